//! The admission plan: one path from a job's `gpufit.io/` annotations, its
//! namespace and its W to a checked workload, pins, mode, GPU sharing and —
//! given the GPU — the suggestion. Used by the admission webhook (W from
//! the object) and by the Kueue answer (W as admitted), so both decide
//! alike and the namespace's mode label is read in one place.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use crate::core::advisor::{AdvisorError, Strategy, StrategyTargets, Suggestion};
use crate::core::catalog::GpuSpec;
use crate::core::run::{RunRecord, MAX_BATCH};
use crate::core::settings::{EngineeringSettings, Pins};
use crate::core::similarity::HistoryQuery;
use crate::core::workload::{Workload, WorkloadError};
use crate::history::{HistoryError, HistoryStore};
use crate::service::{Ask, Pipeline, PipelineError, SimilarRuns};

use super::crd::Mode;
use super::gpu;
use super::keys::{
    ANN_APPLIED, ANN_FALLBACK, ANN_PEAK_PENDING, ANN_REASON, ANN_RECOMMENDATION, ANN_RECORDED,
    ANN_WORKLOAD, MODE_KEY,
};
use super::validate::check_pins;

pub(crate) mod annotations;

pub(crate) use annotations::{denied, Denied};
pub use annotations::{workload_from_annotations, AnnotationNames};

/// What one job and its namespace say, before the GPU is known.
pub struct PlanInputs<'a> {
    /// The job's annotations (all of them; the `gpufit.io/` ones are read).
    pub annotations: &'a BTreeMap<String, String>,
    /// Its namespace, and that namespace's labels when known.
    pub namespace: Option<(&'a str, Option<&'a BTreeMap<String, String>>)>,
    /// The mode when neither the annotation nor the namespace says.
    pub default_mode: Mode,
    /// W: the data-parallel GPUs the object itself asks for (webhook), or
    /// those Kueue admitted (then `gpufit.io/gpus` is not read: admission
    /// decides W); None when the object does not say (a TrainJob whose
    /// runtime decides).
    pub gpus: Option<u32>,
    /// W comes from Kueue's admission.
    pub admitted: bool,
}

/// The checked plan for one job.
#[derive(Debug, Clone)]
pub struct Plan {
    pub workload: Workload,
    pub strategy: Strategy,
    pub mode: Mode,
    pub pins: Pins,
    /// `gpufit.io/gpu`, when set.
    pub gpu: Option<String>,
    pub sharing: gpu::Sharing,
    /// Whether W is known (from the object, `gpufit.io/gpus`, or admission).
    pub gpus_known: bool,
}

/// Why there is no plan.
#[derive(Debug, Clone, PartialEq)]
pub enum NoPlan {
    /// The job does not opt in (no `gpufit.io/` input annotation).
    NotOptedIn,
    /// A bad annotation, named in the message: the webhook denies it.
    Denied(String),
    /// The job's own shape cannot be planned for (a W that makes the
    /// global batch impossible): allowed unchanged with this warning.
    Unplannable(String),
}

impl From<Denied> for NoPlan {
    fn from(d: Denied) -> Self {
        NoPlan::Denied(d.0)
    }
}

/// Reads and checks the plan: the annotations (unknown keys, bad values
/// and contradictions denied, each naming its annotation), the workload
/// resolved by the core's one resolver, the pins checked against it, the
/// mode (annotation, else namespace label, else the default) and the GPU
/// sharing (annotation, else namespace label).
pub fn plan(i: &PlanInputs<'_>) -> Result<Plan, NoPlan> {
    // What gpufit wrote itself is never input; at admission, neither are
    // the settings of an earlier admission (a re-admission plans anew).
    let written: &[&str] = if i.admitted {
        &[
            ANN_WORKLOAD,
            ANN_RECORDED,
            ANN_PEAK_PENDING,
            ANN_FALLBACK,
            ANN_APPLIED,
            ANN_RECOMMENDATION,
            ANN_REASON,
        ]
    } else {
        &[ANN_WORKLOAD, ANN_RECORDED, ANN_PEAK_PENDING, ANN_FALLBACK]
    };
    let own: BTreeMap<String, String> = i
        .annotations
        .iter()
        .filter(|(k, _)| !written.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let Some(mut inputs) = annotations::input_annotations(&own)? else {
        return Err(NoPlan::NotOptedIn);
    };
    if i.admitted {
        // Admission decides W: the annotation (read at creation) is not input.
        inputs.remove("gpus");
    }
    let gpus_annotated = inputs.contains_key("gpus");
    let (request, strategy, mode, pins, gpu_name) =
        annotations::parse_annotations(&inputs, i.gpus.unwrap_or(1))?;
    let workload = match request.resolve() {
        Ok(w) => w,
        // W from the job's own shape (or admission), not from an
        // annotation: the shape is at fault, said with what was seen.
        Err(WorkloadError::GlobalBatchNotDivisible { global, gpus }) if !gpus_annotated => {
            return Err(NoPlan::Unplannable(format!(
                "gpufit did not change this object: its {} {gpus} data-parallel GPUs \
                 (pods × GPUs per pod) do not divide gpufit.io/global-batch {global}; \
                 set gpufit.io/gpus or a global batch that {gpus} GPUs divide",
                if i.admitted {
                    "admission gives it"
                } else {
                    "shape asks for"
                }
            )))
        }
        Err(e) => return Err(annotations::denied_workload(&e).into()),
    };
    check_pins(&pins, &workload, "gpufit.io/pins")
        .map_err(|e| NoPlan::Denied(format!("gpufit: {e}")))?;
    let (ns, ns_labels) = match i.namespace {
        Some((ns, labels)) => (Some(ns), labels),
        None => (None, None),
    };
    let mode = match mode {
        Some(m) => m,
        None => namespace_mode(ns, ns_labels)
            .map_err(NoPlan::Denied)?
            .unwrap_or(i.default_mode),
    };
    let sharing = gpu::sharing_of(Some(i.annotations), ns.zip(ns_labels))
        .map_err(|e| NoPlan::Denied(format!("gpufit: {e}")))?;
    Ok(Plan {
        workload,
        strategy,
        mode,
        pins,
        gpu: gpu_name,
        sharing,
        gpus_known: i.gpus.is_some() || gpus_annotated,
    })
}

/// The namespace's `gpufit.io/mode` label (the one place it is parsed).
pub fn namespace_mode(
    ns: Option<&str>,
    labels: Option<&BTreeMap<String, String>>,
) -> Result<Option<Mode>, String> {
    match labels.and_then(|l| l.get(MODE_KEY)) {
        Some(v) => v.parse().map(Some).map_err(|e: String| {
            format!(
                "gpufit: namespace {} label {MODE_KEY}: {e}",
                ns.unwrap_or_default()
            )
        }),
        None => Ok(None),
    }
}

/// The settings a job runs with when gpufit cannot answer for it (a Kueue
/// admission gpufit could not configure, a pod started without the
/// answer): the user's pins over safe values — micro batch 1 (the
/// smallest memory), activation checkpointing on, accumulation keeping
/// m × a × W = G for `gpus` (the admitted W; the workload's when None).
pub fn fallback(plan: &Plan, gpus: Option<u32>) -> EngineeringSettings {
    let mut s = EngineeringSettings {
        activation_checkpointing: true,
        ..EngineeringSettings::default()
    };
    let p = &plan.pins;
    if let Some(m) = p.micro_batch_size {
        s.micro_batch_size = m.clamp(1, MAX_BATCH);
    }
    if let Some(d) = p.dtype {
        s.dtype = d;
    }
    if let Some(c) = p.activation_checkpointing {
        s.activation_checkpointing = c;
    }
    if let Some(o) = p.activation_offloading {
        s.activation_offloading = o;
    }
    if let Some(c) = p.compile {
        s.compile = c;
    }
    if let Some(w) = p.num_workers {
        s.dataloader.num_workers = w;
    }
    let w = gpus.unwrap_or(plan.workload.gpus).max(1);
    s.gradient_accumulation_steps =
        match (p.gradient_accumulation_steps, plan.workload.global_batch) {
            (Some(a), _) => a,
            (None, Some(g)) => {
                let per_gpu = g / w;
                if per_gpu > 0 && per_gpu.is_multiple_of(s.micro_batch_size) {
                    per_gpu / s.micro_batch_size
                } else {
                    1
                }
            }
            (None, None) => 1,
        }
        .clamp(1, MAX_BATCH);
    s
}

/// Similar-run lists by query, kept for [`HistoryCache::TTL`]. The history
/// changes when jobs finish (minutes), so a suggestion made from a view a few
/// seconds old is as good; the size is bounded (cleared when full).
#[derive(Debug, Default)]
pub struct HistoryCache {
    entries: std::sync::Mutex<std::collections::HashMap<HistoryQuery, CachedRuns>>,
}

/// When a similar-run list was read, and the list.
type CachedRuns = (Instant, Arc<Vec<RunRecord>>);

impl HistoryCache {
    /// How long an answer is reused.
    pub const TTL: std::time::Duration = std::time::Duration::from_secs(10);
    /// Most queries held.
    const MAX: usize = 4096;

    /// The cached answer, or the store's (then cached).
    pub fn similar(
        &self,
        store: &dyn HistoryStore,
        q: &HistoryQuery,
    ) -> Result<Arc<Vec<RunRecord>>, crate::history::HistoryError> {
        if let Ok(m) = self.entries.lock() {
            if let Some((at, runs)) = m.get(q) {
                if at.elapsed() < Self::TTL {
                    return Ok(runs.clone());
                }
            }
        }
        let runs = Arc::new(store.similar(q)?);
        if let Ok(mut m) = self.entries.lock() {
            if m.len() >= Self::MAX {
                m.clear();
            }
            m.insert(q.clone(), (Instant::now(), runs.clone()));
        }
        Ok(runs)
    }

    /// Forgets every cached list of runs of `model` with `method` (a run
    /// of it was just recorded: the next suggestion must see it — a job
    /// resubmitted right after an OOM must not get the settings that failed).
    pub fn forget(&self, model: &str, method: crate::core::workload::Method) {
        if let Ok(mut m) = self.entries.lock() {
            m.retain(|q, _| !(q.model == model && q.method == method));
        }
    }
}

/// Why no suggestion was made for a plan on a GPU.
#[derive(Debug)]
pub enum NoSuggestion {
    /// Settings that keep the global batch exactly do not exist: the
    /// annotations are at fault (the webhook denies).
    GlobalBatch(AdvisorError),
    /// The history store cannot be read.
    History(HistoryError),
    /// The advisor cannot answer, or the answer is one the history would
    /// refuse to record: the job runs as written.
    Unavailable(String),
}

/// The one pipeline's suggestion for a plan on a GPU, the history read
/// through `history` (the webhook's cache, or the store). A suggestion the
/// history would refuse to record (an accumulation above
/// [`MAX_BATCH`]) is no suggestion: injecting it would lose the run's record.
pub fn suggest(
    plan: &Plan,
    gpu: &GpuSpec,
    cpus_per_gpu: Option<u32>,
    targets: StrategyTargets,
    history: &(impl SimilarRuns + ?Sized),
) -> Result<Suggestion, NoSuggestion> {
    let ask = Ask {
        workload: &plan.workload,
        gpu,
        strategy: plan.strategy,
        pins: &plan.pins,
    };
    let s = match Pipeline::new(targets)
        .with_cpus_per_gpu(cpus_per_gpu)
        .suggest(history, &ask)
    {
        Ok(s) => s,
        Err(PipelineError::Advisor(e @ AdvisorError::GlobalBatch { .. })) => {
            return Err(NoSuggestion::GlobalBatch(e))
        }
        Err(PipelineError::History(e)) => return Err(NoSuggestion::History(e)),
        Err(e) => return Err(NoSuggestion::Unavailable(e.to_string())),
    };
    recordable(&s).map_err(NoSuggestion::Unavailable)?;
    Ok(s)
}

/// The memory model alone (the history store being down must not hold a
/// Kueue admission), with the same recordability check.
pub fn suggest_without_history(
    plan: &Plan,
    gpu: &GpuSpec,
    cpus_per_gpu: Option<u32>,
    targets: StrategyTargets,
) -> Result<Suggestion, NoSuggestion> {
    suggest(plan, gpu, cpus_per_gpu, targets, &NoHistory)
}

struct NoHistory;

impl SimilarRuns for NoHistory {
    fn similar_runs(&self, _q: &HistoryQuery) -> Result<Arc<Vec<RunRecord>>, HistoryError> {
        Ok(Arc::new(Vec::new()))
    }
}

/// Whether the history would record a run with these settings (the
/// ranges `RunRecord::validated` enforces).
fn recordable(s: &Suggestion) -> Result<(), String> {
    let st = &s.settings;
    for (name, v) in [
        ("micro batch", st.micro_batch_size),
        ("gradient accumulation", st.gradient_accumulation_steps),
    ] {
        if !(1..=MAX_BATCH).contains(&v) {
            return Err(format!(
                "gpufit did not change this object: the {name} it would set, {v}, is outside \
                 what the history records (1 to {MAX_BATCH}), so the run could not be learned \
                 from; choose a smaller gpufit.io/global-batch or more GPUs"
            ));
        }
    }
    Ok(())
}

impl std::fmt::Display for NoSuggestion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoSuggestion::GlobalBatch(e) => write!(f, "{e}"),
            NoSuggestion::History(e) => write!(f, "history store: {e}"),
            NoSuggestion::Unavailable(m) => write!(f, "{m}"),
        }
    }
}
