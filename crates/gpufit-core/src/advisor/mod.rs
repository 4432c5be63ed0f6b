//! The advisor: workload + GPU + strategy + pins + history → engineering
//! settings, with confidence, source and reasoning (docs/design.md,
//! "Advisor").
//!
//! A suggestion is made in four steps, one file each:
//! 1. [`candidates`] — the settings worth considering (dtype × checkpointing
//!    × compile × offloading, less what the user pinned or the strategy
//!    fixes), with the precision policy.
//! 2. [`evaluate`] — each candidate judged on its own: its largest micro
//!    batch under the strategy's target, found by searching the memory model
//!    itself ([`predict`]) with the accumulation that batch implies, corrected
//!    by the runs recorded with exactly those settings, bounded by their OOMs.
//! 3. [`pick`] — the fastest candidate that meets the target (measured
//!    candidates before unmeasured ones); the hard rules hold by construction.
//! 4. [`explain`] — source, confidence and a reasoning whose numbers are the
//!    prediction for exactly the settings suggested.
//!
//! When nothing fits even at micro batch 1, [`does_not_fit`] says what would.
//!
//! Balanced is computed first; aggressive never goes below its micro batch
//! and conservative never above it, which makes the micro batch monotone
//! across strategies by construction.

mod candidates;
mod does_not_fit;
mod evaluate;
mod explain;
mod margin;
mod pick;
mod predict;
mod speed;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::catalog::GpuSpec;
use crate::memory::{Estimate, MemoryError};
use crate::run::RunRecord;
use crate::settings::{EngineeringSettings, Pins};
use crate::similarity::HistoryQuery;
use crate::workload::Workload;

pub use candidates::Cand;
pub use does_not_fit::{render_alternatives, Alternative, Change, ChangeNames, DomainChanges};
pub use margin::{margin_from, under_prediction_margin, UNDER_PREDICTION_P99_ALL};
pub use predict::first_run_plan;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum AdvisorError {
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// Even micro batch 1 does not fit: says what would.
    #[error("{}", does_not_fit_message(.model, .gpu, *.needed_gib, *.capacity_gib, .alternatives, &DomainChanges))]
    DoesNotFit {
        model: String,
        gpu: String,
        needed_gib: f64,
        capacity_gib: f64,
        alternatives: Vec<Alternative>,
    },
    #[error("invalid pin: {0}")]
    BadPin(String),
    /// The global batch (scientific) cannot be met exactly with the pins
    /// given: m × a × W = G has no solution. Names the nearest valid choices.
    #[error("the global batch {global} cannot be kept exactly: {reason}")]
    GlobalBatch { global: u32, reason: String },
    /// The GPU description cannot be used (e.g. zero memory).
    #[error("invalid GPU: {0}")]
    BadGpu(String),
}

impl AdvisorError {
    /// The message, each change that would fit said with `names` (the
    /// command line's flags; `Display` uses the domain's words).
    pub fn render(&self, names: &dyn ChangeNames) -> String {
        match self {
            AdvisorError::DoesNotFit {
                model,
                gpu,
                needed_gib,
                capacity_gib,
                alternatives,
            } => does_not_fit_message(model, gpu, *needed_gib, *capacity_gib, alternatives, names),
            other => other.to_string(),
        }
    }
}

fn does_not_fit_message(
    model: &str,
    gpu: &str,
    needed_gib: f64,
    capacity_gib: f64,
    alternatives: &[Alternative],
    names: &dyn ChangeNames,
) -> String {
    format!(
        "{model} does not fit on {gpu} even at micro batch 1 ({needed_gib:.1} GiB predicted, {capacity_gib:.1} GiB on the card). What would: {}",
        render_alternatives(alternatives, names)
    )
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
    /// Training tokens/s of one GPU predicted for these settings (the
    /// throughput model, calibrated by measured runs of this workload).
    #[serde(default)]
    pub predicted_tokens_per_sec: f64,
    /// Tokens/s measured by runs with exactly these settings, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_tokens_per_sec: Option<f64>,
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
/// [`crate::memory::estimate`]; tests and simulations plug in others.
pub trait MemoryModel {
    fn estimate(&self, w: &Workload, s: &EngineeringSettings) -> Result<Estimate, MemoryError>;
}

/// gpufit's own estimator.
#[derive(Debug, Clone, Copy, Default)]
pub struct BuiltinModel;

impl MemoryModel for BuiltinModel {
    fn estimate(&self, w: &Workload, s: &EngineeringSettings) -> Result<Estimate, MemoryError> {
        crate::memory::estimate(w, s)
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

/// Confidence never reaches certainty: hardware, drivers and data vary (docs/design.md, "The advisor").
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

/// A successful run's measured peak at or above this share of the card …
pub const CACHE_FILLED_SHARE: f64 = 0.95;
/// … and this many times the model's prediction is the allocator's cache
/// filling the card (PyTorch releases it when a request fails), not what the
/// step needs: it is learned from as "fits", not as a peak. True
/// under-predictions of the memory model stay within 25 % on the measured
/// rows (`cargo bench --bench accuracy`), so a 1.25× gap is the cache.
pub const CACHE_FILLED_RATIO: f64 = 1.25;

/// With two or more measured batches, extrapolating beyond the largest one
/// carries the fit's noise: the slope gets this many standard errors of
/// margin there (about the one-sided 95th percentile).
pub const LEAST_SQUARES_Z: f64 = 1.65;

/// With one measured micro batch the measurement cannot tell how the model's
/// error splits between its fixed part and its per-sample part, and beyond
/// that batch the split decides: a fixed part over-predicted by the model
/// and a per-sample part under-predicted pass through the same measurement
/// and grow apart with every sample (issue 40: Llama-3.2-1B full on an L4,
/// micro batch 3 measured at 55 %, the model scaled through it predicted 61.5 %
/// at 8, which needed 101 %). Beyond a single measured batch the advisor
/// plans for the worst split the measurement allows
/// ([`crate::learner::worst_split`]), within this range of the
/// model's error: the true fixed part at least 0.85 × the model's (weights,
/// gradients and optimizer states are counted exactly; context, workspaces
/// and the allocator's share are what can be over-counted) …
pub const ONE_POINT_FIXED_LOW: f64 = 0.85;
/// … and the true per-sample part at most 1.5 × the model's (activations
/// depend on kernels the model cannot see; the first run's stated margin is
/// +35 %, [`HEURISTIC_SLOPE_MARGIN`], and the fleets the convergence
/// benchmark simulates reach +45 %). Two or more measured batches replace
/// the range with the fitted line.
pub const ONE_POINT_SLOPE_HIGH: f64 = 1.5;

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
        Strategy::Aggressive => {
            let a = ctx.pick(Strategy::Aggressive, balanced.m, u32::MAX)?;
            // Aggressive's own candidates can all stay below balanced's batch
            // (e.g. balanced needed pure bf16 to meet its target, while
            // aggressive's higher target admits fp32 master weights at 1):
            // then balanced's choice, which meets the higher target too.
            if a.m < balanced.m && req.pins.micro_batch_size.is_none() {
                balanced
            } else {
                a
            }
        }
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

// === the context of one request ===

/// The request, validated, with the history cut down to its similarity key.
pub(crate) struct Ctx<'a> {
    req: &'a AdviceRequest<'a>,
    opts: &'a AdvisorOptions<'a>,
    w: &'a Workload,
    capacity: f64,
    /// Runs under the similarity query (any settings).
    key_runs: Vec<&'a RunRecord>,
    /// Per-GPU batch G / W when a global batch is given.
    per_gpu: Option<u32>,
    /// Throughput calibration per candidate (measured / model), computed
    /// once per request: `speed` is asked for many micro batches.
    calibrations: std::cell::RefCell<std::collections::HashMap<Cand, Option<f64>>>,
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
        let per_gpu = w.global_batch.map(|g| g / w.gpus.max(1));
        if let (Some(g), Some(per)) = (w.global_batch, per_gpu) {
            check_global_batch(g, per, w.gpus, req.pins)?;
        }
        let q = HistoryQuery::new(&w.model.name, w.method, &req.gpu.name, w.seq_len);
        let key_runs: Vec<&RunRecord> = req
            .history
            .iter()
            .filter(|r| q.matches(r) && r.settings.micro_batch_size > 0)
            .collect();
        Ok(Ctx {
            req,
            opts,
            w,
            capacity: req.gpu.memory_bytes as f64,
            key_runs,
            per_gpu,
            calibrations: Default::default(),
        })
    }

    fn target(&self, s: Strategy) -> f64 {
        self.req.targets.for_strategy(s)
    }

    fn gpu_name(&self) -> &str {
        &self.req.gpu.name
    }

    /// Largest micro batch worth considering: the per-GPU batch when a
    /// global batch is given, else [`MAX_MICRO_BATCH`].
    fn cap(&self) -> u32 {
        self.per_gpu
            .unwrap_or(MAX_MICRO_BATCH)
            .clamp(1, MAX_MICRO_BATCH)
    }

    /// Gradient accumulation that goes with micro batch `m`: G / (m × W)
    /// when a global batch is given (m divides the per-GPU batch), else the
    /// pinned value or 1.
    fn accumulation(&self, m: u32) -> u32 {
        match self.per_gpu {
            Some(per) => (per / m.max(1)).max(1),
            None => self.req.pins.gradient_accumulation_steps.unwrap_or(1),
        }
    }

    /// Whether micro batch `m` keeps the global batch exact (always, without one).
    fn eligible(&self, m: u32) -> bool {
        if m == 0 {
            return false;
        }
        match self.per_gpu {
            Some(per) => {
                per.is_multiple_of(m)
                    && self
                        .req
                        .pins
                        .gradient_accumulation_steps
                        .is_none_or(|a| m.checked_mul(a) == Some(per))
            }
            None => true,
        }
    }

    /// The micro batches a search may return, largest first.
    fn eligible_batches(&self) -> Vec<u32> {
        let cap = self.cap();
        match self.per_gpu {
            Some(_) => (1..=cap).rev().filter(|&m| self.eligible(m)).collect(),
            None => (1..=cap).rev().collect(),
        }
    }
}

/// m × a × W = G must be solvable with the pins given: a pinned micro batch
/// or accumulation must divide the per-GPU batch G / W, and both pinned must
/// multiply to it. Otherwise the request is bad input, naming the nearest
/// valid choices.
fn check_global_batch(g: u32, per: u32, gpus: u32, pins: &Pins) -> Result<(), AdvisorError> {
    let near = |x: u32| -> String {
        let below = (1..=x.min(per)).rev().find(|d| per.is_multiple_of(*d));
        let above = (x..=per).find(|d| per.is_multiple_of(*d));
        match (below, above) {
            (Some(b), Some(a)) if a != b => format!("{b} or {a}"),
            (Some(b), _) => b.to_string(),
            (None, Some(a)) => a.to_string(),
            (None, None) => "1".to_string(),
        }
    };
    match (pins.micro_batch_size, pins.gradient_accumulation_steps) {
        (Some(m), Some(a)) if (m as u64) * (a as u64) * (gpus as u64) != g as u64 => {
            Err(AdvisorError::GlobalBatch {
                global: g,
                reason: format!(
                    "pinned micro batch {m} × accumulation {a} × {gpus} GPU(s) = {} samples; unpin one of them, or pin a micro batch that divides the per-GPU batch of {per} (e.g. {}) with accumulation {per}/m",
                    (m as u64) * (a as u64) * (gpus as u64),
                    near(m)
                ),
            })
        }
        (Some(m), _) if !per.is_multiple_of(m) => Err(AdvisorError::GlobalBatch {
            global: g,
            reason: format!(
                "the pinned micro batch {m} does not divide the per-GPU batch of {per} ({g} over {gpus} GPU(s)); nearest valid micro batches: {}",
                near(m)
            ),
        }),
        (_, Some(a)) if !per.is_multiple_of(a) => Err(AdvisorError::GlobalBatch {
            global: g,
            reason: format!(
                "the pinned gradient accumulation {a} does not divide the per-GPU batch of {per} ({g} over {gpus} GPU(s)); nearest valid accumulations: {}",
                near(a)
            ),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests;
