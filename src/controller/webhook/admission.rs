//! The admission decision: an AdmissionReview in, allowed untouched,
//! allowed with a warning, mutated (the same injection as a TrainingJob's
//! Job) or denied (a bad annotation) out.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::core::v1::{Namespace, PodSpec};
use kube::api::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use kube::runtime::reflector::{ObjectRef, Store};
use serde_json::Value;

use crate::core::advisor::{AdvisorError, Strategy, Suggestion};
use crate::core::catalog::GpuSpec;
use crate::core::run::RunRecord;
use crate::core::settings::Pins;
use crate::core::similarity::HistoryQuery;
use crate::core::workload::Workload;
use crate::history::{HistoryError, HistoryStore};
use crate::service::{Ask, Pipeline, PipelineError, SimilarRuns};

use super::super::crd::Mode;
use super::super::gpu;
use super::super::inject;
use super::super::kueue;
use super::super::metrics::Via;
use super::super::reconcile::{workloads, MODE_KEY};
use super::super::validate::check_pins;
use super::annotations::{denied, denied_workload, input_annotations, parse_annotations, Denied};
use super::shape::{self, Shape};
use super::{HistoryCache, WebhookState};

/// Answers one AdmissionReview (JSON bytes as the API server sends them).
pub fn review(body: &[u8], state: &WebhookState) -> AdmissionReview<DynamicObject> {
    let start = Instant::now();
    let review: AdmissionReview<DynamicObject> = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => {
            return AdmissionResponse::invalid(format!("not an AdmissionReview: {e}")).into_review()
        }
    };
    let req: AdmissionRequest<DynamicObject> = match review.try_into() {
        Ok(r) => r,
        Err(_) => {
            return AdmissionResponse::invalid("AdmissionReview without a request").into_review()
        }
    };
    let kind = match req.kind.kind.as_str() {
        "Job" => "Job",
        "PyTorchJob" => "PyTorchJob",
        "JobSet" => "JobSet",
        "TrainJob" => "TrainJob",
        _ => "other",
    };
    let (resp, result) = admit(&req, state);
    state
        .metrics
        .webhook_requests
        .with_label_values(&[kind, result])
        .inc();
    state
        .metrics
        .webhook_duration
        .with_label_values(&[kind])
        .observe(start.elapsed().as_secs_f64());
    resp.into_review()
}

/// Decides one request; the label says what happened (for metrics).
fn admit(
    req: &AdmissionRequest<DynamicObject>,
    state: &WebhookState,
) -> (AdmissionResponse, &'static str) {
    let resp = AdmissionResponse::from(req);
    if req.operation != Operation::Create {
        return (resp, "untouched");
    }
    let Some(obj) = &req.object else {
        return (resp, "untouched");
    };
    let original = match serde_json::to_value(obj) {
        Ok(v) => v,
        Err(e) => {
            return (
                resp.deny(format!("gpufit: cannot read the object: {e}")),
                "error",
            )
        }
    };
    let anns: BTreeMap<String, String> = obj.metadata.annotations.clone().unwrap_or_default();
    match decide(req, &original, &anns, state) {
        Ok(Decision::Untouched) => (resp, "untouched"),
        Ok(Decision::Warn(w)) => {
            let mut resp = resp;
            resp.warnings = Some(vec![w]);
            (resp, "untouched")
        }
        Ok(Decision::Mutate(mutated, warnings)) => {
            let patch = json_patch::diff(&original, &mutated);
            match resp.with_patch(patch) {
                Ok(mut r) => {
                    if !warnings.is_empty() {
                        r.warnings = Some(warnings);
                    }
                    (r, "mutated")
                }
                Err(e) => (
                    AdmissionResponse::from(req)
                        .deny(format!("gpufit: cannot encode the patch: {e}")),
                    "error",
                ),
            }
        }
        Err(Denied(msg)) => (resp.deny(msg), "denied"),
    }
}

/// What the webhook does with one object.
enum Decision {
    Untouched,
    /// Allowed untouched, with a warning for the submitter.
    Warn(String),
    /// The mutated object and warnings.
    Mutate(Value, Vec<String>),
}

/// Decides what to do with an object: untouched without gpufit.io
/// annotations, denied for a bad one, else the suggestion injected into
/// every pod template — or a warning when no suggestion can be made
/// (an object is not refused for the cluster's state).
fn decide(
    req: &AdmissionRequest<DynamicObject>,
    original: &Value,
    anns: &BTreeMap<String, String>,
    state: &WebhookState,
) -> Result<Decision, Denied> {
    let Some(inputs) = input_annotations(anns)? else {
        return Ok(Decision::Untouched);
    };

    // A kind or shape gpufit cannot configure is allowed unchanged with a
    // warning, but its annotations are still checked (a typo is denied).
    let shape = shape::shape(&req.kind.kind, original);
    let object_gpus = shape.as_ref().ok().and_then(|s| s.gpus);
    let (request, strategy, mode, pins, gpu_name) =
        parse_annotations(&inputs, object_gpus.unwrap_or(1))?;
    let shape = match shape {
        Ok(s) => s,
        Err(warning) => return Ok(Decision::Warn(warning)),
    };
    let first_pod: Option<PodSpec> = shape
        .templates
        .first()
        .and_then(|t| original.pointer(&format!("{t}/spec")))
        .and_then(|v| serde_json::from_value(v.clone()).ok());
    // The core's one resolver, the field named as its annotation.
    let workload = request.resolve().map_err(|e| denied_workload(&e))?;
    check_pins(&pins, &workload, "gpufit.io/pins").map_err(|e| Denied(format!("gpufit: {e}")))?;
    let mode = match mode {
        Some(m) => m,
        None => namespace_mode(req.namespace.as_deref(), &state.namespaces)?
            .unwrap_or(state.default_mode),
    };

    // Queued in Kueue: the GPU (flavor) and the counts are decided at
    // admission, so the settings are too (the AdmissionCheck controller),
    // W included: a TrainJob whose runtime sets its GPUs is fine here.
    if let Some(queue) = kueue_queue(original, req.namespace.as_deref(), state)? {
        return Ok(queued(
            original,
            &shape,
            &workload,
            mode,
            &req.kind.kind,
            &queue,
        ));
    }

    if object_gpus.is_none() && !inputs.contains_key("gpus") {
        return Ok(Decision::Warn(format!(
            "gpufit did not change this {}: its GPU count comes from its runtime; set \
             spec.trainer.numNodes and nvidia.com/gpu in spec.trainer.resourcesPerNode, \
             or annotate gpufit.io/gpus with the training GPUs of the whole job",
            req.kind.kind
        )));
    }

    let sharing = sharing(anns, req.namespace.as_deref(), &state.namespaces)?;
    let (gpu, gpu_warnings) =
        match target_gpu(gpu_name.as_deref(), first_pod.as_ref(), sharing, state)? {
            Ok(g) => g,
            Err(warning) => return Ok(Decision::Warn(warning)),
        };
    // Data-loader workers from the CPUs the pod has per GPU.
    // A TrainJob has no pod template here (its runtime's): no CPU figure.
    let cpus = shape
        .templates
        .first()
        .and_then(|t| original.pointer(&format!("{t}/spec")))
        .and_then(gpu::cpus_per_gpu_json);
    let suggestion = match advise(&workload, &gpu, strategy, &pins, cpus, state)? {
        Ok(s) => s,
        // Why the GPU is what it is (e.g. MPS's cap) explains the failure too.
        Err(warning) => {
            let all: Vec<String> = std::iter::once(warning).chain(gpu_warnings).collect();
            return Ok(Decision::Warn(all.join("; ")));
        }
    };
    let mut mutated = with_suggestion(original, &shape, &suggestion, mode);
    if mode == Mode::Inject {
        // What recording the run later needs travels on the object.
        workloads::mark_for_recording(&mut mutated, &shape.templates, &workload);
    }
    // What planning for the GPU had to say (e.g. `whole` refused under MPS) first.
    let warnings = gpu_warnings
        .into_iter()
        .chain(suggestion.warnings.iter().cloned())
        .collect();
    Ok(Decision::Mutate(mutated, warnings))
}

/// The Kueue queue an object goes through, for the messages: its
/// `kueue.x-k8s.io/queue-name`, else — in a namespace whose jobs without
/// one Kueue manages (`state.kueue_unlabelled`) — the namespace's default
/// LocalQueue; None when Kueue does not manage it.
fn kueue_queue(
    original: &Value,
    ns: Option<&str>,
    state: &WebhookState,
) -> Result<Option<String>, Denied> {
    if let Some(q) = kueue::queue_name(original.get("metadata")) {
        return Ok(Some(q.to_string()));
    }
    // A JobSet's Job or a TrainJob's JobSet is admitted with its owner.
    if kueue::owned_by_integration(original.get("metadata")) {
        return Ok(None);
    }
    let Some(ns) = ns else { return Ok(None) };
    let obj = state.namespaces.get(&ObjectRef::new(ns));
    let labels = obj.as_ref().and_then(|o| o.metadata.labels.as_ref());
    match state.kueue_unlabelled.managed(ns, labels) {
        Ok(true) => Ok(Some(format!("(namespace {ns}'s default LocalQueue)"))),
        Ok(false) => Ok(None),
        Err(e) => Err(Denied(format!("gpufit: {e}"))),
    }
}

/// An object queued in Kueue: its containers read each setting from a pod
/// annotation that the AdmissionCheck controller sets when Kueue admits it
/// on a flavor (`podSetUpdates`); it is marked for recording now. In
/// Recommend mode it is left untouched (the recommendation is written on it
/// at admission).
fn queued(
    original: &Value,
    shape: &Shape,
    workload: &Workload,
    mode: Mode,
    kind: &str,
    queue: &str,
) -> Decision {
    if mode == Mode::Recommend {
        return Decision::Warn(format!(
            "gpufit will recommend settings for this {kind} when Kueue admits it from queue {queue} \
             (annotation gpufit.io/recommendation)"
        ));
    }
    let mut mutated = original.clone();
    for ptr in &shape.templates {
        if let Some(t) = mutated.pointer_mut(ptr) {
            inject::inject_pod_template_deferred(t);
        }
    }
    if let Some(ptr) = &shape.trainer {
        if let Some(trainer) = object_at(&mut mutated, ptr) {
            inject::inject_container_deferred(trainer, false);
        }
    }
    workloads::mark_for_recording(&mut mutated, &shape.templates, workload);
    Decision::Mutate(mutated, Vec::new())
}

/// The GPU to plan for, with what planning for it had to say: the
/// annotated one (denied when unknown), else the one of the nodes the pod
/// may land on — `Ok(Err(warning))` when the nodes do not tell.
fn target_gpu(
    gpu_name: Option<&str>,
    first_pod: Option<&PodSpec>,
    sharing: gpu::Sharing,
    state: &WebhookState,
) -> Result<Result<(GpuSpec, Vec<String>), String>, Denied> {
    if let Some(name) = gpu_name {
        return gpu::resolve_named(name)
            .map(|g| Ok((g, Vec::new())))
            .map_err(|e| denied("gpufit.io/gpu", e));
    }
    let nodes = state.nodes.state();
    Ok(
        gpu::plan_from_nodes(nodes.iter().map(|n| n.as_ref()), first_pod, sharing)
            .map(|p| (p.gpu, p.warnings))
            .map_err(|e| {
                format!("gpufit did not change this object: {e} (or annotate gpufit.io/gpu)")
            }),
    )
}

/// The one pipeline's suggestion for this workload on this GPU (the history
/// read through the webhook's cache), counted in the metrics;
/// `Ok(Err(warning))` when history or advisor cannot answer.
fn advise(
    workload: &Workload,
    gpu: &GpuSpec,
    strategy: Strategy,
    pins: &Pins,
    cpus_per_gpu: Option<u32>,
    state: &WebhookState,
) -> Result<Result<Suggestion, String>, Denied> {
    let ask = Ask {
        workload,
        gpu,
        strategy,
        pins,
    };
    let history = Cached {
        cache: &state.cache,
        store: state.history.as_ref(),
    };
    match Pipeline::new(state.targets)
        .with_cpus_per_gpu(cpus_per_gpu)
        .suggest(&history, &ask)
    {
        Ok(s) => {
            state.metrics.count_suggestion(Via::Webhook, &s);
            Ok(Ok(s))
        }
        // The global batch is scientific: settings that cannot keep it
        // exactly are refused with the reason, not silently let through.
        Err(PipelineError::Advisor(e @ AdvisorError::GlobalBatch { .. })) => {
            Err(Denied(format!("gpufit: {e}")))
        }
        Err(e) => Ok(Err(format!("gpufit did not change this object: {e}"))),
    }
}

/// The history as the webhook reads it: through its short-lived cache.
struct Cached<'a> {
    cache: &'a HistoryCache,
    store: &'a dyn HistoryStore,
}

impl SimilarRuns for Cached<'_> {
    fn similar_runs(&self, q: &HistoryQuery) -> Result<Arc<Vec<RunRecord>>, HistoryError> {
        self.cache.similar(self.store, q)
    }
}

/// The object with the suggestion's annotations and every training pod
/// template (or a TrainJob's trainer) injected (the same injection as a
/// TrainingJob's Job).
fn with_suggestion(original: &Value, shape: &Shape, suggestion: &Suggestion, mode: Mode) -> Value {
    let mut mutated = original.clone();
    if let Some(meta) = mutated.get_mut("metadata") {
        inject::add_annotations(meta, &inject::annotations(suggestion, mode));
    }
    for ptr in &shape.templates {
        if let Some(t) = mutated.pointer_mut(ptr) {
            inject::inject_pod_template(t, suggestion, mode, mode == Mode::Inject);
        }
    }
    if let (Some(ptr), Mode::Inject) = (&shape.trainer, mode) {
        if let Some(trainer) = object_at(&mut mutated, ptr) {
            // A TrainJob has no container of its own: its controller merges
            // the trainer's env/command/args into the runtime's trainer.
            inject::inject_container(trainer, suggestion, false);
        }
    }
    mutated
}

/// The JSON object at `/a/b` (created, with its parents, when absent).
fn object_at<'a>(v: &'a mut Value, ptr: &str) -> Option<&'a mut serde_json::Map<String, Value>> {
    let mut cur = v;
    for key in ptr.split('/').skip(1) {
        cur = cur
            .as_object_mut()?
            .entry(key.to_string())
            .or_insert_with(|| Value::Object(Default::default()));
    }
    cur.as_object_mut()
}

/// How to plan for a shared GPU: the object's annotation, else its
/// namespace's label; a bad value is denied like other bad annotations.
fn sharing(
    anns: &BTreeMap<String, String>,
    ns: Option<&str>,
    namespaces: &Store<Namespace>,
) -> Result<gpu::Sharing, Denied> {
    let obj = ns.and_then(|ns| namespaces.get(&ObjectRef::new(ns)));
    let labels = obj.as_ref().and_then(|o| o.metadata.labels.as_ref());
    gpu::sharing_of(Some(anns), ns.zip(labels)).map_err(|e| Denied(format!("gpufit: {e}")))
}

fn namespace_mode(ns: Option<&str>, namespaces: &Store<Namespace>) -> Result<Option<Mode>, Denied> {
    let Some(ns) = ns else { return Ok(None) };
    let Some(obj) = namespaces.get(&ObjectRef::new(ns)) else {
        return Ok(None);
    };
    match obj.metadata.labels.as_ref().and_then(|l| l.get(MODE_KEY)) {
        Some(v) => v
            .parse()
            .map(Some)
            .map_err(|e: String| Denied(format!("gpufit: namespace {ns} label {MODE_KEY}: {e}"))),
        None => Ok(None),
    }
}
