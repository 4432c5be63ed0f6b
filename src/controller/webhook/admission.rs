//! The admission decision: an AdmissionReview in, allowed untouched,
//! allowed with a warning, mutated (the same injection as a TrainingJob's
//! Job) or denied (a bad annotation) out.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::core::v1::PodSpec;
use kube::api::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use kube::runtime::reflector::ObjectRef;
use serde_json::Value;

use crate::core::catalog::GpuSpec;
use crate::core::run::RunRecord;
use crate::core::similarity::HistoryQuery;
use crate::history::{HistoryError, HistoryStore};
use crate::service::SimilarRuns;

use super::super::crd::Mode;
use super::super::gpu;
use super::super::inject;
use super::super::keys::{LABEL_DEFERRED, MODE_KEY};
use super::super::kinds::{self, Shape, TrainingKind};
use super::super::metrics::Via;
use super::super::plan::{self, denied, Denied, NoPlan, NoSuggestion, Plan, PlanInputs};
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
    let kind = match kinds::of(Some(&req.kind.group), &req.kind.kind) {
        Some(k) => k.kind(),
        None if req.kind.group.is_empty() && req.kind.kind == "Pod" => "Pod",
        None => "other",
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
    let decision = if req.kind.group.is_empty() && req.kind.kind == "Pod" {
        Ok(pod(&original))
    } else {
        decide(req, &original, &anns, state)
    };
    match decision {
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
/// (an object is not refused for the cluster's state, nor for a shape
/// gpufit cannot read).
fn decide(
    req: &AdmissionRequest<DynamicObject>,
    original: &Value,
    anns: &BTreeMap<String, String>,
    state: &WebhookState,
) -> Result<Decision, Denied> {
    let ns = req.namespace.as_deref();
    let ns_obj = ns.and_then(|n| state.namespaces.get(&ObjectRef::new(n)));
    let ns_labels = ns_obj.as_ref().and_then(|o| o.metadata.labels.as_ref());
    let kind = kinds::of(Some(&req.kind.group), &req.kind.kind);
    // A kind or shape gpufit cannot configure is allowed unchanged with a
    // warning, but its annotations are still checked (a typo is denied).
    let shape = match kind {
        Some(k) => k.shape(original),
        None => Err(format!(
            "gpufit did not change this {}: gpufit configures {} only",
            req.kind.kind,
            kinds::KINDS
                .iter()
                .map(|k| k.kind())
                .collect::<Vec<_>>()
                .join(", ")
        )),
    };
    let object_gpus = shape.as_ref().ok().and_then(|s| s.gpus);
    let inputs = PlanInputs {
        annotations: anns,
        namespace: ns.map(|n| (n, ns_labels)),
        default_mode: state.default_mode,
        gpus: object_gpus,
        admitted: false,
    };
    let plan = match plan::plan(&inputs) {
        Ok(p) => p,
        Err(NoPlan::NotOptedIn) => return Ok(Decision::Untouched),
        Err(NoPlan::Denied(m)) => return Err(Denied(m)),
        Err(NoPlan::Unplannable(w)) => {
            return Ok(Decision::Warn(shape.err().unwrap_or(w)));
        }
    };
    let (kind, shape) = match (kind, shape) {
        (Some(k), Ok(s)) => (k, s),
        (_, Err(warning)) => return Ok(Decision::Warn(warning)),
        (None, Ok(_)) => return Ok(Decision::Untouched),
    };

    // Queued in Kueue (decided as Kueue decides, whichever webhook runs
    // first): the GPU (flavor) and the counts are decided at admission,
    // so the settings are too (the AdmissionCheck controller), W
    // included: a TrainJob whose runtime sets its GPUs is fine here.
    let queue = match ns {
        Some(n) => state
            .kueue
            .queue_for(
                kind.kueue_framework(),
                original.get("metadata"),
                n,
                ns_labels,
            )
            .map_err(|e| Denied(format!("gpufit: {e}")))?,
        None => None,
    };
    if let Some(queue) = queue {
        return Ok(queued(original, &shape, &plan, kind, &queue));
    }

    if !plan.gpus_known {
        return Ok(Decision::Warn(format!(
            "gpufit did not change this {}: its GPU count comes from its runtime; set \
             spec.trainer.numNodes and nvidia.com/gpu in spec.trainer.resourcesPerNode, \
             or annotate gpufit.io/gpus with the training GPUs of the whole job",
            kind.kind()
        )));
    }

    let first_pod: Option<PodSpec> = shape
        .templates
        .first()
        .and_then(|t| original.pointer(&format!("{}/spec", t.pointer)))
        .and_then(|v| serde_json::from_value(v.clone()).ok());
    let (gpu, gpu_warnings) =
        match target_gpu(plan.gpu.as_deref(), first_pod.as_ref(), plan.sharing, state)? {
            Ok(g) => g,
            Err(warning) => return Ok(Decision::Warn(warning)),
        };
    // Data-loader workers from the CPUs the pod has per GPU.
    // A TrainJob has no pod template here (its runtime's): no CPU figure.
    let cpus = shape
        .templates
        .first()
        .and_then(|t| original.pointer(&format!("{}/spec", t.pointer)))
        .and_then(gpu::cpus_per_gpu_json);
    let history = Cached {
        cache: &state.cache,
        store: state.history.as_ref(),
    };
    let suggestion = match plan::suggest(&plan, &gpu, cpus, state.targets, &history) {
        Ok(s) => {
            state.metrics.count_suggestion(Via::Webhook, &s);
            s
        }
        // The global batch is scientific: settings that cannot keep it
        // exactly are refused with the reason, not silently let through.
        Err(NoSuggestion::GlobalBatch(e)) => return Err(Denied(format!("gpufit: {e}"))),
        Err(e @ NoSuggestion::History(_)) => {
            return Ok(Decision::Warn(format!(
                "gpufit did not change this object: {e}"
            )))
        }
        Err(NoSuggestion::Unavailable(m)) => {
            let m = if m.starts_with("gpufit") {
                m
            } else {
                format!("gpufit did not change this object: {m}")
            };
            // Why the GPU is what it is (e.g. MPS's cap) explains the failure too.
            let all: Vec<String> = std::iter::once(m).chain(gpu_warnings).collect();
            return Ok(Decision::Warn(all.join("; ")));
        }
    };
    let mut mutated = with_suggestion(original, &shape, &suggestion, plan.mode);
    if plan.mode == Mode::Inject {
        // What recording the run later needs travels on the object.
        kinds::mark_for_recording(&mut mutated, &shape.pointers(), &plan.workload);
    }
    // What planning for the GPU had to say (e.g. `whole` refused under MPS) first.
    let warnings = gpu_warnings
        .into_iter()
        .chain(suggestion.warnings.iter().cloned())
        .collect();
    Ok(Decision::Mutate(mutated, warnings))
}

/// An object queued in Kueue: its containers read each setting from a pod
/// annotation that the AdmissionCheck controller sets when Kueue admits it
/// on a flavor (`podSetUpdates`); each pod template also carries the
/// fallback settings (the user's pins, else safe values) that gpufit's pod
/// webhook fills in should a pod start without the answer — a setting is
/// never empty. It is marked for recording now. In Recommend mode it is
/// left untouched (the recommendation is written on it at admission).
fn queued(
    original: &Value,
    shape: &Shape,
    plan: &Plan,
    kind: &dyn TrainingKind,
    queue: &str,
) -> Decision {
    if plan.mode == Mode::Recommend {
        return Decision::Warn(format!(
            "gpufit will recommend settings for this {} when Kueue admits it from queue {queue} \
             (annotation gpufit.io/recommendation)",
            kind.kind()
        ));
    }
    let fallback = inject::setting_annotations(&plan::fallback(plan, None));
    let mut mutated = original.clone();
    for t in &shape.templates {
        if let Some(t) = mutated.pointer_mut(&t.pointer) {
            inject::inject_pod_template_deferred(t);
            inject::add_fallback(t, &fallback);
        }
    }
    if let Some(ptr) = &shape.trainer {
        if let Some(trainer) = object_at(&mut mutated, ptr) {
            inject::inject_container_deferred(trainer, false);
            // Its pods come from the runtime: the fallback travels in the
            // trainer's environment, which Trainer copies into them.
            inject::add_fallback_env(trainer, &fallback);
        }
    }
    kinds::mark_for_recording(&mut mutated, &shape.pointers(), &plan.workload);
    Decision::Mutate(mutated, Vec::new())
}

/// A pod whose containers read their settings from its annotations
/// ([`LABEL_DEFERRED`], or a TrainJob trainer's variables): every setting
/// annotation it lacks (Kueue started it without gpufit's answer: a check
/// absent on its flavor) is filled from its fallback, so no container
/// reads "".
fn pod(original: &Value) -> Decision {
    let labelled = original
        .pointer(&format!(
            "/metadata/labels/{}",
            LABEL_DEFERRED.replace('/', "~1")
        ))
        .and_then(Value::as_str)
        == Some("true");
    if !labelled && !inject::reads_deferred_settings(original) {
        return Decision::Untouched;
    }
    let mut mutated = original.clone();
    let filled = inject::fill_missing_settings(&mut mutated);
    if filled.is_empty() {
        return Decision::Untouched;
    }
    Decision::Mutate(
        mutated,
        vec![format!(
            "gpufit: this pod started without gpufit's admission answer; fallback settings used for {}",
            filled.join(", ")
        )],
    )
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
fn with_suggestion(
    original: &Value,
    shape: &Shape,
    suggestion: &crate::core::advisor::Suggestion,
    mode: Mode,
) -> Value {
    let mut mutated = original.clone();
    if let Some(meta) = mutated.get_mut("metadata") {
        inject::add_annotations(meta, &inject::annotations(suggestion, mode));
    }
    for t in &shape.templates {
        if let Some(t) = mutated.pointer_mut(&t.pointer) {
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

// The namespace's mode label is read by the plan (`plan::namespace_mode`).
const _: &str = MODE_KEY;
