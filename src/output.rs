//! Output for people and scripts: aligned tables, JSON, and gRPC errors turned into one
//! readable sentence.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

/// Prints rows under headers, columns aligned; nothing but the headers for no rows.
pub fn table(headers: &[&str], rows: &[Vec<String>]) {
    let mut width: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for r in rows {
        debug_assert_eq!(r.len(), headers.len(), "a row must have a cell per column");
        for (i, c) in r.iter().enumerate().take(width.len()) {
            width[i] = width[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<w$}  ", w = width.get(i).copied().unwrap_or(0)));
            }
        }
        println!("{}", s.trim_end());
    };
    line(headers.to_vec());
    for r in rows {
        line(r.iter().map(String::as_str).collect());
    }
}

pub fn json<T: Serialize>(v: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

/// A refused or failed call as a sentence for the operator.
pub fn status_error(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{}", locus::ops::status_sentence(&s))
}

pub trait StatusExt<T> {
    /// Converts a gRPC error into an operator-facing error.
    fn or_status(self) -> anyhow::Result<T>;
}

impl<T> StatusExt<T> for Result<tonic::Response<T>, tonic::Status> {
    fn or_status(self) -> anyhow::Result<T> {
        self.map(tonic::Response::into_inner).map_err(status_error)
    }
}

pub fn time(ms: i64) -> String {
    if ms == 0 {
        "-".into()
    } else {
        locus_proto::human::format_time_ms(ms)
    }
}

pub fn size(b: u64) -> String {
    locus_proto::human::format_size(b)
}

/// Prints progress: a line redrawn four times a second on a terminal, a plain line every
/// ten seconds into a log or pipe. Either says so when nothing has moved for a while, so a
/// stalled node or source shows as a stall and not as a silent command.
pub struct Progress {
    label: &'static str,
    pub done: Arc<AtomicU64>,
    start: Instant,
    task: Option<tokio::task::JoinHandle<()>>,
    terminal: bool,
}

/// After this long without a byte, the progress line says the work is stalled.
const STALLED: Duration = Duration::from_secs(5);

impl Progress {
    pub fn new(label: &'static str, total: u64) -> Self {
        use std::io::IsTerminal;
        let done = Arc::new(AtomicU64::new(0));
        let start = Instant::now();
        let terminal = std::io::stderr().is_terminal();
        let d = done.clone();
        let task = tokio::spawn(async move {
            // Looked at four times a second either way, so that the time of the last
            // move is known to that much even when a log gets a line every ten seconds.
            let every = Duration::from_millis(if terminal { 250 } else { 10_000 });
            let (mut last, mut moved, mut printed) = (0, Instant::now(), Instant::now());
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let n = d.load(Ordering::Relaxed);
                if n != last {
                    (last, moved) = (n, Instant::now());
                }
                if printed.elapsed() < every {
                    continue;
                }
                printed = Instant::now();
                let rate = n as f64 / start.elapsed().as_secs_f64().max(0.001);
                // An object-store source's total is not known before it is listed.
                let of = if total == 0 {
                    String::new()
                } else {
                    format!(" / {}", size(total))
                };
                let stalled = match moved.elapsed() {
                    t if t >= STALLED => format!(
                        "; nothing moved for {}s (a node or the source is not answering?)",
                        t.as_secs()
                    ),
                    _ => String::new(),
                };
                let line = format!("{label} {}{of} ({}/s){stalled}", size(n), size(rate as u64));
                if terminal {
                    eprint!("\r\x1b[K{line}");
                } else {
                    eprintln!("{line}");
                }
            }
        });
        Progress {
            label,
            done,
            start,
            task: Some(task),
            terminal,
        }
    }

    pub fn finish(mut self) -> Duration {
        if let Some(t) = self.task.take() {
            t.abort();
        }
        let took = self.start.elapsed();
        // A log got progress lines only if the work lasted; then it gets the end too.
        if self.terminal || took >= Duration::from_secs(10) {
            eprintln!(
                "{}{} {} in {:.1}s",
                if self.terminal { "\r\x1b[K" } else { "" },
                self.label,
                size(self.done.load(Ordering::Relaxed)),
                took.as_secs_f64()
            );
        }
        self.start.elapsed()
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        // A phase that failed is never finished: its line stops with it.
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

/// Shows each phase of long library work (`locus::ops`) as a progress line on a terminal.
#[derive(Default)]
pub struct TermObserver {
    phases: std::sync::Mutex<std::collections::HashMap<&'static str, Progress>>,
}

impl locus::ops::Observer for TermObserver {
    fn start(&self, phase: &'static str, total: u64) -> Arc<AtomicU64> {
        let p = Progress::new(phase, total);
        let done = p.done.clone();
        self.phases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(phase, p);
        done
    }

    fn end(&self, phase: &'static str) {
        let p = self
            .phases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(phase);
        if let Some(p) = p {
            p.finish();
        }
    }
}
