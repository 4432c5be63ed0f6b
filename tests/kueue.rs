//! Kueue-aware injection (issue 39.1): a batch Job and a PyTorchJob queued
//! in a two-flavor ClusterQueue (A100-40GB and H100-80GB ResourceFlavors
//! with nodeLabels) get, through gpufit's AdmissionCheck, the settings of
//! the flavor and counts they are **admitted** with.
//!
//! kube's `Client` talks to a scripted in-memory API server; the Workload
//! objects are written as Kueue writes them (`kueue.x-k8s.io/v1beta1`:
//! owner reference and job-uid label, `spec.podSets` named `main` /
//! `master`+`worker`, `status.admission.podSetAssignments` with flavors and
//! counts, `status.admissionChecks`, the QuotaReserved / Admitted / Evicted
//! conditions), and what Kueue does with the answer is replayed from its
//! source (`pkg/podset`: `podSetUpdates` merged into the templates at
//! unsuspend, a key already there with another value is a conflict; the
//! templates restored and every check reset to Pending on eviction).
//! The containers' downward-API environment is then resolved as the
//! kubelet would, so the test reads what the training script would read.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpufit::controller::crd::Mode;
use gpufit::controller::inject::{ANN_APPLIED, SETTING_ANNOTATION_PREFIX};
use gpufit::controller::kueue::CONTROLLER_NAME;
use gpufit::controller::metrics::Metrics;
use gpufit::controller::reconcile::kueue::{
    activation, admission_checks, our_checks, reconcile_kueue_workload, KueueContext,
};
use gpufit::controller::reconcile::workloads::{
    reconcile_workload, WorkloadContext, ANN_WORKLOAD, LABEL_CONFIGURED,
};
use gpufit::controller::reconcile::{Context, MeasuredPeak, PeakQuery, PeakReader};
use gpufit::controller::webhook::{review, WebhookState};
use gpufit::core::advisor::StrategyTargets;
use gpufit::history::{HistoryStore, ListFilter};
use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::reflector::{self, store::Writer};
use kube::runtime::watcher;
use serde_json::{json, Value};

#[path = "common/mock_api.rs"]
mod mock_api;

const KUEUE: &str = "/apis/kueue.x-k8s.io/v1beta1";

/// The scripted API server: objects by `plural/name`, pods, every write.
#[derive(Default)]
struct FakeApi {
    objects: BTreeMap<String, Value>,
    pods: Vec<Value>,
    /// (method, path, query) of every PATCH.
    writes: Vec<(String, String, String)>,
    /// Another writer changes the next Workload read, right after it is read.
    change_after_get: bool,
    rv: u64,
    unexpected: Vec<String>,
}

impl FakeApi {
    fn bump(&mut self, key: &str) {
        self.rv += 1;
        let rv = self.rv.to_string();
        if let Some(o) = self.objects.get_mut(key) {
            o["metadata"]["resourceVersion"] = json!(rv);
        }
    }

    fn status_writes(&self) -> usize {
        self.writes
            .iter()
            .filter(|(_, p, _)| p.ends_with("/status"))
            .count()
    }

    fn owner_writes(&self, plural: &str) -> usize {
        self.writes
            .iter()
            .filter(|(_, p, _)| p.contains(&format!("/{plural}/")))
            .count()
    }
}

fn not_found() -> (u16, Value) {
    (
        404,
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"}),
    )
}

fn answer(api: &mut FakeApi, method: &str, path: &str, query: &str, body: Value) -> (u16, Value) {
    if path.starts_with("/apis/events.k8s.io/") {
        return (201, body);
    }
    if path == "/api/v1/namespaces/ml/pods" && method == "GET" {
        let items: Vec<Value> = api
            .pods
            .iter()
            .filter(|p| p["metadata"]["labels"][LABEL_CONFIGURED] == "true")
            .cloned()
            .collect();
        return (
            200,
            json!({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}),
        );
    }
    if let Some(name) = path.strip_prefix(&format!("{KUEUE}/resourceflavors/")) {
        return match (method, api.objects.get(&format!("resourceflavors/{name}"))) {
            ("GET", Some(f)) => (200, f.clone()),
            ("GET", None) => not_found(),
            _ => {
                api.unexpected.push(format!("{method} {path}"));
                (405, json!({}))
            }
        };
    }
    if let Some(rest) = path.strip_prefix(&format!("{KUEUE}/namespaces/ml/workloads/")) {
        let (name, status) = match rest.strip_suffix("/status") {
            Some(n) => (n, true),
            None => (rest, false),
        };
        let key = format!("workloads/{name}");
        if !api.objects.contains_key(&key) {
            return not_found();
        }
        match (method, status) {
            ("GET", false) => {
                let out = api.objects[&key].clone();
                if std::mem::take(&mut api.change_after_get) {
                    api.bump(&key);
                }
                return (200, out);
            }
            ("PATCH", true) => {
                api.writes.push((method.into(), path.into(), query.into()));
                let stored = &api.objects[&key];
                // Server-side apply with a resourceVersion: a precondition.
                if body["metadata"]["resourceVersion"] != stored["metadata"]["resourceVersion"] {
                    return (
                        409,
                        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Conflict", "code": 409,
                               "message": "the object has been modified; please apply your changes to the latest version and try again"}),
                    );
                }
                // `admissionChecks` is a map keyed by name: our entry replaced, the others kept.
                let obj = api.objects.get_mut(&key).expect("workload");
                let checks = obj["status"]["admissionChecks"]
                    .as_array_mut()
                    .expect("admissionChecks");
                for ours in body["status"]["admissionChecks"]
                    .as_array()
                    .into_iter()
                    .flatten()
                {
                    match checks.iter_mut().find(|c| c["name"] == ours["name"]) {
                        Some(c) => *c = ours.clone(),
                        None => checks.push(ours.clone()),
                    }
                }
                api.bump(&key);
                return (200, api.objects[&key].clone());
            }
            _ => {}
        }
    }
    for plural in ["jobs", "pytorchjobs"] {
        let Some(name) = path
            .rsplit_once(&format!("/namespaces/ml/{plural}/"))
            .map(|(_, n)| n.to_string())
        else {
            continue;
        };
        let key = format!("{plural}/{name}");
        let Some(obj) = api.objects.get_mut(&key) else {
            return not_found();
        };
        match method {
            "GET" => return (200, obj.clone()),
            "PATCH" => {
                json_patch::merge(obj, &body);
                let out = obj.clone();
                api.writes.push((method.into(), path.into(), query.into()));
                return (200, out);
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

/// Peak reader double.
struct Peaks(u64);

impl PeakReader for Peaks {
    fn job_peak(&self, _q: &PeakQuery) -> Result<Option<MeasuredPeak>, String> {
        Ok(Some(MeasuredPeak {
            bytes: self.0,
            source: "prometheus".into(),
        }))
    }
}

/// Two node pools: A100-40GB (`pool=a100`) and H100-80GB (`pool=h100`).
fn nodes() -> reflector::Store<Node> {
    let (nodes, mut w) = reflector::store::<Node>();
    for (name, product, mem, pool) in [
        ("a100-1", "NVIDIA-A100-SXM4-40GB", "40960", "a100"),
        ("h100-1", "NVIDIA-H100-80GB-HBM3", "81559", "h100"),
    ] {
        w.apply_watcher_event(&watcher::Event::Apply(
            serde_json::from_value(json!({"metadata": {"name": name, "labels": {
                "nvidia.com/gpu.product": product, "nvidia.com/gpu.memory": mem,
                "nvidia.com/gpu.count": "8", "pool": pool}}}))
            .expect("node"),
        ));
    }
    nodes
}

/// The AdmissionChecks: gpufit's, and another controller's on the same queue.
fn checks() -> reflector::Store<DynamicObject> {
    let mut w = Writer::new(admission_checks());
    let store = w.as_reader();
    for (name, controller) in [
        ("gpufit", CONTROLLER_NAME),
        ("prov", "kueue.x-k8s.io/provisioning-request"),
    ] {
        w.apply_watcher_event(&watcher::Event::Apply(
            serde_json::from_value(json!({
                "apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "AdmissionCheck",
                "metadata": {"name": name, "generation": 1},
                "spec": {"controllerName": controller}
            }))
            .expect("admission check"),
        ));
    }
    store
}

struct World {
    api: Arc<Mutex<FakeApi>>,
    history: Arc<dyn HistoryStore>,
    webhook: WebhookState,
    kueue: Arc<KueueContext>,
    _dir: tempfile::TempDir,
}

impl World {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite:{}", dir.path().join("h.db").display());
        let history: Arc<dyn HistoryStore> = Arc::from(gpufit::history::open(&url).expect("db"));
        let api = Arc::new(Mutex::new(FakeApi::default()));
        {
            let mut a = api.lock().unwrap();
            // The two ResourceFlavors of the ClusterQueue, as an admin writes them.
            for (name, pool) in [("a100-40gb", "a100"), ("h100-80gb", "h100")] {
                a.objects.insert(
                    format!("resourceflavors/{name}"),
                    json!({"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "ResourceFlavor",
                           "metadata": {"name": name}, "spec": {"nodeLabels": {"pool": pool}}}),
                );
            }
            // A flavor of CPU-only nodes (no GPU labels anywhere).
            a.objects.insert(
                "resourceflavors/spot".into(),
                json!({"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "ResourceFlavor",
                       "metadata": {"name": "spot"}, "spec": {"nodeLabels": {"pool": "spot"}}}),
            );
        }
        let (namespaces, _w) = reflector::store::<Namespace>();
        let client = mock_api::mock_client(api.clone(), answer);
        let mut ctx = Context::new(
            client,
            history.clone(),
            nodes(),
            namespaces.clone(),
            Arc::new(Peaks(30 << 30)),
            Metrics::new(),
        );
        ctx.peak_retry = Duration::from_millis(200);
        World {
            webhook: WebhookState {
                history: history.clone(),
                nodes: nodes(),
                namespaces,
                metrics: Metrics::new(),
                targets: StrategyTargets::default(),
                default_mode: Mode::Inject,
                cache: Default::default(),
            },
            kueue: Arc::new(KueueContext {
                ctx: Arc::new(ctx),
                checks: checks(),
            }),
            api,
            history,
            _dir: dir,
        }
    }

    /// The webhook's answer for `obj`: (allowed, mutated object, warnings).
    fn admit(&self, kind: (&str, &str, &str, &str), obj: &Value) -> (Value, Vec<String>) {
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
        let mut admitted = obj.clone();
        if let Some(p) = resp.patch {
            let patch: json_patch::Patch = serde_json::from_slice(&p).expect("JSON patch");
            json_patch::patch(&mut admitted, &patch).expect("patch applies");
        }
        (admitted, resp.warnings.unwrap_or_default())
    }

    /// Submits `obj` through the webhook and stores it; Kueue then creates
    /// its Workload (pending, both checks Pending).
    fn submit(&self, kind: (&str, &str, &str, &str), obj: Value) -> (Value, String) {
        let (admitted, _) = self.admit(kind, &obj);
        let mut job = admitted;
        let name = job["metadata"]["name"].as_str().unwrap().to_string();
        job["metadata"]["uid"] = json!(format!("uid-{name}"));
        let wl = kueue_workload(kind, &job);
        let wl_name = wl["metadata"]["name"].as_str().unwrap().to_string();
        let mut api = self.api.lock().unwrap();
        api.objects
            .insert(format!("{}/{name}", kind.3), job.clone());
        api.objects.insert(format!("workloads/{wl_name}"), wl);
        api.bump(&format!("workloads/{wl_name}"));
        (job, wl_name)
    }

    fn get(&self, key: &str) -> Value {
        self.api.lock().unwrap().objects[key].clone()
    }

    /// Kueue changes the stored Workload (a new resourceVersion).
    fn kueue_writes(&self, wl: &str, f: impl FnOnce(&mut Value)) -> Value {
        let key = format!("workloads/{wl}");
        let mut api = self.api.lock().unwrap();
        f(api.objects.get_mut(&key).expect("workload"));
        api.bump(&key);
        api.objects[&key].clone()
    }

    /// One reconcile of gpufit's AdmissionCheck controller on `cached`.
    async fn reconcile(&self, cached: &Value) {
        let obj: DynamicObject = serde_json::from_value(cached.clone()).expect("workload");
        tokio::time::timeout(
            Duration::from_secs(30),
            reconcile_kueue_workload(Arc::new(obj), self.kueue.clone()),
        )
        .await
        .expect("in time")
        .expect("reconciled");
    }
}

const JOB: (&str, &str, &str, &str) = ("batch", "v1", "Job", "jobs");
const PYTORCHJOB: (&str, &str, &str, &str) = ("kubeflow.org", "v1", "PyTorchJob", "pytorchjobs");

fn annotations() -> Value {
    json!({
        "gpufit.io/model": "meta-llama/Llama-3.1-8B", "gpufit.io/method": "full",
        "gpufit.io/optimizer": "adamw8bit", "gpufit.io/sharding": "fsdp",
        "gpufit.io/seq-len": "2048", "gpufit.io/global-batch": "64"
    })
}

fn container(name: &str) -> Value {
    json!({"name": name, "image": "ghcr.io/acme/train:1",
           "args": ["--micro-batch", "{micro_batch_size}", "--grad-accum={gradient_accumulation_steps}"],
           "resources": {"limits": {"nvidia.com/gpu": "1", "cpu": "8"}}})
}

fn batch_job(name: &str, parallelism: u32, extra: Value) -> Value {
    let mut anns = annotations();
    if let (Some(a), Some(e)) = (anns.as_object_mut(), extra.as_object()) {
        a.extend(e.clone());
    }
    json!({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": "ml", "annotations": anns,
                     "labels": {"kueue.x-k8s.io/queue-name": "team-a"}},
        "spec": {"suspend": true, "parallelism": parallelism, "completions": parallelism,
                 "completionMode": "Indexed", "backoffLimit": 0,
                 "template": {"spec": {"restartPolicy": "Never", "containers": [container("train")]}}}
    })
}

fn pytorchjob(name: &str) -> Value {
    let template =
        json!({"spec": {"restartPolicy": "Never", "containers": [container("pytorch")]}});
    json!({
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": "ml", "annotations": annotations(),
                     "labels": {"kueue.x-k8s.io/queue-name": "team-a"}},
        "spec": {"runPolicy": {"suspend": true}, "pytorchReplicaSpecs": {
            "Master": {"replicas": 1, "restartPolicy": "Never", "template": template.clone()},
            "Worker": {"replicas": 3, "restartPolicy": "Never", "template": template}
        }}
    })
}

/// Pointers of a job's pod templates by Kueue pod set name.
fn templates(kind: &str) -> Vec<(&'static str, &'static str)> {
    match kind {
        "Job" => vec![("main", "/spec/template")],
        _ => vec![
            ("master", "/spec/pytorchReplicaSpecs/Master/template"),
            ("worker", "/spec/pytorchReplicaSpecs/Worker/template"),
        ],
    }
}

/// The Workload Kueue's job reconciler creates for `job`
/// (jobframework: name `<kind>-<name>-<hash>`, controller owner reference,
/// job-uid label; a Job's pod set `main` with `minCount` from
/// `kueue.x-k8s.io/job-min-parallelism`; a PyTorchJob's per replica type).
fn kueue_workload(kind: (&str, &str, &str, &str), job: &Value) -> Value {
    let (group, version, k, _) = kind;
    let name = job["metadata"]["name"].as_str().unwrap();
    let uid = job["metadata"]["uid"].as_str().unwrap();
    let api_version = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    let pod_sets: Vec<Value> = templates(k)
        .into_iter()
        .map(|(ps, ptr)| {
            let count = if k == "Job" {
                job["spec"]["parallelism"].clone()
            } else {
                job["spec"]["pytorchReplicaSpecs"][if ps == "master" { "Master" } else { "Worker" }]
                    ["replicas"]
                    .clone()
            };
            let mut p =
                json!({"name": ps, "count": count, "template": job.pointer(ptr).cloned().unwrap()});
            if let Some(min) = job["metadata"]["annotations"]["kueue.x-k8s.io/job-min-parallelism"]
                .as_str()
                .and_then(|m| m.parse::<u32>().ok())
            {
                p["minCount"] = json!(min);
            }
            p
        })
        .collect();
    json!({
        "apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "Workload",
        "metadata": {"name": format!("{}-{name}-3f9c1", k.to_lowercase()), "namespace": "ml",
            "uid": format!("wl-{uid}"), "generation": 1,
            "labels": {"kueue.x-k8s.io/job-uid": uid},
            "ownerReferences": [{"apiVersion": api_version, "kind": k, "name": name, "uid": uid,
                                 "controller": true, "blockOwnerDeletion": true}]},
        "spec": {"queueName": "team-a", "priority": 0, "active": true, "podSets": pod_sets},
        "status": {
            "conditions": [],
            "admissionChecks": [
                {"name": "gpufit", "state": "Pending", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"},
                {"name": "prov", "state": "Pending", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}
            ]
        }
    })
}

fn condition(wl: &mut Value, t: &str, status: &str, reason: &str) {
    let conds = wl["status"]["conditions"]
        .as_array_mut()
        .expect("conditions");
    conds.retain(|c| c["type"] != t);
    conds.push(
        json!({"type": t, "status": status, "reason": reason, "message": "",
                      "lastTransitionTime": "2026-01-01T00:01:00Z", "observedGeneration": 1}),
    );
}

/// Kueue's scheduler reserves quota on `flavor` for `counts` pods per pod
/// set (workload.SetQuotaReservation: QuotaReserved, Evicted reset).
fn reserve(wl: &mut Value, flavor: &str, counts: &[(&str, u32)]) {
    let assignments: Vec<Value> = counts
        .iter()
        .map(|(ps, n)| {
            json!({"name": ps, "count": n,
                   "flavors": {"nvidia.com/gpu": flavor, "cpu": flavor},
                   "resourceUsage": {"nvidia.com/gpu": n.to_string(), "cpu": (8 * n).to_string()}})
        })
        .collect();
    wl["status"]["admission"] =
        json!({"clusterQueue": "gpu-cluster-queue", "podSetAssignments": assignments});
    condition(wl, "QuotaReserved", "True", "QuotaReserved");
    if wl["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .any(|c| c["type"] == "Evicted")
    {
        condition(wl, "Evicted", "False", "QuotaReserved");
    }
}

/// The other AdmissionCheck's controller answers Ready.
fn other_check_ready(wl: &mut Value) {
    for c in wl["status"]["admissionChecks"].as_array_mut().unwrap() {
        if c["name"] == "prov" {
            c["state"] = json!("Ready");
        }
    }
}

fn check<'a>(wl: &'a Value, name: &str) -> &'a Value {
    wl["status"]["admissionChecks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .expect("check")
}

/// Kueue admits (every check Ready) and starts the job
/// (jobframework.startJob → podset.Merge): each pod set's flavor
/// nodeLabels into the node selector and every check's podSetUpdates
/// into the template, a key present with another value being a conflict;
/// a Job's parallelism set to the admitted count.
fn kueue_start(wl: &mut Value, job: &mut Value, flavors: &BTreeMap<String, Value>) {
    let checks = wl["status"]["admissionChecks"].as_array().unwrap().clone();
    assert!(checks.iter().all(|c| c["state"] == "Ready"), "{checks:#?}");
    condition(wl, "Admitted", "True", "Admitted");
    let kind = job["kind"].as_str().unwrap().to_string();
    for (ps, ptr) in templates(&kind) {
        let a = wl["status"]["admission"]["podSetAssignments"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["name"] == ps)
            .unwrap()
            .clone();
        let flavor = a["flavors"]["nvidia.com/gpu"].as_str().unwrap();
        let t = job.pointer_mut(ptr).unwrap();
        let mut merge = |field: &str, add: &Value| {
            let target = match field {
                "nodeSelector" => &mut t["spec"]["nodeSelector"],
                f => &mut t["metadata"][f],
            };
            if target.is_null() {
                *target = json!({});
            }
            for (k, v) in add.as_object().into_iter().flatten() {
                if let Some(old) = target.get(k) {
                    assert_eq!(old, v, "Kueue refuses a conflicting podSetUpdate for {k}");
                }
                target[k] = v.clone();
            }
        };
        merge("nodeSelector", &flavors[flavor]["spec"]["nodeLabels"]);
        for c in &checks {
            for u in c["podSetUpdates"].as_array().into_iter().flatten() {
                if u["name"] == ps {
                    merge("annotations", &u["annotations"]);
                    merge("labels", &u["labels"]);
                    merge("nodeSelector", &u["nodeSelector"]);
                }
            }
        }
        if kind == "Job" {
            job["spec"]["parallelism"] = a["count"].clone();
        }
    }
    match kind.as_str() {
        "Job" => job["spec"]["suspend"] = json!(false),
        _ => job["spec"]["runPolicy"]["suspend"] = json!(false),
    }
}

/// Kueue evicts (preemption): Evicted, every check reset to Pending
/// without its podSetUpdates; the job suspended and its templates restored
/// from the Workload's pod sets (RestorePodSetsInfo).
fn kueue_evict(wl: &mut Value, job: &mut Value) {
    condition(wl, "Evicted", "True", "Preempted");
    condition(wl, "Admitted", "False", "NoReservation");
    for c in wl["status"]["admissionChecks"].as_array_mut().unwrap() {
        let prev = c["state"].as_str().unwrap().to_string();
        *c = json!({"name": c["name"], "state": "Pending",
                    "message": format!("Reset to Pending after eviction. Previously: {prev}"),
                    "lastTransitionTime": "2026-01-01T00:30:00Z"});
    }
    let kind = job["kind"].as_str().unwrap().to_string();
    for (ps, ptr) in templates(&kind) {
        let original = wl["spec"]["podSets"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == ps)
            .unwrap()["template"]
            .clone();
        let t = job.pointer_mut(ptr).unwrap();
        t["metadata"]["annotations"] = original["metadata"]["annotations"].clone();
        t["metadata"]["labels"] = original["metadata"]["labels"].clone();
        t["spec"]["nodeSelector"] = original["spec"]["nodeSelector"].clone();
    }
    match kind.as_str() {
        "Job" => job["spec"]["suspend"] = json!(true),
        _ => job["spec"]["runPolicy"]["suspend"] = json!(true),
    }
}

/// The quota is released once the job is suspended.
fn kueue_release(wl: &mut Value) {
    condition(wl, "QuotaReserved", "False", "Pending");
    wl["status"].as_object_mut().unwrap().remove("admission");
}

/// What the container sees: its environment with the downward API
/// resolved from the pod's annotations (a missing annotation is an empty
/// string, as the kubelet does), and its args with `$(VAR)` expanded.
fn container_view(template: &Value) -> (BTreeMap<String, String>, Vec<String>) {
    let c = &template["spec"]["containers"][0];
    let anns = &template["metadata"]["annotations"];
    let mut env = BTreeMap::new();
    for e in c["env"].as_array().into_iter().flatten() {
        let name = e["name"].as_str().unwrap().to_string();
        let value = match (
            &e["value"],
            e["valueFrom"]["fieldRef"]["fieldPath"].as_str(),
        ) {
            (Value::String(v), _) => v.clone(),
            (_, Some(path)) => match path
                .strip_prefix("metadata.annotations['")
                .and_then(|p| p.strip_suffix("']"))
            {
                Some(key) => anns[key].as_str().unwrap_or("").to_string(),
                None => format!("<{path}>"),
            },
            _ => String::new(),
        };
        env.insert(name, value);
    }
    let args = c["args"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|a| {
            let mut s = a.as_str().unwrap().to_string();
            for (k, v) in &env {
                s = s.replace(&format!("$({k})"), v);
            }
            s
        })
        .collect();
    (env, args)
}

fn num(env: &BTreeMap<String, String>, key: &str) -> u32 {
    env[key]
        .parse()
        .unwrap_or_else(|_| panic!("{key} = {:?} is not a number", env[key]))
}

/// m × a × W = G, read from what the container sees.
fn assert_global_batch(template: &Value, w: u32) -> (u32, u32) {
    let (env, args) = container_view(template);
    let (m, a) = (
        num(&env, "GPUFIT_MICRO_BATCH_SIZE"),
        num(&env, "GPUFIT_GRAD_ACCUM_STEPS"),
    );
    assert_eq!(m * a * w, 64, "m {m} × a {a} × W {w} = G 64");
    assert_eq!(args[1], m.to_string());
    assert_eq!(args[2], format!("--grad-accum={a}"));
    (m, a)
}

fn flavors(w: &World) -> BTreeMap<String, Value> {
    ["a100-40gb", "h100-80gb"]
        .iter()
        .map(|f| (f.to_string(), w.get(&format!("resourceflavors/{f}"))))
        .collect()
}

fn applied(job: &Value) -> Value {
    serde_json::from_str(
        job["metadata"]["annotations"][ANN_APPLIED]
            .as_str()
            .expect("applied settings on the job"),
    )
    .expect("JSON")
}

#[tokio::test]
async fn a_queued_job_gets_the_settings_of_the_flavor_and_counts_it_was_admitted_with() {
    let w = World::new();

    // Without Kueue, the two pools are two GPUs: the job is left untouched.
    let mut plain = batch_job("plain", 4, json!({}));
    plain["metadata"]["labels"] = json!({});
    let (untouched, warnings) = w.admit(JOB, &plain);
    assert_eq!(untouched, plain);
    assert!(
        warnings.iter().any(|w| w.contains("different GPUs")),
        "{warnings:?}"
    );

    // Queued: every setting becomes a reference to a pod annotation.
    let (job, wl_name) = w.submit(JOB, batch_job("train", 4, json!({})));
    let t = &job["spec"]["template"];
    let (env, args) = container_view(t);
    assert_eq!(
        env["GPUFIT_MICRO_BATCH_SIZE"], "",
        "no value before admission"
    );
    assert_eq!(args[1], "", "an unset annotation reads as empty");
    assert_eq!(
        t["spec"]["containers"][0]["args"][1],
        "$(GPUFIT_MICRO_BATCH_SIZE)"
    );
    assert!(
        t["metadata"]["annotations"].is_null(),
        "the template's annotations are Kueue's to fill"
    );
    assert_eq!(t["metadata"]["labels"][LABEL_CONFIGURED], "true");
    assert!(job["metadata"]["annotations"][ANN_APPLIED].is_null());
    assert!(job["metadata"]["annotations"][ANN_WORKLOAD].is_string());

    // Queued, no quota yet: nothing to answer.
    let queued = w.get(&format!("workloads/{wl_name}"));
    w.reconcile(&queued).await;
    assert_eq!(w.api.lock().unwrap().writes.len(), 0);

    // Quota reserved on the A100 flavor for 4 pods.
    let reserved = w.kueue_writes(&wl_name, |wl| reserve(wl, "a100-40gb", &[("main", 4)]));
    w.reconcile(&reserved).await;
    let wl = w.get(&format!("workloads/{wl_name}"));
    let ours = check(&wl, "gpufit");
    assert_eq!(ours["state"], "Ready", "{ours:#}");
    assert!(
        ours["message"].as_str().unwrap().contains("a100-40gb"),
        "{ours:#}"
    );
    assert_eq!(
        check(&wl, "prov")["state"],
        "Pending",
        "another controller's check is left alone"
    );
    let update = &ours["podSetUpdates"][0];
    assert_eq!(update["name"], "main");
    let anns = update["annotations"].as_object().unwrap();
    assert_eq!(
        anns.keys()
            .filter(|k| k.starts_with(SETTING_ANNOTATION_PREFIX))
            .count(),
        10,
        "one annotation per setting"
    );
    let stored_job = w.get("jobs/train");
    let a100 = applied(&stored_job);
    assert!(a100["gpu"].as_str().unwrap().contains("A100"), "{a100}");
    let recorded_workload: Value = serde_json::from_str(
        stored_job["metadata"]["annotations"][ANN_WORKLOAD]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(recorded_workload["gpus"], 4);
    {
        let api = w.api.lock().unwrap();
        assert_eq!(api.status_writes(), 1);
        let (_, _, query) = &api
            .writes
            .iter()
            .find(|(_, p, _)| p.ends_with("/status"))
            .unwrap();
        assert!(
            query.contains("fieldManager=gpufit-advisor") && query.contains("force=true"),
            "{query}"
        );
    }

    // Duplicate and stale events (the cached copy still says Pending): no second answer.
    w.reconcile(&reserved).await;
    w.reconcile(&reserved).await;
    assert_eq!(
        w.api.lock().unwrap().status_writes(),
        1,
        "one answer per admission"
    );
    assert_eq!(w.api.lock().unwrap().owner_writes("jobs"), 1);

    // Kueue admits and starts it: the container reads the A100 settings.
    let mut job = w.get("jobs/train");
    let fl = flavors(&w);
    let started = w.kueue_writes(&wl_name, |wl| {
        other_check_ready(wl);
        kueue_start(wl, &mut job, &fl);
    });
    assert_eq!(
        job["spec"]["template"]["spec"]["nodeSelector"]["pool"],
        "a100"
    );
    let (m_a100, _) = assert_global_batch(&job["spec"]["template"], 4);
    assert_eq!(
        m_a100,
        a100["settings"]["microBatchSize"].as_u64().unwrap() as u32
    );
    w.reconcile(&started).await;
    assert_eq!(
        w.api.lock().unwrap().status_writes(),
        1,
        "admitted: nothing to answer"
    );

    // Preempted: evicted, checks reset, quota not yet released — the old
    // admission must not be answered again.
    let evicted = w.kueue_writes(&wl_name, |wl| kueue_evict(wl, &mut job));
    w.reconcile(&evicted).await;
    let released = w.kueue_writes(&wl_name, kueue_release);
    w.reconcile(&released).await;
    assert_eq!(
        w.api.lock().unwrap().status_writes(),
        1,
        "no answer while evicted"
    );
    let (env, _) = container_view(&job["spec"]["template"]);
    assert_eq!(
        env["GPUFIT_MICRO_BATCH_SIZE"], "",
        "the template was restored"
    );

    // Re-admitted to the H100 flavor: new settings for the new GPU.
    let readmitted = w.kueue_writes(&wl_name, |wl| reserve(wl, "h100-80gb", &[("main", 4)]));
    w.reconcile(&readmitted).await;
    let wl = w.get(&format!("workloads/{wl_name}"));
    assert_eq!(check(&wl, "gpufit")["state"], "Ready");
    assert!(check(&wl, "gpufit")["message"]
        .as_str()
        .unwrap()
        .contains("h100-80gb"));
    let stored_job = w.get("jobs/train");
    let h100 = applied(&stored_job);
    assert!(h100["gpu"].as_str().unwrap().contains("H100"), "{h100}");
    job["metadata"]["annotations"] = stored_job["metadata"]["annotations"].clone();
    let started = w.kueue_writes(&wl_name, |wl| {
        other_check_ready(wl);
        kueue_start(wl, &mut job, &fl);
    });
    let _ = started;
    assert_eq!(
        job["spec"]["template"]["spec"]["nodeSelector"]["pool"],
        "h100"
    );
    let (m_h100, _) = assert_global_batch(&job["spec"]["template"], 4);
    assert!(
        m_h100 > m_a100,
        "twice the memory, a larger micro batch: A100 {m_a100}, H100 {m_h100}"
    );

    // The job runs and completes: the run recorder records the admission's
    // prediction, GPU and settings.
    job["status"] = json!({"conditions": [{"type": "Complete", "status": "True"}],
        "startTime": "2026-01-01T01:00:00Z", "completionTime": "2026-01-01T02:00:00Z",
        "succeeded": 4});
    let pods: Vec<Value> = (0..4)
        .map(|i| {
            json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": format!("train-{i}-x"), "namespace": "ml",
                    "labels": job["spec"]["template"]["metadata"]["labels"],
                    "annotations": job["spec"]["template"]["metadata"]["annotations"],
                    "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "train",
                        "uid": "uid-train", "controller": true}]},
                "spec": {"nodeName": "h100-1", "containers": job["spec"]["template"]["spec"]["containers"]},
                "status": {"phase": "Succeeded", "hostIP": "10.0.0.2"}})
        })
        .collect();
    {
        let mut api = w.api.lock().unwrap();
        api.objects.insert("jobs/train".into(), job.clone());
        api.pods = pods;
    }
    let recorder = Arc::new(WorkloadContext {
        ctx: w.kueue.ctx.clone(),
        resource: ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("batch", "v1", "Job"),
            "jobs",
        ),
    });
    let obj: DynamicObject = serde_json::from_value(job.clone()).unwrap();
    tokio::time::timeout(
        Duration::from_secs(30),
        reconcile_workload(Arc::new(obj), recorder),
    )
    .await
    .expect("in time")
    .expect("recorded");
    let runs = w.history.list(&ListFilter::default()).expect("runs");
    assert_eq!(runs.len(), 1);
    let r = &runs[0];
    assert!(r.gpu_model.contains("H100"), "{}", r.gpu_model);
    assert_eq!(r.gpus, 4);
    assert_eq!(r.settings.micro_batch_size, m_h100);
    assert_eq!(r.predicted_peak_bytes, h100["predictedPeakBytes"].as_u64());
    assert_eq!(r.result.peak_memory_bytes, Some(30 << 30));
    assert_eq!(
        h100["source"], "heuristic",
        "nothing measured before: {h100}"
    );

    // The same workload queued again and admitted to the H100 flavor: its
    // admission learns from the recorded run.
    let (_, wl2) = w.submit(JOB, batch_job("train-2", 4, json!({})));
    let reserved = w.kueue_writes(&wl2, |wl| reserve(wl, "h100-80gb", &[("main", 4)]));
    w.reconcile(&reserved).await;
    let learned = applied(&w.get("jobs/train-2"));
    assert!(
        learned["source"]
            .as_str()
            .unwrap()
            .starts_with("historical_data"),
        "the second admission uses the first run: {learned}"
    );
    assert!(
        w.api.lock().unwrap().unexpected.is_empty(),
        "{:?}",
        w.api.lock().unwrap().unexpected
    );
}

#[tokio::test]
async fn partial_admission_lowers_w_and_raises_the_accumulation() {
    let w = World::new();
    let (mut job, wl_name) = w.submit(
        JOB,
        batch_job(
            "partial",
            4,
            json!({"kueue.x-k8s.io/job-min-parallelism": "2"}),
        ),
    );
    assert_eq!(
        w.get(&format!("workloads/{wl_name}"))["spec"]["podSets"][0]["minCount"],
        2
    );
    // Only 2 of the 4 pods fit in the quota.
    let reserved = w.kueue_writes(&wl_name, |wl| reserve(wl, "h100-80gb", &[("main", 2)]));
    w.reconcile(&reserved).await;
    let stored_job = w.get("jobs/partial");
    let workload: Value = serde_json::from_str(
        stored_job["metadata"]["annotations"][ANN_WORKLOAD]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(workload["gpus"], 2, "W is the admitted count");
    let fl = flavors(&w);
    w.kueue_writes(&wl_name, |wl| {
        other_check_ready(wl);
        kueue_start(wl, &mut job, &fl);
    });
    assert_eq!(job["spec"]["parallelism"], 2);
    assert_global_batch(&job["spec"]["template"], 2);
}

#[tokio::test]
async fn a_pytorchjob_gets_the_flavor_settings_on_master_and_workers_and_new_ones_on_readmission() {
    let w = World::new();
    let (mut job, wl_name) = w.submit(PYTORCHJOB, pytorchjob("ddp"));
    for (_, ptr) in templates("PyTorchJob") {
        let c = &job.pointer(ptr).unwrap()["spec"]["containers"][0];
        assert!(c["env"].as_array().unwrap().iter().any(|e| e["name"]
            == "GPUFIT_MICRO_BATCH_SIZE"
            && e["valueFrom"]["fieldRef"]["fieldPath"]
                .as_str()
                .unwrap()
                .contains(SETTING_ANNOTATION_PREFIX)));
    }
    let reserved = w.kueue_writes(&wl_name, |wl| {
        reserve(wl, "h100-80gb", &[("master", 1), ("worker", 3)])
    });
    // Another writer changes the Workload between our read and our write:
    // a conflict, nothing answered; the next reconcile answers.
    w.api.lock().unwrap().change_after_get = true;
    w.reconcile(&reserved).await;
    assert_eq!(
        check(&w.get(&format!("workloads/{wl_name}")), "gpufit")["state"],
        "Pending"
    );
    w.reconcile(&reserved).await;
    let wl = w.get(&format!("workloads/{wl_name}"));
    let ours = check(&wl, "gpufit");
    assert_eq!(ours["state"], "Ready");
    let names: Vec<&str> = ours["podSetUpdates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["master", "worker"]);
    let fl = flavors(&w);
    w.kueue_writes(&wl_name, |wl| {
        other_check_ready(wl);
        kueue_start(wl, &mut job, &fl);
    });
    let mut h100 = Vec::new();
    for (_, ptr) in templates("PyTorchJob") {
        h100.push(assert_global_batch(job.pointer(ptr).unwrap(), 4));
    }
    assert_eq!(h100[0], h100[1], "every rank the same settings");
    assert!(applied(&w.get("pytorchjobs/ddp"))["gpu"]
        .as_str()
        .unwrap()
        .contains("H100"));

    // Evicted, then re-admitted to the A100 flavor.
    w.kueue_writes(&wl_name, |wl| kueue_evict(wl, &mut job));
    w.kueue_writes(&wl_name, kueue_release);
    let readmitted = w.kueue_writes(&wl_name, |wl| {
        reserve(wl, "a100-40gb", &[("master", 1), ("worker", 3)])
    });
    w.reconcile(&readmitted).await;
    job["metadata"]["annotations"] = w.get("pytorchjobs/ddp")["metadata"]["annotations"].clone();
    w.kueue_writes(&wl_name, |wl| {
        other_check_ready(wl);
        kueue_start(wl, &mut job, &fl);
    });
    for (_, ptr) in templates("PyTorchJob") {
        let t = job.pointer(ptr).unwrap();
        assert_eq!(t["spec"]["nodeSelector"]["pool"], "a100");
        let a100 = assert_global_batch(t, 4);
        assert!(
            a100.0 < h100[0].0,
            "re-admission to the smaller GPU lowers m: {a100:?} vs {h100:?}"
        );
    }
    assert!(applied(&w.get("pytorchjobs/ddp"))["gpu"]
        .as_str()
        .unwrap()
        .contains("A100"));
}

#[tokio::test]
async fn a_job_gpufit_cannot_configure_is_admitted_as_written_never_held() {
    let w = World::new();
    // First admitted on A100: settings applied.
    let (mut job, wl_name) = w.submit(JOB, batch_job("cpu", 2, json!({})));
    let reserved = w.kueue_writes(&wl_name, |wl| reserve(wl, "a100-40gb", &[("main", 2)]));
    w.reconcile(&reserved).await;
    assert!(applied(&w.get("jobs/cpu"))["gpu"].is_string());
    w.kueue_writes(&wl_name, |wl| kueue_evict(wl, &mut job));
    w.kueue_writes(&wl_name, kueue_release);
    // Then on a flavor whose nodes carry no GPU labels.
    let spot = w.kueue_writes(&wl_name, |wl| reserve(wl, "spot", &[("main", 2)]));
    w.reconcile(&spot).await;
    let wl = w.get(&format!("workloads/{wl_name}"));
    let ours = check(&wl, "gpufit");
    assert_eq!(
        ours["state"], "Ready",
        "never Rejected (Kueue would deactivate it)"
    );
    assert!(ours.get("podSetUpdates").is_none());
    assert!(
        ours["message"]
            .as_str()
            .unwrap()
            .contains("gpufit did not configure"),
        "{ours:#}"
    );
    let stored = w.get("jobs/cpu");
    assert!(
        stored["metadata"]["annotations"][ANN_APPLIED].is_null(),
        "the earlier admission's settings are not this run's"
    );

    // A job on the same queue that did not opt in: Ready, nothing written on it.
    let mut other = batch_job("other", 1, json!({}));
    other["metadata"]["annotations"] = json!({});
    let (_, other_wl) = w.submit(JOB, other);
    let writes = w.api.lock().unwrap().owner_writes("jobs");
    let reserved = w.kueue_writes(&other_wl, |wl| reserve(wl, "a100-40gb", &[("main", 1)]));
    w.reconcile(&reserved).await;
    let wl = w.get(&format!("workloads/{other_wl}"));
    assert_eq!(check(&wl, "gpufit")["state"], "Ready");
    assert!(check(&wl, "gpufit").get("podSetUpdates").is_none());
    assert_eq!(w.api.lock().unwrap().owner_writes("jobs"), writes);
}

#[test]
fn only_our_admission_checks_are_ours_and_each_is_marked_active_once() {
    let store = checks();
    let ours = our_checks(&store);
    assert_eq!(ours.into_iter().collect::<Vec<_>>(), ["gpufit"]);
    let ac = |controller: &str, conditions: Value| -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "AdmissionCheck",
            "metadata": {"name": "gpufit", "generation": 3},
            "spec": {"controllerName": controller}, "status": {"conditions": conditions}
        }))
        .unwrap()
    };
    let body =
        activation(&ac(CONTROLLER_NAME, json!([])), "2026-01-01T00:00:00Z").expect("a patch");
    assert_eq!(body["status"]["conditions"][0]["type"], "Active");
    assert_eq!(body["status"]["conditions"][0]["status"], "True");
    assert_eq!(body["status"]["conditions"][0]["observedGeneration"], 3);
    let active = json!([{"type": "Active", "status": "True"}]);
    assert_eq!(activation(&ac(CONTROLLER_NAME, active), "t"), None);
    assert_eq!(
        activation(&ac("kueue.x-k8s.io/provisioning-request", json!([])), "t"),
        None
    );
}

#[tokio::test]
async fn recommend_mode_leaves_the_job_alone_and_writes_the_recommendation_at_admission() {
    let w = World::new();
    let mut job = batch_job("rec", 2, json!({"gpufit.io/mode": "Recommend"}));
    job["metadata"]["uid"] = json!("uid-rec");
    let (out, warnings) = w.admit(JOB, &job);
    assert_eq!(out, job, "Recommend: nothing injected at creation");
    assert!(
        warnings.iter().any(|m| m.contains("when Kueue admits it")),
        "{warnings:?}"
    );
    let (_, wl_name) = w.submit(
        JOB,
        batch_job("rec", 2, json!({"gpufit.io/mode": "Recommend"})),
    );
    let reserved = w.kueue_writes(&wl_name, |wl| reserve(wl, "h100-80gb", &[("main", 2)]));
    w.reconcile(&reserved).await;
    let ours = check(&w.get(&format!("workloads/{wl_name}")), "gpufit").clone();
    assert_eq!(ours["state"], "Ready");
    assert!(
        ours.get("podSetUpdates").is_none(),
        "Recommend: nothing set on the pods"
    );
    assert!(
        ours["message"].as_str().unwrap().contains("Recommend"),
        "{ours:#}"
    );
    let anns = &w.get("jobs/rec")["metadata"]["annotations"];
    assert!(anns["gpufit.io/recommendation"]
        .as_str()
        .unwrap()
        .contains("H100"));
    assert!(anns[ANN_APPLIED].is_null());
}

#[tokio::test]
async fn a_flavor_that_does_not_tell_the_gpu_falls_back_to_the_jobs_gpu_annotation() {
    let w = World::new();
    let (_, wl_name) = w.submit(
        JOB,
        batch_job(
            "named",
            2,
            json!({"gpufit.io/gpu": "NVIDIA A100-SXM4-80GB"}),
        ),
    );
    let reserved = w.kueue_writes(&wl_name, |wl| reserve(wl, "spot", &[("main", 2)]));
    w.reconcile(&reserved).await;
    let ours = check(&w.get(&format!("workloads/{wl_name}")), "gpufit").clone();
    assert_eq!(ours["state"], "Ready");
    assert!(
        ours["podSetUpdates"][0]["annotations"].is_object(),
        "{ours:#}"
    );
    let gpu = applied(&w.get("jobs/named"))["gpu"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(gpu.contains("A100-SXM4-80GB"), "{gpu}");
}

#[tokio::test]
async fn a_queued_trainjob_whose_runtime_sets_its_gpus_is_configured_at_admission() {
    let w = World::new();
    let tj = json!({
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
        "metadata": {"name": "tj", "namespace": "ml", "annotations": annotations(),
                     "labels": {"kueue.x-k8s.io/queue-name": "team-a"}},
        "spec": {"runtimeRef": {"name": "torch-distributed"},
                 "trainer": {"image": "ghcr.io/acme/train:1", "args": ["--mb", "{micro_batch_size}"]}}
    });
    let kind = ("trainer.kubeflow.org", "v1alpha1", "TrainJob", "trainjobs");
    let (out, warnings) = w.admit(kind, &tj);
    assert!(warnings.is_empty(), "W comes from admission: {warnings:?}");
    let env = out["spec"]["trainer"]["env"]
        .as_array()
        .expect("trainer env");
    assert!(env.iter().any(|e| e["name"] == "GPUFIT_MICRO_BATCH_SIZE"
        && e["valueFrom"]["fieldRef"]["fieldPath"]
            == "metadata.annotations['gpufit.io/setting.micro_batch_size']"));
    assert_eq!(
        out["spec"]["trainer"]["args"][1],
        "$(GPUFIT_MICRO_BATCH_SIZE)"
    );
    // Not queued: the runtime's W is unknown, so it is left alone with a warning.
    let mut plain = tj.clone();
    plain["metadata"]["labels"] = json!({});
    let (out, warnings) = w.admit(kind, &plain);
    assert_eq!(out, plain);
    assert!(
        warnings.iter().any(|m| m.contains("gpufit.io/gpus")),
        "{warnings:?}"
    );
}

#[tokio::test]
async fn pod_sets_admitted_to_different_flavors_are_planned_for_the_smaller_gpu() {
    let w = World::new();
    let (mut job, wl_name) = w.submit(PYTORCHJOB, pytorchjob("mixed"));
    let reserved = w.kueue_writes(&wl_name, |wl| {
        reserve(wl, "a100-40gb", &[("master", 1), ("worker", 3)]);
        wl["status"]["admission"]["podSetAssignments"][0]["flavors"] =
            json!({"nvidia.com/gpu": "h100-80gb", "cpu": "h100-80gb"});
    });
    w.reconcile(&reserved).await;
    let ours = check(&w.get(&format!("workloads/{wl_name}")), "gpufit").clone();
    let msg = ours["message"].as_str().unwrap();
    assert!(
        msg.contains("h100-80gb") && msg.contains("a100-40gb"),
        "{msg}"
    );
    assert!(applied(&w.get("pytorchjobs/mixed"))["gpu"]
        .as_str()
        .unwrap()
        .contains("A100"));
    let fl = flavors(&w);
    w.kueue_writes(&wl_name, |wl| {
        other_check_ready(wl);
        kueue_start(wl, &mut job, &fl);
    });
    let master = assert_global_batch(
        job.pointer("/spec/pytorchReplicaSpecs/Master/template")
            .unwrap(),
        4,
    );
    let worker = assert_global_batch(
        job.pointer("/spec/pytorchReplicaSpecs/Worker/template")
            .unwrap(),
        4,
    );
    assert_eq!(master, worker, "one set of settings for every rank");
}
