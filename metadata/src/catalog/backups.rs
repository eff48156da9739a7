//! The catalogue's side of backups: the consistent export, and the record of runs and restore sources.

use super::*;

impl Catalog {
    /// Writes the catalogue as of one instant in the backup catalog format.
    pub fn export(&self, out: &mut dyn std::io::Write) -> Result<crate::snapshot::ExportStats> {
        crate::snapshot::export(self.store.as_ref(), out).map_err(|e| match e {
            crate::snapshot::SnapshotError::Store(s) => CatalogError::Store(s),
            e => CatalogError::Precondition(e.to_string()),
        })
    }

    /// Remembers a committed backup (URL → snapshot id, when) as a source of last resort.
    /// An empty `snapshot` says a run to `url` begins: the target is recorded (so nodes
    /// accept uploads to it) without touching what a committed run recorded there.
    /// `restored`: the cluster restored a version from `url` — it becomes a source, and a
    /// record of a committed backup there is left as it is (the last backup is not newer
    /// for a restore).
    pub fn record_backup(&self, url: &str, snapshot: &str, restored: bool) -> Result<()> {
        let existing = self.store.get(Table::Backups, url.as_bytes())?;
        if (snapshot.is_empty() || restored) && existing.is_some() {
            return Ok(());
        }
        let rec = BackupRecord {
            snapshot: snapshot.to_string(),
            recorded_at_ms: self.clock.now_ms(),
            restored,
        };
        let mut b = Batch::default();
        b.put(Table::Backups, url.as_bytes(), rec.encode_to_vec());
        self.store.write(b, true)?;
        Ok(())
    }

    /// Every recorded backup target with its last snapshot.
    pub fn list_backups(&self) -> Result<Vec<(String, BackupRecord)>> {
        let mut out = Vec::new();
        for kv in self.store.scan(Table::Backups, b"", None) {
            let (k, v) = kv?;
            out.push((
                String::from_utf8_lossy(&k).into_owned(),
                decode(Table::Backups, &v)?,
            ));
        }
        Ok(out)
    }

    /// Backup targets that blobs can be read back from, in URL order.
    pub fn backup_sources(&self) -> Result<Vec<String>> {
        let mut out = Vec::new();
        for kv in self.store.scan(Table::Backups, b"", None) {
            let (k, _) = kv?;
            out.push(String::from_utf8_lossy(&k).into_owned());
        }
        Ok(out)
    }
}
