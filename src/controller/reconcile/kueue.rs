//! gpufit's Kueue AdmissionCheck controller (`controllerName:
//! gpufit.io/advisor`): when Kueue reserves quota for a Workload on a
//! flavor, the settings for that flavor's GPU and the admitted counts are
//! decided and handed to Kueue as `podSetUpdates` (pod annotations the
//! containers read through the downward API, injected at creation by the
//! webhook). Thin I/O around the pure [`crate::controller::kueue`]:
//!
//! 1. the cached Workload says our check is `Pending` with quota reserved
//!    ([`step`]); the API server's copy is read again, so a stale or
//!    duplicate event answers nothing twice;
//! 2. the owner job's `gpufit.io/` annotations (the workload), the flavors'
//!    `nodeLabels` (the GPU), the admitted counts (W), the ONE suggest
//!    pipeline;
//! 3. the owner job's annotations updated (applied settings, workload with
//!    the admitted W: what the run recorder reads when the job ends), then
//!    the check set `Ready` by server-side apply on the Workload's status,
//!    with the copy's `resourceVersion` (a Workload changed meanwhile is a
//!    conflict, and is looked at again).
//!
//! A job gpufit cannot configure (no GPU known, nothing fits, unreadable
//! annotations) is never held: its check is `Ready` without updates, with
//! the reason as the check's message and a Warning Event on the Workload.
//! (`Rejected` would deactivate the workload; `Retry` would give its quota
//! back to be admitted again, likely the same way.)
//!
//! The AdmissionChecks with our controller name are marked `Active`, which
//! a ClusterQueue needs before it admits anything.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::{SecondsFormat, Utc};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Client, ResourceExt};
use serde_json::{json, Value};

use crate::controller::crd::Mode;
use crate::controller::gpu;
use crate::controller::inject::{self, ANN_APPLIED, ANN_REASON, ANN_RECOMMENDATION};
use crate::controller::kueue::{
    admitted, admitted_gpus, flavor_gpu, ready_check, smallest, status_apply, step, training,
    Admitted, Step, Workload, CONDITION_ACTIVE, CONTROLLER_NAME, GROUP, VERSION,
};
use crate::controller::metrics::Via;
use crate::controller::validate::check_pins;
use crate::controller::webhook::{inputs_for_admission, AdmissionInputs};
use crate::controller::ControllerError;
use crate::core::advisor::Suggestion;
use crate::core::catalog::GpuSpec;
use crate::service::{Ask, Pipeline, PipelineError};

use super::context::Context;
use super::workloads::ANN_WORKLOAD;
use super::MODE_KEY;

/// Field manager of gpufit's writes to Kueue objects.
pub const FIELD_MANAGER: &str = "gpufit-advisor";

fn resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, kind), plural)
}

/// `kueue.x-k8s.io/v1beta1` Workloads.
pub fn workloads() -> ApiResource {
    resource("Workload", "workloads")
}

/// `kueue.x-k8s.io/v1beta1` AdmissionChecks (cluster-scoped).
pub fn admission_checks() -> ApiResource {
    resource("AdmissionCheck", "admissionchecks")
}

/// `kueue.x-k8s.io/v1beta1` ResourceFlavors (cluster-scoped).
pub fn resource_flavors() -> ApiResource {
    resource("ResourceFlavor", "resourceflavors")
}

/// What the Kueue reconciler shares.
pub struct KueueContext {
    pub ctx: Arc<Context>,
    /// AdmissionChecks, from a reflector: which check names are ours.
    pub checks: Store<DynamicObject>,
}

/// The names of the AdmissionChecks whose controller is gpufit.
pub fn our_checks(checks: &Store<DynamicObject>) -> BTreeSet<String> {
    checks
        .state()
        .iter()
        .filter(|c| c.data["spec"]["controllerName"].as_str() == Some(CONTROLLER_NAME))
        .map(|c| c.name_any())
        .collect()
}

/// What gpufit answers for one admission.
#[derive(Debug)]
enum Answer {
    /// Settings for the admitted flavor and counts.
    Configured {
        suggestion: Box<Suggestion>,
        workload: Box<crate::core::workload::Workload>,
        mode: Mode,
        message: String,
    },
    /// The owner did not opt in: nothing to set.
    NotOptedIn(String),
    /// gpufit cannot configure it: the job runs as written.
    Failed(String),
}

/// The owner job of a Workload (its controller owner reference).
struct Owner {
    api: Api<DynamicObject>,
    name: String,
    obj: DynamicObject,
}

/// Answers gpufit's check on one Workload (the `Controller::run` reconciler).
pub async fn reconcile_kueue_workload(
    obj: Arc<DynamicObject>,
    k: Arc<KueueContext>,
) -> Result<Action, ControllerError> {
    let ctx = &k.ctx;
    let ours = our_checks(&k.checks);
    let cached = match Workload::from_json(&serde_json::to_value(obj.as_ref())?) {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(workload = %obj.name_any(), error = %e, "Kueue Workload not read");
            return Ok(Action::await_change());
        }
    };
    if let Step::Wait(_) = step(&cached, &ours) {
        return Ok(Action::await_change());
    }
    // The cache may be behind our own answer: the API server's copy decides.
    let ns = obj.namespace().unwrap_or_default();
    let name = obj.name_any();
    let api: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), &ns, &workloads());
    let Some(fresh) = api.get_opt(&name).await? else {
        return Ok(Action::await_change());
    };
    let wl = match Workload::from_json(&serde_json::to_value(&fresh)?) {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(workload = %name, error = %e, "Kueue Workload not read");
            return Ok(Action::await_change());
        }
    };
    let Step::Configure { check } = step(&wl, &ours) else {
        return Ok(Action::await_change());
    };
    let owner = owner(ctx, &fresh, &ns).await?;
    let answer = configure(ctx, &wl, owner.as_ref().map(|o| &o.obj), &ns).await?;

    let pod_sets: Vec<String> = wl.spec.pod_sets.iter().map(|p| p.name.clone()).collect();
    let (pod_annotations, message) = match &answer {
        Answer::Configured {
            suggestion,
            mode: Mode::Inject,
            message,
            ..
        } => {
            let mut a = inject::setting_annotations(&suggestion.settings);
            a.extend(
                inject::annotations(suggestion, Mode::Inject)
                    .into_iter()
                    .filter(|(k, _)| k == ANN_APPLIED),
            );
            (a, message.clone())
        }
        Answer::Configured { message, .. } | Answer::NotOptedIn(message) => {
            (BTreeMap::new(), message.clone())
        }
        Answer::Failed(m) => (BTreeMap::new(), m.clone()),
    };
    // The owner first: if the check were Ready and this failed, the run
    // would be recorded with the settings of an earlier admission.
    if let Some(o) = &owner {
        if let Some(patch) = owner_patch(&answer) {
            o.api
                .patch(&o.name, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
        }
    }
    let now = Utc::now().to_rfc3339_opts(SecondsFormat::Secs, true);
    let body = status_apply(
        &name,
        &ns,
        fresh.resource_version().as_deref(),
        ready_check(&check, &pod_sets, &pod_annotations, &message, &now),
    );
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    match api.patch_status(&name, &pp, &Patch::Apply(&body)).await {
        Ok(_) => {}
        // Changed since read (Kueue evicted it, say): look again.
        Err(kube::Error::Api(e)) if e.code == 409 => {
            tracing::info!(workload = %format!("{ns}/{name}"), "Workload changed meanwhile; looking again");
            return Ok(Action::requeue(Duration::from_secs(1)));
        }
        Err(e) => return Err(e.into()),
    }
    match &answer {
        Answer::Failed(m) => {
            tracing::warn!(workload = %format!("{ns}/{name}"), reason = %m, "Kueue workload admitted unconfigured");
            event(ctx, &fresh, EventType::Warning, "NotConfigured", m).await;
        }
        Answer::Configured { message, .. } => {
            tracing::info!(workload = %format!("{ns}/{name}"), %message, "Kueue workload configured");
            event(ctx, &fresh, EventType::Normal, "Configured", message).await;
        }
        Answer::NotOptedIn(_) => {}
    }
    Ok(Action::await_change())
}

/// The owner job (controller owner reference), read from the API server.
async fn owner(
    ctx: &Context,
    wl: &DynamicObject,
    ns: &str,
) -> Result<Option<Owner>, ControllerError> {
    let refs = wl.owner_references();
    let Some(o) = refs
        .iter()
        .find(|o| o.controller == Some(true))
        .or(refs.first())
    else {
        return Ok(None);
    };
    let (group, version) = o
        .api_version
        .split_once('/')
        .unwrap_or(("", &o.api_version));
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, &o.kind));
    let api: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), ns, &ar);
    match api.get_opt(&o.name).await? {
        // A job of the same name created after ours was deleted is not ours.
        Some(obj) if obj.uid().as_deref() == Some(o.uid.as_str()) => Ok(Some(Owner {
            api,
            name: o.name.clone(),
            obj,
        })),
        _ => Ok(None),
    }
}

/// Decides the settings for this admission. Errors only for the API
/// server (retried); everything about the job is an [`Answer`].
async fn configure(
    ctx: &Context,
    wl: &Workload,
    owner: Option<&DynamicObject>,
    ns: &str,
) -> Result<Answer, ControllerError> {
    let Some(owner) = owner else {
        return Ok(Answer::NotOptedIn(
            "gpufit: the Workload's job is gone; nothing to configure".into(),
        ));
    };
    let anns = owner.annotations();
    let pod_sets = match admitted(wl) {
        Ok(p) => p,
        Err(e) => {
            return Ok(Answer::Failed(format!(
                "gpufit did not configure this job: {e}"
            )))
        }
    };
    let train = training(&pod_sets);
    let w = admitted_gpus(&train);
    let inputs = match inputs_for_admission(anns, w) {
        Ok(Some(i)) => i,
        Ok(None) => {
            return Ok(Answer::NotOptedIn(
                "gpufit: the job has no gpufit.io/model annotation; nothing to configure".into(),
            ))
        }
        Err(e) => {
            return Ok(Answer::Failed(format!(
                "gpufit did not configure this job: {e}"
            )))
        }
    };
    if let Err(e) = check_pins(&inputs.pins, &inputs.workload, "gpufit.io/pins") {
        return Ok(Answer::Failed(format!(
            "gpufit did not configure this job: {e}"
        )));
    }
    let ns_labels = ctx
        .namespaces
        .get(&reflector::ObjectRef::new(ns))
        .and_then(|n| n.metadata.labels.clone())
        .unwrap_or_default();
    let mode = match inputs.mode {
        Some(m) => m,
        None => match ns_labels.get(MODE_KEY).map(|v| v.parse::<Mode>()) {
            Some(Ok(m)) => m,
            Some(Err(e)) => {
                return Ok(Answer::Failed(format!(
                    "gpufit did not configure this job: namespace {ns} label {MODE_KEY}: {e}"
                )))
            }
            None => ctx.default_mode,
        },
    };
    let sharing = match gpu::sharing_of(Some(anns), Some((ns, &ns_labels))) {
        Ok(s) => s,
        Err(e) => {
            return Ok(Answer::Failed(format!(
                "gpufit did not configure this job: {e}"
            )))
        }
    };
    let (gpu, flavors) = match plan_gpu(ctx, &train, &inputs, sharing).await? {
        Ok(g) => g,
        Err(e) => {
            return Ok(Answer::Failed(format!(
                "gpufit did not configure this job: {e}"
            )))
        }
    };
    let cpus = train
        .first()
        .and_then(|p| gpu::cpus_per_gpu_json(&p.pod_spec));
    let (suggestion, history_note) = match suggest(ctx, &inputs, &gpu, cpus).await? {
        Ok(s) => s,
        Err(e) => {
            return Ok(Answer::Failed(format!(
                "gpufit did not configure this job: {e}"
            )))
        }
    };
    ctx.metrics.count_suggestion(Via::Webhook, &suggestion);
    let s = &suggestion.settings;
    let mut message = format!(
        "gpufit: {} on flavor {flavors}: micro batch {} × accumulation {} × W {w} GPUs = global batch {}; predicted peak {:.1} GiB",
        suggestion.gpu,
        s.micro_batch_size,
        s.gradient_accumulation_steps,
        suggestion.effective_batch(w),
        suggestion.predicted_peak_bytes as f64 / f64::from(1u32 << 30),
    );
    if mode == Mode::Recommend {
        message.push_str(" (Recommend mode: nothing set; see gpufit.io/recommendation)");
    }
    if let Some(n) = history_note {
        message.push_str(&format!(
            " (history store unavailable, memory model only: {n})"
        ));
    }
    Ok(Answer::Configured {
        suggestion: Box::new(suggestion),
        workload: Box::new(inputs.workload),
        mode,
        message,
    })
}

/// The GPU of the training pod sets' flavors (the smallest when they
/// differ), else the `gpufit.io/gpu` annotation; and the flavors' names.
async fn plan_gpu(
    ctx: &Context,
    train: &[&Admitted],
    inputs: &AdmissionInputs,
    sharing: gpu::Sharing,
) -> Result<Result<(GpuSpec, String), String>, ControllerError> {
    let flavors_api: Api<DynamicObject> = Api::all_with(ctx.client.clone(), &resource_flavors());
    let mut labels_of: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    let mut gpus = Vec::new();
    let mut errors = Vec::new();
    for ps in train {
        let flavor = ps.flavor.clone().unwrap_or_default();
        if !flavor.is_empty() && !labels_of.contains_key(&flavor) {
            let labels = flavors_api
                .get_opt(&flavor)
                .await?
                .and_then(|f| serde_json::from_value(f.data["spec"]["nodeLabels"].clone()).ok())
                .unwrap_or_default();
            labels_of.insert(flavor.clone(), labels);
        }
        let labels = labels_of.get(&flavor).cloned().unwrap_or_default();
        let nodes = ctx.nodes.state();
        match flavor_gpu(ps, &labels, nodes.iter().map(|n| n.as_ref()), sharing) {
            Ok(g) => gpus.push(g),
            Err(e) => errors.push(format!("pod set {} (flavor {flavor}): {e}", ps.name)),
        }
    }
    let names = {
        let f: Vec<&str> = train
            .iter()
            .filter_map(|p| p.flavor.as_deref())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        if f.is_empty() {
            "(none)".to_string()
        } else {
            f.join(", ")
        }
    };
    if errors.is_empty() {
        if let Some(g) = smallest(gpus) {
            return Ok(Ok((g, names)));
        }
    }
    // The flavor does not tell: the job's own annotation, when it has one.
    if let Some(n) = &inputs.gpu {
        return Ok(gpu::resolve_named(n)
            .map(|g| (g, names))
            .map_err(|e| format!("annotation gpufit.io/gpu: {e}")));
    }
    Ok(Err(errors.join("; ")))
}

/// The one pipeline's suggestion (blocking, off the async threads). The
/// history store being down does not hold the job: the memory model alone
/// answers, and the note says so.
async fn suggest(
    ctx: &Context,
    inputs: &AdmissionInputs,
    gpu: &GpuSpec,
    cpus: Option<u32>,
) -> Result<Result<(Suggestion, Option<String>), String>, ControllerError> {
    let (history, targets) = (ctx.history.clone(), ctx.targets);
    let (inputs, gpu) = (inputs.clone(), gpu.clone());
    tokio::task::spawn_blocking(move || {
        let p = Pipeline::new(targets).with_cpus_per_gpu(cpus);
        let ask = Ask {
            workload: &inputs.workload,
            gpu: &gpu,
            strategy: inputs.strategy,
            pins: &inputs.pins,
        };
        match p.suggest(history.as_ref(), &ask) {
            Ok(s) => Ok((s, None)),
            Err(PipelineError::History(e)) => p
                .advise(&ask, &[])
                .map(|s| (s, Some(e.to_string())))
                .map_err(|e| e.to_string()),
            Err(PipelineError::Advisor(e)) => Err(e.to_string()),
        }
    })
    .await
    .map_err(|e| ControllerError::Other(format!("advisor task failed: {e}")))
}

/// The owner's annotations for this answer: what the run recorder reads
/// (`gpufit.io/applied-settings`, `gpufit.io/workload` with the admitted
/// W) in Inject mode, the recommendation in Recommend mode; a failed
/// answer removes the settings of an earlier admission (the pods of this
/// one do not have them).
fn owner_patch(answer: &Answer) -> Option<Value> {
    let anns = match answer {
        Answer::Configured {
            suggestion,
            workload,
            mode,
            ..
        } => {
            let mut a: serde_json::Map<String, Value> = inject::annotations(suggestion, *mode)
                .into_iter()
                .map(|(k, v)| (k, Value::String(v)))
                .collect();
            if *mode == Mode::Inject {
                a.insert(
                    ANN_WORKLOAD.into(),
                    json!(serde_json::to_string(workload).ok()),
                );
                a.insert(ANN_RECOMMENDATION.into(), Value::Null);
            }
            Value::Object(a)
        }
        Answer::Failed(m) => json!({ANN_APPLIED: null, ANN_REASON: m}),
        Answer::NotOptedIn(_) => return None,
    };
    Some(json!({"metadata": {"annotations": anns}}))
}

/// An Event on the Workload (best effort: a failure is only logged).
async fn event(ctx: &Context, wl: &DynamicObject, type_: EventType, reason: &str, note: &str) {
    let reference = ObjectReference {
        api_version: Some(format!("{GROUP}/{VERSION}")),
        kind: Some("Workload".into()),
        name: wl.metadata.name.clone(),
        namespace: wl.metadata.namespace.clone(),
        uid: wl.metadata.uid.clone(),
        resource_version: wl.metadata.resource_version.clone(),
        field_path: None,
    };
    let ev = Event {
        type_,
        reason: reason.into(),
        note: Some(note.chars().take(1000).collect()),
        action: "AdmissionCheck".into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&ev, &reference).await {
        tracing::warn!(error = %e, reason, "cannot publish event");
    }
}

/// Bounded backoff; never a crash.
pub fn kueue_error_policy(
    obj: Arc<DynamicObject>,
    err: &ControllerError,
    k: Arc<KueueContext>,
) -> Action {
    let key = format!(
        "Workload/{}/{}",
        obj.namespace().unwrap_or_default(),
        obj.name_any()
    );
    let wait = k.ctx.next_backoff(&key);
    tracing::warn!(workload = %key, error = %err, retry_in = ?wait, "answering gpufit's Kueue admission check failed");
    Action::requeue(wait)
}

/// The status patch that marks one of our AdmissionChecks `Active` (None
/// when it already is, or is not ours).
pub fn activation(check: &DynamicObject, now: &str) -> Option<Value> {
    if check.data["spec"]["controllerName"].as_str() != Some(CONTROLLER_NAME) {
        return None;
    }
    let active = check.data["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == CONDITION_ACTIVE && c["status"] == "True");
    if active {
        return None;
    }
    Some(json!({
        "apiVersion": format!("{GROUP}/{VERSION}"),
        "kind": "AdmissionCheck",
        "metadata": {"name": check.name_any()},
        "status": {"conditions": [{
            "type": CONDITION_ACTIVE, "status": "True", "reason": "Active",
            "message": "gpufit answers this admission check",
            "lastTransitionTime": now,
            "observedGeneration": check.metadata.generation,
        }]}
    }))
}

/// Marks our AdmissionChecks `Active` (the reconciler of AdmissionChecks).
async fn reconcile_check(
    obj: Arc<DynamicObject>,
    k: Arc<KueueContext>,
) -> Result<Action, ControllerError> {
    let now = Utc::now().to_rfc3339_opts(SecondsFormat::Secs, true);
    if let Some(body) = activation(&obj, &now) {
        let api: Api<DynamicObject> = Api::all_with(k.ctx.client.clone(), &admission_checks());
        api.patch_status(
            &obj.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await?;
        tracing::info!(check = %obj.name_any(), "Kueue AdmissionCheck marked Active");
    }
    Ok(Action::await_change())
}

/// Runs the AdmissionCheck controller: marks our AdmissionChecks `Active`
/// and answers our check on Workloads (in `namespace`, or all), until the
/// streams end.
pub async fn run_kueue_controllers(client: Client, ctx: Arc<Context>, namespace: Option<String>) {
    let checks_api: Api<DynamicObject> = Api::all_with(client.clone(), &admission_checks());
    let writer = reflector::store::Writer::new(admission_checks());
    let checks = writer.as_reader();
    let cache = reflector::reflector(
        writer,
        watcher(checks_api.clone(), watcher::Config::default()),
    )
    .default_backoff()
    .touched_objects()
    .for_each(|r| {
        if let Err(e) = r {
            tracing::warn!(error = %e, "Kueue AdmissionCheck watch failed; retrying");
        }
        futures::future::ready(())
    });
    tokio::spawn(cache);
    let k = Arc::new(KueueContext {
        ctx,
        checks: checks.clone(),
    });
    let wl_api: Api<DynamicObject> = match &namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &workloads()),
        None => Api::all_with(client.clone(), &workloads()),
    };
    let check_controller =
        Controller::new_with(checks_api, watcher::Config::default(), admission_checks())
            .run(reconcile_check, kueue_error_policy, k.clone())
            .for_each(log_result);
    let wl_controller = async move {
        // Which checks are ours must be known before Workloads are judged.
        let _ = checks.wait_until_ready().await;
        Controller::new_with(wl_api, watcher::Config::default(), workloads())
            .run(reconcile_kueue_workload, kueue_error_policy, k)
            .for_each(log_result)
            .await
    };
    futures::future::join(check_controller, wl_controller).await;
}

fn log_result<T, E: std::fmt::Display>(r: Result<T, E>) -> futures::future::Ready<()> {
    if let Err(e) = r {
        tracing::debug!(error = %e, "Kueue reconcile stream");
    }
    futures::future::ready(())
}
