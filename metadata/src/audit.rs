//! The audit log: one JSON line per admin action (import sessions, commits, deletions),
//! with who, what, when and the result. Append-only; never rewritten by the service.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;

use crate::auth::Principal;

pub struct AuditLog {
    file: Mutex<File>,
}

impl AuditLog {
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Self {
            file: Mutex::new(file),
        })
    }

    /// Records one action. `result` is `Ok(detail)` or `Err(message)`.
    pub fn record(&self, who: &Principal, action: &str, target: &str, result: Result<String, String>) {
        let now = crate::SystemClock.now_ms();
        let (ok, detail) = match result {
            Ok(d) => (true, d),
            Err(e) => (false, e),
        };
        let line = serde_json::json!({
            "time": locus_proto::human::format_time_ms(now),
            "who": who.name,
            "role": who.role_name(),
            "action": action,
            "target": target,
            "result": if ok { "ok" } else { "error" },
            "detail": detail,
        });
        let mut f = self.file.lock().unwrap_or_else(|p| p.into_inner());
        // An audit line that cannot be written is an operator problem, not a reason to
        // fail the action that already happened; say so loudly.
        if let Err(e) = writeln!(f, "{line}") {
            tracing::error!("cannot write the audit log: {e}");
        }
    }
}

use crate::Clock;
