//! The GPU source interface: what the sidecar needs from the hardware, with
//! one real implementation (NVML) and two stand-ins (a declared inventory,
//! a deterministic simulation) — the dcgm-exporter shape (docs/design.md, "Measuring peaks").

use super::attribution::JobKey;

// The wire types live in `crate::wire` (one definition for server and clients).
pub use crate::wire::sidecar::{Backend, GpuInfo, MigSlice, SliceRef};

/// One process's use of one GPU at one sampling instant.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessObservation {
    /// Host PID. Used for attribution only, never exported as a label.
    pub pid: u32,
    /// GPU index.
    pub gpu: u32,
    /// The MIG slice of GPU `gpu` it runs on (a slice is its own device:
    /// its memory and peaks are the slice's, not the card's); None on a whole GPU.
    pub mig: Option<SliceRef>,
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
