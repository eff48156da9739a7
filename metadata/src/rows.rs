//! A catalogue row from outside — a backup's export, on its way into a restored store —
//! checked like the API input it once was: every key decodes to the names and numbers
//! its table is keyed by, every value to its record, and every name, path, hash, label
//! and address passes the same validation the service applies to requests
//! (`locus_proto` domain types). A signature says who wrote a snapshot, not that its
//! writer validated it: a snapshot restored with `--allow-unsigned`, or written by a
//! build with a bug, must not put a path with `..`, a short hash or a malformed node
//! into a catalogue that mounts and nodes then trust.

use locus_proto::{pb, DatasetName, NodeId};
use prost::Message;

use crate::keys;
use crate::records::{BackupRecord, DatasetRecord, EntryRecord, NodeRecord, ShardRecord, VersionRecord};
use crate::store::Table;

/// Checks one exported row; the reason names what is wrong, not the row's bytes.
pub fn check_row(t: Table, k: &[u8], v: &[u8]) -> Result<(), String> {
    match t {
        // A group's own state is never exported, so a backup carrying it was not made here.
        Table::Raft => Err("a metadata group's own state does not belong in a backup".into()),
        Table::Meta => match k {
            keys::META_CLUSTER_ID => {
                let ok = !v.is_empty() && v.len() <= 64 && v.iter().all(u8::is_ascii_alphanumeric);
                ok.then_some(())
                    .ok_or_else(|| "cluster id is not 1-64 letters and digits".into())
            }
            keys::META_SCHEMA => (v.len() == 4 || v.len() == 8)
                .then_some(())
                .ok_or_else(|| "schema version is not a number".into()),
            keys::META_NEXT_UID => keys::u64_value(v)
                .map(drop)
                .ok_or_else(|| "next uid is not a number".into()),
            _ => Err("unknown meta key".into()),
        },
        Table::Nodes => {
            node_id(k)?;
            let r = decode::<NodeRecord>(v)?;
            if r.address.is_empty() || r.address.len() > 255 || r.address.contains(char::is_whitespace) {
                return Err("node address is not HOST:PORT".into());
            }
            for (lk, lv) in &r.labels {
                locus_proto::names::check_label(lk, lv).map_err(|e| e.reason)?;
            }
            Ok(())
        }
        Table::Datasets => {
            dataset(k)?;
            decode::<DatasetRecord>(v).map(drop)
        }
        Table::Versions => {
            let nul = k
                .len()
                .checked_sub(9)
                .filter(|i| k[*i] == 0)
                .ok_or("malformed version key")?;
            dataset(&k[..nul])?;
            let r = decode::<VersionRecord>(v)?;
            if !r.chunk_size.is_power_of_two()
                || !(locus_proto::MIN_CHUNK_SIZE..=locus_proto::MAX_CHUNK_SIZE).contains(&r.chunk_size)
            {
                return Err(format!("chunk size {} is not one Locus writes", r.chunk_size));
            }
            if r.origin.len() > 4096 || r.origin.chars().any(char::is_control) {
                return Err("origin is not a URL".into());
            }
            Ok(())
        }
        Table::Entries => {
            let (dir, name) = keys::split_entry(k).ok_or("malformed entry key")?;
            let r = decode::<EntryRecord>(v)?;
            if !r.chunks.len().is_multiple_of(32) {
                return Err("chunk hashes are not whole hashes".into());
            }
            let chunks = r.chunk_hashes();
            let e = pb::Entry {
                path: keys::join(dir, name),
                kind: r.kind as i32,
                size: r.size,
                mode: r.mode,
                mtime_ns: r.mtime_ns,
                blob: r.blob,
                chunks,
                symlink_target: r.target,
                shard: r.shard,
            };
            locus_proto::Entry::try_from(e)
                .map(drop)
                .map_err(|e| e.to_string())
        }
        Table::Shards => {
            fixed(k, 12, "shard key")?;
            let r = decode::<ShardRecord>(v)?;
            r.replicas.iter().try_for_each(|n| node_id(n.as_bytes()))
        }
        Table::NodeShards => {
            let nul = k
                .len()
                .checked_sub(13)
                .filter(|i| k[*i] == 0)
                .ok_or("malformed node-shard key")?;
            node_id(&k[..nul])
        }
        Table::Resident => {
            node_id(k.get(8..).ok_or("malformed resident key")?)?;
            keys::u64_value(v)
                .map(drop)
                .ok_or_else(|| "resident bytes are not a number".into())
        }
        Table::ShardBlobs => keys::shard_blobs_row(k, v)
            .map(drop)
            .ok_or_else(|| "malformed shard-blobs row".into()),
        Table::BlobShards => {
            fixed(k, 32 + 12, "blob-shard key")?;
            // Empty in rows of schema version 1.
            if v.is_empty() {
                Ok(())
            } else {
                fixed(v, 12, "blob-shard value")
            }
        }
        Table::Backups => {
            let url = std::str::from_utf8(k).map_err(|_| "backup URL is not UTF-8")?;
            if url.is_empty() || url.len() > 4096 || url.chars().any(char::is_control) {
                return Err("backup URL is not a URL".into());
            }
            decode::<BackupRecord>(v).map(drop)
        }
        // Open import sessions are never exported: one in a snapshot is not ours.
        Table::Sessions => Err("import sessions are not part of a snapshot".into()),
    }
}

fn decode<M: Message + Default>(v: &[u8]) -> Result<M, String> {
    M::decode(v).map_err(|e| format!("record does not decode: {e}"))
}

fn node_id(b: &[u8]) -> Result<(), String> {
    let s = std::str::from_utf8(b).map_err(|_| "node id is not UTF-8")?;
    NodeId::try_from(s)
        .map(drop)
        .map_err(|e| format!("node id: {}", e.reason))
}

fn dataset(b: &[u8]) -> Result<(), String> {
    let s = std::str::from_utf8(b).map_err(|_| "dataset name is not UTF-8")?;
    DatasetName::try_from(s)
        .map(drop)
        .map_err(|e| format!("dataset name: {}", e.reason))
}

fn fixed(b: &[u8], len: usize, what: &str) -> Result<(), String> {
    (b.len() == len)
        .then_some(())
        .ok_or_else(|| format!("{what} is {} bytes, not {len}", b.len()))
}
