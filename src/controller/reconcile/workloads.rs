//! Workloads the admission webhook configured (a `batch/v1` Job, a Kubeflow
//! `PyTorchJob`, a `JobSet`, a Kubeflow Trainer `TrainJob`): when one ends, its run is recorded once, with the same
//! rules as a TrainingJob's attempt, so the next submission learns from it.
//!
//! At admission the webhook labels the object and its pod templates
//! ([`LABEL_CONFIGURED`]) and writes the resolved workload
//! ([`ANN_WORKLOAD`]) next to the applied settings (`gpufit.io/applied-settings`:
//! settings, predicted peak, GPU). The leader watches only labelled objects,
//! so its memory grows with what gpufit configured, not with the cluster.
//!
//! - Outcome: the owner's end condition (`Complete`/`Failed` for a Job,
//!   `Succeeded`/`Failed` for a PyTorchJob, `Completed`/`Failed` for a
//!   JobSet, `Complete`/`Failed` for a TrainJob); a failure is classified from
//!   every pod by [`classify_pods`] (one CUDA OOM anywhere: the workload
//!   ran out of GPU memory; a host `OOMKilled`: `other_error`).
//! - Pods: those it owns; a JobSet's (owned by its child Jobs) and a
//!   TrainJob's (its runtime JobSet's, named after it) by the label
//!   `jobset.sigs.k8s.io/jobset-name`. A JobSet's child Job and a
//!   TrainJob's JobSet are never recorded themselves.
//! - Peak: the maximum over all its pods and GPUs (one query over every
//!   pod); a peak not there yet is filled in later, paced like a
//!   TrainingJob's ([`MAX_PEAK_LOOKUPS`]).
//! - Duration: from `status.startTime`, or (a JobSet, a TrainJob: their
//!   status has none) the earliest training pod's start (those asking for
//!   GPUs: not a TrainJob's initializers), to the end condition.
//! - Tokens/s: as the job printed it, read from the lowest rank that
//!   printed one (the master first) — not summed over ranks, like the
//!   single-pod TrainingJob, whose one pod prints what its rank 0 prints.
//! - Only the leader records ([`Context::is_leading`], checked before the
//!   API server is asked and again right before each write): a standby
//!   replica, or one that lost the Lease mid-reconcile, writes nothing.
//! - Exactly once: the run's identity is (source, cluster, `Kind:ns/name/uid`),
//!   so recording again updates the same row; the object is then annotated
//!   [`ANN_RECORDED`], read fresh from the API server before recording so a
//!   stale cached copy records nothing.
//! - A workload deleted before it ended is **not recorded** (what it would
//!   have done is unknown); nothing is retried on this path — the owner's
//!   controller restarts its pods, and the next submission learns.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use serde_json::{json, Value};

use crate::controller::crd::{AttemptOutcome, SettingsStatus};
use crate::controller::gpu::pod_gpus;
use crate::controller::keys::ANN_APPLIED;
use crate::controller::kinds::{self, TrainingKind};
use crate::controller::metrics::RunOutcome;
use crate::controller::ControllerError;
use crate::core::run::{
    FailureReason, RunKey, RunOrigin, RunPath, RunRecord, RunResult, RunSource,
};
use crate::core::workload::Workload;

use super::context::{Context, PeakQuery, PodRef};
use super::observe::{classify_pods, host_oom_killed, reported_tokens_per_sec, unix};
use super::peaks::read_peak;
use super::MAX_PEAK_LOOKUPS;

pub use crate::controller::keys::{ANN_PEAK_PENDING, ANN_RECORDED, ANN_WORKLOAD, LABEL_CONFIGURED};
pub use crate::controller::kinds::{mark_for_recording, LABEL_JOBSET_NAME, LABEL_JOBSET_UID};

/// The kinds whose runs are recorded (read-only watches, plus the
/// annotation patch): every kind of [`kinds::KINDS`].
pub fn kinds() -> Vec<ApiResource> {
    kinds::KINDS.iter().map(|k| k.resource()).collect()
}

/// The kind of a watched object (its `kind`).
fn kind_of(obj: &DynamicObject) -> Option<&'static dyn TrainingKind> {
    let t = obj.types.as_ref()?;
    kinds::of_api_version(&t.api_version, &t.kind)
}

/// A child object another recorded workload stands for: a Job a JobSet
/// created, or a JobSet a TrainJob created. Never recorded itself (its
/// parent's run is the one record).
fn is_child(obj: &DynamicObject) -> bool {
    obj.labels().contains_key(LABEL_JOBSET_NAME)
        || obj.owner_references().iter().any(|o| {
            // A kind whose pods are its child Jobs' (JobSet, TrainJob).
            kinds::of_api_version(&o.api_version, &o.kind).is_some_and(|k| k.pods_by_jobset_label())
        })
}

/// Where a workload stands, from its `status.conditions`.
#[derive(Debug, Clone, PartialEq)]
pub enum Progress {
    Running,
    /// Ended; `at` is when (RFC 3339), when the object says.
    Ended {
        success: bool,
        at: Option<String>,
    },
}

/// The end condition of the object's kind ([`TrainingKind::end`]: a Job's
/// `Complete`/`Failed`, a PyTorchJob's `Succeeded`/`Failed`, a JobSet's
/// `Completed`/`Failed`, a TrainJob's `Complete`/`Failed`).
pub fn progress(obj: &DynamicObject) -> Progress {
    let status = &obj.data["status"];
    let kind = kind_of(obj);
    let end = |t: &str| match kind {
        Some(k) => k.end(t),
        // Not typed: any kind's end condition.
        None => kinds::KINDS.iter().find_map(|k| k.end(t)),
    };
    for c in status["conditions"].as_array().into_iter().flatten() {
        if c["status"].as_str() != Some("True") {
            continue;
        }
        let Some(success) = c["type"].as_str().and_then(end) else {
            continue;
        };
        let at = status["completionTime"]
            .as_str()
            .filter(|_| success)
            .or(c["lastTransitionTime"].as_str())
            .map(str::to_string);
        return Progress::Ended { success, at };
    }
    Progress::Running
}

/// A workload's annotations could not be read back.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("{kind} {name}: {message}")]
pub struct Unreadable {
    kind: String,
    name: String,
    message: String,
}

/// The run record of an ended webhook-configured workload (pure): `None`
/// while it runs, when it is not one gpufit configured in inject mode, or
/// when it is already recorded. `pods` are its pods (any order); the peak
/// is left unknown (the caller looks it up).
pub fn run_record(
    obj: &DynamicObject,
    pods: &[Pod],
    cluster: Option<&str>,
    now: DateTime<Utc>,
) -> Result<Option<RunRecord>, Unreadable> {
    let anns = obj.annotations();
    let (Some(applied), Some(workload)) = (anns.get(ANN_APPLIED), anns.get(ANN_WORKLOAD)) else {
        return Ok(None);
    };
    if anns.contains_key(ANN_RECORDED) || is_child(obj) {
        return Ok(None);
    }
    let Progress::Ended { success, at } = progress(obj) else {
        return Ok(None);
    };
    let kind = obj
        .types
        .as_ref()
        .map(|t| t.kind.clone())
        .unwrap_or_default();
    let bad = |message: String| Unreadable {
        kind: kind.clone(),
        name: obj.name_any(),
        message,
    };
    let uid = obj.uid().ok_or_else(|| bad("no metadata.uid".into()))?;
    let w: Workload = serde_json::from_str(workload)
        .map_err(|e| bad(format!("annotation {ANN_WORKLOAD}: {e}")))?;
    let applied: Value =
        serde_json::from_str(applied).map_err(|e| bad(format!("annotation {ANN_APPLIED}: {e}")))?;
    let settings = serde_json::from_value::<SettingsStatus>(applied["settings"].clone())
        .ok()
        .and_then(|s| s.to_settings())
        .ok_or_else(|| bad(format!("annotation {ANN_APPLIED}: no readable settings")))?;
    let gpu = applied["gpu"].as_str().unwrap_or_default();

    let pods = ranked(pods);
    let outcome = if success {
        AttemptOutcome::Succeeded
    } else {
        classify_pods(&pods).map_or(AttemptOutcome::Failed, |(o, _)| o)
    };
    let start = started(obj, &pods);
    let duration = match (start, unix(at.as_deref())) {
        (Some(s), Some(e)) if e >= s => Some(e - s),
        _ => None,
    };
    // What the pods really ran (docs/controller.md, "Confirmed settings").
    let evidence = crate::controller::confirm::PodEvidence::of(&pods);
    use crate::core::confirm::Confirmation;
    let confirmed = evidence.confirm(&settings);
    let settings = confirmed.settings;
    let tokens = evidence
        .record
        .as_ref()
        .and_then(|r| r.tokens_per_sec)
        .filter(|t| t.is_finite() && *t > 0.0)
        .or_else(|| reported_tokens_per_sec(&pods, settings.micro_batch_size, w.seq_len));
    let origin = RunOrigin::new(RunSource::Kubernetes, now)
        .cluster(cluster.map(str::to_string))
        .node(pods.iter().find_map(|p| p.spec.as_ref()?.node_name.clone()))
        .job_id(Some(webhook_job_id(
            &kind,
            &obj.namespace().unwrap_or_default(),
            &obj.name_any(),
            &uid,
        )));
    let record = RunRecord::new(
        origin,
        RunKey::of(&w, gpu),
        settings,
        RunResult {
            outcome: crate::core::run::RunOutcome::of(
                success,
                outcome == AttemptOutcome::Oom,
                host_oom_killed(&pods),
            ),
            peak_memory_bytes: None,
            samples_per_sec: tokens.map(|t| t / w.seq_len.max(1) as f64),
            tokens_per_sec: tokens,
            duration_sec: duration,
        },
    )
    // The prediction was for the injected settings: none for others.
    .with_prediction(
        applied["predictedPeakBytes"]
            .as_u64()
            .filter(|_| confirmed.confirmation != Confirmation::RanOther),
    )
    .with_confirmation(confirmed.confirmation);
    Ok(Some(record))
}

/// When the workload started (Unix seconds): its `status.startTime` (a
/// Job, a PyTorchJob), else its earliest training pod's (a TrainJob's
/// status has no start time; a JobSet's neither). The training pods are
/// those asking for GPUs (all when none does): a TrainJob's dataset and
/// model initializers, or a JobSet's CPU-only driver, run before training
/// starts, and the run's duration is the training's.
fn started(obj: &DynamicObject, pods: &[Pod]) -> Option<f64> {
    let gpus = |p: &&Pod| p.spec.as_ref().is_some_and(|s| pod_gpus(s).count > 0);
    let any_gpu = pods.iter().any(|p| gpus(&p));
    unix(obj.data["status"]["startTime"].as_str()).or_else(|| {
        pods.iter()
            .filter(|p| !any_gpu || gpus(p))
            .filter_map(|p| {
                let t = p.status.as_ref()?.start_time.as_ref()?;
                Some(t.0.as_millisecond() as f64 / 1000.0)
            })
            .reduce(f64::min)
    })
}

/// The job id of a webhook-path run: `Kind:namespace/name/uid` (the
/// TrainingJob path writes `namespace/job/uid`; the `Kind:` prefix is how
/// [`RunRecord::path`] tells them apart).
pub fn webhook_job_id(kind: &str, ns: &str, name: &str, uid: &str) -> String {
    format!("{kind}:{ns}/{name}/{uid}")
}

/// The pods, lowest rank first: the master (or a Job's index 0), then by name.
fn ranked(pods: &[Pod]) -> Vec<Pod> {
    let mut pods = pods.to_vec();
    let rank = |p: &Pod| {
        let l = p.labels();
        let master = l
            .get("training.kubeflow.org/replica-type")
            .is_some_and(|t| t.eq_ignore_ascii_case("master"));
        let index = l
            .get("training.kubeflow.org/replica-index")
            .or(l.get("batch.kubernetes.io/job-completion-index"))
            .and_then(|i| i.parse::<u32>().ok())
            .unwrap_or(u32::MAX);
        (!master, index, p.name_any())
    };
    pods.sort_by_key(rank);
    pods
}

/// The label selector that lists a workload's candidate pods (its kind's).
fn pod_selector(kind: &str, name: &str) -> String {
    match kinds::of(None, kind) {
        Some(k) => k.pod_selector(name),
        None => LABEL_CONFIGURED.to_string(),
    }
}

/// The pods of this workload, among the listed ones of its namespace
/// ([`TrainingKind::owns_pod`]).
fn owned(pods: Vec<Pod>, kind: &str, name: &str, uid: &str) -> Vec<Pod> {
    let Some(k) = kinds::of(None, kind) else {
        return Vec::new();
    };
    pods.into_iter()
        .filter(|p| k.owns_pod(p, name, uid))
        .collect()
}

/// What the workload controllers share.
pub struct WorkloadContext {
    pub ctx: Arc<Context>,
    pub resource: ApiResource,
}

/// Records an ended workload once; fills a late peak. The controller's
/// reconciler, thin around [`run_record`].
pub async fn reconcile_workload(
    obj: Arc<DynamicObject>,
    wctx: Arc<WorkloadContext>,
) -> Result<Action, ControllerError> {
    let (ctx, ar) = (&wctx.ctx, &wctx.resource);
    let ns = obj.namespace().unwrap_or_default();
    let name = obj.name_any();
    let api: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), &ns, ar);
    // Only the leader records (a second replica's watch sees the same
    // events); the new leader's controller lists every object afresh.
    if !ctx.is_leading() {
        return Ok(Action::await_change());
    }
    if obj.annotations().contains_key(ANN_RECORDED) {
        return fill_late_peak(ctx, &api, &ar.kind, &obj).await;
    }
    if !matches!(progress(&obj), Progress::Ended { .. }) {
        return Ok(Action::requeue(Duration::from_secs(300)));
    }
    // The cache may be stale (our own annotation not seen yet): the API
    // server's copy decides. Deleted meanwhile: not recorded.
    let Some(fresh) = api.get_opt(&name).await? else {
        return Ok(Action::await_change());
    };
    let uid = fresh.uid().unwrap_or_default();
    let pods = workload_pods(ctx, &ns, &ar.kind, &name, &uid).await?;
    let rec = match run_record(&fresh, &pods, ctx.cluster.as_deref(), Utc::now()) {
        Ok(Some(r)) => r,
        Ok(None) => return Ok(Action::await_change()),
        Err(e) => {
            tracing::warn!(error = %e, "webhook-configured workload ended; not recorded");
            return Ok(Action::await_change());
        }
    };
    let q = PeakQuery {
        namespace: ns.clone(),
        job: name.clone(),
        pods: pods.iter().map(pod_ref).collect(),
        start: started(&fresh, &pods),
        end: match progress(&fresh) {
            Progress::Ended { at, .. } => unix(at.as_deref()),
            Progress::Running => None,
        },
    };
    let mut rec = rec;
    let peak = read_peak(ctx, q).await.ok().flatten();
    rec.result.peak_memory_bytes = peak.as_ref().map(|p| p.bytes);
    let gpu = rec.gpu_model.clone();
    let outcome = match rec.result.failure_reason() {
        None => RunOutcome::Success,
        Some(FailureReason::Oom) => RunOutcome::Oom,
        Some(FailureReason::OtherError) => RunOutcome::OtherError,
    };
    // Leadership may have moved during the lookups above: the one that
    // holds it now records (the run's identity keeps a race harmless, but
    // a deposed replica should not even try).
    if !ctx.is_leading() {
        return Ok(Action::await_change());
    }
    let (store, metrics, r) = (ctx.history.clone(), ctx.metrics.clone(), rec.clone());
    let id = tokio::task::spawn_blocking(move || {
        let id = store.record(&r)?;
        metrics.observe_throughput(store.as_ref(), &r);
        Ok::<_, crate::history::HistoryError>(id)
    })
    .await
    .map_err(|e| ControllerError::Other(format!("history task failed: {e}")))??;
    // The next suggestion for this workload must see this run.
    ctx.history_cache.forget(&rec.model, rec.method);
    ctx.metrics.count_run(RunPath::Webhook, &gpu, outcome);
    if outcome == RunOutcome::Oom {
        ctx.metrics.ooms.inc();
    }
    observe_error(ctx, &rec, rec.result.peak_memory_bytes);
    let pending = peak
        .is_none()
        .then(|| format!("1 {}", Utc::now().to_rfc3339()));
    annotate(&api, &name, id.to_string().as_str(), pending).await?;
    tracing::info!(kind = %ar.kind, workload = %format!("{ns}/{name}"), run = id, "webhook-configured run recorded");
    Ok(match peak {
        Some(_) => Action::await_change(),
        None => Action::requeue(ctx.peak_retry),
    })
}

/// The workload's pods still in the API server (label-selected, then
/// [`owned`]).
async fn workload_pods(
    ctx: &Context,
    ns: &str,
    kind: &str,
    name: &str,
    uid: &str,
) -> Result<Vec<Pod>, kube::Error> {
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let listed = api
        .list(&ListParams::default().labels(&pod_selector(kind, name)))
        .await?
        .items;
    Ok(owned(listed, kind, name, uid))
}

fn pod_ref(p: &Pod) -> PodRef {
    PodRef {
        name: p.name_any(),
        node: p.spec.as_ref().and_then(|s| s.node_name.clone()),
        host_ip: p.status.as_ref().and_then(|s| s.host_ip.clone()),
    }
}

fn observe_error(ctx: &Context, rec: &RunRecord, peak: Option<u64>) {
    if let (Some(pred), Some(p)) = (rec.predicted_peak_bytes, peak.filter(|p| *p > 0)) {
        let err = (pred as f64 - p as f64) / p as f64;
        ctx.metrics.observe_prediction_error(&rec.gpu_model, err);
    }
}

/// Writes `gpufit.io/recorded` and the pending-peak mark (`None` removes it).
async fn annotate(
    api: &Api<DynamicObject>,
    name: &str,
    recorded: &str,
    pending: Option<String>,
) -> Result<(), kube::Error> {
    let patch = json!({"metadata": {"annotations": {
        ANN_RECORDED: recorded,
        ANN_PEAK_PENDING: pending,
    }}});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map(|_| ())
}

/// A recorded run whose peak was unknown: looked up again when due
/// (`peak_retry` doubled per lookup), up to [`MAX_PEAK_LOOKUPS`].
async fn fill_late_peak(
    ctx: &Context,
    api: &Api<DynamicObject>,
    kind: &str,
    obj: &DynamicObject,
) -> Result<Action, ControllerError> {
    let anns = obj.annotations();
    let (Some(id), Some(pending)) = (
        anns.get(ANN_RECORDED).and_then(|v| v.parse::<i64>().ok()),
        anns.get(ANN_PEAK_PENDING),
    ) else {
        return Ok(Action::await_change());
    };
    let (lookups, last) = pending.split_once(' ').unwrap_or((pending, ""));
    let lookups: u32 = lookups.parse().unwrap_or(MAX_PEAK_LOOKUPS);
    if lookups >= MAX_PEAK_LOOKUPS {
        return Ok(Action::await_change());
    }
    if let Ok(last) = DateTime::parse_from_rfc3339(last) {
        let due = last.with_timezone(&Utc)
            + chrono::Duration::from_std(ctx.peak_retry * (1u32 << (lookups - 1).min(10)))
                .unwrap_or_default();
        if let Ok(wait) = (due - Utc::now()).to_std() {
            return Ok(Action::requeue(wait.max(Duration::from_millis(100))));
        }
    }
    // Its pods, while they linger (a finished Job's stay until its TTL):
    // the query names them, and a TrainJob's start comes from them. Gone:
    // the pods of `<name>-…`.
    let ns = obj.namespace().unwrap_or_default();
    let uid = obj.uid().unwrap_or_default();
    let pods = workload_pods(ctx, &ns, kind, &obj.name_any(), &uid).await?;
    let q = PeakQuery {
        namespace: ns,
        job: obj.name_any(),
        pods: pods.iter().map(pod_ref).collect(),
        start: started(obj, &pods),
        end: match progress(obj) {
            Progress::Ended { at, .. } => unix(at.as_deref()),
            Progress::Running => None,
        },
    };
    let name = obj.name_any();
    if let Ok(Some(p)) = read_peak(ctx, q).await {
        if !ctx.is_leading() {
            return Ok(Action::await_change());
        }
        let store = ctx.history.clone();
        let bytes = p.bytes;
        tokio::task::spawn_blocking(move || store.set_peak(id, bytes))
            .await
            .map_err(|e| ControllerError::Other(format!("history task failed: {e}")))??;
        annotate(api, &name, &id.to_string(), None).await?;
        return Ok(Action::await_change());
    }
    let next = lookups + 1;
    annotate(
        api,
        &name,
        &id.to_string(),
        Some(format!("{next} {}", Utc::now().to_rfc3339())),
    )
    .await?;
    Ok(if next < MAX_PEAK_LOOKUPS {
        Action::requeue(ctx.peak_retry * (1u32 << (next - 1).min(10)))
    } else {
        Action::await_change()
    })
}

/// Bounded backoff; never a crash.
pub fn workload_error_policy(
    obj: Arc<DynamicObject>,
    err: &ControllerError,
    wctx: Arc<WorkloadContext>,
) -> Action {
    let key = format!(
        "{}/{}/{}",
        wctx.resource.kind,
        obj.namespace().unwrap_or_default(),
        obj.name_any()
    );
    let wait = wctx.ctx.next_backoff(&key);
    tracing::warn!(workload = %key, error = %err, retry_in = ?wait, "recording a webhook-configured run failed");
    Action::requeue(wait)
}

/// Watches the labelled objects of every kind in [`kinds`] (in `namespace`,
/// or all) and records their runs, until the stream ends. A kind whose
/// resource is not installed (no Kubeflow) only logs its watch errors.
pub async fn run_workload_controllers(
    client: Client,
    ctx: Arc<Context>,
    namespace: Option<String>,
) {
    let controllers = kinds().into_iter().map(|ar| {
        let api: Api<DynamicObject> = match &namespace {
            Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
            None => Api::all_with(client.clone(), &ar),
        };
        let wctx = Arc::new(WorkloadContext {
            ctx: ctx.clone(),
            resource: ar.clone(),
        });
        Controller::new_with(api, watcher::Config::default().labels(LABEL_CONFIGURED), ar)
            .run(reconcile_workload, workload_error_policy, wctx)
            .for_each(|r| {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "workload reconcile stream");
                }
                futures::future::ready(())
            })
    });
    futures::future::join_all(controllers).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    const APPLIED: &str = r#"{"settings":{"microBatchSize":4,"gradientAccumulationSteps":2,"dtype":"bf16","activationCheckpointing":false,"activationOffloading":false,"compile":false,"numWorkers":4,"pinMemory":true,"persistentWorkers":true,"prefetchFactor":2},"predictedPeakBytes":32000000000,"gpu":"NVIDIA A100-SXM4-80GB"}"#;

    fn workload_json() -> String {
        let w = crate::core::request::WorkloadRequest {
            model: Some(crate::core::request::ModelRequest::Catalog(
                "meta-llama/Llama-3.1-8B".into(),
            )),
            seq_len: Some(2048),
            gpus: Some(4),
            global_batch: Some(32),
            ..Default::default()
        }
        .resolve()
        .expect("a catalog workload");
        serde_json::to_string(&w).expect("json")
    }

    fn pytorchjob(conditions: Value, extra_anns: &[(&str, &str)]) -> DynamicObject {
        let mut anns = json!({ANN_APPLIED: APPLIED, ANN_WORKLOAD: workload_json()});
        for (k, v) in extra_anns {
            anns[*k] = json!(v);
        }
        serde_json::from_value(json!({
            "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": "llama", "namespace": "team", "uid": "u-1", "annotations": anns,
                         "labels": {LABEL_CONFIGURED: "true"}},
            "spec": {},
            "status": {"conditions": conditions, "startTime": "2026-01-01T00:00:00Z",
                       "completionTime": "2026-01-01T01:00:00Z"}
        }))
        .expect("a PyTorchJob")
    }

    fn ended(ok: bool) -> Value {
        json!([
            {"type": "Created", "status": "True"},
            {"type": "Running", "status": "False"},
            {"type": if ok {"Succeeded"} else {"Failed"}, "status": "True",
             "lastTransitionTime": "2026-01-01T00:30:00Z"}
        ])
    }

    fn pod(name: &str, replica: &str, exit: i32, message: &str, reason: Option<&str>) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"training.kubeflow.org/replica-type": replica}},
            "status": {"containerStatuses": [{
                "name": "pytorch", "image": "x", "imageID": "", "ready": false, "restartCount": 0,
                "state": {"terminated": {"exitCode": exit, "message": message, "reason": reason}}
            }]}
        }))
        .expect("a pod")
    }

    fn record(obj: &DynamicObject, pods: &[Pod]) -> Option<RunRecord> {
        run_record(obj, pods, Some("c1"), Utc::now()).expect("readable")
    }

    #[test]
    fn a_running_workload_is_not_recorded() {
        let running = json!([{"type": "Running", "status": "True"}]);
        assert_eq!(record(&pytorchjob(running, &[]), &[]), None);
    }

    #[test]
    fn a_succeeded_pytorchjob_is_one_success_with_the_admission_prediction() {
        let r = record(&pytorchjob(ended(true), &[]), &[]).expect("recorded");
        assert!(r.result.success());
        assert_eq!(r.result.failure_reason(), None);
        assert_eq!(r.predicted_peak_bytes, Some(32_000_000_000));
        assert_eq!(r.settings.micro_batch_size, 4);
        assert_eq!(r.gpus, 4);
        assert_eq!(r.gpu_model, "NVIDIA A100-SXM4-80GB");
        assert_eq!(r.job_id.as_deref(), Some("PyTorchJob:team/llama/u-1"));
        assert_eq!(r.result.duration_sec, Some(3600.0));
        assert_eq!(r.path(), "webhook");
    }

    #[test]
    fn one_worker_out_of_gpu_memory_makes_the_whole_job_one_oom() {
        let pods = [
            pod("llama-master-0", "master", 137, "", Some("Error")),
            pod("llama-worker-0", "worker", 1, "", None),
            pod(
                "llama-worker-1",
                "worker",
                1,
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
                None,
            ),
            pod("llama-worker-2", "worker", 1, "", None),
        ];
        let r = record(&pytorchjob(ended(false), &[]), &pods).expect("recorded");
        assert!(!r.result.success());
        assert_eq!(r.result.failure_reason(), Some(FailureReason::Oom));
    }

    #[test]
    fn a_host_oomkill_is_an_other_error_not_a_gpu_oom() {
        let pods = [pod("llama-master-0", "master", 137, "", Some("OOMKilled"))];
        let r = record(&pytorchjob(ended(false), &[]), &pods).expect("recorded");
        assert_eq!(r.result.failure_reason(), Some(FailureReason::OtherError));
        assert!(r.result.host_oom(), "the data loader's lesson");
        // A bare SIGKILL (preemption, eviction) is no host-memory kill.
        let pods = [pod("llama-master-0", "master", 137, "", None)];
        let r = record(&pytorchjob(ended(false), &[]), &pods).expect("recorded");
        assert_eq!(r.result.failure_reason(), Some(FailureReason::OtherError));
        assert!(!r.result.host_oom());
        // A CUDA OOM on one worker and a host kill on another: the GPU's lesson.
        let pods = [
            pod("llama-master-0", "master", 137, "", Some("OOMKilled")),
            pod(
                "llama-worker-0",
                "worker",
                1,
                "torch.OutOfMemoryError: CUDA out of memory.",
                None,
            ),
        ];
        let r = record(&pytorchjob(ended(false), &[]), &pods).expect("recorded");
        assert_eq!(r.result.failure_reason(), Some(FailureReason::Oom));
        assert!(!r.result.host_oom());
    }

    #[test]
    fn tokens_per_second_are_the_masters_not_a_sum_over_ranks() {
        let tt = |v: f64| {
            format!("Step 10 | loss:1.2 tokens_per_second_per_gpu:{v} peak_memory_active:18.2")
        };
        let pods = [
            pod("llama-worker-0", "worker", 0, &tt(1000.0), None),
            pod("llama-master-0", "master", 0, &tt(2890.1), None),
        ];
        let r = record(&pytorchjob(ended(true), &[]), &pods).expect("recorded");
        assert_eq!(r.result.tokens_per_sec, Some(2890.1));
    }

    #[test]
    fn an_already_recorded_or_unconfigured_workload_records_nothing() {
        let done = pytorchjob(ended(true), &[(ANN_RECORDED, "7")]);
        assert_eq!(record(&done, &[]), None);
        let mut plain = pytorchjob(ended(true), &[]);
        plain.metadata.annotations = None;
        assert_eq!(record(&plain, &[]), None);
    }

    #[test]
    fn a_garbled_annotation_is_an_error_naming_it_not_a_panic() {
        let bad = pytorchjob(ended(true), &[(ANN_WORKLOAD, "{not json")]);
        let e = run_record(&bad, &[], None, Utc::now()).expect_err("unreadable");
        assert!(e.to_string().contains(ANN_WORKLOAD), "{e}");
    }

    #[test]
    fn job_conditions_end_a_batch_job_too() {
        let job: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"},
            "status": {"conditions": [{"type": "Complete", "status": "True"}],
                       "completionTime": "2026-01-01T01:00:00Z"}
        }))
        .expect("a Job");
        assert_eq!(
            progress(&job),
            Progress::Ended {
                success: true,
                at: Some("2026-01-01T01:00:00Z".into())
            }
        );
    }

    fn multi_pod(api_version: &str, kind: &str, conditions: Value) -> DynamicObject {
        let mut obj = pytorchjob(conditions, &[]);
        obj.types = Some(kube::api::TypeMeta {
            api_version: api_version.into(),
            kind: kind.into(),
        });
        obj
    }

    fn jobset_pod(name: &str, jobset: &str, uid: &str, exit: i32, message: &str) -> Pod {
        let mut p = pod(name, "worker", exit, message, None);
        p.metadata.labels = Some(
            [
                (LABEL_JOBSET_NAME.to_string(), jobset.to_string()),
                (LABEL_JOBSET_UID.to_string(), uid.to_string()),
            ]
            .into_iter()
            .collect(),
        );
        p
    }

    #[test]
    fn a_failed_jobset_with_one_pod_out_of_gpu_memory_is_one_oom_record() {
        let failed = json!([{"type": "Failed", "status": "True",
                             "lastTransitionTime": "2026-01-01T00:30:00Z"}]);
        let js = multi_pod("jobset.x-k8s.io/v1alpha2", "JobSet", failed);
        let listed = vec![
            jobset_pod("llama-workers-0-0", "llama", "u-1", 1, ""),
            jobset_pod(
                "llama-workers-0-1",
                "llama",
                "u-1",
                1,
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
            ),
            // Another JobSet's pod, and a pod of an earlier JobSet of the same name.
            jobset_pod("other-workers-0-0", "other", "u-2", 0, ""),
            jobset_pod("llama-workers-0-0-old", "llama", "u-0", 0, ""),
        ];
        let pods = owned(listed, "JobSet", "llama", "u-1");
        assert_eq!(pods.len(), 2);
        let r = record(&js, &pods).expect("recorded");
        assert!(!r.result.success());
        assert_eq!(r.result.failure_reason(), Some(FailureReason::Oom));
        assert_eq!(r.job_id.as_deref(), Some("JobSet:team/llama/u-1"));
        assert_eq!(
            pod_selector("JobSet", "llama"),
            format!("{LABEL_JOBSET_NAME}=llama")
        );
    }

    #[test]
    fn a_completed_jobset_is_a_success() {
        let done = json!([{"type": "Completed", "status": "True"}]);
        let js = multi_pod("jobset.x-k8s.io/v1alpha2", "JobSet", done);
        assert!(record(&js, &[]).expect("recorded").result.success());
    }

    #[test]
    fn a_completed_trainjob_is_one_success_record() {
        let done = json!([
            {"type": "Created", "status": "True"},
            {"type": "Complete", "status": "True", "lastTransitionTime": "2026-01-01T01:00:00Z"}
        ]);
        let tj = multi_pod("trainer.kubeflow.org/v1alpha1", "TrainJob", done);
        let pods = owned(
            vec![
                jobset_pod("llama-node-0-0", "llama", "js-uid", 0, ""),
                jobset_pod("llama-node-0-1", "llama", "js-uid", 0, ""),
            ],
            "TrainJob",
            "llama",
            "u-1",
        );
        assert_eq!(
            pods.len(),
            2,
            "a TrainJob's pods carry its runtime JobSet's uid"
        );
        let r = record(&tj, &pods).expect("recorded");
        assert!(r.result.success());
        assert_eq!(r.job_id.as_deref(), Some("TrainJob:team/llama/u-1"));
        assert_eq!(r.predicted_peak_bytes, Some(32_000_000_000));
    }

    #[test]
    fn a_jobsets_child_job_or_a_trainjobs_jobset_is_never_recorded() {
        let done = json!([{"type": "Complete", "status": "True"}]);
        let mut job = multi_pod("batch/v1", "Job", done.clone());
        job.metadata.labels = Some(
            [(LABEL_JOBSET_NAME.to_string(), "llama".to_string())]
                .into_iter()
                .collect(),
        );
        assert_eq!(record(&job, &[]), None);
        let mut js = multi_pod("jobset.x-k8s.io/v1alpha2", "JobSet", done);
        js.metadata.owner_references = Some(vec![serde_json::from_value(json!({
            "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "name": "llama", "uid": "t-1"
        }))
        .expect("an owner reference")]);
        assert_eq!(record(&js, &[]), None);
    }

    #[test]
    fn jobset_and_trainjob_are_watched() {
        let plurals: Vec<_> = kinds().into_iter().map(|k| k.plural).collect();
        assert!(plurals.contains(&"jobsets".to_string()));
        assert!(plurals.contains(&"trainjobs".to_string()));
    }
}
