//! Convergence benchmark: does the advisor learn a workload's real memory
//! curve in few runs without running out of memory?
//!
//! A simulated fleet of workloads × GPU models. Each workload's true peak is
//! `F + S × m` where F and S differ from gpufit's own estimate by random
//! factors (F × U(0.8, 1.2), S × U(0.6, 1.4)), measured with 1.5 % noise
//! (σ, clipped at 2.7 σ ≈ ±4 %), and a run whose measured peak exceeds the GPU's memory
//! fails with OOM. The advisor never sees F or S: only the run records.
//!
//! Loop per workload: suggest (balanced) → "run" → record, R times. Reported:
//! runs recorded until the suggestion is within 10 % of the best batch under
//! the balanced target (b* = max m with F + S m ≤ 0.85 C), and OOM runs as a
//! share of all runs; median and p90 over the fleet. Two baselines run the
//! same fleet: (a) largest success extrapolated linearly through zero to
//! ≤ 90 % of memory, at most doubling per step; (b) binary search from 1.
//!
//! Run: `cargo bench --bench convergence`.

use chrono::Utc;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use gpufit::core::advisor::{suggest, AdviceRequest, Strategy, StrategyTargets, MAX_MICRO_BATCH};
use gpufit::core::catalog::{lookup_gpu, lookup_model, GpuSpec};
use gpufit::core::learner::{error_stats_of, percentile};
use gpufit::core::memory::estimate;
use gpufit::core::run::{FailureReason, RunRecord, RunResult, RunSource};
use gpufit::core::settings::{Dtype, EngineeringSettings, Pins};
use gpufit::core::workload::{
    Attention, Framework, LoraConfig, LoraTarget, Method, Optimizer, Sharding, Workload,
};

/// Runs per workload.
const R: usize = 8;
/// Workloads in the fleet (before filtering those that cannot be learned).
const CANDIDATES: usize = 400;
const TARGET: f64 = 0.85;
const SEED: u64 = 20_261_122;

/// Knobs for sensitivity runs (defaults are the figures):
/// GPUFIT_BENCH_SEED, GPUFIT_BENCH_FIXED_SPREAD (0.2 = ±20 %),
/// GPUFIT_BENCH_SLOPE_SPREAD (0.4), GPUFIT_BENCH_NOISE (σ, 0.015).
fn knob(name: &str, default: f64) -> f64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

const MODELS: &[&str] = &[
    "Qwen/Qwen2.5-0.5B",
    "Qwen/Qwen2.5-1.5B",
    "meta-llama/Llama-3.2-1B",
    "meta-llama/Llama-3.2-3B",
    "google/gemma-2-2b",
    "microsoft/Phi-3-mini-4k-instruct",
    "meta-llama/Llama-3.1-8B",
    "mistralai/Mistral-7B-v0.3",
    "Qwen/Qwen2.5-7B",
    "openai-community/gpt2-medium",
];
const GPUS: &[&str] = &[
    "NVIDIA A100-SXM4-80GB",
    "NVIDIA A100-SXM4-40GB",
    "NVIDIA H100 80GB HBM3",
    "NVIDIA L4",
    "NVIDIA GeForce RTX 4090",
    "NVIDIA A10G",
    "NVIDIA L40S",
];
const SEQS: &[u32] = &[512, 1024, 2048, 4096];

/// One simulated workload with its hidden true curve.
struct Case {
    w: Workload,
    gpu: GpuSpec,
    pins: Pins,
    fixed: f64,
    slope: f64,
    capacity: f64,
    best: u32,
}

impl Case {
    fn true_mean(&self, m: u32) -> f64 {
        self.fixed + self.slope * m as f64
    }

    fn within(&self, m: u32) -> bool {
        (m as f64 - self.best as f64).abs() <= 0.1 * self.best as f64
    }

    /// Runs micro batch m: measured peak, or None for OOM.
    fn run(&self, m: u32, rng: &mut StdRng) -> Option<u64> {
        let sigma = knob("GPUFIT_BENCH_NOISE", 0.015);
        let noise = (normal(rng) * sigma).clamp(-2.7 * sigma, 2.7 * sigma);
        let peak = self.true_mean(m) * (1.0 + noise);
        (peak <= self.capacity).then_some(peak as u64)
    }
}

fn normal(rng: &mut StdRng) -> f64 {
    // Box–Muller.
    let u1: f64 = rng.gen_range(f64::EPSILON..1.0);
    let u2: f64 = rng.gen();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

fn fleet(rng: &mut StdRng) -> Vec<Case> {
    let mut out: Vec<Case> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for _ in 0..CANDIDATES {
        let model = MODELS[rng.gen_range(0..MODELS.len())];
        let gpu_name = GPUS[rng.gen_range(0..GPUS.len())];
        let seq = SEQS[rng.gen_range(0..SEQS.len())];
        let method = [Method::Full, Method::Lora, Method::Qlora][rng.gen_range(0..3)];
        let ckpt = rng.gen_bool(0.4);
        if !seen.insert((model, gpu_name, seq, method, ckpt)) {
            continue;
        }
        let (Ok(m), Ok(gpu)) = (lookup_model(model), lookup_gpu(gpu_name)) else {
            continue;
        };
        let w = Workload {
            model: m.arch,
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
            framework: Framework::Torchtune,
            attention: Attention::Sdpa,
        };
        if w.validate().is_err() {
            continue;
        }
        let settings = |mb: u32| EngineeringSettings {
            micro_batch_size: mb,
            dtype: Dtype::Bf16,
            activation_checkpointing: ckpt,
            ..EngineeringSettings::default()
        };
        let (Ok(e1), Ok(e2)) = (estimate(&w, &settings(1)), estimate(&w, &settings(2))) else {
            continue;
        };
        let slope_e = e2.peak_bytes as f64 - e1.peak_bytes as f64;
        let fixed_e = e1.peak_bytes as f64 - slope_e;
        if slope_e <= 0.0 || fixed_e <= 0.0 {
            continue;
        }
        let fs = knob("GPUFIT_BENCH_FIXED_SPREAD", 0.2);
        let ss = knob("GPUFIT_BENCH_SLOPE_SPREAD", 0.4);
        let fixed = fixed_e * rng.gen_range(1.0 - fs..1.0 + fs);
        let slope = slope_e * rng.gen_range(1.0 - ss..1.0 + ss);
        let capacity = gpu.memory_bytes as f64;
        let best = ((TARGET * capacity - fixed) / slope).floor();
        // Learnable: something to find (≥ 2) within the advisor's range.
        if !(2.0..=MAX_MICRO_BATCH as f64).contains(&best) {
            continue;
        }
        out.push(Case {
            w,
            gpu,
            pins: Pins {
                dtype: Some(Dtype::Bf16),
                activation_checkpointing: Some(ckpt),
                compile: Some(false),
                ..Pins::default()
            },
            fixed,
            slope,
            capacity,
            best: best as u32,
        });
    }
    out
}

/// What one method did on one workload.
struct Outcome {
    /// Runs recorded before the suggestion was first within 10 % (R + 1: never).
    runs_to_target: usize,
    runs: usize,
    ooms: usize,
    /// OOMs among the runs made until the target was reached (inclusive of
    /// the run of the first good suggestion).
    ooms_until_target: usize,
    runs_until_target: usize,
}

fn record(c: &Case, m: u32, peak: Option<u64>, predicted: Option<u64>) -> RunRecord {
    RunRecord {
        id: None,
        timestamp: Utc::now(),
        cluster: None,
        node: None,
        source: RunSource::Cli,
        job_id: None,
        model: c.w.model.name.clone(),
        method: c.w.method,
        gpu_model: c.gpu.name.clone(),
        seq_len: c.w.seq_len,
        lora_rank: c.w.lora.as_ref().map(|l| l.rank),
        gpus: 1,
        global_batch: None,
        settings: EngineeringSettings {
            micro_batch_size: m,
            dtype: c.pins.dtype.unwrap_or(Dtype::Bf16),
            activation_checkpointing: c.pins.activation_checkpointing.unwrap_or(false),
            ..EngineeringSettings::default()
        },
        result: RunResult {
            success: peak.is_some(),
            failure_reason: peak.is_none().then_some(FailureReason::Oom),
            peak_memory_bytes: peak,
            samples_per_sec: None,
            tokens_per_sec: None,
            duration_sec: None,
        },
        predicted_peak_bytes: predicted,
    }
}

/// Drives one method: `next(history)` gives the next batch (None: gives up).
fn drive(
    c: &Case,
    rng: &mut StdRng,
    mut next: impl FnMut(&[RunRecord]) -> Option<(u32, Option<u64>)>,
    history: &mut Vec<RunRecord>,
) -> Outcome {
    let mut o = Outcome {
        runs_to_target: R + 1,
        runs: 0,
        ooms: 0,
        ooms_until_target: 0,
        runs_until_target: 0,
    };
    for k in 0..R {
        let Some((m, predicted)) = next(history) else {
            break;
        };
        if o.runs_to_target > R && c.within(m) {
            o.runs_to_target = k;
            // The run of the good suggestion is part of getting there.
            o.runs_until_target = k + 1;
        }
        let peak = c.run(m, rng);
        o.runs += 1;
        if peak.is_none() {
            o.ooms += 1;
            if o.runs_to_target > R || o.runs_until_target == k + 1 {
                o.ooms_until_target += 1;
            }
        }
        history.push(record(c, m, peak, predicted));
    }
    if o.runs_to_target > R {
        o.runs_until_target = o.runs;
    }
    o
}

fn gpufit(c: &Case, h: &[RunRecord]) -> Option<(u32, Option<u64>)> {
    let req = AdviceRequest {
        workload: &c.w,
        gpu: &c.gpu,
        strategy: Strategy::Balanced,
        targets: StrategyTargets::default(),
        pins: &c.pins,
        history: h,
    };
    let s = suggest(&req).ok()?;
    Some((s.settings.micro_batch_size, Some(s.predicted_peak_bytes)))
}

fn mine<'h>(c: &Case, h: &'h [RunRecord]) -> impl Iterator<Item = &'h RunRecord> {
    let (name, gpu, seq) = (c.w.model.name.clone(), c.gpu.name.clone(), c.w.seq_len);
    let (method, ckpt) = (c.w.method, c.pins.activation_checkpointing);
    h.iter().filter(move |r| {
        r.model == name
            && r.gpu_model == gpu
            && r.seq_len == seq
            && r.method == method
            && Some(r.settings.activation_checkpointing) == ckpt
    })
}

/// (a) Largest success, extrapolated linearly through zero to ≤ 90 % of
/// memory, at most doubling per step; below the smallest OOM.
fn baseline_linear(c: &Case, h: &[RunRecord]) -> Option<(u32, Option<u64>)> {
    let runs: Vec<&RunRecord> = mine(c, h).collect();
    let oom = runs
        .iter()
        .filter(|r| !r.result.success)
        .map(|r| r.settings.micro_batch_size)
        .min();
    let best = runs
        .iter()
        .filter(|r| r.result.success)
        .filter_map(|r| Some((r.settings.micro_batch_size, r.result.peak_memory_bytes?)))
        .max();
    let m = match (best, oom) {
        (None, None) => 1,
        (None, Some(o)) => (o / 2).max(1),
        (Some((m, p)), oom) => {
            let ext = (m as f64 * 0.9 * c.capacity / p as f64).floor() as u32;
            let mut n = ext.min(2 * m).max(m);
            if let Some(o) = oom {
                n = n.min(o.saturating_sub(1)).max(m.min(o.saturating_sub(1)));
            }
            n.max(1)
        }
    };
    if oom == Some(1) {
        return None;
    }
    Some((m, None))
}

/// (b) Binary search from 1: double until the first OOM, then bisect.
fn baseline_binary(c: &Case, h: &[RunRecord]) -> Option<(u32, Option<u64>)> {
    let runs: Vec<&RunRecord> = mine(c, h).collect();
    let lo = runs
        .iter()
        .filter(|r| r.result.success)
        .map(|r| r.settings.micro_batch_size)
        .max()
        .unwrap_or(0);
    let hi = runs
        .iter()
        .filter(|r| !r.result.success)
        .map(|r| r.settings.micro_batch_size)
        .min();
    let m = match hi {
        None => (2 * lo).max(1),
        Some(hi) if hi <= lo + 1 => lo.max(1),
        Some(hi) => lo + (hi - lo) / 2,
    };
    if m == 0 || hi == Some(1) {
        return None;
    }
    Some((m, None))
}

struct Summary {
    name: &'static str,
    median: f64,
    p90: f64,
    mean: f64,
    never: usize,
    oom_share: f64,
    oom_share_until: f64,
}

fn summarize(name: &'static str, o: &[Outcome]) -> Summary {
    let mut r: Vec<f64> = o.iter().map(|x| x.runs_to_target as f64).collect();
    r.sort_by(|a, b| a.total_cmp(b));
    let runs: usize = o.iter().map(|x| x.runs).sum();
    let ooms: usize = o.iter().map(|x| x.ooms).sum();
    let runs_u: usize = o.iter().map(|x| x.runs_until_target).sum();
    let ooms_u: usize = o.iter().map(|x| x.ooms_until_target).sum();
    Summary {
        name,
        median: percentile(&r, 0.5),
        p90: percentile(&r, 0.9),
        mean: r.iter().sum::<f64>() / r.len().max(1) as f64,
        never: o.iter().filter(|x| x.runs_to_target > R).count(),
        oom_share: ooms as f64 / runs.max(1) as f64,
        oom_share_until: ooms_u as f64 / runs_u.max(1) as f64,
    }
}

fn main() {
    let started = std::time::Instant::now();
    let seed = knob("GPUFIT_BENCH_SEED", SEED as f64) as u64;
    let mut rng = StdRng::seed_from_u64(seed);
    let cases = fleet(&mut rng);
    if cases.len() < 50 {
        eprintln!(
            "only {} learnable workloads in the fleet (need ≥ 50): is the catalog/estimator in place?",
            cases.len()
        );
        std::process::exit(1);
    }
    let gpus: std::collections::HashSet<&str> = cases.iter().map(|c| c.gpu.name.as_str()).collect();
    let models: std::collections::HashSet<&str> =
        cases.iter().map(|c| c.w.model.name.as_str()).collect();
    println!(
        "fleet: {} workloads ({} models × {} GPU models × methods × sequence lengths × checkpointing), {R} runs each, seed {seed}, true fixed ±{:.0} %, slope ±{:.0} %, noise σ {:.1} %",
        cases.len(),
        models.len(),
        gpus.len(),
        knob("GPUFIT_BENCH_FIXED_SPREAD", 0.2) * 100.0,
        knob("GPUFIT_BENCH_SLOPE_SPREAD", 0.4) * 100.0,
        knob("GPUFIT_BENCH_NOISE", 0.015) * 100.0
    );
    let mut fleet_history = Vec::new();
    let mut base_a = Vec::new();
    let mut base_b = Vec::new();
    let mut ours = Vec::new();
    let mut sim = StdRng::seed_from_u64(seed ^ 0x5eed);
    for c in &cases {
        ours.push(drive(c, &mut sim, |h| gpufit(c, h), &mut fleet_history));
    }
    let mut h_a = Vec::new();
    let mut h_b = Vec::new();
    let mut sim = StdRng::seed_from_u64(seed ^ 0x5eed);
    for c in &cases {
        base_a.push(drive(c, &mut sim, |h| baseline_linear(c, h), &mut h_a));
    }
    let mut sim = StdRng::seed_from_u64(seed ^ 0x5eed);
    for c in &cases {
        base_b.push(drive(c, &mut sim, |h| baseline_binary(c, h), &mut h_b));
    }
    let s = [
        summarize("gpufit (balanced)", &ours),
        summarize("(a) linear through zero, ≤90 %, ≤2×/step", &base_a),
        summarize("(b) binary search from 1", &base_b),
    ];
    println!(
        "\n{:<44} {:>7} {:>5} {:>6} {:>7} {:>10} {:>14}",
        "method", "median", "p90", "mean", "never", "OOM share", "OOM until b*"
    );
    for x in &s {
        println!(
            "{:<44} {:>7.1} {:>5.1} {:>6.2} {:>7} {:>9.1}% {:>13.1}%",
            x.name,
            x.median,
            x.p90,
            x.mean,
            x.never,
            x.oom_share * 100.0,
            x.oom_share_until * 100.0
        );
    }
    println!("(runs recorded until the suggestion is within 10 % of b*; never = not within {R} runs, counted as {})", R + 1);
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    println!(
        "\nmean runs-to-target ratio gpufit / (a) = {:.2}, gpufit / (b) = {:.2}",
        ratio(s[0].mean, s[1].mean),
        ratio(s[0].mean, s[2].mean)
    );
    // Fleet prediction accuracy: first runs (model alone) vs later runs.
    let mut first = Vec::new();
    let mut later = Vec::new();
    for c in &cases {
        for (i, r) in mine(c, &fleet_history).enumerate() {
            if let Some(e) = r.prediction_error() {
                if i == 0 {
                    first.push(e)
                } else if i >= 2 {
                    later.push(e)
                }
            }
        }
    }
    let (f, l) = (error_stats_of(&first), error_stats_of(&later));
    println!(
        "prediction error |pred−meas|/meas: first run (memory model alone) median {:.1} % p90 {:.1} %; runs ≥3 (learned) median {:.1} % p90 {:.1} %",
        f.median_abs * 100.0,
        f.p90_abs * 100.0,
        l.median_abs * 100.0,
        l.p90_abs * 100.0
    );
    let pass = |ok: bool| if ok { "PASS" } else { "MISS" };
    println!("\ntargets for gpufit:");
    println!(
        "  median ≤ 2 runs:            {} ({:.1})",
        pass(s[0].median <= 2.0),
        s[0].median
    );
    println!(
        "  p90 ≤ 3 runs:               {} ({:.1})",
        pass(s[0].p90 <= 3.0),
        s[0].p90
    );
    println!(
        "  OOM share ≤ 2 %:            {} ({:.1} %)",
        pass(s[0].oom_share <= 0.02),
        s[0].oom_share * 100.0
    );
    println!(
        "  better than both baselines: {} (mean {:.2} vs {:.2} / {:.2}; median {:.1} vs {:.1} / {:.1})",
        pass(s[0].mean < s[1].mean && s[0].mean < s[2].mean && s[0].median <= s[1].median && s[0].median <= s[2].median),
        s[0].mean,
        s[1].mean,
        s[2].mean,
        s[0].median,
        s[1].median,
        s[2].median
    );
    println!("\nwall time {:.1}s", started.elapsed().as_secs_f64());
}
