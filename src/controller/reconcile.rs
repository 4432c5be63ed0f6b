//! Reconcile a `TrainingJob` as an explicit pipeline:
//! **dereference** (mode from annotation/namespace, the current Job and its
//! pods) → **validate** (pure, [`super::validate`]) → **build** (pure,
//! [`super::build`]) → **apply** (create the Job) → **status** (one merge
//! patch, Events).
//!
//! When a Job finishes, its peak GPU memory is read (Prometheus, then the
//! node sidecar), a CUDA out-of-memory failure is told from other failures,
//! the run is recorded in the history, and an OOM is retried with the
//! advisor's next suggestion (which now knows the OOM) up to the retry limit.
//!
//! Nothing is lost on the way: the outcome goes into status first; a run the
//! history store could not take is recorded on a later pass (status keeps it),
//! and a run whose peak is not yet known is recorded with `peak unknown` and
//! filled in later.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;

use crate::core::advisor::{self, AdviceRequest, StrategyTargets, Suggestion};
use crate::core::catalog::GpuSpec;
use crate::core::run::{FailureReason, RunKey, RunOrigin, RunRecord, RunResult, RunSource};
use crate::core::similarity::HistoryQuery;
use crate::history::HistoryStore;

use super::build::{self, build_job};
use super::crd::{
    Attempt, Mode, Outcome, Phase, SettingsStatus, SuggestionStatus, TrainingJob, TrainingJobStatus,
};
use super::gpu;
use super::metrics::Metrics;
use super::prom::{render_query, PromClient};
use super::sidecar_client::SidecarClient;
use super::validate::{self, Validated, ValidationError};
use super::ControllerError;

/// Annotation (TrainingJob) or label (Namespace) that sets the mode.
pub const MODE_KEY: &str = "gpufit.io/mode";
/// Field manager name for status patches.
pub const MANAGER: &str = "gpufit-controller";
/// How often the peak of a finished attempt is looked up before giving up
/// (the run stays recorded with peak unknown).
pub const MAX_PEAK_LOOKUPS: u32 = 5;

/// Default [`Context::peak_retry`]: 30 s, then 60, 120, 240 — a peak that
/// reaches Prometheus within about 7 minutes of the Job's end is filled in.
pub const PEAK_RETRY: Duration = Duration::from_secs(30);

/// When the next lookup of a pending peak is due.
fn peak_due(a: &Attempt, retry: Duration) -> Option<chrono::DateTime<chrono::Utc>> {
    let last = chrono::DateTime::parse_from_rfc3339(a.last_peak_lookup.as_deref()?).ok()?;
    let factor = 1u32 << a.peak_lookups.saturating_sub(1).min(10);
    let wait = chrono::Duration::from_std(retry * factor).ok()?;
    Some(last.with_timezone(&chrono::Utc) + wait)
}

// === Peak readers ===

/// A pod of a finished Job, as the peak readers need it.
#[derive(Debug, Clone, PartialEq)]
pub struct PodRef {
    pub name: String,
    pub node: Option<String>,
    pub host_ip: Option<String>,
}

/// What to measure: a finished Job's pods over its run time.
#[derive(Debug, Clone, PartialEq)]
pub struct PeakQuery {
    pub namespace: String,
    pub job: String,
    /// Pods of the Job; empty when they are gone (then the Job's pod-name
    /// prefix is used).
    pub pods: Vec<PodRef>,
    /// Unix seconds.
    pub start: Option<f64>,
    /// Unix seconds.
    pub end: Option<f64>,
}

/// A measured peak and where it came from (`prometheus`, `sidecar`).
#[derive(Debug, Clone, PartialEq)]
pub struct MeasuredPeak {
    pub bytes: u64,
    pub source: String,
}

/// Reads the peak GPU memory of a finished Job. Blocking (called from
/// `spawn_blocking`). `Ok(None)`: every source answered but none knows it.
pub trait PeakReader: Send + Sync {
    fn job_peak(&self, q: &PeakQuery) -> Result<Option<MeasuredPeak>, String>;
}

/// Prometheus first (a configurable PromQL template), then the node sidecar.
pub struct PromThenSidecar {
    pub prom: Option<PromClient>,
    pub query_template: String,
    pub sidecar: Option<SidecarClient>,
}

impl PeakReader for PromThenSidecar {
    fn job_peak(&self, q: &PeakQuery) -> Result<Option<MeasuredPeak>, String> {
        let mut errors = Vec::new();
        if let Some(prom) = &self.prom {
            let pods: Vec<String> = if q.pods.is_empty() {
                // Pods of Job `x` are named `x-<suffix>`; the regex is built
                // from the escaped prefix below.
                vec![]
            } else {
                q.pods.iter().map(|p| p.name.clone()).collect()
            };
            let range = match (q.start, q.end) {
                (Some(s), Some(e)) if e > s => Duration::from_secs_f64(e - s + 60.0),
                _ => Duration::from_secs(3600),
            };
            let mut promql = render_query(&self.query_template, &q.namespace, &q.job, &pods, range);
            if pods.is_empty() {
                let prefix = super::prom::regex_alternation(std::slice::from_ref(&q.job));
                promql = promql.replace("pod=~\"\"", &format!("pod=~\"{prefix}-.*\""));
            }
            match prom.query_max(&promql, q.end.map(|e| e + 30.0)) {
                Ok(Some(v)) if v > 0.0 => {
                    return Ok(Some(MeasuredPeak {
                        bytes: v.round() as u64,
                        source: "prometheus".into(),
                    }))
                }
                Ok(_) => {}
                Err(e) => errors.push(e.to_string()),
            }
        }
        if let Some(sc) = &self.sidecar {
            let mut best: Option<u64> = None;
            for p in &q.pods {
                let (Some(ip), node) = (&p.host_ip, p.node.as_deref().unwrap_or("")) else {
                    continue;
                };
                match sc.pod_peak(ip, node, &q.namespace, &p.name) {
                    Ok(Some(b)) => best = Some(best.map_or(b, |m| m.max(b))),
                    Ok(None) => {}
                    Err(e) => errors.push(e),
                }
            }
            if let Some(bytes) = best {
                return Ok(Some(MeasuredPeak {
                    bytes,
                    source: "sidecar".into(),
                }));
            }
        }
        if errors.is_empty() {
            Ok(None)
        } else {
            Err(errors.join("; "))
        }
    }
}

// === Context ===

/// Everything a reconcile needs, shared by all reconciles.
pub struct Context {
    pub client: Client,
    pub history: Arc<dyn HistoryStore>,
    /// Nodes (GPU Feature Discovery labels), from a reflector.
    pub nodes: Store<Node>,
    /// Namespaces (the `gpufit.io/mode` label), from a reflector.
    pub namespaces: Store<Namespace>,
    pub peaks: Arc<dyn PeakReader>,
    pub metrics: Metrics,
    pub recorder: Recorder,
    pub targets: StrategyTargets,
    /// Mode when neither the spec, the TrainingJob's annotation nor the
    /// namespace's label says.
    pub default_mode: Mode,
    /// Cluster name recorded with each run.
    pub cluster: Option<String>,
    /// Wait before the second lookup of a peak that was not there yet (a
    /// Prometheus scrape or remote-write lag); doubled for each later one.
    /// Time, not reconciles, paces the lookups: the status patch of a
    /// failed lookup triggers a reconcile at once, which must not spend the
    /// next lookup.
    pub peak_retry: Duration,
    /// Consecutive failures per TrainingJob, for the error backoff.
    failures: Mutex<HashMap<String, u32>>,
}

impl Context {
    pub fn new(
        client: Client,
        history: Arc<dyn HistoryStore>,
        nodes: Store<Node>,
        namespaces: Store<Namespace>,
        peaks: Arc<dyn PeakReader>,
        metrics: Metrics,
    ) -> Self {
        let reporter = Reporter {
            controller: MANAGER.into(),
            instance: std::env::var("POD_NAME").ok(),
        };
        Context {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            history,
            nodes,
            namespaces,
            peaks,
            metrics,
            targets: StrategyTargets::default(),
            default_mode: Mode::Inject,
            cluster: None,
            peak_retry: PEAK_RETRY,
            failures: Mutex::new(HashMap::new()),
        }
    }

    fn reset_failures(&self, key: &str) {
        if let Ok(mut f) = self.failures.lock() {
            f.remove(key);
        }
    }

    /// Exponential backoff per object: 5 s, 10 s, 20 s … capped at 5 min,
    /// so a broken dependency never turns into a hot loop.
    pub fn next_backoff(&self, key: &str) -> Duration {
        let n = match self.failures.lock() {
            Ok(mut f) => {
                let n = f.entry(key.to_string()).or_insert(0);
                *n = n.saturating_add(1);
                *n
            }
            Err(_) => 1,
        };
        let secs = 5u64.saturating_mul(1u64 << (n - 1).min(6));
        Duration::from_secs(secs.min(300))
    }

    async fn event(&self, tj: &TrainingJob, type_: EventType, reason: &str, note: String) {
        let ev = Event {
            type_,
            reason: reason.into(),
            note: Some(truncate(&note, 1000)),
            action: "Reconcile".into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &tj.object_ref(&())).await {
            tracing::warn!(error = %e, reason, "cannot publish event");
        }
    }
}

fn key(tj: &TrainingJob) -> String {
    format!("{}/{}", tj.namespace().unwrap_or_default(), tj.name_any())
}

// === Entry points ===

/// Reconciles one TrainingJob (the `Controller::run` reconciler).
pub async fn reconcile(tj: Arc<TrainingJob>, ctx: Arc<Context>) -> Result<Action, ControllerError> {
    let _timer = ctx.metrics.reconcile_timer();
    let r = reconcile_inner(&tj, &ctx).await;
    match &r {
        Ok(_) => {
            ctx.metrics.reconciles.with_label_values(&["ok"]).inc();
            ctx.reset_failures(&key(&tj));
        }
        Err(e) => ctx.metrics.record_error(e),
    }
    r
}

/// Bounded retry with backoff; never a crash.
pub fn error_policy(tj: Arc<TrainingJob>, err: &ControllerError, ctx: Arc<Context>) -> Action {
    let wait = ctx.next_backoff(&key(&tj));
    tracing::warn!(trainingjob = %key(&tj), error = %err, retry_in = ?wait, "reconcile failed");
    Action::requeue(wait)
}

// === The pipeline ===

async fn reconcile_inner(tj: &TrainingJob, ctx: &Context) -> Result<Action, ControllerError> {
    if tj.metadata.deletion_timestamp.is_some() {
        // The Jobs are owned: Kubernetes' garbage collector removes them.
        return Ok(Action::await_change());
    }
    let ns = tj
        .namespace()
        .ok_or_else(|| ControllerError::Invalid("TrainingJob without a namespace".into()))?;
    let name = tj.name_any();
    let tjs: Api<TrainingJob> = Api::namespaced(ctx.client.clone(), &ns);
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &ns);
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let generation = tj.metadata.generation;
    let old = tj.status.clone().unwrap_or_default();
    let mut st = old.clone();
    st.observed_generation = generation;

    // --- dereference + validate ---
    let validated = mode_default(tj, &ctx.namespaces)
        .and_then(|m| validate::validate(&tj.spec, Some(m.unwrap_or(ctx.default_mode))));
    let v = match validated {
        Ok(v) => v,
        Err(e) => {
            st.phase = Some(Phase::Invalid);
            set_condition(
                &mut st,
                "Invalid",
                true,
                "InvalidSpec",
                &e.to_string(),
                generation,
            );
            set_condition(
                &mut st,
                "Ready",
                false,
                "InvalidSpec",
                &e.to_string(),
                generation,
            );
            if st != old {
                patch_status(&tjs, &name, &st).await?;
                ctx.event(tj, EventType::Warning, "InvalidSpec", e.to_string())
                    .await;
            }
            // Waits for a spec change instead of retrying forever.
            return Ok(Action::await_change());
        }
    };
    if has_condition(&st, "Invalid") {
        set_condition(
            &mut st,
            "Invalid",
            false,
            "Valid",
            "the spec is valid",
            generation,
        );
    }
    st.mode = Some(v.mode);

    let mut requeue: Option<Duration> = None;
    let mut just_finished = None;

    // --- the in-flight attempt: still running, finished, or deleted ---
    if let Some(i) = st
        .attempts
        .iter()
        .rposition(|a| a.outcome == Outcome::Running)
    {
        let job_name = st.attempts[i].job_name.clone();
        match jobs.get_opt(&job_name).await? {
            None => {
                let a = &mut st.attempts[i];
                a.outcome = Outcome::Deleted;
                a.message = Some("the Job was deleted before it finished".into());
                ctx.event(
                    tj,
                    EventType::Warning,
                    "JobDeleted",
                    format!("Job {job_name} was deleted before it finished; edit the TrainingJob to start again"),
                )
                .await;
            }
            Some(job) => match job_state(&job) {
                JobState::Active(running) => {
                    st.phase = Some(if running {
                        Phase::Running
                    } else {
                        Phase::Pending
                    });
                    requeue = Some(Duration::from_secs(300));
                }
                JobState::Finished(_)
                    if jobs
                        .get_opt(&super::build::job_name(&name, st.attempts[i].index + 1))
                        .await?
                        .is_some() =>
                {
                    // The next attempt's Job exists: this TrainingJob is a
                    // stale cached copy (its ADDED event raced our status
                    // patch). Finishing the attempt again would record,
                    // count and announce it twice: wait for the fresh copy.
                    tracing::debug!(tj = %name, "stale TrainingJob in the cache; requeued");
                    return Ok(Action::requeue(Duration::from_secs(1)));
                }
                JobState::Finished(success) => {
                    let pod_list = pods
                        .list(
                            &ListParams::default()
                                .labels(&format!("batch.kubernetes.io/job-name={job_name}")),
                        )
                        .await?
                        .items;
                    finish_attempt(ctx, tj, &mut st.attempts[i], &ns, &job, &pod_list, success)
                        .await;
                    just_finished = Some(i);
                    if let Some(p) = st.attempts[i].measured_peak_bytes {
                        st.peak_gib = Some((crate::core::units::to_gib(p) * 100.0).round() / 100.0);
                    }
                }
            },
        }
    }

    // --- record every finished attempt the history does not have yet ---
    let history_result = record_runs(ctx, &ns, &v, &mut st).await;
    match &history_result {
        Ok(()) => {
            if has_condition(&st, "HistoryUnavailable") {
                set_condition(
                    &mut st,
                    "HistoryUnavailable",
                    false,
                    "Recorded",
                    "every run is recorded",
                    generation,
                );
            }
        }
        Err(e) => {
            set_condition(
                &mut st,
                "HistoryUnavailable",
                true,
                "HistoryStoreError",
                &format!("{e}; the run is kept in status and recorded when the store is back"),
                generation,
            );
        }
    }

    // --- fill peaks that were unknown when the run was recorded ---
    if fill_pending_peaks(ctx, &ns, &mut st, just_finished).await {
        let next = st
            .attempts
            .iter()
            .filter_map(|a| peak_due(a, ctx.peak_retry))
            .min()
            .and_then(|due| (due - chrono::Utc::now()).to_std().ok())
            .unwrap_or(ctx.peak_retry)
            .max(Duration::from_millis(100));
        requeue = Some(requeue.map_or(next, |r| r.min(next)));
    }

    // --- decide: start an attempt, or settle the phase ---
    let next = decide(&st, &v, generation);
    let mut create_error = None;
    match next {
        Next::Wait => {}
        Next::Settle(phase, reason, message) => {
            if st.phase != Some(phase) {
                let ty = if phase == Phase::Succeeded {
                    EventType::Normal
                } else {
                    EventType::Warning
                };
                ctx.event(tj, ty, reason, message.clone()).await;
            }
            st.phase = Some(phase);
            set_condition(
                &mut st,
                "Ready",
                phase == Phase::Succeeded,
                reason,
                &message,
                generation,
            );
        }
        Next::Start => match start_attempt(ctx, tj, &jobs, &v, &mut st, generation).await {
            Ok(()) => requeue = Some(Duration::from_secs(300)),
            Err(StartError::Invalid(msg)) => {
                st.phase = Some(Phase::Invalid);
                set_condition(&mut st, "Invalid", true, "DoesNotFit", &msg, generation);
                set_condition(&mut st, "Ready", false, "DoesNotFit", &msg, generation);
                ctx.event(tj, EventType::Warning, "DoesNotFit", msg).await;
            }
            Err(StartError::InvalidSpec(msg)) => {
                st.phase = Some(Phase::Invalid);
                set_condition(&mut st, "Invalid", true, "InvalidSpec", &msg, generation);
                set_condition(&mut st, "Ready", false, "InvalidSpec", &msg, generation);
                ctx.event(tj, EventType::Warning, "InvalidSpec", msg).await;
            }
            Err(StartError::Retry(reason, e)) => {
                set_condition(&mut st, "Ready", false, reason, &e.to_string(), generation);
                if st.phase.is_none() {
                    st.phase = Some(Phase::Pending);
                }
                ctx.event(tj, EventType::Warning, reason, e.to_string())
                    .await;
                create_error = Some(e);
            }
        },
    }

    if st != old {
        patch_status(&tjs, &name, &st).await?;
    }
    history_result?;
    if let Some(e) = create_error {
        return Err(e);
    }
    Ok(match requeue {
        Some(d) => Action::requeue(d),
        None if st.phase.is_some_and(Phase::is_final) => Action::await_change(),
        None => Action::requeue(Duration::from_secs(300)),
    })
}

/// The mode when `spec.mode` is unset: the TrainingJob's annotation, then
/// its namespace's label.
fn mode_default(
    tj: &TrainingJob,
    namespaces: &Store<Namespace>,
) -> Result<Option<Mode>, ValidationError> {
    if let Some(v) = tj.annotations().get(MODE_KEY) {
        return validate::parse_mode(v, &format!("metadata.annotations[{MODE_KEY}]")).map(Some);
    }
    let Some(ns) = tj.namespace() else {
        return Ok(None);
    };
    let Some(obj) = namespaces.get(&ObjectRef::new(&ns)) else {
        return Ok(None);
    };
    match obj.labels().get(MODE_KEY) {
        Some(v) => validate::parse_mode(v, &format!("namespace {ns} label {MODE_KEY}")).map(Some),
        None => Ok(None),
    }
}

enum JobState {
    /// Not finished; `true` when a pod is running.
    Active(bool),
    /// Finished; `true` when it succeeded.
    Finished(bool),
}

fn job_state(job: &Job) -> JobState {
    let status = job.status.clone().unwrap_or_default();
    for c in status.conditions.iter().flatten() {
        if c.status == "True" {
            match c.type_.as_str() {
                "Complete" => return JobState::Finished(true),
                "Failed" => return JobState::Finished(false),
                _ => {}
            }
        }
    }
    JobState::Active(status.active.unwrap_or(0) > 0)
}

/// Tells a GPU out-of-memory failure from other failures by the containers'
/// termination messages (with `terminationMessagePolicy:
/// FallbackToLogsOnError` that is the log's tail) and exit codes.
pub fn classify_failure(job: &Job, pods: &[Pod]) -> (Outcome, String) {
    let mut other: Option<String> = None;
    for pod in pods {
        let statuses = pod
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref());
        for cs in statuses.into_iter().flatten() {
            let terms = [
                cs.state.as_ref().and_then(|s| s.terminated.as_ref()),
                cs.last_state.as_ref().and_then(|s| s.terminated.as_ref()),
            ];
            for t in terms.into_iter().flatten() {
                if t.exit_code == 0 {
                    continue;
                }
                let msg = t.message.as_deref().unwrap_or("");
                // The same markers as the log parser and the Slurm Epilog.
                if let Some(line) = crate::core::logs::oom::first_oom_line(msg) {
                    return (
                        Outcome::Oom,
                        format!(
                            "container {} ran out of GPU memory (exit code {}): {}",
                            cs.name,
                            t.exit_code,
                            truncate(line.trim(), 300)
                        ),
                    );
                }
                if other.is_none() {
                    other = Some(
                        if t.reason.as_deref() == Some("OOMKilled") || t.exit_code == 137 {
                            format!(
                            "container {} was killed (exit code {}, {}): host memory, not GPU memory; raise its memory limit",
                            cs.name,
                            t.exit_code,
                            t.reason.as_deref().unwrap_or("SIGKILL")
                        )
                        } else {
                            let last = msg
                                .lines()
                                .rev()
                                .find(|l| !l.trim().is_empty())
                                .unwrap_or("");
                            format!(
                                "container {} exited with code {}{}",
                                cs.name,
                                t.exit_code,
                                if last.is_empty() {
                                    String::new()
                                } else {
                                    format!(": {}", truncate(last.trim(), 300))
                                }
                            )
                        },
                    );
                }
            }
        }
    }
    let msg = other.unwrap_or_else(|| {
        let cond = job
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == "Failed"))
            .and_then(|c| c.message.clone().or(c.reason.clone()));
        format!(
            "the Job failed: {}",
            cond.unwrap_or_else(|| "no reason given".into())
        )
    });
    (Outcome::Failed, msg)
}

fn time_str(t: Option<&Time>) -> Option<String> {
    t.map(|t| t.0.to_string())
}

fn unix(s: Option<&str>) -> Option<f64> {
    let ts: Timestamp = s?.parse().ok()?;
    Some(ts.as_millisecond() as f64 / 1000.0)
}

fn pod_refs(pods: &[Pod]) -> Vec<PodRef> {
    pods.iter()
        .map(|p| PodRef {
            name: p.name_any(),
            node: p.spec.as_ref().and_then(|s| s.node_name.clone()),
            host_ip: p.status.as_ref().and_then(|s| s.host_ip.clone()),
        })
        .collect()
}

/// A finished Job: outcome, peak, prediction error, metrics, events.
async fn finish_attempt(
    ctx: &Context,
    tj: &TrainingJob,
    a: &mut Attempt,
    ns: &str,
    job: &Job,
    pods: &[Pod],
    success: bool,
) {
    let js = job.status.clone().unwrap_or_default();
    a.started_at = time_str(js.start_time.as_ref());
    a.finished_at = time_str(js.completion_time.as_ref()).or_else(|| {
        js.conditions
            .iter()
            .flatten()
            .find(|c| c.type_ == "Failed")
            .and_then(|c| time_str(c.last_transition_time.as_ref()))
    });
    let refs = pod_refs(pods);
    a.node = refs.iter().find_map(|p| p.node.clone());
    a.job_uid = job.metadata.uid.clone();
    let seq = tj.spec.workload.seq_len;
    a.tokens_per_sec = reported_tokens_per_sec(pods, a.settings.micro_batch_size, seq);
    if success {
        a.outcome = Outcome::Succeeded;
        a.message = None;
    } else {
        let (outcome, msg) = classify_failure(job, pods);
        a.outcome = outcome;
        a.message = Some(msg.clone());
        if outcome == Outcome::Oom {
            ctx.metrics.ooms.inc();
            ctx.event(tj, EventType::Warning, "OutOfMemory", msg).await;
        }
    }
    let q = PeakQuery {
        namespace: ns.to_string(),
        job: a.job_name.clone(),
        pods: refs,
        start: unix(a.started_at.as_deref()),
        end: unix(a.finished_at.as_deref()),
    };
    lookup_peak(ctx, tj, a, q).await;
}

/// Training throughput the job printed in its containers' termination
/// messages (what `/dev/termination-log` holds, or the log's tail with
/// `FallbackToLogsOnError`), read by the shared log parsers: tokens/s as
/// printed, else samples/s × sequence length, else (Lightning) iterations/s
/// × micro batch × sequence length. The first container that says wins.
pub fn reported_tokens_per_sec(pods: &[Pod], micro_batch: u32, seq_len: u32) -> Option<f64> {
    let seq = seq_len as f64;
    pods.iter()
        .filter_map(|p| p.status.as_ref()?.container_statuses.as_ref())
        .flatten()
        .flat_map(|cs| {
            [
                cs.state.as_ref().and_then(|s| s.terminated.as_ref()),
                cs.last_state.as_ref().and_then(|s| s.terminated.as_ref()),
            ]
        })
        .flatten()
        .filter_map(|t| t.message.as_deref())
        .filter_map(|msg| crate::core::logs::parse_str(msg).ok())
        .find_map(|p| {
            p.tokens_per_sec
                .or(p.samples_per_sec.map(|s| s * seq))
                .or(p.steps_per_sec.map(|s| s * micro_batch as f64 * seq))
                .filter(|t| t.is_finite() && *t > 0.0)
        })
}

/// Looks the peak up once; on success fills measured peak and prediction error.
async fn lookup_peak(ctx: &Context, tj: &TrainingJob, a: &mut Attempt, q: PeakQuery) -> bool {
    let reader = ctx.peaks.clone();
    let r = tokio::task::spawn_blocking(move || reader.job_peak(&q))
        .await
        .unwrap_or_else(|e| Err(format!("peak lookup panicked: {e}")));
    match r {
        Ok(Some(p)) => {
            a.measured_peak_bytes = Some(p.bytes);
            a.peak_source = Some(p.source);
            if let Some(pred) = a.predicted_peak_bytes {
                if p.bytes > 0 {
                    let err = (pred as f64 - p.bytes as f64) / p.bytes as f64;
                    a.prediction_error = Some((err * 1000.0).round() / 1000.0);
                    let gpu = tj
                        .status
                        .as_ref()
                        .and_then(|s| s.gpu.clone())
                        .unwrap_or_default();
                    ctx.metrics.observe_prediction_error(&gpu, err);
                }
            }
            true
        }
        Ok(None) => {
            a.peak_lookups += 1;
            a.last_peak_lookup = Some(chrono::Utc::now().to_rfc3339());
            false
        }
        Err(e) => {
            a.peak_lookups += 1;
            a.last_peak_lookup = Some(chrono::Utc::now().to_rfc3339());
            ctx.event(
                tj,
                EventType::Warning,
                "PeakUnavailable",
                format!("cannot read the peak GPU memory of Job {}: {e}; the run is recorded with peak unknown and filled in later", a.job_name),
            )
            .await;
            false
        }
    }
}

fn finished(o: Outcome) -> bool {
    matches!(o, Outcome::Succeeded | Outcome::Oom | Outcome::Failed)
}

/// The run record of a finished attempt.
pub fn run_record(
    v: &Validated,
    gpu: &str,
    cluster: Option<&str>,
    ns: &str,
    a: &Attempt,
) -> Option<RunRecord> {
    let settings = a.settings.to_settings()?;
    let w = &v.workload;
    let duration = match (
        unix(a.started_at.as_deref()),
        unix(a.finished_at.as_deref()),
    ) {
        (Some(s), Some(e)) if e >= s => Some(e - s),
        _ => None,
    };
    let origin = RunOrigin::new(RunSource::Kubernetes, chrono::Utc::now())
        .cluster(cluster.map(str::to_string))
        .node(a.node.clone())
        // The run's identity in the history: a replayed reconcile updates
        // the row instead of adding one.
        .job_id(Some(match &a.job_uid {
            Some(uid) => format!("{ns}/{}/{uid}", a.job_name),
            None => format!("{ns}/{}", a.job_name),
        }));
    let record = RunRecord::new(
        origin,
        RunKey::of(w, gpu),
        settings,
        RunResult {
            success: a.outcome == Outcome::Succeeded,
            // Only finished attempts are recorded: Succeeded, Oom or Failed.
            failure_reason: match a.outcome {
                Outcome::Oom => Some(FailureReason::Oom),
                Outcome::Failed => Some(FailureReason::OtherError),
                _ => None,
            },
            peak_memory_bytes: a.measured_peak_bytes,
            samples_per_sec: a.tokens_per_sec.map(|t| t / w.seq_len.max(1) as f64),
            tokens_per_sec: a.tokens_per_sec,
            duration_sec: duration,
        },
    )
    .with_prediction(a.predicted_peak_bytes);
    Some(record)
}

async fn record_runs(
    ctx: &Context,
    ns: &str,
    v: &Validated,
    st: &mut TrainingJobStatus,
) -> Result<(), ControllerError> {
    let gpu = st.gpu.clone().unwrap_or_default();
    for a in st.attempts.iter_mut() {
        if !finished(a.outcome) || a.run_id.is_some() || a.mode == Some(Mode::Recommend) {
            continue;
        }
        let Some(rec) = run_record(v, &gpu, ctx.cluster.as_deref(), ns, a) else {
            tracing::warn!(job = %a.job_name, "attempt settings cannot be read back; not recorded");
            continue;
        };
        let store = ctx.history.clone();
        let metrics = ctx.metrics.clone();
        let id = tokio::task::spawn_blocking(move || {
            let id = store.record(&rec)?;
            metrics.observe_throughput(store.as_ref(), &rec);
            Ok::<_, crate::history::HistoryError>(id)
        })
        .await
        .map_err(|e| ControllerError::Other(format!("history task failed: {e}")))??;
        a.run_id = Some(id);
        let outcome = match a.outcome {
            Outcome::Succeeded => "success",
            Outcome::Oom => "oom",
            _ => "other_error",
        };
        ctx.metrics.count_run("kubernetes", &gpu, outcome);
    }
    Ok(())
}

/// Retries the peak of recorded runs whose peak was unknown; `true` when
/// some are still pending (so the caller requeues).
async fn fill_pending_peaks(
    ctx: &Context,
    ns: &str,
    st: &mut TrainingJobStatus,
    just_finished: Option<usize>,
) -> bool {
    let mut pending = false;
    let gpu = st.gpu.clone().unwrap_or_default();
    for (i, a) in st.attempts.iter_mut().enumerate() {
        if Some(i) == just_finished {
            // Looked up a moment ago in `finish_attempt`.
            continue;
        }
        let waiting = finished(a.outcome)
            && a.measured_peak_bytes.is_none()
            && a.peak_lookups > 0
            && a.peak_lookups < MAX_PEAK_LOOKUPS;
        let Some(id) = a.run_id.filter(|_| waiting) else {
            continue;
        };
        if peak_due(a, ctx.peak_retry).is_some_and(|due| chrono::Utc::now() < due) {
            // Not yet: an early reconcile (our own status patch, a Job
            // event) must not spend a lookup.
            pending = true;
            continue;
        }
        let q = PeakQuery {
            namespace: ns.to_string(),
            job: a.job_name.clone(),
            pods: vec![],
            start: unix(a.started_at.as_deref()),
            end: unix(a.finished_at.as_deref()),
        };
        let reader = ctx.peaks.clone();
        let r = tokio::task::spawn_blocking(move || reader.job_peak(&q))
            .await
            .unwrap_or_else(|e| Err(e.to_string()));
        match r {
            Ok(Some(p)) => {
                let store = ctx.history.clone();
                let bytes = p.bytes;
                let stored = tokio::task::spawn_blocking(move || store.set_peak(id, bytes)).await;
                if matches!(stored, Ok(Ok(()))) {
                    a.measured_peak_bytes = Some(p.bytes);
                    a.peak_source = Some(p.source);
                    if let Some(pred) = a.predicted_peak_bytes.filter(|_| p.bytes > 0) {
                        let err = (pred as f64 - p.bytes as f64) / p.bytes as f64;
                        a.prediction_error = Some((err * 1000.0).round() / 1000.0);
                        ctx.metrics.observe_prediction_error(&gpu, err);
                    }
                } else {
                    pending = true;
                }
            }
            _ => {
                a.peak_lookups += 1;
                a.last_peak_lookup = Some(chrono::Utc::now().to_rfc3339());
                pending |= a.peak_lookups < MAX_PEAK_LOOKUPS;
            }
        }
    }
    // A run recorded in this pass whose first lookup failed also waits.
    pending
        || st.attempts.iter().any(|a| {
            finished(a.outcome)
                && a.run_id.is_some()
                && a.measured_peak_bytes.is_none()
                && a.peak_lookups > 0
                && a.peak_lookups < MAX_PEAK_LOOKUPS
        })
}

enum Next {
    Wait,
    Start,
    Settle(Phase, &'static str, String),
}

/// What to do next, from the attempts alone (pure).
fn decide(st: &TrainingJobStatus, v: &Validated, generation: Option<i64>) -> Next {
    let Some(last) = st.attempts.last() else {
        return Next::Start;
    };
    if last.outcome == Outcome::Running {
        return Next::Wait;
    }
    // A spec change after the last attempt ended starts a new attempt.
    if last.generation != generation && st.phase != Some(Phase::Invalid) && generation.is_some() {
        return Next::Start;
    }
    if st.phase == Some(Phase::Invalid) {
        return Next::Start;
    }
    match last.outcome {
        Outcome::Succeeded => Next::Settle(
            Phase::Succeeded,
            "Succeeded",
            format!("Job {} completed", last.job_name),
        ),
        Outcome::Oom if last.mode == Some(Mode::Recommend) => Next::Settle(
            Phase::Failed,
            "OutOfMemory",
            format!(
                "Job {} ran out of GPU memory with its own settings (Recommend mode); gpufit recommended micro batch {}: apply it, or switch to mode Inject",
                last.job_name, last.settings.micro_batch_size
            ),
        ),
        Outcome::Oom => {
            let ooms = st
                .attempts
                .iter()
                .filter(|a| a.generation == generation && a.outcome == Outcome::Oom)
                .count() as u32;
            if ooms <= v.oom_retry_limit {
                Next::Start
            } else {
                Next::Settle(
                    Phase::Failed,
                    "OOMRetriesExhausted",
                    format!(
                        "{ooms} attempts ran out of GPU memory (limit {} retries): pin a smaller microBatchSize, turn on activationCheckpointing, or use more GPUs",
                        v.oom_retry_limit
                    ),
                )
            }
        }
        Outcome::Failed => Next::Settle(
            Phase::Failed,
            "JobFailed",
            last.message
                .clone()
                .unwrap_or_else(|| "the Job failed".into()),
        ),
        Outcome::Deleted => Next::Settle(
            Phase::Failed,
            "JobDeleted",
            format!(
                "Job {} was deleted before it finished; edit the TrainingJob to start again",
                last.job_name
            ),
        ),
        Outcome::Running => Next::Wait,
    }
}

enum StartError {
    /// Will not work without a spec change: nothing fits.
    Invalid(String),
    /// The spec contradicts itself (a global batch its pins cannot keep).
    InvalidSpec(String),
    /// Transient (GPU labels missing, history down, API error): retry with backoff.
    Retry(&'static str, ControllerError),
}

/// Resolves the GPU, asks the advisor (with this job's history), builds and creates the Job.
async fn start_attempt(
    ctx: &Context,
    tj: &TrainingJob,
    jobs: &Api<Job>,
    v: &Validated,
    st: &mut TrainingJobStatus,
    generation: Option<i64>,
) -> Result<(), StartError> {
    let gpu: GpuSpec = match &v.gpu {
        Some(name) => gpu::resolve_named(name),
        None => {
            let nodes = ctx.nodes.state();
            gpu::resolve_from_nodes(
                nodes.iter().map(|n| n.as_ref()),
                tj.spec.template.spec.as_ref(),
            )
        }
    }
    .map_err(|e| StartError::Retry("GpuUnknown", ControllerError::Gpu(e.to_string())))?;

    let query = HistoryQuery::new(
        &v.workload.model.name,
        v.workload.method,
        &gpu.name,
        v.workload.seq_len,
    );
    let store = ctx.history.clone();
    let history = tokio::task::spawn_blocking(move || store.similar(&query))
        .await
        .map_err(|e| {
            StartError::Retry("HistoryUnavailable", ControllerError::Other(e.to_string()))
        })?
        .map_err(|e| StartError::Retry("HistoryUnavailable", ControllerError::History(e)))?;

    let suggestion: Suggestion = advisor::suggest(&AdviceRequest {
        workload: &v.workload,
        gpu: &gpu,
        strategy: v.strategy,
        targets: ctx.targets,
        pins: &v.pins,
        history: &history,
    })
    .map_err(|e| match e {
        // The spec asks for a global batch its pins cannot keep: invalid.
        advisor::AdvisorError::GlobalBatch { .. } => StartError::InvalidSpec(e.to_string()),
        _ => StartError::Invalid(e.to_string()),
    })?;
    ctx.metrics
        .suggestions
        .with_label_values(&[
            source_label(&suggestion),
            strategy_label(&suggestion),
            "kubernetes",
        ])
        .inc();
    ctx.metrics
        .suggestion_confidence
        .observe(suggestion.confidence);

    let index = st.attempts.iter().map(|a| a.index).max().unwrap_or(0) + 1;
    let job = build_job(tj, index, &suggestion, v.mode)
        .map_err(|e| StartError::Retry("BuildFailed", ControllerError::Other(e.to_string())))?;
    let job_name = build::job_name(&tj.name_any(), index);
    match jobs.create(&PostParams::default(), &job).await {
        Ok(_) => {}
        // Created on an earlier pass whose status patch was lost: adopt it.
        Err(kube::Error::Api(s)) if s.is_already_exists() => {}
        Err(e) => return Err(StartError::Retry("JobCreateFailed", e.into())),
    }
    let retry = index > 1;
    st.attempts.push(Attempt {
        index,
        job_name: job_name.clone(),
        settings: SettingsStatus::from(&suggestion.settings),
        outcome: Outcome::Running,
        predicted_peak_bytes: Some(suggestion.predicted_peak_bytes),
        measured_peak_bytes: None,
        peak_source: None,
        prediction_error: None,
        tokens_per_sec: None,
        run_id: None,
        message: None,
        last_peak_lookup: None,
        job_uid: None,
        generation,
        mode: Some(v.mode),
        node: None,
        started_at: None,
        finished_at: None,
        peak_lookups: 0,
    });
    st.job_name = Some(job_name.clone());
    st.gpu = Some(gpu.name.clone());
    st.suggestion = Some(SuggestionStatus::from(&suggestion));
    st.phase = Some(Phase::Pending);
    let verb = if v.mode == Mode::Inject {
        "with"
    } else {
        "as written; recommended"
    };
    let msg = format!(
        "{} Job {job_name} {verb} micro batch {} × accumulation {}, {} on {} ({}, confidence {:.2}): {}",
        if retry { "retry: created" } else { "created" },
        suggestion.settings.micro_batch_size,
        suggestion.settings.gradient_accumulation_steps,
        suggestion.settings.dtype,
        gpu.name,
        source_label(&suggestion),
        suggestion.confidence,
        suggestion.reasoning
    );
    set_condition(st, "Ready", true, "JobCreated", &msg, generation);
    ctx.event(
        tj,
        EventType::Normal,
        if retry { "RetryCreated" } else { "JobCreated" },
        msg,
    )
    .await;
    Ok(())
}

fn source_label(s: &Suggestion) -> &'static str {
    use crate::core::advisor::SuggestionSource::*;
    match s.source {
        Heuristic => "heuristic",
        HistoricalData => "historical_data",
        HistoricalDataWithMemory => "historical_data_with_memory",
        LearnedFromFailures => "learned_from_failures",
    }
}

fn strategy_label(s: &Suggestion) -> &'static str {
    use crate::core::advisor::Strategy::*;
    match s.strategy {
        Conservative => "conservative",
        Balanced => "balanced",
        Aggressive => "aggressive",
    }
}

// === Status helpers ===

async fn patch_status(
    api: &Api<TrainingJob>,
    name: &str,
    st: &TrainingJobStatus,
) -> Result<(), ControllerError> {
    let patch = json!({ "status": st });
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

fn has_condition(st: &TrainingJobStatus, type_: &str) -> bool {
    st.conditions
        .iter()
        .any(|c| c.type_ == type_ && c.status == "True")
}

/// Sets a condition, keeping `lastTransitionTime` when the status is unchanged.
fn set_condition(
    st: &mut TrainingJobStatus,
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
) {
    let status = if status { "True" } else { "False" }.to_string();
    let message = truncate(message, 1000);
    if let Some(c) = st.conditions.iter_mut().find(|c| c.type_ == type_) {
        if c.status != status {
            c.last_transition_time = Time(Timestamp::now());
        }
        c.status = status;
        c.reason = reason.to_string();
        c.message = message;
        c.observed_generation = generation;
        return;
    }
    st.conditions.push(Condition {
        type_: type_.to_string(),
        status,
        reason: reason.to_string(),
        message,
        observed_generation: generation,
        last_transition_time: Time(Timestamp::now()),
    });
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod throughput_tests {
    use super::*;

    fn pod(message: &str, exit: i32) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p"},
            "status": {"containerStatuses": [{
                "name": "train", "image": "x", "imageID": "", "ready": false, "restartCount": 0,
                "state": {"terminated": {"exitCode": exit, "message": message}}
            }]}
        }))
        .expect("a pod")
    }

    #[test]
    fn throughput_is_read_from_what_the_job_printed() {
        // HF Trainer's summary: samples/s × sequence length.
        let hf = pod(
            "{'train_runtime': 100.0, 'train_samples_per_second': 6.25, 'train_steps_per_second': 0.8, 'train_loss': 1.2, 'epoch': 1.0}",
            0,
        );
        assert_eq!(reported_tokens_per_sec(&[hf], 4, 2048), Some(6.25 * 2048.0));
        // torchtune's metric line: tokens/s as printed.
        let tt = pod(
            "Step 10 | loss:1.2 lr:2e-05 tokens_per_second_per_gpu:2890.1 peak_memory_active:18.2 peak_memory_alloc:18.2 peak_memory_reserved:19.9 ",
            0,
        );
        assert_eq!(reported_tokens_per_sec(&[tt], 4, 2048), Some(2890.1));
        // Nothing printed: nothing invented.
        assert_eq!(reported_tokens_per_sec(&[pod("", 0)], 4, 2048), None);
        assert_eq!(reported_tokens_per_sec(&[], 4, 2048), None);
    }
}
