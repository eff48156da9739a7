//! The audit log: one JSON line per admin action (import sessions, commits, deletions,
//! grants), node registration and refused call, with who, what, when and the result.
//! Append-only; never rewritten by the service. Refused calls are written at most
//! `REFUSED_PER_SECOND` a second — anyone who can connect can cause them — with a line
//! counting those left out.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;

use crate::auth::Principal;

pub struct AuditLog {
    file: Mutex<File>,
    refusals: locus_proto::auth::Throttle,
    mounts: locus_proto::auth::Throttle,
}

pub const REFUSED_PER_SECOND: u32 = 50;
/// Mount starts and ends written a second at most: a thousand hosts mounting at a job's
/// start are written over a few seconds' worth of lines, a flood (any reader can cause
/// one) is counted instead of filling the disk.
pub const MOUNTS_PER_SECOND: u32 = 200;

impl AuditLog {
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Self {
            file: Mutex::new(file),
            refusals: locus_proto::auth::Throttle::new(REFUSED_PER_SECOND, std::time::Duration::from_secs(1)),
            mounts: locus_proto::auth::Throttle::new(MOUNTS_PER_SECOND, std::time::Duration::from_secs(1)),
        })
    }

    /// Whether a line of a throttled kind may be written now; when it may after some were
    /// left out, a line counting those (`KIND.not-written`) is written first.
    fn admit(&self, refusals: bool) -> bool {
        let (throttle, kind, result, what, per_second) = match refusals {
            true => (
                &self.refusals,
                "refused",
                "refused",
                "refused calls",
                REFUSED_PER_SECOND,
            ),
            false => (
                &self.mounts,
                "mount",
                "ok",
                "mount starts and ends",
                MOUNTS_PER_SECOND,
            ),
        };
        let Some(dropped) = throttle.admit() else {
            return false;
        };
        if dropped > 0 {
            self.write(serde_json::json!({
                "time": locus_proto::human::format_time_ms(crate::SystemClock.now_ms()),
                "action": format!("{kind}.not-written"),
                "result": result,
                "count": dropped,
                "detail": format!("{dropped} {what} not written (over {per_second} a second)"),
            }));
        }
        true
    }

    /// Records a call the auth layer refused, unless too many were this second.
    pub fn refused(&self, r: &locus_proto::auth::Refused<'_>) {
        if !self.admit(true) {
            return;
        }
        // Who it was is in the message when the token was valid (denied); otherwise no
        // one the service knows.
        self.write(serde_json::json!({
            "time": locus_proto::human::format_time_ms(crate::SystemClock.now_ms()),
            "action": "refused",
            "target": r.path,
            "result": "refused",
            "reason": r.reason,
            "detail": r.message,
        }));
    }

    /// Records a mount's start or end (`mount.start`, `mount.end`: who, `DATASET@N`,
    /// `HOST:MOUNTPOINT`), at most MOUNTS_PER_SECOND a second, counting the rest.
    pub fn mount(&self, who: &Principal, action: &str, target: &str, place: String) {
        if self.admit(false) {
            self.record(who, action, target, Ok(place));
        }
    }

    /// Records a call a token's dataset scope refused (throttled with the auth layer's
    /// refusals: a scoped caller can cause them at will).
    pub fn scope_refused(&self, who: &Principal, action: &str, target: &str) {
        if !self.admit(true) {
            return;
        }
        self.write(serde_json::json!({
            "time": locus_proto::human::format_time_ms(crate::SystemClock.now_ms()),
            "who": who.name,
            "role": who.role_name(),
            "action": action,
            "target": target,
            "result": "refused",
            "reason": "scope",
            "detail": who.scope.as_ref().map(|s| format!("scope {}", s.describe())).unwrap_or_default(),
        }));
    }

    fn write(&self, line: serde_json::Value) {
        let mut f = self.file.lock().unwrap_or_else(|p| p.into_inner());
        // An audit line that cannot be written is an operator problem, not a reason to
        // fail the action that already happened; say so loudly.
        if let Err(e) = writeln!(f, "{line}") {
            tracing::error!("cannot write the audit log: {e}");
        }
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
        self.write(line);
    }
}

use crate::Clock;
