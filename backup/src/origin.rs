//! A version's origin — where its bytes were imported from — as the last source of the
//! mount and the cache nodes: when no live node (or backup) can serve a chunk or a blob,
//! the same range is read from the origin and used only if it hashes to the manifest's
//! hash (the source may have changed since the import; then the read fails rather than
//! return other bytes).
//!
//! Origins are `file:///abs/dir` (percent-encoded where the path has `%` or whitespace)
//! and object-store URLs (`s3://`, `gs://`, `az://`, opened by `locus_backup::url`).
//! Versions whose origin is `cluster` have none.

use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt};

pub enum Origin {
    Dir(PathBuf),
    Store {
        url: String,
        store: Arc<dyn ObjectStore>,
        prefix: String,
    },
}

/// `%`, space, tab, CR and LF as %XX, so any local path fits an origin URL.
pub fn encode_path(p: &str) -> String {
    let mut out = String::with_capacity(p.len());
    for c in p.chars() {
        match c {
            '%' | ' ' | '\t' | '\r' | '\n' => out.push_str(&format!("%{:02X}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

fn decode_path(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

impl Origin {
    /// None for versions without an origin ("cluster").
    pub fn parse(url: &str) -> Result<Option<Origin>, String> {
        if url.is_empty() || url == "cluster" {
            return Ok(None);
        }
        if let Some(p) = url.strip_prefix("file://") {
            let p = decode_path(p).ok_or_else(|| format!("{url}: bad percent-encoding"))?;
            return Ok(Some(Origin::Dir(PathBuf::from(p))));
        }
        let o = crate::url::open(url, false).map_err(|e| e.to_string())?;
        Ok(Some(Origin::Store {
            url: url.to_string(),
            store: o.store,
            prefix: o.prefix,
        }))
    }

    /// Refuses to read `rel` of a local-directory origin unless the file, symlinks
    /// resolved, lies under one of `roots` (a cache node reads only the directories its
    /// operator named: its own privileges must not read whatever a caller's origin URL
    /// points at, `/etc` or `/proc/self`). Object-store origins are not affected.
    pub fn check_within(&self, rel: &str, roots: &[PathBuf]) -> Result<(), String> {
        let Origin::Dir(root) = self else {
            return Ok(());
        };
        let file = root.join(rel);
        let real = std::fs::canonicalize(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        let inside = roots.iter().any(|r| {
            std::fs::canonicalize(r)
                .map(|r| real.starts_with(r))
                .unwrap_or(false)
        });
        if inside {
            return Ok(());
        }
        Err(if roots.is_empty() {
            format!(
                "{}: this node reads no local directories (a file:// origin); give the node \
                 --origin-root DIR for the directories it may import or repair from",
                root.display()
            )
        } else {
            format!(
                "{}: not under this node's --origin-root directories ({})",
                root.display(),
                roots
                    .iter()
                    .map(|r| r.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
    }

    pub fn describe(&self) -> String {
        match self {
            Origin::Dir(p) => format!("file://{}", p.display()),
            Origin::Store { url, .. } => url.clone(),
        }
    }

    /// The whole file at `rel` (a validated relative path), as it streams in: pieces of
    /// any size, in order. A local file is read on a blocking thread in 8 MiB pieces,
    /// at most two ahead of the consumer.
    pub async fn stream(
        &self,
        rel: &str,
    ) -> Result<futures_util::stream::BoxStream<'static, Result<Bytes, String>>, String> {
        use futures_util::StreamExt;
        match self {
            Origin::Dir(root) => {
                let path = root.join(rel);
                let f = std::fs::File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
                let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, String>>(2);
                tokio::task::spawn_blocking(move || {
                    use std::io::Read;
                    let mut f = f;
                    loop {
                        let mut buf = vec![0u8; 8 << 20];
                        let mut got = 0;
                        while got < buf.len() {
                            match f.read(&mut buf[got..]) {
                                Ok(0) => break,
                                Ok(n) => got += n,
                                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                                Err(e) => {
                                    let _ = tx.blocking_send(Err(format!("{}: {e}", path.display())));
                                    return;
                                }
                            }
                        }
                        if got == 0 {
                            return;
                        }
                        buf.truncate(got);
                        if tx.blocking_send(Ok(Bytes::from(buf))).is_err() {
                            return;
                        }
                    }
                });
                Ok(tokio_stream_of(rx).boxed())
            }
            Origin::Store { store, prefix, url } => {
                let key = if prefix.is_empty() {
                    rel.to_string()
                } else {
                    format!("{prefix}/{rel}")
                };
                let path = ObjPath::parse(key.as_str()).map_err(|e| format!("{url}/{rel}: {e}"))?;
                let r = store.get(&path).await.map_err(|e| format!("{url}/{rel}: {e}"))?;
                let what = format!("{url}/{rel}");
                Ok(r.into_stream()
                    .map(move |p| p.map_err(|e| format!("{what}: {e}")))
                    .boxed())
            }
        }
    }

    /// `[offset, offset + len)` of the entry at `rel` (a validated relative path).
    pub async fn read(&self, rel: &str, offset: u64, len: u64) -> Result<Bytes, String> {
        match self {
            Origin::Dir(root) => {
                let path = root.join(rel);
                tokio::task::spawn_blocking(move || {
                    use std::os::unix::fs::FileExt;
                    let f = std::fs::File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
                    let mut buf = vec![0u8; len as usize];
                    let mut got = 0;
                    while got < buf.len() {
                        match f.read_at(&mut buf[got..], offset + got as u64) {
                            Ok(0) => {
                                return Err(format!("{}: shorter than the manifest says", path.display()))
                            }
                            Ok(n) => got += n,
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                            Err(e) => return Err(format!("{}: {e}", path.display())),
                        }
                    }
                    Ok(Bytes::from(buf))
                })
                .await
                .map_err(|e| e.to_string())?
            }
            Origin::Store {
                store, prefix, url, ..
            } => {
                let key = if prefix.is_empty() {
                    rel.to_string()
                } else {
                    format!("{prefix}/{rel}")
                };
                // The key as the import listed it: raw UTF-8 (`Path::from` would
                // percent-encode a name like `ünï` into a key that does not exist).
                let path = ObjPath::parse(key.as_str()).map_err(|e| format!("{url}/{rel}: {e}"))?;
                store
                    .get_range(&path, offset..offset + len)
                    .await
                    .map_err(|e| format!("{url}/{rel}: {e}"))
            }
        }
    }
}

/// A receiver as a stream (what tokio-stream's wrapper does, without the dependency).
fn tokio_stream_of<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures_util::Stream<Item = T> {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_round_trip_through_the_url() {
        for p in ["/data/imagenet", "/a b/c%d\te"] {
            let url = format!("file://{}", encode_path(p));
            assert!(!url.contains(' '));
            match Origin::parse(&url).unwrap().unwrap() {
                Origin::Dir(d) => assert_eq!(d, PathBuf::from(p)),
                _ => panic!("not a dir"),
            }
        }
        assert!(Origin::parse("cluster").unwrap().is_none());
        assert!(matches!(
            Origin::parse("gs://x/y"),
            Ok(Some(Origin::Store { .. }))
        ));
        assert!(Origin::parse("ftp://x/y").is_err());
    }
}
