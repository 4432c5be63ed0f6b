//! `gpufit report` speed: 1 000 000 runs in SQLite and in a real PostgreSQL
//! (started from Debian's binaries on 127.0.0.1, stopped afterwards), the
//! report over `--since all` and `--since 7d`, aggregation plus table/JSON
//! and HTML rendering, median of 3. Target: under 5 s each.
//!
//! Run: `cargo bench --bench report_speed`
//! (`GPUFIT_BENCH_RECORDS=100000` for a quicker, smaller run.)

#[path = "../tests/common/postgres.rs"]
mod pg;

#[path = "common/fleet_gpus.rs"]
mod fleet_gpus;
use fleet_gpus::GPUS;
use gpufit::core::run::RunOutcome;

use std::time::Instant;

use chrono::{DateTime, Duration, Utc};
use gpufit::cli::report::{build_report, html, parse_since};
use gpufit::core::run::{RunRecord, RunResult, RunSource};
use gpufit::core::settings::EngineeringSettings;
use gpufit::core::workload::Method;
use gpufit::history::sqlite::SqliteStore;
use gpufit::history::{HistoryError, HistoryStore};
use rand::{Rng, SeedableRng};

const MODELS: usize = 100;
const METHODS: [Method; 3] = [Method::Full, Method::Lora, Method::Qlora];
const SEQS: [u32; 4] = [1024, 2048, 4096, 8192];
const GIB: f64 = (1u64 << 30) as f64;

/// Runs spread over the 30 days before `now`: 1 in 8 OOM, most with a
/// prediction, successful ones with a peak below the card (30–98 % of its
/// memory) and a throughput.
fn runs(n: usize, now: DateTime<Utc>) -> impl Iterator<Item = Result<RunRecord, HistoryError>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    (0..n).map(move |i| {
        let gpu = GPUS[rng.gen_range(0..GPUS.len())];
        // the card's memory as NVML reports it: the store refuses a peak
        // above it (bad data)
        let cap = gpufit::core::catalog::lookup_gpu(gpu)
            .map(|g| g.memory_bytes as f64 / GIB)
            .expect("bench GPU in the catalog");
        let method = METHODS[rng.gen_range(0..METHODS.len())];
        let batch: u32 = rng.gen_range(1..=16);
        let oom = rng.gen_range(0..8) == 0;
        let peak = cap * rng.gen_range(0.3..0.98);
        let gpus = [1, 1, 2, 4, 8][rng.gen_range(0..5)];
        Ok(RunRecord {
            confirmation: Default::default(),
            nodes: None,
            id: None,
            timestamp: now - Duration::seconds(rng.gen_range(0..30 * 86_400)),
            cluster: Some("bench".into()),
            node: Some(format!("node-{}", i % 64)),
            source: RunSource::Slurm,
            job_id: Some(i.to_string()),
            model: format!("bench-org/model-{}", rng.gen_range(0..MODELS)),
            method,
            gpu_model: gpu.into(),
            seq_len: SEQS[rng.gen_range(0..SEQS.len())],
            lora_rank: (method != Method::Full).then_some(16),
            gpus,
            global_batch: Some(64),
            settings: EngineeringSettings {
                micro_batch_size: batch,
                gradient_accumulation_steps: 64 / batch,
                ..EngineeringSettings::default()
            },
            result: RunResult {
                outcome: RunOutcome::of(!oom, oom, false),
                peak_memory_bytes: (!oom).then_some((peak * GIB) as u64),
                samples_per_sec: (!oom).then_some(batch as f64 * 0.7),
                tokens_per_sec: (!oom).then_some(rng.gen_range(500.0..5000.0) * gpus as f64),
                duration_sec: Some(if oom {
                    rng.gen_range(10.0..300.0)
                } else {
                    rng.gen_range(600.0..36_000.0)
                }),
            },
            predicted_peak_bytes: (rng.gen_range(0..10) > 0)
                .then_some((peak * rng.gen_range(0.85..1.2) * GIB) as u64),
        })
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Times the report over `store` for each window: median of 3 runs.
fn time_reports(label: &str, store: &dyn HistoryStore, now: DateTime<Utc>) {
    for window in ["all", "7d"] {
        let since = parse_since(window, now).expect("window");
        // Reading alone: the store's rows into a callback that does nothing.
        let mut read = Vec::new();
        for _ in 0..3 {
            let t = Instant::now();
            let mut k = 0u64;
            store
                .report_rows(since.map(|s| s.timestamp_micros()), &mut |_| {
                    k += 1;
                    Ok(())
                })
                .expect("scan");
            read.push(t.elapsed().as_secs_f64());
            assert!(k > 0);
        }
        let mut agg = Vec::new();
        let mut total = Vec::new();
        let mut rows = 0;
        let mut runs = 0;
        for _ in 0..3 {
            let t = Instant::now();
            let r = build_report(store, since, now).expect("report");
            agg.push(t.elapsed().as_secs_f64());
            let json = serde_json::to_string(&r).expect("json");
            let page = html::render(&r, &store.url()).expect("html");
            total.push(t.elapsed().as_secs_f64());
            assert!(json.len() > 1000 && page.contains("<svg"));
            rows = r.rows_scanned;
            runs = r.total.runs;
        }
        println!(
            "{label}: report --since {window}: {runs} runs in the window, {rows} rows read; reading alone median {:.2} s; reading + aggregation median {:.2} s, with JSON + HTML median {:.2} s (min {:.2}, max {:.2}); target < 5 s",
            median(read),
            median(agg),
            median(total.clone()),
            total.iter().copied().fold(f64::INFINITY, f64::min),
            total.iter().copied().fold(0.0, f64::max),
        );
    }
}

fn main() {
    let n: usize = std::env::var("GPUFIT_BENCH_RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let now = Utc::now();
    let dir = tempfile::tempdir().expect("temp dir");
    println!(
        "report_speed: {n} runs over {} GPU models × {MODELS} models × {} methods × {} sequence lengths, 30 days",
        GPUS.len(),
        METHODS.len(),
        SEQS.len()
    );

    let sqlite = SqliteStore::open(&dir.path().join("history.db")).expect("open sqlite");
    let t = Instant::now();
    let stored = sqlite.record_batch(&mut runs(n, now)).expect("fill sqlite");
    println!(
        "SQLite: stored {stored} runs in {:.1} s (not timed below)",
        t.elapsed().as_secs_f64()
    );
    time_reports("SQLite", &sqlite, now);
    drop(sqlite);

    // the tests' throwaway server (it names the package to install when
    // the binaries are missing)
    let pg = pg::Postgres::start();
    let store = gpufit::history::open(&pg.url()).expect("open postgres");
    let t = Instant::now();
    let stored = store
        .record_batch(&mut runs(n, now))
        .expect("fill postgres");
    println!(
        "PostgreSQL: stored {stored} runs in {:.1} s (not timed below)",
        t.elapsed().as_secs_f64()
    );
    time_reports("PostgreSQL", store.as_ref(), now);
}
