//! gpufit's Kueue AdmissionCheck controller (`controllerName:
//! gpufit.io/advisor`): when Kueue reserves quota for a Workload on a
//! flavor, the settings for that flavor's GPU and the admitted counts are
//! decided and handed to Kueue as `podSetUpdates` (pod annotations the
//! containers read through the downward API, injected at creation by the
//! webhook). Thin I/O around the pure [`crate::controller::kueue`] and the
//! one admission plan ([`crate::controller::plan`]).
//!
//! **Never hold quota.** Kueue has no timeout for a Pending check, so
//! every Workload that names a gpufit check is answered `Ready` within
//! [`ANSWER_BUDGET`] of this replica seeing its quota reserved, whatever
//! owns it:
//!
//! - a kind gpufit does not describe ([`crate::controller::kinds`]: a
//!   RayJob, an MPIJob…) is not even read (the chart's RBAC would refuse):
//!   `Ready`, no changes, a Warning Event;
//! - an owner that cannot be read (403, 404, gone) likewise;
//! - a job gpufit cannot configure (no GPU known, nothing fits, a bad
//!   annotation), or one whose answer takes longer than the budget
//!   (history store, API server slow), is answered with its fallback
//!   settings — the user's pins over safe values — so that no container
//!   reads an empty setting;
//! - every gpufit check on the Workload is answered, in one write.
//!
//! `Rejected` would deactivate the workload; `Retry` would give its quota
//! back to be admitted again, likely the same way: neither is ever used.
//!
//! **Never FailedToStart.** No update carries a key the pod set's template
//! already has with another value ([`conflict_free`]); a pod set whose
//! containers read deferred settings always gets every setting key, so a
//! re-admission to another flavor overwrites all of them (JobSet merges
//! template annotations into its existing child Jobs).
//!
//! Only the leader answers, and leadership is checked again right before
//! each write (the owner's annotations, then the Workload's status). The
//! Workload is written by server-side apply with the copy's
//! `resourceVersion`: a Workload changed meanwhile is a conflict, looked at
//! again.
//!
//! The AdmissionChecks with our controller name are marked `Active`, which
//! a ClusterQueue needs before it admits anything.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
use crate::controller::inject;
use crate::controller::keys::{ANN_APPLIED, ANN_REASON, ANN_RECOMMENDATION, ANN_WORKLOAD};
use crate::controller::kinds;
use crate::controller::kueue::{
    admitted, admitted_gpus, conflict_free, deferred, flavor_gpu, pick_version, ready_check,
    smallest, status_apply, step, training, Admitted, Step, Workload, CONDITION_ACTIVE,
    CONTROLLER_NAME, GROUP,
};
use crate::controller::metrics::Via;
use crate::controller::plan::{self, NoPlan, NoSuggestion, Plan, PlanInputs};
use crate::controller::ControllerError;
use crate::core::advisor::Suggestion;
use crate::core::catalog::GpuSpec;
use crate::core::settings::EngineeringSettings;

use super::context::Context;

/// Field manager of gpufit's writes to Kueue objects.
pub const FIELD_MANAGER: &str = "gpufit-advisor";

/// The longest gpufit works on one answer once it has seen a Workload's
/// quota reserved: past it, the answer is the fallback settings (the
/// Workload is never held for gpufit's own dependencies). With leader
/// election, a Workload waits at most the Lease duration (a failover)
/// plus this.
pub const ANSWER_BUDGET: Duration = Duration::from_secs(5);

/// Retries within the budget (an API call that failed) come this soon.
const RETRY: Duration = Duration::from_millis(500);

fn resource(version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, version, kind), plural)
}

/// `kueue.x-k8s.io/<version>` Workloads.
pub fn workloads(version: &str) -> ApiResource {
    resource(version, "Workload", "workloads")
}

/// `kueue.x-k8s.io/<version>` AdmissionChecks (cluster-scoped).
pub fn admission_checks(version: &str) -> ApiResource {
    resource(version, "AdmissionCheck", "admissionchecks")
}

/// `kueue.x-k8s.io/<version>` ResourceFlavors (cluster-scoped).
pub fn resource_flavors(version: &str) -> ApiResource {
    resource(version, "ResourceFlavor", "resourceflavors")
}

/// `kueue.x-k8s.io/<version>` LocalQueues (for LocalQueueDefaulting).
pub fn local_queues(version: &str) -> ApiResource {
    resource(version, "LocalQueue", "localqueues")
}

/// The Kueue API version to speak, from the API server's discovery: the
/// newest gpufit knows that Kueue serves ([`pick_version`]).
pub async fn discover_version(client: &Client) -> Result<&'static str, ControllerError> {
    let groups = client.list_api_groups().await?;
    let served: Vec<String> = groups
        .groups
        .iter()
        .filter(|g| g.name == GROUP)
        .flat_map(|g| g.versions.iter().map(|v| v.version.clone()))
        .collect();
    pick_version(&served).ok_or_else(|| {
        ControllerError::Other(format!(
            "--kueue: the API server serves no Kueue API gpufit speaks ({GROUP} versions served: {}; \
             gpufit speaks {}): install Kueue, or run without --kueue",
            if served.is_empty() { "none".to_string() } else { served.join(", ") },
            crate::controller::kueue::VERSIONS.join(", ")
        ))
    })
}

/// What the Kueue reconciler shares.
pub struct KueueContext {
    pub ctx: Arc<Context>,
    /// AdmissionChecks, from a reflector: which check names are ours.
    pub checks: Store<DynamicObject>,
    /// The Kueue API version spoken (from discovery).
    pub version: &'static str,
    /// When this replica first saw each Workload waiting on our answer
    /// (`ns/name/uid`): the start of its [`ANSWER_BUDGET`].
    seen: Mutex<HashMap<String, Instant>>,
}

impl KueueContext {
    pub fn new(ctx: Arc<Context>, checks: Store<DynamicObject>, version: &'static str) -> Self {
        KueueContext {
            ctx,
            checks,
            version,
            seen: Mutex::new(HashMap::new()),
        }
    }

    /// How long this replica has been answering `key` (starting now when new).
    fn elapsed(&self, key: &str) -> Duration {
        let Ok(mut m) = self.seen.lock() else {
            return Duration::ZERO;
        };
        if m.len() > 100_000 {
            m.clear();
        }
        m.entry(key.to_string())
            .or_insert_with(Instant::now)
            .elapsed()
    }

    fn forget(&self, key: &str) {
        if let Ok(mut m) = self.seen.lock() {
            m.remove(key);
        }
    }
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
    /// The owner is a kind gpufit does not describe, or cannot be read:
    /// nothing to set (a Warning Event says why).
    Unknown(String),
    /// gpufit cannot configure it: the fallback settings (when the plan
    /// was readable; else the template's own fallback) for deferred pods.
    Failed(String, Option<EngineeringSettings>),
}

impl Answer {
    fn label(&self) -> &'static str {
        match self {
            Answer::Configured { .. } => "configured",
            Answer::NotOptedIn(_) => "not_opted_in",
            Answer::Unknown(_) => "unknown_owner",
            Answer::Failed(..) => "not_configured",
        }
    }
}

/// The owner job of a Workload (its controller owner reference).
struct Owner {
    api: Api<DynamicObject>,
    name: String,
    obj: DynamicObject,
}

/// Where the owner lookup stands.
enum Lookup {
    Found(Box<Owner>),
    /// No answer about the owner's settings (the message says why).
    Nothing(Answer),
}

/// Answers gpufit's checks on one Workload (the `Controller::run` reconciler).
pub async fn reconcile_kueue_workload(
    obj: Arc<DynamicObject>,
    k: Arc<KueueContext>,
) -> Result<Action, ControllerError> {
    let ctx = &k.ctx;
    if !ctx.is_leading() {
        return Ok(Action::await_change());
    }
    let ours = our_checks(&k.checks);
    let cached = match Workload::from_json(&serde_json::to_value(obj.as_ref())?) {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(workload = %obj.name_any(), error = %e, "Kueue Workload not read");
            return Ok(Action::await_change());
        }
    };
    let ns = obj.namespace().unwrap_or_default();
    let name = obj.name_any();
    let key = format!("{ns}/{name}/{}", obj.uid().unwrap_or_default());
    if let Step::Wait(_) = step(&cached, &ours) {
        k.forget(&key);
        return Ok(Action::await_change());
    }
    let elapsed = k.elapsed(&key);
    // The cache may be behind our own answer: the API server's copy decides.
    let api: Api<DynamicObject> =
        Api::namespaced_with(ctx.client.clone(), &ns, &workloads(k.version));
    let Some(fresh) = api.get_opt(&name).await? else {
        k.forget(&key);
        return Ok(Action::await_change());
    };
    let wl = match Workload::from_json(&serde_json::to_value(&fresh)?) {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(workload = %name, error = %e, "Kueue Workload not read");
            return Ok(Action::await_change());
        }
    };
    let Step::Configure { checks } = step(&wl, &ours) else {
        k.forget(&key);
        return Ok(Action::await_change());
    };

    // Within the budget, the answer; past it (or on its deadline), the fallback.
    let left = ANSWER_BUDGET.saturating_sub(elapsed);
    let work = async {
        let owner = match owner(ctx, &fresh, &ns).await? {
            Lookup::Found(o) => o,
            Lookup::Nothing(a) => return Ok((None, a)),
        };
        let answer = configure(ctx, k.version, &wl, &owner.obj, &ns).await?;
        Ok::<_, ControllerError>((Some(owner), answer))
    };
    let late = |why: &str| {
        Answer::Failed(
            format!("gpufit did not configure this job within {ANSWER_BUDGET:?}: {why}; fallback settings"),
            None,
        )
    };
    let (owner, answer) = if left.is_zero() {
        (None, late("out of time"))
    } else {
        match tokio::time::timeout(left, work).await {
            Ok(Ok(r)) => r,
            // An API call failed: again soon, while the budget lasts.
            Ok(Err(e)) if ANSWER_BUDGET.saturating_sub(k.elapsed(&key)) > RETRY => {
                tracing::info!(workload = %key, error = %e, "answering gpufit's check: retrying");
                return Ok(Action::requeue(RETRY));
            }
            Ok(Err(e)) => (None, late(&e.to_string())),
            Err(_) => (None, late("timed out")),
        }
    };

    let updates = pod_set_updates(&wl, &answer);
    let message = match &answer {
        Answer::Configured { message, .. }
        | Answer::NotOptedIn(message)
        | Answer::Unknown(message) => message.clone(),
        Answer::Failed(m, _) => m.clone(),
    };
    // The owner first: if the check were Ready and this failed, the run
    // would be recorded with the settings of an earlier admission.
    if let Some(o) = &owner {
        if let Some(patch) = owner_patch(&answer) {
            if !ctx.is_leading() {
                return Ok(Action::await_change());
            }
            o.api
                .patch(&o.name, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
        }
    }
    let now = Utc::now().to_rfc3339_opts(SecondsFormat::Secs, true);
    let answers = checks
        .iter()
        .map(|c| ready_check(c, &updates, &message, &now))
        .collect();
    let body = status_apply(
        k.version,
        &name,
        &ns,
        fresh.resource_version().as_deref(),
        answers,
    );
    if !ctx.is_leading() {
        return Ok(Action::await_change());
    }
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    match api.patch_status(&name, &pp, &Patch::Apply(&body)).await {
        Ok(_) => {}
        // Changed since read (Kueue evicted it, say): look again.
        Err(kube::Error::Api(e)) if e.code == 409 => {
            tracing::info!(workload = %format!("{ns}/{name}"), "Workload changed meanwhile; looking again");
            return Ok(Action::requeue(Duration::from_millis(200)));
        }
        Err(e) => return Err(e.into()),
    }
    k.forget(&key);
    ctx.metrics
        .kueue_answers
        .with_label_values(&[answer.label()])
        .inc();
    if let Some(at) = wl.reserved_at() {
        let waited = (Utc::now() - at).num_milliseconds().max(0) as f64 / 1000.0;
        ctx.metrics.kueue_wait.observe(waited);
    }
    match &answer {
        Answer::Failed(m, _) => {
            tracing::warn!(workload = %format!("{ns}/{name}"), reason = %m, "Kueue workload admitted with fallback settings");
            event(
                ctx,
                k.version,
                &fresh,
                EventType::Warning,
                "NotConfigured",
                m,
            )
            .await;
        }
        Answer::Unknown(m) => {
            tracing::warn!(workload = %format!("{ns}/{name}"), reason = %m, "Kueue workload admitted unchanged");
            event(
                ctx,
                k.version,
                &fresh,
                EventType::Warning,
                "NotConfigured",
                m,
            )
            .await;
        }
        Answer::Configured { message, .. } => {
            tracing::info!(workload = %format!("{ns}/{name}"), %message, "Kueue workload configured");
            event(
                ctx,
                k.version,
                &fresh,
                EventType::Normal,
                "Configured",
                message,
            )
            .await;
        }
        Answer::NotOptedIn(_) => {}
    }
    Ok(Action::await_change())
}

/// Each pod set's update for this answer: the settings (Inject mode), or
/// — for a pod set whose containers read deferred settings — the fallback,
/// so every setting key is always set; never a key the template already
/// has with another value.
fn pod_set_updates(wl: &Workload, answer: &Answer) -> Vec<(String, BTreeMap<String, String>)> {
    wl.spec
        .pod_sets
        .iter()
        .map(|ps| {
            let template_fallback = deferred(&ps.template);
            let mut a = match answer {
                Answer::Configured {
                    suggestion,
                    mode: Mode::Inject,
                    ..
                } => {
                    let mut a = inject::setting_annotations(&suggestion.settings);
                    a.extend(
                        inject::annotations(suggestion, Mode::Inject)
                            .into_iter()
                            .filter(|(k, _)| k == ANN_APPLIED),
                    );
                    a
                }
                Answer::Failed(_, Some(s)) if template_fallback.is_some() => {
                    inject::setting_annotations(s)
                }
                _ => template_fallback.clone().unwrap_or_default(),
            };
            // A deferred pod set missing a key (an older template): defaults.
            if template_fallback.is_some() {
                for (k, v) in inject::setting_annotations(&EngineeringSettings::default()) {
                    a.entry(k).or_insert(v);
                }
            }
            let (keep, dropped) = conflict_free(&ps.template, &a);
            if !dropped.is_empty() {
                tracing::info!(pod_set = %ps.name, ?dropped, "kept the template's own value (Kueue refuses a conflicting update)");
            }
            (ps.name.clone(), keep)
        })
        .collect()
}

/// The owner job (controller owner reference), read from the API server
/// when it is a kind gpufit describes. Errors only for a transient API
/// failure (retried within the budget); anything else is an answer.
async fn owner(ctx: &Context, wl: &DynamicObject, ns: &str) -> Result<Lookup, ControllerError> {
    let refs = wl.owner_references();
    let Some(o) = refs
        .iter()
        .find(|o| o.controller == Some(true))
        .or(refs.first())
    else {
        return Ok(Lookup::Nothing(Answer::NotOptedIn(
            "gpufit: the Workload has no owner job; nothing to configure".into(),
        )));
    };
    let Some(kind) = kinds::of_api_version(&o.api_version, &o.kind) else {
        return Ok(Lookup::Nothing(Answer::Unknown(format!(
            "gpufit does not configure a {} ({}); admitted unchanged",
            o.kind, o.api_version
        ))));
    };
    let api: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), ns, &kind.resource());
    match api.get_opt(&o.name).await {
        // A job of the same name created after ours was deleted is not ours.
        Ok(Some(obj)) if obj.uid().as_deref() == Some(o.uid.as_str()) => {
            Ok(Lookup::Found(Box::new(Owner {
                api,
                name: o.name.clone(),
                obj,
            })))
        }
        Ok(_) => Ok(Lookup::Nothing(Answer::NotOptedIn(
            "gpufit: the Workload's job is gone; nothing to configure".into(),
        ))),
        // Forbidden, or any other refusal: it will not change by retrying.
        Err(kube::Error::Api(e)) if (400..500).contains(&e.code) && e.code != 429 => {
            Ok(Lookup::Nothing(Answer::Unknown(format!(
                "gpufit cannot read the {} {} ({} {}); admitted unchanged",
                o.kind, o.name, e.code, e.reason
            ))))
        }
        Err(e) => Err(e.into()),
    }
}

/// Decides the settings for this admission through the one admission
/// plan. Errors only for the API server (retried within the budget);
/// everything about the job is an [`Answer`].
async fn configure(
    ctx: &Context,
    version: &str,
    wl: &Workload,
    owner: &DynamicObject,
    ns: &str,
) -> Result<Answer, ControllerError> {
    let failed = |e: &dyn std::fmt::Display, plan: Option<&Plan>, w: u32| {
        Answer::Failed(
            format!("gpufit did not configure this job: {e}"),
            plan.map(|p| plan::fallback(p, Some(w))),
        )
    };
    let pod_sets = match admitted(wl) {
        Ok(p) => p,
        Err(e) => return Ok(failed(&e, None, 1)),
    };
    let train = training(&pod_sets);
    let w = admitted_gpus(&train);
    let ns_obj = ctx.namespaces.get(&reflector::ObjectRef::new(ns));
    let ns_labels = ns_obj.as_ref().and_then(|n| n.metadata.labels.as_ref());
    let inputs = PlanInputs {
        annotations: owner.annotations(),
        namespace: Some((ns, ns_labels)),
        default_mode: ctx.default_mode,
        gpus: Some(w),
        admitted: true,
    };
    let plan = match plan::plan(&inputs) {
        Ok(p) => p,
        Err(NoPlan::NotOptedIn) => {
            return Ok(Answer::NotOptedIn(
                "gpufit: the job has no gpufit.io/model annotation; nothing to configure".into(),
            ))
        }
        Err(NoPlan::Denied(m) | NoPlan::Unplannable(m)) => {
            return Ok(Answer::Failed(
                format!("gpufit did not configure this job: {m}"),
                None,
            ))
        }
    };
    let (gpu, flavors) = match plan_gpu(ctx, version, &train, &plan, plan.sharing).await? {
        Ok(g) => g,
        Err(e) => return Ok(failed(&e, Some(&plan), w)),
    };
    let cpus = train
        .first()
        .and_then(|p| gpu::cpus_per_gpu_json(&p.pod_spec));
    let (suggestion, history_note) = match suggest(ctx, &plan, &gpu, cpus).await? {
        Ok(s) => s,
        Err(e) => return Ok(failed(&e, Some(&plan), w)),
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
    if plan.mode == Mode::Recommend {
        message.push_str(" (Recommend mode: nothing set; see gpufit.io/recommendation)");
    }
    if let Some(n) = history_note {
        message.push_str(&format!(
            " (history store unavailable, memory model only: {n})"
        ));
    }
    Ok(Answer::Configured {
        suggestion: Box::new(suggestion),
        workload: Box::new(plan.workload),
        mode: plan.mode,
        message,
    })
}

/// The GPU of the training pod sets' flavors (the smallest when they
/// differ), else the `gpufit.io/gpu` annotation; and the flavors' names.
async fn plan_gpu(
    ctx: &Context,
    version: &str,
    train: &[&Admitted],
    plan: &Plan,
    sharing: gpu::Sharing,
) -> Result<Result<(GpuSpec, String), String>, ControllerError> {
    let flavors_api: Api<DynamicObject> =
        Api::all_with(ctx.client.clone(), &resource_flavors(version));
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
    if let Some(n) = &plan.gpu {
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
    plan: &Plan,
    gpu: &GpuSpec,
    cpus: Option<u32>,
) -> Result<Result<(Suggestion, Option<String>), String>, ControllerError> {
    let (history, targets) = (ctx.history.clone(), ctx.targets);
    let (plan, gpu) = (plan.clone(), gpu.clone());
    tokio::task::spawn_blocking(move || {
        match plan::suggest(&plan, &gpu, cpus, targets, history.as_ref()) {
            Ok(s) => Ok((s, None)),
            Err(NoSuggestion::History(e)) => {
                plan::suggest_without_history(&plan, &gpu, cpus, targets)
                    .map(|s| (s, Some(e.to_string())))
                    .map_err(|e| e.to_string())
            }
            Err(e) => Err(e.to_string()),
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
        Answer::Failed(m, _) => json!({ANN_APPLIED: null, ANN_REASON: m}),
        Answer::NotOptedIn(_) | Answer::Unknown(_) => return None,
    };
    Some(json!({"metadata": {"annotations": anns}}))
}

/// An Event on the Workload (best effort: a failure is only logged).
async fn event(
    ctx: &Context,
    version: &str,
    wl: &DynamicObject,
    type_: EventType,
    reason: &str,
    note: &str,
) {
    let reference = ObjectReference {
        api_version: Some(format!("{GROUP}/{version}")),
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

/// Short retries (within [`ANSWER_BUDGET`] the answer falls back anyway;
/// a status write the API server refuses is retried every few seconds,
/// never minutes); never a crash.
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
    let wait = k.ctx.next_backoff(&key).min(Duration::from_secs(2));
    tracing::warn!(workload = %key, error = %err, retry_in = ?wait, "answering gpufit's Kueue admission check failed");
    Action::requeue(wait)
}

/// The status patch that marks one of our AdmissionChecks `Active` (None
/// when it already is, or is not ours), in API `version`.
pub fn activation(version: &str, check: &DynamicObject, now: &str) -> Option<Value> {
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
        "apiVersion": format!("{GROUP}/{version}"),
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
    if let Some(body) = activation(k.version, &obj, &now) {
        if !k.ctx.is_leading() {
            return Ok(Action::await_change());
        }
        let api: Api<DynamicObject> =
            Api::all_with(k.ctx.client.clone(), &admission_checks(k.version));
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

/// The age in seconds of the oldest Workload waiting on one of `ours`
/// (quota reserved, check Pending), 0 when none — what the chart's alert
/// watches (Kueue itself never times a Pending check out).
pub fn oldest_pending(
    workloads: &[Arc<DynamicObject>],
    ours: &BTreeSet<String>,
    now: chrono::DateTime<Utc>,
) -> f64 {
    workloads
        .iter()
        .filter_map(|o| Workload::from_json(&serde_json::to_value(o.as_ref()).ok()?).ok())
        .filter(|w| matches!(step(w, ours), Step::Configure { .. }))
        .filter_map(|w| w.reserved_at())
        .map(|t| (now - t).num_milliseconds().max(0) as f64 / 1000.0)
        .fold(0.0, f64::max)
}

/// Runs the AdmissionCheck controller in Kueue API `version`: marks our
/// AdmissionChecks `Active` and answers our checks on the Workloads of
/// every namespace (a check in a namespace gpufit did not watch would
/// never be answered), until the streams end.
pub async fn run_kueue_controllers(client: Client, ctx: Arc<Context>, version: &'static str) {
    let checks_api: Api<DynamicObject> = Api::all_with(client.clone(), &admission_checks(version));
    let writer = reflector::store::Writer::new(admission_checks(version));
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
    let cache = tokio::spawn(cache);
    let k = Arc::new(KueueContext::new(ctx, checks.clone(), version));
    let wl_api: Api<DynamicObject> = Api::all_with(client.clone(), &workloads(version));
    let check_controller = Controller::new_with(
        checks_api,
        watcher::Config::default(),
        admission_checks(version),
    )
    .run(reconcile_check, kueue_error_policy, k.clone())
    .for_each(log_result);
    let wl_controller = async move {
        // Which checks are ours must be known before Workloads are judged.
        let _ = checks.wait_until_ready().await;
        let controller =
            Controller::new_with(wl_api, watcher::Config::default(), workloads(version));
        let store = controller.store();
        let (gauge_k, gauge_checks) = (k.clone(), checks.clone());
        let gauge = tokio::spawn(async move {
            loop {
                let age = oldest_pending(&store.state(), &our_checks(&gauge_checks), Utc::now());
                gauge_k.ctx.metrics.kueue_pending_oldest.set(age);
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        });
        controller
            .run(reconcile_kueue_workload, kueue_error_policy, k)
            .for_each(log_result)
            .await;
        gauge.abort();
    };
    futures::future::join(check_controller, wl_controller).await;
    cache.abort();
}

fn log_result<T, E: std::fmt::Display>(r: Result<T, E>) -> futures::future::Ready<()> {
    if let Err(e) = r {
        tracing::debug!(error = %e, "Kueue reconcile stream");
    }
    futures::future::ready(())
}
