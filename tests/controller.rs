//! The TrainingJob reconciler: reconcile I/O against kube's `Client` over
//! `tower_test::mock`, where a small in-memory API server answers each
//! request as Kubernetes would and records it for the assertions.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpufit::controller::crd::{AttemptOutcome, Mode, Phase, TrainingJob, TrainingJobStatus};
use gpufit::controller::inject::ANN_RECOMMENDATION;
use gpufit::controller::metrics::Metrics;
use gpufit::controller::reconcile::{
    reconcile, Context, MeasuredPeak, PeakQuery, PeakReader, MAX_PEAK_LOOKUPS,
};
use gpufit::core::run::RunRecord;
use gpufit::core::similarity::HistoryQuery;
use gpufit::core::workload::Method;
use gpufit::history::{HistoryError, HistoryStore, ListFilter};
use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use kube::Client;
use serde_json::{json, Value};

#[path = "common/api_server.rs"]
mod api_server;
#[path = "common/controller.rs"]
mod fixtures;
use fixtures::*;

use api_server::ApiServer as FakeApi;

/// What the TrainingJob tests read from the scripted API server.
trait Reads {
    /// Bodies of the Jobs created.
    fn jobs_created(&self) -> Vec<Value>;
    /// Patches of a status subresource.
    fn status_patches(&self) -> usize;
    /// Reasons of the Events published.
    fn event_reasons(&self) -> Vec<String>;
    /// The one TrainingJob.
    fn tj_value(&self) -> Option<Value>;
    /// Jobs stored.
    fn jobs_len(&self) -> usize;
}

impl Reads for FakeApi {
    fn jobs_created(&self) -> Vec<Value> {
        self.seen
            .iter()
            .filter(|s| s.method == "POST" && s.path.ends_with("/jobs"))
            .map(|s| s.body.clone())
            .collect()
    }
    fn status_patches(&self) -> usize {
        self.seen
            .iter()
            .filter(|s| s.method == "PATCH" && s.path.ends_with("/status"))
            .count()
    }
    fn event_reasons(&self) -> Vec<String> {
        self.events()
            .iter()
            .filter_map(|e| e["reason"].as_str().map(str::to_string))
            .collect()
    }
    fn tj_value(&self) -> Option<Value> {
        self.objects
            .iter()
            .find(|(k, _)| k.starts_with("trainingjobs/"))
            .map(|(_, v)| v.clone())
    }
    fn jobs_len(&self) -> usize {
        self.objects
            .keys()
            .filter(|k| k.starts_with("jobs/"))
            .count()
    }
}

/// Starts the scripted API server; returns a client talking to it. Every
/// request is kept in `seen` for the assertions.
fn fake_client(api: Arc<Mutex<FakeApi>>) -> Client {
    api_server::client(api)
}

/// A history store double: in memory, or down.
#[derive(Default)]
struct MemHistory {
    runs: Mutex<Vec<RunRecord>>,
    down: std::sync::atomic::AtomicBool,
}

impl MemHistory {
    fn check(&self) -> Result<(), HistoryError> {
        if self.down.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(HistoryError::Store {
                url: "mem:".into(),
                message: "connection refused".into(),
            });
        }
        Ok(())
    }
    fn all(&self) -> Vec<RunRecord> {
        self.runs.lock().unwrap().clone()
    }
}

impl HistoryStore for MemHistory {
    fn record(&self, run: &RunRecord) -> Result<i64, HistoryError> {
        self.check()?;
        let mut runs = self.runs.lock().unwrap();
        let mut r = run.clone();
        r.id = Some(runs.len() as i64 + 1);
        runs.push(r);
        Ok(runs.len() as i64)
    }
    fn similar(&self, q: &HistoryQuery) -> Result<Vec<RunRecord>, HistoryError> {
        self.check()?;
        Ok(self
            .runs
            .lock()
            .unwrap()
            .iter()
            .filter(|r| q.matches(r))
            .cloned()
            .collect())
    }
    fn list(&self, _f: &ListFilter) -> Result<Vec<RunRecord>, HistoryError> {
        self.check()?;
        Ok(self.all())
    }
    fn set_peak(&self, id: i64, peak: u64) -> Result<(), HistoryError> {
        self.check()?;
        let mut runs = self.runs.lock().unwrap();
        let r = runs
            .iter_mut()
            .find(|r| r.id == Some(id))
            .ok_or(HistoryError::Store {
                url: "mem:".into(),
                message: "no such run".into(),
            })?;
        r.result.peak_memory_bytes = Some(peak);
        Ok(())
    }
    fn count(&self) -> Result<u64, HistoryError> {
        self.check()?;
        Ok(self.runs.lock().unwrap().len() as u64)
    }
    fn url(&self) -> String {
        "mem:".into()
    }
}

/// A peak reader double: a fixed answer, or an outage.
struct FakePeaks(Mutex<Result<Option<u64>, String>>);

impl PeakReader for FakePeaks {
    fn job_peak(&self, _q: &PeakQuery) -> Result<Option<MeasuredPeak>, String> {
        self.0.lock().unwrap().clone().map(|o| {
            o.map(|bytes| MeasuredPeak {
                bytes,
                source: "prometheus".into(),
            })
        })
    }
}

const PEAK_RETRY_IN_TESTS: Duration = Duration::from_millis(300);

struct Scenario {
    api: Arc<Mutex<FakeApi>>,
    ctx: Arc<Context>,
    history: Arc<MemHistory>,
    peaks: Arc<FakePeaks>,
}

fn a100_nodes() -> Store<Node> {
    let (store, mut writer) = reflector::store::<Node>();
    writer.apply_watcher_event(&watcher::Event::Apply(node(
        "gpu-1",
        &[
            ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-80GB"),
            ("nvidia.com/gpu.memory", "81920"),
        ],
    )));
    store
}

impl Scenario {
    fn new(tj: TrainingJob, nodes: Store<Node>) -> Self {
        let mut server = FakeApi::default();
        server.insert(
            &format!(
                "trainingjobs/{}",
                tj.metadata.name.clone().unwrap_or_default()
            ),
            serde_json::to_value(&tj).expect("tj json"),
        );
        let api = Arc::new(Mutex::new(server));
        let client = fake_client(api.clone());
        let history = Arc::new(MemHistory::default());
        let peaks = Arc::new(FakePeaks(Mutex::new(Ok(Some(30 << 30)))));
        let (namespaces, _w) = reflector::store::<Namespace>();
        let mut ctx = Context::new(
            client,
            history.clone(),
            nodes,
            namespaces,
            peaks.clone(),
            Metrics::new(),
        );
        // Peak lookups are paced by time: short here, so tests wait little.
        ctx.peak_retry = PEAK_RETRY_IN_TESTS;
        Scenario {
            api,
            ctx: Arc::new(ctx),
            history,
            peaks,
        }
    }

    /// This replica's leadership as `leading` says (a Lease elsewhere).
    fn with_leading(mut self, leading: tokio::sync::watch::Receiver<bool>) -> Self {
        Arc::get_mut(&mut self.ctx)
            .expect("the context is not shared yet")
            .leading = leading;
        self
    }

    /// The TrainingJob as the fake API server holds it now.
    fn tj(&self) -> TrainingJob {
        serde_json::from_value(self.api.lock().unwrap().tj_value().expect("tj")).expect("tj")
    }

    fn status(&self) -> TrainingJobStatus {
        self.tj().status.unwrap_or_default()
    }

    async fn reconcile(
        &self,
    ) -> Result<kube::runtime::controller::Action, gpufit::controller::ControllerError> {
        tokio::time::timeout(
            Duration::from_secs(20),
            reconcile(Arc::new(self.tj()), self.ctx.clone()),
        )
        .await
        .expect("reconcile finishes in time")
    }

    /// Marks a Job finished (and adds its pod), as the Job controller would.
    fn finish_job(&self, name: &str, success: bool, message: &str) {
        let mut api = self.api.lock().unwrap();
        let job = api
            .objects
            .get_mut(&format!("jobs/{name}"))
            .expect("job exists");
        job["status"] = json!({
            "startTime": "2026-11-22T01:00:00Z",
            "completionTime": if success { json!("2026-11-22T01:30:00Z") } else { Value::Null },
            "conditions": [{"type": if success { "Complete" } else { "Failed" }, "status": "True",
                            "lastTransitionTime": "2026-11-22T01:30:00Z"}],
        });
        if job["status"]["completionTime"].is_null() {
            job["status"]
                .as_object_mut()
                .unwrap()
                .remove("completionTime");
        }
        api.add_pods(vec![json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("{name}-x1y2z"), "namespace": "default",
                         "labels": {"batch.kubernetes.io/job-name": name}},
            "spec": {"nodeName": "gpu-1", "containers": [{"name": "train", "image": "i"}]},
            "status": {"hostIP": "10.0.0.7", "containerStatuses": [{
                "name": "train", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
                "state": {"terminated": {"exitCode": if success { 0 } else { 1 }, "reason": if success { "Completed" } else { "Error" }, "message": message}}}]}
        })]);
    }

    fn assert_no_unexpected_requests(&self) {
        let api = self.api.lock().unwrap();
        assert!(
            api.unexpected.is_empty(),
            "unexpected API requests: {:?}",
            api.unexpected
        );
    }
}

fn lora_tj() -> TrainingJob {
    served(tj_from_yaml(EXAMPLE_LORA))
}

fn created_env(job: &Value) -> BTreeMap<String, String> {
    job["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            (
                e["name"].as_str().unwrap_or_default().to_string(),
                e["value"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

const OOM_MESSAGE: &str = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 2.1 GiB is free.";

#[tokio::test]
async fn a_new_training_job_gets_a_job_with_the_settings_and_an_owner_reference_and_a_status() {
    let s = Scenario::new(lora_tj(), a100_nodes());
    s.reconcile().await.expect("reconcile succeeds");
    s.assert_no_unexpected_requests();

    let created = s.api.lock().unwrap().jobs_created();
    assert_eq!(created.len(), 1, "exactly one Job");
    let job = &created[0];
    assert_eq!(job["metadata"]["name"], "llama-3-1-8b-lora-1");
    assert_eq!(job["metadata"]["ownerReferences"][0]["kind"], "TrainingJob");
    assert_eq!(job["metadata"]["ownerReferences"][0]["uid"], "0b5c1f7e-uid");
    let env = created_env(job);
    let st = s.status();
    let sug = st.suggestion.as_ref().expect("suggestion in status");
    assert_eq!(
        env["GPUFIT_MICRO_BATCH_SIZE"],
        sug.settings.micro_batch_size.to_string()
    );
    assert_eq!(
        env["GPUFIT_GRAD_ACCUM_STEPS"],
        sug.settings.gradient_accumulation_steps.to_string()
    );
    // The global batch of 64 is scientific: micro × accumulation × 1 GPU keeps it.
    assert_eq!(
        sug.settings.micro_batch_size * sug.settings.gradient_accumulation_steps,
        64
    );
    let args: Vec<String> =
        serde_json::from_value(job["spec"]["template"]["spec"]["containers"][0]["args"].clone())
            .unwrap();
    assert!(
        args.contains(&format!("batch_size={}", sug.settings.micro_batch_size)),
        "{args:?}"
    );
    assert!(
        args.iter().all(|a| !a.contains('{')),
        "placeholders left: {args:?}"
    );

    assert_eq!(st.phase, Some(Phase::Pending));
    assert_eq!(st.observed_generation, Some(1));
    assert!(st.gpu.as_deref().unwrap_or("").contains("A100"));
    assert_eq!(st.attempts.len(), 1);
    assert_eq!(st.attempts[0].outcome, AttemptOutcome::Running);
    assert!(st
        .conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True"));
    assert_eq!(s.api.lock().unwrap().event_reasons(), vec!["JobCreated"]);
    assert_eq!(
        s.ctx
            .metrics
            .suggestions
            .with_label_values(&["heuristic", "balanced", "trainingjob"])
            .get(),
        1
    );

    // A second pass with nothing new changes nothing and creates nothing.
    let patches = s.api.lock().unwrap().status_patches();
    s.reconcile().await.expect("idempotent");
    assert_eq!(s.api.lock().unwrap().jobs_created().len(), 1);
    assert_eq!(s.api.lock().unwrap().status_patches(), patches);
}

#[tokio::test]
async fn a_replica_that_does_not_lead_creates_no_job_and_writes_no_status() {
    let (tx, rx) = tokio::sync::watch::channel(false);
    let s = Scenario::new(lora_tj(), a100_nodes()).with_leading(rx);
    s.reconcile().await.expect("reconcile succeeds");
    assert!(s.api.lock().unwrap().jobs_created().is_empty());
    assert_eq!(s.api.lock().unwrap().status_patches(), 0);
    // Once it holds the Lease, the same TrainingJob gets its one Job.
    tx.send(true).expect("receiver alive");
    s.reconcile().await.expect("reconcile succeeds");
    assert_eq!(s.api.lock().unwrap().jobs_created().len(), 1);
    s.assert_no_unexpected_requests();
}

#[tokio::test]
async fn a_finished_job_has_its_peak_read_its_run_recorded_and_the_training_job_succeeds() {
    let s = Scenario::new(lora_tj(), a100_nodes());
    s.reconcile().await.expect("create");
    s.finish_job("llama-3-1-8b-lora-1", true, "");
    s.reconcile().await.expect("finish");
    s.assert_no_unexpected_requests();

    let st = s.status();
    assert_eq!(st.phase, Some(Phase::Succeeded));
    let a = &st.attempts[0];
    assert_eq!(a.outcome, AttemptOutcome::Succeeded);
    assert_eq!(a.measured_peak_bytes, Some(30 << 30));
    assert_eq!(st.peak_gib, Some(30.0));
    assert!(a.prediction_error.is_some());
    assert_eq!(a.node.as_deref(), Some("gpu-1"));
    let runs = s.history.all();
    assert_eq!(runs.len(), 1, "one run recorded");
    let r = &runs[0];
    assert!(r.result.success());
    assert_eq!(r.result.peak_memory_bytes, Some(30 << 30));
    assert_eq!(r.result.duration_sec, Some(1800.0));
    // Namespace, Job name and Job uid: the run's identity in the history.
    assert_eq!(
        r.job_id.as_deref(),
        Some("default/llama-3-1-8b-lora-1/uid-llama-3-1-8b-lora-1")
    );
    assert_eq!(Some(r.gpu_model.clone()), st.gpu);
    assert_eq!(r.method, Method::Lora);
    assert_eq!(r.global_batch, Some(64));
    assert_eq!(r.predicted_peak_bytes, a.predicted_peak_bytes);
    assert_eq!(a.run_id, Some(1));
    assert_eq!(s.ctx.metrics.prediction_error.get_sample_count(), 1);
    assert!(s
        .api
        .lock()
        .unwrap()
        .event_reasons()
        .contains(&"Succeeded".to_string()));
}

#[tokio::test]
async fn an_oom_is_recorded_and_retried_with_a_smaller_micro_batch() {
    let s = Scenario::new(lora_tj(), a100_nodes());
    s.reconcile().await.expect("create");
    let first = s
        .status()
        .suggestion
        .expect("suggestion")
        .settings
        .micro_batch_size;
    assert!(
        first > 1,
        "the first suggestion must leave room to shrink, got {first}"
    );
    s.finish_job("llama-3-1-8b-lora-1", false, OOM_MESSAGE);
    s.reconcile().await.expect("retry");
    s.assert_no_unexpected_requests();

    let st = s.status();
    assert_eq!(st.attempts.len(), 2);
    assert_eq!(st.attempts[0].outcome, AttemptOutcome::Oom);
    assert!(st.attempts[0]
        .message
        .as_deref()
        .unwrap_or("")
        .contains("CUDA out of memory"));
    let runs = s.history.all();
    assert_eq!(runs.len(), 1);
    assert!(runs[0].is_oom(), "the OOM is recorded");
    let created = s.api.lock().unwrap().jobs_created();
    assert_eq!(created.len(), 2);
    assert_eq!(created[1]["metadata"]["name"], "llama-3-1-8b-lora-2");
    let second: u32 = created_env(&created[1])["GPUFIT_MICRO_BATCH_SIZE"]
        .parse()
        .unwrap();
    assert!(
        second < first,
        "retry micro batch {second} must be below the OOM batch {first}"
    );
    assert_eq!(st.attempts[1].outcome, AttemptOutcome::Running);
    assert_eq!(st.phase, Some(Phase::Pending));
    assert_eq!(s.ctx.metrics.ooms.get(), 1);
    let reasons = s.api.lock().unwrap().event_reasons();
    assert!(
        reasons.contains(&"OutOfMemory".to_string())
            && reasons.contains(&"RetryCreated".to_string()),
        "{reasons:?}"
    );
}

/// Prometheus stopped while the Job ends and back a while later (here the
/// outage spans three lookup intervals): the run is recorded at once
/// without a peak, every early reconcile leaves the lookups alone, and the
/// peak is filled in when Prometheus answers again.
#[tokio::test]
async fn prometheus_down_when_the_job_ends_and_back_later_fills_the_peak() {
    let s = Scenario::new(lora_tj(), a100_nodes());
    s.reconcile().await.expect("create");
    s.finish_job("llama-3-1-8b-lora-1", true, "");
    *s.peaks.0.lock().unwrap() = Err("Prometheus at http://prom:9090: connection refused".into());
    s.reconcile().await.expect("records without the peak");
    assert_eq!(s.history.all().len(), 1);
    // Outage: reconciles keep coming (status patches, Job events, requeues).
    let outage = PEAK_RETRY_IN_TESTS * 3;
    let t = std::time::Instant::now();
    while t.elapsed() < outage {
        s.reconcile().await.expect("during the outage");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let a = &s.status().attempts[0];
    assert!(
        a.peak_lookups < MAX_PEAK_LOOKUPS,
        "lookups exhausted during a short outage: {a:?}"
    );
    // Prometheus is back.
    *s.peaks.0.lock().unwrap() = Ok(Some(27 << 30));
    let deadline = std::time::Instant::now() + PEAK_RETRY_IN_TESTS * 8;
    while s.status().attempts[0].measured_peak_bytes.is_none() {
        assert!(std::time::Instant::now() < deadline, "never filled in");
        s.reconcile().await.expect("after the outage");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(s.history.all()[0].result.peak_memory_bytes, Some(27 << 30));
    s.assert_no_unexpected_requests();
}

/// The event order a real API server produces: creating the retry's Job
/// makes its ADDED event reconcile the TrainingJob from a cache that does
/// not have our status patch yet. That stale copy must not finish, record,
/// count or announce the OOM a second time, nor create anything.
#[tokio::test]
async fn a_stale_cached_training_job_does_not_finish_an_attempt_twice() {
    let s = Scenario::new(lora_tj(), a100_nodes());
    s.reconcile().await.expect("create");
    s.finish_job("llama-3-1-8b-lora-1", false, OOM_MESSAGE);
    let stale = s.tj();
    s.reconcile().await.expect("retry");
    // The ADDED event of Job 2 (and a duplicate of it), with the old copy.
    for _ in 0..2 {
        tokio::time::timeout(
            Duration::from_secs(20),
            reconcile(Arc::new(stale.clone()), s.ctx.clone()),
        )
        .await
        .expect("in time")
        .expect("stale reconcile");
    }
    s.assert_no_unexpected_requests();
    assert_eq!(s.history.all().len(), 1, "the OOM recorded once");
    assert_eq!(s.ctx.metrics.ooms.get(), 1, "counted once");
    let reasons = s.api.lock().unwrap().event_reasons();
    let count = |r: &str| reasons.iter().filter(|x| x.as_str() == r).count();
    assert_eq!(count("OutOfMemory"), 1, "{reasons:?}");
    assert_eq!(count("RetryCreated"), 1, "{reasons:?}");
    assert_eq!(s.api.lock().unwrap().jobs_created().len(), 2);
    let st = s.status();
    assert_eq!(st.attempts.len(), 2);
    assert_eq!(st.attempts[1].outcome, AttemptOutcome::Running);
}

/// The other stale copy: one whose status lacks the attempt just started
/// (the new Job's ADDED event raced our status patch). Its Job already
/// exists, so it is the attempt already started: adopted, with no second
/// event and no second count — for the first Job and for a retry.
#[tokio::test]
async fn a_stale_cached_training_job_announces_and_counts_each_job_once() {
    let a100 = node(
        "gpu-1",
        &[
            ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-80GB"),
            ("nvidia.com/gpu.memory", "81920"),
        ],
    );
    let (nodes, mut writer) = reflector::store::<Node>();
    writer.apply_watcher_event(&watcher::Event::Apply(a100.clone()));
    let s = Scenario::new(lora_tj(), nodes);
    let replay = |stale: TrainingJob| {
        let ctx = s.ctx.clone();
        async move {
            // The event, and a duplicate of it.
            for _ in 0..2 {
                tokio::time::timeout(
                    Duration::from_secs(20),
                    reconcile(Arc::new(stale.clone()), ctx.clone()),
                )
                .await
                .expect("in time")
                .expect("stale reconcile");
            }
        }
    };

    // The first Job.
    let before_first = s.tj();
    s.reconcile().await.expect("create");
    replay(before_first).await;
    // The retry: the OOM is written on a pass that cannot start it (the
    // nodes' labels are gone for a moment), its Job created on the next.
    s.finish_job("llama-3-1-8b-lora-1", false, OOM_MESSAGE);
    writer.apply_watcher_event(&watcher::Event::Delete(a100.clone()));
    s.reconcile().await.expect_err("no GPU known: retried");
    let before_retry = s.tj();
    writer.apply_watcher_event(&watcher::Event::Apply(a100));
    s.reconcile().await.expect("retry");
    replay(before_retry).await;

    s.assert_no_unexpected_requests();
    assert_eq!(s.api.lock().unwrap().jobs_len(), 2, "two Jobs");
    let reasons = s.api.lock().unwrap().event_reasons();
    let count = |r: &str| reasons.iter().filter(|x| x.as_str() == r).count();
    assert_eq!(count("JobCreated"), 1, "{reasons:?}");
    assert_eq!(count("RetryCreated"), 1, "{reasons:?}");
    // Summed over every label set (the retry's source differs).
    let suggestions: f64 = s
        .ctx
        .metrics
        .render()
        .lines()
        .filter(|l| l.starts_with("gpufit_controller_suggestions_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(suggestions, 2.0, "one suggestion counted per Job");
    assert_eq!(s.ctx.metrics.suggestion_confidence.get_sample_count(), 2);
    let st = s.status();
    assert_eq!(st.attempts.len(), 2);
    assert_eq!(st.attempts[0].outcome, AttemptOutcome::Oom);
    assert_eq!(st.attempts[1].outcome, AttemptOutcome::Running);
    assert_eq!(s.history.all().len(), 1, "the OOM recorded once");
}

/// A container killed for host memory (`OOMKilled`, exit 137): the attempt
/// failed for another reason than GPU memory (no retry with a smaller micro
/// batch), says so in its status, and its run is recorded `other_error`
/// with `host_oom` for the data loader to learn from.
#[tokio::test]
async fn a_host_memory_kill_fails_the_attempt_and_is_recorded_for_the_data_loader() {
    let s = Scenario::new(lora_tj(), a100_nodes());
    s.reconcile().await.expect("create");
    s.finish_job("llama-3-1-8b-lora-1", false, "");
    {
        let mut api = s.api.lock().unwrap();
        let pod = api
            .objects
            .get_mut("pods/llama-3-1-8b-lora-1-x1y2z")
            .expect("the job's pod");
        pod["status"]["containerStatuses"][0]["state"]["terminated"] =
            json!({"exitCode": 137, "reason": "OOMKilled"});
    }
    s.reconcile().await.expect("settle");
    s.assert_no_unexpected_requests();
    let st = s.status();
    assert_eq!(
        st.attempts.len(),
        1,
        "no retry: the micro batch is not at fault"
    );
    assert_eq!(st.attempts[0].outcome, AttemptOutcome::Failed);
    assert!(st.attempts[0].host_oom);
    assert!(
        st.attempts[0]
            .message
            .as_deref()
            .unwrap_or("")
            .contains("host memory"),
        "{:?}",
        st.attempts[0].message
    );
    let runs = s.history.all();
    assert_eq!(runs.len(), 1);
    assert_eq!(
        runs[0].result.failure_reason(),
        Some(gpufit::core::run::FailureReason::OtherError)
    );
    assert!(runs[0].result.host_oom());
    assert_eq!(s.ctx.metrics.ooms.get(), 0, "not a GPU OOM");
}

#[tokio::test]
async fn when_oom_retries_are_exhausted_the_training_job_fails() {
    let mut tj = lora_tj();
    tj.spec.oom_retry_limit = Some(1);
    let s = Scenario::new(tj, a100_nodes());
    s.reconcile().await.expect("create");
    s.finish_job("llama-3-1-8b-lora-1", false, OOM_MESSAGE);
    s.reconcile().await.expect("retry");
    s.finish_job("llama-3-1-8b-lora-2", false, OOM_MESSAGE);
    s.reconcile().await.expect("give up");
    s.assert_no_unexpected_requests();

    let st = s.status();
    assert_eq!(st.phase, Some(Phase::Failed));
    assert_eq!(st.attempts.len(), 2, "no third Job");
    assert_eq!(s.api.lock().unwrap().jobs_created().len(), 2);
    assert_eq!(s.history.all().len(), 2, "both OOMs recorded");
    let ready = st
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .expect("Ready condition");
    assert_eq!(ready.status, "False");
    assert_eq!(ready.reason, "OOMRetriesExhausted");
}

#[tokio::test]
async fn an_invalid_spec_sets_a_condition_and_creates_no_job() {
    let mut tj = lora_tj();
    // A LoRA rank on a full fine-tune contradicts itself: refused on every path.
    tj.spec.workload.method = Some(Method::Full);
    let s = Scenario::new(tj, a100_nodes());
    let action = s
        .reconcile()
        .await
        .expect("invalid is not an error to retry");
    s.assert_no_unexpected_requests();
    assert_eq!(action, kube::runtime::controller::Action::await_change());
    assert!(s.api.lock().unwrap().jobs_created().is_empty());
    let st = s.status();
    assert_eq!(st.phase, Some(Phase::Invalid));
    let c = st
        .conditions
        .iter()
        .find(|c| c.type_ == "Invalid")
        .expect("Invalid condition");
    assert_eq!(c.status, "True");
    assert!(c.message.contains("loraRank"), "{}", c.message);
    assert_eq!(s.api.lock().unwrap().event_reasons(), vec!["InvalidSpec"]);
}

#[tokio::test]
async fn a_job_deleted_under_a_running_training_job_fails_it_and_is_not_recreated() {
    let s = Scenario::new(lora_tj(), a100_nodes());
    s.reconcile().await.expect("create");
    s.api
        .lock()
        .unwrap()
        .objects
        .retain(|k, _| !k.starts_with("jobs/"));
    s.reconcile().await.expect("notices the deletion");
    s.assert_no_unexpected_requests();
    let st = s.status();
    assert_eq!(st.attempts[0].outcome, AttemptOutcome::Deleted);
    assert_eq!(st.phase, Some(Phase::Failed));
    assert_eq!(
        s.api.lock().unwrap().jobs_created().len(),
        1,
        "not recreated"
    );
    assert!(s.history.all().is_empty(), "a deleted Job is no run result");
    assert!(s
        .api
        .lock()
        .unwrap()
        .event_reasons()
        .contains(&"JobDeleted".to_string()));
}

#[tokio::test]
async fn with_the_history_store_down_the_run_stays_in_status_and_is_recorded_later() {
    let s = Scenario::new(lora_tj(), a100_nodes());
    s.reconcile().await.expect("create");
    s.finish_job("llama-3-1-8b-lora-1", true, "");
    s.history
        .down
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let err = s.reconcile().await.expect_err("history down is retried");
    assert_eq!(err.metric_label(), "history");
    let st = s.status();
    assert_eq!(
        st.attempts[0].outcome,
        AttemptOutcome::Succeeded,
        "the outcome is kept in status"
    );
    assert_eq!(st.attempts[0].run_id, None);
    assert!(st
        .conditions
        .iter()
        .any(|c| c.type_ == "HistoryUnavailable" && c.status == "True"));

    s.history
        .down
        .store(false, std::sync::atomic::Ordering::SeqCst);
    s.reconcile().await.expect("recorded now");
    s.assert_no_unexpected_requests();
    assert_eq!(s.history.all().len(), 1);
    let st = s.status();
    assert_eq!(st.attempts[0].run_id, Some(1));
    assert!(st
        .conditions
        .iter()
        .any(|c| c.type_ == "HistoryUnavailable" && c.status == "False"));
}

#[tokio::test]
async fn an_unknown_peak_is_recorded_as_unknown_and_filled_in_later() {
    let s = Scenario::new(lora_tj(), a100_nodes());
    s.reconcile().await.expect("create");
    s.finish_job("llama-3-1-8b-lora-1", true, "");
    *s.peaks.0.lock().unwrap() =
        Err("Prometheus at http://prom:9090 did not answer within 5s".into());
    s.reconcile().await.expect("records without the peak");
    let runs = s.history.all();
    assert_eq!(runs.len(), 1, "recorded, not dropped");
    assert_eq!(runs[0].result.peak_memory_bytes, None);
    assert!(s
        .api
        .lock()
        .unwrap()
        .event_reasons()
        .contains(&"PeakUnavailable".to_string()));

    *s.peaks.0.lock().unwrap() = Ok(Some(31 << 30));
    tokio::time::sleep(PEAK_RETRY_IN_TESTS + Duration::from_millis(50)).await;
    s.reconcile().await.expect("fills the peak");
    s.assert_no_unexpected_requests();
    assert_eq!(s.history.all()[0].result.peak_memory_bytes, Some(31 << 30));
    assert_eq!(s.status().attempts[0].measured_peak_bytes, Some(31 << 30));
}

/// A peak that reaches Prometheus late: the status patch of each failed
/// lookup triggers a reconcile at once (the TrainingJob's own watch event),
/// and those must not spend the lookups — time paces them, so the peak is
/// still filled in when it arrives.
#[tokio::test]
async fn a_peak_that_arrives_late_is_filled_in_despite_immediate_reconciles() {
    let s = Scenario::new(lora_tj(), a100_nodes());
    s.reconcile().await.expect("create");
    s.finish_job("llama-3-1-8b-lora-1", true, "");
    *s.peaks.0.lock().unwrap() = Ok(None);
    s.reconcile().await.expect("records without the peak");
    // The events a real API server sends right after each status patch.
    for _ in 0..(MAX_PEAK_LOOKUPS * 2) {
        s.reconcile().await.expect("an early reconcile");
    }
    let a = &s.status().attempts[0];
    assert_eq!(a.peak_lookups, 1, "early reconciles spent lookups: {a:?}");
    assert_eq!(a.measured_peak_bytes, None);
    // The peak shows up in Prometheus later; the next due lookup finds it.
    *s.peaks.0.lock().unwrap() = Ok(Some(29 << 30));
    tokio::time::sleep(PEAK_RETRY_IN_TESTS + Duration::from_millis(50)).await;
    s.reconcile().await.expect("the due lookup");
    assert_eq!(s.status().attempts[0].measured_peak_bytes, Some(29 << 30));
    assert_eq!(s.history.all()[0].result.peak_memory_bytes, Some(29 << 30));
    s.assert_no_unexpected_requests();
}

#[tokio::test]
async fn without_gpu_labels_the_training_job_waits_with_a_condition_and_backs_off() {
    let (empty, _w) = reflector::store::<Node>();
    let s = Scenario::new(lora_tj(), empty);
    let err = s.reconcile().await.expect_err("retried with backoff");
    s.assert_no_unexpected_requests();
    assert_eq!(err.metric_label(), "gpu");
    assert!(s.api.lock().unwrap().jobs_created().is_empty());
    let st = s.status();
    let ready = st
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .expect("Ready");
    assert_eq!(ready.reason, "GpuUnknown");
    assert!(ready.message.contains("spec.gpu"), "{}", ready.message);
    let first = s.ctx.next_backoff("default/llama-3-1-8b-lora");
    let second = s.ctx.next_backoff("default/llama-3-1-8b-lora");
    assert!(second > first && second <= Duration::from_secs(300));
}

#[tokio::test]
async fn in_recommend_mode_the_job_runs_as_written_and_the_suggestion_goes_to_status() {
    let s = Scenario::new(served(tj_from_yaml(EXAMPLE_RECOMMEND)), a100_nodes());
    s.reconcile().await.expect("create");
    let created = s.api.lock().unwrap().jobs_created();
    assert_eq!(created.len(), 1);
    let job = &created[0];
    assert!(
        created_env(job).keys().all(|k| !k.starts_with("GPUFIT_")),
        "no settings injected"
    );
    assert_eq!(
        job["spec"]["template"]["spec"]["containers"][0]["args"],
        json!(["--per_device_train_batch_size", "8", "--bf16"])
    );
    assert!(job["metadata"]["annotations"][ANN_RECOMMENDATION].is_string());
    let st = s.status();
    assert_eq!(st.mode, Some(Mode::Recommend));
    assert!(st.suggestion.is_some(), "the recommendation is in status");

    // Its outcome is not recorded as a run: gpufit does not know its real settings.
    s.finish_job("qwen-full-recommend-1", true, "");
    s.reconcile().await.expect("finish");
    s.assert_no_unexpected_requests();
    assert_eq!(s.status().phase, Some(Phase::Succeeded));
    assert!(s.history.all().is_empty());
}

/// Issue 46 on the TrainingJob path: a node sharing each A100 80GB ten
/// ways through MPS, and a TrainingJob asking `gpufit.io/gpu-sharing=whole`:
/// planned for the 8 GiB the MPS daemon lets each pod use, and the refusal
/// of `whole` is a Warning event on the TrainingJob, not only a log line.
#[tokio::test]
async fn whole_on_an_mps_node_is_planned_for_the_share_and_the_training_job_is_told_why() {
    let (nodes, mut writer) = reflector::store::<Node>();
    writer.apply_watcher_event(&watcher::Event::Apply(node(
        "mps-1",
        &[
            ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-80GB-SHARED"),
            ("nvidia.com/gpu.memory", "81920"),
            ("nvidia.com/gpu.count", "8"),
            ("nvidia.com/gpu.replicas", "10"),
            ("nvidia.com/gpu.sharing-strategy", "mps"),
        ],
    )));
    let yaml = EXAMPLE_LORA
        .replace("model: meta-llama/Llama-3.1-8B", "model: Qwen/Qwen2.5-0.5B")
        .replace("seqLen: 2048", "seqLen: 512")
        .replace(
            "nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB",
            "nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB-SHARED",
        );
    let mut tj = served(tj_from_yaml(&yaml));
    tj.metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert("gpufit.io/gpu-sharing".into(), "whole".into());
    let s = Scenario::new(tj, nodes);
    s.reconcile().await.expect("reconcile succeeds");
    let created = s.api.lock().unwrap().jobs_created();
    assert_eq!(created.len(), 1, "the job runs");
    let st = s.status();
    let sug = st.suggestion.as_ref().expect("suggestion in status");
    assert!(
        sug.predicted_peak_bytes <= 8 << 30,
        "planned within the 8 GiB share: {}",
        sug.predicted_peak_bytes
    );
    assert!(
        st.gpu.as_deref().unwrap_or("").contains("MPS-shared by 10"),
        "{:?}",
        st.gpu
    );
    let reasons = s.api.lock().unwrap().event_reasons();
    assert!(
        reasons.iter().any(|r| r == "GpuSharing"),
        "a Warning event says why `whole` was not used: {reasons:?}"
    );
}
