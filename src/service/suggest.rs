//! One suggestion from a wire request: resolve the workload and GPU, read
//! the similar runs, ask the advisor. Shared by `POST /v1/suggest` and the
//! Slurm TaskProlog without a controller.

use crate::core::advisor::{
    self, AdviceRequest, AdvisorError, Strategy, StrategyTargets, Suggestion,
};
use crate::core::catalog::{lookup_gpu, lookup_model, GpuSpec};
use crate::core::memory::default_lora_targets;
use crate::core::similarity::HistoryQuery;
use crate::core::workload::{
    Attention, Framework, LoraConfig, Method as TrainMethod, Optimizer, Sharding, Workload,
};
use crate::history::{HistoryError, HistoryStore};
use crate::wire::api::{GpuRef, SuggestRequest, WorkloadSpec};

/// Why a suggestion request got no suggestion. The messages name the
/// request field at fault; the HTTP API maps the kinds to statuses.
#[derive(Debug, thiserror::Error)]
pub enum SuggestError {
    /// `workload.model` is not in the catalog.
    #[error("workload.model: {0}")]
    Model(String),
    /// The resolved workload is inconsistent.
    #[error("workload: {0}")]
    Workload(String),
    /// `gpu` is unknown or has no memory.
    #[error("{0}")]
    Gpu(String),
    /// The history could not be read: a server fault, not the request's.
    #[error("cannot read the history: {0}")]
    History(#[source] HistoryError),
    /// Nothing fits the card: a valid answer about the request.
    #[error("{0}")]
    DoesNotFit(#[source] AdvisorError),
    /// The advisor refused the request (e.g. an impossible global batch).
    #[error("{0}")]
    Advisor(#[source] AdvisorError),
}

/// Canonical model id for a name (catalog id when the catalog knows it),
/// so runs recorded under an alias land on the same history key.
pub fn canonical_model(name: &str) -> String {
    lookup_model(name)
        .map(|m| m.arch.name)
        .unwrap_or_else(|_| name.to_string())
}

/// Resolves a workload spec with the model catalog and validates it.
pub fn resolve_workload(spec: &WorkloadSpec) -> Result<Workload, SuggestError> {
    let mref = lookup_model(&spec.model).map_err(|e| SuggestError::Model(e.to_string()))?;
    let method = spec.method.or(mref.method).unwrap_or(TrainMethod::Full);
    let framework = spec.framework.unwrap_or(Framework::Generic);
    // The same defaults as `gpufit suggest` (WorkloadArgs::resolve): rank 8
    // (PEFT's and torchtune's default) and the framework's default targets.
    let lora = match method {
        TrainMethod::Full => None,
        TrainMethod::Lora | TrainMethod::Qlora => Some(LoraConfig {
            rank: spec.lora_rank.unwrap_or(8),
            targets: spec
                .lora_targets
                .clone()
                .unwrap_or_else(|| default_lora_targets(framework)),
        }),
    };
    let workload = Workload {
        model: mref.arch,
        method,
        lora,
        seq_len: spec.seq_len,
        optimizer: spec.optimizer.unwrap_or(Optimizer::Adamw),
        global_batch: spec.global_batch,
        gpus: spec.gpus.unwrap_or(1),
        sharding: spec.sharding.unwrap_or(Sharding::None),
        framework,
        attention: spec.attention.unwrap_or(Attention::Sdpa),
    };
    workload
        .validate()
        .map_err(|e| SuggestError::Workload(e.to_string()))?;
    Ok(workload)
}

/// Resolves the GPU of a request (catalog name, or a live spec).
pub fn resolve_gpu(gpu: &GpuRef) -> Result<GpuSpec, SuggestError> {
    match gpu {
        GpuRef::Name(n) => lookup_gpu(n).map_err(|e| SuggestError::Gpu(format!("gpu: {e}"))),
        GpuRef::Spec(s) if s.memory_bytes == 0 => Err(SuggestError::Gpu(
            "gpu.memory_bytes must be positive: give the GPU's total memory in bytes".into(),
        )),
        GpuRef::Spec(s) => Ok(s.clone()),
    }
}

/// The whole suggestion: resolve, read similar runs, ask the advisor.
/// Blocking (reads the history): async callers use `spawn_blocking`.
pub fn suggest_blocking(
    history: &dyn HistoryStore,
    targets: StrategyTargets,
    req: &SuggestRequest,
) -> Result<Suggestion, SuggestError> {
    let workload = resolve_workload(&req.workload)?;
    let gpu = resolve_gpu(&req.gpu)?;
    let query = HistoryQuery::new(
        &workload.model.name,
        workload.method,
        &gpu.name,
        workload.seq_len,
    );
    let runs = history.similar(&query).map_err(SuggestError::History)?;
    let advice = AdviceRequest {
        workload: &workload,
        gpu: &gpu,
        strategy: req.strategy.unwrap_or(Strategy::Balanced),
        targets,
        pins: &req.pins,
        history: &runs,
    };
    advisor::suggest(&advice).map_err(|e| match e {
        AdvisorError::DoesNotFit { .. } => SuggestError::DoesNotFit(e),
        other => SuggestError::Advisor(other),
    })
}
