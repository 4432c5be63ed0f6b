//! GPU catalog. Memory is what NVML reports as the card's total
//! (e.g. 81920 MiB for an A100 80GB), not the marketing GB.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::CatalogError;

/// A GPU model (catalog entry, or live values read from NVML which win).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GpuSpec {
    /// Name as NVML / nvidia-smi print it, e.g. `NVIDIA A100-SXM4-80GB`.
    pub name: String,
    /// Total memory in bytes as NVML reports it.
    pub memory_bytes: u64,
    /// CUDA compute capability, e.g. "8.0" (AMD: gfx arch, e.g. "gfx90a").
    pub compute_capability: String,
    pub bf16: bool,
    pub fp8: bool,
    /// Dense bf16/fp16 tensor TFLOP/s (datasheet), for ranking candidates by speed.
    pub bf16_tflops: f64,
}

/// Looks a GPU up by NVML/nvidia-smi name, case- and punctuation-tolerant.
/// An unknown name is an error listing close matches, never a guess.
pub fn lookup_gpu(name: &str) -> Result<GpuSpec, CatalogError> {
    Err(CatalogError::UnknownGpu {
        name: name.to_string(),
        suggestions: vec![],
    })
}

/// Every GPU in the catalog.
pub fn all_gpus() -> Vec<GpuSpec> {
    Vec::new()
}
