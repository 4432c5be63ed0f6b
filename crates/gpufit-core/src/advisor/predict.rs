//! One memory truth: the peak of a candidate at any micro batch is the
//! memory model's estimate for exactly the settings that would be suggested
//! (that micro batch, the accumulation it implies, every phase of the step),
//! corrected by the runs measured with those settings and bounded by their
//! OOMs, and never below a peak measured at or under that micro batch with
//! the same settings or with settings that only save memory on top of them
//! (compile, checkpointing, offloading). The search for a micro batch, the
//! hard rules and the printed `predicted_peak_bytes` all use this one
//! prediction.

use super::margin::under_prediction_margin;
use super::{
    AdvisorError, Cand, Ctx, HEURISTIC_FIXED_MARGIN, HEURISTIC_SLOPE_MARGIN, LEAST_SQUARES_Z,
    ONE_POINT_FIXED_LOW, ONE_POINT_SLOPE_HIGH,
};
use super::{CACHE_FILLED_RATIO, CACHE_FILLED_SHARE};
use crate::learner::{self, Correction, CorrectionKind, ErrorRange, Measured, Split};
use crate::memory::Estimate;
use crate::run::RunRecord;
use crate::workload::{Framework, Workload};

/// The corrected memory prediction of one candidate.
#[derive(Clone)]
pub(super) struct Predictor<'c, 'a> {
    ctx: &'c Ctx<'a>,
    w: &'c Workload,
    cand: Cand,
    pub correction: Option<Correction>,
    /// An OOM below the corrected prediction: beyond micro batch `.0` the
    /// peak grows by `.1` more bytes per sample than predicted, just enough
    /// that the OOM batch reaches the card's capacity.
    pub oom_tilt: Option<(u32, f64)>,
    /// With one distinct measured batch (or a degenerate line): the worst
    /// split of the measured error, planned with beyond that batch.
    pub split: Option<Split>,
    /// Measured peaks (micro batch, bytes) that bound the prediction from
    /// below at their batch and above: runs of exactly these settings, or
    /// of these settings with compile, checkpointing or offloading turned on
    /// (they never need more memory than without).
    pub floors: Vec<(u32, f64)>,
    /// For an untried compile: the floors of the same settings uncompiled,
    /// which its plan must fit as well (see `compile_untried`).
    plain_floors: Vec<(u32, f64)>,
    /// A compiled candidate without compiled measurements of its own:
    /// planned to fit compiled and uncompiled.
    pub compile_untried: bool,
}

impl<'c, 'a> Predictor<'c, 'a> {
    /// The memory model's estimate at micro batch `m` (with its accumulation).
    pub fn model(&self, m: u32) -> Result<Estimate, AdvisorError> {
        let s = self.cand.settings(m, self.ctx.accumulation(m));
        Ok(self.ctx.opts.model.estimate(self.w, &s)?)
    }

    /// Best prediction of the peak (bytes) at micro batch `m`: no margin.
    pub fn best(&self, m: u32) -> Result<f64, AdvisorError> {
        let e = self.model(m)?;
        Ok(self.best_of(&e, m))
    }

    fn best_of(&self, e: &Estimate, m: u32) -> f64 {
        let mut p = e.peak_bytes as f64;
        if let Some(c) = self.correction {
            p = c.apply(p, m);
        }
        (p + self.tilt(m)).max(self.floor(m)).max(0.0)
    }

    /// The OOM tilt's extra bytes at micro batch `m`.
    fn tilt(&self, m: u32) -> f64 {
        self.oom_tilt
            .map_or(0.0, |(from, extra)| extra * m.saturating_sub(from) as f64)
    }

    /// The largest peak measured at or below micro batch `m` with settings
    /// that bound this candidate from below (0 when none).
    pub fn floor(&self, m: u32) -> f64 {
        floor_in(&self.floors, m)
    }

    /// The smallest micro batch of these settings (or, for an untried
    /// compile, of them uncompiled) measured at or above `budget` bytes:
    /// beyond it they are never suggested.
    pub fn measured_over(&self, budget: f64) -> Option<u32> {
        self.floors
            .iter()
            .chain(&self.plain_floors)
            .filter(|&&(_, p)| p >= budget)
            .map(|&(m, _)| m)
            .min()
    }

    /// The pessimistic prediction a suggestion keeps under the target: what
    /// the peak could be if the model's errors fall on the unlucky side.
    /// Without measurements, the model's stated margins
    /// ([`HEURISTIC_FIXED_MARGIN`] on the fixed part, [`HEURISTIC_SLOPE_MARGIN`]
    /// on the per-sample part); with them, the fit's uncertainty beyond the
    /// largest measured batch.
    pub fn plan(&self, m: u32) -> Result<f64, AdvisorError> {
        let e = self.model(m)?;
        let compiled = self.plan_of(&e, m);
        if !self.compile_untried {
            return Ok(compiled);
        }
        // An untried compile must fit either way — compiled or not — so a
        // compile that fails or saves less than modelled costs one retry,
        // not an OOM.
        let mut s = self.cand.settings(m, self.ctx.accumulation(m));
        s.compile = false;
        let plain = self.ctx.opts.model.estimate(self.w, &s)?;
        Ok(compiled
            .max(self.plan_of(&plain, m))
            .max(floor_in(&self.plain_floors, m)))
    }

    fn plan_of(&self, e: &Estimate, m: u32) -> f64 {
        let best = self.best_of(e, m);
        let Some(c) = self.correction else {
            let tilt = best - e.peak_bytes as f64;
            return first_run_plan(e, self.w.framework) + tilt;
        };
        if m <= c.max_measured_batch {
            return best;
        }
        match (c.kind, self.split) {
            // Two or more measured batches: the fitted line, with its
            // slope's noise beyond the largest.
            (CorrectionKind::ResidualLine, _) => {
                let beyond = (m - c.max_measured_batch) as f64;
                best + LEAST_SQUARES_Z * c.r1_stderr * beyond
            }
            // One batch measured: the worst split of its error between the
            // fixed and per-sample parts (see ONE_POINT_FIXED_LOW).
            (_, Some(split)) => {
                let worst = split.at(e.fixed_bytes as f64, e.per_sample_bytes as f64, m);
                best.max(worst + self.tilt(m))
            }
            (_, None) => best,
        }
    }
}

impl<'a> Ctx<'a> {
    /// The predictor of candidate `c` for workload `w`, corrected by `runs`
    /// (runs recorded with exactly the candidate's memory settings).
    pub(super) fn predictor<'c>(
        &'c self,
        w: &'c Workload,
        c: Cand,
        runs: &[&RunRecord],
    ) -> Result<Predictor<'c, 'a>, AdvisorError> {
        let mut p = Predictor {
            ctx: self,
            w,
            cand: c,
            correction: None,
            oom_tilt: None,
            split: None,
            floors: self.floors(w, c)?,
            plain_floors: Vec::new(),
            compile_untried: c.compile,
        };
        if runs.is_empty() {
            return Ok(p);
        }
        // Peaks are learned from runs with the candidate's compile setting;
        // a compiled candidate without its own measurements borrows the
        // uncompiled ones (compile does not add memory: the H100 measured
        // 24–34 % less), never the other way round.
        let same_compile = |r: &&&RunRecord| r.settings.compile == c.compile;
        let has_own = runs
            .iter()
            .filter(same_compile)
            .any(|r| r.result.success() && r.full_peak().is_some());
        p.compile_untried = c.compile && !has_own;
        if p.compile_untried {
            let plain = Cand {
                compile: false,
                ..c
            };
            p.plain_floors = self.floors(w, plain)?;
        }
        let learn_from: Vec<&&RunRecord> = if has_own || !c.compile {
            runs.iter().filter(same_compile).collect()
        } else {
            runs.iter().collect()
        };
        let mut points = Vec::new();
        let mut cache_filled = 0;
        for r in learn_from.into_iter().filter(|r| r.result.success()) {
            // A partial multi-node peak is only a lower bound of the job's:
            // it raises the floors (see `floors`), never the fitted line,
            // which would extrapolate from it as if it were the peak.
            let Some(peak) = r.full_peak() else {
                continue;
            };
            let e = self.model_for_record(w, r)?;
            if cache_filled_the_card(peak as f64, e.peak_bytes as f64, self.capacity) {
                // The run fitted; its peak says how full the allocator's
                // cache got, not what the step needs (see CACHE_FILLED_SHARE).
                cache_filled += 1;
                continue;
            }
            points.push(Measured {
                micro_batch: r.settings.micro_batch_size,
                model_bytes: e.peak_bytes as f64,
                model_slope: e.per_sample_bytes as f64,
                model_fixed: e.fixed_bytes as f64,
                peak_bytes: peak as f64,
            });
        }
        p.correction = learner::correct(&points).map(|c| Correction {
            outliers: c.outliers + cache_filled,
            ..c
        });
        if p.correction
            .is_some_and(|c| c.kind != CorrectionKind::ResidualLine)
        {
            p.split = learner::worst_split(&points, ONE_POINT_RANGE);
        }
        // The smallest OOM is an upper bound: the true peak there was above
        // the card. A prediction that says otherwise is too low beyond the
        // largest measured batch below it.
        // An uncompiled OOM says nothing about compiled settings measured on
        // their own (compile never adds memory: bounds flow the other way).
        let compiled_own = c.compile && !p.compile_untried;
        let oom = runs
            .iter()
            .filter(|r| r.is_oom() && (r.settings.compile || !compiled_own))
            .min_by_key(|r| r.settings.micro_batch_size);
        if let Some(r) = oom {
            let o = r.settings.micro_batch_size;
            let e = self.model_for_record(w, r)?;
            let at_oom = match p.correction {
                Some(c) => c.apply(e.peak_bytes as f64, o),
                None => e.peak_bytes as f64,
            };
            if at_oom < self.capacity {
                let from = points
                    .iter()
                    .map(|q| q.micro_batch)
                    .filter(|&m| m < o)
                    .max()
                    .unwrap_or(0);
                let extra = (self.capacity - at_oom) / (o - from).max(1) as f64;
                p.oom_tilt = Some((from, extra));
            }
        }
        Ok(p)
    }

    /// The measured peaks that bound candidate `c` from below (see
    /// [`Predictor::floors`]): successful runs of the same dtype whose
    /// compile, checkpointing and offloading are each those of `c` or on,
    /// at a sequence no longer than the workload's. A partial multi-node
    /// peak ([`RunRecord::peak_is_lower_bound`]) bounds too: the job's peak
    /// was at least it. A peak that is the allocator's cache filling the
    /// card (see [`CACHE_FILLED_SHARE`]) is not what the step needs and
    /// bounds nothing.
    fn floors(&self, w: &Workload, c: Cand) -> Result<Vec<(u32, f64)>, AdvisorError> {
        let mut out = Vec::new();
        for r in self.key_runs.iter().filter(|r| saves_at_least(r, c)) {
            let Some(peak) = r.result.peak_memory_bytes.filter(|_| r.result.success()) else {
                continue;
            };
            if r.seq_len > w.seq_len {
                continue;
            }
            let e = self.model_for_record(w, r)?;
            if !cache_filled_the_card(peak as f64, e.peak_bytes as f64, self.capacity) {
                out.push((r.settings.micro_batch_size, peak as f64));
            }
        }
        Ok(out)
    }

    /// The memory model's estimate for the settings a run really used, at
    /// its own sequence length (similar runs differ by up to 10 %).
    fn model_for_record(&self, w: &Workload, r: &RunRecord) -> Result<Estimate, AdvisorError> {
        let mut s = r.settings.clone();
        s.gradient_accumulation_steps = s.gradient_accumulation_steps.max(1);
        if r.seq_len != w.seq_len && r.seq_len > 0 {
            let wr = Workload {
                seq_len: r.seq_len,
                ..w.clone()
            };
            if let Ok(e) = self.opts.model.estimate(&wr, &s) {
                return Ok(e);
            }
        }
        Ok(self.opts.model.estimate(w, &s)?)
    }
}

/// The largest peak among `floors` measured at or below micro batch `m`.
fn floor_in(floors: &[(u32, f64)], m: u32) -> f64 {
    floors
        .iter()
        .filter(|&&(fm, _)| fm <= m)
        .map(|&(_, p)| p)
        .fold(0.0, f64::max)
}

/// The range of the memory model's error a single measured batch is read
/// with (see [`ONE_POINT_FIXED_LOW`]).
const ONE_POINT_RANGE: ErrorRange = ErrorRange {
    fixed_low: ONE_POINT_FIXED_LOW,
    slope_high: ONE_POINT_SLOPE_HIGH,
};

/// Whether run `r` used candidate `c`'s dtype, with each of compile,
/// checkpointing and offloading as `c` has it or on: settings that need no
/// more memory than `c`'s (compile measured 24–34 % less on the H100;
/// checkpointing and offloading only take activations off the card), so
/// its measured peak is a floor for `c` and its OOM an OOM of `c`.
pub(super) fn saves_at_least(r: &RunRecord, c: Cand) -> bool {
    let s = &r.settings;
    s.dtype == c.dtype
        && (s.compile || !c.compile)
        && (s.activation_checkpointing || !c.ckpt)
        && (s.activation_offloading || !c.offload)
}

/// A successful run whose measured peak filled the card far beyond what the
/// model predicts: PyTorch's caching allocator keeps freed blocks until a
/// request fails, then releases them and retries (measured on the H100 with
/// variable-length batches: reserved memory climbs over 30 steps from 28 to
/// 77 GiB of 79.6 while the step needs 32 GiB, and drops when the card is
/// full; bench/data/h100/steps.csv). Such a peak is the cache, not the need.
fn cache_filled_the_card(peak: f64, model: f64, capacity: f64) -> bool {
    peak >= CACHE_FILLED_SHARE * capacity && peak >= CACHE_FILLED_RATIO * model
}

/// What a suggestion without measurements plans with for the estimate `e`
/// of a `framework` workload: the fixed part and the per-sample part each
/// with its stated margin ([`HEURISTIC_FIXED_MARGIN`],
/// [`HEURISTIC_SLOPE_MARGIN`]), and never below the estimate raised by the
/// model's measured under-prediction for that framework
/// ([`under_prediction_margin`]: its 99th percentile). The accuracy
/// benchmark checks this figure against measured peaks.
pub fn first_run_plan(e: &Estimate, framework: Framework) -> f64 {
    let m = e.micro_batch_size as f64;
    let line = e.fixed_bytes as f64 * (1.0 + HEURISTIC_FIXED_MARGIN)
        + e.per_sample_bytes as f64 * (1.0 + HEURISTIC_SLOPE_MARGIN) * m;
    let peak = e.peak_bytes as f64;
    line.max(peak * (1.0 + HEURISTIC_FIXED_MARGIN))
        .max(peak * (1.0 + under_prediction_margin(framework)))
}
