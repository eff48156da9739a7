//! The grant keys: the Ed25519 keys the service signs grants with and nodes check them
//! against, and their rotation.
//!
//! A key ring, oldest first. The newest key whose `signs_from` has come signs; a key
//! published ahead of that (`next`) already verifies, so every node learns it (heartbeat
//! answers carry the keys) before it sees a grant signed with it; a key a newer one
//! replaced keeps verifying until the longest grant it may have signed has expired, then
//! drops out. A revoked key (one that leaked) verifies nothing from the moment it is
//! revoked. The ring lives where the service's state lives: beside a single service's
//! store (`DATA_DIR/grant-keys.json`, mode 0600, never in a catalogue export), or in a
//! group's own replicated state (the `raft` table, never exported), so every member signs
//! with the same key and a grant survives a failover.
//!
//! This module must never hand out private key bytes except to the store it came from.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use locus_proto::grant::{GrantBody, GrantKey, MAX_TTL};
use locus_proto::pb;
use serde::{Deserialize, Serialize};

/// How long a newly rotated key is published before it signs, by default.
pub const DEFAULT_PUBLISH_DELAY: Duration = Duration::from_secs(60);
/// Retired keys verify this long past their retirement: the longest grant, plus the clock
/// skew nodes tolerate.
const VERIFY_AFTER_RETIRED: Duration = Duration::from_secs(MAX_TTL.as_secs() + 300);

#[derive(Debug, thiserror::Error)]
pub enum KeyRingError {
    #[error("grant keys {place}: {reason}")]
    Store { place: String, reason: String },
    #[error("grant keys {place} are damaged: {reason}")]
    Damaged { place: String, reason: String },
    #[error("{0}")]
    Invalid(String),
}

#[derive(Clone, Serialize, Deserialize)]
struct Entry {
    /// PKCS#8 v2 DER, hex.
    pkcs8: String,
    created_ms: u64,
    signs_from_ms: u64,
    #[serde(default)]
    revoked_ms: u64,
}

#[derive(Clone, Default, Serialize, Deserialize)]
struct RingFile {
    format: u32,
    keys: Vec<Entry>,
}

/// The parsed ring.
pub struct KeyRing {
    entries: Vec<(Entry, GrantKey)>,
}

impl std::fmt::Debug for KeyRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Public halves only.
        let keys: Vec<_> = self.entries.iter().map(|(_, k)| k).collect();
        f.debug_struct("KeyRing").field("keys", &keys).finish()
    }
}

impl KeyRing {
    /// A ring of one new key that signs at once.
    pub fn fresh(now_ms: u64) -> Result<Self, KeyRingError> {
        let mut r = KeyRing { entries: vec![] };
        r.add(now_ms, now_ms, None)?;
        Ok(r)
    }

    /// A ring holding a key made before rings existed (a single service's `grant.key`, a
    /// group's `grant_key`): it signs from the start, so grants it signed stay valid.
    pub fn from_legacy(pkcs8: &[u8], now_ms: u64) -> Result<Self, KeyRingError> {
        let key = GrantKey::from_pkcs8(pkcs8).map_err(KeyRingError::Invalid)?;
        Ok(KeyRing {
            entries: vec![(
                Entry {
                    pkcs8: locus_proto::hex::encode(pkcs8),
                    created_ms: now_ms,
                    signs_from_ms: 0,
                    revoked_ms: 0,
                },
                key,
            )],
        })
    }

    pub fn decode(bytes: &[u8], place: &str) -> Result<Self, KeyRingError> {
        let damaged = |reason: String| KeyRingError::Damaged {
            place: place.to_string(),
            reason,
        };
        let f: RingFile = serde_json::from_slice(bytes).map_err(|e| damaged(e.to_string()))?;
        if f.format != 1 {
            return Err(damaged(format!("format {} (this build reads 1)", f.format)));
        }
        if f.keys.is_empty() {
            return Err(damaged("no keys".into()));
        }
        let mut entries = Vec::with_capacity(f.keys.len());
        for e in f.keys {
            let der = locus_proto::hex::decode(&e.pkcs8).ok_or_else(|| damaged("a key is not hex".into()))?;
            let k = GrantKey::from_pkcs8(&der).map_err(damaged)?;
            entries.push((e, k));
        }
        Ok(KeyRing { entries })
    }

    pub fn encode(&self) -> Vec<u8> {
        let f = RingFile {
            format: 1,
            keys: self.entries.iter().map(|(e, _)| e.clone()).collect(),
        };
        serde_json::to_vec_pretty(&f).expect("a key ring serialises")
    }

    fn add(&mut self, now_ms: u64, signs_from_ms: u64, revoke: Option<u64>) -> Result<(), KeyRingError> {
        let der = GrantKey::generate_pkcs8().map_err(KeyRingError::Invalid)?;
        let key = GrantKey::from_pkcs8(&der).map_err(KeyRingError::Invalid)?;
        if let Some(at) = revoke {
            for (e, _) in &mut self.entries {
                if e.revoked_ms == 0 {
                    e.revoked_ms = at;
                }
            }
        }
        self.entries.push((
            Entry {
                pkcs8: locus_proto::hex::encode(&der),
                created_ms: now_ms,
                signs_from_ms,
                revoked_ms: 0,
            },
            key,
        ));
        Ok(())
    }

    /// Rotation: a new key, signing `delay` from now (at once when revoking: the old
    /// keys are then worthless and nothing may be signed with them).
    pub fn rotated(&self, now_ms: u64, delay: Duration, revoke: bool) -> Result<KeyRing, KeyRingError> {
        let mut r = KeyRing::decode(&self.encode(), "being rotated")?;
        let from = if revoke {
            now_ms
        } else {
            now_ms + delay.as_millis() as u64
        };
        r.add(now_ms, from, revoke.then_some(now_ms))?;
        r.prune(now_ms);
        Ok(r)
    }

    /// When key `i` stopped signing: the `signs_from` of the next key that signs after it.
    fn retired_ms(&self, i: usize) -> Option<u64> {
        self.entries[i + 1..].iter().map(|(e, _)| e.signs_from_ms).min()
    }

    fn state(&self, i: usize, now_ms: u64) -> &'static str {
        let e = &self.entries[i].0;
        if e.revoked_ms != 0 && e.revoked_ms <= now_ms {
            return "revoked";
        }
        if e.signs_from_ms > now_ms {
            return "next";
        }
        match self.retired_ms(i) {
            Some(r) if r <= now_ms => {
                if now_ms < r + VERIFY_AFTER_RETIRED.as_millis() as u64 {
                    "verifying"
                } else {
                    "expired"
                }
            }
            _ => "signing",
        }
    }

    /// Drops keys that verify nothing any more (revoked or long retired), keeping the
    /// signer.
    fn prune(&mut self, now_ms: u64) {
        let keep: Vec<bool> = (0..self.entries.len())
            .map(|i| !matches!(self.state(i, now_ms), "revoked" | "expired"))
            .collect();
        let mut i = 0;
        self.entries.retain(|_| {
            i += 1;
            keep[i - 1]
        });
    }

    /// When the key that signs now was made (Unix ms): how old the signing key is.
    pub fn signer_created_ms(&self, now_ms: u64) -> u64 {
        (0..self.entries.len())
            .rev()
            .find(|&i| self.state(i, now_ms) == "signing")
            .or(self.entries.len().checked_sub(1))
            .map_or(0, |i| self.entries[i].0.created_ms)
    }

    /// The key that signs now.
    pub fn signer(&self, now_ms: u64) -> &GrantKey {
        (0..self.entries.len())
            .rev()
            .find(|&i| self.state(i, now_ms) == "signing")
            .map(|i| &self.entries[i].1)
            // A ring always has a signer unless every key was revoked, which rotation
            // never leaves (the new key is not revoked) — but be total: the newest.
            .unwrap_or(&self.entries.last().expect("a ring is never empty").1)
    }

    /// Public keys nodes must accept now: the signer, keys published next, and retired
    /// keys whose grants may still be valid.
    pub fn verifying(&self, now_ms: u64) -> Vec<Vec<u8>> {
        (0..self.entries.len())
            .filter(|&i| matches!(self.state(i, now_ms), "signing" | "next" | "verifying"))
            .map(|i| self.entries[i].1.public().to_vec())
            .collect()
    }

    pub fn describe(&self, now_ms: u64) -> Vec<pb::GrantKey> {
        (0..self.entries.len())
            .map(|i| {
                let (e, k) = &self.entries[i];
                pb::GrantKey {
                    public_key: k.public().to_vec(),
                    created_unix_ms: e.created_ms,
                    signs_from_unix_ms: e.signs_from_ms,
                    retired_unix_ms: self.retired_ms(i).unwrap_or(0),
                    state: self.state(i, now_ms).into(),
                }
            })
            .collect()
    }
}

/// Where the ring is kept.
pub trait RingStore: Send + Sync {
    /// The ring's bytes, if one was stored.
    fn load(&self) -> Result<Option<Vec<u8>>, KeyRingError>;
    /// Stores new bytes (durably; in a group, committed by a quorum). Blocking.
    fn store(&self, bytes: Vec<u8>) -> Result<(), KeyRingError>;
    fn place(&self) -> String;
}

/// A single service's ring: `DATA_DIR/grant-keys.json`, written tmp → fsync → rename.
#[derive(Debug)]
pub struct FileRing {
    path: PathBuf,
}

impl FileRing {
    /// Opens the ring in `data_dir`, making it at first start; a `grant.key` from before
    /// rings existed becomes its first key, so grants it signed stay valid.
    pub fn open(data_dir: &Path) -> Result<(Self, KeyRing), KeyRingError> {
        let me = FileRing {
            path: data_dir.join("grant-keys.json"),
        };
        let now = locus_proto::grant::now_ms();
        if let Some(b) = me.load()? {
            let ring = KeyRing::decode(&b, &me.place())?;
            return Ok((me, ring));
        }
        let legacy = data_dir.join("grant.key");
        let ring = if legacy.exists() {
            let k = locus_proto::keyfile::read_pkcs8(&legacy).map_err(|reason| KeyRingError::Store {
                place: legacy.display().to_string(),
                reason,
            })?;
            KeyRing::from_legacy(&k, now)?
        } else {
            KeyRing::fresh(now)?
        };
        me.store(ring.encode())?;
        Ok((me, ring))
    }
}

impl RingStore for FileRing {
    fn load(&self) -> Result<Option<Vec<u8>>, KeyRingError> {
        let fail = |reason: String| KeyRingError::Store {
            place: self.place(),
            reason,
        };
        match std::fs::metadata(&self.path) {
            Ok(m) => {
                use std::os::unix::fs::PermissionsExt;
                if m.permissions().mode() & 0o077 != 0 {
                    return Err(fail(format!(
                        "holds private keys but other users may read it (mode {:o}): chmod 600 {}",
                        m.permissions().mode() & 0o777,
                        self.path.display()
                    )));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(fail(e.to_string())),
        }
        std::fs::read(&self.path)
            .map(Some)
            .map_err(|e| fail(e.to_string()))
    }

    fn store(&self, bytes: Vec<u8>) -> Result<(), KeyRingError> {
        locus_proto::keyfile::write_private(&self.path, &bytes).map_err(|reason| KeyRingError::Store {
            place: self.place(),
            reason,
        })
    }

    fn place(&self) -> String {
        self.path.display().to_string()
    }
}

/// The grant keys a service signs with: the ring, re-read from its store when it
/// changed (a rotation on this or, in a group, another member).
pub struct GrantKeys {
    store: Arc<dyn RingStore>,
    /// The stored bytes last parsed, the ring they hold, and when the store was last read.
    cache: Mutex<(Vec<u8>, Arc<KeyRing>, Option<std::time::Instant>)>,
}

/// How long a ring read from the store is used before the store is read again. Every
/// heartbeat and grant asks for the ring: reading the store each time was 6% of the
/// service's CPU at 10,000 nodes. A rotation here updates the ring at once, and rotations
/// and listings read the store afresh; a rotation made on another group member is seen
/// here within this delay — shorter than nodes take to hear of it (their heartbeat
/// interval), and a new key is published a while before it signs.
const RING_RECHECK: Duration = Duration::from_secs(1);

impl std::fmt::Debug for GrantKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GrantKeys({})", self.store.place())
    }
}

impl GrantKeys {
    pub fn new(store: Arc<dyn RingStore>, ring: KeyRing) -> Self {
        GrantKeys {
            store,
            cache: Mutex::new((ring.encode(), Arc::new(ring), Some(std::time::Instant::now()))),
        }
    }

    /// The current ring. A store that cannot be read keeps the last ring in use (with a
    /// warning) rather than stopping every grant.
    pub fn ring(&self) -> Arc<KeyRing> {
        self.ring_within(RING_RECHECK)
    }

    /// The ring as stored now (for a rotation, which must build on the latest one, and
    /// for listing keys to an operator).
    pub fn fresh_ring(&self) -> Arc<KeyRing> {
        self.ring_within(Duration::ZERO)
    }

    fn ring_within(&self, max_age: Duration) -> Arc<KeyRing> {
        let mut c = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if c.2.is_some_and(|t| t.elapsed() < max_age) {
            return c.1.clone();
        }
        c.2 = Some(std::time::Instant::now());
        match self.store.load() {
            Ok(Some(b)) if b != c.0 => match KeyRing::decode(&b, &self.store.place()) {
                Ok(r) => (c.0, c.1) = (b, Arc::new(r)),
                Err(e) => tracing::warn!("{e}; signing with the keys read before"),
            },
            Ok(_) => {}
            Err(e) => tracing::warn!("{e}; signing with the keys read before"),
        }
        c.1.clone()
    }

    pub fn sign(&self, body: &GrantBody) -> String {
        self.ring().signer(locus_proto::grant::now_ms()).sign(body)
    }

    /// What nodes must accept now.
    pub fn verifying(&self) -> Vec<Vec<u8>> {
        self.ring().verifying(locus_proto::grant::now_ms())
    }

    /// Rotates the ring and stores it. Blocking (a group commits it through the log).
    pub fn rotate(&self, delay: Duration, revoke: bool) -> Result<Arc<KeyRing>, KeyRingError> {
        let now = locus_proto::grant::now_ms();
        let next = Arc::new(self.fresh_ring().rotated(now, delay, revoke)?);
        let bytes = next.encode();
        self.store.store(bytes.clone())?;
        *self.cache.lock().unwrap_or_else(|p| p.into_inner()) =
            (bytes, next.clone(), Some(std::time::Instant::now()));
        Ok(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body() -> GrantBody {
        GrantBody {
            cluster_id: "c".into(),
            node: "n1".into(),
            operation: "read".into(),
            ..Default::default()
        }
    }

    fn verifies(keys: &[Vec<u8>], token: &str) -> bool {
        let v = locus_proto::grant::Verifier::new("n1");
        v.set("c", keys.to_vec());
        v.verify(token.as_bytes(), "ReadBlob", 1).is_ok()
    }

    fn signed(ring: &KeyRing, now: u64) -> String {
        let mut b = body();
        b.expires_unix_ms = u64::MAX;
        ring.signer(now).sign(&b)
    }

    #[test]
    fn a_rotated_key_is_published_before_it_signs_and_the_old_one_verifies_until_its_grants_expire() {
        let t0 = 1_000_000_000;
        let ring = KeyRing::fresh(t0).unwrap();
        let old = signed(&ring, t0);
        let r2 = ring.rotated(t0, Duration::from_secs(60), false).unwrap();
        // Published at once, signing only after the delay.
        assert_eq!(r2.verifying(t0).len(), 2);
        assert_eq!(
            signed(&r2, t0 + 1000),
            old,
            "the old key still signs until the delay"
        );
        let new = signed(&r2, t0 + 61_000);
        assert_ne!(new, old);
        assert!(
            verifies(&r2.verifying(t0), &new),
            "nodes accept the next key before it signs"
        );
        // After the switch, grants of the old key hold until they can have expired.
        let later = t0 + 61_000 + MAX_TTL.as_millis() as u64;
        assert!(verifies(&r2.verifying(later), &old));
        let much_later = later + VERIFY_AFTER_RETIRED.as_millis() as u64;
        assert!(!verifies(&r2.verifying(much_later), &old));
        assert!(verifies(&r2.verifying(much_later), &new));
        // The states say so, and the ring survives its encoding.
        let states: Vec<_> = r2.describe(t0 + 1000).into_iter().map(|k| k.state).collect();
        assert_eq!(states, ["signing", "next"]);
        let back = KeyRing::decode(&r2.encode(), "test").unwrap();
        assert_eq!(back.verifying(t0), r2.verifying(t0));
        // A later rotation prunes keys that verify nothing.
        let r3 = r2.rotated(much_later, Duration::ZERO, false).unwrap();
        assert_eq!(r3.describe(much_later).len(), 2);
    }

    #[test]
    fn revoking_stops_the_old_keys_at_once_and_signs_with_the_new_one() {
        let t0 = 5_000_000;
        let ring = KeyRing::fresh(t0).unwrap();
        let old = signed(&ring, t0);
        let r2 = ring.rotated(t0 + 10, Duration::from_secs(60), true).unwrap();
        assert!(!verifies(&r2.verifying(t0 + 10), &old));
        let new = signed(&r2, t0 + 10);
        assert!(verifies(&r2.verifying(t0 + 10), &new));
        assert_eq!(r2.verifying(t0 + 10).len(), 1);
    }

    #[test]
    fn a_damaged_or_foreign_ring_is_refused_with_its_place() {
        for junk in [&b"{}"[..], b"not json", br#"{"format":2,"keys":[]}"#] {
            let e = KeyRing::decode(junk, "/x/grant-keys.json")
                .unwrap_err()
                .to_string();
            assert!(e.contains("/x/grant-keys.json") && e.contains("damaged"), "{e}");
        }
    }

    #[test]
    fn a_single_services_ring_adopts_its_old_key_and_is_private() {
        let d = tempfile::tempdir().unwrap();
        let old = GrantKey::load_or_create(&d.path().join("grant.key")).unwrap();
        let (_store, ring) = FileRing::open(d.path()).unwrap();
        assert_eq!(ring.signer(locus_proto::grant::now_ms()).public(), old.public());
        use std::os::unix::fs::PermissionsExt;
        let p = d.path().join("grant-keys.json");
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = FileRing::open(d.path()).unwrap_err().to_string();
        assert!(e.contains("chmod 600"), "{e}");
    }
}
