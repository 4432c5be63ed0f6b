//! Runs of workloads the admission webhook configured (issue 38): a Job, a
//! 4-pod PyTorchJob, a JobSet and a Kubeflow Trainer TrainJob admitted by
//! the webhook, then recorded by the leader's workload reconciler through
//! kube's `Client` over a scripted in-memory API server (GET/PATCH the
//! object, list its pods, a Lease with optimistic concurrency), into a real
//! SQLite history. Then the same workload submitted again learns from it.
//! Controller restarts mid-run, a second replica, duplicate and stale watch
//! events: 0 duplicated and 0 lost records. One test reads the peaks from a
//! real Prometheus scraping a simulated sidecar.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpufit::controller::crd::Mode;
use gpufit::controller::inject::ANN_APPLIED;
use gpufit::controller::leader::{self, LeaderConfig};
use gpufit::controller::metrics::Metrics;
use gpufit::controller::prom::{render_query, PromClient, DEFAULT_PEAK_QUERY};
use gpufit::controller::reconcile::workloads::{
    reconcile_workload, WorkloadContext, ANN_RECORDED, LABEL_CONFIGURED,
};
use gpufit::controller::reconcile::{
    Context, MeasuredPeak, PeakQuery, PeakReader, PromThenSidecar,
};
use gpufit::controller::webhook::{review, WebhookState};
use gpufit::core::advisor::StrategyTargets;
use gpufit::core::run::{FailureReason, RunRecord};
use gpufit::history::{HistoryStore, ListFilter};
use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::reflector;
use kube::runtime::watcher;
use kube::Client;
use serde_json::{json, Value};
use tokio::sync::watch;

#[path = "common/api_server.rs"]
mod api_server;
#[path = "common/prom.rs"]
mod prom;

use api_server::ApiServer as FakeApi;

fn fake_client(api: Arc<Mutex<FakeApi>>) -> Client {
    api_server::client(api)
}

/// A peak reader double that keeps every query (to check all pods are asked).
#[derive(Default)]
struct Peaks {
    bytes: Mutex<Option<u64>>,
    queries: Mutex<Vec<PeakQuery>>,
}

impl PeakReader for Peaks {
    fn job_peak(&self, q: &PeakQuery) -> Result<Option<MeasuredPeak>, String> {
        self.queries.lock().unwrap().push(q.clone());
        Ok(self.bytes.lock().unwrap().map(|bytes| MeasuredPeak {
            bytes,
            source: "prometheus".into(),
        }))
    }
}

struct World {
    api: Arc<Mutex<FakeApi>>,
    history: Arc<dyn HistoryStore>,
    peaks: Arc<Peaks>,
    /// What the controllers read peaks with: `peaks`, or a real Prometheus.
    reader: Arc<dyn PeakReader>,
    webhook: WebhookState,
    _dir: tempfile::TempDir,
}

/// The leader Lease's name (namespace `gpufit`).
const LEASE: &str = "gpufit-controller";

/// A controller replica: its recorder, and its leader-election loop over
/// the scripted Lease, which it hands back when stopped.
struct Replica {
    c: Arc<WorkloadContext>,
    leading: watch::Receiver<bool>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Replica {
    async fn wait_leading(&mut self, want: bool) {
        tokio::time::timeout(
            Duration::from_secs(10),
            self.leading.wait_for(|l| *l == want),
        )
        .await
        .unwrap_or_else(|_| panic!("leadership did not become {want}"))
        .expect("leader loop alive");
    }

    /// A rolling update stops it: it steps down and hands the Lease back.
    async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .expect("the replica stops in time")
            .expect("leader loop");
    }
}

fn a100_nodes() -> reflector::Store<Node> {
    let (nodes, mut w) = reflector::store::<Node>();
    w.apply_watcher_event(&watcher::Event::Apply(
        serde_json::from_value(json!({"metadata": {"name": "gpu-1", "labels": {
            "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.memory": "81920"}}}))
        .expect("node"),
    ));
    nodes
}

impl World {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite:{}", dir.path().join("h.db").display());
        let history: Arc<dyn HistoryStore> = Arc::from(gpufit::history::open(&url).expect("db"));
        let (namespaces, _w) = reflector::store::<Namespace>();
        let peaks = Arc::new(Peaks::default());
        World {
            api: Arc::new(Mutex::new(FakeApi::default())),
            reader: peaks.clone(),
            webhook: WebhookState {
                history: history.clone(),
                nodes: a100_nodes(),
                namespaces,
                metrics: Metrics::new(),
                targets: StrategyTargets::default(),
                default_mode: Mode::Inject,
                cache: Default::default(),
                kueue: Default::default(),
            },
            history,
            peaks,
            _dir: dir,
        }
    }

    /// A controller instance (a restart makes a new one over the same history).
    fn controller(&self, kind: Kind) -> Arc<WorkloadContext> {
        self.controller_leading(kind, watch::channel(true).1)
    }

    /// A controller instance whose leadership `leading` says.
    fn controller_leading(
        &self,
        kind: Kind,
        leading: watch::Receiver<bool>,
    ) -> Arc<WorkloadContext> {
        let (namespaces, _w) = reflector::store::<Namespace>();
        let mut ctx = Context::new(
            fake_client(self.api.clone()),
            self.history.clone(),
            a100_nodes(),
            namespaces,
            self.reader.clone(),
            Metrics::new(),
        );
        ctx.peak_retry = Duration::from_millis(200);
        ctx.leading = leading;
        // One process: the recorder and the webhook share the history cache.
        ctx.history_cache = self.webhook.cache.clone();
        let (group, version, k, plural) = kind;
        Arc::new(WorkloadContext {
            ctx: Arc::new(ctx),
            resource: ApiResource::from_gvk_with_plural(
                &GroupVersionKind::gvk(group, version, k),
                plural,
            ),
        })
    }

    /// A replica (new process state) recording `kind`, its leadership from
    /// the real leader-election loop over the scripted Lease.
    fn replica(&self, kind: Kind, identity: &str) -> Replica {
        let (tx, rx) = watch::channel(false);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let cfg = LeaderConfig {
            lease_name: LEASE.into(),
            namespace: "gpufit".into(),
            identity: identity.into(),
            lease_duration: Duration::from_secs(2),
            renew_every: Duration::from_millis(50),
        };
        let task = tokio::spawn(leader::run(fake_client(self.api.clone()), cfg, tx, async {
            let _ = stop_rx.await;
        }));
        Replica {
            c: self.controller_leading(kind, rx.clone()),
            leading: rx,
            stop: Some(stop_tx),
            task,
        }
    }

    /// Admits `obj` through the webhook and stores it as the API server would.
    fn submit(&self, kind: Kind, obj: Value) -> Value {
        let (group, version, k, plural) = kind;
        let body = json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": "705ab4f5", "kind": {"group": group, "version": version, "kind": k},
                "resource": {"group": group, "version": version, "resource": plural},
                "name": obj["metadata"]["name"].clone(), "namespace": "ml", "operation": "CREATE",
                "userInfo": {"username": "alice"}, "object": obj.clone(), "dryRun": false
            }
        });
        let out = review(&serde_json::to_vec(&body).unwrap(), &self.webhook);
        let resp = out.response.expect("a response");
        assert!(resp.allowed, "{:?}", resp.result);
        let patch: json_patch::Patch =
            serde_json::from_slice(&resp.patch.expect("a patch")).expect("JSON patch");
        let mut admitted = obj;
        json_patch::patch(&mut admitted, &patch).expect("patch applies");
        let name = admitted["metadata"]["name"].as_str().unwrap().to_string();
        admitted["metadata"]["uid"] = json!(format!("uid-{name}"));
        self.api
            .lock()
            .unwrap()
            .objects
            .insert(format!("{plural}/{name}"), admitted.clone());
        admitted
    }

    fn set_status(&self, key: &str, status: Value) -> Value {
        let mut api = self.api.lock().unwrap();
        let obj = api.objects.get_mut(key).expect("object");
        obj["status"] = status;
        obj.clone()
    }

    /// Time passes: the webhook's short-lived history cache has expired.
    fn later(&mut self) {
        self.webhook.cache = Default::default();
    }

    fn runs(&self) -> Vec<RunRecord> {
        self.history.list(&ListFilter::default()).expect("list")
    }
}

/// What the webhook applied (`gpufit.io/applied-settings`) to an admitted object.
fn applied(obj: &Value) -> Value {
    let text = obj["metadata"]["annotations"][ANN_APPLIED]
        .as_str()
        .expect("the applied-settings annotation");
    serde_json::from_str(text).expect("JSON")
}

async fn reconcile(obj: &Value, c: &Arc<WorkloadContext>) {
    let dynobj: DynamicObject = serde_json::from_value(obj.clone()).expect("object");
    tokio::time::timeout(
        Duration::from_secs(20),
        reconcile_workload(Arc::new(dynobj), c.clone()),
    )
    .await
    .expect("in time")
    .expect("reconciled");
}

/// (group, version, kind, plural).
type Kind = (&'static str, &'static str, &'static str, &'static str);

const JOB: Kind = ("batch", "v1", "Job", "jobs");
const PYTORCHJOB: Kind = ("kubeflow.org", "v1", "PyTorchJob", "pytorchjobs");

fn annotations() -> Value {
    json!({
        "gpufit.io/model": "meta-llama/Llama-3.1-8B", "gpufit.io/method": "lora",
        "gpufit.io/lora-rank": "16", "gpufit.io/seq-len": "2048", "gpufit.io/global-batch": "64"
    })
}

fn container(name: &str) -> Value {
    json!({"name": name, "image": "ghcr.io/acme/train:1",
           "args": ["--micro-batch", "{micro_batch_size}"],
           "resources": {"limits": {"nvidia.com/gpu": "1"}}})
}

fn pytorchjob(name: &str) -> Value {
    let template =
        json!({"spec": {"restartPolicy": "Never", "containers": [container("pytorch")]}});
    json!({
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": "ml", "annotations": annotations()},
        "spec": {"pytorchReplicaSpecs": {
            "Master": {"replicas": 1, "restartPolicy": "Never", "template": template.clone()},
            "Worker": {"replicas": 3, "restartPolicy": "Never", "template": template}
        }}
    })
}

/// A pod as training-operator creates it for replica `rtype`/`index`,
/// from the admitted template (its labels included).
fn operator_pod(job: &Value, rtype: &str, index: u32, state: Value) -> Value {
    let name = job["metadata"]["name"].as_str().unwrap();
    let uid = job["metadata"]["uid"].as_str().unwrap();
    let tmpl = &job["spec"]["pytorchReplicaSpecs"][if rtype == "master" {
        "Master"
    } else {
        "Worker"
    }]["template"];
    let mut labels = tmpl["metadata"]["labels"].clone();
    labels["training.kubeflow.org/job-name"] = json!(name);
    labels["training.kubeflow.org/operator-name"] = json!("pytorchjob-controller");
    labels["training.kubeflow.org/replica-type"] = json!(rtype);
    labels["training.kubeflow.org/replica-index"] = json!(index.to_string());
    if rtype == "master" {
        labels["training.kubeflow.org/job-role"] = json!("master");
    }
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("{name}-{rtype}-{index}"), "namespace": "ml", "labels": labels,
            "ownerReferences": [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": name,
                "uid": uid, "controller": true, "blockOwnerDeletion": true}]},
        "spec": {"nodeName": format!("gpu-{index}"), "containers": tmpl["spec"]["containers"].clone()},
        "status": {"phase": "Running", "hostIP": "10.0.0.1", "containerStatuses": [{
            "name": "pytorch", "image": "ghcr.io/acme/train:1", "imageID": "", "ready": true,
            "restartCount": 0, "state": state}]}
    })
}

fn running() -> Value {
    json!({"running": {"startedAt": "2026-01-01T00:00:10Z"}})
}

fn oom() -> Value {
    json!({"terminated": {"exitCode": 1, "reason": "Error",
        "message": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB",
        "startedAt": "2026-01-01T00:00:10Z", "finishedAt": "2026-01-01T00:20:00Z"}})
}

#[tokio::test]
async fn a_pytorchjob_whose_one_worker_ran_out_of_memory_is_one_oom_record_across_duplicates_and_a_restart(
) {
    let w = World::new();
    let job = w.submit(PYTORCHJOB, pytorchjob("ddp"));
    assert_eq!(job["metadata"]["labels"][LABEL_CONFIGURED], "true");
    assert_eq!(
        job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]["labels"]
            [LABEL_CONFIGURED],
        "true"
    );
    let first: Value = applied(&job);
    let c1 = w.controller(PYTORCHJOB);
    *w.peaks.bytes.lock().unwrap() = Some(70 << 30);

    // The pods exist (one already out of memory) before the owner's status says anything.
    let created = w.set_status(
        "pytorchjobs/ddp",
        json!({"conditions": [{"type": "Created", "status": "True", "reason": "PyTorchJobCreated"}]}),
    );
    {
        let mut api = w.api.lock().unwrap();
        api.set_pods(vec![
            operator_pod(&job, "master", 0, running()),
            operator_pod(&job, "worker", 0, running()),
            operator_pod(&job, "worker", 1, oom()),
            operator_pod(&job, "worker", 2, running()),
        ]);
    }
    reconcile(&created, &c1).await;
    assert_eq!(w.runs().len(), 0, "not ended: nothing recorded");

    // A controller restart mid-run: a new instance over the same history.
    let c2 = w.controller(PYTORCHJOB);
    let failed = w.set_status(
        "pytorchjobs/ddp",
        json!({
            "conditions": [
                {"type": "Created", "status": "True", "reason": "PyTorchJobCreated"},
                {"type": "Running", "status": "False", "reason": "PyTorchJobRunning"},
                {"type": "Failed", "status": "True", "reason": "PyTorchJobFailed",
                 "message": "PyTorchJob ml/ddp is failed because 1 Worker replica(s) failed.",
                 "lastUpdateTime": "2026-01-01T00:20:05Z", "lastTransitionTime": "2026-01-01T00:20:05Z"}
            ],
            "replicaStatuses": {"Master": {"active": 1}, "Worker": {"active": 2, "failed": 1}},
            "startTime": "2026-01-01T00:00:00Z"
        }),
    );
    reconcile(&failed, &c2).await;
    // Duplicate and stale events (the cached copy without our annotation),
    // on this instance and on the old one.
    reconcile(&failed, &c2).await;
    reconcile(&failed, &c1).await;
    let runs = w.runs();
    assert_eq!(
        runs.len(),
        1,
        "one record for the workload, not one per pod: {runs:#?}"
    );
    let r = &runs[0];
    assert_eq!(r.result.failure_reason(), Some(FailureReason::Oom));
    assert_eq!(r.path(), "webhook");
    assert_eq!(r.gpus, 4, "W = 4 ranks × 1 GPU");
    assert_eq!(r.result.peak_memory_bytes, Some(70 << 30));
    assert_eq!(r.predicted_peak_bytes, first["predictedPeakBytes"].as_u64());
    assert_eq!(r.result.duration_sec, Some(1205.0));
    let q = w.peaks.queries.lock().unwrap().clone();
    assert_eq!(q.len(), 1, "the peak is read once");
    assert_eq!(q[0].pods.len(), 4, "the peak is the max over every pod");
    let stored = w.api.lock().unwrap().objects["pytorchjobs/ddp"].clone();
    assert!(stored["metadata"]["annotations"][ANN_RECORDED].is_string());

    // A crash between recording and annotating: the same identity, the same row.
    w.api
        .lock()
        .unwrap()
        .objects
        .get_mut("pytorchjobs/ddp")
        .unwrap()["metadata"]["annotations"]
        .as_object_mut()
        .unwrap()
        .remove(ANN_RECORDED);
    reconcile(&failed, &w.controller(PYTORCHJOB)).await;
    assert_eq!(w.runs().len(), 1, "0 duplicated records after a restart");
    assert!(w.api.lock().unwrap().unexpected.is_empty());

    // The same workload again, within the cache's 10 s: it learned from
    // the OOM (recording the run cleared the webhook's cached history).
    let again = w.submit(PYTORCHJOB, pytorchjob("ddp-2"));
    let second: Value = applied(&again);
    assert_eq!(second["source"], "learned_from_failures", "{second}");
    assert!(
        second["settings"]["microBatchSize"].as_u64()
            < first["settings"]["microBatchSize"].as_u64(),
        "the OOM moved the micro batch down: {first} → {second}"
    );
}

fn batch_job(name: &str) -> Value {
    json!({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": "ml", "annotations": annotations()},
        "spec": {"backoffLimit": 0, "template": {"spec": {"restartPolicy": "Never",
            "containers": [container("train")]}}}
    })
}

#[tokio::test]
async fn a_finished_job_is_recorded_once_and_the_next_submission_uses_its_measured_peak() {
    let mut w = World::new();
    let job = w.submit(JOB, batch_job("finetune"));
    let first: Value = applied(&job);
    assert_eq!(first["source"], "heuristic");
    let predicted = first["predictedPeakBytes"].as_u64().unwrap();
    // It used far less than predicted.
    *w.peaks.bytes.lock().unwrap() = Some(predicted / 2);
    let c = w.controller(JOB);
    w.api.lock().unwrap().set_pods(vec![job_pod(
        &job,
        "finetune-x7k2p",
        "Succeeded",
        json!({"terminated": {"exitCode": 0, "reason": "Completed",
            "message": "{'train_runtime': 100.0, 'train_samples_per_second': 6.25, 'train_steps_per_second': 0.8, 'train_loss': 1.2, 'epoch': 1.0}"}}),
    )]);
    let done = w.set_status(
        "jobs/finetune",
        json!({"startTime": "2026-01-01T00:00:00Z", "completionTime": "2026-01-01T00:10:00Z",
               "succeeded": 1, "conditions": [
                   {"type": "SuccessCriteriaMet", "status": "True"},
                   {"type": "Complete", "status": "True", "lastTransitionTime": "2026-01-01T00:10:00Z"}]}),
    );
    reconcile(&done, &c).await;
    reconcile(&done, &c).await;
    let runs = w.runs();
    assert_eq!(runs.len(), 1);
    assert!(runs[0].result.success());
    assert_eq!(runs[0].result.tokens_per_sec, Some(6.25 * 2048.0));
    assert_eq!(runs[0].result.duration_sec, Some(600.0));
    assert_eq!(runs[0].path(), "webhook");

    w.later();
    let again = w.submit(JOB, batch_job("finetune-2"));
    let second: Value = applied(&again);
    assert_eq!(second["source"], "historical_data_with_memory", "{second}");
    assert_ne!(
        second["settings"]["microBatchSize"], first["settings"]["microBatchSize"],
        "the measurement moved the micro batch: {first} → {second}"
    );
}

/// A Job's pods as the Job controller creates them (from the admitted template).
fn job_pod(job: &Value, name: &str, phase: &str, state: Value) -> Value {
    let uid = job["metadata"]["uid"].as_str().unwrap();
    let owner = job["metadata"]["name"].as_str().unwrap();
    let mut labels = job["spec"]["template"]["metadata"]["labels"].clone();
    labels["batch.kubernetes.io/controller-uid"] = json!(uid);
    labels["batch.kubernetes.io/job-name"] = json!(owner);
    labels["controller-uid"] = json!(uid);
    labels["job-name"] = json!(owner);
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml", "labels": labels,
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": owner,
                "uid": uid, "controller": true, "blockOwnerDeletion": true}]},
        "spec": {"nodeName": "gpu-1", "containers": job["spec"]["template"]["spec"]["containers"].clone()},
        "status": {"phase": phase, "containerStatuses": [{"name": "train", "image": "x", "imageID": "",
            "ready": false, "restartCount": 0, "state": state}]}
    })
}

fn job_failed() -> Value {
    json!({"startTime": "2026-01-01T00:00:00Z", "failed": 1, "conditions": [
        {"type": "FailureTarget", "status": "True", "reason": "BackoffLimitExceeded"},
        {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
         "message": "Job has reached the specified backoff limit",
         "lastTransitionTime": "2026-01-01T00:05:00Z"}]})
}

#[tokio::test]
async fn a_peak_missing_when_the_job_ends_is_filled_in_later_and_a_host_oomkill_is_other_error() {
    let mut w = World::new();
    let job = w.submit(JOB, batch_job("late"));
    let first = applied(&job);
    w.api.lock().unwrap().set_pods(vec![job_pod(
        &job,
        "late-abcde",
        "Failed",
        json!({"terminated": {"exitCode": 137, "reason": "OOMKilled"}}),
    )]);
    let c = w.controller(JOB);
    let failed = w.set_status("jobs/late", job_failed());
    reconcile(&failed, &c).await;
    let runs = w.runs();
    assert_eq!(runs.len(), 1);
    assert_eq!(
        runs[0].result.failure_reason(),
        Some(FailureReason::OtherError)
    );
    assert!(runs[0].result.host_oom(), "OOMKilled: host memory");
    assert_eq!(
        runs[0].result.peak_memory_bytes, None,
        "not in Prometheus yet"
    );

    // The peak reaches Prometheus; the next due lookup fills it in.
    *w.peaks.bytes.lock().unwrap() = Some(33 << 30);
    tokio::time::sleep(Duration::from_millis(250)).await;
    let annotated = w.api.lock().unwrap().objects["jobs/late"].clone();
    assert!(annotated["metadata"]["annotations"]["gpufit.io/peak-pending"].is_string());
    reconcile(&annotated, &c).await;
    let runs = w.runs();
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0].result.peak_memory_bytes, Some(33 << 30));
    let q = w.peaks.queries.lock().unwrap().clone();
    assert_eq!(q.len(), 2, "looked up at the end, then once when due");
    assert_eq!(
        q[1].pods.len(),
        1,
        "the late lookup names the pod still there"
    );
    let done = w.api.lock().unwrap().objects["jobs/late"].clone();
    assert!(done["metadata"]["annotations"]["gpufit.io/peak-pending"].is_null());
    assert!(
        w.runs()[0].result.host_oom(),
        "kept when the peak is filled in"
    );

    // The next submission of the workload: the same micro batch, half the
    // data-loader workers, no pinned memory.
    w.later();
    let again = applied(&w.submit(JOB, batch_job("late-2")));
    let workers = first["settings"]["numWorkers"].as_u64().expect("workers");
    assert!(workers >= 2, "{first}");
    assert_eq!(
        again["settings"]["numWorkers"].as_u64(),
        Some(workers / 2),
        "{again}"
    );
    assert_eq!(again["settings"]["pinMemory"], false, "{again}");
    assert_eq!(
        again["settings"]["microBatchSize"],
        first["settings"]["microBatchSize"]
    );
}

#[tokio::test]
async fn a_workload_deleted_before_it_ended_is_not_recorded() {
    let w = World::new();
    w.submit(JOB, batch_job("gone"));
    let c = w.controller(JOB);
    // The watch saw it end, but it is gone from the API server by the time
    // the leader looks (deleted; its status no longer trusted).
    let seen = w.set_status("jobs/gone", job_failed());
    w.api.lock().unwrap().objects.remove("jobs/gone");
    reconcile(&seen, &c).await;
    assert!(w.runs().is_empty());
}

const JOBSET: Kind = ("jobset.x-k8s.io", "v1alpha2", "JobSet", "jobsets");

fn jobset(name: &str) -> Value {
    let template =
        json!({"spec": {"restartPolicy": "Never", "containers": [container("trainer")]}});
    json!({
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": name, "namespace": "ml", "annotations": annotations()},
        "spec": {"replicatedJobs": [{"name": "workers", "replicas": 1, "template": {"spec": {
            "parallelism": 2, "completions": 2, "backoffLimit": 0, "template": template}}}]}
    })
}

/// A pod as the JobSet's child Job creates it: owned by the Job (not the
/// JobSet), labelled with the JobSet's name and uid.
fn jobset_pod(js: &Value, index: u32, state: Value) -> Value {
    let name = js["metadata"]["name"].as_str().unwrap();
    let uid = js["metadata"]["uid"].as_str().unwrap();
    let tmpl = &js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"];
    let mut labels = tmpl["metadata"]["labels"].clone();
    if !labels.is_object() {
        labels = json!({});
    }
    labels["jobset.sigs.k8s.io/jobset-name"] = json!(name);
    labels["jobset.sigs.k8s.io/jobset-uid"] = json!(uid);
    labels["batch.kubernetes.io/job-completion-index"] = json!(index.to_string());
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("{name}-workers-0-{index}"), "namespace": "ml", "labels": labels,
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": format!("{name}-workers-0"),
                "uid": "child-job-uid", "controller": true, "blockOwnerDeletion": true}]},
        "spec": {"nodeName": format!("gpu-{index}"), "containers": tmpl["spec"]["containers"].clone()},
        "status": {"phase": phase(&state), "hostIP": "10.0.0.1", "startTime": "2026-01-01T00:00:05Z",
            "containerStatuses": [{
            "name": "trainer", "image": "ghcr.io/acme/train:1", "imageID": "", "ready": false,
            "restartCount": 0, "state": state}]}
    })
}

#[tokio::test]
async fn a_jobset_whose_one_pod_ran_out_of_memory_is_one_oom_record_with_the_peak_over_its_pods() {
    let w = World::new();
    let js = w.submit(JOBSET, jobset("multi"));
    let first: Value = applied(&js);
    *w.peaks.bytes.lock().unwrap() = Some(75 << 30);
    let done = json!({"terminated": {"exitCode": 143, "reason": "Error",
        "startedAt": "2026-01-01T00:00:10Z", "finishedAt": "2026-01-01T00:10:00Z"}});
    w.api
        .lock()
        .unwrap()
        .set_pods(vec![jobset_pod(&js, 0, done), jobset_pod(&js, 1, oom())]);
    let failed = w.set_status(
        "jobsets/multi",
        json!({"conditions": [{"type": "Failed", "status": "True", "reason": "FailedJobs",
            "lastTransitionTime": "2026-01-01T00:10:05Z"}], "terminalState": "Failed"}),
    );
    let c1 = w.controller(JOBSET);
    reconcile(&failed, &c1).await;
    // A duplicate event, and a restarted controller seeing the stale copy.
    reconcile(&failed, &c1).await;
    reconcile(&failed, &w.controller(JOBSET)).await;
    let runs = w.runs();
    assert_eq!(runs.len(), 1, "one record for the JobSet: {runs:#?}");
    let r = &runs[0];
    assert_eq!(r.result.failure_reason(), Some(FailureReason::Oom));
    assert_eq!(r.result.peak_memory_bytes, Some(75 << 30));
    assert_eq!(r.predicted_peak_bytes, first["predictedPeakBytes"].as_u64());
    assert!(r
        .job_id
        .as_deref()
        .unwrap_or_default()
        .starts_with("JobSet:ml/multi/"));
    let q = w.peaks.queries.lock().unwrap().clone();
    assert_eq!(q.len(), 1, "the peak is read once");
    assert_eq!(q[0].pods.len(), 2, "the peak is the max over both pods");
    let stored = w.api.lock().unwrap().objects["jobsets/multi"].clone();
    assert!(stored["metadata"]["annotations"][ANN_RECORDED].is_string());
    assert!(w.api.lock().unwrap().unexpected.is_empty());
}

/// A pod's phase from its one container's state.
fn phase(state: &Value) -> &'static str {
    match state["terminated"]["exitCode"].as_i64() {
        None => "Running",
        Some(0) => "Succeeded",
        Some(_) => "Failed",
    }
}

/// A training process that finished and printed its throughput (the
/// Hugging Face Trainer's summary line) into the termination message.
fn finished() -> Value {
    json!({"terminated": {"exitCode": 0, "reason": "Completed",
        "startedAt": "2026-01-01T00:00:10Z", "finishedAt": "2026-01-01T00:10:00Z",
        "message": "{'train_runtime': 100.0, 'train_samples_per_second': 6.25, 'train_steps_per_second': 0.8, 'train_loss': 1.2, 'epoch': 1.0}"}})
}

const TRAINJOB: Kind = ("trainer.kubeflow.org", "v1alpha1", "TrainJob", "trainjobs");

/// A Kubeflow Trainer v2 TrainJob as a user writes it (2 nodes × 1 GPU on
/// the `torch-distributed` runtime), with what the CRD defaulting adds.
fn trainjob(name: &str) -> Value {
    json!({
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
        "metadata": {"name": name, "namespace": "ml", "annotations": annotations()},
        "spec": {
            "runtimeRef": {"name": "torch-distributed", "apiGroup": "trainer.kubeflow.org",
                           "kind": "ClusterTrainingRuntime"},
            "trainer": {"image": "ghcr.io/acme/train:1",
                        "command": ["torchrun", "train.py", "--micro-batch={micro_batch_size}"],
                        "numNodes": 2, "resourcesPerNode": {"limits": {"nvidia.com/gpu": "1"}}},
            "suspend": false,
            "managedBy": "trainer.kubeflow.org/trainjob-controller"
        }
    })
}

/// The uid of the JobSet Kubeflow Trainer creates for a TrainJob (named
/// after it, owned by it): its pods carry this uid, not the TrainJob's.
fn runtime_jobset_uid(tj: &Value) -> String {
    format!("jobset-of-{}", tj["metadata"]["uid"].as_str().unwrap())
}

/// A pod of a TrainJob as its runtime JobSet's child Job (`<name>-node-0`,
/// the torch runtime's `node` replicated job) creates it: trainer
/// container `node` with the TrainJob's trainer env and command merged in.
fn trainjob_pod(tj: &Value, index: u32, suffix: &str, state: Value) -> Value {
    let name = tj["metadata"]["name"].as_str().unwrap();
    let trainer = &tj["spec"]["trainer"];
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("{name}-node-0-{index}-{suffix}"), "namespace": "ml", "labels": {
                "jobset.sigs.k8s.io/jobset-name": name,
                "jobset.sigs.k8s.io/jobset-uid": runtime_jobset_uid(tj),
                "jobset.sigs.k8s.io/replicatedjob-name": "node",
                "jobset.sigs.k8s.io/job-index": "0",
                "batch.kubernetes.io/job-name": format!("{name}-node-0"),
                "batch.kubernetes.io/job-completion-index": index.to_string(),
                "trainer.kubeflow.org/trainjob-ancestor-step": "trainer"},
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": format!("{name}-node-0"),
                "uid": "child-job-uid", "controller": true, "blockOwnerDeletion": true}]},
        "spec": {"nodeName": format!("gpu-{index}"), "containers": [{"name": "node",
            "image": trainer["image"].clone(), "command": trainer["command"].clone(),
            "env": trainer["env"].clone(), "resources": trainer["resourcesPerNode"].clone()}]},
        "status": {"phase": phase(&state), "hostIP": "10.0.0.1", "startTime": "2026-01-01T00:00:05Z",
            "containerStatuses": [{"name": "node", "image": "ghcr.io/acme/train:1", "imageID": "",
                "ready": state.get("running").is_some(), "restartCount": 0, "state": state}]}
    })
}

/// The runtime JobSet of a TrainJob, in the worst case for gpufit: the
/// TrainJob's gpufit label and annotations propagated onto it.
fn runtime_jobset(tj: &Value) -> Value {
    let name = tj["metadata"]["name"].as_str().unwrap();
    json!({
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": name, "namespace": "ml", "uid": runtime_jobset_uid(tj),
            "labels": {LABEL_CONFIGURED: "true"},
            "annotations": tj["metadata"]["annotations"].clone(),
            "ownerReferences": [{"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
                "name": name, "uid": tj["metadata"]["uid"].clone(), "controller": true,
                "blockOwnerDeletion": true}]},
        "spec": {"replicatedJobs": [{"name": "node", "replicas": 1}]},
        "status": {"conditions": [{"type": "Completed", "status": "True", "reason": "AllJobsCompleted",
            "message": "jobset completed successfully", "lastTransitionTime": "2026-01-01T00:10:05Z"}],
            "terminalState": "Completed"}
    })
}

/// A TrainJob's status while its JobSet runs: Kubeflow Trainer copies the
/// child Jobs' counts (`jobsStatus`) and no condition yet.
fn trainjob_running(active: i32, succeeded: i32) -> Value {
    json!({"jobsStatus": [{"name": "node", "ready": active, "succeeded": succeeded, "failed": 0,
        "active": active, "suspended": 0}]})
}

/// A TrainJob's status once its JobSet completed: the JobSet's `Completed`
/// condition copied as `Complete` (Kubeflow Trainer's jobset plugin).
fn trainjob_complete() -> Value {
    json!({"conditions": [{"type": "Complete", "status": "True", "reason": "AllJobsCompleted",
        "message": "jobset completed successfully", "lastTransitionTime": "2026-01-01T00:10:05Z"}],
        "jobsStatus": [{"name": "node", "ready": 0, "succeeded": 1, "failed": 0, "active": 0,
            "suspended": 0}]})
}

/// The JobSet's `Completed` condition.
fn jobset_completed() -> Value {
    json!({"conditions": [{"type": "Completed", "status": "True", "reason": "AllJobsCompleted",
        "message": "jobset completed successfully", "lastTransitionTime": "2026-01-01T00:10:05Z"}],
        "terminalState": "Completed",
        "replicatedJobsStatus": [{"name": "workers", "ready": 0, "succeeded": 1, "failed": 0,
            "active": 0, "suspended": 0}]})
}

/// Time passes: the webhook's cache expires, and the same workload is
/// submitted again under a new name. Returns what it applied.
fn resubmit_learned(w: &mut World, kind: Kind, obj: Value, first: &Value) {
    w.later();
    let again = w.submit(kind, obj);
    let second: Value = applied(&again);
    assert_eq!(second["source"], "historical_data_with_memory", "{second}");
    assert_ne!(
        second["settings"]["microBatchSize"], first["settings"]["microBatchSize"],
        "the measurement moved the micro batch: {first} → {second}"
    );
}

#[tokio::test]
async fn a_trainjob_is_recorded_once_when_it_completes_and_its_resubmission_learns() {
    let mut w = World::new();
    let tj = w.submit(TRAINJOB, trainjob("llama-ft"));
    assert_eq!(tj["metadata"]["labels"][LABEL_CONFIGURED], "true");
    let first: Value = applied(&tj);
    assert_eq!(first["source"], "heuristic");
    let predicted = first["predictedPeakBytes"].as_u64().expect("a prediction");
    // The settings reach the trainer containers through spec.trainer.env.
    let env = tj["spec"]["trainer"]["env"]
        .as_array()
        .expect("trainer env");
    assert!(
        env.iter().any(|e| e["name"] == "GPUFIT_MICRO_BATCH_SIZE"),
        "{env:?}"
    );
    *w.peaks.bytes.lock().unwrap() = Some(predicted / 2);
    let c = w.controller(TRAINJOB);

    // Both nodes run; then node 1 finishes first while node 0 still trains.
    w.api.lock().unwrap().set_pods(vec![
        trainjob_pod(&tj, 0, "x7k2p", running()),
        trainjob_pod(&tj, 1, "q9m4z", running()),
    ]);
    let running_copy = w.set_status("trainjobs/llama-ft", trainjob_running(1, 0));
    reconcile(&running_copy, &c).await;
    w.api
        .lock()
        .unwrap()
        .add_pods(vec![trainjob_pod(&tj, 1, "q9m4z", finished())]);
    reconcile(&running_copy, &c).await;
    assert!(
        w.runs().is_empty(),
        "one pod ending does not end the TrainJob"
    );

    // All done: the TrainJob's Complete condition (copied from its JobSet).
    w.api
        .lock()
        .unwrap()
        .add_pods(vec![trainjob_pod(&tj, 0, "x7k2p", finished())]);
    let done = w.set_status("trainjobs/llama-ft", trainjob_complete());
    reconcile(&done, &c).await;
    // A duplicate, the stale running copy, and a restarted controller.
    reconcile(&done, &c).await;
    reconcile(&running_copy, &c).await;
    reconcile(&done, &w.controller(TRAINJOB)).await;
    // The runtime JobSet (even carrying the TrainJob's gpufit annotations)
    // is never a second record.
    let js = runtime_jobset(&tj);
    w.api
        .lock()
        .unwrap()
        .objects
        .insert("jobsets/llama-ft".into(), js.clone());
    reconcile(&js, &w.controller(JOBSET)).await;

    let runs = w.runs();
    assert_eq!(runs.len(), 1, "one record for the TrainJob: {runs:#?}");
    let r = &runs[0];
    assert!(r.result.success());
    assert_eq!(
        r.job_id.as_deref(),
        Some("TrainJob:ml/llama-ft/uid-llama-ft")
    );
    assert_eq!(r.path(), "webhook");
    assert_eq!(r.gpus, 2, "W = 2 nodes × 1 GPU");
    assert_eq!(
        r.predicted_peak_bytes,
        Some(predicted),
        "the admission's prediction"
    );
    assert_eq!(r.result.peak_memory_bytes, Some(predicted / 2));
    assert_eq!(
        r.result.tokens_per_sec,
        Some(6.25 * 2048.0),
        "rank 0's, not a sum"
    );
    // No startTime on a TrainJob: from its earliest pod (00:00:05) to Complete (00:10:05).
    assert_eq!(r.result.duration_sec, Some(600.0));
    let q = w.peaks.queries.lock().unwrap().clone();
    assert_eq!(q.len(), 1, "the peak is read once");
    let mut asked: Vec<_> = q[0].pods.iter().map(|p| p.name.clone()).collect();
    asked.sort();
    assert_eq!(
        asked,
        ["llama-ft-node-0-0-x7k2p", "llama-ft-node-0-1-q9m4z"]
    );
    {
        let api = w.api.lock().unwrap();
        assert!(
            api.objects["trainjobs/llama-ft"]["metadata"]["annotations"][ANN_RECORDED].is_string()
        );
        assert!(api.objects["jobsets/llama-ft"]["metadata"]["annotations"][ANN_RECORDED].is_null());
        assert!(api.unexpected.is_empty(), "{:?}", api.unexpected);
    }

    resubmit_learned(&mut w, TRAINJOB, trainjob("llama-ft-2"), &first);
}

#[tokio::test]
async fn a_completed_jobset_is_recorded_once_and_its_resubmission_uses_the_measured_peak() {
    let mut w = World::new();
    let js = w.submit(JOBSET, jobset("multi"));
    let first: Value = applied(&js);
    assert_eq!(first["source"], "heuristic");
    let predicted = first["predictedPeakBytes"].as_u64().expect("a prediction");
    *w.peaks.bytes.lock().unwrap() = Some(predicted / 2);
    w.api.lock().unwrap().set_pods(vec![
        jobset_pod(&js, 0, finished()),
        jobset_pod(&js, 1, finished()),
    ]);
    let done = w.set_status("jobsets/multi", jobset_completed());
    let c = w.controller(JOBSET);
    reconcile(&done, &c).await;
    reconcile(&done, &c).await;
    let runs = w.runs();
    assert_eq!(runs.len(), 1);
    assert!(runs[0].result.success());
    assert_eq!(runs[0].gpus, 2, "W = 1 replica × 2 pods × 1 GPU");
    assert_eq!(runs[0].predicted_peak_bytes, Some(predicted));
    assert_eq!(runs[0].result.peak_memory_bytes, Some(predicted / 2));

    resubmit_learned(&mut w, JOBSET, jobset("multi-2"), &first);
}

/// One workload of each kind, for the restart and replica scenario: what is
/// submitted, its pods (running or ended), its status running and ended,
/// and W.
struct Case {
    kind: Kind,
    object: Value,
    pods: fn(&Value, bool) -> Vec<Value>,
    running: Value,
    ended: Value,
    gpus: u32,
}

fn state(ended: bool) -> Value {
    if ended {
        finished()
    } else {
        running()
    }
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            kind: JOB,
            object: batch_job("restart-job"),
            pods: |o, e| vec![job_pod(o, "restart-job-x7k2p", phase(&state(e)), state(e))],
            running: json!({"startTime": "2026-01-01T00:00:00Z", "active": 1, "ready": 1}),
            ended: json!({"startTime": "2026-01-01T00:00:00Z", "completionTime": "2026-01-01T00:10:00Z",
                "succeeded": 1, "conditions": [
                    {"type": "SuccessCriteriaMet", "status": "True"},
                    {"type": "Complete", "status": "True", "lastTransitionTime": "2026-01-01T00:10:00Z"}]}),
            gpus: 1,
        },
        Case {
            kind: PYTORCHJOB,
            object: pytorchjob("restart-ddp"),
            pods: |o, e| {
                let mut p = vec![operator_pod(o, "master", 0, state(e))];
                p.extend((0..3).map(|i| operator_pod(o, "worker", i, state(e))));
                p
            },
            running: json!({"startTime": "2026-01-01T00:00:00Z", "conditions": [
                {"type": "Created", "status": "True", "reason": "PyTorchJobCreated"},
                {"type": "Running", "status": "True", "reason": "PyTorchJobRunning"}],
                "replicaStatuses": {"Master": {"active": 1}, "Worker": {"active": 3}}}),
            ended: json!({"startTime": "2026-01-01T00:00:00Z", "completionTime": "2026-01-01T00:10:00Z",
                "conditions": [
                    {"type": "Created", "status": "True", "reason": "PyTorchJobCreated"},
                    {"type": "Running", "status": "False", "reason": "PyTorchJobRunning"},
                    {"type": "Succeeded", "status": "True", "reason": "PyTorchJobSucceeded",
                     "lastTransitionTime": "2026-01-01T00:10:00Z"}],
                "replicaStatuses": {"Master": {"succeeded": 1}, "Worker": {"succeeded": 3}}}),
            gpus: 4,
        },
        Case {
            kind: JOBSET,
            object: jobset("restart-js"),
            pods: |o, e| (0..2).map(|i| jobset_pod(o, i, state(e))).collect(),
            running: json!({"replicatedJobsStatus": [{"name": "workers", "ready": 1, "succeeded": 0,
                "failed": 0, "active": 1, "suspended": 0}]}),
            ended: jobset_completed(),
            gpus: 2,
        },
        Case {
            kind: TRAINJOB,
            object: trainjob("restart-tj"),
            pods: |o, e| {
                vec![
                    trainjob_pod(o, 0, "aaaaa", state(e)),
                    trainjob_pod(o, 1, "bbbbb", state(e)),
                ]
            },
            running: trainjob_running(1, 0),
            ended: trainjob_complete(),
            gpus: 2,
        },
    ]
}

/// Runs recorded under `webhook` by this replica (its own metrics).
fn recorded_by(r: &Replica) -> u64 {
    ["success", "oom", "other_error"]
        .iter()
        .map(|o| {
            r.c.ctx
                .metrics
                .runs
                .with_label_values(&["webhook", "NVIDIA A100-SXM4-80GB", o])
                .get()
        })
        .sum()
}

#[tokio::test]
async fn each_kind_survives_a_restart_mid_run_and_a_second_replica_with_no_duplicated_or_lost_record(
) {
    for case in cases() {
        let (_, _, kind, plural) = case.kind;
        let w = World::new();
        *w.peaks.bytes.lock().unwrap() = Some(40 << 30);
        let obj = w.submit(case.kind, case.object.clone());
        let name = obj["metadata"]["name"].as_str().unwrap().to_string();
        let key = format!("{plural}/{name}");
        let predicted = applied(&obj)["predictedPeakBytes"].as_u64();

        // Two replicas: a takes the Lease, b stands by.
        let mut a = w.replica(case.kind, "replica-a");
        a.wait_leading(true).await;
        let b = w.replica(case.kind, "replica-b");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !*b.leading.borrow(),
            "{kind}: b must not lead while a renews"
        );

        // Pods exist and run; both replicas see the running workload.
        w.api.lock().unwrap().set_pods((case.pods)(&obj, false));
        let running_copy = w.set_status(&key, case.running.clone());
        reconcile(&running_copy, &a.c).await;
        reconcile(&running_copy, &b.c).await;
        assert!(
            w.runs().is_empty(),
            "{kind}: nothing recorded while it runs"
        );

        // Restart mid-run: a is replaced (rolling update), b takes over,
        // and a's successor a2 comes up with fresh process state.
        a.stop().await;
        let mut b = b;
        b.wait_leading(true).await;
        let a2 = w.replica(case.kind, "replica-a2");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!*a2.leading.borrow(), "{kind}: a2 stands by");

        // The workload ends while a was gone: both replicas' watches see
        // it, twice, then the stale running copy again.
        w.api.lock().unwrap().set_pods((case.pods)(&obj, true));
        let ended_copy = w.set_status(&key, case.ended.clone());
        for c in [&a2.c, &b.c, &a2.c, &b.c] {
            reconcile(&ended_copy, c).await;
        }
        reconcile(&running_copy, &b.c).await;
        reconcile(&running_copy, &a2.c).await;

        let runs = w.runs();
        assert_eq!(runs.len(), 1, "{kind}: 0 lost, 0 duplicated: {runs:#?}");
        let r = &runs[0];
        assert!(r.result.success(), "{kind}");
        assert_eq!(
            r.job_id.as_deref(),
            Some(format!("{kind}:ml/{name}/uid-{name}").as_str())
        );
        assert_eq!(r.gpus, case.gpus, "{kind}: W");
        assert_eq!(r.predicted_peak_bytes, predicted, "{kind}");
        assert_eq!(r.result.peak_memory_bytes, Some(40 << 30), "{kind}");
        assert_eq!(recorded_by(&b), 1, "{kind}: the leader recorded it");
        assert_eq!(recorded_by(&a2), 0, "{kind}: the standby recorded nothing");
        let q = w.peaks.queries.lock().unwrap().clone();
        assert_eq!(q.len(), 1, "{kind}: one peak lookup");
        assert_eq!(
            q[0].pods.len(),
            (case.pods)(&obj, true).len(),
            "{kind}: every pod"
        );

        // The leader dies between recording and annotating: a2 takes over
        // and records the same identity again — the same row.
        w.api.lock().unwrap().objects.get_mut(&key).unwrap()["metadata"]["annotations"]
            .as_object_mut()
            .unwrap()
            .remove(ANN_RECORDED);
        b.stop().await;
        let mut a2 = a2;
        a2.wait_leading(true).await;
        reconcile(&ended_copy, &a2.c).await;
        assert_eq!(w.runs().len(), 1, "{kind}: 0 duplicated after the takeover");
        assert_eq!(w.runs()[0].id, r.id, "{kind}: the same row");
        assert!(
            w.api.lock().unwrap().objects[&key]["metadata"]["annotations"][ANN_RECORDED]
                .is_string()
        );
        a2.stop().await;
        let api = w.api.lock().unwrap();
        assert!(api.unexpected.is_empty(), "{kind}: {:?}", api.unexpected);
    }
}

#[tokio::test]
async fn a_replica_that_does_not_lead_records_nothing_even_when_the_workload_ended() {
    let w = World::new();
    *w.peaks.bytes.lock().unwrap() = Some(20 << 30);
    let job = w.submit(JOB, batch_job("standby"));
    w.api.lock().unwrap().set_pods(vec![job_pod(
        &job,
        "standby-abcde",
        "Succeeded",
        finished(),
    )]);
    let done = w.set_status(
        "jobs/standby",
        json!({"startTime": "2026-01-01T00:00:00Z", "completionTime": "2026-01-01T00:10:00Z",
               "conditions": [{"type": "Complete", "status": "True"}]}),
    );
    let (tx, rx) = watch::channel(false);
    let standby = w.controller_leading(JOB, rx);
    reconcile(&done, &standby).await;
    assert!(w.runs().is_empty(), "a standby writes nothing");
    assert!(
        w.api.lock().unwrap().objects["jobs/standby"]["metadata"]["annotations"][ANN_RECORDED]
            .is_null()
    );
    assert!(
        w.peaks.queries.lock().unwrap().is_empty(),
        "nor asks for peaks"
    );
    // It becomes the leader: the same event now records once.
    tx.send(true).expect("receiver alive");
    reconcile(&done, &standby).await;
    reconcile(&done, &standby).await;
    assert_eq!(w.runs().len(), 1);
}

/// Issue 38's "real Prometheus for the peaks" on the webhook path: the two
/// nodes of a TrainJob peak at different heights on a simulated sidecar a
/// real Prometheus scrapes; the record's peak is the higher one, read with
/// the controller's own PromQL over the TrainJob's pods — not another
/// job's pod on the same server, which peaked higher still.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainjobs_recorded_peak_is_the_max_over_its_pods_from_a_real_prometheus() {
    use prom::{end_process, simulate, GIB};
    let dir = tempfile::tempdir().expect("temp dir");
    let (_sidecar, sc) = prom::start_sidecar();
    let (_prom, pa) = prom::start_prometheus(sc, dir.path());
    let prom_url = format!("http://{pa}");

    let mut w = World::new();
    w.reader = Arc::new(PromThenSidecar {
        prom: Some(PromClient::new(&prom_url, Duration::from_secs(5))),
        query_template: DEFAULT_PEAK_QUERY.to_string(),
        sidecar: None,
    });
    let tj = w.submit(TRAINJOB, trainjob("prom-ft"));
    let started = chrono::Utc::now();
    let pods = ["prom-ft-node-0-0-x7k2p", "prom-ft-node-0-1-q9m4z"];
    // Node 0 peaks at 30 GiB, node 1 at 55 GiB; another job's pod at 70.
    tokio::task::spawn_blocking(move || {
        for (pid, pod, gib) in [
            (101, pods[0], 10),
            (101, pods[0], 30),
            (102, pods[1], 20),
            (102, pods[1], 55),
            (103, "other-node-0-0-zzzzz", 70),
        ] {
            simulate(sc, pid, "ml", pod, gib * GIB);
        }
        // Scraped at the top (1 s interval), then memory falls and they exit.
        std::thread::sleep(Duration::from_millis(2500));
        simulate(sc, 101, "ml", pods[0], 5 * GIB);
        simulate(sc, 102, "ml", pods[1], 8 * GIB);
        end_process(sc, 101);
        end_process(sc, 102);
        // Prometheus has both pods' peaks before the TrainJob's end is seen.
        let client = PromClient::new(&prom_url, Duration::from_secs(5));
        let names: Vec<String> = pods.iter().map(|p| p.to_string()).collect();
        let q = render_query(
            DEFAULT_PEAK_QUERY,
            "ml",
            "prom-ft",
            &names,
            Duration::from_secs(300),
        );
        prom::wait_for("both pods' peaks scraped", Duration::from_secs(30), || {
            client.query_max(&q, None).ok().flatten() == Some((55 * GIB) as f64)
        });
    })
    .await
    .expect("the simulation");

    let timed = |mut p: Value| {
        p["status"]["startTime"] = json!(started.to_rfc3339());
        p
    };
    w.api.lock().unwrap().set_pods(vec![
        timed(trainjob_pod(&tj, 0, "x7k2p", finished())),
        timed(trainjob_pod(&tj, 1, "q9m4z", finished())),
    ]);
    let mut complete = trainjob_complete();
    complete["conditions"][0]["lastTransitionTime"] = json!(chrono::Utc::now().to_rfc3339());
    let done = w.set_status("trainjobs/prom-ft", complete);
    let c = w.controller(TRAINJOB);
    reconcile(&done, &c).await;
    reconcile(&done, &c).await;
    let runs = w.runs();
    assert_eq!(runs.len(), 1);
    assert_eq!(
        runs[0].result.peak_memory_bytes,
        Some(55 * GIB),
        "the max over the TrainJob's two pods, not node 0's 30 GiB nor the other job's 70"
    );
    assert_eq!(
        runs[0].predicted_peak_bytes,
        applied(&tj)["predictedPeakBytes"].as_u64()
    );
    let stored = w.api.lock().unwrap().objects["trainjobs/prom-ft"].clone();
    assert!(
        stored["metadata"]["annotations"]["gpufit.io/peak-pending"].is_null(),
        "the peak was there at once: nothing pending"
    );
}

#[tokio::test]
async fn a_failed_trainjob_whose_one_node_ran_out_of_memory_is_one_oom_record_and_the_next_learns()
{
    let mut w = World::new();
    let tj = w.submit(TRAINJOB, trainjob("tj-oom"));
    let first: Value = applied(&tj);
    *w.peaks.bytes.lock().unwrap() = Some(78 << 30);
    // Node 1 runs out of GPU memory; JobSet's failure policy stops node 0.
    let stopped = json!({"terminated": {"exitCode": 143, "reason": "Error",
        "startedAt": "2026-01-01T00:00:10Z", "finishedAt": "2026-01-01T00:05:00Z"}});
    w.api.lock().unwrap().set_pods(vec![
        trainjob_pod(&tj, 0, "aaaaa", stopped),
        trainjob_pod(&tj, 1, "bbbbb", oom()),
    ]);
    // Kubeflow Trainer copies the JobSet's Failed condition.
    let failed = w.set_status(
        "trainjobs/tj-oom",
        json!({"conditions": [{"type": "Failed", "status": "True", "reason": "FailedJobs",
            "message": "jobset failed due to one or more job failures",
            "lastTransitionTime": "2026-01-01T00:05:05Z"}],
            "jobsStatus": [{"name": "node", "ready": 0, "succeeded": 0, "failed": 1, "active": 0,
                "suspended": 0}]}),
    );
    let c = w.controller(TRAINJOB);
    reconcile(&failed, &c).await;
    reconcile(&failed, &w.controller(TRAINJOB)).await;
    let runs = w.runs();
    assert_eq!(runs.len(), 1, "one record, not one per node: {runs:#?}");
    assert_eq!(runs[0].result.failure_reason(), Some(FailureReason::Oom));
    assert_eq!(runs[0].result.peak_memory_bytes, Some(78 << 30));
    assert_eq!(runs[0].result.duration_sec, Some(300.0));

    w.later();
    let again = w.submit(TRAINJOB, trainjob("tj-oom-2"));
    let second: Value = applied(&again);
    assert_eq!(second["source"], "learned_from_failures", "{second}");
    assert!(
        second["settings"]["microBatchSize"].as_u64()
            < first["settings"]["microBatchSize"].as_u64()
            || second["settings"]["activationCheckpointing"] == true,
        "the OOM made the next suggestion lighter: {first} → {second}"
    );
}

/// A script that ignores GPUFIT_MICRO_BATCH_SIZE (a hard-coded batch in its
/// args, no placeholder) and says what it ran in its result record (the
/// Python package's callback writes it to /dev/termination-log).
#[tokio::test]
async fn a_job_that_ran_another_micro_batch_than_injected_is_recorded_and_learned_at_what_it_ran() {
    let mut w = World::new();
    let hard_coded = |name: &str| {
        let mut j = batch_job(name);
        j["spec"]["template"]["spec"]["containers"][0]["args"] =
            json!(["--per_device_train_batch_size", "8"]);
        j
    };
    let job = w.submit(JOB, hard_coded("fixed"));
    let first = applied(&job);
    let injected = first["settings"]["microBatchSize"]
        .as_u64()
        .expect("injected batch");
    let ran = if injected == 8 { 6 } else { 8 };
    // The peak of what really ran: 40 GiB.
    *w.peaks.bytes.lock().unwrap() = Some(40 << 30);
    let record = json!({
        "schema_version": 1, "source": "hf", "world_size": 1,
        "injected": {"micro_batch_size": injected},
        "ran": {"micro_batch_size": ran, "gradient_accumulation_steps": 64 / ran},
        "peaks": [], "tokens_per_sec": 5000.0, "steps": 20, "outcome": "completed"
    })
    .to_string();
    let c = w.controller(JOB);
    w.api.lock().unwrap().set_pods(vec![job_pod(
        &job,
        "fixed-x7k2p",
        "Succeeded",
        json!({"terminated": {"exitCode": 0, "reason": "Completed", "message": record}}),
    )]);
    let done = w.set_status(
        "jobs/fixed",
        json!({"startTime": "2026-01-01T00:00:00Z", "completionTime": "2026-01-01T00:10:00Z",
               "succeeded": 1, "conditions": [
                   {"type": "SuccessCriteriaMet", "status": "True"},
                   {"type": "Complete", "status": "True", "lastTransitionTime": "2026-01-01T00:10:00Z"}]}),
    );
    reconcile(&done, &c).await;
    let runs = w.runs();
    assert_eq!(runs.len(), 1);
    let r = &runs[0];
    assert_eq!(
        r.settings.micro_batch_size as u64, ran,
        "stored with what ran"
    );
    assert_eq!(
        r.confirmation,
        gpufit::core::confirm::Confirmation::RanOther
    );
    assert_eq!(
        r.predicted_peak_bytes, None,
        "the prediction was another batch's"
    );
    assert_eq!(
        r.result.tokens_per_sec,
        Some(5000.0),
        "the record's own throughput"
    );

    w.later();
    let again = w.submit(JOB, hard_coded("fixed-2"));
    let second = applied(&again);
    let reason = again["metadata"]["annotations"]["gpufit.io/reason"]
        .as_str()
        .unwrap_or_default();
    assert_eq!(second["source"], "historical_data_with_memory", "{second}");
    assert!(
        reason.contains(&format!("micro batch {ran} measured 40.0 GiB")),
        "learned from the batch that ran: {reason}"
    );
}

/// The same script without a record or any stated setting: nothing confirms
/// it ran the injected batch, so its peak is a floor and moves nothing up.
#[tokio::test]
async fn an_unconfirmed_run_is_stored_as_such_and_not_extrapolated_from() {
    let mut w = World::new();
    let mut j = batch_job("silent");
    j["spec"]["template"]["spec"]["containers"][0]["args"] = json!(["--batch", "8"]);
    let job = w.submit(JOB, j.clone());
    let first = applied(&job);
    let predicted = first["predictedPeakBytes"].as_u64().unwrap();
    *w.peaks.bytes.lock().unwrap() = Some(predicted / 2);
    let c = w.controller(JOB);
    w.api.lock().unwrap().set_pods(vec![job_pod(
        &job,
        "silent-1",
        "Succeeded",
        json!({"terminated": {"exitCode": 0, "reason": "Completed", "message": ""}}),
    )]);
    let done = w.set_status(
        "jobs/silent",
        json!({"startTime": "2026-01-01T00:00:00Z", "completionTime": "2026-01-01T00:10:00Z",
               "succeeded": 1, "conditions": [
                   {"type": "Complete", "status": "True", "lastTransitionTime": "2026-01-01T00:10:00Z"}]}),
    );
    reconcile(&done, &c).await;
    let runs = w.runs();
    assert_eq!(runs.len(), 1);
    assert_eq!(
        runs[0].confirmation,
        gpufit::core::confirm::Confirmation::Unconfirmed
    );
    w.later();
    let mut j2 = j;
    j2["metadata"]["name"] = json!("silent-2");
    let second = applied(&w.submit(JOB, j2));
    assert_ne!(second["source"], "historical_data_with_memory", "{second}");
    assert_eq!(
        second["settings"]["microBatchSize"], first["settings"]["microBatchSize"],
        "half the predicted peak, unconfirmed, moves nothing: {first} → {second}"
    );
}
