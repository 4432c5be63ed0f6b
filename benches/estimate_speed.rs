//! Speed of the memory model: one `estimate` plus one `max_micro_batch`
//! for a workload (what the advisor does per candidate), median and p99
//! over many runs, for a few workloads.
//!
//! Run: `cargo bench --bench estimate_speed`. Target (issue 2): < 20 µs
//! median for estimate + largest fitting micro batch.

use std::hint::black_box;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use gpufit::core::catalog::{lookup_gpu, lookup_model};
use gpufit::core::memory::{estimate, max_micro_batch};
use gpufit::core::settings::{Dtype, EngineeringSettings};
use gpufit::core::workload::{
    Attention, Framework, LoraConfig, LoraTarget, Method, Optimizer, Sharding, Workload,
};

const TARGET: Duration = Duration::from_micros(20);

fn workload(model: &str, method: Method, seq: u32) -> Option<Workload> {
    Some(Workload {
        model: lookup_model(model).ok()?.arch,
        method,
        lora: (method != Method::Full).then(|| LoraConfig {
            rank: 16,
            targets: vec![LoraTarget::Q, LoraTarget::K, LoraTarget::V, LoraTarget::O],
        }),
        seq_len: seq,
        optimizer: Optimizer::Adamw,
        global_batch: None,
        gpus: 1,
        sharding: Sharding::None,
        framework: Framework::Hf,
        attention: Attention::Sdpa,
    })
}

fn main() -> ExitCode {
    let Ok(gpu) = lookup_gpu("NVIDIA A100-SXM4-80GB") else {
        eprintln!("catalog has no A100 80GB");
        return ExitCode::FAILURE;
    };
    let cases = [
        (
            "llama-3.1-8b lora seq 2048",
            workload("llama-3.1-8b", Method::Lora, 2048),
        ),
        (
            "qwen2.5-0.5b full seq 1024",
            workload("qwen2.5-0.5b", Method::Full, 1024),
        ),
        (
            "mixtral-8x7b qlora seq 4096",
            workload("mixtral-8x7b", Method::Qlora, 4096),
        ),
        (
            "gpt2 full seq 1024 (tiny: big batches)",
            workload("gpt2", Method::Full, 1024),
        ),
    ];
    let settings = EngineeringSettings {
        micro_batch_size: 2,
        dtype: Dtype::Bf16,
        activation_checkpointing: true,
        ..Default::default()
    };
    const RUNS: usize = 20_000;
    let mut worst_median = Duration::ZERO;
    println!(
        "{:<42} {:>10} {:>10} {:>9}",
        "workload", "median", "p99", "max batch"
    );
    for (name, w) in cases {
        let Some(w) = w else {
            eprintln!("unknown model in case {name}");
            return ExitCode::FAILURE;
        };
        let mut times = Vec::with_capacity(RUNS);
        let mut batch = None;
        for _ in 0..RUNS {
            let t = Instant::now();
            let e = estimate(black_box(&w), black_box(&settings));
            let m = max_micro_batch(black_box(&w), black_box(&settings), gpu.memory_bytes);
            times.push(t.elapsed());
            black_box(&e);
            batch = m.ok().flatten();
        }
        times.sort();
        let median = times[RUNS / 2];
        let p99 = times[RUNS * 99 / 100];
        worst_median = worst_median.max(median);
        println!(
            "{name:<42} {:>8.2}µs {:>8.2}µs {:>9}",
            median.as_secs_f64() * 1e6,
            p99.as_secs_f64() * 1e6,
            batch
                .map(|b| b.to_string())
                .unwrap_or_else(|| "none".into())
        );
    }
    println!(
        "\nslowest median: {:.2}µs (target < {}µs): {}",
        worst_median.as_secs_f64() * 1e6,
        TARGET.as_micros(),
        if worst_median < TARGET {
            "met"
        } else {
            "NOT met"
        }
    );
    if worst_median < TARGET {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
