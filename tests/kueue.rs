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
use gpufit::controller::keys::{ANN_FALLBACK, LABEL_DEFERRED};
use gpufit::controller::kueue::{
    KueueConfig, Unlabelled, CONTROLLER_NAME, DEFAULT_NAMESPACE_SELECTOR,
};
use gpufit::controller::metrics::Metrics;
use gpufit::controller::reconcile::kueue::{
    activation, admission_checks, local_queues, our_checks, reconcile_kueue_workload, KueueContext,
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

#[path = "common/api_server.rs"]
mod api_server;

use api_server::{ApiServer as FakeApi, Rule};

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
fn checks(version: &str) -> reflector::Store<DynamicObject> {
    let mut w = Writer::new(admission_checks(version));
    let store = w.as_reader();
    for (name, controller) in [
        ("gpufit", CONTROLLER_NAME),
        ("prov", "kueue.x-k8s.io/provisioning-request"),
    ] {
        w.apply_watcher_event(&watcher::Event::Apply(
            serde_json::from_value(json!({
                "apiVersion": format!("kueue.x-k8s.io/{version}"), "kind": "AdmissionCheck",
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
    /// The Kueue API version the stand-in serves.
    version: &'static str,
    /// The LocalQueues the webhook's reflector has seen.
    local_queues: Mutex<Writer<DynamicObject>>,
    _dir: tempfile::TempDir,
}

/// Every training integration enabled (a cluster whose Kueue
/// configuration lists `kubeflow.org/pytorchjob` too).
fn all_frameworks() -> Option<std::collections::BTreeSet<String>> {
    Some(
        gpufit::controller::kinds::KINDS
            .iter()
            .map(|k| k.kueue_framework().to_string())
            .collect(),
    )
}

impl World {
    fn new() -> Self {
        World::with(Unlabelled::default(), &[])
    }

    /// A world whose webhook knows these namespaces (name, labels) and
    /// which jobs without a queue label Kueue manages.
    fn with(unlabelled: Unlabelled, ns: &[(&str, Value)]) -> Self {
        World::build("v1beta2", unlabelled, all_frameworks(), ns)
    }

    /// The world with a Kueue that serves only API `version`, with these
    /// integrations enabled.
    fn build(
        version: &'static str,
        unlabelled: Unlabelled,
        frameworks: Option<std::collections::BTreeSet<String>>,
        ns: &[(&str, Value)],
    ) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite:{}", dir.path().join("h.db").display());
        let history: Arc<dyn HistoryStore> = Arc::from(gpufit::history::open(&url).expect("db"));
        let api = Arc::new(Mutex::new(
            FakeApi::default().serving("kueue.x-k8s.io", version),
        ));
        {
            let mut a = api.lock().unwrap();
            // The two ResourceFlavors of the ClusterQueue, as an admin writes them.
            for (name, pool) in [("a100-40gb", "a100"), ("h100-80gb", "h100")] {
                a.objects.insert(
                    format!("resourceflavors/{name}"),
                    json!({"apiVersion": format!("kueue.x-k8s.io/{version}"), "kind": "ResourceFlavor",
                           "metadata": {"name": name}, "spec": {"nodeLabels": {"pool": pool}}}),
                );
            }
            // A flavor of CPU-only nodes (no GPU labels anywhere).
            a.objects.insert(
                "resourceflavors/spot".into(),
                json!({"apiVersion": format!("kueue.x-k8s.io/{version}"), "kind": "ResourceFlavor",
                       "metadata": {"name": "spot"}, "spec": {"nodeLabels": {"pool": "spot"}}}),
            );
        }
        let (namespaces, mut ns_writer) = reflector::store::<Namespace>();
        for (name, labels) in ns {
            // The API server labels every namespace with its name.
            let mut l = labels.clone();
            l["kubernetes.io/metadata.name"] = json!(name);
            ns_writer.apply_watcher_event(&watcher::Event::Apply(
                serde_json::from_value(json!({"metadata": {"name": name, "labels": l}}))
                    .expect("namespace"),
            ));
        }
        let client = api_server::client(api.clone());
        let mut ctx = Context::new(
            client,
            history.clone(),
            nodes(),
            namespaces.clone(),
            Arc::new(Peaks(30 << 30)),
            Metrics::new(),
        );
        ctx.peak_retry = Duration::from_millis(200);
        let lq = Writer::new(local_queues(version));
        let lq_store = lq.as_reader();
        World {
            webhook: WebhookState {
                history: history.clone(),
                nodes: nodes(),
                namespaces,
                metrics: Metrics::new(),
                targets: StrategyTargets::default(),
                default_mode: Mode::Inject,
                cache: Default::default(),
                kueue: KueueConfig {
                    enabled: true,
                    unlabelled,
                    frameworks,
                    local_queues: Some(lq_store),
                },
            },
            kueue: Arc::new(KueueContext::new(Arc::new(ctx), checks(version), version)),
            version,
            local_queues: Mutex::new(lq),
            api,
            history,
            _dir: dir,
        }
    }

    /// The webhook's AdmissionResponse for `obj` created in namespace `ns`.
    fn review_in(
        &self,
        ns: &str,
        kind: (&str, &str, &str, &str),
        obj: &Value,
    ) -> kube::core::admission::AdmissionResponse {
        let (group, version, k, plural) = kind;
        let body = json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": "705ab4f5", "kind": {"group": group, "version": version, "kind": k},
                "resource": {"group": group, "version": version, "resource": plural},
                "name": obj["metadata"]["name"].clone(), "namespace": ns, "operation": "CREATE",
                "userInfo": {"username": "alice"}, "object": obj.clone(), "dryRun": false
            }
        });
        let out = review(&serde_json::to_vec(&body).unwrap(), &self.webhook);
        out.response.expect("a response")
    }

    /// The webhook's answer for `obj`: (allowed, mutated object, warnings).
    fn admit(&self, kind: (&str, &str, &str, &str), obj: &Value) -> (Value, Vec<String>) {
        self.admit_in("ml", kind, obj)
    }

    /// [`Self::admit`] in namespace `ns`.
    fn admit_in(
        &self,
        ns: &str,
        kind: (&str, &str, &str, &str),
        obj: &Value,
    ) -> (Value, Vec<String>) {
        let resp = self.review_in(ns, kind, obj);
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
        let mut wl = kueue_workload(kind, &job);
        wl["apiVersion"] = json!(format!("kueue.x-k8s.io/{}", self.version));
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

/// A Job's pods at once: parallelism, at most completions (Kueue's count).
fn job_pods(spec: &Value) -> u64 {
    let p = spec["parallelism"].as_u64().unwrap_or(1);
    spec["completions"].as_u64().map_or(p, |c| c.min(p))
}

/// A job's pod templates as Kueue names its pod sets: (name, JSON pointer,
/// pods). A Job's one `main`; a PyTorchJob's replica types lower-cased; a
/// JobSet's replicated Jobs by name, replicas × min(parallelism,
/// completions) pods each (`pkg/controller/jobs/jobset`: `podsCount`).
fn templates(job: &Value) -> Vec<(String, String, u64)> {
    match job["kind"].as_str().unwrap() {
        "Job" => vec![(
            "main".into(),
            "/spec/template".into(),
            job_pods(&job["spec"]),
        )],
        "JobSet" => job["spec"]["replicatedJobs"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(i, rj)| {
                (
                    rj["name"].as_str().unwrap().to_string(),
                    format!("/spec/replicatedJobs/{i}/template/spec/template"),
                    rj["replicas"].as_u64().unwrap_or(1) * job_pods(&rj["template"]["spec"]),
                )
            })
            .collect(),
        _ => ["Master", "Worker"]
            .iter()
            .map(|r| {
                (
                    r.to_lowercase(),
                    format!("/spec/pytorchReplicaSpecs/{r}/template"),
                    job["spec"]["pytorchReplicaSpecs"][r]["replicas"]
                        .as_u64()
                        .unwrap_or(1),
                )
            })
            .collect(),
    }
}

/// The Workload Kueue's job reconciler creates for `job`
/// (jobframework: name `<kind>-<name>-<hash>`, controller owner reference,
/// job-uid label; a Job's pod set `main` with `minCount` from
/// `kueue.x-k8s.io/job-min-parallelism`; a PyTorchJob's per replica type;
/// a JobSet's per replicated Job; a TrainJob's those of the JobSet its
/// runtime makes, `pkg/controller/jobs/trainjob`: `getChildJobSet`).
fn kueue_workload(kind: (&str, &str, &str, &str), job: &Value) -> Value {
    let (group, version, k, _) = kind;
    let name = job["metadata"]["name"].as_str().unwrap();
    let uid = job["metadata"]["uid"].as_str().unwrap();
    let api_version = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    let source = if k == "TrainJob" {
        trainer_jobset(job)
    } else {
        job.clone()
    };
    let pod_sets: Vec<Value> = templates(&source)
        .into_iter()
        .map(|(ps, ptr, count)| {
            let mut p = json!({"name": ps, "count": count,
                               "template": source.pointer(&ptr).cloned().unwrap()});
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
    let pod_sets = wl["spec"]["podSets"].as_array().unwrap().clone();
    let assignments: Vec<Value> = counts
        .iter()
        .map(|(ps, n)| {
            // A pod set gets a flavor for each resource it asks for: a
            // driver without GPUs gets only its CPUs'.
            let template = &pod_sets.iter().find(|p| p["name"] == *ps).expect("pod set")["template"];
            let gpus = template["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
                .as_str()
                .and_then(|g| g.parse::<u32>().ok());
            match gpus {
                Some(g) => json!({"name": ps, "count": n,
                    "flavors": {"nvidia.com/gpu": flavor, "cpu": flavor},
                    "resourceUsage": {"nvidia.com/gpu": (g * n).to_string(), "cpu": (8 * n).to_string()}}),
                None => json!({"name": ps, "count": n, "flavors": {"cpu": flavor},
                    "resourceUsage": {"cpu": (2 * n).to_string()}}),
            }
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

/// The PodSetInfo Kueue starts a pod set with (`podset.FromAssignment`,
/// then every check's `podSetUpdates` merged, `podset.FromUpdate`): the
/// flavors' nodeLabels as node selector, the updates' annotations, labels
/// and node selector. A key present with another value is a conflict.
fn pod_set_info(wl: &Value, ps: &str, flavors: &BTreeMap<String, Value>) -> Value {
    let a = wl["status"]["admission"]["podSetAssignments"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == ps)
        .unwrap()
        .clone();
    let mut info =
        json!({"annotations": {}, "labels": {}, "nodeSelector": {}, "count": a["count"]});
    let mut merge = |field: &str, add: &Value| {
        for (k, v) in add.as_object().into_iter().flatten() {
            if let Some(old) = info[field].get(k) {
                assert_eq!(old, v, "Kueue refuses a conflicting podSetUpdate for {k}");
            }
            info[field][k] = v.clone();
        }
    };
    for f in a["flavors"].as_object().unwrap().values() {
        merge(
            "nodeSelector",
            &flavors[f.as_str().unwrap()]["spec"]["nodeLabels"],
        );
    }
    for c in wl["status"]["admissionChecks"].as_array().unwrap() {
        for u in c["podSetUpdates"].as_array().into_iter().flatten() {
            if u["name"] == ps {
                merge("annotations", &u["annotations"]);
                merge("labels", &u["labels"]);
                merge("nodeSelector", &u["nodeSelector"]);
            }
        }
    }
    info
}

/// Merges string maps (`podset.Merge`: a key already there with another
/// value is a conflict Kueue refuses).
fn merge_into(target: &mut Value, add: &Value) {
    if target.is_null() {
        *target = json!({});
    }
    for (k, v) in add.as_object().into_iter().flatten() {
        if let Some(old) = target.get(k) {
            assert_eq!(old, v, "Kueue refuses a conflicting podSetUpdate for {k}");
        }
        target[k] = v.clone();
    }
}

/// Kueue admits (every check Ready) and starts the job
/// (jobframework.startJob → RunWithPodSetsInfo): a Job's, PyTorchJob's or
/// JobSet's templates get each pod set's info merged (`podset.Merge`), a
/// Job's parallelism the admitted count; a TrainJob's info goes into the
/// runtime patch Kueue owns (v0.17+: `spec.runtimePatches[manager
/// kueue.x-k8s.io/manager]`) or, in Kueue v0.15 – v0.16, appended
/// `spec.podTemplateOverrides`, which Kubeflow Trainer applies to the
/// runtime's JobSet ([`trainer_jobset`]).
fn kueue_start(wl: &mut Value, job: &mut Value, flavors: &BTreeMap<String, Value>) {
    let checks = wl["status"]["admissionChecks"].as_array().unwrap().clone();
    assert!(checks.iter().all(|c| c["state"] == "Ready"), "{checks:#?}");
    condition(wl, "Admitted", "True", "Admitted");
    let kind = job["kind"].as_str().unwrap().to_string();
    if kind == "TrainJob" {
        let infos: Vec<(String, Value)> = wl["spec"]["podSets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                let n = p["name"].as_str().unwrap().to_string();
                let info = pod_set_info(wl, &n, flavors);
                (n, info)
            })
            .collect();
        let kueue_patch = job["spec"]["runtimePatches"]
            .as_array_mut()
            .into_iter()
            .flatten()
            .find(|p| p["manager"] == "kueue.x-k8s.io/manager");
        match kueue_patch {
            Some(patch) => {
                patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"] = infos
                    .iter()
                    .map(|(n, i)| {
                        json!({"name": n, "template": {"spec": {"template": {
                        "metadata": {"annotations": i["annotations"], "labels": i["labels"]},
                        "spec": {"nodeSelector": i["nodeSelector"]}}}}})
                    })
                    .collect();
            }
            None => {
                let overrides = job["spec"]["podTemplateOverrides"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                let mut all = overrides;
                for (n, i) in &infos {
                    all.push(json!({"targetJobs": [{"name": n}],
                        "metadata": {"annotations": i["annotations"],
                                     "labels": {"kueue.x-k8s.io/podset": n}},
                        "spec": {"nodeSelector": i["nodeSelector"]}}));
                }
                job["spec"]["podTemplateOverrides"] = json!(all);
            }
        }
        job["spec"]["suspend"] = json!(false);
        return;
    }
    for (ps, ptr, _) in templates(job) {
        let info = pod_set_info(wl, &ps, flavors);
        let t = job.pointer_mut(&ptr).unwrap();
        merge_into(&mut t["spec"]["nodeSelector"], &info["nodeSelector"]);
        merge_into(&mut t["metadata"]["annotations"], &info["annotations"]);
        merge_into(&mut t["metadata"]["labels"], &info["labels"]);
        if kind == "Job" {
            job["spec"]["parallelism"] = info["count"].clone();
        }
    }
    match kind.as_str() {
        "PyTorchJob" => job["spec"]["runPolicy"]["suspend"] = json!(false),
        _ => job["spec"]["suspend"] = json!(false),
    }
}

/// Kueue evicts (preemption): Evicted, every check reset to Pending
/// without its podSetUpdates; the job suspended and its templates restored
/// from the Workload's pod sets (RestorePodSetsInfo; a TrainJob's: Kueue's
/// runtime patch emptied, or its podTemplateOverrides dropped).
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
    if kind == "TrainJob" {
        for p in job["spec"]["runtimePatches"]
            .as_array_mut()
            .into_iter()
            .flatten()
        {
            if p["manager"] == "kueue.x-k8s.io/manager" {
                p["trainingRuntimeSpec"]["template"]["spec"]
                    .as_object_mut()
                    .unwrap()
                    .remove("replicatedJobs");
            }
        }
        if let Some(o) = job["spec"]["podTemplateOverrides"].as_array_mut() {
            o.retain(|o| o["metadata"]["labels"]["kueue.x-k8s.io/podset"].is_null());
        }
        job["spec"]["suspend"] = json!(true);
        return;
    }
    for (ps, ptr, _) in templates(job) {
        let original = wl["spec"]["podSets"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == ps.as_str())
            .unwrap()["template"]
            .clone();
        let t = job.pointer_mut(&ptr).unwrap();
        t["metadata"]["annotations"] = original["metadata"]["annotations"].clone();
        t["metadata"]["labels"] = original["metadata"]["labels"].clone();
        t["spec"]["nodeSelector"] = original["spec"]["nodeSelector"].clone();
    }
    match kind.as_str() {
        "PyTorchJob" => job["spec"]["runPolicy"]["suspend"] = json!(true),
        _ => job["spec"]["suspend"] = json!(true),
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
    // The setting annotations are Kueue's to fill (a template key with
    // another value would be a conflict); only the fallback is there.
    let template_anns: Vec<&String> = t["metadata"]["annotations"]
        .as_object()
        .map(|a| a.keys().collect())
        .unwrap_or_default();
    assert_eq!(template_anns, [ANN_FALLBACK], "{template_anns:?}");
    assert_eq!(t["metadata"]["labels"][LABEL_DEFERRED], "true");
    assert_eq!(t["metadata"]["labels"][LABEL_CONFIGURED], "true");
    assert!(job["metadata"]["annotations"][ANN_APPLIED].is_null());
    assert!(job["metadata"]["annotations"][ANN_WORKLOAD].is_string());

    // Queued, no quota yet: nothing to answer.
    let queued = w.get(&format!("workloads/{wl_name}"));
    w.reconcile(&queued).await;
    assert_eq!(w.api.lock().unwrap().writes().len(), 0);

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
        let writes = api.writes();
        let (_, _, query) = writes
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
    assert_eq!(w.api.lock().unwrap().writes_to("jobs"), 1);

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
        api.set_pods(pods);
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
    for (_, ptr, _) in templates(&job) {
        let c = &job.pointer(&ptr).unwrap()["spec"]["containers"][0];
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
    w.api.lock().unwrap().bump_after_get = Some(format!("workloads/{wl_name}"));
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
    for (_, ptr, _) in templates(&job) {
        h100.push(assert_global_batch(job.pointer(&ptr).unwrap(), 4));
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
    for (_, ptr, _) in templates(&job) {
        let t = job.pointer(&ptr).unwrap();
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
    // Every setting, from the fallback (micro batch 1, accumulation keeping
    // G = 64 over the admitted 2 GPUs): no container reads "" and the
    // earlier flavor's values are all overwritten; no applied settings.
    let update = &ours["podSetUpdates"][0]["annotations"];
    assert!(update.get(ANN_APPLIED).is_none(), "{ours:#}");
    assert_eq!(
        update[format!("{SETTING_ANNOTATION_PREFIX}micro_batch_size")],
        "1"
    );
    assert_eq!(
        update[format!("{SETTING_ANNOTATION_PREFIX}gradient_accumulation_steps")],
        "32"
    );
    assert!(
        ours["message"]
            .as_str()
            .unwrap()
            .contains("gpufit did not configure"),
        "{ours:#}"
    );
    let mut admitted_wl = w.kueue_writes(&wl_name, other_check_ready);
    let mut fl = flavors(&w);
    fl.insert("spot".into(), w.get("resourceflavors/spot"));
    kueue_start(&mut admitted_wl, &mut job, &fl);
    assert_global_batch(&job["spec"]["template"], 2);
    let stored = w.get("jobs/cpu");
    assert!(
        stored["metadata"]["annotations"][ANN_APPLIED].is_null(),
        "the earlier admission's settings are not this run's"
    );

    // A job on the same queue that did not opt in: Ready, nothing written on it.
    let mut other = batch_job("other", 1, json!({}));
    other["metadata"]["annotations"] = json!({});
    let (_, other_wl) = w.submit(JOB, other);
    let writes = w.api.lock().unwrap().writes_to("jobs");
    let reserved = w.kueue_writes(&other_wl, |wl| reserve(wl, "a100-40gb", &[("main", 1)]));
    w.reconcile(&reserved).await;
    let wl = w.get(&format!("workloads/{other_wl}"));
    assert_eq!(check(&wl, "gpufit")["state"], "Ready");
    assert!(check(&wl, "gpufit").get("podSetUpdates").is_none());
    assert_eq!(w.api.lock().unwrap().writes_to("jobs"), writes);
}

#[test]
fn only_our_admission_checks_are_ours_and_each_is_marked_active_once() {
    let store = checks("v1beta2");
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
    let body = activation(
        "v1beta2",
        &ac(CONTROLLER_NAME, json!([])),
        "2026-01-01T00:00:00Z",
    )
    .expect("a patch");
    assert_eq!(body["status"]["conditions"][0]["type"], "Active");
    assert_eq!(body["status"]["conditions"][0]["status"], "True");
    assert_eq!(body["status"]["conditions"][0]["observedGeneration"], 3);
    let active = json!([{"type": "Active", "status": "True"}]);
    assert_eq!(
        activation("v1beta2", &ac(CONTROLLER_NAME, active), "t"),
        None
    );
    assert_eq!(
        activation(
            "v1beta2",
            &ac("kueue.x-k8s.io/provisioning-request", json!([])),
            "t"
        ),
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

// === JobSet and TrainJob through Kueue admission ===

const JOBSET: (&str, &str, &str, &str) = ("jobset.x-k8s.io", "v1alpha2", "JobSet", "jobsets");
const TRAINJOB: (&str, &str, &str, &str) =
    ("trainer.kubeflow.org", "v1alpha1", "TrainJob", "trainjobs");

/// A JobSet: a CPU-only driver, a leader with 2 GPUs, and 3 worker Jobs of
/// 2 one-GPU pods each (parallelism 2, completions 2): W = 1 × 2 + 3 × 2 × 1 = 8.
fn jobset(name: &str) -> Value {
    let pod = |c: Value| json!({"spec": {"restartPolicy": "Never", "containers": [c]}});
    let mut leader = container("train");
    leader["resources"]["limits"] = json!({"nvidia.com/gpu": "2", "cpu": "16"});
    json!({
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": name, "namespace": "ml", "annotations": annotations(),
                     "labels": {"kueue.x-k8s.io/queue-name": "team-a"}},
        "spec": {"suspend": true, "replicatedJobs": [
            {"name": "driver", "replicas": 1, "template": {"spec": {"parallelism": 1, "completions": 1,
                "template": pod(json!({"name": "driver", "image": "ghcr.io/acme/driver:1",
                                       "resources": {"limits": {"cpu": "2"}}}))}}},
            {"name": "leader", "replicas": 1, "template": {"spec": {"parallelism": 1, "completions": 1,
                "template": pod(leader)}}},
            {"name": "workers", "replicas": 3, "template": {"spec": {"parallelism": 2, "completions": 2,
                "template": pod(container("train"))}}}
        ]}
    })
}

/// The ClusterTrainingRuntime the TrainJobs use, shaped like Kubeflow
/// Trainer's torchtune runtimes (`manifests/base/runtimes/torchtune`): two
/// CPU-only initializer Jobs and the `node` Job (ancestor `trainer`, one
/// container `node`) that trains; `mlPolicy.numNodes` 1 unless the TrainJob says.
fn training_runtime() -> Value {
    let step = |s: &str| json!({"trainer.kubeflow.org/trainjob-ancestor-step": s});
    json!({
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "ClusterTrainingRuntime",
        "metadata": {"name": "torchtune-llama"},
        "spec": {"mlPolicy": {"numNodes": 1, "torch": {}}, "template": {"spec": {"replicatedJobs": [
            {"name": "dataset-initializer", "template": {"metadata": {"labels": step("dataset-initializer")},
                "spec": {"template": {"spec": {"containers": [
                    {"name": "dataset-initializer", "image": "ghcr.io/kubeflow/trainer/dataset-initializer"}]}}}}},
            {"name": "model-initializer", "template": {"metadata": {"labels": step("model-initializer")},
                "spec": {"template": {"spec": {"containers": [
                    {"name": "model-initializer", "image": "ghcr.io/kubeflow/trainer/model-initializer"}]}}}}},
            {"name": "node", "template": {"metadata": {"labels": step("trainer")},
                "spec": {"template": {"spec": {"containers": [
                    {"name": "node", "image": "ghcr.io/kubeflow/trainer/torchtune-trainer",
                     "command": ["tune", "run", "full_finetune_distributed"],
                     "env": [{"name": "HF_HOME", "value": "/workspace/cache"}],
                     "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}}}
        ]}}}
    })
}

/// A TrainJob on that runtime: 2 nodes of 4 GPUs (W = 8), suspended with
/// the empty runtime patch Kueue's webhook adds (v0.17+; `legacy`: Kueue
/// v0.15 – v0.16, which uses `podTemplateOverrides` instead).
fn trainjob(name: &str, legacy: bool) -> Value {
    let mut tj = json!({
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
        "metadata": {"name": name, "namespace": "ml", "annotations": annotations(),
                     "labels": {"kueue.x-k8s.io/queue-name": "team-a"}},
        "spec": {"suspend": true,
                 "runtimeRef": {"name": "torchtune-llama", "apiGroup": "trainer.kubeflow.org",
                                "kind": "ClusterTrainingRuntime"},
                 "trainer": {"numNodes": 2,
                             "resourcesPerNode": {"limits": {"nvidia.com/gpu": "4", "cpu": "32"}},
                             "args": ["--micro-batch", "{micro_batch_size}",
                                      "--grad-accum={gradient_accumulation_steps}"]}}
    });
    if !legacy {
        tj["spec"]["runtimePatches"] = json!([{"manager": "kueue.x-k8s.io/manager",
            "trainingRuntimeSpec": {"template": {"spec": {}}}}]);
    }
    tj
}

/// The JobSet Kubeflow Trainer makes of a TrainJob (`pkg/runtime/core/
/// trainingruntime.go` and `plugins/jobset/builder.go`, v2.1 – v2.3): the
/// runtime's JobSet template with the runtime patches merged (replicated
/// Jobs by name) or the podTemplateOverrides applied to their target Jobs;
/// each replicated Job 1 replica; the trainer Job's parallelism and
/// completions `numNodes`; its `node` container with the TrainJob's
/// command/args, `resourcesPerNode` merged into its resources and
/// `spec.trainer.env` upserted into its env.
fn trainer_jobset(tj: &Value) -> Value {
    let rt = training_runtime();
    let mut spec = rt["spec"]["template"]["spec"].clone();
    let mut apply = |name: &Value, meta: &Value, pod_spec: &Value| {
        let rj = spec["replicatedJobs"]
            .as_array_mut()
            .unwrap()
            .iter_mut()
            .find(|r| r["name"] == *name)
            .expect("a patch names a replicated Job of the runtime");
        let t = &mut rj["template"]["spec"]["template"];
        for (field, add) in [
            ("annotations", &meta["annotations"]),
            ("labels", &meta["labels"]),
        ] {
            for (k, v) in add.as_object().into_iter().flatten() {
                t["metadata"][field][k] = v.clone();
            }
        }
        for (k, v) in pod_spec["nodeSelector"].as_object().into_iter().flatten() {
            t["spec"]["nodeSelector"][k] = v.clone();
        }
    };
    for p in tj["spec"]["runtimePatches"]
        .as_array()
        .into_iter()
        .flatten()
    {
        for rj in p["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let t = &rj["template"]["spec"]["template"];
            apply(&rj["name"], &t["metadata"], &t["spec"]);
        }
    }
    for o in tj["spec"]["podTemplateOverrides"]
        .as_array()
        .into_iter()
        .flatten()
    {
        for target in o["targetJobs"].as_array().into_iter().flatten() {
            apply(&target["name"], &o["metadata"], &o["spec"]);
        }
    }
    let trainer = &tj["spec"]["trainer"];
    let nodes = trainer["numNodes"]
        .as_u64()
        .or(rt["spec"]["mlPolicy"]["numNodes"].as_u64())
        .unwrap_or(1);
    for rj in spec["replicatedJobs"].as_array_mut().unwrap() {
        rj["replicas"] = json!(1);
        if rj["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"]
            != "trainer"
        {
            continue;
        }
        rj["template"]["spec"]["parallelism"] = json!(nodes);
        rj["template"]["spec"]["completions"] = json!(nodes);
        for c in rj["template"]["spec"]["template"]["spec"]["containers"]
            .as_array_mut()
            .unwrap()
        {
            if c["name"] != "node" {
                continue;
            }
            for f in ["image", "command", "args"] {
                if !trainer[f].is_null() {
                    c[f] = trainer[f].clone();
                }
            }
            for kind in ["limits", "requests"] {
                for (k, v) in trainer["resourcesPerNode"][kind]
                    .as_object()
                    .into_iter()
                    .flatten()
                {
                    c["resources"][kind][k] = v.clone();
                }
            }
            let env = c["env"].as_array_mut().unwrap();
            for e in trainer["env"].as_array().into_iter().flatten() {
                env.retain(|x| x["name"] != e["name"]);
                env.push(e.clone());
            }
        }
    }
    let name = tj["metadata"]["name"].as_str().unwrap();
    json!({
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": name, "namespace": "ml", "uid": format!("js-{name}"),
            "ownerReferences": [{"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
                "name": name, "uid": tj["metadata"]["uid"], "controller": true}]},
        "spec": spec
    })
}

/// The `node` (trainer) pod template of a TrainJob's JobSet.
fn trainer_template(tj: &Value) -> Value {
    let js = trainer_jobset(tj);
    js["spec"]["replicatedJobs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "node")
        .expect("the trainer Job")["template"]["spec"]["template"]
        .clone()
}

/// Pods as the JobSet controller creates them from `template`: labelled
/// with the JobSet's name and uid, started, succeeded.
fn jobset_pods(jobset: &str, uid: &str, rj: &str, n: usize, template: &Value) -> Vec<Value> {
    (0..n)
        .map(|i| {
            let mut labels = template["metadata"]["labels"].clone();
            if labels.is_null() {
                labels = json!({});
            }
            labels["jobset.sigs.k8s.io/jobset-name"] = json!(jobset);
            labels["jobset.sigs.k8s.io/jobset-uid"] = json!(uid);
            json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": format!("{jobset}-{rj}-0-{i}-x"), "namespace": "ml",
                    "labels": labels, "annotations": template["metadata"]["annotations"]},
                "spec": {"nodeName": "h100-1", "containers": template["spec"]["containers"]},
                "status": {"phase": "Succeeded", "hostIP": "10.0.0.2",
                           "startTime": "2026-01-01T01:00:00Z"}})
        })
        .collect()
}

/// Runs the webhook-path run recorder once on `obj` (of `kind`).
async fn record(w: &World, kind: (&str, &str, &str, &str), obj: &Value) {
    let recorder = Arc::new(WorkloadContext {
        ctx: w.kueue.ctx.clone(),
        resource: ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk(kind.0, kind.1, kind.2),
            kind.3,
        ),
    });
    let o: DynamicObject = serde_json::from_value(obj.clone()).unwrap();
    tokio::time::timeout(
        Duration::from_secs(30),
        reconcile_workload(Arc::new(o), recorder),
    )
    .await
    .expect("in time")
    .expect("recorded");
}

#[tokio::test]
async fn a_jobset_gets_its_flavor_settings_in_every_training_job_and_new_ones_on_readmission() {
    let w = World::new();
    let (mut js, wl_name) = w.submit(JOBSET, jobset("llm"));
    let wl = w.get(&format!("workloads/{wl_name}"));
    // Kueue's pod sets: one per replicated Job, replicas × min(parallelism, completions).
    let sets: Vec<(String, i64)> = wl["spec"]["podSets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap().into(),
                p["count"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        sets,
        [
            ("driver".into(), 1),
            ("leader".into(), 1),
            ("workers".into(), 6)
        ]
    );
    // The driver asks for no GPU: its container is left alone.
    let driver = &js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"];
    assert!(
        driver["spec"]["containers"][0]["env"].is_null(),
        "{driver:#}"
    );

    let counts = [("driver", 1), ("leader", 1), ("workers", 6)];
    let reserved = w.kueue_writes(&wl_name, |wl| reserve(wl, "a100-40gb", &counts));
    w.reconcile(&reserved).await;
    let ours = check(&w.get(&format!("workloads/{wl_name}")), "gpufit").clone();
    assert_eq!(ours["state"], "Ready", "{ours:#}");
    assert!(
        ours["message"].as_str().unwrap().contains("W 8 GPUs"),
        "{ours:#}"
    );
    let a100 = applied(&w.get("jobsets/llm"));
    assert!(a100["gpu"].as_str().unwrap().contains("A100"), "{a100}");
    let recorded_w: Value = serde_json::from_str(
        w.get("jobsets/llm")["metadata"]["annotations"][ANN_WORKLOAD]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        recorded_w["gpus"], 8,
        "W over every training replicated Job"
    );

    let fl = flavors(&w);
    w.kueue_writes(&wl_name, |wl| {
        other_check_ready(wl);
        kueue_start(wl, &mut js, &fl);
    });
    assert_eq!(js["spec"]["suspend"], false);
    let mut a100_settings = Vec::new();
    for i in [1, 2] {
        let t = &js["spec"]["replicatedJobs"][i]["template"]["spec"]["template"];
        assert_eq!(t["spec"]["nodeSelector"]["pool"], "a100");
        a100_settings.push(assert_global_batch(t, 8));
    }
    assert_eq!(a100_settings[0], a100_settings[1], "every rank the same");
    assert_eq!(
        a100_settings[0].0 as u64,
        a100["settings"]["microBatchSize"].as_u64().unwrap()
    );

    // Preempted, then re-admitted to the H100 flavor.
    w.kueue_writes(&wl_name, |wl| kueue_evict(wl, &mut js));
    w.kueue_writes(&wl_name, kueue_release);
    let t = &js["spec"]["replicatedJobs"][2]["template"]["spec"]["template"];
    assert_eq!(container_view(t).0["GPUFIT_MICRO_BATCH_SIZE"], "");
    let readmitted = w.kueue_writes(&wl_name, |wl| reserve(wl, "h100-80gb", &counts));
    w.reconcile(&readmitted).await;
    js["metadata"]["annotations"] = w.get("jobsets/llm")["metadata"]["annotations"].clone();
    w.kueue_writes(&wl_name, |wl| {
        other_check_ready(wl);
        kueue_start(wl, &mut js, &fl);
    });
    let h100 = applied(&w.get("jobsets/llm"));
    assert!(h100["gpu"].as_str().unwrap().contains("H100"), "{h100}");
    let mut h100_settings = Vec::new();
    for i in [1, 2] {
        let t = &js["spec"]["replicatedJobs"][i]["template"]["spec"]["template"];
        assert_eq!(t["spec"]["nodeSelector"]["pool"], "h100");
        h100_settings.push(assert_global_batch(t, 8));
    }
    assert!(
        h100_settings[0].0 > a100_settings[0].0,
        "the larger GPU, a larger micro batch: {a100_settings:?} → {h100_settings:?}"
    );

    // It completes: one run recorded, with the H100 admission's prediction.
    js["status"] = json!({"conditions": [{"type": "Completed", "status": "True",
        "lastTransitionTime": "2026-01-01T02:00:00Z"}]});
    let leader_t = js["spec"]["replicatedJobs"][1]["template"]["spec"]["template"].clone();
    let workers_t = js["spec"]["replicatedJobs"][2]["template"]["spec"]["template"].clone();
    let driver_t = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"].clone();
    let mut pods = jobset_pods("llm", "uid-llm", "driver", 1, &driver_t);
    pods[0]["status"]["startTime"] = json!("2026-01-01T00:55:00Z");
    pods.extend(jobset_pods("llm", "uid-llm", "leader", 1, &leader_t));
    pods.extend(jobset_pods("llm", "uid-llm", "workers", 6, &workers_t));
    // A pod left by an earlier JobSet of the same name is not this run's.
    let mut stale = jobset_pods("llm", "uid-old", "workers", 1, &workers_t);
    stale[0]["metadata"]["name"] = json!("llm-old-pod");
    pods.extend(stale);
    {
        let mut api = w.api.lock().unwrap();
        api.objects.insert("jobsets/llm".into(), js.clone());
        api.set_pods(pods);
    }
    record(&w, JOBSET, &js).await;
    // A stale event for the same JobSet records nothing more.
    record(&w, JOBSET, &js).await;
    let runs = w.history.list(&ListFilter::default()).expect("runs");
    assert_eq!(runs.len(), 1, "one record for the JobSet");
    let r = &runs[0];
    assert!(r.gpu_model.contains("H100"), "{}", r.gpu_model);
    assert_eq!(r.gpus, 8);
    assert_eq!(r.predicted_peak_bytes, h100["predictedPeakBytes"].as_u64());
    assert_eq!(
        r.settings.micro_batch_size as u64,
        h100["settings"]["microBatchSize"].as_u64().unwrap()
    );
    assert_eq!(r.job_id.as_deref(), Some("JobSet:ml/llm/uid-llm"));
    assert!(r.result.success());
    assert_eq!(r.result.duration_sec, Some(3600.0));
    assert!(
        w.api.lock().unwrap().unexpected.is_empty(),
        "{:?}",
        w.api.lock().unwrap().unexpected
    );
}

/// A TrainJob through Kueue: its pod sets come from its runtime's JobSet;
/// gpufit's settings reach the trainer's `node` containers through
/// `spec.trainer.env` (downward-API references) and the pod annotations
/// Kueue puts in the runtime patch (or the podTemplateOverrides).
async fn trainjob_through_kueue(legacy: bool) {
    let w = World::new();
    let (mut tj, wl_name) = w.submit(TRAINJOB, trainjob("tj", legacy));
    let wl = w.get(&format!("workloads/{wl_name}"));
    let sets: Vec<(String, i64)> = wl["spec"]["podSets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap().into(),
                p["count"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        sets,
        [
            ("dataset-initializer".into(), 1),
            ("model-initializer".into(), 1),
            ("node".into(), 2)
        ]
    );
    // Before admission the trainer's variables read as empty.
    let (env, args) = container_view(&trainer_template(&tj));
    assert_eq!(env["GPUFIT_MICRO_BATCH_SIZE"], "");
    assert_eq!(env["HF_HOME"], "/workspace/cache", "the runtime's env kept");
    assert_eq!(args[1], "");

    let counts = [
        ("dataset-initializer", 1),
        ("model-initializer", 1),
        ("node", 2),
    ];
    let reserved = w.kueue_writes(&wl_name, |wl| reserve(wl, "h100-80gb", &counts));
    w.reconcile(&reserved).await;
    let ours = check(&w.get(&format!("workloads/{wl_name}")), "gpufit").clone();
    assert_eq!(ours["state"], "Ready", "{ours:#}");
    assert!(
        ours["message"].as_str().unwrap().contains("W 8 GPUs"),
        "{ours:#}"
    );
    let h100 = applied(&w.get("trainjobs/tj"));
    assert!(h100["gpu"].as_str().unwrap().contains("H100"), "{h100}");
    let fl = flavors(&w);
    w.kueue_writes(&wl_name, |wl| {
        other_check_ready(wl);
        kueue_start(wl, &mut tj, &fl);
    });
    assert_eq!(tj["spec"]["suspend"], false);
    let t = trainer_template(&tj);
    assert_eq!(t["spec"]["nodeSelector"]["pool"], "h100");
    let h100_settings = assert_global_batch(&t, 8);
    assert_eq!(
        h100_settings.0 as u64,
        h100["settings"]["microBatchSize"].as_u64().unwrap()
    );

    // Evicted, re-admitted to the A100 flavor: the A100's settings.
    w.kueue_writes(&wl_name, |wl| kueue_evict(wl, &mut tj));
    w.kueue_writes(&wl_name, kueue_release);
    assert_eq!(
        container_view(&trainer_template(&tj)).0["GPUFIT_MICRO_BATCH_SIZE"],
        "",
        "Kueue's patch was removed"
    );
    let readmitted = w.kueue_writes(&wl_name, |wl| reserve(wl, "a100-40gb", &counts));
    w.reconcile(&readmitted).await;
    tj["metadata"]["annotations"] = w.get("trainjobs/tj")["metadata"]["annotations"].clone();
    w.kueue_writes(&wl_name, |wl| {
        other_check_ready(wl);
        kueue_start(wl, &mut tj, &fl);
    });
    let t = trainer_template(&tj);
    assert_eq!(t["spec"]["nodeSelector"]["pool"], "a100");
    let a100_settings = assert_global_batch(&t, 8);
    assert!(
        a100_settings.0 < h100_settings.0,
        "the smaller GPU, a smaller micro batch: {h100_settings:?} → {a100_settings:?}"
    );
    let a100 = applied(&w.get("trainjobs/tj"));
    assert!(a100["gpu"].as_str().unwrap().contains("A100"), "{a100}");

    // It completes: one run for the TrainJob, none for its JobSet.
    tj["status"] = json!({"conditions": [
        {"type": "Created", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"},
        {"type": "Complete", "status": "True", "lastTransitionTime": "2026-01-01T01:30:00Z"}]});
    let mut child = trainer_jobset(&tj);
    child["status"] = json!({"conditions": [{"type": "Completed", "status": "True",
        "lastTransitionTime": "2026-01-01T01:30:00Z"}]});
    {
        let mut api = w.api.lock().unwrap();
        api.objects.insert("trainjobs/tj".into(), tj.clone());
        api.objects.insert("jobsets/tj".into(), child.clone());
        api.set_pods(jobset_pods("tj", "js-tj", "node", 2, &t));
        // The initializers ran first (from 00:40): not the training's time.
        let js = trainer_jobset(&tj);
        let init_t = &js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"];
        let mut init = jobset_pods("tj", "js-tj", "dataset-initializer", 1, init_t);
        init[0]["status"]["startTime"] = json!("2026-01-01T00:40:00Z");
        api.add_pods(init);
    }
    record(&w, JOBSET, &child).await;
    assert!(w.history.list(&ListFilter::default()).unwrap().is_empty());
    record(&w, TRAINJOB, &tj).await;
    record(&w, TRAINJOB, &tj).await;
    let runs = w.history.list(&ListFilter::default()).expect("runs");
    assert_eq!(runs.len(), 1, "one record for the TrainJob");
    let r = &runs[0];
    assert!(r.gpu_model.contains("A100"), "{}", r.gpu_model);
    assert_eq!(r.gpus, 8);
    assert_eq!(r.predicted_peak_bytes, a100["predictedPeakBytes"].as_u64());
    assert_eq!(r.job_id.as_deref(), Some("TrainJob:ml/tj/uid-tj"));
    assert_eq!(
        r.result.duration_sec,
        Some(1800.0),
        "from the trainer pods' start, not the initializers'"
    );
    assert_eq!(r.result.peak_memory_bytes, Some(30 << 30));
    assert!(
        w.api.lock().unwrap().unexpected.is_empty(),
        "{:?}",
        w.api.lock().unwrap().unexpected
    );
}

#[tokio::test]
async fn a_trainjob_gets_its_flavor_settings_through_kueues_runtime_patch() {
    trainjob_through_kueue(false).await;
}

#[tokio::test]
async fn a_trainjob_gets_its_flavor_settings_through_pod_template_overrides_on_older_kueue() {
    trainjob_through_kueue(true).await;
}

// === Jobs Kueue manages without a queue label ===

/// A Job without `kueue.x-k8s.io/queue-name`.
fn unlabelled_job(name: &str) -> Value {
    let mut j = batch_job(name, 2, json!({}));
    j["metadata"]["labels"] = json!({});
    j
}

fn deferred(job: &Value) -> bool {
    job["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|e| e["name"] == "GPUFIT_MICRO_BATCH_SIZE" && e["valueFrom"]["fieldRef"].is_object())
}

#[tokio::test]
async fn with_the_flag_unlabelled_jobs_in_kueues_namespaces_are_configured_at_admission() {
    let policy = Unlabelled::managing(DEFAULT_NAMESPACE_SELECTOR).unwrap();
    let w = World::with(
        policy,
        &[
            ("ml", json!({})),
            ("kube-system", json!({})),
            ("research", json!({"gpufit.io/kueue": "unmanaged"})),
            ("typo", json!({"gpufit.io/kueue": "on"})),
        ],
    );
    // In a namespace Kueue manages: configured at admission, like a queued job.
    let (job, warnings) = w.admit_in("ml", JOB, &unlabelled_job("auto"));
    assert!(deferred(&job), "{job:#}");
    assert!(warnings.is_empty(), "{warnings:?}");
    assert!(job["metadata"]["annotations"][ANN_WORKLOAD].is_string());
    // Kueue's webhook gives it the namespace's default LocalQueue; the
    // admission then goes as for any queued job.
    let mut job = job;
    job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = json!("default");
    job["metadata"]["uid"] = json!("uid-auto");
    let wl = kueue_workload(JOB, &job);
    let wl_name = wl["metadata"]["name"].as_str().unwrap().to_string();
    {
        let mut api = w.api.lock().unwrap();
        api.objects.insert("jobs/auto".into(), job.clone());
        api.objects.insert(format!("workloads/{wl_name}"), wl);
    }
    let reserved = w.kueue_writes(&wl_name, |wl| reserve(wl, "h100-80gb", &[("main", 2)]));
    w.reconcile(&reserved).await;
    let fl = flavors(&w);
    w.kueue_writes(&wl_name, |wl| {
        other_check_ready(wl);
        kueue_start(wl, &mut job, &fl);
    });
    assert_global_batch(&job["spec"]["template"], 2);

    // kube-system (outside Kueue's default selector) and a namespace
    // labelled unmanaged: the job is judged now, as without Kueue (the two
    // node pools are two GPUs, so it is left alone with a warning).
    for ns in ["kube-system", "research"] {
        let plain = unlabelled_job("plain");
        let (out, warnings) = w.admit_in(ns, JOB, &plain);
        assert_eq!(out, plain, "{ns}");
        assert!(
            warnings.iter().any(|m| m.contains("different GPUs")),
            "{ns}: {warnings:?}"
        );
    }
    // A Job its JobSet controls is admitted with the JobSet, not on its
    // own: judged now (here: left alone, two GPUs in the pools).
    let mut child = unlabelled_job("llm-workers-0");
    child["metadata"]["ownerReferences"] = json!([{"apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet", "name": "llm", "uid": "u", "controller": true}]);
    let (out, _) = w.admit_in("ml", JOB, &child);
    assert!(!deferred(&out), "{out:#}");
    // A namespace label gpufit does not know: denied, naming it.
    let resp = w.review_in("typo", JOB, &unlabelled_job("t"));
    assert!(!resp.allowed);
    assert!(
        resp.result.message.contains("gpufit.io/kueue"),
        "{:?}",
        resp.result
    );
    // A job that did not opt in is untouched anywhere.
    let mut other = unlabelled_job("other");
    other["metadata"]["annotations"] = json!({});
    assert_eq!(w.admit_in("ml", JOB, &other).0, other);
}

#[tokio::test]
async fn without_the_flag_a_namespace_labelled_managed_is_kueues() {
    let w = World::with(
        Unlabelled::default(),
        &[
            ("ml", json!({})),
            ("team-b", json!({"gpufit.io/kueue": "managed"})),
        ],
    );
    let (job, _) = w.admit_in("team-b", JOB, &unlabelled_job("b"));
    assert!(deferred(&job), "{job:#}");
    // A JobSet there too: every training template.
    let mut js = jobset("js-b");
    js["metadata"]["labels"] = json!({});
    let (js, _) = w.admit_in("team-b", JOBSET, &js);
    let workers = &js["spec"]["replicatedJobs"][2]["template"]["spec"]["template"];
    assert!(container_view(workers)
        .0
        .contains_key("GPUFIT_MICRO_BATCH_SIZE"));
    // Elsewhere (no flag, no label): not Kueue's.
    let plain = unlabelled_job("plain");
    let (out, _) = w.admit_in("ml", JOB, &plain);
    assert!(!deferred(&out));
    // Recommend mode in a managed namespace: untouched, told when.
    let mut rec = unlabelled_job("rec");
    rec["metadata"]["annotations"]["gpufit.io/mode"] = json!("Recommend");
    let (out, warnings) = w.admit_in("team-b", JOB, &rec);
    assert_eq!(out, rec);
    assert!(
        warnings.iter().any(|m| m.contains("when Kueue admits it")),
        "{warnings:?}"
    );
}

#[test]
fn the_controller_refuses_a_namespace_selector_it_cannot_read_and_the_flag_alone() {
    let gpufit = env!("CARGO_BIN_EXE_gpufit");
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite:{}", dir.path().join("h.db").display());
    let out = std::process::Command::new(gpufit)
        .args([
            "controller",
            "--kueue",
            "--kueue-manage-jobs-without-queue-name",
            "--kueue-managed-jobs-namespace-selector",
            "matchExpressions: [{key: team, operator: Near, values: [ml]}]",
            "--history",
            &db,
        ])
        .env("KUBECONFIG", dir.path().join("none"))
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--kueue-managed-jobs-namespace-selector"),
        "{err}"
    );
    // Without --kueue nothing would answer the admission: refused.
    let out = std::process::Command::new(gpufit)
        .args([
            "controller",
            "--kueue-manage-jobs-without-queue-name",
            "--history",
            &db,
        ])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--kueue"));
    // A namespace-limited controller would never answer the checks of
    // other namespaces' Workloads (their quota held forever): refused.
    let out = std::process::Command::new(gpufit)
        .args([
            "controller",
            "--kueue",
            "--watch-namespace",
            "ml",
            "--history",
            &db,
        ])
        .env("KUBECONFIG", dir.path().join("none"))
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--watch-namespace") && err.contains("quota"),
        "{err}"
    );
}

// === Kueue as it really behaves (issue 45) ===

/// Kueue's job webhook on a Job without a queue label in a namespace with
/// a LocalQueue `default` (`jobframework.ApplyDefaultLocalQueue`, then
/// `ApplyDefaultForSuspend`): the label, and suspended.
fn kueue_webhook(job: &Value) -> Value {
    let mut j = job.clone();
    if j["metadata"]["labels"]["kueue.x-k8s.io/queue-name"].is_null() {
        j["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = json!("default");
    }
    j["spec"]["suspend"] = json!(true);
    j
}

impl World {
    /// A LocalQueue appears (the webhook's reflector sees it).
    fn local_queue(&self, ns: &str, name: &str) {
        self.local_queues
            .lock()
            .unwrap()
            .apply_watcher_event(&watcher::Event::Apply(
                serde_json::from_value(json!({
                    "apiVersion": format!("kueue.x-k8s.io/{}", self.version), "kind": "LocalQueue",
                    "metadata": {"name": name, "namespace": ns}, "spec": {"clusterQueue": "gpu-cluster-queue"}}))
                .expect("local queue"),
            ));
    }

    /// Stores `job` (admitted) and the Workload Kueue makes for it.
    fn store(&self, kind: (&str, &str, &str, &str), job: &mut Value) -> String {
        let name = job["metadata"]["name"].as_str().unwrap().to_string();
        job["metadata"]["uid"] = json!(format!("uid-{name}"));
        let mut wl = kueue_workload(kind, job);
        wl["apiVersion"] = json!(format!("kueue.x-k8s.io/{}", self.version));
        let wl_name = wl["metadata"]["name"].as_str().unwrap().to_string();
        let mut api = self.api.lock().unwrap();
        api.objects
            .insert(format!("{}/{name}", kind.3), job.clone());
        api.objects.insert(format!("workloads/{wl_name}"), wl);
        api.bump(&format!("workloads/{wl_name}"));
        wl_name
    }

    /// Reconciles (as the controller's requeues would) until every gpufit
    /// check on the Workload is answered; returns how long that took.
    async fn answer(&self, wl_name: &str) -> Duration {
        let start = std::time::Instant::now();
        loop {
            let cached = self.get(&format!("workloads/{wl_name}"));
            let pending = cached["status"]["admissionChecks"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| {
                    c["name"].as_str().unwrap().starts_with("gpufit") && c["state"] == "Pending"
                });
            if !pending {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "never answered: {cached:#}"
            );
            let obj: DynamicObject = serde_json::from_value(cached).expect("workload");
            let _ = reconcile_kueue_workload(Arc::new(obj), self.kueue.clone()).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A pod the Job controller creates from `template`, through gpufit's
    /// pod webhook (the chart's `pods` rule).
    fn pod_from(&self, template: &Value) -> Value {
        let pod = json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p-0", "namespace": "ml",
                         "labels": template["metadata"]["labels"].clone(),
                         "annotations": template["metadata"]["annotations"].clone()},
            "spec": template["spec"].clone()});
        self.admit(("", "v1", "Pod", "pods"), &pod).0
    }
}

/// Every `GPUFIT_*` setting the container reads, and every word of its
/// args, as the kubelet expands them (`fieldpath.go`: a missing annotation
/// is ""; `$(VAR)` from the environment): none may be empty.
fn assert_no_empty_setting(pod: &Value, what: &str) -> BTreeMap<String, String> {
    let (env, args) = container_view(pod);
    for v in gpufit::core::settings::SETTING_VARS {
        let got = env
            .get(v.env)
            .unwrap_or_else(|| panic!("{what}: {} not set", v.env));
        assert!(!got.trim().is_empty(), "{what}: {} is empty", v.env);
    }
    for a in &args {
        assert!(
            !a.is_empty() && !a.ends_with('='),
            "{what}: an empty argument in {args:?}"
        );
    }
    env
}

/// The ids of the stand-ins: one Kueue API version each.
const STAND_INS: [&str; 2] = ["v1beta2", "v1beta1"];

#[tokio::test]
async fn each_stand_in_is_spoken_in_the_one_version_it_serves() {
    for version in STAND_INS {
        let w = World::build(version, Unlabelled::default(), all_frameworks(), &[]);
        let client = w.kueue.ctx.client.clone();
        assert_eq!(
            gpufit::controller::reconcile::kueue::discover_version(&client)
                .await
                .unwrap(),
            version
        );
        let (mut job, wl_name) = w.submit(JOB, batch_job("v", 4, json!({})));
        w.kueue_writes(&wl_name, |wl| reserve(wl, "h100-80gb", &[("main", 4)]));
        w.answer(&wl_name).await;
        let fl = flavors(&w);
        w.kueue_writes(&wl_name, |wl| {
            other_check_ready(wl);
            kueue_start(wl, &mut job, &fl);
        });
        assert_global_batch(&job["spec"]["template"], 4);
        let api = w.api.lock().unwrap();
        assert!(api.unexpected.is_empty(), "{version}: {:?}", api.unexpected);
        assert!(
            api.writes()
                .iter()
                .filter(|(_, p, _)| p.contains("kueue.x-k8s.io"))
                .all(|(_, p, _)| p.contains(&format!("/{version}/"))),
            "{version}: {:?}",
            api.writes()
        );
    }
}

#[tokio::test]
async fn a_kueue_serving_no_known_version_is_refused_with_the_versions_named() {
    let w = World::build("v1alpha9", Unlabelled::default(), all_frameworks(), &[]);
    let e = gpufit::controller::reconcile::kueue::discover_version(&w.kueue.ctx.client)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("v1alpha9") && e.contains("v1beta2"), "{e}");
}

#[tokio::test]
async fn a_local_queue_defaulted_job_is_configured_at_admission_in_either_webhook_order() {
    let ml = [("ml", json!({}))];
    let mut defaults = Unlabelled::managing(DEFAULT_NAMESPACE_SELECTOR).unwrap();
    defaults.manage = false; // Kueue's default: only LocalQueueDefaulting queues it.
    let w = World::with(defaults, &ml);
    w.local_queue("ml", "default");
    let job = unlabelled_job("lqd");
    // Kueue's webhook first, then gpufit's.
    let (kueue_first, _) = w.admit(JOB, &kueue_webhook(&job));
    // gpufit's first, then Kueue's, then gpufit's again
    // (reinvocationPolicy: IfNeeded, since Kueue's changed the object).
    let (gpufit_first, _) = w.admit(JOB, &job);
    let (reinvoked, _) = w.admit(JOB, &kueue_webhook(&gpufit_first));
    assert_eq!(
        kueue_first, reinvoked,
        "the same object whichever webhook runs first"
    );
    assert!(
        deferred(&kueue_first),
        "configured at admission, not at creation"
    );
    assert!(kueue_first["metadata"]["annotations"][ANN_APPLIED].is_null());

    // Admitted on H100 for 2 pods: that flavor's settings.
    let mut job = kueue_first;
    let wl_name = w.store(JOB, &mut job);
    w.kueue_writes(&wl_name, |wl| reserve(wl, "h100-80gb", &[("main", 2)]));
    w.answer(&wl_name).await;
    let fl = flavors(&w);
    w.kueue_writes(&wl_name, |wl| {
        other_check_ready(wl);
        kueue_start(wl, &mut job, &fl);
    });
    assert_global_batch(&job["spec"]["template"], 2);
    assert!(applied(&w.get("jobs/lqd"))["gpu"]
        .as_str()
        .unwrap()
        .contains("H100"));

    // Without the LocalQueue, Kueue does not queue it: judged now (the
    // two pools are two GPUs, so left alone with a warning).
    let w = World::with(Unlabelled::default(), &ml);
    let plain = unlabelled_job("plain");
    assert_eq!(w.admit(JOB, &plain).0, plain);
}

#[tokio::test]
async fn a_labelled_pytorchjob_is_configured_at_creation_when_kueues_integration_is_off() {
    // Kueue's default configuration: the PyTorchJob integration is off, so
    // Kueue neither suspends nor admits it; with deferred settings it
    // would start with empty ones.
    let w = World::build("v1beta2", Unlabelled::default(), None, &[]);
    let mut pj = pytorchjob("off");
    pj["metadata"]["annotations"]["gpufit.io/gpu"] = json!("H100-80GB");
    let (out, _) = w.admit(PYTORCHJOB, &pj);
    let t = &out["spec"]["pytorchReplicaSpecs"]["Worker"]["template"];
    let env = assert_no_empty_setting(t, "PyTorchJob, integration off");
    assert!(env["GPUFIT_MICRO_BATCH_SIZE"].parse::<u32>().is_ok());
    assert!(out["metadata"]["annotations"][ANN_APPLIED].is_string());
    // The Job integration is on: a labelled Job is queued (deferred).
    let (job, _) = w.admit(JOB, &batch_job("on", 2, json!({})));
    assert!(deferred(&job));
}

#[tokio::test]
async fn an_immediately_configured_job_that_is_then_queued_never_fails_to_start() {
    // Kueue's `job_controller_test.go` "conflict": a template annotation
    // with another value in a podSetUpdate finishes the Workload
    // FailedToStart. Here: the job was configured at creation (Kueue's
    // label came later, e.g. a LocalQueue gpufit's cache had not seen yet),
    // so its template carries gpufit.io/applied-settings.
    let w = World::new();
    let mut job = unlabelled_job("conflict");
    job["metadata"]["annotations"]["gpufit.io/gpu"] = json!("A100-SXM4-40GB");
    let (mut job, _) = w.admit(JOB, &job);
    let before = job["spec"]["template"]["metadata"]["annotations"][ANN_APPLIED].clone();
    assert!(before.is_string(), "{job:#}");
    job = kueue_webhook(&job);
    let wl_name = w.store(JOB, &mut job);
    w.kueue_writes(&wl_name, |wl| reserve(wl, "h100-80gb", &[("main", 2)]));
    w.answer(&wl_name).await;
    let fl = flavors(&w);
    let mut started = w.kueue_writes(&wl_name, other_check_ready);
    // `merge_into` asserts what podset.Merge refuses: no conflicting key.
    kueue_start(&mut started, &mut job, &fl);
    let t = &job["spec"]["template"];
    assert_eq!(
        t["metadata"]["annotations"][ANN_APPLIED], before,
        "the template's own value kept"
    );
    assert_global_batch(t, 2);
}

#[tokio::test]
async fn every_workload_is_answered_within_the_bound_across_the_fault_matrix() {
    use gpufit::controller::reconcile::kueue::ANSWER_BUDGET;
    let mut waits: Vec<(&str, Duration)> = Vec::new();

    // 1. An owner of a kind gpufit does not describe (a RayJob): not read
    //    (the chart's RBAC would answer 403), Ready at once, a Warning.
    let w = World::new();
    let (_, wl_name) = w.submit(JOB, batch_job("ray", 2, json!({})));
    w.kueue_writes(&wl_name, |wl| {
        wl["metadata"]["ownerReferences"][0]["apiVersion"] = json!("ray.io/v1");
        wl["metadata"]["ownerReferences"][0]["kind"] = json!("RayJob");
        reserve(wl, "h100-80gb", &[("main", 2)]);
    });
    waits.push(("unknown kind (RayJob)", w.answer(&wl_name).await));
    let ours = check(&w.get(&format!("workloads/{wl_name}")), "gpufit").clone();
    assert_eq!(ours["state"], "Ready");
    assert!(
        ours["message"].as_str().unwrap().contains("RayJob"),
        "{ours:#}"
    );
    {
        let api = w.api.lock().unwrap();
        assert!(
            !api.seen.iter().any(|r| r.path.contains("rayjobs")),
            "the RayJob is never read: {:?}",
            api.seen
        );
        assert!(
            api.events().iter().any(|e| e["type"] == "Warning"),
            "{:?}",
            api.events()
        );
    }

    // 2. An owner gpufit may not read (403).
    let w = World::new();
    w.api
        .lock()
        .unwrap()
        .fail("GET", "/jobs/", u32::MAX, 403, "Forbidden");
    let (mut job, wl_name) = w.submit(JOB, batch_job("forbidden", 2, json!({})));
    w.kueue_writes(&wl_name, |wl| reserve(wl, "h100-80gb", &[("main", 2)]));
    waits.push(("owner 403", w.answer(&wl_name).await));
    let wl = w.get(&format!("workloads/{wl_name}"));
    let ours = check(&wl, "gpufit").clone();
    assert_eq!(ours["state"], "Ready");
    assert!(
        ours["message"].as_str().unwrap().contains("403"),
        "{ours:#}"
    );
    // Its pods still read every setting (the template's fallback).
    let fl = flavors(&w);
    let mut started = w.kueue_writes(&wl_name, other_check_ready);
    kueue_start(&mut started, &mut job, &fl);
    assert_no_empty_setting(&w.pod_from(&job["spec"]["template"]), "owner 403");

    // 3. The API server fails every read for longer than the budget: the
    //    fallback answer, within the budget.
    let w = World::new();
    let (_, wl_name) = w.submit(JOB, batch_job("flaky", 2, json!({})));
    w.kueue_writes(&wl_name, |wl| reserve(wl, "h100-80gb", &[("main", 2)]));
    w.api.lock().unwrap().rules.push(Rule {
        method: "GET",
        path: "/".into(),
        unless: "/workloads/".into(),
        times: u32::MAX,
        code: 500,
        reason: "InternalError",
    });
    let waited = w.answer(&wl_name).await;
    waits.push(("owner reads fail (500) throughout", waited));
    assert!(
        waited >= ANSWER_BUDGET.saturating_sub(Duration::from_secs(1)),
        "{waited:?}"
    );
    let ours = check(&w.get(&format!("workloads/{wl_name}")), "gpufit").clone();
    assert!(
        ours["message"].as_str().unwrap().contains("fallback"),
        "{ours:#}"
    );
    assert_eq!(
        ours["podSetUpdates"][0]["annotations"]
            [format!("{SETTING_ANNOTATION_PREFIX}micro_batch_size")],
        "1"
    );

    // 4. Two gpufit checks on one Workload: both answered, in one write.
    let w = World::new();
    let (_, wl_name) = w.submit(JOB, batch_job("two", 2, json!({})));
    w.kueue_writes(&wl_name, |wl| {
        wl["status"]["admissionChecks"].as_array_mut().unwrap().push(
            json!({"name": "gpufit-b", "state": "Pending", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}),
        );
        reserve(wl, "h100-80gb", &[("main", 2)]);
    });
    let mut ac = Writer::new(admission_checks("v1beta2"));
    for c in w.kueue.checks.state() {
        ac.apply_watcher_event(&watcher::Event::Apply((*c).clone()));
    }
    ac.apply_watcher_event(&watcher::Event::Apply(
        serde_json::from_value(
            json!({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "AdmissionCheck",
            "metadata": {"name": "gpufit-b"}, "spec": {"controllerName": CONTROLLER_NAME}}),
        )
        .unwrap(),
    ));
    let two = World {
        kueue: Arc::new(KueueContext::new(
            w.kueue.ctx.clone(),
            ac.as_reader(),
            "v1beta2",
        )),
        ..w
    };
    waits.push(("two gpufit checks", two.answer(&wl_name).await));
    let wl = two.get(&format!("workloads/{wl_name}"));
    assert_eq!(check(&wl, "gpufit")["state"], "Ready");
    assert_eq!(check(&wl, "gpufit-b")["state"], "Ready");
    assert_eq!(two.api.lock().unwrap().status_writes(), 1);

    // 5. A second replica that does not lead writes nothing; the
    //    controller killed while checks are pending: the replica that
    //    takes the Lease answers on its first look.
    let w = World::new();
    let (_, wl_name) = w.submit(JOB, batch_job("failover", 2, json!({})));
    let reserved = w.kueue_writes(&wl_name, |wl| reserve(wl, "h100-80gb", &[("main", 2)]));
    let standby = {
        let mut ctx = Context::new(
            w.kueue.ctx.client.clone(),
            w.history.clone(),
            nodes(),
            reflector::store::<Namespace>().0,
            Arc::new(Peaks(1)),
            Metrics::new(),
        );
        ctx.leading = tokio::sync::watch::channel(false).1;
        Arc::new(KueueContext::new(
            Arc::new(ctx),
            checks("v1beta2"),
            "v1beta2",
        ))
    };
    let obj: DynamicObject = serde_json::from_value(reserved.clone()).unwrap();
    reconcile_kueue_workload(Arc::new(obj), standby)
        .await
        .unwrap();
    assert_eq!(
        w.api.lock().unwrap().writes().len(),
        0,
        "a standby writes nothing"
    );
    // The leader was killed (its in-flight reconcile dropped mid-way).
    let obj: DynamicObject = serde_json::from_value(reserved).unwrap();
    let leader = reconcile_kueue_workload(Arc::new(obj), w.kueue.clone());
    let _ = tokio::time::timeout(Duration::from_micros(1), leader).await;
    // The new leader (a fresh replica) answers.
    let fresh = World {
        kueue: Arc::new(KueueContext::new(
            w.kueue.ctx.clone(),
            checks("v1beta2"),
            "v1beta2",
        )),
        ..w
    };
    waits.push(("leader killed, next replica", fresh.answer(&wl_name).await));
    assert_eq!(
        check(&fresh.get(&format!("workloads/{wl_name}")), "gpufit")["state"],
        "Ready"
    );

    let longest = waits.iter().map(|(_, d)| *d).max().unwrap();
    for (what, d) in &waits {
        eprintln!(
            "fault matrix: {what}: answered after {:.3} s",
            d.as_secs_f64()
        );
    }
    eprintln!(
        "fault matrix: longest wait {:.3} s; bound {:?} (+ the Lease duration on failover)",
        longest.as_secs_f64(),
        ANSWER_BUDGET
    );
    assert!(
        longest <= ANSWER_BUDGET + Duration::from_secs(1),
        "{waits:?}"
    );
}

#[tokio::test]
async fn no_pod_starts_with_an_empty_setting_across_the_failure_matrix() {
    let mut checked = 0;
    // (what, flavor admitted on, whether gpufit's check is on the Workload)
    for (what, flavor, with_check) in [
        ("configured", "h100-80gb", true),
        (
            "a flavor without GPU labels (answer: fallback)",
            "spot",
            true,
        ),
        (
            "a flavor whose nodes do not exist yet (answer: fallback)",
            "future",
            true,
        ),
        (
            "the check absent on this flavor (admissionChecksStrategy.onFlavors)",
            "h100-80gb",
            false,
        ),
    ] {
        let w = World::new();
        w.api.lock().unwrap().objects.insert(
            "resourceflavors/future".into(),
            json!({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
                   "metadata": {"name": "future"}, "spec": {"nodeLabels": {"pool": "autoscaled"}}}),
        );
        let (mut job, wl_name) = w.submit(JOB, batch_job("m", 2, json!({})));
        w.kueue_writes(&wl_name, |wl| {
            if !with_check {
                wl["status"]["admissionChecks"]
                    .as_array_mut()
                    .unwrap()
                    .retain(|c| c["name"] != "gpufit");
            }
            reserve(wl, flavor, &[("main", 2)]);
        });
        if with_check {
            w.answer(&wl_name).await;
        }
        let mut fl = flavors(&w);
        for f in ["spot", "future"] {
            fl.insert(f.into(), w.get(&format!("resourceflavors/{f}")));
        }
        let mut started = w.kueue_writes(&wl_name, other_check_ready);
        kueue_start(&mut started, &mut job, &fl);
        let pod = w.pod_from(&job["spec"]["template"]);
        let env = assert_no_empty_setting(&pod, what);
        let (m, a) = (
            num(&env, "GPUFIT_MICRO_BATCH_SIZE"),
            num(&env, "GPUFIT_GRAD_ACCUM_STEPS"),
        );
        assert_eq!(m * a * 2, 64, "{what}: m {m} × a {a} × 2 = 64");
        checked += 1;
        // Kueue never finishes it FailedToStart: kueue_start's merge found no conflict.
        let wl = w.get(&format!("workloads/{wl_name}"));
        assert!(
            !wl["status"]["conditions"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| c["reason"] == "FailedToStart"),
            "{what}"
        );
    }
    // Without the pod webhook the absent-check pod would read "" — the
    // kubelet's rule the matrix guards against.
    let w = World::new();
    let (job, _) = w.admit(JOB, &batch_job("raw", 2, json!({})));
    let (env, _) = container_view(&job["spec"]["template"]);
    assert_eq!(env["GPUFIT_MICRO_BATCH_SIZE"], "");
    eprintln!(
        "empty-setting matrix: {checked} cases, 0 pods with an empty setting, 0 FailedToStart"
    );
}

// === Kueue's own objects (tests/fixtures/kueue, kubernetes-sigs/kueue ff69552) ===

fn fixture(name: &str) -> Vec<Value> {
    let path = format!("{}/tests/fixtures/kueue/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).expect("fixture");
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).expect("YAML"))
        .filter(|v: &Value| !v.is_null())
        .collect()
}

#[test]
fn kueues_samples_are_read_as_kueue_reads_them() {
    use gpufit::controller::kinds;
    // The JobSet: pod sets named after the replicated Jobs (no GPUs: all
    // of them), queued through its label (the integration is on by default).
    let js = &fixture("sample-jobset.yaml")[0];
    let k = kinds::of(Some("jobset.x-k8s.io"), "JobSet").unwrap();
    let sets: Vec<String> = k
        .shape(js)
        .unwrap()
        .templates
        .into_iter()
        .map(|t| t.pod_set)
        .collect();
    assert_eq!(sets, ["workers", "driver"]);
    let cfg = KueueConfig {
        enabled: true,
        ..KueueConfig::default()
    };
    assert_eq!(
        cfg.queue_for(k.kueue_framework(), js.get("metadata"), "default", None)
            .unwrap(),
        Some("user-queue".into())
    );
    // The PyTorchJob: pod sets master and worker; Kueue's default
    // configuration does not enable its integration, so the label does not queue it.
    let pj = &fixture("sample-pytorchjob.yaml")[0];
    let k = kinds::of(Some("kubeflow.org"), "PyTorchJob").unwrap();
    let sets: Vec<String> = k
        .shape(pj)
        .unwrap()
        .templates
        .into_iter()
        .map(|t| t.pod_set)
        .collect();
    assert_eq!(sets, ["master", "worker"]);
    assert_eq!(
        cfg.queue_for(k.kueue_framework(), pj.get("metadata"), "default", None)
            .unwrap(),
        None
    );
}

#[test]
fn kueues_admission_checks_are_not_gpufits_and_its_cluster_queue_is_v1beta2() {
    let mut objs = fixture("provisioning-setup.yaml");
    objs.extend(fixture("sample-admission-check.yaml"));
    let mut w = Writer::new(admission_checks("v1beta2"));
    let store = w.as_reader();
    for o in objs.iter().filter(|o| o["kind"] == "AdmissionCheck") {
        assert_eq!(o["apiVersion"], "kueue.x-k8s.io/v1beta2");
        w.apply_watcher_event(&watcher::Event::Apply(
            serde_json::from_value(o.clone()).unwrap(),
        ));
    }
    assert_eq!(store.state().len(), 2);
    assert!(our_checks(&store).is_empty());
    // The ClusterQueue names its checks per flavor (v1beta2): the docs'
    // example for gpufit's check has the same shape.
    let cq = objs.iter().find(|o| o["kind"] == "ClusterQueue").unwrap();
    let strategy = &cq["spec"]["admissionChecksStrategy"]["admissionChecks"][0];
    assert_eq!(strategy["onFlavors"][0], "default-flavor");
    let docs =
        std::fs::read_to_string(format!("{}/docs/controller.md", env!("CARGO_MANIFEST_DIR")))
            .unwrap();
    let example = docs
        .split("```yaml")
        .skip(1)
        .filter_map(|b| b.split("```").next())
        .find(|b| b.contains("kind: ClusterQueue"))
        .expect("docs/controller.md has a ClusterQueue example");
    let docs_cq: Value = serde_yaml::Deserializer::from_str(example)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .find(|v: &Value| v["kind"] == "ClusterQueue")
        .unwrap();
    assert_eq!(docs_cq["apiVersion"], cq["apiVersion"]);
    assert!(
        docs_cq["spec"].get("admissionChecks").is_none(),
        "v1beta2 has admissionChecksStrategy only"
    );
    assert_eq!(
        docs_cq["spec"]["admissionChecksStrategy"]["admissionChecks"][0]["name"],
        "gpufit"
    );
}

#[test]
fn kueues_workload_status_shapes_are_read() {
    use gpufit::controller::kueue::{step, Step, Workload};
    // QuotaReserved with a Pending check: that check is answered, and the
    // reservation time is read from the condition.
    let pending = &fixture("pending-admission-check-status.yaml")[0];
    let wl = Workload::from_json(pending).unwrap();
    let ours = ["dws-prov".to_string()].into();
    assert_eq!(
        step(&wl, &ours),
        Step::Configure {
            checks: vec!["dws-prov".into()]
        }
    );
    assert_eq!(
        wl.reserved_at().unwrap().to_rfc3339(),
        "2024-05-03T20:01:59+00:00"
    );
    // podSetAssignments: count and flavors per resource.
    let assigned = &fixture("podsetassignments-workload.yaml")[0];
    let wl = Workload::from_json(assigned).unwrap();
    let a = &wl.status.admission.as_ref().unwrap().pod_set_assignments[0];
    assert_eq!((a.name.as_str(), a.count), ("main", Some(3)));
    assert_eq!(a.flavors["cpu"], "default-flavor");
}

/// JobSet's `resumeJob` (kubernetes-sigs/jobset v0.12.0,
/// `pkg/controllers/jobset_controller.go`): an existing child Job's pod
/// template gets the replicated Job's annotations **merged** in
/// (`collections.MergeMaps`: new values win, old keys stay).
fn jobset_resume_child(child: &mut Value, template: &Value) {
    let old = child["metadata"]["annotations"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    let mut merged = old;
    for (k, v) in template["metadata"]["annotations"]
        .as_object()
        .into_iter()
        .flatten()
    {
        merged.insert(k.clone(), v.clone());
    }
    child["metadata"]["annotations"] = Value::Object(merged);
}

#[tokio::test]
async fn a_readmission_to_another_flavor_reaches_the_jobsets_existing_child_jobs() {
    let w = World::new();
    let (mut js, wl_name) = w.submit(JOBSET, jobset("llm"));
    let counts = [("driver", 1), ("leader", 1), ("workers", 6)];
    // First admission: H100, configured; JobSet creates its child Jobs
    // from the replicated Jobs' templates.
    w.kueue_writes(&wl_name, |wl| reserve(wl, "h100-80gb", &counts));
    w.answer(&wl_name).await;
    let fl = {
        let mut f = flavors(&w);
        f.insert("spot".into(), w.get("resourceflavors/spot"));
        f
    };
    let mut started = w.kueue_writes(&wl_name, other_check_ready);
    kueue_start(&mut started, &mut js, &fl);
    let ptr = "/spec/replicatedJobs/2/template/spec/template";
    let mut child = js.pointer(ptr).unwrap().clone();
    let h100 = assert_no_empty_setting(&w.pod_from(&child), "first admission");
    // Evicted; re-admitted on a flavor gpufit cannot read the GPU of:
    // the fallback, every key of it.
    w.kueue_writes(&wl_name, |wl| kueue_evict(wl, &mut js));
    w.kueue_writes(&wl_name, kueue_release);
    w.kueue_writes(&wl_name, |wl| reserve(wl, "spot", &counts));
    w.answer(&wl_name).await;
    let mut restarted = w.kueue_writes(&wl_name, other_check_ready);
    kueue_start(&mut restarted, &mut js, &fl);
    jobset_resume_child(&mut child, js.pointer(ptr).unwrap());
    let pod = w.pod_from(&child);
    let again = assert_no_empty_setting(&pod, "re-admission");
    for v in gpufit::core::settings::SETTING_VARS {
        let key = format!("{SETTING_ANNOTATION_PREFIX}{}", v.placeholder);
        assert_eq!(
            pod["metadata"]["annotations"][&key],
            js.pointer(ptr).unwrap()["metadata"]["annotations"][&key],
            "{key}: the child Job runs this admission's value"
        );
    }
    assert_eq!(
        again["GPUFIT_MICRO_BATCH_SIZE"], "1",
        "the fallback, not H100's {}",
        h100["GPUFIT_MICRO_BATCH_SIZE"]
    );
    let (m, a) = (
        num(&again, "GPUFIT_MICRO_BATCH_SIZE"),
        num(&again, "GPUFIT_GRAD_ACCUM_STEPS"),
    );
    assert_eq!(m * a * 8, 64, "m × a × W(8) = G");
}

#[test]
fn the_oldest_pending_check_is_what_the_alert_watches() {
    use gpufit::controller::reconcile::kueue::oldest_pending;
    let wl = |name: &str, reserved: &str, state: &str| -> Arc<DynamicObject> {
        Arc::new(
            serde_json::from_value(json!({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
                "metadata": {"name": name, "namespace": "ml"},
                "spec": {"podSets": [{"name": "main", "count": 1, "template": {"spec": {"containers": []}}}]},
                "status": {"admission": {"clusterQueue": "q", "podSetAssignments": [{"name": "main", "count": 1}]},
                    "conditions": [{"type": "QuotaReserved", "status": "True", "lastTransitionTime": reserved}],
                    "admissionChecks": [{"name": "gpufit", "state": state, "message": ""}]}}))
            .unwrap(),
        )
    };
    let now = chrono::DateTime::parse_from_rfc3339("2026-01-01T00:10:00Z")
        .unwrap()
        .with_timezone(&chrono::Utc);
    let ours = ["gpufit".to_string()].into();
    let all = [
        wl("a", "2026-01-01T00:09:00Z", "Pending"),
        wl("b", "2026-01-01T00:00:00Z", "Ready"),
        wl("c", "2026-01-01T00:08:20Z", "Pending"),
    ];
    assert_eq!(oldest_pending(&all, &ours, now), 100.0);
    assert_eq!(
        oldest_pending(&all[1..2], &ours, now),
        0.0,
        "answered: nothing waits"
    );
}

#[test]
fn trainers_torch_runtime_trains_in_the_node_job_the_tests_replay() {
    // Kubeflow Trainer v2.3.0's torch-distributed runtime (tests/fixtures/trainer).
    let path = format!(
        "{}/tests/fixtures/trainer/torch_distributed.yaml",
        env!("CARGO_MANIFEST_DIR")
    );
    let upstream: Value = serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(upstream["apiVersion"], "trainer.kubeflow.org/v1alpha1");
    let node = |rt: &Value| -> Value {
        rt["spec"]["template"]["spec"]["replicatedJobs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| {
                r["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"]
                    == "trainer"
            })
            .cloned()
            .expect("a replicated Job that trains")
    };
    // The runtime the TrainJob tests replay trains where Trainer's does:
    // the Job `node`, its container `node` (where spec.trainer is merged).
    let (ours, theirs) = (node(&training_runtime()), node(&upstream));
    assert_eq!(ours["name"], theirs["name"]);
    assert_eq!(
        ours["template"]["spec"]["template"]["spec"]["containers"][0]["name"],
        theirs["template"]["spec"]["template"]["spec"]["containers"][0]["name"]
    );
    // Its Kueue pod set is named after the replicated Job.
    assert_eq!(theirs["name"], "node");
}

#[tokio::test]
async fn a_trainjob_pod_started_without_gpufits_answer_reads_its_fallback_not_empty_settings() {
    // gpufit's check absent on the flavor (admissionChecksStrategy.onFlavors):
    // Kueue starts the TrainJob without gpufit's annotations. Its pods come
    // from the runtime, so the fallback travels in the trainer's environment.
    let w = World::new();
    let (mut tj, wl_name) = w.submit(TRAINJOB, trainjob("tj", false));
    let counts = [
        ("dataset-initializer", 1),
        ("model-initializer", 1),
        ("node", 2),
    ];
    w.kueue_writes(&wl_name, |wl| {
        wl["status"]["admissionChecks"]
            .as_array_mut()
            .unwrap()
            .retain(|c| c["name"] != "gpufit");
        reserve(wl, "h100-80gb", &counts);
    });
    let fl = flavors(&w);
    let mut started = w.kueue_writes(&wl_name, other_check_ready);
    kueue_start(&mut started, &mut tj, &fl);
    let template = trainer_template(&tj);
    let (raw, _) = container_view(&template);
    assert_eq!(
        raw["GPUFIT_MICRO_BATCH_SIZE"], "",
        "without the pod rule: empty"
    );
    let pod = w.pod_from(&template);
    let env = assert_no_empty_setting(&pod, "TrainJob, no answer");
    let (m, a) = (
        num(&env, "GPUFIT_MICRO_BATCH_SIZE"),
        num(&env, "GPUFIT_GRAD_ACCUM_STEPS"),
    );
    assert_eq!(
        m * a * 8,
        64,
        "the fallback keeps G over the job's W: m {m} × a {a} × 8"
    );
}

#[tokio::test]
async fn a_leader_killed_while_checks_are_pending_is_replaced_within_the_lease() {
    use gpufit::controller::leader::{self, LeaderConfig};
    use gpufit::controller::reconcile::kueue::ANSWER_BUDGET;
    let lease = Duration::from_secs(3);
    let w = World::new();
    let replica = |identity: &str| {
        let (tx, rx) = tokio::sync::watch::channel(false);
        let cfg = LeaderConfig {
            lease_name: "gpufit-controller".into(),
            namespace: "gpufit".into(),
            identity: identity.into(),
            lease_duration: lease,
            renew_every: lease / 3,
        };
        let client = api_server::client(w.api.clone());
        let task = tokio::spawn(leader::run(client, cfg, tx, std::future::pending()));
        let mut ctx = Context::new(
            api_server::client(w.api.clone()),
            w.history.clone(),
            nodes(),
            reflector::store::<Namespace>().0,
            Arc::new(Peaks(1)),
            Metrics::new(),
        );
        ctx.leading = rx;
        let k = Arc::new(KueueContext::new(
            Arc::new(ctx),
            checks("v1beta2"),
            "v1beta2",
        ));
        (task, k)
    };
    // Replica a leads, then dies (no hand-back: a crash).
    let (a_task, a) = replica("a");
    let mut a_leading = a.ctx.leading.clone();
    tokio::time::timeout(Duration::from_secs(10), a_leading.wait_for(|l| *l))
        .await
        .expect("a leads")
        .unwrap();
    a_task.abort();
    // Quota is reserved while nobody answers; replica b starts.
    let (_, wl_name) = w.submit(JOB, batch_job("crash", 2, json!({})));
    w.kueue_writes(&wl_name, |wl| reserve(wl, "h100-80gb", &[("main", 2)]));
    let (_b_task, b) = replica("b");
    let b_world = World { kueue: b, ..w };
    let waited = b_world.answer(&wl_name).await;
    eprintln!(
        "fault matrix: leader killed (Lease {lease:?}), the other replica took over and answered after {:.3} s",
        waited.as_secs_f64()
    );
    assert!(
        waited <= lease + ANSWER_BUDGET + Duration::from_secs(1),
        "{waited:?}"
    );
    assert_eq!(
        check(&b_world.get(&format!("workloads/{wl_name}")), "gpufit")["state"],
        "Ready"
    );
}

#[tokio::test]
async fn the_trainjob_replay_writes_where_kueues_own_test_expects() {
    // Kueue's expected runtimePatches (tests/fixtures/kueue/trainjob-runtime-patch.json).
    let path = format!(
        "{}/tests/fixtures/kueue/trainjob-runtime-patch.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let theirs: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let theirs = &theirs["runtimePatches"][0];
    // The replay's, after an admission gpufit answered.
    let w = World::new();
    let (mut tj, wl_name) = w.submit(TRAINJOB, trainjob("tj", false));
    let counts = [
        ("dataset-initializer", 1),
        ("model-initializer", 1),
        ("node", 2),
    ];
    w.kueue_writes(&wl_name, |wl| reserve(wl, "h100-80gb", &counts));
    w.answer(&wl_name).await;
    let fl = flavors(&w);
    let mut started = w.kueue_writes(&wl_name, other_check_ready);
    kueue_start(&mut started, &mut tj, &fl);
    let ours = tj["spec"]["runtimePatches"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["manager"] == theirs["manager"])
        .expect("Kueue's own runtime patch")
        .clone();
    let node = |p: &Value| -> Value {
        p["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == "node")
            .cloned()
            .expect("the node patch")
    };
    let (ours, theirs) = (node(&ours), node(theirs));
    for ptr in [
        "/template/spec/template/metadata/annotations",
        "/template/spec/template/metadata/labels",
        "/template/spec/template/spec/nodeSelector",
    ] {
        assert!(
            theirs.pointer(ptr).is_some_and(Value::is_object),
            "Kueue writes {ptr}"
        );
        assert!(
            ours.pointer(ptr).is_some_and(Value::is_object),
            "the replay writes {ptr}: {ours:#}"
        );
    }
    assert!(ours
        .pointer("/template/spec/template/metadata/annotations")
        .and_then(|a| a.get(format!("{SETTING_ANNOTATION_PREFIX}micro_batch_size")))
        .is_some());
}

#[test]
fn both_versions_of_kueues_conversion_pair_read_alike() {
    use gpufit::controller::kueue::Workload;
    let path = format!(
        "{}/tests/fixtures/kueue/workload-conversion-pair.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let pair: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let old = Workload::from_json(&pair["v1beta1"]).unwrap();
    let new = Workload::from_json(&pair["v1beta2"]).unwrap();
    assert_eq!(
        old, new,
        "the fields gpufit reads do not change between versions"
    );
    assert_eq!(new.status.conditions[0].type_, "Admitted");
}
