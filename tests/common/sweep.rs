//! The advisor's invariants, swept over the catalog: every model × method ×
//! framework × sequence length × GPU × strategy, with and without a global
//! batch, with no history. Shared by `tests/advisor_invariants.rs` (which
//! asserts every count is zero) and `benches/advisor_sweep.rs` (which prints
//! the counts).

// Each consumer (a test, a benchmark) uses part of this module.
#![allow(dead_code)]

use gpufit::core::advisor::{self, AdviceRequest, AdvisorError, Strategy, StrategyTargets};
use gpufit::core::catalog::{all_gpus, all_models, GpuSpec};
use gpufit::core::memory::{default_lora_targets, estimate};
use gpufit::core::settings::{Dtype, EngineeringSettings, Pins};
use gpufit::core::workload::{
    Attention, Framework, LoraConfig, Method, ModelArch, Optimizer, Sharding, Workload,
};

/// GPUs of the sweep: every memory class and both precision generations.
pub const GPUS: &[&str] = &[
    "Tesla T4",
    "Tesla V100-SXM2-32GB",
    "NVIDIA A10G",
    "NVIDIA GeForce RTX 4090",
    "NVIDIA L40S",
    "NVIDIA A100-SXM4-40GB",
    "NVIDIA A100-SXM4-80GB",
    "NVIDIA H100 80GB HBM3",
    "NVIDIA H200",
];
pub const SEQS: &[u32] = &[512, 2048, 8192];
pub const FRAMEWORKS: &[Framework] = &[
    Framework::Generic,
    Framework::Hf,
    Framework::Torchtune,
    Framework::Litgpt,
    Framework::Lightning,
];
pub const GLOBAL_BATCHES: &[Option<u32>] = &[None, Some(64)];

/// Violations of each invariant, with a few examples.
#[derive(Debug, Default)]
pub struct Counts {
    pub suggestions: usize,
    pub does_not_fit: usize,
    /// predicted_peak_bytes differs from `estimate` of the suggestion by > 1 %.
    pub prediction_not_estimate: usize,
    /// predicted above target × memory without an over-target warning at m = 1.
    pub over_target: usize,
    /// `estimate` of the suggestion above the card.
    pub over_card: usize,
    /// Without history: the first-run plan at the suggested micro batch
    /// (estimate + the stated margins, at least the framework's measured
    /// under-prediction) above the target, other than micro batch 1 with
    /// its over-target warning.
    pub plan_over_target: usize,
    /// m × a × W ≠ G.
    pub global_batch_broken: usize,
    /// conservative ≤ balanced ≤ aggressive broken.
    pub not_monotone: usize,
    /// At the micro-batch cap although the model does not fit that batch
    /// under the target.
    pub unjustified_cap: usize,
    /// "Does not fit" although the policy's half precision with
    /// checkpointing fits at micro batch 1.
    pub false_does_not_fit: usize,
    /// fp32 chosen unpinned on a bf16 GPU, or a LoRA/QLoRA base held in
    /// fp32 (fp32 or a -mixed dtype) unpinned.
    pub bad_precision: usize,
    /// Errors other than does-not-fit.
    pub errors: usize,
    pub examples: Vec<String>,
}

impl Counts {
    pub fn violations(&self) -> usize {
        self.prediction_not_estimate
            + self.over_target
            + self.over_card
            + self.plan_over_target
            + self.global_batch_broken
            + self.not_monotone
            + self.unjustified_cap
            + self.false_does_not_fit
            + self.bad_precision
            + self.errors
    }

    fn note(&mut self, what: &str, ctx: &str) {
        if self.examples.len() < 20 {
            self.examples.push(format!("{what}: {ctx}"));
        }
    }
}

/// The least memory any candidate of the precision policy needs at micro
/// batch 1: 16-bit with checkpointing (torchtune without bf16: fp32).
fn smallest_at_one(w: &Workload, gpu: &GpuSpec) -> Option<u64> {
    let dtype = if gpu.bf16 {
        Dtype::Bf16
    } else if w.framework == Framework::Torchtune {
        Dtype::Fp32
    } else if w.method == Method::Full {
        Dtype::Fp16Mixed
    } else {
        Dtype::Fp16
    };
    let per = w.global_batch.map(|g| g / w.gpus).unwrap_or(1);
    let s = EngineeringSettings {
        micro_batch_size: 1,
        gradient_accumulation_steps: per,
        dtype,
        activation_checkpointing: true,
        ..EngineeringSettings::default()
    };
    estimate(w, &s).ok().map(|e| e.peak_bytes)
}

/// Runs the sweep over `models` (None: the whole catalog).
pub fn sweep(models: Option<usize>) -> Counts {
    let mut c = Counts::default();
    let gpus: Vec<GpuSpec> = all_gpus()
        .into_iter()
        .filter(|g| GPUS.contains(&g.name.as_str()))
        .collect();
    assert_eq!(
        gpus.len(),
        GPUS.len(),
        "sweep GPUs missing from the catalog"
    );
    let targets = StrategyTargets::default();
    let pins = Pins::default();
    let catalog = all_models();
    let n = models.unwrap_or(catalog.len()).min(catalog.len());
    for arch in catalog.iter().take(n) {
        for method in [Method::Full, Method::Lora, Method::Qlora] {
            for &framework in FRAMEWORKS {
                for &seq in SEQS {
                    for &global_batch in GLOBAL_BATCHES {
                        let w = one_gpu_workload(arch, method, framework, seq, global_batch);
                        if w.validate().is_err() {
                            continue;
                        }
                        for gpu in &gpus {
                            check(&mut c, &w, gpu, &targets, &pins);
                        }
                    }
                }
            }
        }
    }
    c
}

fn check(c: &mut Counts, w: &Workload, gpu: &GpuSpec, targets: &StrategyTargets, pins: &Pins) {
    let ctx = format!(
        "{} {:?} {:?} seq {} G {:?} on {}",
        w.model.name, w.method, w.framework, w.seq_len, w.global_batch, gpu.name
    );
    let mut ms = Vec::new();
    for s in Strategy::ALL {
        let req = AdviceRequest {
            workload: w,
            gpu,
            strategy: s,
            targets: *targets,
            pins,
            history: &[],
        };
        match advisor::suggest(&req) {
            Ok(sug) => {
                c.suggestions += 1;
                let st = &sug.settings;
                ms.push(st.micro_batch_size);
                let est = match estimate(w, st) {
                    Ok(e) => e.peak_bytes as f64,
                    Err(e) => {
                        c.errors += 1;
                        c.note("estimate error", &format!("{ctx}: {e}"));
                        continue;
                    }
                };
                let p = sug.predicted_peak_bytes as f64;
                if (p - est).abs() > 0.01 * est {
                    c.prediction_not_estimate += 1;
                    c.note(
                        "prediction ≠ estimate",
                        &format!(
                            "{ctx} {s}: {p:.3e} vs {est:.3e} at m {}",
                            st.micro_batch_size
                        ),
                    );
                }
                let cap = gpu.memory_bytes as f64;
                let budget = targets.for_strategy(s) * cap;
                let warned = sug.warnings.iter().any(|w| w.contains("above the"));
                if p > budget && !(st.micro_batch_size == 1 && warned) {
                    c.over_target += 1;
                    c.note(
                        "over target",
                        &format!("{ctx} {s}: m {}", st.micro_batch_size),
                    );
                }
                if est > cap {
                    c.over_card += 1;
                    c.note("over card", &format!("{ctx} {s}"));
                }
                if let Ok(e) = estimate(w, st) {
                    let plan = advisor::first_run_plan(&e, w.framework);
                    if plan > budget * (1.0 + 1e-9) && !(st.micro_batch_size == 1 && warned) {
                        c.plan_over_target += 1;
                        c.note(
                            "plan over target",
                            &format!("{ctx} {s}: m {} plan {plan:.3e}", st.micro_batch_size),
                        );
                    }
                }
                if let Some(g) = w.global_batch {
                    if st.micro_batch_size * st.gradient_accumulation_steps * w.gpus != g {
                        c.global_batch_broken += 1;
                        c.note("global batch", &format!("{ctx} {s}"));
                    }
                }
                if st.micro_batch_size == advisor::MAX_MICRO_BATCH && est > budget {
                    c.unjustified_cap += 1;
                    c.note("cap", &format!("{ctx} {s}"));
                }
                let lora = w.method != Method::Full;
                let fp32_on_bf16 = gpu.bf16 && st.dtype == Dtype::Fp32;
                let lora_fp32_base = lora
                    && matches!(st.dtype, Dtype::Fp32 | Dtype::Bf16Mixed | Dtype::Fp16Mixed)
                    && !(st.dtype == Dtype::Fp32
                        && w.framework == Framework::Torchtune
                        && !gpu.bf16);
                if fp32_on_bf16 || lora_fp32_base {
                    c.bad_precision += 1;
                    c.note("precision", &format!("{ctx} {s}: {}", st.dtype));
                }
            }
            Err(AdvisorError::DoesNotFit { .. }) => {
                c.does_not_fit += 1;
                ms.push(0);
                if smallest_at_one(w, gpu).is_some_and(|p| p as f64 <= gpu.memory_bytes as f64) {
                    c.false_does_not_fit += 1;
                    c.note("false does-not-fit", &format!("{ctx} {s}"));
                }
            }
            Err(e) => {
                c.errors += 1;
                c.note("error", &format!("{ctx} {s}: {e}"));
            }
        }
    }
    if ms.len() == 3 && ms.iter().all(|&m| m > 0) && !(ms[0] <= ms[1] && ms[1] <= ms[2]) {
        c.not_monotone += 1;
        c.note("monotone", &format!("{ctx}: {ms:?}"));
    }
}

/// A one-GPU AdamW workload (LoRA rank 16 on the framework's default
/// targets for adapter methods, SDPA attention).
pub fn one_gpu_workload(
    arch: &ModelArch,
    method: Method,
    framework: Framework,
    seq: u32,
    global_batch: Option<u32>,
) -> Workload {
    Workload {
        model: arch.clone(),
        method,
        lora: (method != Method::Full).then(|| LoraConfig {
            rank: 16,
            targets: default_lora_targets(framework),
        }),
        seq_len: seq,
        optimizer: Optimizer::Adamw,
        global_batch,
        gpus: 1,
        sharding: Sharding::None,
        framework,
        attention: Attention::Sdpa,
    }
}
