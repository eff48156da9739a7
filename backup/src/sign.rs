//! Signed snapshots: whoever can write the bucket must not be able to rewrite a
//! catalogue so that a restore maps datasets to blobs of their choosing.
//!
//! A backup run holding the operator's Ed25519 key (`locus backup keygen`) signs the
//! snapshot's manifest — which carries the catalogue's size and BLAKE3, so the catalogue
//! is covered too, and the catalogue names every blob by hash — and stores
//! `snapshots/<id>/SIGNATURE` before COMMITTED. Restore and verify check it against the
//! public keys they trust, and refuse an unsigned snapshot or one signed by anyone else
//! unless told `--allow-unsigned`.
//!
//! What is signed is the manifest as this code serialises it (`serde_json::to_vec` of
//! the parsed struct), so a re-encoding of the same values verifies and any change of a
//! value does not. Keys: PKCS#8 v2 private key file (mode 0600); public keys as 64 hex
//! digits. Ed25519 through aws-lc-rs, the crypto library the object-store client already
//! links.

use std::path::Path;

use aws_lc_rs::signature::{Ed25519KeyPair, KeyPair, UnparsedPublicKey, ED25519};
use serde::{Deserialize, Serialize};

use crate::format::SnapshotManifest;
use crate::{BackupError, Target};

type Result<T, E = BackupError> = std::result::Result<T, E>;

/// `snapshots/<id>/SIGNATURE`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Signature {
    /// "ed25519".
    pub alg: String,
    /// The signer's public key, hex.
    pub key: String,
    /// The signature over the manifest, hex.
    pub sig: String,
}

/// An operator's signing key, read from its PKCS#8 file.
pub struct SigningKey(Ed25519KeyPair);

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The public half only, ever.
        write!(f, "SigningKey({})", self.public_hex())
    }
}

impl SigningKey {
    pub fn load(path: &Path) -> Result<Self> {
        locus_proto::keyfile::read_ed25519(path)
            .map(SigningKey)
            .map_err(|why| BackupError::Invalid(format!("signing key {}: {why}", path.display())))
    }

    /// Creates a new key at `path` (mode 0600; an existing file is never overwritten)
    /// and returns its public key, hex.
    pub fn generate(path: &Path) -> Result<String> {
        let bad = |why: String| BackupError::Invalid(format!("{}: {why}", path.display()));
        if !locus_proto::keyfile::create_ed25519(path).map_err(bad)? {
            return Err(bad("exists already; a key is never overwritten".into()));
        }
        Ok(SigningKey::load(path)?.public_hex())
    }

    pub fn public_hex(&self) -> String {
        locus_proto::hex::encode(self.0.public_key().as_ref())
    }

    pub fn sign(&self, m: &SnapshotManifest) -> Signature {
        Signature {
            alg: "ed25519".into(),
            key: self.public_hex(),
            sig: locus_proto::hex::encode(self.0.sign(&signed_bytes(m)).as_ref()),
        }
    }
}

/// Which snapshots restore and verify accept.
#[derive(Debug, Clone, Default)]
pub struct Trust {
    /// Public keys, hex.
    pub keys: Vec<String>,
    /// Accept unsigned snapshots and signatures by unknown keys (said loudly).
    pub allow_unsigned: bool,
}

/// What the check found, for reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum Checked {
    /// Signed by this trusted key.
    Trusted(String),
    /// Not checked: unsigned or signed by an unknown key, accepted by `--allow-unsigned`.
    Unchecked(String),
}

impl Trust {
    /// Parses public keys given as hex or as files holding the hex.
    pub fn from_args(keys: &[String], allow_unsigned: bool) -> Result<Trust> {
        let mut out = Vec::new();
        for k in keys {
            let hexed = if is_public_key(k) {
                k.clone()
            } else {
                std::fs::read_to_string(k)
                    .map_err(|e| BackupError::Invalid(format!("--trust-key {k}: {e}")))?
                    .trim()
                    .to_string()
            };
            if !is_public_key(&hexed) {
                return Err(BackupError::Invalid(format!(
                    "--trust-key {k}: not an Ed25519 public key (64 hex digits)"
                )));
            }
            out.push(hexed.to_ascii_lowercase());
        }
        Ok(Trust {
            keys: out,
            allow_unsigned,
        })
    }

    /// Checks snapshot `id`'s signature over `m`, and that `m` is the manifest of the
    /// snapshot it was read from: a signed manifest copied under another (newer) id is
    /// refused, signed or not, so an old snapshot cannot pass for the newest.
    pub async fn check(&self, t: &Target, id: &str, m: &SnapshotManifest) -> Result<Checked> {
        let key = t.snapshot_key(id, "SIGNATURE");
        let sig = t.get_json_opt::<Signature>(&key).await.map_err(|e| e.to_string());
        self.judge(id, m, sig)
    }

    /// The decision of `check`, on a signature already read (None: there is none; Err:
    /// it could not be read or parsed). Pure, so it can be fuzzed.
    pub fn judge(
        &self,
        id: &str,
        m: &SnapshotManifest,
        sig: std::result::Result<Option<Signature>, String>,
    ) -> Result<Checked> {
        if m.id != id {
            return Err(BackupError::Invalid(format!(
                "snapshot {id}: its manifest is snapshot {:?}'s (copied or moved under another \
                 id); refusing it",
                m.id
            )));
        }
        let refuse = |why: String| {
            BackupError::Invalid(format!(
                "snapshot {id}: {why}; refusing it (give --trust-key with the operator's public \
                 key, or --allow-unsigned to use it anyway)"
            ))
        };
        let sig = match sig {
            Ok(Some(s)) => s,
            Ok(None) if self.allow_unsigned => return Ok(Checked::Unchecked("unsigned".into())),
            Ok(None) => return Err(refuse("it is not signed".into())),
            Err(e) => return Err(refuse(format!("its signature cannot be read: {e}"))),
        };
        let trusted = self.keys.iter().any(|k| k.eq_ignore_ascii_case(&sig.key));
        if !trusted {
            if self.allow_unsigned {
                return Ok(Checked::Unchecked(format!(
                    "signed by an untrusted key {}",
                    sig.key
                )));
            }
            return Err(refuse(format!(
                "it is signed by {}, which is not a trusted key",
                sig.key
            )));
        }
        let (Some(pk), Some(s)) = (
            locus_proto::hex::decode(&sig.key),
            locus_proto::hex::decode(&sig.sig),
        ) else {
            return Err(refuse("its signature is malformed".into()));
        };
        if sig.alg != "ed25519"
            || UnparsedPublicKey::new(&ED25519, pk)
                .verify(&signed_bytes(m), &s)
                .is_err()
        {
            // Never accepted, not even with --allow-unsigned: a trusted key's signature
            // that does not match means the manifest was changed after it was signed.
            return Err(BackupError::Invalid(format!(
                "snapshot {id}: its manifest does not match its signature by trusted key {}: \
                 it was changed after it was signed; refusing it",
                sig.key
            )));
        }
        Ok(Checked::Trusted(sig.key))
    }
}

fn signed_bytes(m: &SnapshotManifest) -> Vec<u8> {
    let mut b = b"locus snapshot manifest v1\n".to_vec();
    b.extend(serde_json::to_vec(m).expect("a manifest serialises"));
    b
}

fn is_public_key(s: &str) -> bool {
    s.len() == 64 && s.chars().all(|c| c.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest() -> SnapshotManifest {
        SnapshotManifest {
            format: 1,
            id: "s1".into(),
            cluster_id: "c".into(),
            created_ms: 5,
            datasets: vec![],
            blobs: 3,
            blob_bytes: 300,
            catalog_bytes: 10,
            catalog_blake3: "ab".repeat(32),
        }
    }

    #[tokio::test]
    async fn a_signed_manifest_verifies_and_any_change_or_stranger_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let key_path = d.path().join("k");
        let public = SigningKey::generate(&key_path).unwrap();
        assert!(SigningKey::generate(&key_path).is_err(), "never overwrites a key");
        let key = SigningKey::load(&key_path).unwrap();
        let t = Target::open(&format!("file://{}", d.path().join("t").display())).unwrap();
        let m = manifest();
        t.put_json(&t.snapshot_key("s1", "SIGNATURE"), &key.sign(&m))
            .await
            .unwrap();
        let trust = Trust::from_args(std::slice::from_ref(&public), false).unwrap();
        assert_eq!(
            trust.check(&t, "s1", &m).await.unwrap(),
            Checked::Trusted(public.clone())
        );
        // The catalogue's hash changed (a poisoned catalogue): refused, even when unsigned
        // snapshots are allowed.
        let mut poisoned = m.clone();
        poisoned.catalog_blake3 = "cd".repeat(32);
        for allow in [false, true] {
            let trust = Trust::from_args(std::slice::from_ref(&public), allow).unwrap();
            let e = trust.check(&t, "s1", &poisoned).await.unwrap_err().to_string();
            assert!(e.contains("changed after it was signed"), "{e}");
        }
        // Another key, or none at all.
        let stranger = Trust::from_args(&["00".repeat(32)], false).unwrap();
        let e = stranger.check(&t, "s1", &m).await.unwrap_err().to_string();
        assert!(e.contains("not a trusted key"), "{e}");
        let mut m2 = m.clone();
        m2.id = "s2".into();
        let e = trust.check(&t, "s2", &m2).await.unwrap_err().to_string();
        assert!(e.contains("not signed"), "{e}");
        let lax = Trust::from_args(&[], true).unwrap();
        assert!(matches!(
            lax.check(&t, "s2", &m2).await.unwrap(),
            Checked::Unchecked(_)
        ));
        // A signed manifest under another snapshot's directory: refused, whatever trust.
        t.put_json(&t.snapshot_key("s9", "SIGNATURE"), &key.sign(&m))
            .await
            .unwrap();
        for tr in [&trust, &lax] {
            let e = tr.check(&t, "s9", &m).await.unwrap_err().to_string();
            assert!(e.contains("copied or moved under another id"), "{e}");
        }
        // A key file others can read is refused.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(SigningKey::load(&key_path).is_err());
    }
}
