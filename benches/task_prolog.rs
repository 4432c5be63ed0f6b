//! TaskProlog wall time: `gpufit slurm task-prolog` spawned as Slurm would
//! (a prepared job environment), asking a `gpufit controller --no-kubernetes`
//! on loopback whose SQLite history holds 1,000,000 runs, with the GPU read
//! from a simulate sidecar. Prints p50 / p99 over 200 runs (target p99 ≤
//! 100 ms) and, measured in the same run, a job that does not ask for gpufit
//! (process start-up alone) for comparison.
//!
//! `cargo bench --bench task_prolog` (GPUFIT_BENCH_RECORDS / GPUFIT_BENCH_RUNS
//! change the sizes).

use gpufit::core::run::RunOutcome;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpufit::core::run::{RunRecord, RunResult, RunSource};
use gpufit::core::settings::{Dtype, EngineeringSettings};
use gpufit::core::workload::Method;
use gpufit::history::HistoryError;

const BIN: &str = env!("CARGO_BIN_EXE_gpufit");
const MODEL: &str = "meta-llama/Llama-3.1-8B";
const GPU: &str = "NVIDIA H100 80GB HBM3";

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

fn env_usize(k: &str, default: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `n` runs over 40 models × 8 GPU models × 6 sequence lengths, so the
/// benchmark's key has its share (~500 runs) among many others.
fn runs(n: usize) -> impl Iterator<Item = Result<RunRecord, HistoryError>> {
    const GPUS: [&str; 8] = [
        GPU,
        "NVIDIA A100-SXM4-80GB",
        "NVIDIA A100-SXM4-40GB",
        "NVIDIA L40S",
        "NVIDIA GeForce RTX 4090",
        "Tesla T4",
        "NVIDIA A10G",
        "NVIDIA H200",
    ];
    const SEQ: [u32; 6] = [512, 1024, 2048, 4096, 8192, 16384];
    let t0 = chrono::Utc::now();
    (0..n).map(move |i| {
        let model = if i % 40 == 0 {
            MODEL.to_string()
        } else {
            format!("org/model-{}", i % 40)
        };
        // Spread micro batch and checkpointing inside every key (i is a
        // multiple of 40 for the benchmark model, so mix the higher digits).
        let mb = 1 + ((i / 7) % 16) as u32;
        // the largest micro batches ran out of memory (an OOM below a
        // success would tell the advisor nothing fits)
        let oom = mb >= 15;
        let gpu = GPUS[(i / 40) % 8];
        // 25 % of the card plus 2.5 % per sample (20 GB + 2 GB per sample
        // on an 80 GB card): within every card, as the store requires (it
        // refuses a peak above the GPU's memory)
        let card = gpufit::core::catalog::lookup_gpu(gpu)
            .map(|g| g.memory_bytes as f64)
            .expect("bench GPU in the catalog");
        let peak = card * (0.25 + 0.025 * f64::from(mb));
        Ok(RunRecord {
            confirmation: Default::default(),
            nodes: None,
            id: None,
            timestamp: t0 - chrono::Duration::seconds(i as i64),
            cluster: Some("bench".into()),
            node: Some(format!("n{}", i % 64)),
            source: RunSource::Slurm,
            job_id: Some(i.to_string()),
            model,
            method: if i % 3 == 0 {
                Method::Full
            } else {
                Method::Lora
            },
            gpu_model: gpu.to_string(),
            seq_len: SEQ[(i / 320) % 6],
            lora_rank: Some(16),
            gpus: 1,
            global_batch: None,
            settings: EngineeringSettings {
                micro_batch_size: mb,
                dtype: Dtype::Bf16,
                activation_checkpointing: (i / 13) % 2 == 0,
                ..EngineeringSettings::default()
            },
            result: RunResult {
                outcome: RunOutcome::of(!oom, oom, false),
                peak_memory_bytes: (!oom).then_some(peak as u64),
                samples_per_sec: Some(10.0 * f64::from(mb)),
                tokens_per_sec: None,
                duration_sec: Some(600.0),
            },
            predicted_peak_bytes: Some((peak * 1.05) as u64),
        })
    })
}

fn wait_http(url: &str, d: &mut Daemon) {
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_millis(500))
        .build();
    let t = Instant::now();
    while agent.get(url).call().is_err() {
        if let Ok(Some(s)) = d.0.try_wait() {
            panic!("{url}: the server exited ({s})");
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "{url} never answered"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Spawns the TaskProlog `runs` times; returns wall times and the last output.
fn measure(envs: &[(String, String)], runs: usize) -> (Vec<Duration>, String) {
    let mut times = Vec::with_capacity(runs);
    let mut last = String::new();
    for i in 0..runs {
        let t = Instant::now();
        let out = Command::new(BIN)
            .args(["slurm", "task-prolog"])
            .env_clear()
            .envs(envs.iter().map(|(k, v)| (k, v)))
            .env("SLURM_JOB_ID", (1000 + i).to_string())
            .stdin(Stdio::null())
            .output()
            .expect("the gpufit binary runs");
        times.push(t.elapsed());
        assert!(out.status.success(), "task-prolog always exits 0");
        last = String::from_utf8_lossy(&out.stdout).into_owned();
        if i == 0 && !out.stderr.is_empty() {
            eprintln!(
                "task-prolog stderr: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    times.sort();
    (times, last)
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() {
    let records = env_usize("GPUFIT_BENCH_RECORDS", 1_000_000);
    let n = env_usize("GPUFIT_BENCH_RUNS", 200);
    let dir = tempfile::tempdir().expect("a temp dir");
    let db = dir.path().join("history.db");
    let url = format!("sqlite:{}", db.display());

    let t = Instant::now();
    {
        let store = gpufit::history::open(&url).expect("a SQLite history");
        let stored = store
            .record_batch(&mut runs(records))
            .expect("bulk insert of the benchmark history");
        assert_eq!(stored as usize, records);
    }
    eprintln!(
        "history: {records} runs written in {:.1} s ({})",
        t.elapsed().as_secs_f64(),
        db.display()
    );

    let ctl_port = free_port();
    let mut ctl = Daemon(
        Command::new(BIN)
            .args(["controller", "--no-kubernetes", "--listen"])
            .arg(format!("127.0.0.1:{ctl_port}"))
            .args(["--history", &url])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("the controller starts"),
    );
    wait_http(&format!("http://127.0.0.1:{ctl_port}/healthz"), &mut ctl);
    let side_port = free_port();
    let mut side = Daemon(
        Command::new(BIN)
            .args([
                "sidecar",
                "--backend",
                "simulate",
                "--simulate-gpus",
                "2",
                "--listen",
            ])
            .arg(format!("127.0.0.1:{side_port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("the sidecar starts"),
    );
    wait_http(&format!("http://127.0.0.1:{side_port}/healthz"), &mut side);

    let empty_config = dir.path().join("slurm.toml");
    std::fs::write(&empty_config, "").expect("config file");
    let state = dir.path().join("state");
    std::fs::create_dir_all(&state).expect("state dir");
    let base: Vec<(String, String)> = [
        ("PATH", "/usr/bin:/bin"),
        ("SLURM_JOB_GPUS", "0"),
        ("CUDA_VISIBLE_DEVICES", "0"),
        ("GPUFIT_SLURM_CONFIG", empty_config.to_str().unwrap_or("")),
        ("GPUFIT_STATE_DIR", state.to_str().unwrap_or("")),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .chain([
        (
            "GPUFIT_CONTROLLER_URL".to_string(),
            format!("http://127.0.0.1:{ctl_port}"),
        ),
        (
            "GPUFIT_SIDECAR_URL".to_string(),
            format!("http://127.0.0.1:{side_port}"),
        ),
    ])
    .collect();
    let mut asking = base.clone();
    asking.extend(
        [
            ("GPUFIT_MODEL", MODEL),
            ("GPUFIT_SEQ_LEN", "2048"),
            ("GPUFIT_METHOD", "lora"),
            ("GPUFIT_LORA_RANK", "16"),
            ("GPUFIT_GLOBAL_BATCH", "64"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string())),
    );
    // A job with no GPU and no gpufit request: nothing but process start-up.
    let mut plain = base.clone();
    plain.retain(|(k, _)| k != "SLURM_JOB_GPUS" && k != "CUDA_VISIBLE_DEVICES");

    let (_, warm) = measure(&asking, 5);
    assert!(
        warm.contains("export GPUFIT_MICRO_BATCH_SIZE="),
        "the TaskProlog gave no settings; output: {warm:?}"
    );
    let (with, out) = measure(&asking, n);
    let (without, plain_out) = measure(&plain, n);
    assert!(plain_out.is_empty(), "a job not asking gets nothing");
    let source = out
        .lines()
        .find_map(|l| l.strip_prefix("export GPUFIT_SUGGESTION_SOURCE="))
        .unwrap_or("?");

    println!("task_prolog: {n} runs, history {records} runs, controller and sidecar on loopback");
    println!(
        "  asking (source {source}):  p50 {:7.1} ms   p99 {:7.1} ms   max {:7.1} ms",
        ms(pct(&with, 0.50)),
        ms(pct(&with, 0.99)),
        ms(pct(&with, 1.0))
    );
    println!(
        "  not asking (start-up):     p50 {:7.1} ms   p99 {:7.1} ms   max {:7.1} ms",
        ms(pct(&without, 0.50)),
        ms(pct(&without, 0.99)),
        ms(pct(&without, 1.0))
    );
    println!(
        "  ratio asking / not asking: p50 {:.2}x   p99 {:.2}x   (target p99 <= 100 ms: {})",
        ms(pct(&with, 0.50)) / ms(pct(&without, 0.50)),
        ms(pct(&with, 0.99)) / ms(pct(&without, 0.99)),
        if pct(&with, 0.99) <= Duration::from_millis(100) {
            "met"
        } else {
            "NOT met"
        }
    );
}
