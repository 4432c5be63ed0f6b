//! Step 5, start an attempt: resolve the GPU, ask the advisor (with this
//! job's history, which now knows any OOM), build and create the Job.

use k8s_openapi::api::batch::v1::Job;
use kube::api::{Api, PostParams};
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::ResourceExt;

use crate::controller::build::{self, build_job};
use crate::controller::crd::{
    Attempt, Mode, Phase, SettingsStatus, SuggestionStatus, TrainingJob, TrainingJobStatus,
};
use crate::controller::gpu;
use crate::controller::metrics::Via;
use crate::controller::validate::Validated;
use crate::controller::ControllerError;
use crate::core::advisor::{AdvisorError, Suggestion};
use crate::core::catalog::GpuSpec;
use crate::service::{Ask, Pipeline, PipelineError};

use super::context::Context;
use super::status::set_condition;

/// Why no attempt was started.
#[derive(Debug)]
pub(super) enum StartError {
    /// Will not work without a spec change: nothing fits.
    Invalid(String),
    /// The spec contradicts itself (a global batch its pins cannot keep).
    InvalidSpec(String),
    /// Transient (GPU labels missing, history down, API error): retry with backoff.
    Retry(&'static str, ControllerError),
}

/// Resolves the GPU, asks the advisor (with this job's history), builds and creates the Job.
pub(super) async fn start_attempt(
    ctx: &Context,
    tj: &TrainingJob,
    ns: &str,
    v: &Validated,
    st: &mut TrainingJobStatus,
    generation: Option<i64>,
) -> Result<(), StartError> {
    let (gpu, gpu_warnings) = target_gpu(ctx, tj, v)?;
    // Data-loader workers from the CPUs the pod template has per GPU.
    let cpus = tj.spec.template.spec.as_ref().and_then(gpu::cpus_per_gpu);
    let suggestion = advise(ctx, v, &gpu, cpus).await?;
    let index = st.attempts.iter().map(|a| a.index).max().unwrap_or(0) + 1;
    let (job_name, created) = create_job(ctx, tj, ns, v, index, &suggestion).await?;
    record_attempt(st, v, index, &job_name, &gpu, &suggestion, generation);
    let msg = created_message(v, index, &job_name, &gpu, &suggestion);
    set_condition(st, "Ready", true, "JobCreated", &msg, generation);
    // A Job that already exists is the attempt already started (this pass
    // replays a stale cached TrainingJob whose status lacks it): it was
    // announced and counted when it was created.
    if created == Created::AlreadyExisted {
        tracing::debug!(job = %job_name, "attempt's Job already exists; adopted");
        return Ok(());
    }
    ctx.metrics.count_suggestion(Via::Kubernetes, &suggestion);
    let reason = if index > 1 {
        "RetryCreated"
    } else {
        "JobCreated"
    };
    ctx.event(tj, EventType::Normal, reason, msg).await;
    // What planning for the GPU had to say (e.g. `whole` refused under
    // MPS), where the user looks: the TrainingJob's events.
    for w in gpu_warnings {
        ctx.event(tj, EventType::Warning, "GpuSharing", w).await;
    }
    Ok(())
}

/// The GPU named in the spec, else the one of the nodes the pod may land
/// on; unknown is transient (labels may come).
/// With what planning for it had to say (e.g. `whole` refused under MPS).
fn target_gpu(
    ctx: &Context,
    tj: &TrainingJob,
    v: &Validated,
) -> Result<(GpuSpec, Vec<String>), StartError> {
    match &v.gpu {
        Some(name) => gpu::resolve_named(name).map(|g| (g, Vec::new())),
        None => {
            // A shared GPU: the TrainingJob's annotation, else its
            // namespace's label, says whether to plan for its share.
            let ns = tj.namespace();
            let ns_obj = ns
                .as_deref()
                .and_then(|ns| ctx.namespaces.get(&ObjectRef::new(ns)));
            let ns_labels = ns_obj.as_ref().and_then(|o| o.metadata.labels.as_ref());
            let sharing = gpu::sharing_of(
                tj.metadata.annotations.as_ref(),
                ns.as_deref().zip(ns_labels),
            )
            .map_err(StartError::InvalidSpec)?;
            let nodes = ctx.nodes.state();
            gpu::plan_from_nodes(
                nodes.iter().map(|n| n.as_ref()),
                tj.spec.template.spec.as_ref(),
                sharing,
            )
            .map(|p| (p.gpu, p.warnings))
        }
    }
    .map_err(|e| StartError::Retry("GpuUnknown", ControllerError::Gpu(e.to_string())))
}

/// The one pipeline's suggestion with this job's history, off the async
/// threads (it reads the history).
async fn advise(
    ctx: &Context,
    v: &Validated,
    gpu: &GpuSpec,
    cpus_per_gpu: Option<u32>,
) -> Result<Suggestion, StartError> {
    let store = ctx.history.clone();
    let pipeline = Pipeline::new(ctx.targets).with_cpus_per_gpu(cpus_per_gpu);
    let (workload, pins, strategy, gpu) =
        (v.workload.clone(), v.pins.clone(), v.strategy, gpu.clone());
    let suggest = move || {
        let ask = Ask {
            workload: &workload,
            gpu: &gpu,
            strategy,
            pins: &pins,
        };
        pipeline.suggest(store.as_ref(), &ask)
    };
    tokio::task::spawn_blocking(suggest)
        .await
        .map_err(|e| {
            StartError::Retry("HistoryUnavailable", ControllerError::Other(e.to_string()))
        })?
        .map_err(|e| match e {
            PipelineError::History(e) => {
                StartError::Retry("HistoryUnavailable", ControllerError::History(e))
            }
            // The spec asks for a global batch its pins cannot keep: invalid.
            PipelineError::Advisor(e @ AdvisorError::GlobalBatch { .. }) => {
                StartError::InvalidSpec(e.to_string())
            }
            PipelineError::Advisor(e) => StartError::Invalid(e.to_string()),
        })
}

/// Whether [`create_job`] created the Job or found it there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Created {
    New,
    AlreadyExisted,
}

/// Builds and creates attempt `index`'s Job; answers its name and whether
/// it is new.
async fn create_job(
    ctx: &Context,
    tj: &TrainingJob,
    ns: &str,
    v: &Validated,
    index: u32,
    suggestion: &Suggestion,
) -> Result<(String, Created), StartError> {
    let job = build_job(tj, index, suggestion, v.mode)
        .map_err(|e| StartError::Retry("BuildFailed", ControllerError::Other(e.to_string())))?;
    let job_name = build::job_name(&tj.name_any(), index);
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), ns);
    let created = match jobs.create(&PostParams::default(), &job).await {
        Ok(_) => Created::New,
        // Created on an earlier pass (a stale cached TrainingJob, or a
        // status patch that was lost): adopt it.
        Err(kube::Error::Api(s)) if s.is_already_exists() => Created::AlreadyExisted,
        Err(e) => return Err(StartError::Retry("JobCreateFailed", e.into())),
    };
    Ok((job_name, created))
}

/// The new attempt, running, and the status that points at it.
fn record_attempt(
    st: &mut TrainingJobStatus,
    v: &Validated,
    index: u32,
    job_name: &str,
    gpu: &GpuSpec,
    suggestion: &Suggestion,
    generation: Option<i64>,
) {
    st.attempts.push(Attempt {
        predicted_peak_bytes: Some(suggestion.predicted_peak_bytes),
        ..Attempt::started(
            index,
            job_name.to_string(),
            SettingsStatus::from(&suggestion.settings),
            generation,
            v.mode,
        )
    });
    st.job_name = Some(job_name.to_string());
    st.gpu = Some(gpu.name.clone());
    st.suggestion = Some(SuggestionStatus::from(suggestion));
    st.phase = Some(Phase::Pending);
}

/// What was created and why, for the Ready condition and the event.
fn created_message(
    v: &Validated,
    index: u32,
    job_name: &str,
    gpu: &GpuSpec,
    suggestion: &Suggestion,
) -> String {
    let retry = index > 1;
    let verb = if v.mode == Mode::Inject {
        "with"
    } else {
        "as written; recommended"
    };
    format!(
        "{} Job {job_name} {verb} micro batch {} × accumulation {}, {} on {} ({}, confidence {:.2}): {}",
        if retry { "retry: created" } else { "created" },
        suggestion.settings.micro_batch_size,
        suggestion.settings.gradient_accumulation_steps,
        suggestion.settings.dtype,
        gpu.name,
        suggestion.source.as_str(),
        suggestion.confidence,
        suggestion.reasoning
    )
}
