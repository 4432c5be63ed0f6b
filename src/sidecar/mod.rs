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

/// The first local GPU as NVML sees it (live values win over the catalog);
/// used by `gpufit suggest --gpu auto`. A clear error when there is none.
pub fn local_gpu() -> Result<crate::core::catalog::GpuSpec, SidecarError> {
    Err(SidecarError::Nvml("NVML is not wired in yet".into()))
}
