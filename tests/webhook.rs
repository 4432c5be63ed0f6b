//! The mutating admission webhook over real HTTPS on loopback, with a
//! certificate made by rcgen, fed AdmissionReview v1 JSON in the shapes the
//! API server sends; the returned JSON patch is applied and checked.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use gpufit::controller::crd::Mode;
use gpufit::controller::inject::{ANN_APPLIED, ANN_REASON, ANN_RECOMMENDATION};
use gpufit::controller::metrics::Metrics;
use gpufit::controller::webhook::{WebhookConfig, WebhookServer, WebhookState, PATH};
use gpufit::core::advisor::StrategyTargets;
use http_body_util::{BodyExt, Full};
use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::runtime::reflector;
use kube::runtime::watcher;
use serde_json::{json, Value};

struct Webhook {
    addr: SocketAddr,
    metrics: Metrics,
    ca_pem: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    _dir: tempfile::TempDir,
}

impl Drop for Webhook {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

fn gpu_node() -> Node {
    serde_json::from_value(json!({"metadata": {"name": "gpu-1", "labels": {
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.memory": "81920", "nvidia.com/gpu.count": "8"}}}))
    .expect("node")
}

fn namespace(name: &str, mode: Option<&str>) -> Namespace {
    let labels = mode
        .map(|m| json!({"gpufit.io/mode": m}))
        .unwrap_or(json!({}));
    serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}}))
        .expect("namespace")
}

async fn start_webhook() -> Webhook {
    start_webhook_on(vec![gpu_node()]).await
}

async fn start_webhook_on(gpu_nodes: Vec<Node>) -> Webhook {
    let dir = tempfile::tempdir().expect("temp dir");
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("rcgen");
    let cert_path = dir.path().join("tls.crt");
    let key_path = dir.path().join("tls.key");
    std::fs::write(&cert_path, cert.cert.pem()).expect("write cert");
    std::fs::write(&key_path, cert.key_pair.serialize_pem()).expect("write key");

    let history = gpufit::history::open(&format!("sqlite:{}", dir.path().join("h.db").display()))
        .expect("sqlite history");
    let (nodes, mut nw) = reflector::store::<Node>();
    for n in gpu_nodes {
        nw.apply_watcher_event(&watcher::Event::Apply(n));
    }
    let (namespaces, mut nsw) = reflector::store::<Namespace>();
    nsw.apply_watcher_event(&watcher::Event::Apply(namespace("ml", None)));
    nsw.apply_watcher_event(&watcher::Event::Apply(namespace(
        "careful",
        Some("Recommend"),
    )));
    let metrics = Metrics::new();
    let state = Arc::new(WebhookState {
        history: Arc::from(history),
        nodes,
        namespaces,
        metrics: metrics.clone(),
        targets: StrategyTargets::default(),
        default_mode: Mode::Inject,
        cache: Default::default(),
        kueue: Default::default(),
    });
    let server = WebhookServer::bind(&WebhookConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        cert: cert_path,
        key: key_path,
    })
    .await
    .expect("bind webhook");
    let addr = server.local_addr().expect("address");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(server.serve(state, async {
        let _ = rx.await;
    }));
    Webhook {
        addr,
        metrics,
        ca_pem: cert.cert.pem(),
        stop: Some(tx),
        _dir: dir,
    }
}

/// POSTs over HTTPS, trusting only the test certificate; returns status and JSON.
async fn post(w: &Webhook, path: &str, body: &Value) -> (u16, Value) {
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_pemfile::certs(&mut w.ca_pem.as_bytes()) {
        roots.add(c.expect("pem")).expect("trust anchor");
    }
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("tls versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let tcp = tokio::net::TcpStream::connect(w.addr)
        .await
        .expect("connect");
    let name = rustls::pki_types::ServerName::try_from("localhost").expect("name");
    let tls = connector
        .connect(name, tcp)
        .await
        .expect("TLS handshake with the webhook certificate");
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .expect("http handshake");
    tokio::spawn(conn);
    let req = http::Request::post(path)
        .header("host", "localhost")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(body).unwrap())))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(20), sender.send_request(req))
        .await
        .expect("webhook answers in time")
        .expect("response");
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// An AdmissionReview v1 as the API server sends it for a CREATE.
fn review(kind: (&str, &str, &str, &str), ns: &str, object: Value) -> Value {
    let (group, version, k, resource) = kind;
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": group, "version": version, "kind": k},
            "resource": {"group": group, "version": version, "resource": resource},
            "requestKind": {"group": group, "version": version, "kind": k},
            "requestResource": {"group": group, "version": version, "resource": resource},
            "name": object["metadata"]["name"].clone(),
            "namespace": ns,
            "operation": "CREATE",
            "userInfo": {"username": "alice", "uid": "u-1", "groups": ["system:authenticated"]},
            "object": object,
            "oldObject": null,
            "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}
        }
    })
}

const JOB: (&str, &str, &str, &str) = ("batch", "v1", "Job", "jobs");
const PYTORCHJOB: (&str, &str, &str, &str) = ("kubeflow.org", "v1", "PyTorchJob", "pytorchjobs");
const JOBSET: (&str, &str, &str, &str) = ("jobset.x-k8s.io", "v1alpha2", "JobSet", "jobsets");
const TRAINJOB: (&str, &str, &str, &str) =
    ("trainer.kubeflow.org", "v1alpha1", "TrainJob", "trainjobs");

fn job(annotations: Value) -> Value {
    json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "finetune", "namespace": "ml", "annotations": annotations},
        "spec": {"backoffLimit": 0, "template": {"spec": {
            "restartPolicy": "Never",
            "containers": [{
                "name": "train", "image": "ghcr.io/acme/train:1",
                "args": ["--batch-size={micro_batch_size}", "--grad-accum={gradient_accumulation_steps}", "--lr=2e-4", "--seed=7"],
                "env": [{"name": "WANDB_PROJECT", "value": "x"}],
                "resources": {"limits": {"nvidia.com/gpu": "1"}}
            }]
        }}}
    })
}

fn lora_annotations() -> Value {
    json!({
        "gpufit.io/model": "meta-llama/Llama-3.1-8B",
        "gpufit.io/method": "lora",
        "gpufit.io/lora-rank": "16",
        "gpufit.io/seq-len": "2048",
        "gpufit.io/global-batch": "32"
    })
}

/// Decodes the base64 JSON patch of a response and applies it.
fn apply_patch(original: &Value, response: &Value) -> Value {
    assert_eq!(response["response"]["patchType"], "JSONPatch");
    let b64 = response["response"]["patch"]
        .as_str()
        .expect("patch is a base64 string");
    let bytes = decode_b64(b64);
    let patch: json_patch::Patch = serde_json::from_slice(&bytes).expect("a JSON patch");
    let mut doc = original.clone();
    json_patch::patch(&mut doc, &patch).expect("the patch applies to the object");
    doc
}

fn decode_b64(s: &str) -> Vec<u8> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => (c - b'A') as u32,
            b'a'..=b'z' => (c - b'a' + 26) as u32,
            b'0'..=b'9' => (c - b'0' + 52) as u32,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    let mut out = Vec::new();
    for chunk in s.as_bytes().chunks(4) {
        let pad = chunk.iter().filter(|&&c| c == b'=').count();
        let mut n = 0u32;
        for &c in chunk {
            n = (n << 6) | if c == b'=' { 0 } else { val(c) };
        }
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..3 - pad]);
    }
    out
}

fn env(pod_template: &Value, container: usize) -> std::collections::BTreeMap<String, String> {
    env_of(&pod_template["spec"]["containers"][container])
}

/// The plain-value variables of a container (or a TrainJob's trainer).
fn env_of(container: &Value) -> std::collections::BTreeMap<String, String> {
    container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            (
                e["name"].as_str().unwrap().to_string(),
                e["value"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

#[tokio::test]
async fn an_opted_in_job_gets_the_settings_through_a_json_patch() {
    let w = start_webhook().await;
    let obj = job(lora_annotations());
    let (status, resp) = post(&w, PATH, &review(JOB, "ml", obj.clone())).await;
    assert_eq!(status, 200);
    assert_eq!(resp["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(resp["kind"], "AdmissionReview");
    assert_eq!(
        resp["response"]["uid"],
        "705ab4f5-6393-11e8-b7cc-42010a800002"
    );
    assert_eq!(resp["response"]["allowed"], true, "{resp}");

    let out = apply_patch(&obj, &resp);
    let t = &out["spec"]["template"];
    let e = env(t, 0);
    let m: u32 = e["GPUFIT_MICRO_BATCH_SIZE"].parse().expect("micro batch");
    let a: u32 = e["GPUFIT_GRAD_ACCUM_STEPS"].parse().expect("accumulation");
    assert_eq!(m * a, 32, "the global batch of 32 on 1 GPU is kept");
    assert!(
        e.contains_key("GPUFIT_DTYPE")
            && e.contains_key("GPUFIT_ACTIVATION_CHECKPOINTING")
            && e.contains_key("GPUFIT_COMPILE")
    );
    assert_eq!(e["WANDB_PROJECT"], "x", "the user's variables are kept");
    let args = t["spec"]["containers"][0]["args"].as_array().unwrap();
    assert_eq!(args[0], format!("--batch-size={m}"));
    assert_eq!(args[1], format!("--grad-accum={a}"));
    assert_eq!(args[2], "--lr=2e-4", "scientific args untouched");
    assert_eq!(args[3], "--seed=7");
    let anns = &out["metadata"]["annotations"];
    let applied: Value =
        serde_json::from_str(anns[ANN_APPLIED].as_str().expect("applied annotation")).unwrap();
    assert_eq!(applied["settings"]["microBatchSize"], m);
    assert!(!anns[ANN_REASON].as_str().unwrap().is_empty());
    assert_eq!(
        anns["gpufit.io/model"], "meta-llama/Llama-3.1-8B",
        "the user's annotations stay"
    );
}

#[tokio::test]
async fn a_job_without_gpufit_annotations_is_allowed_untouched() {
    let w = start_webhook().await;
    let (status, resp) = post(&w, PATH, &review(JOB, "ml", job(json!({"team": "nlp"})))).await;
    assert_eq!(status, 200);
    assert_eq!(resp["response"]["allowed"], true);
    assert!(resp["response"].get("patch").is_none(), "no patch: {resp}");
    assert!(resp["response"].get("patchType").is_none());
}

#[tokio::test]
async fn a_job_gpufit_already_set_up_is_left_alone() {
    let w = start_webhook().await;
    let mut anns = lora_annotations();
    anns[ANN_APPLIED] = json!("{\"settings\":{}}");
    let (_, resp) = post(&w, PATH, &review(JOB, "ml", job(anns))).await;
    assert_eq!(resp["response"]["allowed"], true);
    assert!(resp["response"].get("patch").is_none());
}

#[tokio::test]
async fn a_bad_annotation_value_is_denied_with_a_message_naming_it() {
    let w = start_webhook().await;
    let mut anns = lora_annotations();
    anns["gpufit.io/seq-len"] = json!("two thousand");
    let (status, resp) = post(&w, PATH, &review(JOB, "ml", job(anns))).await;
    assert_eq!(status, 200);
    assert_eq!(resp["response"]["allowed"], false);
    let msg = resp["response"]["status"]["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("gpufit.io/seq-len") && msg.contains("two thousand"),
        "{msg}"
    );
}

#[tokio::test]
async fn a_misspelt_gpufit_annotation_is_denied_not_ignored() {
    let w = start_webhook().await;
    let mut anns = lora_annotations();
    anns["gpufit.io/seqlen"] = json!("2048");
    let (_, resp) = post(&w, PATH, &review(JOB, "ml", job(anns))).await;
    assert_eq!(resp["response"]["allowed"], false);
    let msg = resp["response"]["status"]["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("gpufit.io/seqlen") && msg.contains("unknown"),
        "{msg}"
    );
}

#[tokio::test]
async fn contradictory_annotations_are_denied() {
    let w = start_webhook().await;
    let mut anns = lora_annotations();
    anns["gpufit.io/method"] = json!("full");
    let (_, resp) = post(&w, PATH, &review(JOB, "ml", job(anns))).await;
    assert_eq!(resp["response"]["allowed"], false);
    let msg = resp["response"]["status"]["message"].as_str().unwrap_or("");
    assert!(msg.contains("gpufit.io/lora-rank"), "{msg}");
}

#[tokio::test]
async fn a_global_batch_the_pinned_micro_batch_cannot_keep_is_denied_with_the_valid_choices() {
    let w = start_webhook().await;
    let mut anns = lora_annotations();
    anns["gpufit.io/pins"] = json!("micro_batch_size=3");
    let (_, resp) = post(&w, PATH, &review(JOB, "ml", job(anns))).await;
    assert_eq!(resp["response"]["allowed"], false, "{resp}");
    let msg = resp["response"]["status"]["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("global batch 32") && msg.contains("microBatchSize"),
        "{msg}"
    );
}

#[tokio::test]
async fn a_pinned_micro_batch_in_annotations_is_kept() {
    let w = start_webhook().await;
    let mut anns = lora_annotations();
    anns["gpufit.io/pins"] = json!("micro_batch_size=2");
    let obj = job(anns);
    let (_, resp) = post(&w, PATH, &review(JOB, "ml", obj.clone())).await;
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    let out = apply_patch(&obj, &resp);
    let e = env(&out["spec"]["template"], 0);
    assert_eq!(e["GPUFIT_MICRO_BATCH_SIZE"], "2");
    assert_eq!(e["GPUFIT_GRAD_ACCUM_STEPS"], "16");
}

#[tokio::test]
async fn every_rank_of_a_pytorchjob_gets_the_same_settings() {
    let w = start_webhook().await;
    let pod = |name: &str| {
        json!({"spec": {"containers": [{"name": name, "image": "train:1",
        "args": ["--micro-batch", "{micro_batch_size}"], "resources": {"limits": {"nvidia.com/gpu": 1}}}]}})
    };
    let mut anns = lora_annotations();
    anns["gpufit.io/global-batch"] = json!("64");
    let obj = json!({
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": {"name": "ddp", "namespace": "ml", "annotations": anns},
        "spec": {"pytorchReplicaSpecs": {
            "Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": pod("pytorch")},
            "Worker": {"replicas": 3, "restartPolicy": "OnFailure", "template": pod("pytorch")}
        }}
    });
    let (_, resp) = post(&w, PATH, &review(PYTORCHJOB, "ml", obj.clone())).await;
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    let out = apply_patch(&obj, &resp);
    let master = env(&out["spec"]["pytorchReplicaSpecs"]["Master"]["template"], 0);
    let worker = env(&out["spec"]["pytorchReplicaSpecs"]["Worker"]["template"], 0);
    assert_eq!(master, worker, "all ranks get the same settings");
    let m: u32 = master["GPUFIT_MICRO_BATCH_SIZE"].parse().unwrap();
    let a: u32 = master["GPUFIT_GRAD_ACCUM_STEPS"].parse().unwrap();
    assert_eq!(
        m * a * 4,
        64,
        "4 data-parallel ranks keep the global batch of 64"
    );
    assert_eq!(
        out["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["args"]
            [1],
        m.to_string()
    );
}

#[tokio::test]
async fn in_a_recommend_namespace_only_an_annotation_is_added() {
    let w = start_webhook().await;
    let obj = job(lora_annotations());
    let (_, resp) = post(&w, PATH, &review(JOB, "careful", obj.clone())).await;
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    let out = apply_patch(&obj, &resp);
    assert!(out["metadata"]["annotations"][ANN_RECOMMENDATION].is_string());
    assert_eq!(
        out["spec"]["template"]["spec"]["containers"],
        obj["spec"]["template"]["spec"]["containers"],
        "containers unchanged"
    );
}

#[tokio::test]
async fn updates_are_allowed_untouched() {
    let w = start_webhook().await;
    let mut r = review(JOB, "ml", job(lora_annotations()));
    r["request"]["operation"] = json!("UPDATE");
    r["request"]["oldObject"] = r["request"]["object"].clone();
    let (_, resp) = post(&w, PATH, &r).await;
    assert_eq!(resp["response"]["allowed"], true);
    assert!(resp["response"].get("patch").is_none());
}

#[tokio::test]
async fn a_body_that_is_not_an_admission_review_is_refused_without_crashing() {
    let w = start_webhook().await;
    let (status, resp) = post(&w, PATH, &json!({"hello": "world"})).await;
    assert_eq!(status, 200);
    assert_eq!(resp["response"]["allowed"], false);
    // The server is still up.
    let (_, again) = post(&w, PATH, &review(JOB, "ml", job(json!({})))).await;
    assert_eq!(again["response"]["allowed"], true);
}

#[tokio::test]
async fn metrics_health_and_readiness_are_served_and_count_admissions() {
    use gpufit::controller::metrics::{bind, Health, Routes};
    use std::sync::atomic::Ordering;
    let w = start_webhook().await;
    let (_, resp) = post(&w, PATH, &review(JOB, "ml", job(lora_annotations()))).await;
    assert_eq!(resp["response"]["allowed"], true);
    let (_, resp) = post(&w, PATH, &review(JOB, "ml", job(json!({})))).await;
    assert_eq!(resp["response"]["allowed"], true);

    let health = Arc::new(Health::default());
    let listener = bind("127.0.0.1:0".parse().unwrap()).await.expect("bind");
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let routes = Routes {
        metrics: w.metrics.clone(),
        health: health.clone(),
        api: None,
    };
    tokio::spawn(routes.serve(listener, async {
        let _ = rx.await;
    }));
    let get = |path: &'static str| {
        let url = format!("http://{addr}{path}");
        tokio::task::spawn_blocking(move || {
            match ureq::get(&url).timeout(Duration::from_secs(5)).call() {
                Ok(r) => (r.status(), r.into_string().unwrap_or_default()),
                Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap_or_default()),
                Err(e) => panic!("GET {url}: {e}"),
            }
        })
    };
    assert_eq!(get("/healthz").await.unwrap().0, 200);
    assert_eq!(
        get("/readyz").await.unwrap().0,
        503,
        "not ready before the caches are filled"
    );
    health.ready.store(true, Ordering::Relaxed);
    assert_eq!(get("/readyz").await.unwrap().0, 200);
    let (code, text) = get("/metrics").await.unwrap();
    assert_eq!(code, 200);
    assert!(
        text.contains(r#"gpufit_webhook_requests_total{kind="Job",result="mutated"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"gpufit_webhook_requests_total{kind="Job",result="untouched"} 1"#),
        "{text}"
    );
    assert!(
        text.contains("gpufit_controller_reconcile_duration_seconds"),
        "{text}"
    );
    // The webhook's suggestion is counted, labelled with its path.
    assert!(
        text.lines()
            .any(|l| l.starts_with("gpufit_controller_suggestions_total")
                && l.contains(r#"path="webhook""#)
                && l.ends_with(" 1")),
        "{text}"
    );
    let _ = tx.send(());
}

/// The micro batch and accumulation steps a container was given.
fn batch_of(env: &std::collections::BTreeMap<String, String>) -> (u32, u32) {
    let m = env["GPUFIT_MICRO_BATCH_SIZE"].parse().expect("micro batch");
    let a = env["GPUFIT_GRAD_ACCUM_STEPS"]
        .parse()
        .expect("accumulation");
    (m, a)
}

/// A JobSet as a user writes it (a leader job and a worker job, 8 GPUs a
/// pod), with what the API server's CRD defaulting adds before admission
/// (`groupName: default`).
fn jobset(annotations: Value) -> Value {
    let job = |replicas: u32, parallelism: u32| {
        json!({
            "replicas": replicas,
            "groupName": "default",
            "template": {"spec": {
                "parallelism": parallelism, "completions": parallelism, "backoffLimit": 0,
                "template": {"spec": {
                    "restartPolicy": "Never",
                    "containers": [{
                        "name": "trainer", "image": "ghcr.io/acme/train:1",
                        "command": ["torchrun", "--nproc-per-node=8", "train.py",
                                    "--micro-batch={micro_batch_size}", "--accum={gradient_accumulation_steps}"],
                        "env": [{"name": "HF_HOME", "value": "/cache"}],
                        "resources": {"limits": {"nvidia.com/gpu": "8"}}
                    }]
                }}
            }}
        })
    };
    let mut leader = job(1, 1);
    leader["name"] = json!("leader");
    let mut workers = job(2, 2);
    workers["name"] = json!("workers");
    json!({
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "llama-ft", "namespace": "ml",
                     "labels": {"gpufit.io/inject": "true"}, "annotations": annotations},
        "spec": {
            "failurePolicy": {"maxRestarts": 0, "restartStrategy": "Recreate"},
            "replicatedJobs": [leader, workers]
        }
    })
}

/// A Kubeflow Trainer v2 TrainJob as a user writes it, with what the CRD
/// defaulting adds (runtimeRef apiGroup/kind, suspend, managedBy).
fn trainjob(annotations: Value, trainer: Value) -> Value {
    json!({
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": "llama-ft", "namespace": "ml",
                     "labels": {"gpufit.io/inject": "true"}, "annotations": annotations},
        "spec": {
            "runtimeRef": {"name": "torch-distributed", "apiGroup": "trainer.kubeflow.org",
                           "kind": "ClusterTrainingRuntime"},
            "trainer": trainer,
            "suspend": false,
            "managedBy": "trainer.kubeflow.org/trainjob-controller"
        }
    })
}

#[tokio::test]
async fn every_training_container_of_a_jobset_gets_the_same_settings_for_all_its_gpus() {
    let w = start_webhook().await;
    let mut anns = lora_annotations();
    // W = 1 × 1 × 8 (leader) + 2 replicas × 2 pods × 8 (workers) = 40.
    anns["gpufit.io/global-batch"] = json!("160");
    let obj = jobset(anns);
    let (status, resp) = post(&w, PATH, &review(JOBSET, "ml", obj.clone())).await;
    assert_eq!(status, 200);
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    let out = apply_patch(&obj, &resp);
    let leader = &out["spec"]["replicatedJobs"][0]["template"]["spec"]["template"];
    let workers = &out["spec"]["replicatedJobs"][1]["template"]["spec"]["template"];
    let (le, we) = (env(leader, 0), env(workers, 0));
    assert_eq!(le, we, "every training template gets the same settings");
    let (m, a) = batch_of(&le);
    assert_eq!(m * a * 40, 160, "m × a × W = G over all 40 GPUs");
    assert_eq!(le["HF_HOME"], "/cache", "the user's variables are kept");
    let cmd = workers["spec"]["containers"][0]["command"]
        .as_array()
        .unwrap();
    assert_eq!(cmd[3], format!("--micro-batch={m}"));
    assert_eq!(cmd[4], format!("--accum={a}"));
    for t in [leader, workers] {
        assert!(t["metadata"]["annotations"][ANN_APPLIED].is_string(), "{t}");
    }
    let applied: Value = serde_json::from_str(
        out["metadata"]["annotations"][ANN_APPLIED]
            .as_str()
            .expect("applied annotation on the JobSet"),
    )
    .unwrap();
    assert_eq!(applied["settings"]["microBatchSize"], m);
    assert_eq!(
        out["spec"]["replicatedJobs"][1]["replicas"], 2,
        "shape untouched"
    );
}

#[tokio::test]
async fn a_trainjob_gets_the_settings_on_its_trainer_for_num_nodes_times_gpus_per_node() {
    let w = start_webhook().await;
    let mut anns = lora_annotations();
    anns["gpufit.io/global-batch"] = json!("64");
    let obj = trainjob(
        anns,
        json!({
            "image": "ghcr.io/acme/train:1",
            "command": ["torchrun", "train.py", "--micro-batch={micro_batch_size}"],
            "env": [{"name": "HF_HOME", "value": "/cache"}],
            "numNodes": 2,
            "resourcesPerNode": {"limits": {"nvidia.com/gpu": "4"}}
        }),
    );
    let (_, resp) = post(&w, PATH, &review(TRAINJOB, "ml", obj.clone())).await;
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    let out = apply_patch(&obj, &resp);
    let trainer = &out["spec"]["trainer"];
    let e = env_of(trainer);
    let (m, a) = batch_of(&e);
    assert_eq!(m * a * 8, 64, "m × a × W = G over 2 nodes × 4 GPUs");
    assert_eq!(e["HF_HOME"], "/cache");
    assert_eq!(trainer["command"][2], format!("--micro-batch={m}"));
    let names: Vec<&str> = trainer["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert!(names.contains(&"GPUFIT_POD_NAME"), "{names:?}");
    assert_eq!(trainer["numNodes"], 2, "shape untouched");
    assert!(out["metadata"]["annotations"][ANN_APPLIED].is_string());
}

#[tokio::test]
async fn a_trainjob_whose_runtime_decides_the_gpus_is_allowed_unchanged_with_a_warning() {
    let w = start_webhook().await;
    let obj = trainjob(lora_annotations(), json!({"numNodes": 2}));
    let (_, resp) = post(&w, PATH, &review(TRAINJOB, "ml", obj.clone())).await;
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    assert!(resp["response"].get("patch").is_none(), "{resp}");
    let warning = resp["response"]["warnings"][0].as_str().unwrap_or("");
    assert!(warning.contains("gpufit.io/gpus"), "{warning}");

    // With the GPUs annotated, the trainer gets the settings (env created).
    let mut anns = lora_annotations();
    anns["gpufit.io/gpus"] = json!("8");
    let obj = trainjob(anns, json!({"numNodes": 2}));
    let (_, resp) = post(&w, PATH, &review(TRAINJOB, "ml", obj.clone())).await;
    let out = apply_patch(&obj, &resp);
    let e = env_of(&out["spec"]["trainer"]);
    let (m, a) = batch_of(&e);
    assert_eq!(m * a * 8, 32);
}

#[tokio::test]
async fn a_kind_gpufit_cannot_configure_is_allowed_with_a_warning_but_a_bad_annotation_is_denied() {
    let w = start_webhook().await;
    let rayjob = |anns: Value| {
        json!({"apiVersion": "ray.io/v1", "kind": "RayJob",
               "metadata": {"name": "r", "namespace": "ml", "annotations": anns},
               "spec": {"entrypoint": "python train.py"}})
    };
    let kind = ("ray.io", "v1", "RayJob", "rayjobs");
    let (_, resp) = post(&w, PATH, &review(kind, "ml", rayjob(lora_annotations()))).await;
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    assert!(resp["response"].get("patch").is_none());
    let warning = resp["response"]["warnings"][0].as_str().unwrap_or("");
    assert!(warning.contains("RayJob"), "{warning}");

    let mut bad = lora_annotations();
    bad["gpufit.io/seq-len"] = json!("long");
    for (kind, obj) in [(kind, rayjob(bad.clone())), (JOBSET, jobset(bad.clone()))] {
        let (_, resp) = post(&w, PATH, &review(kind, "ml", obj)).await;
        assert_eq!(resp["response"]["allowed"], false, "{resp}");
        let msg = resp["response"]["status"]["message"].as_str().unwrap_or("");
        assert!(msg.contains("gpufit.io/seq-len"), "{msg}");
    }
}

/// A pod asking for MIG slices (`nvidia.com/mig-<profile>`, the `mixed`
/// strategy) counts them as GPUs: 2 slices per pod × parallelism 2 are 4
/// data-parallel ranks, so m × a × 4 = the global batch of 32.
#[tokio::test]
async fn mig_slices_a_pod_asks_for_count_as_its_gpus() {
    let w = start_webhook().await;
    let mut anns = lora_annotations();
    anns["gpufit.io/gpu"] = json!("NVIDIA A100-SXM4-80GB MIG 3g.40gb");
    let mut obj = job(anns);
    obj["spec"]["parallelism"] = json!(2);
    obj["spec"]["template"]["spec"]["containers"][0]["resources"] =
        json!({"limits": {"nvidia.com/mig-3g.40gb": "2"}});
    let (_, resp) = post(&w, PATH, &review(JOB, "ml", obj.clone())).await;
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    let out = apply_patch(&obj, &resp);
    let e = env(&out["spec"]["template"], 0);
    let m: u32 = e["GPUFIT_MICRO_BATCH_SIZE"].parse().expect("micro batch");
    let a: u32 = e["GPUFIT_GRAD_ACCUM_STEPS"].parse().expect("accumulation");
    assert_eq!(m * a * 4, 32, "4 slices in all");
    let reason = out["metadata"]["annotations"][ANN_REASON].as_str().unwrap();
    assert!(reason.contains("MIG 3g.40gb"), "{reason}");
}

#[tokio::test]
async fn a_bad_gpu_sharing_annotation_is_denied_and_a_good_one_accepted() {
    let w = start_webhook().await;
    let mut anns = lora_annotations();
    anns["gpufit.io/gpu-sharing"] = json!("half");
    let (_, resp) = post(&w, PATH, &review(JOB, "ml", job(anns.clone()))).await;
    assert_eq!(resp["response"]["allowed"], false);
    let msg = resp["response"]["status"]["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("gpufit.io/gpu-sharing") && msg.contains("half"),
        "{msg}"
    );
    anns["gpufit.io/gpu-sharing"] = json!("whole");
    let (_, resp) = post(&w, PATH, &review(JOB, "ml", job(anns))).await;
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    assert!(resp["response"]["patch"].is_string(), "mutated: {resp}");
}

/// Data-loader workers follow the CPUs the pod has per GPU, not the
/// webhook's host: 2 CPUs for its one GPU → at most 2 workers.
#[tokio::test]
async fn a_pod_with_two_cpus_per_gpu_gets_at_most_two_workers() {
    let w = start_webhook().await;
    let mut obj = job(lora_annotations());
    obj["spec"]["template"]["spec"]["containers"][0]["resources"] =
        json!({"limits": {"nvidia.com/gpu": "1", "cpu": "2"}, "requests": {"cpu": "2"}});
    let (_, resp) = post(&w, PATH, &review(JOB, "ml", obj.clone())).await;
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    let e = env(&apply_patch(&obj, &resp)["spec"]["template"], 0);
    let workers: u32 = e["GPUFIT_DATALOADER_NUM_WORKERS"].parse().expect("workers");
    assert!(workers <= 2, "{workers} workers for 2 CPUs");
}

/// Acceptance (issue 46): on a node sharing each A100 80GB ten ways through
/// MPS, a job asking `gpufit.io/gpu-sharing=whole` is planned for the 8 GiB
/// the MPS daemon lets it use, and the admission response warns why.
#[tokio::test]
async fn whole_on_an_mps_node_is_planned_for_the_share_with_a_warning() {
    let mps: Node = serde_json::from_value(json!({"metadata": {"name": "mps-1", "labels": {
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB-SHARED", "nvidia.com/gpu.memory": "81920",
        "nvidia.com/gpu.count": "8", "nvidia.com/gpu.replicas": "10",
        "nvidia.com/gpu.sharing-strategy": "mps"}}}))
    .expect("node");
    let w = start_webhook_on(vec![mps]).await;
    let mut anns = lora_annotations();
    anns["gpufit.io/gpu-sharing"] = json!("whole");
    // An 8B model does not fit 8 GiB: the warning still says why it is 8 GiB.
    let (_, resp) = post(&w, PATH, &review(JOB, "ml", job(anns.clone()))).await;
    let warnings = resp["response"]["warnings"].to_string();
    assert!(
        warnings.contains("does not fit") && warnings.contains("MPS daemon caps"),
        "{resp}"
    );
    anns["gpufit.io/model"] = json!("Qwen/Qwen2.5-0.5B");
    anns["gpufit.io/seq-len"] = json!("512");
    let obj = job(anns);
    let (_, resp) = post(&w, PATH, &review(JOB, "ml", obj.clone())).await;
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    let warnings = resp["response"]["warnings"].to_string();
    assert!(
        warnings.contains("gpufit.io/gpu-sharing=whole ignored") && warnings.contains("MPS"),
        "{resp}"
    );
    let out = apply_patch(&obj, &resp);
    let reason = out["metadata"]["annotations"][ANN_REASON]
        .as_str()
        .unwrap_or("");
    assert!(reason.contains("MPS-shared by 10"), "{reason}");
    let applied: Value = serde_json::from_str(
        out["metadata"]["annotations"][ANN_APPLIED]
            .as_str()
            .unwrap_or("{}"),
    )
    .expect("applied JSON");
    assert!(
        applied["gpu"]
            .as_str()
            .unwrap_or("")
            .contains("MPS-shared by 10"),
        "{applied}"
    );
    let peak = applied["predictedPeakBytes"].as_u64().unwrap_or(u64::MAX);
    assert!(peak <= 8 << 30, "planned within 8 GiB: {peak}");
}

// === What the webhook mutates, and what it reads (issue 47.6) ===

/// The response's warnings, joined.
fn warnings(resp: &Value) -> String {
    resp["response"]["warnings"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect::<Vec<_>>()
        .join(" | ")
}

#[tokio::test]
async fn a_deployment_is_never_mutated_though_it_has_a_pod_template() {
    let w = start_webhook().await;
    let mut d = job(lora_annotations());
    d["apiVersion"] = json!("apps/v1");
    d["kind"] = json!("Deployment");
    let kind = ("apps", "v1", "Deployment", "deployments");
    let (_, resp) = post(&w, PATH, &review(kind, "ml", d)).await;
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    assert!(resp["response"].get("patch").is_none(), "{resp}");
    assert!(warnings(&resp).contains("Deployment"), "{resp}");
    // A `Job` of another API group is not a batch Job either.
    let (_, resp) = post(
        &w,
        PATH,
        &review(
            ("example.com", "v1", "Job", "jobs"),
            "ml",
            job(lora_annotations()),
        ),
    )
    .await;
    assert!(resp["response"].get("patch").is_none(), "{resp}");
}

#[tokio::test]
async fn gpu_counts_are_read_as_kubernetes_quantities_and_bad_ones_are_named() {
    let w = start_webhook().await;
    for bad in ["two", "-2", "1.5"] {
        let mut j = job(lora_annotations());
        j["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] =
            json!(bad);
        let (_, resp) = post(&w, PATH, &review(JOB, "ml", j)).await;
        assert_eq!(resp["response"]["allowed"], true, "{bad}: {resp}");
        assert!(
            resp["response"].get("patch").is_none(),
            "{bad}: not W = 1 silently: {resp}"
        );
        let warned = warnings(&resp);
        assert!(
            warned.contains(&format!("`{bad}`")) && warned.contains("nvidia.com/gpu"),
            "{bad}: {warned}"
        );
    }
    // "2k" is a valid quantity: 2000 GPUs per pod, which the global batch
    // of 32 cannot be split over: allowed unchanged, saying what it saw.
    let mut j = job(lora_annotations());
    j["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] =
        json!("2k");
    let (_, resp) = post(&w, PATH, &review(JOB, "ml", j)).await;
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    assert!(warnings(&resp).contains("2000"), "{resp}");
}

#[tokio::test]
async fn a_shape_that_makes_the_global_batch_impossible_is_a_warning_not_a_denial() {
    let w = start_webhook().await;
    let mut j = job(lora_annotations());
    j["spec"]["parallelism"] = json!(1_000_000_000u64);
    let (_, resp) = post(&w, PATH, &review(JOB, "ml", j.clone())).await;
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    assert!(resp["response"].get("patch").is_none());
    let warned = warnings(&resp);
    assert!(
        warned.contains("1000000000") && warned.contains("global-batch 32"),
        "{warned}"
    );
    // The same W from the user's own gpufit.io/gpus: that annotation is at fault.
    let mut anns = lora_annotations();
    anns["gpufit.io/gpus"] = json!("1000000000");
    j["metadata"]["annotations"] = anns;
    let (_, resp) = post(&w, PATH, &review(JOB, "ml", j)).await;
    assert_eq!(resp["response"]["allowed"], false, "{resp}");
    let msg = resp["response"]["status"]["message"].as_str().unwrap_or("");
    assert!(msg.contains("gpufit.io/gpus"), "{msg}");
}

#[tokio::test]
async fn settings_the_history_would_refuse_are_never_injected() {
    let w = start_webhook().await;
    let mut anns = lora_annotations();
    anns["gpufit.io/global-batch"] = json!("2147483648");
    let (_, resp) = post(&w, PATH, &review(JOB, "ml", job(anns))).await;
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    assert!(
        resp["response"].get("patch").is_none(),
        "an accumulation of ~10^9 injected: {resp}"
    );
    assert!(warnings(&resp).contains("65536"), "{resp}");
}

#[tokio::test]
async fn a_pin_given_twice_is_denied_naming_the_annotation() {
    let w = start_webhook().await;
    let mut anns = lora_annotations();
    anns["gpufit.io/pins"] = json!("micro_batch_size=2,micro_batch_size=8");
    let (_, resp) = post(&w, PATH, &review(JOB, "ml", job(anns))).await;
    assert_eq!(resp["response"]["allowed"], false, "{resp}");
    let msg = resp["response"]["status"]["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("gpufit.io/pins") && msg.contains("micro_batch_size"),
        "{msg}"
    );
}
