//! The GPU source interface: what the sidecar needs from the hardware, with
//! one real implementation (NVML) and two stand-ins (a declared inventory,
//! a deterministic simulation) — the dcgm-exporter shape (docs/design.md, "Measuring peaks").

use serde::{Deserialize, Serialize};

use super::attribution::JobKey;

/// Which implementation reads the GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// NVIDIA Management Library: the real one.
    Nvml,
    /// GPUs declared by hand in a YAML/TOML file; no per-job data.
    Inventory,
    /// Deterministic synthetic GPUs; processes registered over HTTP.
    Simulate,
}

impl Backend {
    /// The name used on the command line and in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Nvml => "nvml",
            Backend::Inventory => "inventory",
            Backend::Simulate => "simulate",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One GPU as the source sees it at one sampling instant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// Device index as NVML / nvidia-smi number it (not CUDA_VISIBLE_DEVICES order).
    pub index: u32,
    /// `GPU-…` UUID.
    pub uuid: String,
    /// Model name as NVML prints it, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    pub memory_total_bytes: u64,
    pub memory_used_bytes: u64,
    pub memory_free_bytes: u64,
    /// CUDA compute capability, e.g. "9.0"; None when unknown.
    pub compute_capability: Option<String>,
    /// Fraction of the last sample period a kernel was running (0–1); None when unknown.
    pub utilization_ratio: Option<f64>,
    /// Whether MIG mode is on; None when unsupported or unknown.
    pub mig_enabled: Option<bool>,
    /// Whether NVML's accounting mode is on (exact per-process peaks); None when unknown.
    pub accounting_enabled: Option<bool>,
    /// False when reading the device failed at the last sample.
    pub healthy: bool,
    /// What failed, when unhealthy.
    pub error: Option<String>,
}

/// One process's use of one GPU at one sampling instant.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessObservation {
    /// Host PID. Used for attribution only, never exported as a label.
    pub pid: u32,
    /// GPU index.
    pub gpu: u32,
    /// GPU memory the process holds now (0 once it has ended).
    pub used_bytes: u64,
    /// The process's exact maximum from NVML accounting, when accounting is on.
    pub max_bytes: Option<u64>,
    /// False for a final report about a process that has just ended.
    pub running: bool,
    /// The job it belongs to, when the source already knows (simulate);
    /// otherwise filled in by [`super::attribution::Attributor`].
    pub job: Option<JobKey>,
}

/// Everything one sample returns.
#[derive(Debug, Clone, Default)]
pub struct SourceSample {
    pub gpus: Vec<GpuInfo>,
    pub processes: Vec<ProcessObservation>,
}

/// A GPU reader. A sample never fails as a whole: a device that cannot be
/// read is reported with `healthy: false` and the others are still read.
pub trait GpuSource: Send + Sync {
    /// Which backend this is.
    fn backend(&self) -> Backend;
    /// Reads every GPU and its compute processes now.
    fn sample(&self) -> SourceSample;
    /// Whether this source can see processes (inventory cannot).
    fn sees_processes(&self) -> bool {
        true
    }
}
