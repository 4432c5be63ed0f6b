//! The advisor: workload + GPU + strategy + pins + history → engineering
//! settings, with confidence, source and reasoning (SPEC §3).
//!
//! How a suggestion is made:
//! 1. The history is cut down to the similarity key (model, method, GPU
//!    model, sequence length ±10 %); if every run there failed, the advice is
//!    micro batch 1 with checkpointing on (`learned_from_failures`).
//! 2. Otherwise every candidate setting (dtype × checkpointing × compile, less
//!    what the user pinned or the strategy fixes) is judged on its own: by the
//!    runs recorded with exactly that dtype and checkpointing (learned line,
//!    OOM bounds, largest success) or, where there are none, by the memory
//!    model with a margin for its uncertainty. Each gets its largest micro
//!    batch under the strategy's target.
//! 3. The fastest candidate wins (measured candidates before unmeasured ones),
//!    the micro batch is fitted to the global batch (m × a × W = G) and the
//!    hard rules are applied last.
//!
//! Balanced is computed first; aggressive never goes below its micro batch
//! and conservative never above it, which makes the micro batch monotone
//! across strategies by construction (conservative's checkpointing could
//! otherwise buy it a larger batch than balanced).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::core::catalog::GpuSpec;
use crate::core::learner::{self, Fit, FitKind, Line};
use crate::core::memory::{Estimate, MemoryError};
use crate::core::run::RunRecord;
use crate::core::settings::{DataLoaderSettings, Dtype, EngineeringSettings, Pins};
use crate::core::similarity::{matches_settings, HistoryQuery};
use crate::core::units::to_gib;
use crate::core::workload::{
    Framework, LoraConfig, LoraTarget, Method, Optimizer, Sharding, Workload,
};

#[derive(Debug, Error, Clone, PartialEq)]
pub enum AdvisorError {
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// Even micro batch 1 does not fit: says what would.
    #[error("{model} does not fit on {gpu} even at micro batch 1 (needs {needed_gib:.1} GiB of {capacity_gib:.1} GiB). What would: {}", .alternatives.join("; "))]
    DoesNotFit {
        model: String,
        gpu: String,
        needed_gib: f64,
        capacity_gib: f64,
        alternatives: Vec<String>,
    },
    #[error("invalid pin: {0}")]
    BadPin(String),
    /// The GPU description cannot be used (e.g. zero memory).
    #[error("invalid GPU: {0}")]
    BadGpu(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    Conservative,
    Balanced,
    #[serde(alias = "extreme")]
    Aggressive,
}

impl Strategy {
    /// All strategies, least to most memory.
    pub const ALL: [Strategy; 3] = [
        Strategy::Conservative,
        Strategy::Balanced,
        Strategy::Aggressive,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::Conservative => "conservative",
            Strategy::Balanced => "balanced",
            Strategy::Aggressive => "aggressive",
        }
    }
}

impl std::fmt::Display for Strategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Strategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "conservative" => Ok(Strategy::Conservative),
            "balanced" => Ok(Strategy::Balanced),
            "aggressive" | "extreme" => Ok(Strategy::Aggressive),
            o => Err(format!(
                "unknown strategy `{o}`: use conservative, balanced or aggressive"
            )),
        }
    }
}

/// Target fraction of GPU memory for the predicted peak, per strategy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct StrategyTargets {
    pub conservative: f64,
    pub balanced: f64,
    pub aggressive: f64,
}

impl Default for StrategyTargets {
    fn default() -> Self {
        StrategyTargets {
            conservative: 0.70,
            balanced: 0.85,
            aggressive: 0.93,
        }
    }
}

impl StrategyTargets {
    /// The target fraction for a strategy.
    pub fn for_strategy(&self, s: Strategy) -> f64 {
        match s {
            Strategy::Conservative => self.conservative,
            Strategy::Balanced => self.balanced,
            Strategy::Aggressive => self.aggressive,
        }
    }

    /// Checks that every target is in (0, 1] and that they are ordered
    /// conservative ≤ balanced ≤ aggressive (monotone micro batches need it).
    pub fn validate(&self) -> Result<(), AdvisorError> {
        for (name, v) in [
            ("conservative", self.conservative),
            ("balanced", self.balanced),
            ("aggressive", self.aggressive),
        ] {
            if !(v > 0.0 && v <= 1.0) {
                return Err(AdvisorError::BadPin(format!(
                    "{name} target {v} is not a fraction of GPU memory: use a value in (0, 1], e.g. 0.85"
                )));
            }
        }
        if !(self.conservative <= self.balanced && self.balanced <= self.aggressive) {
            return Err(AdvisorError::BadPin(format!(
                "strategy targets must be ordered conservative ≤ balanced ≤ aggressive (got {}, {}, {})",
                self.conservative, self.balanced, self.aggressive
            )));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SuggestionSource {
    Heuristic,
    HistoricalData,
    HistoricalDataWithMemory,
    LearnedFromFailures,
}

impl SuggestionSource {
    pub fn as_str(self) -> &'static str {
        match self {
            SuggestionSource::Heuristic => "heuristic",
            SuggestionSource::HistoricalData => "historical_data",
            SuggestionSource::HistoricalDataWithMemory => "historical_data_with_memory",
            SuggestionSource::LearnedFromFailures => "learned_from_failures",
        }
    }
}

/// What the advisor says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Suggestion {
    #[serde(flatten)]
    pub settings: EngineeringSettings,
    pub predicted_peak_bytes: u64,
    /// predicted_peak_bytes / GPU memory.
    pub memory_fraction: f64,
    pub confidence: f64,
    pub source: SuggestionSource,
    pub strategy: Strategy,
    pub gpu: String,
    pub reasoning: String,
    pub warnings: Vec<String>,
}

impl Suggestion {
    /// Samples per optimizer step over `gpus` data-parallel GPUs: m × a × W
    /// (equals the global batch when one was given).
    pub fn effective_batch(&self, gpus: u32) -> u32 {
        self.settings
            .micro_batch_size
            .saturating_mul(self.settings.gradient_accumulation_steps)
            .saturating_mul(gpus)
    }
}

/// Everything the advisor needs for one suggestion.
#[derive(Debug, Clone)]
pub struct AdviceRequest<'a> {
    pub workload: &'a Workload,
    pub gpu: &'a GpuSpec,
    pub strategy: Strategy,
    pub targets: StrategyTargets,
    pub pins: &'a Pins,
    /// Runs returned by the history store for `HistoryQuery` of this workload
    /// and GPU (may include other dtypes/checkpointing; the advisor filters).
    pub history: &'a [RunRecord],
}

// === memory model seam ===

/// The memory model the advisor consults. The built-in one is
/// [`crate::core::memory::estimate`]; tests and simulations plug in others.
pub trait MemoryModel {
    fn estimate(&self, w: &Workload, s: &EngineeringSettings) -> Result<Estimate, MemoryError>;
}

/// gpufit's own estimator.
#[derive(Debug, Clone, Copy, Default)]
pub struct BuiltinModel;

impl MemoryModel for BuiltinModel {
    fn estimate(&self, w: &Workload, s: &EngineeringSettings) -> Result<Estimate, MemoryError> {
        crate::core::memory::estimate(w, s)
    }
}

/// Knobs that are not part of the request.
#[derive(Clone, Copy)]
pub struct AdvisorOptions<'m> {
    pub model: &'m dyn MemoryModel,
    /// CPU cores available per GPU, for data-loader advice (None: unknown).
    pub cpus_per_gpu: Option<u32>,
}

impl Default for AdvisorOptions<'static> {
    fn default() -> Self {
        AdvisorOptions {
            model: &BuiltinModel,
            cpus_per_gpu: None,
        }
    }
}

// === constants ===

/// Largest micro batch ever suggested when nothing else bounds it (no global
/// batch, a tiny model): beyond this, throughput no longer grows and data
/// loaders become the bottleneck.
pub const MAX_MICRO_BATCH: u32 = 1024;

/// Confidence never reaches certainty: hardware, drivers and data vary (SPEC §3).
pub const MAX_CONFIDENCE: f64 = 0.95;

/// With no measurement, the memory model's fixed part (weights, optimizer
/// state, context) is trusted to about ±10 %: it is parameter counting. Its
/// per-sample part (activations, logits) is trusted to about ±35 %: it
/// depends on kernels, fusion and framework details the model cannot see.
/// The heuristic plans with the upper end of both so a first run neither
/// runs out of memory nor overshoots the target; measurements then replace
/// the margins.
pub const HEURISTIC_FIXED_MARGIN: f64 = 0.10;
/// See [`HEURISTIC_FIXED_MARGIN`].
pub const HEURISTIC_SLOPE_MARGIN: f64 = 0.35;

/// With two or more measured batches, extrapolating beyond the largest one
/// carries the fit's noise: the slope gets this many standard errors of
/// margin there (about the one-sided 95th percentile).
pub const LEAST_SQUARES_Z: f64 = 1.65;

/// With one measured micro batch the model's line is scaled through it
/// (SPEC §3); how the model's error splits between fixed part and slope is
/// unknown. The split is taken as uncertain by this fraction of the fixed
/// part, which is worth `u·F / m1` of slope beyond the measured batch m1:
/// large when the fixed part dominates a small measured batch, small when
/// activations dominate.
pub const ONE_POINT_SPLIT_UNCERTAINTY: f64 = 0.25;

/// Relative throughput cost of full activation checkpointing: recomputing the
/// forward pass adds about one forward (≈ 1/3 of forward + backward FLOPs),
/// i.e. ×0.75 speed (Chen et al. 2016, "Training Deep Nets with Sublinear
/// Memory Cost"; Korthikanti et al. 2022 measure 30–40 % overhead).
pub const CHECKPOINTING_SPEED: f64 = 0.75;

/// Relative speed-up of `torch.compile`. The PyTorch 2.0 release reports
/// 43 % on average over 163 models on an A100 with AMP; LLM stacks already
/// use fused attention, so a third of that is assumed.
pub const COMPILE_SPEED: f64 = 1.15;

/// fp32 (TF32 tensor cores) relative to bf16/fp16: half the dense tensor
/// throughput on A100/H100 datasheets (156 vs 312, 495 vs 989 TFLOP/s).
pub const FP32_SPEED_TF32: f64 = 0.5;
/// fp32 without TF32 (pre-Ampere: V100 15.7 vs 125 TFLOP/s, T4 8.1 vs 65).
pub const FP32_SPEED_NO_TF32: f64 = 0.125;

/// Tokens per micro batch at which a GPU's matmuls reach half their peak
/// utilisation; GEMMs with an M dimension of a few thousand rows run near
/// peak on current GPUs. Used only to rank candidates, never for memory.
pub const HALF_UTILISATION_TOKENS: f64 = 2048.0;

// === entry points ===

/// Suggests engineering settings with gpufit's built-in memory model.
pub fn suggest(req: &AdviceRequest<'_>) -> Result<Suggestion, AdvisorError> {
    suggest_with(req, &AdvisorOptions::default())
}

/// Suggests engineering settings with the given memory model and options.
pub fn suggest_with(
    req: &AdviceRequest<'_>,
    opts: &AdvisorOptions<'_>,
) -> Result<Suggestion, AdvisorError> {
    let ctx = Ctx::new(req, opts)?;
    if let Some(s) = ctx.learned_from_failures(req.strategy)? {
        return Ok(s);
    }
    // Balanced first; aggressive never below it, conservative never above
    // it, which makes the micro batch monotone across strategies.
    let balanced = ctx.pick(Strategy::Balanced, 0, u32::MAX)?;
    let pick = match req.strategy {
        Strategy::Balanced => balanced,
        Strategy::Aggressive => ctx.pick(Strategy::Aggressive, balanced.m, u32::MAX)?,
        Strategy::Conservative => ctx.pick(Strategy::Conservative, 0, balanced.m)?,
    };
    Ok(ctx.finish(req.strategy, pick))
}

/// All three strategies for the same inputs (for `gpufit plan`).
pub fn plan_with(
    req: &AdviceRequest<'_>,
    opts: &AdvisorOptions<'_>,
) -> Result<Vec<Suggestion>, AdvisorError> {
    Strategy::ALL
        .iter()
        .map(|&s| {
            let r = AdviceRequest {
                strategy: s,
                ..req.clone()
            };
            suggest_with(&r, opts)
        })
        .collect()
}

// === impl Ctx ===

/// One candidate setting.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Cand {
    dtype: Dtype,
    ckpt: bool,
    compile: bool,
    offload: bool,
}

/// What is known about a candidate from history.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Evidence {
    None,
    Success,
    Memory,
}

/// A candidate judged for one strategy.
#[derive(Debug, Clone)]
struct Eval {
    cand: Cand,
    /// Chosen micro batch (after the global-batch rule).
    m: u32,
    /// Whether the predicted peak meets the strategy's target (false: only
    /// micro batch 1 fits, above the target).
    meets_target: bool,
    /// The best line (learned, or the model's): predicts the peak at any m.
    line: Line,
    /// Best prediction of the peak at `m` (learned line, or the model).
    predicted: f64,
    evidence: Evidence,
    fit: Option<Fit>,
    /// Runs with exactly this dtype and checkpointing.
    similar: usize,
    successes: usize,
    largest_success: Option<u32>,
    oom_min: Option<u32>,
    /// Best measured point (largest measured batch, its peak) for reasoning.
    measured: Option<(u32, u64)>,
    speed: f64,
    warnings: Vec<String>,
}

struct Ctx<'a> {
    req: &'a AdviceRequest<'a>,
    opts: &'a AdvisorOptions<'a>,
    w: &'a Workload,
    capacity: f64,
    /// Runs under the similarity query (any settings).
    key_runs: Vec<&'a RunRecord>,
    /// Per-GPU batch G / W when a global batch is given.
    per_gpu: Option<u32>,
}

impl<'a> Ctx<'a> {
    fn new(req: &'a AdviceRequest<'a>, opts: &'a AdvisorOptions<'a>) -> Result<Self, AdvisorError> {
        let w = req.workload;
        w.validate().map_err(MemoryError::from)?;
        req.targets.validate()?;
        if req.gpu.memory_bytes == 0 {
            return Err(AdvisorError::BadGpu(format!(
                "{} has no memory size: give --gpu-memory or use a catalog name",
                req.gpu.name
            )));
        }
        if req.pins.micro_batch_size == Some(0) {
            return Err(MemoryError::ZeroMicroBatch.into());
        }
        if req.pins.gradient_accumulation_steps == Some(0) {
            return Err(AdvisorError::BadPin(
                "--grad-accum must be at least 1".into(),
            ));
        }
        let q = HistoryQuery::new(&w.model.name, w.method, &req.gpu.name, w.seq_len);
        let key_runs: Vec<&RunRecord> = req
            .history
            .iter()
            .filter(|r| q.matches(r) && r.settings.micro_batch_size > 0)
            .collect();
        let per_gpu = w.global_batch.map(|g| g / w.gpus.max(1));
        Ok(Ctx {
            req,
            opts,
            w,
            capacity: req.gpu.memory_bytes as f64,
            key_runs,
            per_gpu,
        })
    }

    fn target(&self, s: Strategy) -> f64 {
        self.req.targets.for_strategy(s)
    }

    fn gpu_name(&self) -> &str {
        &self.req.gpu.name
    }

    /// The half-precision dtype this framework and GPU would use.
    fn half_dtype(&self) -> Option<Dtype> {
        let mixed = matches!(self.w.framework, Framework::Hf | Framework::Lightning);
        if self.req.gpu.bf16 {
            Some(if mixed { Dtype::Bf16Mixed } else { Dtype::Bf16 })
        } else if self.w.framework == Framework::Torchtune {
            // torchtune trains in bf16 or fp32 only.
            None
        } else {
            Some(Dtype::Fp16Mixed)
        }
    }

    fn candidates(&self, s: Strategy) -> Vec<Cand> {
        let pins = self.req.pins;
        let dtypes: Vec<Dtype> = match pins.dtype {
            Some(d) => vec![d],
            None => self.half_dtype().into_iter().chain([Dtype::Fp32]).collect(),
        };
        let ckpts: Vec<bool> = match (pins.activation_checkpointing, s) {
            (Some(c), _) => vec![c],
            (None, Strategy::Conservative) => vec![true],
            (None, _) => vec![false, true],
        };
        let compiles: Vec<bool> = match (pins.compile, s) {
            (Some(c), _) => vec![c],
            (None, Strategy::Conservative) => vec![false],
            (None, Strategy::Aggressive) => vec![true],
            // Balanced compiles only where compiling has been seen to work
            // for this workload: a failed compile costs a whole job.
            (None, Strategy::Balanced) => {
                if self
                    .key_runs
                    .iter()
                    .any(|r| r.result.success && r.settings.compile)
                {
                    vec![false, true]
                } else {
                    vec![false]
                }
            }
        };
        let offload = pins.activation_offloading.unwrap_or(false);
        let mut out = Vec::new();
        for &dtype in &dtypes {
            for &ckpt in &ckpts {
                for &compile in &compiles {
                    out.push(Cand {
                        dtype,
                        ckpt,
                        compile,
                        offload,
                    });
                }
            }
        }
        out
    }

    fn settings_for(&self, c: Cand, m: u32) -> EngineeringSettings {
        EngineeringSettings {
            micro_batch_size: m,
            gradient_accumulation_steps: 1,
            dtype: c.dtype,
            activation_checkpointing: c.ckpt,
            activation_offloading: c.offload,
            compile: c.compile,
            dataloader: DataLoaderSettings::default(),
        }
    }

    /// The memory model's line for a candidate, from its predictions at
    /// micro batch 1 and 2.
    fn model_line(&self, w: &Workload, c: Cand) -> Result<Line, AdvisorError> {
        let e1 = self.opts.model.estimate(w, &self.settings_for(c, 1))?;
        let e2 = self.opts.model.estimate(w, &self.settings_for(c, 2))?;
        let p1 = e1.peak_bytes as f64;
        let slope = (e2.peak_bytes as f64 - p1).max(0.0);
        Ok(Line {
            fixed: (p1 - slope).max(0.0),
            slope,
        })
    }

    fn exact_runs(&self, c: Cand) -> Vec<&'a RunRecord> {
        self.key_runs
            .iter()
            .copied()
            .filter(|r| {
                matches_settings(r, c.dtype, c.ckpt)
                    && r.settings.activation_offloading == c.offload
            })
            .collect()
    }

    fn cap(&self) -> u32 {
        self.per_gpu
            .unwrap_or(MAX_MICRO_BATCH)
            .clamp(1, MAX_MICRO_BATCH)
    }

    /// Judges one candidate for a strategy.
    fn evaluate(&self, s: Strategy, c: Cand) -> Result<Option<Eval>, AdvisorError> {
        let model = self.model_line(self.w, c)?;
        let runs = self.exact_runs(c);
        let obs = learner::observations(&runs);
        let oom_min = learner::smallest_oom(&runs);
        let largest_success =
            learner::largest_success(&runs).filter(|&m| oom_min.is_none_or(|o| m < o));
        let successes = runs.iter().filter(|r| r.result.success).count();
        let fit = learner::fit(model, &obs);
        let evidence = if fit.is_some() {
            Evidence::Memory
        } else if successes > 0 {
            Evidence::Success
        } else {
            Evidence::None
        };
        let measured = runs
            .iter()
            .filter(|r| r.result.success)
            .filter_map(|r| Some((r.settings.micro_batch_size, r.result.peak_memory_bytes?)))
            .max();

        // The best prediction (no margin) and the planning line (with margin).
        let mut best = fit.map(|f| f.line).unwrap_or(model);
        if let Some(o) = oom_min {
            best = learner::respect_oom(best, o, self.capacity);
        }
        // The pessimistic prediction: what the peak could be if the model's
        // errors fall on the unlucky side. Suggestions keep it under the
        // target, so balanced approaches the best batch from below (it never
        // goes back below a success, so overshooting could not be undone).
        let plan_at = |m: u32| -> f64 {
            match fit {
                Some(f) => {
                    let beyond = m.saturating_sub(f.max_measured_batch) as f64;
                    let extra_slope = match f.kind {
                        FitKind::LeastSquares => LEAST_SQUARES_Z * f.slope_stderr,
                        // One batch measured: the scale is known, the split
                        // between fixed part and slope is not. A fixed part
                        // off by u·F moves the slope by u·F / m1.
                        FitKind::ScaledModel | FitKind::DegenerateFallback => {
                            ONE_POINT_SPLIT_UNCERTAINTY * best.fixed
                                / f.max_measured_batch.max(1) as f64
                        }
                    };
                    best.at(m) + extra_slope * beyond
                }
                None => {
                    best.fixed * (1.0 + HEURISTIC_FIXED_MARGIN)
                        + best.slope * (1.0 + HEURISTIC_SLOPE_MARGIN) * m as f64
                }
            }
        };
        let budget = self.target(s) * self.capacity;
        let cap = self.cap();
        let mut warnings = Vec::new();
        let mut meets_target = true;

        let m = if let Some(pm) = self.req.pins.micro_batch_size {
            pm
        } else {
            // Largest m whose pessimistic prediction meets the target
            // (increasing in m, so bisect).
            let ok = |m: u32| plan_at(m) <= budget;
            let mut m_fit = if ok(1) {
                let (mut lo, mut hi) = (1u32, cap + 1);
                while hi - lo > 1 {
                    let mid = lo + (hi - lo) / 2;
                    if ok(mid) {
                        lo = mid
                    } else {
                        hi = mid
                    }
                }
                lo
            } else {
                0
            };
            // No room beyond the largest measured batch under the
            // pessimistic line: that batch again would teach nothing. One
            // more sample, if the best estimate meets the target, gives the
            // point that settles it.
            if let Some(f) = fit {
                let m1 = f.max_measured_batch;
                if m_fit <= m1
                    && m1 < cap
                    && best.at(m1 + 1) <= budget
                    && oom_min.is_none_or(|o| m1 + 1 < o)
                {
                    m_fit = m1 + 1;
                }
            }
            if m_fit == 0 && best.at(1) <= self.capacity {
                // Over the target even at 1, but predicted to fit the card:
                // micro batch 1 is still an answer (with a warning), not
                // "does not fit".
                meets_target = false;
                m_fit = 1;
            }
            // Balanced and aggressive never go below what already worked
            // (unless a memory-changing pin makes that history moot — pins
            // of dtype/checkpointing are part of the candidate, so its runs
            // are exactly those settings; a pinned micro batch skips this).
            if s != Strategy::Conservative {
                if let Some(ls) = largest_success {
                    if ls > m_fit && best.at(ls) <= self.capacity {
                        m_fit = ls.min(cap);
                    }
                }
            }
            // Hard rule: strictly below the smallest OOM of these settings.
            if let Some(o) = oom_min {
                m_fit = m_fit.min(o - 1);
            }
            // Hard rule: never predicted above the GPU's memory.
            while m_fit > 0 && best.at(m_fit) > self.capacity {
                m_fit -= 1;
            }
            if m_fit == 0 {
                return Ok(None);
            }
            m_fit
        };
        let m_fit = m;
        let mut m = m;
        if self.req.pins.micro_batch_size.is_none() {
            if let Some(per) = self.per_gpu {
                let ga_pin = self.req.pins.gradient_accumulation_steps;
                let d = largest_divisor_at_most(per, m_fit, ga_pin);
                match d {
                    Some(d) => {
                        if d < m_fit {
                            warnings.push(format!(
                                "micro batch {m_fit} would fit, but {d} is the largest that divides the per-GPU batch of {per} exactly"
                            ));
                        }
                        m = d;
                    }
                    None => return Ok(None),
                }
            }
        }
        let speed = self.speed(c, m);
        if !meets_target {
            warnings.push(format!(
                "even micro batch 1 is predicted to need {:.1} GiB, above the {s} target of {:.0} % of {:.1} GiB; it should still fit the card",
                to_gib(best.at(1) as u64),
                self.target(s) * 100.0,
                to_gib(self.capacity as u64)
            ));
        }
        Ok(Some(Eval {
            cand: c,
            m,
            meets_target,
            line: best,
            predicted: best.at(m),
            evidence,
            fit,
            similar: runs.len(),
            successes,
            largest_success,
            oom_min,
            measured,
            speed,
            warnings,
        }))
    }

    /// Relative training throughput (samples/s, arbitrary units) used to rank
    /// candidates: utilisation grows with tokens per micro batch; precision,
    /// checkpointing and compile scale it.
    fn speed(&self, c: Cand, m: u32) -> f64 {
        let tokens = m as f64 * self.w.seq_len as f64;
        let util = tokens / (tokens + HALF_UTILISATION_TOKENS);
        let dtype = match c.dtype {
            Dtype::Fp32 if self.req.gpu.bf16 => FP32_SPEED_TF32,
            Dtype::Fp32 => FP32_SPEED_NO_TF32,
            _ => 1.0,
        };
        let ckpt = if c.ckpt { CHECKPOINTING_SPEED } else { 1.0 };
        let compile = if c.compile { COMPILE_SPEED } else { 1.0 };
        util * dtype * ckpt * compile
    }

    /// The candidate a strategy picks, never below `floor` when possible and
    /// never above `ceil`.
    fn pick(&self, s: Strategy, floor: u32, ceil: u32) -> Result<Eval, AdvisorError> {
        let mut evals = Vec::new();
        for c in self.candidates(s) {
            if let Some(mut e) = self.evaluate(s, c)? {
                if e.m > ceil && self.req.pins.micro_batch_size.is_none() {
                    e.m = ceil;
                    e.predicted = e.line.at(ceil);
                    e.speed = self.speed(c, ceil);
                    e.warnings.clear();
                }
                evals.push(e);
            }
        }
        if self.req.pins.micro_batch_size.is_some() {
            return self.pick_pinned(s, evals);
        }
        if evals.is_empty() {
            return Err(self.does_not_fit(s)?);
        }
        // "The fastest that meets the target": candidates over the target
        // (micro batch 1 only) are used only when no candidate meets it.
        if evals.iter().any(|e| e.meets_target) {
            evals.retain(|e| e.meets_target);
        } else if let Some(lowest) = evals
            .iter()
            .min_by(|a, b| a.predicted.total_cmp(&b.predicted))
            .cloned()
        {
            // Nothing meets the target, only micro batch 1 fits the card:
            // take the settings with the most room, not the fastest.
            evals = vec![lowest];
        }
        let above: Vec<Eval> = evals.iter().filter(|e| e.m >= floor).cloned().collect();
        let pool = if above.is_empty() {
            // Only possible when the estimator gives compile a memory cost
            // that pushes the floor out of reach: take the largest batch.
            let mut best = evals
                .into_iter()
                .max_by_key(|e| e.m)
                .ok_or_else(|| AdvisorError::BadPin("no candidate settings".into()))?;
            best.warnings.push(format!(
                "the {s} micro batch is below balanced's: compiling is predicted to cost memory"
            ));
            vec![best]
        } else {
            above
        };
        let top = pool
            .iter()
            .map(|e| e.evidence)
            .max()
            .unwrap_or(Evidence::None);
        let mut chosen: Vec<&Eval> = match top {
            // Measured settings beat unmeasured ones; among them the fastest.
            Evidence::Memory => pool
                .iter()
                .filter(|e| e.evidence >= Evidence::Success)
                .collect(),
            Evidence::Success | Evidence::None => {
                pool.iter().filter(|e| e.evidence == top).collect()
            }
        };
        chosen.sort_by(|a, b| {
            let key = |e: &Eval| {
                // Without memory data, "the settings most of those runs used".
                if top == Evidence::Success {
                    (e.successes as f64, e.speed)
                } else {
                    (e.speed, e.successes as f64)
                }
            };
            let (ka, kb) = (key(a), key(b));
            kb.0.total_cmp(&ka.0).then(kb.1.total_cmp(&ka.1))
        });
        Ok(chosen[0].clone())
    }

    /// A pinned micro batch: keep it; choose the other settings so it fits
    /// best, and warn when it is predicted to run out of memory.
    fn pick_pinned(&self, s: Strategy, evals: Vec<Eval>) -> Result<Eval, AdvisorError> {
        let budget = self.target(s) * self.capacity;
        let mut fitting: Vec<&Eval> = evals
            .iter()
            .filter(|e| e.predicted <= budget && e.oom_min.is_none_or(|o| e.m < o))
            .collect();
        fitting.sort_by(|a, b| b.speed.total_cmp(&a.speed));
        let mut e = match fitting.first() {
            Some(e) => (*e).clone(),
            None => evals
                .iter()
                .min_by(|a, b| a.predicted.total_cmp(&b.predicted))
                .cloned()
                .ok_or_else(|| AdvisorError::BadPin("no candidate settings".into()))?,
        };
        let gib = to_gib(e.predicted as u64);
        if e.predicted > self.capacity {
            e.warnings.push(format!(
                "pinned micro batch {} is predicted to need {gib:.1} GiB, more than the {:.1} GiB of {}: it will probably run out of memory",
                e.m,
                to_gib(self.capacity as u64),
                self.gpu_name()
            ));
        } else if e.predicted > budget {
            e.warnings.push(format!(
                "pinned micro batch {} is predicted to need {gib:.1} GiB, above the {} target of {:.0} % of GPU memory",
                e.m,
                s,
                self.target(s) * 100.0
            ));
        }
        if let Some(o) = e.oom_min {
            if e.m >= o {
                e.warnings.push(format!(
                    "micro batch {o} already ran out of memory for this workload on {} with these settings; pinned micro batch {} is at or above it",
                    self.gpu_name(),
                    e.m
                ));
            }
        }
        Ok(e)
    }

    /// SPEC §3 `learned_from_failures`: every similar run failed.
    fn learned_from_failures(&self, s: Strategy) -> Result<Option<Suggestion>, AdvisorError> {
        let pins = self.req.pins;
        let runs: Vec<&RunRecord> = self
            .key_runs
            .iter()
            .copied()
            .filter(|r| pins.dtype.is_none_or(|d| r.settings.dtype == d))
            .collect();
        if runs.is_empty() || runs.iter().any(|r| r.result.success) {
            return Ok(None);
        }
        let dtype = pins.dtype.unwrap_or_else(|| {
            most_common(runs.iter().map(|r| r.settings.dtype)).unwrap_or(Dtype::Bf16)
        });
        let c = Cand {
            dtype,
            ckpt: pins.activation_checkpointing.unwrap_or(true),
            compile: pins.compile.unwrap_or(s == Strategy::Aggressive),
            offload: pins.activation_offloading.unwrap_or(false),
        };
        let m = pins.micro_batch_size.unwrap_or(1);
        let exact = self.exact_runs(c);
        let oom_min = learner::smallest_oom(&exact);
        let predicted = self.model_line(self.w, c)?.at(m);
        let mut warnings = Vec::new();
        if pins.micro_batch_size.is_none() && (oom_min == Some(1) || predicted > self.capacity) {
            return Err(self.does_not_fit(s)?);
        }
        if pins.activation_checkpointing == Some(false) {
            warnings.push("every similar run failed and checkpointing is pinned off: turning it on would be the first thing to try".into());
        }
        if let Some(o) = oom_min {
            if m >= o {
                warnings.push(format!("micro batch {o} already ran out of memory for this workload on {} with these settings", self.gpu_name()));
            }
        }
        if predicted > self.capacity {
            warnings.push(format!(
                "micro batch {m} is predicted to need {:.1} GiB, more than the {:.1} GiB of {}",
                to_gib(predicted as u64),
                to_gib(self.capacity as u64),
                self.gpu_name()
            ));
        }
        let ooms = runs.iter().filter(|r| r.is_oom()).count();
        let e = Eval {
            cand: c,
            m,
            meets_target: true,
            line: self.model_line(self.w, c)?,
            predicted,
            evidence: Evidence::None,
            fit: None,
            similar: runs.len(),
            successes: 0,
            largest_success: None,
            oom_min,
            measured: None,
            speed: self.speed(c, m),
            warnings,
        };
        let reason = format!(
            "All {} similar run{} of {} on {} failed ({} out of memory), so this falls back to micro batch {m} with activation checkpointing {}",
            runs.len(),
            plural(runs.len()),
            self.w.model.name,
            self.gpu_name(),
            ooms,
            on_off(c.ckpt)
        );
        let conf = (0.4 + 0.05 * runs.len().min(4) as f64).min(MAX_CONFIDENCE);
        Ok(Some(self.build(
            s,
            e,
            SuggestionSource::LearnedFromFailures,
            conf,
            reason,
        )))
    }

    /// The error for "not even micro batch 1 fits", with what would.
    fn does_not_fit(&self, s: Strategy) -> Result<AdvisorError, AdvisorError> {
        let budget = self.target(s) * self.capacity;
        let base = Cand {
            dtype: self
                .req
                .pins
                .dtype
                .or_else(|| self.half_dtype())
                .unwrap_or(Dtype::Fp32),
            ckpt: self.req.pins.activation_checkpointing.unwrap_or(false),
            compile: false,
            offload: false,
        };
        let needed = self.model_line(self.w, base)?.at(1);
        let mut alternatives = Vec::new();
        let ckpt = Cand { ckpt: true, ..base };
        let fits = |w: &Workload, c: Cand| -> Result<Option<f64>, AdvisorError> {
            let p = self.model_line(w, c)?.at(1);
            Ok((p <= budget).then_some(p))
        };
        let say =
            |what: &str, p: f64| format!("{what} ({:.1} GiB at micro batch 1)", to_gib(p as u64));
        if !base.ckpt {
            if let Some(p) = fits(self.w, ckpt)? {
                alternatives.push(say("activation checkpointing (--checkpointing on)", p));
            }
        }
        if let Some(p) = fits(
            self.w,
            Cand {
                offload: true,
                ..ckpt
            },
        )? {
            alternatives.push(say(
                "activation checkpointing plus activation offloading to CPU memory",
                p,
            ));
        }
        if self.w.optimizer == Optimizer::Adamw && self.w.method == Method::Full {
            let w8 = Workload {
                optimizer: Optimizer::Adamw8bit,
                ..self.w.clone()
            };
            if let Some(p) = fits(&w8, ckpt)? {
                alternatives.push(say(
                    "an 8-bit optimizer (--optimizer adamw8bit) with checkpointing",
                    p,
                ));
            }
        }
        if self.w.method != Method::Qlora {
            let lora = self.w.lora.clone().unwrap_or(LoraConfig {
                rank: 16,
                targets: vec![LoraTarget::Q, LoraTarget::K, LoraTarget::V, LoraTarget::O],
            });
            let rank = lora.rank;
            let q = Workload {
                method: Method::Qlora,
                lora: Some(lora),
                ..self.w.clone()
            };
            if q.validate().is_ok() {
                if let Some(p) = fits(&q, ckpt)? {
                    alternatives.push(say(
                        &format!("QLoRA (--method qlora --lora-rank {rank}) with checkpointing"),
                        p,
                    ));
                }
            }
        }
        if !matches!(self.w.sharding, Sharding::Zero3 | Sharding::Fsdp) || self.w.gpus < 64 {
            for n in [2u32, 4, 8, 16, 32, 64] {
                if n <= self.w.gpus {
                    continue;
                }
                let z = Workload {
                    sharding: Sharding::Zero3,
                    gpus: n,
                    global_batch: self.w.global_batch.filter(|g| g % n == 0),
                    ..self.w.clone()
                };
                if z.validate().is_err() {
                    continue;
                }
                if let Some(p) = fits(&z, ckpt)? {
                    alternatives.push(say(
                        &format!("ZeRO-3 over {n} GPUs (--zero 3 --gpus {n}) with checkpointing"),
                        p,
                    ));
                    break;
                }
            }
        }
        if alternatives.is_empty() {
            alternatives.push(format!(
                "none of checkpointing, offloading, an 8-bit optimizer, QLoRA or ZeRO-3 over up to 64 GPUs brings it under {:.1} GiB: use a GPU with more memory",
                to_gib(budget as u64)
            ));
        }
        Ok(AdvisorError::DoesNotFit {
            model: self.w.model.name.clone(),
            gpu: self.gpu_name().to_string(),
            needed_gib: to_gib(needed as u64),
            capacity_gib: to_gib(self.capacity as u64),
            alternatives,
        })
    }

    /// Source, confidence and reasoning for a picked candidate.
    fn finish(&self, s: Strategy, e: Eval) -> Suggestion {
        let cap_gib = to_gib(self.capacity as u64);
        let pct = |b: f64| 100.0 * b / self.capacity;
        let target_pct = self.target(s) * 100.0;
        let boundary = match e.oom_min {
            Some(o) if o > e.m => format!("; micro batch {o} ran out of memory before"),
            _ => String::new(),
        };
        let (source, mut conf, reason) = match (e.evidence, e.fit) {
            (Evidence::Memory, Some(f)) => {
                let (mm, mp) = e
                    .measured
                    .unwrap_or((f.max_measured_batch, f.line.at(f.max_measured_batch) as u64));
                let how = match f.kind {
                    FitKind::LeastSquares => format!(
                        "fitted {:.2} GiB + {:.3} GiB per sample over {} measured batch sizes",
                        to_gib(f.line.fixed as u64),
                        to_gib(f.line.slope as u64),
                        f.distinct_batches
                    ),
                    _ => "the memory model scaled to that measurement".to_string(),
                };
                let r = format!(
                    "Memory analysis of {} successful run{}: micro batch {mm} measured {:.1} GiB, and {how} predicts {:.1} GiB at micro batch {} ({:.0} % of {cap_gib:.1} GiB, target {target_pct:.0} %){boundary}",
                    e.successes,
                    plural(e.successes),
                    to_gib(mp),
                    to_gib(e.predicted as u64),
                    e.m,
                    pct(e.predicted),
                );
                let c = 0.6
                    + 0.05 * (f.points.min(4) as f64)
                    + if f.kind == FitKind::LeastSquares {
                        0.05
                    } else {
                        0.0
                    };
                (SuggestionSource::HistoricalDataWithMemory, c, r)
            }
            (Evidence::Success, _) | (Evidence::Memory, None) => {
                let ls = e.largest_success.unwrap_or(e.m);
                let r = format!(
                    "{} similar run{} succeeded with {}, the largest at micro batch {ls}; this starts from there and suggests micro batch {}{boundary}",
                    e.successes,
                    plural(e.successes),
                    describe(e.cand),
                    e.m
                );
                let c = 0.5 + 0.05 * (e.successes.min(6) as f64);
                (SuggestionSource::HistoricalData, c, r)
            }
            (Evidence::None, _) => {
                let r = format!(
                    "No similar runs of {} on {} with {} yet, so the memory model alone predicts {:.1} GiB at micro batch {} ({:.0} % of {cap_gib:.1} GiB, target {target_pct:.0} % less a margin for the model's uncertainty){boundary}",
                    self.w.model.name,
                    self.gpu_name(),
                    describe(e.cand),
                    to_gib(e.predicted as u64),
                    e.m,
                    pct(e.predicted),
                );
                let c = 0.3 + 0.02 * (e.similar.min(5) as f64);
                (SuggestionSource::Heuristic, c, r)
            }
        };
        if source != SuggestionSource::Heuristic {
            if e.oom_min.is_some_and(|o| o > e.m) {
                conf += 0.1;
            }
        } else {
            conf = conf.min(0.45);
        }
        let conf = conf.min(MAX_CONFIDENCE);
        self.build(s, e, source, conf, reason)
    }

    fn build(
        &self,
        s: Strategy,
        e: Eval,
        source: SuggestionSource,
        confidence: f64,
        reason: String,
    ) -> Suggestion {
        let mut warnings = e.warnings.clone();
        let w = self.w;
        let pins = self.req.pins;
        let (a, batch_sentence) = match self.per_gpu {
            Some(per) => {
                let a = (per / e.m.max(1)).max(1);
                if e.m.saturating_mul(a) != per {
                    warnings.push(format!(
                        "micro batch {} does not divide the per-GPU batch of {per}: the global batch {} cannot be kept exactly",
                        e.m,
                        w.global_batch.unwrap_or(0)
                    ));
                }
                if let Some(pa) = pins.gradient_accumulation_steps {
                    if pa != a {
                        warnings.push(format!(
                            "pinned gradient accumulation {pa} with micro batch {} on {} GPU(s) gives {} samples per step, not the global batch {}",
                            e.m, w.gpus, pa.saturating_mul(e.m).saturating_mul(w.gpus), w.global_batch.unwrap_or(0)
                        ));
                    }
                }
                let a = pins.gradient_accumulation_steps.unwrap_or(a);
                (
                    a,
                    format!(
                    "Gradient accumulation {a} keeps the global batch at {} ({} × {a} × {} GPU{}).",
                    e.m.saturating_mul(a).saturating_mul(w.gpus),
                    e.m,
                    w.gpus,
                    plural(w.gpus as usize)
                ),
                )
            }
            None => {
                let a = pins.gradient_accumulation_steps.unwrap_or(1);
                (a, format!(
                    "No global batch was given, so the effective batch changed to {} samples per step ({} × {a} × {} GPU{}); pass --global-batch to keep it fixed.",
                    e.m.saturating_mul(a).saturating_mul(w.gpus),
                    e.m,
                    w.gpus,
                    plural(w.gpus as usize)
                ))
            }
        };
        if e.cand.dtype.needs_bf16() && !self.req.gpu.bf16 {
            warnings.push(format!(
                "{} does not support bf16 (compute capability {}): use fp16-mixed or fp32",
                self.gpu_name(),
                self.req.gpu.compute_capability
            ));
        }
        let settings = EngineeringSettings {
            micro_batch_size: e.m,
            gradient_accumulation_steps: a,
            dtype: e.cand.dtype,
            activation_checkpointing: e.cand.ckpt,
            activation_offloading: e.cand.offload,
            compile: e.cand.compile,
            dataloader: self.dataloader(),
        };
        let predicted = e.predicted.max(0.0).round() as u64;
        Suggestion {
            settings,
            predicted_peak_bytes: predicted,
            memory_fraction: predicted as f64 / self.capacity,
            confidence,
            source,
            strategy: s,
            gpu: self.gpu_name().to_string(),
            reasoning: format!("{reason}. {batch_sentence}"),
            warnings,
        }
    }

    /// Data-loader advice: one core per GPU stays with the training process;
    /// the rest (up to 8, beyond which tokenised text loading gains nothing)
    /// become workers. Pinned host memory speeds host→device copies; workers
    /// persist across epochs to avoid re-forking.
    fn dataloader(&self) -> DataLoaderSettings {
        let d = DataLoaderSettings::default();
        let workers = self
            .req
            .pins
            .num_workers
            .unwrap_or_else(|| match self.opts.cpus_per_gpu {
                Some(c) => c.saturating_sub(1).min(8),
                None => d.num_workers,
            });
        DataLoaderSettings {
            num_workers: workers,
            pin_memory: true,
            persistent_workers: workers > 0,
            prefetch_factor: if workers > 0 { d.prefetch_factor } else { 0 },
        }
    }
}

/// Largest divisor of `per` that is ≤ `max` (and, with a pinned accumulation
/// `a`, equals per / a).
fn largest_divisor_at_most(per: u32, max: u32, ga_pin: Option<u32>) -> Option<u32> {
    if let Some(a) = ga_pin {
        let m = per / a;
        return (m >= 1 && m * a == per && m <= max).then_some(m);
    }
    (1..=max.min(per)).rev().find(|d| per.is_multiple_of(*d))
}

fn most_common<T: PartialEq + Copy>(it: impl Iterator<Item = T>) -> Option<T> {
    let mut counts: Vec<(T, usize)> = Vec::new();
    for x in it {
        match counts.iter_mut().find(|(y, _)| *y == x) {
            Some((_, n)) => *n += 1,
            None => counts.push((x, 1)),
        }
    }
    counts.into_iter().max_by_key(|(_, n)| *n).map(|(x, _)| x)
}

fn describe(c: Cand) -> String {
    format!(
        "{}, checkpointing {}{}",
        c.dtype,
        on_off(c.ckpt),
        if c.offload { ", offloading on" } else { "" }
    )
}

fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

#[cfg(test)]
mod tests;
