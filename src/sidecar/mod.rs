//! The node sidecar: reads GPUs (NVML, a declared inventory, or a simulated
//! backend), attributes processes to pods / Slurm jobs, keeps per-job peak
//! memory, and serves HTTP + Prometheus metrics.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum SidecarError {
    #[error("{0}")]
    Nvml(String),
    #[error("{0}")]
    Other(String),
}
