//! Step 1, observe: the spec (mode, validation) and the in-flight attempt
//! — still running, finished (outcome, OOM or not, throughput, and the first
//! peak lookup), or deleted under us.

use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ContainerStateTerminated, Namespace, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams};
use kube::runtime::events::EventType;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::ResourceExt;

use crate::controller::crd::{
    Attempt, AttemptOutcome, Mode, Phase, TrainingJob, TrainingJobStatus,
};
use crate::controller::validate::{self, Validated, ValidationError};
use crate::controller::ControllerError;

use super::context::{Context, PeakQuery, PodRef};
use super::peaks::lookup_peak;
use super::status::truncate;
use super::MODE_KEY;

/// A Kubernetes read failed while observing.
#[derive(Debug, thiserror::Error)]
pub(super) enum ObserveError {
    #[error(transparent)]
    Kube(#[from] kube::Error),
}

impl From<ObserveError> for ControllerError {
    fn from(e: ObserveError) -> Self {
        match e {
            ObserveError::Kube(k) => ControllerError::Kube(k),
        }
    }
}

/// What observing the in-flight attempt found.
pub(super) enum Observed {
    /// This TrainingJob is a stale cached copy: touch nothing, look again soon.
    Stale,
    /// `requeue` while a Job is still active; `just_finished` is the attempt
    /// that finished in this pass (its peak was just looked up).
    Seen {
        requeue: Option<Duration>,
        just_finished: Option<usize>,
    },
}

/// The spec, validated with the mode its annotation or namespace gives.
pub(super) fn validated(tj: &TrainingJob, ctx: &Context) -> Result<Validated, ValidationError> {
    mode_default(tj, &ctx.namespaces)
        .and_then(|m| validate::validate(&tj.spec, Some(m.unwrap_or(ctx.default_mode))))
}

/// The in-flight attempt: still running, finished, or deleted.
pub(super) async fn in_flight(
    ctx: &Context,
    tj: &TrainingJob,
    ns: &str,
    st: &mut TrainingJobStatus,
) -> Result<Observed, ObserveError> {
    let name = tj.name_any();
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let mut requeue: Option<Duration> = None;
    let mut just_finished = None;
    if let Some(i) = st
        .attempts
        .iter()
        .rposition(|a| a.outcome == AttemptOutcome::Running)
    {
        let job_name = st.attempts[i].job_name.clone();
        match jobs.get_opt(&job_name).await? {
            None => {
                let a = &mut st.attempts[i];
                a.outcome = AttemptOutcome::Deleted;
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
                JobProgress::Active(running) => {
                    st.phase = Some(if running {
                        Phase::Running
                    } else {
                        Phase::Pending
                    });
                    requeue = Some(Duration::from_secs(300));
                }
                JobProgress::Finished(_)
                    if jobs
                        .get_opt(&crate::controller::build::job_name(
                            &name,
                            st.attempts[i].index + 1,
                        ))
                        .await?
                        .is_some() =>
                {
                    // The next attempt's Job exists: this TrainingJob is a
                    // stale cached copy (its ADDED event raced our status
                    // patch). Finishing the attempt again would record,
                    // count and announce it twice: wait for the fresh copy.
                    tracing::debug!(tj = %name, "stale TrainingJob in the cache; requeued");
                    return Ok(Observed::Stale);
                }
                JobProgress::Finished(success) => {
                    let pod_list = pods
                        .list(
                            &ListParams::default()
                                .labels(&format!("batch.kubernetes.io/job-name={job_name}")),
                        )
                        .await?
                        .items;
                    finish_attempt(ctx, tj, &mut st.attempts[i], ns, &job, &pod_list, success)
                        .await;
                    just_finished = Some(i);
                    if let Some(p) = st.attempts[i].measured_peak_bytes {
                        st.peak_gib = Some((crate::core::units::to_gib(p) * 100.0).round() / 100.0);
                    }
                }
            },
        }
    }

    Ok(Observed::Seen {
        requeue,
        just_finished,
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

enum JobProgress {
    /// Not finished; `true` when a pod is running.
    Active(bool),
    /// Finished; `true` when it succeeded.
    Finished(bool),
}

fn job_state(job: &Job) -> JobProgress {
    let status = job.status.clone().unwrap_or_default();
    for c in status.conditions.iter().flatten() {
        if c.status == "True" {
            match c.type_.as_str() {
                "Complete" => return JobProgress::Finished(true),
                "Failed" => return JobProgress::Finished(false),
                _ => {}
            }
        }
    }
    JobProgress::Active(status.active.unwrap_or(0) > 0)
}

/// Tells a GPU out-of-memory failure from other failures by the containers'
/// termination messages (with `terminationMessagePolicy:
/// FallbackToLogsOnError` that is the log's tail) and exit codes.
pub fn classify_failure(job: &Job, pods: &[Pod]) -> (AttemptOutcome, String) {
    if let Some(found) = classify_pods(pods) {
        return found;
    }
    let cond = job
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Failed"))
        .and_then(|c| c.message.clone().or(c.reason.clone()));
    (
        AttemptOutcome::Failed,
        format!(
            "the Job failed: {}",
            cond.unwrap_or_else(|| "no reason given".into())
        ),
    )
}

/// What the pods of a failed workload say: a GPU out-of-memory failure in
/// any container of any pod first (one OOM anywhere fails the whole
/// workload), else the first other failure; `None` when no container says.
/// The one set of rules for TrainingJobs and webhook-configured workloads.
pub fn classify_pods(pods: &[Pod]) -> Option<(AttemptOutcome, String)> {
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
                    return Some((
                        AttemptOutcome::Oom,
                        format!(
                            "container {} ran out of GPU memory (exit code {}): {}",
                            cs.name,
                            t.exit_code,
                            truncate(line.trim(), 300)
                        ),
                    ));
                }
                if other.is_none() {
                    other = Some(if killed_for_host_memory(t) {
                        format!(
                            "container {} was killed (exit code {}, {}): host memory, not GPU memory; raise its memory limit",
                            cs.name,
                            t.exit_code,
                            t.reason.as_deref().unwrap_or("OOMKilled")
                        )
                    } else if t.exit_code == 137 {
                        format!(
                            "container {} was killed (exit code 137, SIGKILL without OOMKilled): preempted, evicted or stopped, not out of memory",
                            cs.name
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
                    });
                }
            }
        }
    }
    other.map(|msg| (AttemptOutcome::Failed, msg))
}

/// Every container's termination of `pods`, now and in its last state.
pub(crate) fn terminated_states(pods: &[Pod]) -> impl Iterator<Item = &ContainerStateTerminated> {
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
}

/// Whether a container of `pods` was killed for host memory: the kubelet's
/// termination reason `OOMKilled` (its cgroup's memory limit), now or in
/// its last state. Not a GPU OOM: the run stays `other_error`, and the
/// data loader learns from it ([`crate::core::run::RunResult::host_oom`]).
/// A bare exit code 137 is any SIGKILL (preemption, eviction), so only the
/// reason counts.
pub fn host_oom_killed(pods: &[Pod]) -> bool {
    terminated_states(pods).any(killed_for_host_memory)
}

/// The exit-137 rule, said once: a container was killed for host memory
/// only when the kubelet says `OOMKilled`; a bare exit code 137 is any
/// SIGKILL (preemption, eviction).
fn killed_for_host_memory(t: &ContainerStateTerminated) -> bool {
    t.reason.as_deref() == Some("OOMKilled")
}

fn time_str(t: Option<&Time>) -> Option<String> {
    t.map(|t| t.0.to_string())
}

pub(crate) fn unix(s: Option<&str>) -> Option<f64> {
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
pub(super) async fn finish_attempt(
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
    // What the Job really ran: its result record, the settings its
    // termination message states, or the micro batch gpufit wrote into its
    // command line; else unconfirmed (docs/controller.md, "Confirmed settings").
    let evidence = crate::controller::confirm::PodEvidence::of(pods);
    let mut ran_batch = a.settings.micro_batch_size;
    if let Some(injected) = a.settings.to_settings() {
        let c = evidence.confirm(&injected);
        ran_batch = c.settings.micro_batch_size;
        a.ran_settings = (!c.differences.is_empty())
            .then(|| crate::controller::crd::SettingsStatus::from(&c.settings));
        a.confirmation = Some(c.confirmation);
    }
    let seq = tj.spec.workload.seq_len;
    a.tokens_per_sec = evidence
        .record
        .as_ref()
        .and_then(|r| r.tokens_per_sec)
        .filter(|t| t.is_finite() && *t > 0.0)
        .or_else(|| reported_tokens_per_sec(pods, ran_batch, seq));
    if success {
        a.outcome = AttemptOutcome::Succeeded;
        a.message = None;
    } else {
        let (outcome, msg) = classify_failure(job, pods);
        a.outcome = outcome;
        a.message = Some(msg.clone());
        a.host_oom = outcome == AttemptOutcome::Failed && host_oom_killed(pods);
        if outcome == AttemptOutcome::Oom {
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
    terminated_states(pods)
        .filter_map(|t| t.message.as_deref())
        .filter_map(|msg| crate::core::logs::parse_str(msg).ok())
        .find_map(|p| {
            p.tokens_per_sec
                .or(p.samples_per_sec.map(|s| s * seq))
                .or(p.steps_per_sec.map(|s| s * micro_batch as f64 * seq))
                .filter(|t| t.is_finite() && *t > 0.0)
        })
}

#[cfg(test)]
mod throughput_tests {
    use super::*;
    use serde_json::json;

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

    #[test]
    fn a_bare_exit_137_is_not_called_host_memory() {
        // Issue 47: the message said "host memory" for any 137 while the
        // record treated it as any SIGKILL; one rule now.
        let (_, msg) = classify_pods(&[pod("", 137)]).expect("a failure");
        assert!(!msg.contains("host memory"), "{msg}");
        assert!(msg.contains("SIGKILL"), "{msg}");
        assert!(!host_oom_killed(&[pod("", 137)]));
    }
}
