//! One suggestion from a wire request: resolve the workload and GPU, then
//! the one pipeline ([`super::pipeline`]). Shared by `POST /v1/suggest` and the
//! Slurm TaskProlog without a controller.

use crate::core::advisor::{AdvisorError, Strategy, StrategyTargets, Suggestion};
use crate::core::catalog::{lookup_gpu, lookup_model, GpuSpec};
use crate::core::request::{ModelRequest, WorkloadError, WorkloadRequest};
use crate::core::workload::Workload;
use crate::history::{HistoryError, HistoryStore};
use crate::wire::api::{GpuRef, JsonNames, SuggestRequest, WorkloadSpec};

use super::pipeline::{Ask, Pipeline, PipelineError};

/// Why a suggestion request got no suggestion. The messages name the
/// request field at fault; the HTTP API maps the kinds to statuses.
#[derive(Debug, thiserror::Error)]
pub enum SuggestError {
    /// The workload does not resolve; the message names the JSON field
    /// (`workload.lora_rank: …`).
    #[error("{}", .0.render(&JsonNames))]
    Workload(#[source] WorkloadError),
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

/// A wire workload as a request for the core's one resolver.
pub fn request_from_wire(spec: &WorkloadSpec) -> Result<WorkloadRequest, WorkloadError> {
    // An empty `model` is an unset one when the numbers give the model.
    let named = !(spec.model.trim().is_empty() && spec.architecture.is_some());
    Ok(WorkloadRequest {
        model: ModelRequest::one_of(named.then(|| spec.model.clone()), spec.architecture.clone())?,
        method: spec.method,
        lora_rank: spec.lora_rank,
        lora_targets: spec.lora_targets.clone(),
        seq_len: Some(spec.seq_len),
        optimizer: spec.optimizer,
        global_batch: spec.global_batch,
        gpus: spec.gpus,
        sharding: spec.sharding,
        framework: spec.framework,
        attention: spec.attention,
    })
}

/// Resolves a wire workload with the core's one resolver (docs/design.md,
/// "Workload resolution"): the same defaults as `gpufit suggest`, the CRD
/// and the webhook.
pub fn resolve_workload(spec: &WorkloadSpec) -> Result<Workload, SuggestError> {
    request_from_wire(spec)
        .and_then(|r| r.resolve())
        .map_err(SuggestError::Workload)
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

/// The whole suggestion: resolve, then [`Pipeline::suggest`].
/// Blocking (reads the history): async callers use `spawn_blocking`.
pub fn suggest_blocking(
    history: &dyn HistoryStore,
    targets: StrategyTargets,
    req: &SuggestRequest,
) -> Result<Suggestion, SuggestError> {
    let workload = resolve_workload(&req.workload)?;
    let gpu = resolve_gpu(&req.gpu)?;
    let ask = Ask {
        workload: &workload,
        gpu: &gpu,
        strategy: req.strategy.unwrap_or(Strategy::Balanced),
        pins: &req.pins,
    };
    Pipeline::new(targets)
        .with_cpus_per_gpu(req.cpus_per_gpu)
        .suggest(history, &ask)
        .map_err(|e| match e {
            PipelineError::History(e) => SuggestError::History(e),
            PipelineError::Advisor(e @ AdvisorError::DoesNotFit { .. }) => {
                SuggestError::DoesNotFit(e)
            }
            PipelineError::Advisor(e) => SuggestError::Advisor(e),
        })
}
