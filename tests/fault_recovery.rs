//! Faults under load (issue 12), against a real PostgreSQL and the real
//! `gpufit controller --no-kubernetes` binary:
//! - the controller SIGKILLed in the middle of 1,000 run records posted by
//!   16 concurrent clients, then restarted: every acknowledged record is
//!   stored exactly once (clients retry what was not acknowledged, as the
//!   Slurm Epilog does; the run identity makes a retry an update);
//! - PostgreSQL restarted under load: requests fail with a clear error for a
//!   moment, then succeed again without restarting gpufit.
//!
//! The figures (sent, acknowledged, stored, duplicated) are printed; the
//! numbers of the last run are in BENCHMARKS.md ("Faults").

#[path = "common/postgres.rs"]
mod pg;

use gpufit::core::run::RunOutcome;
use std::collections::HashSet;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::Utc;
use gpufit::core::run::{RunRecord, RunResult, RunSource};
use gpufit::core::settings::{Dtype, EngineeringSettings};
use gpufit::core::workload::Method;

const BIN: &str = env!("CARGO_BIN_EXE_gpufit");
const TOKEN: &str = "fault-test-token";

struct Controller {
    child: Child,
}

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_controller(dir: &Path, port: u16, history: &str) -> Controller {
    let log = std::fs::File::create(
        dir.join(format!("controller-{}.log", Utc::now().timestamp_micros())),
    )
    .expect("log file");
    let child = Command::new(BIN)
        .args(["controller", "--no-kubernetes", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .args(["--history", history, "--token-file"])
        .arg(dir.join("token"))
        .env("GPUFIT_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start the controller");
    let c = Controller { child };
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if agent()
            .get(&format!("http://127.0.0.1:{port}/healthz"))
            .call()
            .is_ok()
        {
            return c;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("the controller did not answer /healthz within 30 s");
}

fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(5))
        .build()
}

fn record(job: &str) -> RunRecord {
    RunRecord {
        confirmation: Default::default(),
        nodes: None,
        id: None,
        timestamp: Utc::now(),
        cluster: Some("faults".into()),
        node: Some("node-1".into()),
        source: RunSource::Slurm,
        job_id: Some(job.into()),
        model: "meta-llama/Llama-3.1-8B".into(),
        method: Method::Lora,
        gpu_model: "NVIDIA A100-SXM4-80GB".into(),
        seq_len: 2048,
        lora_rank: Some(16),
        gpus: 1,
        global_batch: None,
        settings: EngineeringSettings {
            micro_batch_size: 4,
            dtype: Dtype::Bf16,
            ..EngineeringSettings::default()
        },
        result: RunResult {
            outcome: RunOutcome::Succeeded,
            peak_memory_bytes: Some(40_000_000_000),
            samples_per_sec: Some(5.0),
            tokens_per_sec: Some(10_240.0),
            duration_sec: Some(600.0),
        },
        predicted_peak_bytes: Some(41_000_000_000),
    }
}

fn post(port: u16, r: &RunRecord) -> Result<(), String> {
    agent()
        .post(&format!("http://127.0.0.1:{port}/v1/runs"))
        .set("Authorization", &format!("Bearer {TOKEN}"))
        .send_json(serde_json::to_value(r).map_err(|e| e.to_string())?)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

fn stored_jobs(url: &str) -> Vec<String> {
    let mut c = postgres::Client::connect(url, postgres::NoTls).expect("connect");
    c.query("SELECT job_id FROM runs WHERE cluster = 'faults'", &[])
        .expect("query runs")
        .iter()
        .map(|row| row.get::<_, Option<String>>(0).unwrap_or_default())
        .collect()
}

#[test]
fn a_controller_killed_mid_load_loses_and_duplicates_no_acknowledged_record() {
    let pg = pg::Postgres::start();
    let url = pg.create_db("faults_kill");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("token"), TOKEN).unwrap();
    let port = pg::free_port();
    let controller = Arc::new(Mutex::new(Some(start_controller(dir.path(), port, &url))));

    const CLIENTS: usize = 16;
    const PER_CLIENT: usize = 63; // 1,008 records
    let acked = Arc::new(Mutex::new(Vec::<String>::new()));
    let attempts = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let deadline = Instant::now() + Duration::from_secs(120);
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let acked = acked.clone();
            let attempts = attempts.clone();
            std::thread::spawn(move || {
                for k in 0..PER_CLIENT {
                    let job = format!("{c}-{k}");
                    let r = record(&job);
                    // Retry until acknowledged, as the Epilog's caller would.
                    loop {
                        attempts.fetch_add(1, Ordering::Relaxed);
                        if post(port, &r).is_ok() {
                            acked.lock().unwrap().push(job.clone());
                            break;
                        }
                        assert!(Instant::now() < deadline, "record {job} never acknowledged");
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
            })
        })
        .collect();
    // Kill the controller once about a third is acknowledged, restart it.
    while acked.lock().unwrap().len() < CLIENTS * PER_CLIENT / 3 {
        assert!(Instant::now() < deadline, "load never reached a third");
        std::thread::sleep(Duration::from_millis(5));
    }
    let at_kill = acked.lock().unwrap().len();
    if let Some(mut c) = controller.lock().unwrap().take() {
        // SIGKILL: no graceful shutdown, requests in flight are cut.
        let _ = c.child.kill();
        let _ = c.child.wait();
    }
    std::thread::sleep(Duration::from_millis(500));
    *controller.lock().unwrap() = Some(start_controller(dir.path(), port, &url));
    for h in clients {
        h.join().expect("client thread");
    }
    done.store(true, Ordering::Relaxed);

    let acked = acked.lock().unwrap().clone();
    let stored = stored_jobs(&url);
    let distinct: HashSet<&String> = stored.iter().collect();
    let missing: Vec<&String> = acked.iter().filter(|j| !distinct.contains(j)).collect();
    let duplicated = stored.len() - distinct.len();
    eprintln!(
        "faults/kill: sent {} records ({} attempts), acknowledged {}, stored {} ({} distinct), duplicated {duplicated}, acknowledged before the kill {at_kill}",
        CLIENTS * PER_CLIENT,
        attempts.load(Ordering::Relaxed),
        acked.len(),
        stored.len(),
        distinct.len()
    );
    assert_eq!(acked.len(), CLIENTS * PER_CLIENT);
    assert!(
        missing.is_empty(),
        "acknowledged but not stored: {missing:?}"
    );
    assert_eq!(duplicated, 0, "a retried record was stored twice");
}

#[test]
fn a_postgres_restart_under_load_gives_clear_errors_then_recovers_without_restarting_gpufit() {
    let pg = pg::Postgres::start();
    let url = pg.create_db("faults_restart");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("token"), TOKEN).unwrap();
    let port = pg::free_port();
    let _controller = start_controller(dir.path(), port, &url);

    let errors = Arc::new(Mutex::new(Vec::<String>::new()));
    let ok = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let load: Vec<_> = (0..4)
        .map(|c| {
            let (errors, ok, stop) = (errors.clone(), ok.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut k = 0;
                while !stop.load(Ordering::Relaxed) {
                    match post(port, &record(&format!("r{c}-{k}"))) {
                        Ok(()) => {
                            ok.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => errors.lock().unwrap().push(e),
                    }
                    k += 1;
                    std::thread::sleep(Duration::from_millis(10));
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let before = ok.load(Ordering::Relaxed);
    assert!(before > 0, "no record accepted before the restart");
    pg.restart();
    // Recovery: records are accepted again within a few seconds.
    let after_restart = ok.load(Ordering::Relaxed);
    let deadline = Instant::now() + Duration::from_secs(15);
    while ok.load(Ordering::Relaxed) < after_restart + 20 {
        assert!(
            Instant::now() < deadline,
            "no recovery within 15 s of the PostgreSQL restart; errors: {:?}",
            errors.lock().unwrap().iter().take(3).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    for h in load {
        h.join().unwrap();
    }
    let errors = errors.lock().unwrap().clone();
    eprintln!(
        "faults/pg-restart: accepted {} records, {} failed while PostgreSQL restarted; first error: {:?}",
        ok.load(Ordering::Relaxed),
        errors.len(),
        errors.first()
    );
    // Errors, if any, are clear: a 503 naming the history store.
    for e in &errors {
        assert!(
            e.contains("503") || e.contains("500") || e.contains("Connection"),
            "unclear error: {e}"
        );
    }
}
