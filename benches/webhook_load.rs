//! Load test of the admission webhook: HTTPS on loopback, a SQLite history
//! of 1,000,000 runs, an open-loop load generator at a fixed rate (latency is
//! measured from each request's *scheduled* send time, so a slow server
//! cannot hide its queueing — no coordinated omission).
//!
//! Run: `cargo bench --bench webhook_load`
//! Options (environment): `GPUFIT_BENCH_RATE` (requests/s, default 500),
//! `GPUFIT_BENCH_SECONDS` (default 20), `GPUFIT_BENCH_RECORDS` (default
//! 1000000), `GPUFIT_BENCH_DB` (history file, default
//! `target/bench-data/webhook-<records>.db`, reused when complete).
//!
//! Prints p50/p90/p99/max latency and errors for the 1M-record history and,
//! in the same run, for an empty history, with the ratio of the two p99s.

use gpufit::core::run::RunOutcome;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use gpufit::controller::crd::Mode;
use gpufit::controller::metrics::Metrics;
use gpufit::controller::webhook::{WebhookConfig, WebhookServer, WebhookState, PATH};
use gpufit::core::advisor::StrategyTargets;
use gpufit::core::run::{RunRecord, RunResult, RunSource};
use gpufit::core::settings::{DataLoaderSettings, Dtype, EngineeringSettings};
use gpufit::core::workload::Method;
use gpufit::history::{HistoryError, HistoryStore};
use http_body_util::{BodyExt, Full};
use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::runtime::{reflector, watcher};
use serde_json::{json, Value};

const TARGET_MODEL: &str = "meta-llama/Llama-3.1-8B";
const TARGET_GPU: &str = "NVIDIA A100-SXM4-80GB";
const CONNECTIONS: usize = 64;

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Deterministic xorshift, so every run builds the same history.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// One synthetic run. About 1 in 2500 is the benchmark's own key (model,
/// method, GPU, sequence length), so the webhook's similarity query returns
/// a realistic few hundred runs out of the million.
fn synthetic_run(i: u64, rng: &mut Rng, canonical: &str) -> RunRecord {
    let own = i.is_multiple_of(2500);
    let r = rng.next();
    let micro = 1 + (r % 16) as u32;
    let oom = own && micro > 12;
    let (model, gpu, seq) = if own {
        (canonical.to_string(), TARGET_GPU.to_string(), 2048)
    } else {
        (
            format!("org-{}/model-{}", r % 97, (r >> 8) % 211),
            [
                "NVIDIA H100 80GB HBM3",
                "NVIDIA A100-SXM4-40GB",
                "NVIDIA L4",
                "Tesla T4",
            ][(r >> 20) as usize % 4]
                .to_string(),
            [512, 1024, 2048, 4096, 8192][(r >> 24) as usize % 5],
        )
    };
    // 16 GiB + 3 GiB per sample on the benchmark's card; on the others the
    // same line scaled to their memory, which the store requires (it
    // refuses a peak above the GPU's memory)
    let line = (16u64 << 30) + micro as u64 * (3u64 << 30);
    let peak = if own {
        line
    } else {
        let card = gpufit::core::catalog::lookup_gpu(&gpu)
            .map(|g| g.memory_bytes)
            .expect("bench GPU in the catalog");
        (card as f64 * (0.2 + 0.045 * micro as f64)) as u64
    };
    RunRecord {
        confirmation: Default::default(),
        nodes: None,
        id: None,
        timestamp: chrono::Utc::now(),
        cluster: Some("bench".into()),
        node: Some(format!("gpu-{}", r % 64)),
        source: RunSource::Kubernetes,
        job_id: Some(format!("ns/job-{i}")),
        model,
        method: Method::Lora,
        gpu_model: gpu,
        seq_len: seq,
        lora_rank: Some(16),
        gpus: 1,
        global_batch: None,
        settings: EngineeringSettings {
            micro_batch_size: micro,
            gradient_accumulation_steps: 1,
            dtype: Dtype::Bf16,
            activation_checkpointing: true,
            activation_offloading: false,
            compile: false,
            dataloader: DataLoaderSettings::default(),
        },
        result: RunResult {
            outcome: RunOutcome::of(!oom, oom, false),
            peak_memory_bytes: (!oom).then_some(peak),
            samples_per_sec: Some(10.0 + micro as f64),
            tokens_per_sec: None,
            duration_sec: Some(600.0),
        },
        predicted_peak_bytes: Some(peak),
    }
}

fn build_history(path: &Path, records: u64, canonical: &str) -> Box<dyn HistoryStore> {
    let url = format!("sqlite:{}", path.display());
    let store = gpufit::history::open(&url).expect("open the SQLite history");
    let have = store.count().expect("count");
    if have == records {
        eprintln!("reusing {} ({have} runs)", path.display());
        return store;
    }
    drop(store);
    let _ = std::fs::remove_file(path);
    let store = gpufit::history::open(&url).expect("create the SQLite history");
    let start = Instant::now();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut done = 0u64;
    while done < records {
        let n = (records - done).min(50_000);
        let mut it =
            (done..done + n).map(|i| Ok::<_, HistoryError>(synthetic_run(i, &mut rng, canonical)));
        store.record_batch(&mut it).expect("insert runs");
        done += n;
    }
    eprintln!(
        "built {} with {records} runs in {:.1?}",
        path.display(),
        start.elapsed()
    );
    store
}

/// Where one request's time goes: the history query versus the advisor,
/// each timed alone (median of 50) on the same history.
fn split_costs(store: &dyn HistoryStore) {
    use gpufit::controller::crd::WorkloadSpec;
    use gpufit::controller::validate::workload_from_spec;
    use gpufit::core::advisor::{suggest, AdviceRequest, Strategy};
    use gpufit::core::settings::Pins;
    use gpufit::core::similarity::HistoryQuery;
    let w = workload_from_spec(
        &WorkloadSpec {
            model: Some(TARGET_MODEL.into()),
            method: Some(Method::Lora),
            lora_rank: Some(16),
            seq_len: 2048,
            global_batch: Some(32),
            ..WorkloadSpec::default()
        },
        "bench",
    )
    .expect("workload");
    let gpu = gpufit::core::catalog::lookup_gpu(TARGET_GPU).expect("gpu");
    let q = HistoryQuery::new(&w.model.name, w.method, &gpu.name, w.seq_len);
    let median = |mut v: Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let mut hq = Vec::new();
    let mut runs = Vec::new();
    for _ in 0..50 {
        let t = Instant::now();
        runs = store.similar(&q).expect("similar");
        hq.push(t.elapsed());
    }
    let mut adv = Vec::new();
    for _ in 0..50 {
        let t = Instant::now();
        let _ = suggest(&AdviceRequest {
            workload: &w,
            gpu: &gpu,
            strategy: Strategy::Balanced,
            targets: StrategyTargets::default(),
            pins: &Pins::default(),
            history: &runs,
        });
        adv.push(t.elapsed());
    }
    println!(
        "one request, alone: history query {:.3?} ({} similar runs), advisor {:.3?} (medians of 50)",
        median(hq),
        runs.len(),
        median(adv)
    );
}

fn gpu_node() -> Node {
    serde_json::from_value(json!({"metadata": {"name": "gpu-1", "labels": {
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.memory": "81920"}}}))
    .expect("node")
}

fn review_body(i: u64) -> Vec<u8> {
    let obj = json!({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": format!("finetune-{i}"), "namespace": "ml", "annotations": {
            "gpufit.io/model": TARGET_MODEL, "gpufit.io/method": "lora", "gpufit.io/lora-rank": "16",
            "gpufit.io/seq-len": "2048", "gpufit.io/global-batch": "32"}},
        "spec": {"backoffLimit": 0, "template": {"spec": {"restartPolicy": "Never", "containers": [{
            "name": "train", "image": "ghcr.io/acme/train:1",
            "args": ["--batch-size={micro_batch_size}", "--grad-accum={gradient_accumulation_steps}"],
            "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}
    });
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": format!("uid-{i}"),
            "kind": {"group": "batch", "version": "v1", "kind": "Job"},
            "resource": {"group": "batch", "version": "v1", "resource": "jobs"},
            "namespace": "ml", "operation": "CREATE",
            "userInfo": {"username": "bench"}, "object": obj, "oldObject": null, "dryRun": false
        }
    }))
    .expect("json")
}

struct Server {
    addr: std::net::SocketAddr,
    ca_pem: String,
    stop: tokio::sync::oneshot::Sender<()>,
}

async fn start(history: Box<dyn HistoryStore>, dir: &Path) -> Server {
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("rcgen");
    let (c, k) = (dir.join("tls.crt"), dir.join("tls.key"));
    std::fs::write(&c, cert.cert.pem()).expect("cert");
    std::fs::write(&k, cert.key_pair.serialize_pem()).expect("key");
    let (nodes, mut w) = reflector::store::<Node>();
    w.apply_watcher_event(&watcher::Event::Apply(gpu_node()));
    let (namespaces, _nw) = reflector::store::<Namespace>();
    let state = Arc::new(WebhookState {
        history: Arc::from(history),
        nodes,
        namespaces,
        metrics: Metrics::new(),
        targets: StrategyTargets::default(),
        default_mode: Mode::Inject,
        cache: Default::default(),
        kueue: Default::default(),
    });
    let server = WebhookServer::bind(&WebhookConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        cert: c,
        key: k,
    })
    .await
    .expect("bind");
    let addr = server.local_addr().expect("addr");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(server.serve(state, async {
        let _ = rx.await;
    }));
    Server {
        addr,
        ca_pem: cert.cert.pem(),
        stop: tx,
    }
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

async fn connect(addr: std::net::SocketAddr, ca_pem: &str) -> Sender {
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_pemfile::certs(&mut ca_pem.as_bytes()) {
        roots.add(c.expect("pem")).expect("root");
    }
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("tls")
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let _ = tcp.set_nodelay(true);
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(
            rustls::pki_types::ServerName::try_from("localhost").expect("name"),
            tcp,
        )
        .await
        .expect("tls");
    let (sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    sender
}

/// Result of one load phase.
struct Phase {
    latencies: Vec<Duration>,
    errors: u64,
    not_mutated: u64,
    elapsed: Duration,
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// Open loop: request i is due at start + i/rate, whatever the server does;
/// its latency runs from that due time to the full response.
async fn load(server: &Server, rate: u64, seconds: u64) -> Phase {
    let total = rate * seconds;
    let (tx, rx) = async_channel(total as usize);
    let mut workers = Vec::new();
    let results = Arc::new(std::sync::Mutex::new((
        Vec::with_capacity(total as usize),
        0u64,
        0u64,
    )));
    for _ in 0..CONNECTIONS {
        let mut sender = connect(server.addr, &server.ca_pem).await;
        let rx = rx.clone();
        let results = results.clone();
        workers.push(tokio::spawn(async move {
            loop {
                let job = { rx.lock().await.recv().await };
                let Some((due, body)) = job else { break };
                let req = http::Request::post(PATH)
                    .header("host", "localhost")
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(body)))
                    .expect("request");
                let ok = async {
                    sender.ready().await.ok()?;
                    let resp = sender.send_request(req).await.ok()?;
                    if !resp.status().is_success() {
                        return None;
                    }
                    let bytes = resp.into_body().collect().await.ok()?.to_bytes();
                    let v: Value = serde_json::from_slice(&bytes).ok()?;
                    Some(v["response"]["allowed"] == true && v["response"]["patch"].is_string())
                }
                .await;
                let lat = due.elapsed();
                let mut r = results.lock().expect("results");
                r.0.push(lat);
                match ok {
                    None => r.1 += 1,
                    Some(false) => r.2 += 1,
                    Some(true) => {}
                }
            }
        }));
    }
    let start = tokio::time::Instant::now();
    let interval = Duration::from_secs_f64(1.0 / rate as f64);
    for i in 0..total {
        let due = start + interval * i as u32;
        tokio::time::sleep_until(due).await;
        if tx.send((due.into_std(), review_body(i))).await.is_err() {
            break;
        }
    }
    drop(tx);
    for w in workers {
        let _ = w.await;
    }
    let elapsed = start.elapsed();
    let r = match Arc::try_unwrap(results) {
        Ok(m) => m.into_inner().expect("results"),
        Err(_) => panic!("a worker still holds the results"),
    };
    Phase {
        latencies: r.0,
        errors: r.1,
        not_mutated: r.2,
        elapsed,
    }
}

type Job = (Instant, Vec<u8>);
type Rx = Arc<tokio::sync::Mutex<tokio::sync::mpsc::Receiver<Job>>>;

fn async_channel(cap: usize) -> (tokio::sync::mpsc::Sender<Job>, Rx) {
    let (tx, rx) = tokio::sync::mpsc::channel(cap.max(1));
    (tx, Arc::new(tokio::sync::Mutex::new(rx)))
}

fn report(name: &str, p: &mut Phase, rate: u64) -> Duration {
    p.latencies.sort();
    let n = p.latencies.len();
    let p99 = pct(&p.latencies, 0.99);
    println!(
        "{name:<22} requests {n:>6}  achieved {:>6.1}/s (target {rate}/s)  p50 {:>8.3?}  p90 {:>8.3?}  p99 {:>8.3?}  max {:>8.3?}  errors {}  not mutated {}",
        n as f64 / p.elapsed.as_secs_f64(),
        pct(&p.latencies, 0.50),
        pct(&p.latencies, 0.90),
        p99,
        p.latencies.last().copied().unwrap_or_default(),
        p.errors,
        p.not_mutated,
    );
    p99
}

fn main() {
    let rate = env_num("GPUFIT_BENCH_RATE", 500);
    let seconds = env_num("GPUFIT_BENCH_SECONDS", 20);
    let records = env_num("GPUFIT_BENCH_RECORDS", 1_000_000);
    let canonical = gpufit::core::catalog::lookup_model(TARGET_MODEL)
        .map(|m| m.arch.name)
        .unwrap_or_else(|e| panic!("the benchmark's model must be in the catalog: {e}"));
    let db: PathBuf = std::env::var("GPUFIT_BENCH_DB")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            // Cargo's target directory, wherever CARGO_TARGET_DIR puts it.
            std::env::var_os("CARGO_TARGET_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"))
                .join(format!("bench-data/webhook-{records}.db"))
        });
    if let Some(d) = db.parent() {
        std::fs::create_dir_all(d).expect("bench data dir");
    }
    let big = build_history(&db, records, &canonical);
    split_costs(big.as_ref());
    let tmp = tempfile::tempdir().expect("temp dir");
    let empty = gpufit::history::open(&format!("sqlite:{}", tmp.path().join("empty.db").display()))
        .expect("empty history");

    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        println!("webhook_load: HTTPS loopback, {CONNECTIONS} keep-alive connections, open loop {rate} req/s for {seconds} s per phase");
        let s = start(big, tmp.path()).await;
        // Warm-up: the first requests open SQLite pages and caches.
        let _ = load(&s, rate.min(100), 1).await;
        let mut big_phase = load(&s, rate, seconds).await;
        let _ = s.stop.send(());
        let s = start(empty, tmp.path()).await;
        let _ = load(&s, rate.min(100), 1).await;
        let mut empty_phase = load(&s, rate, seconds).await;
        let _ = s.stop.send(());

        let p99_big = report(&format!("{records} runs"), &mut big_phase, rate);
        let p99_empty = report("empty history", &mut empty_phase, rate);
        println!(
            "p99 ratio (1M-run history / empty): {:.2}; target p99 <= 5 ms at {rate}/s with no errors: {}",
            p99_big.as_secs_f64() / p99_empty.as_secs_f64().max(1e-9),
            if p99_big <= Duration::from_millis(5) && big_phase.errors == 0 && big_phase.not_mutated == 0 { "MET" } else { "MISSED" }
        );
    });
}
