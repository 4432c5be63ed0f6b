//! Runs of workloads the admission webhook configured (issue 38.1): a Job
//! and a 4-pod PyTorchJob admitted by the webhook, then recorded by the
//! leader's workload reconciler through kube's `Client` over a scripted
//! in-memory API server (GET/PATCH the object, list its pods), into a real
//! SQLite history. Then the same workload submitted again learns from it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpufit::controller::crd::Mode;
use gpufit::controller::inject::ANN_APPLIED;
use gpufit::controller::metrics::Metrics;
use gpufit::controller::reconcile::workloads::{
    reconcile_workload, WorkloadContext, ANN_RECORDED, LABEL_CONFIGURED,
};
use gpufit::controller::reconcile::{Context, MeasuredPeak, PeakQuery, PeakReader};
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

#[path = "common/mock_api.rs"]
mod mock_api;

/// The scripted API server: objects by `plural/name`, pods, unexpected requests.
#[derive(Default)]
struct FakeApi {
    objects: BTreeMap<String, Value>,
    pods: Vec<Value>,
    unexpected: Vec<String>,
}

fn answer(api: &mut FakeApi, method: &str, path: &str, query: &str, body: Value) -> (u16, Value) {
    if path == "/api/v1/namespaces/ml/pods" && method == "GET" {
        let query = query.replace("%2F", "/").replace("%3D", "=");
        let selected = query.contains(LABEL_CONFIGURED);
        // A JobSet's pods are selected by the JobSet's name label.
        let jobset = query
            .split_once("jobset.sigs.k8s.io/jobset-name=")
            .map(|(_, v)| v.split('&').next().unwrap_or_default().to_string());
        let items: Vec<Value> = api
            .pods
            .iter()
            .filter(|p| {
                let l = &p["metadata"]["labels"];
                match &jobset {
                    Some(js) => l["jobset.sigs.k8s.io/jobset-name"] == js.as_str(),
                    None => selected && l[LABEL_CONFIGURED] == "true",
                }
            })
            .cloned()
            .collect();
        return (
            200,
            json!({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}),
        );
    }
    for plural in ["jobs", "pytorchjobs", "jobsets"] {
        let Some(name) = path
            .rsplit_once(&format!("/namespaces/ml/{plural}/"))
            .map(|(_, n)| n.to_string())
        else {
            continue;
        };
        let key = format!("{plural}/{name}");
        let Some(obj) = api.objects.get_mut(&key) else {
            return (
                404,
                json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"}),
            );
        };
        match method {
            "GET" => return (200, obj.clone()),
            "PATCH" => {
                json_patch::merge(obj, &body);
                return (200, obj.clone());
            }
            _ => {}
        }
    }
    api.unexpected.push(format!("{method} {path}?{query}"));
    (
        500,
        json!({"kind": "Status", "code": 500, "message": "unexpected"}),
    )
}

fn fake_client(api: Arc<Mutex<FakeApi>>) -> Client {
    mock_api::mock_client(api, answer)
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
    webhook: WebhookState,
    _dir: tempfile::TempDir,
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
        World {
            api: Arc::new(Mutex::new(FakeApi::default())),
            webhook: WebhookState {
                history: history.clone(),
                nodes: a100_nodes(),
                namespaces,
                metrics: Metrics::new(),
                targets: StrategyTargets::default(),
                default_mode: Mode::Inject,
                cache: Default::default(),
            },
            history,
            peaks: Arc::new(Peaks::default()),
            _dir: dir,
        }
    }

    /// A controller instance (a restart makes a new one over the same history).
    fn controller(&self, kind: (&str, &str, &str, &str)) -> Arc<WorkloadContext> {
        let (namespaces, _w) = reflector::store::<Namespace>();
        let mut ctx = Context::new(
            fake_client(self.api.clone()),
            self.history.clone(),
            a100_nodes(),
            namespaces,
            self.peaks.clone(),
            Metrics::new(),
        );
        ctx.peak_retry = Duration::from_millis(200);
        let (group, version, k, plural) = kind;
        Arc::new(WorkloadContext {
            ctx: Arc::new(ctx),
            resource: ApiResource::from_gvk_with_plural(
                &GroupVersionKind::gvk(group, version, k),
                plural,
            ),
        })
    }

    /// Admits `obj` through the webhook and stores it as the API server would.
    fn submit(&self, kind: (&str, &str, &str, &str), obj: Value) -> Value {
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

const JOB: (&str, &str, &str, &str) = ("batch", "v1", "Job", "jobs");
const PYTORCHJOB: (&str, &str, &str, &str) = ("kubeflow.org", "v1", "PyTorchJob", "pytorchjobs");

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
    let mut w = World::new();
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
        api.pods = vec![
            operator_pod(&job, "master", 0, running()),
            operator_pod(&job, "worker", 0, running()),
            operator_pod(&job, "worker", 1, oom()),
            operator_pod(&job, "worker", 2, running()),
        ];
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
    assert_eq!(r.result.failure_reason, Some(FailureReason::Oom));
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

    // The same workload again: it learned from the OOM.
    w.later();
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
    w.api.lock().unwrap().pods = vec![job_pod(
        &job,
        "finetune-x7k2p",
        "Succeeded",
        json!({"terminated": {"exitCode": 0, "reason": "Completed",
            "message": "{'train_runtime': 100.0, 'train_samples_per_second': 6.25, 'train_steps_per_second': 0.8, 'train_loss': 1.2, 'epoch': 1.0}"}}),
    )];
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
    assert!(runs[0].result.success);
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
    w.api.lock().unwrap().pods = vec![job_pod(
        &job,
        "late-abcde",
        "Failed",
        json!({"terminated": {"exitCode": 137, "reason": "OOMKilled"}}),
    )];
    let c = w.controller(JOB);
    let failed = w.set_status("jobs/late", job_failed());
    reconcile(&failed, &c).await;
    let runs = w.runs();
    assert_eq!(runs.len(), 1);
    assert_eq!(
        runs[0].result.failure_reason,
        Some(FailureReason::OtherError)
    );
    assert!(runs[0].result.host_oom, "OOMKilled: host memory");
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
    let done = w.api.lock().unwrap().objects["jobs/late"].clone();
    assert!(done["metadata"]["annotations"]["gpufit.io/peak-pending"].is_null());
    assert!(
        w.runs()[0].result.host_oom,
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

const JOBSET: (&str, &str, &str, &str) = ("jobset.x-k8s.io", "v1alpha2", "JobSet", "jobsets");

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
        "status": {"phase": "Failed", "hostIP": "10.0.0.1", "containerStatuses": [{
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
    w.api.lock().unwrap().pods = vec![jobset_pod(&js, 0, done), jobset_pod(&js, 1, oom())];
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
    assert_eq!(r.result.failure_reason, Some(FailureReason::Oom));
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
