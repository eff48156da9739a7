//! Secrets in files: Ed25519 private keys (PKCS#8 v2, mode 0600: the metadata service's
//! grant keys, the operator's backup signing key) and token files. A secret file others
//! may read is refused, saying how to fix it, and an existing key is never overwritten.

use std::path::Path;

use aws_lc_rs::signature::Ed25519KeyPair;

/// Refuses a file that users other than its owner may read or write.
pub fn check_private(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path)
        .map_err(|e| e.to_string())?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        return Err(format!(
            "other users may read it (mode {:o}); run chmod 600 {}",
            mode & 0o777,
            path.display()
        ));
    }
    Ok(())
}

/// A secret kept in a file of its own (a token): the file's text without surrounding
/// whitespace, refused when others may read the file or it is empty.
pub fn read_secret(path: &Path) -> Result<String, String> {
    check_private(path)?;
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let t = text.trim();
    if t.is_empty() {
        return Err("the file is empty".into());
    }
    if t.contains('\n') {
        return Err("the file holds more than one line; it must hold the secret alone".into());
    }
    Ok(t.to_string())
}

/// Reads the key at `path`; the error says what is wrong and how to fix it.
pub fn read_ed25519(path: &Path) -> Result<Ed25519KeyPair, String> {
    let der = read_pkcs8(path)?;
    Ed25519KeyPair::from_pkcs8(&der).map_err(|e| format!("not an Ed25519 PKCS#8 key ({e})"))
}

/// The key file's DER bytes, checked private and an Ed25519 key.
pub fn read_pkcs8(path: &Path) -> Result<Vec<u8>, String> {
    check_private(path)?;
    let der = std::fs::read(path).map_err(|e| e.to_string())?;
    Ed25519KeyPair::from_pkcs8(&der).map_err(|e| format!("not an Ed25519 PKCS#8 key ({e})"))?;
    Ok(der)
}

/// Replaces `path` with `bytes`, mode 0600: a temp file, synced, renamed over it, the
/// directory synced; a crash leaves the old file or the new one, never a torn one.
pub fn write_private(path: &Path, bytes: &[u8]) -> Result<(), String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| format!("{}: {e}", tmp.display()))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| e.to_string())?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    Ok(())
}

/// Writes a new key at `path` (mode 0600, synced). False when a file is there already:
/// it is left as it is (a concurrent first start's key wins).
pub fn create_ed25519(path: &Path) -> Result<bool, String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let rng = aws_lc_rs::rand::SystemRandom::new();
    let doc = Ed25519KeyPair::generate_pkcs8(&rng).map_err(|_| "cannot generate a key".to_string())?;
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        Ok(mut f) => {
            f.write_all(doc.as_ref())
                .and_then(|()| f.sync_all())
                .map_err(|e| e.to_string())?;
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e.to_string()),
    }
}
