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
