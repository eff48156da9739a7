//! Blobs in a backup target: uploads checked against their name before they become
//! visible, existence checks, verified reads.

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use locus_proto::manifest::BlobHash;
use object_store::{ObjectStoreExt, PutPayload, WriteMultipart};

use crate::{BackupError, Result, Target};

/// Blobs up to this size go up in one PUT; larger ones as a multipart upload of parts
/// this big (S3 wants parts of at least 5 MiB).
pub const PART_SIZE: usize = 8 << 20;
/// Parts of one blob in flight at once.
const PARTS_IN_FLIGHT: usize = 4;

/// Whether the target holds `h` with the expected size (one HEAD request).
pub async fn exists(t: &Target, h: &BlobHash, size: u64) -> Result<bool> {
    let key = t.blob_key(h);
    match t.store.head(&key).await {
        Ok(m) => Ok(m.size == size),
        Err(object_store::Error::NotFound { .. }) => Ok(false),
        Err(e) => Err(BackupError::store(
            format!("cannot check {}", t.describe(&key)),
            e,
        )),
    }
}

/// Uploads blob `h` of `size` bytes from `data`. Every byte handed to the store is
/// hashed; the upload is completed only if what was sent hashes to `h` and has the
/// expected length, and is aborted otherwise, so a target never holds a blob under a
/// name its content does not have.
pub async fn upload<S, E>(t: &Target, h: &BlobHash, size: u64, data: S) -> Result<()>
where
    S: Stream<Item = std::result::Result<Bytes, E>>,
    E: std::fmt::Display,
{
    upload_to(t, &t.blob_key(h), h, size, data).await
}

/// Like `upload`, to any key: used for snapshot objects whose hash is known beforehand.
pub async fn upload_to<S, E>(
    t: &Target,
    key: &object_store::path::Path,
    h: &BlobHash,
    size: u64,
    data: S,
) -> Result<()>
where
    S: Stream<Item = std::result::Result<Bytes, E>>,
    E: std::fmt::Display,
{
    let key = key.clone();
    let what = || format!("upload of {h} to {}", t.describe(&key));
    let mut data = std::pin::pin!(data);
    let mut hasher = blake3::Hasher::new();
    let mut sent = 0u64;
    let check = |hasher: &blake3::Hasher, sent: u64| -> Result<()> {
        if sent != size {
            return Err(BackupError::Corrupt(format!(
                "{}: read {sent} bytes, the blob has {size}",
                what()
            )));
        }
        if hasher.finalize().as_bytes() != &h.0 {
            return Err(BackupError::Corrupt(format!(
                "{}: the bytes read do not hash to the blob's name",
                what()
            )));
        }
        Ok(())
    };
    if size as usize <= PART_SIZE {
        let mut buf = Vec::with_capacity(size as usize);
        while let Some(piece) = data.next().await {
            let piece = piece.map_err(|e| BackupError::Invalid(format!("{}: {e}", what())))?;
            hasher.update(&piece);
            sent += piece.len() as u64;
            buf.extend_from_slice(&piece);
        }
        check(&hasher, sent)?;
        t.store
            .put(&key, PutPayload::from(Bytes::from(buf)))
            .await
            .map_err(|e| BackupError::store(what(), e))?;
        return Ok(());
    }
    let upload = t
        .store
        .put_multipart(&key)
        .await
        .map_err(|e| BackupError::store(what(), e))?;
    let mut w = WriteMultipart::new_with_chunk_size(upload, PART_SIZE);
    let mut failed = None;
    while let Some(piece) = data.next().await {
        let piece = match piece {
            Ok(p) => p,
            Err(e) => {
                failed = Some(BackupError::Invalid(format!("{}: {e}", what())));
                break;
            }
        };
        hasher.update(&piece);
        sent += piece.len() as u64;
        if let Err(e) = w.wait_for_capacity(PARTS_IN_FLIGHT).await {
            failed = Some(BackupError::store(what(), e));
            break;
        }
        w.put(piece);
    }
    let failed = failed.or_else(|| check(&hasher, sent).err());
    if let Some(e) = failed {
        // Best effort: an abandoned multipart upload is invisible either way.
        let _ = w.abort().await;
        return Err(e);
    }
    w.finish().await.map_err(|e| BackupError::store(what(), e))?;
    Ok(())
}

/// Streams blob `h` from the target, unverified (callers hash what they keep).
pub async fn read(
    t: &Target,
    h: &BlobHash,
) -> Result<impl Stream<Item = std::result::Result<Bytes, object_store::Error>> + use<>> {
    let key = t.blob_key(h);
    let r = t
        .store
        .get(&key)
        .await
        .map_err(|e| BackupError::store(format!("cannot read {}", t.describe(&key)), e))?;
    Ok(r.into_stream())
}

/// `[offset, offset + len)` of blob `h`, unverified.
pub async fn read_range(t: &Target, h: &BlobHash, offset: u64, len: u64) -> Result<Bytes> {
    let key = t.blob_key(h);
    t.store
        .get_range(&key, offset..offset + len)
        .await
        .map_err(|e| BackupError::store(format!("cannot read {}", t.describe(&key)), e))
}

/// Streams any object into `out` (if given) while hashing it: (bytes, BLAKE3). Large
/// objects (a snapshot's catalogue) are never held in memory.
/// Reads an object whole, hashing it, into `out` if given; stops with an error at more
/// than `max` bytes (what the manifest says it is: a bigger object is not it, and must
/// not fill the disk on its way to being refused).
pub async fn download(
    t: &Target,
    key: &object_store::path::Path,
    mut out: Option<&mut std::fs::File>,
    max: u64,
) -> Result<(u64, BlobHash)> {
    use std::io::Write;
    let what = || format!("cannot read {}", t.describe(key));
    let r = t
        .store
        .get(key)
        .await
        .map_err(|e| BackupError::store(what(), e))?;
    let mut s = std::pin::pin!(r.into_stream());
    let mut hasher = blake3::Hasher::new();
    let mut n = 0u64;
    while let Some(piece) = s.next().await {
        let piece = piece.map_err(|e| BackupError::store(what(), e))?;
        hasher.update(&piece);
        n += piece.len() as u64;
        if n > max {
            return Err(BackupError::Corrupt(format!(
                "{} is larger than the {max} bytes expected",
                t.describe(key)
            )));
        }
        if let Some(f) = out.as_deref_mut() {
            f.write_all(&piece).map_err(|e| {
                BackupError::Invalid(format!("writing a local copy of {}: {e}", t.describe(key)))
            })?;
        }
    }
    Ok((n, BlobHash(*hasher.finalize().as_bytes())))
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Check {
    Ok,
    Missing,
    Corrupt(String),
}

/// Re-reads blob `h` and hashes it.
pub async fn verify(t: &Target, h: &BlobHash, size: u64) -> Result<Check> {
    let mut s = match read(t, h).await {
        Ok(s) => std::pin::pin!(s),
        Err(e) if e.is_not_found() => return Ok(Check::Missing),
        Err(e) => return Err(e),
    };
    let mut hasher = blake3::Hasher::new();
    let mut n = 0u64;
    while let Some(piece) = s.next().await {
        let piece = piece.map_err(|e| BackupError::store(format!("reading blob {h}"), e))?;
        n += piece.len() as u64;
        hasher.update(&piece);
    }
    if n != size {
        return Ok(Check::Corrupt(format!("{n} bytes stored, {size} expected")));
    }
    if hasher.finalize().as_bytes() != &h.0 {
        return Ok(Check::Corrupt("content does not hash to its name".into()));
    }
    Ok(Check::Ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(data: Vec<u8>, piece: usize) -> impl Stream<Item = std::result::Result<Bytes, String>> {
        let pieces: Vec<_> = data
            .chunks(piece)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        futures_util::stream::iter(pieces)
    }

    #[tokio::test]
    async fn uploads_are_checked_before_they_are_visible() {
        let d = tempfile::tempdir().unwrap();
        let t = Target::open(&format!("file://{}", d.path().display())).unwrap();
        for size in [0usize, 1000, PART_SIZE + 12_345] {
            let data: Vec<u8> = (0..size).map(|i| (i * 7 % 251) as u8).collect();
            let h = BlobHash::of(&data);
            assert!(!exists(&t, &h, size as u64).await.unwrap());
            // Wrong bytes under this name: refused, nothing visible.
            let mut wrong = data.clone();
            wrong.push(1);
            let e = upload(&t, &h, size as u64, stream(wrong, 1 << 20))
                .await
                .unwrap_err();
            assert!(e.to_string().contains("blob"), "{e}");
            assert!(!exists(&t, &h, size as u64).await.unwrap());
            upload(&t, &h, size as u64, stream(data.clone(), 1 << 20))
                .await
                .unwrap();
            assert!(exists(&t, &h, size as u64).await.unwrap());
            assert_eq!(verify(&t, &h, size as u64).await.unwrap(), Check::Ok);
        }
        let data = vec![5u8; 100];
        let h = BlobHash::of(&data);
        assert_eq!(verify(&t, &h, 100).await.unwrap(), Check::Missing);
        upload(&t, &h, 100, stream(data, 10)).await.unwrap();
        let path = d.path().join(t.blob_key(&h).as_ref());
        std::fs::write(&path, vec![6u8; 100]).unwrap();
        assert!(matches!(verify(&t, &h, 100).await.unwrap(), Check::Corrupt(_)));
    }
}
