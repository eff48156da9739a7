//! Ed25519 private keys in files (PKCS#8 v2, mode 0600): the metadata service's grant
//! key and the operator's backup signing key. A key file others may read is refused, and
//! an existing one is never overwritten.

use std::path::Path;

use aws_lc_rs::signature::Ed25519KeyPair;

/// Reads the key at `path`; the error says what is wrong and how to fix it.
pub fn read_ed25519(path: &Path) -> Result<Ed25519KeyPair, String> {
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
    let der = std::fs::read(path).map_err(|e| e.to_string())?;
    Ed25519KeyPair::from_pkcs8(&der).map_err(|e| format!("not an Ed25519 PKCS#8 key ({e})"))
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
