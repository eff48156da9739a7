//! A data dir's setup: the format marker that says which layout it holds (and refuses a
//! directory Locus did not create, or a later format), and the modes that keep its blobs
//! private to the node and the readers' group.

use std::fs::{self, File};
use std::path::Path;

use super::{StoreError, FORMAT_FILE, FORMAT_VERSION};

pub(super) fn set_mode(p: &Path, mode: u32) -> Result<(), StoreError> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(p, fs::Permissions::from_mode(mode)).map_err(|e| StoreError::DataDir {
        path: p.display().to_string(),
        reason: format!("cannot set its mode to {mode:o}: {e}"),
    })
}

/// Makes a data dir private to the node's user and the readers' group (see the module
/// rules). Files below keep their modes; what guards them is that no one else can pass
/// through the directory.
pub(super) fn restrict(d: &Path, readers_gid: Option<u32>) -> Result<(), StoreError> {
    let open = if readers_gid.is_some() { 0o750 } else { 0o700 };
    for (p, mode) in [
        (d.to_path_buf(), open),
        (d.join("blobs"), open),
        (d.join("partial"), open),
        (d.join(super::pack::PACKS), open),
        (d.join("tmp"), 0o700),
        (d.join("outboards"), 0o700),
        (d.join("quarantine"), 0o700),
    ] {
        if let (Some(gid), true) = (readers_gid, mode == 0o750) {
            std::os::unix::fs::chown(&p, None, Some(gid)).map_err(|e| StoreError::DataDir {
                path: p.display().to_string(),
                reason: format!("cannot give it group {gid} (the local socket's): {e}"),
            })?;
        }
        set_mode(&p, mode)?;
    }
    Ok(())
}

pub(super) fn check_format(d: &Path) -> Result<(), StoreError> {
    let err = |reason: String| StoreError::DataDir {
        path: d.display().to_string(),
        reason,
    };
    fs::create_dir_all(d).map_err(|e| err(e.to_string()))?;
    let f = d.join(FORMAT_FILE);
    match fs::read_to_string(&f) {
        Ok(s) => {
            let v = s
                .trim()
                .strip_prefix("locus-blobstore ")
                .and_then(|v| v.parse::<u32>().ok());
            match v {
                Some(FORMAT_VERSION) => Ok(()),
                // Formats 1 and 2 are format 3 without packs and without compact records:
                // nothing to convert, only the mark (which keeps older builds out).
                Some(old @ (1 | 2)) => {
                    write_format(d, &f).map_err(|e| err(e.to_string()))?;
                    tracing::info!(
                        dir = %d.display(),
                        "blob store format {old} marked {FORMAT_VERSION} (packs, compact records)"
                    );
                    Ok(())
                }
                Some(other) => Err(err(format!(
                    "blob store format {other}; this build reads formats 1 to {FORMAT_VERSION}"
                ))),
                None => Err(err(format!("{FORMAT_FILE} is not a Locus format marker"))),
            }
        }
        Err(_) => {
            let empty = fs::read_dir(d).map(|mut r| r.next().is_none()).unwrap_or(false);
            if !empty {
                return Err(err(format!(
                    "not empty and has no {FORMAT_FILE}; refusing to use a directory Locus did not create"
                )));
            }
            write_format(d, &f).map_err(|e| err(e.to_string()))
        }
    }
}

/// Writes this build's format marker (`f`, in data dir `d`) whole or not at all.
fn write_format(d: &Path, f: &Path) -> std::io::Result<()> {
    let tmp = d.join(format!("{FORMAT_FILE}.tmp"));
    fs::write(&tmp, format!("locus-blobstore {FORMAT_VERSION}\n"))?;
    File::open(&tmp)?.sync_all()?;
    fs::rename(&tmp, f)?;
    File::open(d)?.sync_all()
}
