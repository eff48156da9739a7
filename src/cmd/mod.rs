//! One module per subcommand family.

pub mod backup;
pub mod csi;
pub mod dataset;
pub mod demo;
pub mod doctor;
pub mod import;
pub mod locality;
pub mod metadata;
pub mod mount;
pub mod node;
pub mod slurm;
pub mod status;
pub mod tls;
pub mod webhook;

/// Resolves when the process is asked to stop (SIGTERM or SIGINT).
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("cannot watch SIGTERM: {e}; stop with Ctrl-C");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
    }
}

/// Raises this process's soft open-file limit to its hard limit (as far as it is
/// allowed). The usual soft limit of 1,024 is too few for a daemon: the metadata service
/// holds a connection per node (thousands), a node one per peer and reader, a mount a
/// descriptor per recently verified local file.
#[allow(unsafe_code)]
pub fn raise_open_file_limit() {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the rlimit struct we pass, which
    // lives on this stack frame for the duration of both calls.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &r) != 0 {
                tracing::debug!("cannot raise the open-file limit");
            }
        }
    }
}
