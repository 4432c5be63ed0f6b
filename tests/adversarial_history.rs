//! Issue 47, items 1 to 4 and 7: the history's one door, tried as a
//! hostile or careless client would, through the controller's API (the
//! path of the Slurm Epilog and of any token holder), the stores and
//! `gpufit history export | gpufit history import`. Each case got through
//! before the door was one; here it is refused and the record is left as
//! it was. Also: a store filled by every writing path round-trips through
//! export and import with nothing skipped, and (a property) every run the
//! door accepts, import accepts as the same run.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use gpufit::controller::api::ApiState;
use gpufit::controller::metrics::{Health, Metrics, Routes};
use gpufit::core::run::{FailureReason, NodeReports, RunOutcome, RunRecord, RunResult, RunSource};
use gpufit::core::settings::EngineeringSettings;
use gpufit::core::workload::Method;
use gpufit::history::{HistoryStore, ListFilter};

#[path = "common/loopback.rs"]
mod loopback;
use loopback::{agent, call};

#[path = "common/cli.rs"]
mod cli;

const TOKEN: &str = "tok";
const A100_40: &str = "NVIDIA A100-SXM4-40GB";
const H100: &str = "NVIDIA H100 80GB HBM3";

/// The controller's port (the API beside `/metrics`, counting what it
/// does) over a SQLite history at `db`, stopped on drop.
struct Controller {
    addr: SocketAddr,
    store: Arc<dyn HistoryStore>,
    rt: Option<tokio::runtime::Runtime>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Controller {
    fn start(db: &std::path::Path) -> Controller {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let store: Arc<dyn HistoryStore> =
            Arc::from(gpufit::history::open(&format!("sqlite:{}", db.display())).unwrap());
        let state = ApiState::new(store.clone(), Some(TOKEN.into()));
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let metrics = Metrics::new();
        let routes = Routes {
            metrics: metrics.clone(),
            health: Arc::new(Health::default()),
            api: Some(Arc::new(state.with_metrics(metrics))),
        };
        rt.spawn(routes.serve(listener, async {
            let _ = rx.await;
        }));
        Controller {
            addr,
            store,
            rt: Some(rt),
            stop: Some(tx),
        }
    }

    fn post(&self, r: &RunRecord) -> (u16, serde_json::Value) {
        self.post_json(&serde_json::to_value(r).unwrap())
    }

    fn post_json(&self, v: &serde_json::Value) -> (u16, serde_json::Value) {
        call(
            agent()
                .post(&format!("http://{}/v1/runs", self.addr))
                .set("Authorization", &format!("Bearer {TOKEN}")),
            Some(&v.to_string()),
        )
    }

    fn job(&self, job: &str) -> Vec<RunRecord> {
        self.store
            .list(&ListFilter::default())
            .unwrap()
            .into_iter()
            .filter(|r| r.job_id.as_deref() == Some(job))
            .collect()
    }

    fn runs_total(&self) -> f64 {
        let text = agent()
            .get(&format!("http://{}/metrics", self.addr))
            .call()
            .unwrap()
            .into_string()
            .unwrap();
        text.lines()
            .filter(|l| l.starts_with("gpufit_controller_runs_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(2));
        }
    }
}

/// A one-node run as the Epilog of a one-node job posts it.
fn one_node(job: &str, gpu: &str, peak: u64) -> RunRecord {
    RunRecord {
        confirmation: Default::default(),
        nodes: None,
        id: None,
        timestamp: Utc::now() - chrono::Duration::minutes(5),
        cluster: Some("c1".into()),
        node: Some("n1".into()),
        source: RunSource::Slurm,
        job_id: Some(job.into()),
        model: "my-org/custom-model".into(),
        method: Method::Full,
        gpu_model: gpu.into(),
        seq_len: 2048,
        lora_rank: None,
        gpus: 16,
        global_batch: Some(256),
        settings: EngineeringSettings {
            micro_batch_size: 4,
            gradient_accumulation_steps: 4,
            ..EngineeringSettings::default()
        },
        result: RunResult {
            outcome: RunOutcome::Succeeded,
            peak_memory_bytes: Some(peak),
            samples_per_sec: Some(3.0),
            tokens_per_sec: None,
            duration_sec: Some(60.0),
        },
        predicted_peak_bytes: Some(peak.saturating_sub(1_000_000_000).max(1)),
    }
}

/// One node's report of a two-node job.
fn node(job: &str, name: &str, gpu: &str, peak: u64) -> RunRecord {
    let mut r = one_node(job, gpu, peak);
    r.node = Some(name.into());
    r.nodes = Some(NodeReports {
        reported: 1,
        expected: 2,
        without_peak: Vec::new(),
    });
    r
}

/// Item 1: a one-node report never replaces a multi-node record, nor an
/// older run of a reused job id (422, the record unchanged).
#[test]
fn a_one_node_report_never_replaces_a_multi_node_record_or_an_older_run() {
    let d = tempfile::tempdir().unwrap();
    let c = Controller::start(&d.path().join("h.db"));
    for n in ["n1", "n2"] {
        let (s, b) = c.post(&node("11", n, A100_40, 30_000_000_000));
        assert_eq!(s, 201, "{b}");
    }
    let before = c.job("11");
    assert_eq!(before.len(), 1);
    assert_eq!(before[0].node.as_deref(), Some("n1,n2"));
    let (s, b) = c.post(&one_node("11", A100_40, 20_000_000_000));
    assert_eq!(s, 422, "{b}");
    assert!(b.to_string().contains("does not replace"), "{b}");
    assert_eq!(c.job("11"), before, "the 2/2 record is unchanged");

    // A reused job id: the old run stays, the new one-node report is refused.
    let mut old = one_node("12", A100_40, 30_000_000_000);
    old.timestamp = Utc::now() - chrono::Duration::hours(2);
    assert_eq!(c.post(&old).0, 201);
    let before = c.job("12");
    let (s, b) = c.post(&one_node("12", A100_40, 20_000_000_000));
    assert_eq!(s, 422, "{b}");
    assert_eq!(c.job("12"), before, "the older run is unchanged");
    // The same run replayed (a retried Epilog) still updates in place.
    let mut again = old.clone();
    again.result.samples_per_sec = Some(4.0);
    assert_eq!(c.post(&again).0, 201);
    assert_eq!(c.job("12")[0].result.samples_per_sec, Some(4.0));
}

/// Item 2: a node's report joins the record only if it describes the same
/// run (GPU model, workload, settings).
#[test]
fn a_node_report_of_another_run_is_refused_and_the_record_kept() {
    let d = tempfile::tempdir().unwrap();
    let c = Controller::start(&d.path().join("h.db"));
    assert_eq!(c.post(&node("21", "n1", A100_40, 30_000_000_000)).0, 201);
    let before = c.job("21");
    // Node 2 on an H100 with a 75 GB peak.
    let (s, b) = c.post(&node("21", "n2", H100, 75_000_000_000));
    assert_eq!(s, 422, "{b}");
    assert!(b.to_string().contains("gpu_model"), "{b}");
    // Node 2 with another model and micro batch.
    let mut other = node("21", "n2", A100_40, 35_000_000_000);
    other.model = "another/model".into();
    assert_eq!(c.post(&other).0, 422);
    let mut other = node("21", "n2", A100_40, 35_000_000_000);
    other.settings.micro_batch_size = 8;
    assert_eq!(c.post(&other).0, 422);
    // Node 2 saying the job had 3 nodes.
    let mut other = node("21", "n2", A100_40, 35_000_000_000);
    other.nodes = Some(NodeReports {
        reported: 1,
        expected: 3,
        without_peak: Vec::new(),
    });
    assert_eq!(c.post(&other).0, 422);
    assert_eq!(c.job("21"), before, "the record is as node 1 made it");
    // A 1g.5gb slice with a 39 GB peak, alone or as a node: refused.
    let slice = "NVIDIA A100-SXM4-40GB MIG 1g.5gb";
    assert_eq!(c.post(&node("22", "n1", slice, 39_000_000_000)).0, 400);
    assert_eq!(c.post(&one_node("23", slice, 39_000_000_000)).0, 400);
    assert_eq!(c.post(&node("22", "n1", slice, 4_000_000_000)).0, 201);
}

/// Item 3: junk `POST /v1/runs` took and import refused: every case 400,
/// nothing stored.
#[test]
fn junk_runs_are_refused_at_the_door() {
    let d = tempfile::tempdir().unwrap();
    let c = Controller::start(&d.path().join("h.db"));
    let good = serde_json::to_value(one_node("31", H100, 50_000_000_000)).unwrap();
    let cases: Vec<(&str, &str, serde_json::Value)> = vec![
        (
            "/gpu_model",
            "unknown GPU, 2^63 peak",
            serde_json::json!("Zzz"),
        ),
        ("/gpu_model", "cpu", serde_json::json!("cpu")),
        (
            "/model",
            "10 kB model name",
            serde_json::json!("m".repeat(10_000)),
        ),
        (
            "/model",
            "escape sequence in the model",
            serde_json::json!("m\u{1b}[2J\rfake row"),
        ),
        (
            "/predicted_peak_bytes",
            "predicted 2^64-1",
            serde_json::json!(u64::MAX),
        ),
        ("/predicted_peak_bytes", "predicted 0", serde_json::json!(0)),
        (
            "/timestamp",
            "year 1",
            serde_json::json!("0001-01-01T00:00:00Z"),
        ),
        (
            "/result/host_oom",
            "host OOM on a success",
            serde_json::json!(true),
        ),
        (
            "/job_id",
            "1 kB job id",
            serde_json::json!("j".repeat(1000)),
        ),
    ];
    for (ptr, what, value) in cases {
        let mut v = good.clone();
        let (parent, field) = ptr.rsplit_once('/').unwrap();
        v.pointer_mut(if parent.is_empty() { "" } else { parent })
            .and_then(|p| p.as_object_mut())
            .unwrap()
            .insert(field.to_string(), value);
        if what.contains("2^63") {
            *v.pointer_mut("/result/peak_memory_bytes").unwrap() = serde_json::json!(1u64 << 63);
        }
        let (s, b) = c.post_json(&v);
        assert_eq!(s, 400, "{what}: {b}");
    }
    assert_eq!(c.store.count().unwrap(), 0, "nothing was stored");
    assert_eq!(c.post_json(&good).0, 201, "the good run itself is taken");
}

/// Item 4: `nodes.expected` is bounded and fixed by the first report, node
/// reports need a job id, a replayed report is counted once.
#[test]
fn node_counts_are_bounded_reports_need_a_job_and_a_replay_counts_once() {
    let d = tempfile::tempdir().unwrap();
    let c = Controller::start(&d.path().join("h.db"));
    let mut huge = node("41", "n1", H100, 50_000_000_000);
    huge.nodes = Some(NodeReports {
        reported: 1,
        expected: 1_000_000,
        without_peak: Vec::new(),
    });
    let (s, b) = c.post(&huge);
    assert_eq!(s, 400, "{b}");
    assert!(c.job("41").is_empty());
    let mut jobless = node("42", "n1", H100, 50_000_000_000);
    jobless.job_id = None;
    let (s, b) = c.post(&jobless);
    assert_eq!(s, 422, "{b}");
    assert!(b.to_string().contains("job_id"), "{b}");
    assert_eq!(c.store.count().unwrap(), 0);
    // A one-node report posted three times: one run in the metrics.
    let run = one_node("43", H100, 50_000_000_000);
    for _ in 0..3 {
        assert_eq!(c.post(&run).0, 201);
    }
    assert_eq!(c.runs_total(), 1.0);
    assert_eq!(c.store.count().unwrap(), 1);
}

/// Item 7, the outcome: a run whose fields say an impossible outcome
/// cannot be built (`RunOutcome`) nor read from a request; the stored
/// outcome reads back as the one it was.
#[test]
fn impossible_outcomes_are_refused_and_each_stored_one_is_one_outcome() {
    let d = tempfile::tempdir().unwrap();
    let c = Controller::start(&d.path().join("h.db"));
    let good = serde_json::to_value(one_node("51", H100, 50_000_000_000)).unwrap();
    for (success, reason, host_oom) in [
        (false, Some("OOM"), true),
        (true, Some("OOM"), false),
        (true, None, true),
        (false, None, false),
    ] {
        let mut v = good.clone();
        v["result"]["success"] = success.into();
        v["result"]["failure_reason"] = serde_json::json!(reason);
        v["result"]["host_oom"] = host_oom.into();
        let (s, b) = c.post_json(&v);
        assert_eq!(s, 400, "{success} {reason:?} {host_oom}: {b}");
    }
    assert_eq!(c.store.count().unwrap(), 0);
    let mut host = one_node("51", H100, 50_000_000_000);
    host.result.outcome = RunOutcome::Failed { host_oom: true };
    assert_eq!(c.post(&host).0, 201);
    let stored = &c.job("51")[0];
    assert_eq!(stored.result.outcome, RunOutcome::Failed { host_oom: true });
    assert_eq!(
        stored.result.failure_reason(),
        Some(FailureReason::OtherError)
    );
}

// === export | import ===

fn gpufit_json(env: &cli::Env, db: &std::path::Path, args: &[&str]) -> serde_json::Value {
    let out = env.run(
        args,
        &[("GPUFIT_HISTORY", format!("sqlite:{}", db.display()))],
    );
    assert!(out.status.success(), "gpufit {args:?}: {}", cli::text(&out));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("gpufit {args:?} printed no JSON ({e}): {}", cli::text(&out)))
}

/// Every record as compared across stores: without its store id.
fn records(store: &dyn HistoryStore) -> Vec<RunRecord> {
    let mut all = store.list(&ListFilter::default()).unwrap();
    for r in &mut all {
        r.id = None;
    }
    all.sort_by_key(RunRecord::identity);
    all
}

/// A store filled by every writing path (`POST /v1/runs` one-node and
/// node reports, whole and partial and peakless; `gpufit record`; a
/// recorder's write through the store; `history import`) round-trips
/// through `history export | history import` with nothing skipped and
/// every record equal.
#[test]
fn a_store_filled_by_every_path_round_trips_through_export_and_import() {
    let env = cli::Env::new();
    let db = env.path("every-path.db");
    let c = Controller::start(&db);
    // POST: one-node, a whole 2-node job, a partial one, one with a peakless node.
    assert_eq!(c.post(&one_node("61", H100, 50_000_000_000)).0, 201);
    for n in ["n1", "n2"] {
        assert_eq!(c.post(&node("62", n, H100, 40_000_000_000)).0, 201);
    }
    assert_eq!(c.post(&node("63", "n1", A100_40, 30_000_000_000)).0, 201);
    let mut peakless = node("64", "n2", H100, 1);
    peakless.result.peak_memory_bytes = None;
    peakless.nodes = Some(NodeReports {
        reported: 1,
        expected: 2,
        without_peak: vec!["n2".into()],
    });
    assert_eq!(c.post(&peakless).0, 201);
    assert_eq!(c.post(&node("64", "n1", H100, 41_000_000_000)).0, 201);
    // A recorder (the reconciler, the webhook's) writes through the store.
    let mut k8s = one_node("team-a/train-1/uid-1", H100, 60_000_000_000);
    k8s.source = RunSource::Kubernetes;
    k8s.result.outcome = RunOutcome::GpuOom;
    c.store.record(&k8s).unwrap();
    // The webhook's recorder: a run nothing confirms ran the settings.
    let mut unconfirmed = one_node("Job:team-a/train-2/uid-2", H100, 45_000_000_000);
    unconfirmed.source = RunSource::Kubernetes;
    unconfirmed.confirmation = gpufit::core::confirm::Confirmation::Unconfirmed;
    c.store.record(&unconfirmed).unwrap();
    // A run without a job id (its identity is its content) whose
    // throughput is a float JSON must read back exactly.
    let mut jobless = one_node("-", H100, 55_000_000_000);
    jobless.job_id = None;
    jobless.result.samples_per_sec = Some(106_620_151.484_521_08);
    c.store.record(&jobless).unwrap();
    // `gpufit record`, a GPU OOM and a host-memory kill.
    for failure in ["oom", "host-oom"] {
        gpufit_json(
            &env,
            &db,
            &cli::args(
                &["-o", "json", "record"],
                &cli::args(
                    cli::MODEL,
                    &[
                        "--gpu",
                        cli::A100,
                        "--micro-batch",
                        "4",
                        "--failure",
                        failure,
                        "--peak-gb",
                        "70",
                    ],
                ),
            ),
        );
    }
    // `history import` of a run_logs line.
    let jsonl = env.path("in.jsonl");
    std::fs::write(
        &jsonl,
        r#"{"timestamp": "2026-01-02T10:00:00", "config": {"model": "torchtune.models.llama3_1.lora_llama3_1_8b", "max_seq_length": 2048, "batch_size": 4, "dtype": "bf16", "gradient_accumulation_steps": 8}, "result": {"success": true, "peak_memory_gb": 23.1, "samples_per_sec": 5.2, "failure_reason": null, "duration_sec": 120.5}, "gpu_type": "NVIDIA A100-SXM4-80GB"}
"#,
    )
    .unwrap();
    let imported = gpufit_json(
        &env,
        &db,
        &["-o", "json", "history", "import", jsonl.to_str().unwrap()],
    );
    assert_eq!(imported["skipped"], 0, "{imported}");
    let filled = records(c.store.as_ref());
    assert_eq!(filled.len(), 10, "{filled:#?}");

    // Export, then import into a new store: nothing skipped, all equal.
    let out = env.path("export.jsonl");
    let o = env.run(
        &["history", "export", "--output-file", out.to_str().unwrap()],
        &[("GPUFIT_HISTORY", format!("sqlite:{}", db.display()))],
    );
    assert!(o.status.success(), "{}", cli::text(&o));
    let db2 = env.path("again.db");
    let again = gpufit_json(
        &env,
        &db2,
        &["-o", "json", "history", "import", out.to_str().unwrap()],
    );
    assert_eq!(again["skipped"], 0, "{again}");
    assert_eq!(again["imported"], 10, "{again}");
    let store2 = gpufit::history::open(&format!("sqlite:{}", db2.display())).unwrap();
    assert_eq!(records(store2.as_ref()), filled);
    // And importing the export into the store it came from changes nothing.
    let same = gpufit_json(
        &env,
        &db,
        &["-o", "json", "history", "import", out.to_str().unwrap()],
    );
    assert_eq!(same["skipped"], 0, "{same}");
    assert_eq!(records(c.store.as_ref()), filled);
}

mod property {
    use super::*;
    use gpufit::history::jsonl::{parse_line, write_record, ImportOptions, Resolver};
    use proptest::prelude::*;

    fn arb_gpu() -> impl Strategy<Value = String> {
        prop_oneof![
            Just(H100.to_string()),
            Just(A100_40.to_string()),
            Just("NVIDIA A100-SXM4-40GB MIG 1g.5gb".to_string()),
            Just("Tesla T4".to_string()),
            Just("Zzz Custom Accelerator".to_string()),
            Just("cpu".to_string()),
        ]
    }

    fn arb_run() -> impl Strategy<Value = RunRecord> {
        (
            (
                arb_gpu(),
                0u64..200_000_000_000,
                prop::option::of(0u64..2_000_000_000_000),
                0u32..70_000,
                0u32..70_000,
                prop::option::of(1u32..8),
                0u32..40,
                0usize..3,
            ),
            (
                any::<bool>(),
                any::<bool>(),
                any::<bool>(),
                -100_000i64..200_000,
                prop::option::of(0.0f64..1e10),
                prop::bool::ANY,
                "[a-z/._-]{1,40}",
            ),
        )
            .prop_map(
                |(
                    (gpu, peak, predicted, micro, accum, expected, gpus, confirmation),
                    (success, oom, host_oom, minutes, rate, has_job, model),
                )| {
                    let mut r = one_node("p", &gpu, 1);
                    r.gpu_model = gpu;
                    r.model = model;
                    r.job_id = has_job.then(|| "p-1".to_string());
                    r.timestamp = Utc::now() - chrono::Duration::minutes(minutes);
                    r.gpus = gpus;
                    r.settings.micro_batch_size = micro;
                    r.settings.gradient_accumulation_steps = accum;
                    r.result.peak_memory_bytes = (peak > 0).then_some(peak);
                    r.predicted_peak_bytes = predicted;
                    r.result.outcome = RunOutcome::of(success, oom, host_oom);
                    r.confirmation = [
                        gpufit::core::confirm::Confirmation::Confirmed,
                        gpufit::core::confirm::Confirmation::RanOther,
                        gpufit::core::confirm::Confirmation::Unconfirmed,
                    ][confirmation];
                    r.result.samples_per_sec = rate;
                    r.nodes = expected.map(|e| NodeReports {
                        reported: 1,
                        expected: e,
                        without_peak: Vec::new(),
                    });
                    r
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        /// Whatever the door accepts (any path stores through it), import
        /// accepts as the same run: its export line is read back equal.
        #[test]
        fn any_run_the_door_accepts_import_accepts_as_the_same_run(r in arb_run()) {
            if let Ok(stored) = r.validated(None) {
                let mut line = Vec::new();
                write_record(&mut line, &stored).unwrap();
                let text = String::from_utf8(line).unwrap();
                let back = parse_line(text.trim(), &ImportOptions::default(), &mut Resolver::default(), Utc::now());
                let back = back.map_err(|e| TestCaseError::fail(format!("import skipped it: {e}\n{text}")))?;
                let back = back.validated(None).map_err(|e| TestCaseError::fail(format!("import refused it: {e}\n{text}")))?;
                prop_assert_eq!(back, stored);
            }
        }
    }
}
