//! History speed: importing 1 000 000 `run_logs.jsonl` lines into SQLite,
//! and `similar()` latency with 1 000 000 records over 10 000 keys.
//!
//! Run: `cargo bench --bench history_speed`
//! (`GPUFIT_BENCH_RECORDS=100000` for a quicker, smaller run.)

#[path = "common/fleet_gpus.rs"]
mod fleet_gpus;
use fleet_gpus::GPUS;

use std::io::{BufReader, BufWriter, Write};
use std::time::Instant;

use gpufit::core::advisor::{suggest, AdviceRequest, Strategy, StrategyTargets};
use gpufit::core::catalog::GpuSpec;
use gpufit::core::settings::Pins;
use gpufit::core::similarity::HistoryQuery;
use gpufit::core::workload::{
    ArchKind, Attention, Framework, LoraConfig, LoraTarget, Method, ModelArch, Optimizer, Sharding,
    Workload,
};
use gpufit::history::jsonl::{ImportOptions, JsonlReader, Resolver, ThreadedReader};
use gpufit::history::sqlite::SqliteStore;
use gpufit::history::HistoryStore;
use rand::{Rng, SeedableRng};

const MODELS: usize = 100;
/// 20 sequence lengths, each 25 % above the last: no two within the 10 %
/// similarity window, so every (model, GPU, seq) is its own key.
fn seq_lens() -> Vec<u32> {
    (0..20)
        .map(|k| (512.0 * 1.25f64.powi(k)).round() as u32)
        .collect()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn main() {
    let n: usize = std::env::var("GPUFIT_BENCH_RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let seqs = seq_lens();
    let keys = MODELS * GPUS.len() * seqs.len();
    let dir = tempfile::tempdir().expect("temp dir");
    let src = dir.path().join("run_logs.jsonl");

    // --- generate the file (not timed) ---
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    {
        let mut w = BufWriter::new(std::fs::File::create(&src).expect("create jsonl"));
        for i in 0..n {
            let key = i % keys;
            let model = key / (GPUS.len() * seqs.len());
            let gpu = GPUS[(key / seqs.len()) % GPUS.len()];
            let seq = seqs[key % seqs.len()];
            let batch: u32 = rng.gen_range(1..=64);
            let oom = batch > 48;
            // within the card: the store refuses a peak above the GPU's
            // memory (bad data), so the bench's records must be plausible
            let card_gb = gpufit::core::catalog::lookup_gpu(gpu)
                .map(|g| g.memory_bytes as f64 / 1e9)
                .expect("bench GPU in the catalog");
            let peak = card_gb * (0.15 + 0.8 * batch as f64 / 64.0);
            let ts = 1_700_000_000 + i as u64;
            writeln!(
                w,
                r#"{{"timestamp": {ts}, "config": {{"model": "bench-org/lora-model-{model}", "max_seq_length": {seq}, "batch_size": {batch}, "dtype": "bf16", "enable_activation_checkpointing": {}, "enable_activation_offloading": false, "compile": false, "gradient_accumulation_steps": 1}}, "result": {{"success": {}, "peak_memory_gb": {}, "samples_per_sec": {:.2}, "failure_reason": {}, "duration_sec": 600.0}}, "gpu_type": "{gpu}"}}"#,
                i % 2 == 0,
                !oom,
                if oom { "null".to_string() } else { format!("{peak:.2}") },
                batch as f64 * 0.7,
                if oom { r#""OOM""# } else { "null" },
            )
            .expect("write jsonl");
        }
    }
    let size = std::fs::metadata(&src).map(|m| m.len()).unwrap_or(0);
    println!(
        "history_speed: {n} lines ({:.0} MB) over {keys} keys",
        size as f64 / 1e6
    );

    // --- parse only (reader, no store) ---
    let t = Instant::now();
    let f = std::fs::File::open(&src).expect("open jsonl");
    let rd = JsonlReader::new(
        BufReader::with_capacity(1 << 20, f),
        "bench",
        ImportOptions::default(),
    );
    let parsed = rd.filter(|r| r.is_ok()).count();
    let parse_s = t.elapsed().as_secs_f64();

    // --- import into SQLite as `gpufit history import` does: one
    // transaction, one prepared statement, the parsing on its own thread ---
    let db = dir.path().join("history.db");
    let store = SqliteStore::open(&db).expect("open sqlite");
    let t = Instant::now();
    let f = std::fs::File::open(&src).expect("open jsonl");
    let mut rd = ThreadedReader::spawn(
        BufReader::with_capacity(1 << 20, f),
        "bench",
        ImportOptions::default(),
    )
    .expect("reader thread");
    let stored = store.record_batch_keyed(&mut rd).expect("import");
    let import_s = t.elapsed().as_secs_f64();
    assert_eq!(rd.finish().imported as usize, n);
    assert_eq!(stored as usize, n);
    assert_eq!(parsed, n);
    println!(
        "import: {stored} records in {import_s:.2} s ({:.0} lines/s); JSON parsing + validation alone {parse_s:.2} s ({:.2} of the import, on the reader's thread beside the inserts); target ≤ 15 s for 1 000 000",
        stored as f64 / import_s,
        parse_s / import_s
    );

    // --- similar() latency: random keys, every query hits ~n/keys records ---
    let queries = 10_000;
    let mut resolver = Resolver::default();
    let mut lat = Vec::with_capacity(queries);
    let mut hits = 0usize;
    for _ in 0..queries {
        let key = rng.gen_range(0..keys);
        let model = key / (GPUS.len() * seqs.len());
        let gpu = GPUS[(key / seqs.len()) % GPUS.len()];
        let seq = seqs[key % seqs.len()];
        // The id and method exactly as the import resolved them.
        let (id, method) = resolver.model(&format!("bench-org/lora-model-{model}"));
        let q = HistoryQuery::new(&id, method, &resolver.gpu(gpu), seq);
        let t = Instant::now();
        let got = store.similar(&q).expect("similar");
        lat.push(t.elapsed().as_secs_f64() * 1e3);
        hits += got.len();
    }
    lat.sort_by(|a, b| a.total_cmp(b));
    println!(
        "similar(): {queries} queries, {:.1} records each on average: p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
        hits as f64 / queries as f64,
        percentile(&lat, 0.50),
        percentile(&lat, 0.99),
        lat[lat.len() - 1]
    );

    // --- full suggest: store query + advisor, as `gpufit suggest` does ---
    let mut lat = Vec::with_capacity(queries);
    let mut sources = std::collections::BTreeMap::<String, usize>::new();
    let mut failed = 0usize;
    let mut first_err = None;
    for _ in 0..queries {
        let key = rng.gen_range(0..keys);
        let model = key / (GPUS.len() * seqs.len());
        let gpu_name = GPUS[(key / seqs.len()) % GPUS.len()];
        let seq = seqs[key % seqs.len()];
        let (id, method) = resolver.model(&format!("bench-org/lora-model-{model}"));
        let gpu = gpufit::core::catalog::lookup_gpu(gpu_name)
            .unwrap_or_else(|_| bench_gpu(&resolver.gpu(gpu_name)));
        let workload = bench_workload(&id, method, seq);
        let pins = Pins::default();
        let t = Instant::now();
        let history = store
            .similar(&HistoryQuery::new(
                &workload.model.name,
                workload.method,
                &gpu.name,
                seq,
            ))
            .expect("similar");
        let res = suggest(&AdviceRequest {
            workload: &workload,
            gpu: &gpu,
            strategy: Strategy::Balanced,
            targets: StrategyTargets::default(),
            pins: &pins,
            history: &history,
        });
        lat.push(t.elapsed().as_secs_f64() * 1e3);
        match res {
            Ok(s) => *sources.entry(format!("{:?}", s.source)).or_default() += 1,
            Err(e) => {
                failed += 1;
                first_err.get_or_insert_with(|| e.to_string());
            }
        }
    }
    lat.sort_by(|a, b| a.total_cmp(b));
    println!(
        "suggest (similar() + advisor): {queries} suggestions: p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms; targets p50 ≤ 2 ms, p99 ≤ 10 ms; sources {sources:?}",
        percentile(&lat, 0.50),
        percentile(&lat, 0.99),
        lat[lat.len() - 1]
    );
    if let Some(e) = first_err {
        println!("  note: {failed} of {queries} suggestions returned an error, e.g.: {e}");
    }
}

/// An 80 GiB A100-class GPU under the benchmark's GPU name (used only if
/// the catalog does not know the name).
fn bench_gpu(name: &str) -> GpuSpec {
    GpuSpec {
        name: name.to_string(),
        memory_bytes: 80 * (1 << 30),
        compute_capability: "8.0".into(),
        bf16: true,
        fp8: false,
        bf16_tflops: 312.0,
        fp32_tflops: 19.5,
        memory_bandwidth_gbs: 2039.0,
    }
}

/// A Llama-3.1-8B-shaped LoRA workload (numbers from its config.json) under
/// the benchmark's model id.
fn bench_workload(id: &str, method: Method, seq_len: u32) -> Workload {
    Workload {
        model: ModelArch {
            name: id.to_string(),
            kind: ArchKind::DecoderOnly,
            params: 8_030_261_248,
            hidden_size: 4096,
            num_layers: 32,
            num_attention_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            intermediate_size: 14336,
            vocab_size: 128_256,
            tied_embeddings: false,
            gated_mlp: true,
            num_experts: 1,
            experts_per_token: 1,
            max_position_embeddings: 131_072,
            quirks: Default::default(),
        },
        method,
        lora: Some(LoraConfig {
            rank: 16,
            targets: vec![LoraTarget::Q, LoraTarget::V],
        }),
        seq_len,
        optimizer: Optimizer::Adamw,
        global_batch: None,
        gpus: 1,
        sharding: Sharding::None,
        framework: Framework::Torchtune,
        attention: Attention::Sdpa,
    }
}
