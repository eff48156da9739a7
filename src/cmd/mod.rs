//! One module per subcommand family.

pub mod audit;
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

/// Raises the open-file limit for a daemon (`locus_proto::net::raise_open_file_limit`).
pub fn raise_open_file_limit() {
    if !locus_proto::net::raise_open_file_limit() {
        tracing::debug!("cannot raise the open-file limit");
    }
}
