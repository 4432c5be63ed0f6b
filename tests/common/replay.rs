//! Replays gpufit's loop — suggest → run → record → suggest again — against
//! throughput and peak memory measured on a real H100
//! (`bench/data/h100/throughput.csv`, see its README). A suggested
//! (dtype, checkpointing, micro batch) is looked up in the table, linearly
//! interpolated between measured micro batches; at or past the first OOM of
//! that series, or where the interpolated peak exceeds the card, the run
//! runs out of memory. Shared by `tests/replay.rs` (targets) and
//! `benches/replay.rs` (the figures).

// Each consumer (a test, a benchmark) uses part of this module.
#![allow(dead_code)]

use gpufit::core::run::RunOutcome;
use std::collections::HashMap;
use std::path::Path;

use chrono::Utc;
use gpufit::core::advisor::{self, AdviceRequest, Strategy, StrategyTargets};
use gpufit::core::catalog::{lookup_gpu, lookup_model, GpuSpec};
use gpufit::core::memory::default_lora_targets;
use gpufit::core::run::{RunRecord, RunResult, RunSource};
use gpufit::core::settings::{Dtype, EngineeringSettings, Pins};
use gpufit::core::workload::{
    Attention, Framework, LoraConfig, Method, Optimizer, Sharding, Workload,
};

/// Runs replayed per workload.
pub const RUNS: usize = 6;

#[derive(Debug, Clone, Copy)]
struct Point {
    m: u32,
    ok: bool,
    device: f64,
    tps: f64,
}

/// One workload of the table with its measured series.
pub struct Workload_ {
    pub name: String,
    pub w: Workload,
    series: HashMap<(Dtype, bool), Vec<Point>>,
}

/// What one replayed run gave.
#[derive(Debug, Clone)]
pub struct Step {
    pub dtype: Dtype,
    pub ckpt: bool,
    pub m: u32,
    pub oom: bool,
    pub tokens_per_sec: f64,
    pub predicted_peak: f64,
    pub measured_peak: f64,
    /// tokens/s as a fraction of the best feasible setting (0 for an OOM).
    pub fraction: f64,
}

pub struct Outcome {
    pub name: String,
    pub best: (Dtype, bool, u32, f64),
    pub best_any_dtype: f64,
    pub steps: Vec<Step>,
}

impl Outcome {
    pub fn ooms(&self) -> usize {
        self.steps.iter().filter(|s| s.oom).count()
    }
    /// Runs until the first within 3 % of the best (1-based; None: never).
    pub fn runs_to_within_3pct(&self) -> Option<usize> {
        self.steps
            .iter()
            .position(|s| s.fraction >= 0.97)
            .map(|i| i + 1)
    }
}

fn parse_dtype(s: &str) -> Option<Dtype> {
    s.parse().ok()
}

/// Reads the table: one workload per distinct `workload` column.
pub fn load(path: &Path) -> Vec<Workload_> {
    let text = std::fs::read_to_string(path).expect("throughput.csv");
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).expect(name);
    let (c_wl, c_model, c_method, c_seq, c_attn, c_dtype, c_ckpt, c_m, c_status, c_dev, c_tps) = (
        col("workload"),
        col("model"),
        col("method"),
        col("seq_len"),
        col("attention"),
        col("dtype"),
        col("checkpointing"),
        col("micro_batch"),
        col("status"),
        col("device_bytes"),
        col("tokens_per_sec"),
    );
    let mut out: Vec<Workload_> = Vec::new();
    for line in lines.filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split(',').collect();
        let name = f[c_wl].to_string();
        if !out.iter().any(|x| x.name == name) {
            let method: Method = f[c_method].parse().expect("method");
            let attention = match f[c_attn] {
                "eager" => Attention::Eager,
                _ => Attention::Sdpa,
            };
            let w = Workload {
                model: lookup_model(f[c_model]).expect("catalog model").arch,
                method,
                lora: (method != Method::Full).then(|| LoraConfig {
                    rank: 16,
                    targets: default_lora_targets(Framework::Hf),
                }),
                seq_len: f[c_seq].parse().expect("seq"),
                optimizer: Optimizer::Adamw,
                global_batch: None,
                gpus: 1,
                sharding: Sharding::None,
                framework: Framework::Hf,
                attention,
            };
            out.push(Workload_ {
                name: name.clone(),
                w,
                series: HashMap::new(),
            });
        }
        let Some(dtype) = parse_dtype(f[c_dtype]) else {
            continue;
        };
        let ckpt = f[c_ckpt] == "on";
        let ok = f[c_status] == "ok";
        let p = Point {
            m: f[c_m].parse().expect("micro batch"),
            ok,
            device: f[c_dev].parse().unwrap_or(0.0),
            tps: f[c_tps].parse().unwrap_or(0.0),
        };
        let wl = out.iter_mut().find(|x| x.name == name).expect("workload");
        wl.series.entry((dtype, ckpt)).or_default().push(p);
    }
    for wl in &mut out {
        for s in wl.series.values_mut() {
            s.sort_by_key(|p| p.m);
        }
    }
    out
}

impl Workload_ {
    /// (device peak, tokens/s) of a run, or None for an OOM.
    fn run(&self, dtype: Dtype, ckpt: bool, m: u32, capacity: f64) -> Option<(f64, f64)> {
        let s = self.series.get(&(dtype, ckpt))?;
        if s.iter().any(|p| !p.ok && p.m <= m) {
            return None;
        }
        let ok: Vec<&Point> = s.iter().filter(|p| p.ok).collect();
        if let Some(p) = ok.iter().find(|p| p.m == m) {
            return Some((p.device, p.tps));
        }
        let below = ok.iter().rev().find(|p| p.m < m);
        let above = ok.iter().find(|p| p.m > m);
        let (dev, tps) = match (below, above) {
            (Some(a), Some(b)) => {
                let t = (m - a.m) as f64 / (b.m - a.m) as f64;
                (
                    a.device + t * (b.device - a.device),
                    a.tps + t * (b.tps - a.tps),
                )
            }
            (Some(b), None) => {
                // Past the last measured batch: the peak goes on along the
                // last two points, throughput stays.
                let prev = ok.iter().rev().nth(1).copied().unwrap_or(b);
                let slope = if b.m > prev.m {
                    (b.device - prev.device) / (b.m - prev.m) as f64
                } else {
                    0.0
                };
                (b.device + slope * (m - b.m) as f64, b.tps)
            }
            (None, Some(a)) => (a.device, a.tps * m as f64 / a.m as f64),
            (None, None) => return None,
        };
        (dev <= capacity).then_some((dev, tps))
    }

    /// Best tokens/s among measured rows under `budget`, over `dtypes`.
    fn best(&self, dtypes: &[Dtype], budget: f64) -> Option<(Dtype, bool, u32, f64)> {
        self.series
            .iter()
            .filter(|((d, _), _)| dtypes.contains(d))
            .flat_map(|((d, c), s)| s.iter().map(move |p| (*d, *c, *p)))
            .filter(|(_, _, p)| p.ok && p.device <= budget)
            .map(|(d, c, p)| (d, c, p.m, p.tps))
            .max_by(|a, b| a.3.total_cmp(&b.3))
    }
}

fn record(
    wl: &Workload_,
    gpu: &GpuSpec,
    s: &EngineeringSettings,
    res: Option<(f64, f64)>,
    predicted: u64,
) -> RunRecord {
    RunRecord {
        confirmation: Default::default(),
        nodes: None,
        id: None,
        timestamp: Utc::now(),
        cluster: None,
        node: None,
        source: RunSource::Cli,
        job_id: None,
        model: wl.w.model.name.clone(),
        method: wl.w.method,
        gpu_model: gpu.name.clone(),
        seq_len: wl.w.seq_len,
        lora_rank: wl.w.lora.as_ref().map(|l| l.rank),
        gpus: 1,
        global_batch: None,
        settings: s.clone(),
        result: RunResult {
            outcome: RunOutcome::of(res.is_some(), res.is_none(), false),
            peak_memory_bytes: res.map(|(d, _)| d as u64),
            samples_per_sec: res.map(|(_, t)| t / wl.w.seq_len as f64),
            tokens_per_sec: res.map(|(_, t)| t),
            duration_sec: Some(600.0),
        },
        predicted_peak_bytes: Some(predicted),
    }
}

/// Replays every workload of the table.
pub fn replay(path: &Path) -> Vec<Outcome> {
    let gpu = lookup_gpu("NVIDIA H100 80GB HBM3").expect("H100 in the catalog");
    let capacity = gpu.memory_bytes as f64;
    let targets = StrategyTargets::default();
    let budget = targets.balanced * capacity;
    // The table has no compiled series: compile is pinned off.
    let pins = Pins {
        compile: Some(false),
        ..Pins::default()
    };
    let mut out = Vec::new();
    for wl in load(path) {
        // "Best" among the precisions gpufit's policy may pick for an HF
        // job: a LoRA base in bf16; a full fine-tune with fp32 master
        // weights (pure bf16 only where nothing else meets the target).
        let allowed: Vec<Dtype> = match wl.w.method {
            Method::Full => vec![Dtype::Bf16Mixed],
            _ => vec![Dtype::Bf16],
        };
        let best = wl.best(&allowed, budget).expect("a feasible row");
        let best_any = wl
            .best(&[Dtype::Bf16, Dtype::Bf16Mixed], budget)
            .map(|b| b.3)
            .unwrap_or(best.3);
        let mut history: Vec<RunRecord> = Vec::new();
        let mut steps = Vec::new();
        for _ in 0..RUNS {
            let req = AdviceRequest {
                workload: &wl.w,
                gpu: &gpu,
                strategy: Strategy::Balanced,
                targets,
                pins: &pins,
                history: &history,
            };
            let s = advisor::suggest(&req).expect("a suggestion");
            let st = &s.settings;
            let res = wl.run(
                st.dtype,
                st.activation_checkpointing,
                st.micro_batch_size,
                capacity,
            );
            steps.push(Step {
                dtype: st.dtype,
                ckpt: st.activation_checkpointing,
                m: st.micro_batch_size,
                oom: res.is_none(),
                tokens_per_sec: res.map(|r| r.1).unwrap_or(0.0),
                predicted_peak: s.predicted_peak_bytes as f64,
                measured_peak: res.map(|r| r.0).unwrap_or(f64::NAN),
                fraction: res.map(|r| r.1 / best.3).unwrap_or(0.0),
            });
            history.push(record(&wl, &gpu, st, res, s.predicted_peak_bytes));
        }
        out.push(Outcome {
            name: wl.name.clone(),
            best,
            best_any_dtype: best_any,
            steps,
        });
    }
    out
}

/// Median of a slice (upper median for an even count).
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}
