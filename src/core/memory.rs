//! The memory model: workload + engineering settings → predicted peak bytes
//! with a breakdown, plus the fixed part and the per-sample slope
//! (peak ≈ fixed + slope × micro_batch).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::core::settings::EngineeringSettings;
use crate::core::workload::{Workload, WorkloadError};

#[derive(Debug, Error, Clone, PartialEq)]
pub enum MemoryError {
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    #[error("--micro-batch must be a positive number (got 0): use --micro-batch 1 or more")]
    ZeroMicroBatch,
}

/// Bytes per component at the peak of a training step.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Breakdown {
    pub weights: u64,
    pub gradients: u64,
    pub optimizer_state: u64,
    pub master_weights: u64,
    pub activations: u64,
    pub logits: u64,
    pub cuda_context: u64,
    pub allocator_overhead: u64,
}

/// A prediction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Estimate {
    pub micro_batch_size: u32,
    /// The figure compared with the GPU's capacity (= `device_bytes`).
    pub peak_bytes: u64,
    /// Part of the peak that does not depend on the micro batch.
    pub fixed_bytes: u64,
    /// Peak growth per additional sample in the micro batch.
    pub per_sample_bytes: u64,
    /// What `torch.cuda.max_memory_allocated()` reports.
    pub peak_allocated_bytes: u64,
    /// What `torch.cuda.max_memory_reserved()` reports (allocator cache included).
    pub peak_reserved_bytes: u64,
    /// What nvidia-smi shows: reserved plus the CUDA context.
    pub device_bytes: u64,
    pub breakdown: Breakdown,
}

/// Predicts the peak memory of one training step.
pub fn estimate(
    workload: &Workload,
    settings: &EngineeringSettings,
) -> Result<Estimate, MemoryError> {
    workload.validate()?;
    if settings.micro_batch_size == 0 {
        return Err(MemoryError::ZeroMicroBatch);
    }
    Ok(Estimate {
        micro_batch_size: settings.micro_batch_size,
        peak_bytes: 0,
        fixed_bytes: 0,
        per_sample_bytes: 0,
        peak_allocated_bytes: 0,
        peak_reserved_bytes: 0,
        device_bytes: 0,
        breakdown: Breakdown::default(),
    })
}

/// Largest micro batch whose predicted peak is ≤ `budget_bytes`; None when
/// even micro batch 1 does not fit.
pub fn max_micro_batch(
    workload: &Workload,
    settings: &EngineeringSettings,
    budget_bytes: u64,
) -> Result<Option<u32>, MemoryError> {
    let _ = (workload, settings, budget_bytes);
    Ok(None)
}
