//! Step 2: judge one candidate for one strategy — its largest micro batch
//! whose pessimistic prediction meets the strategy's target, never at or
//! above an OOM of the same settings (or of settings that only save memory
//! on top of them), never beyond a batch of them measured at or above the
//! target, never predicted above the card.

use super::predict::{saves_at_least, Predictor};
use super::speed::Speed;
use super::{AdvisorError, Cand, Ctx, Strategy};
use crate::learner::{self, Correction};
use crate::run::RunRecord;
use crate::similarity::matches_settings;
use crate::units::to_gib;

/// What is known about a candidate from history.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Evidence {
    None,
    Success,
    Memory,
}

/// A candidate judged for one strategy.
#[derive(Clone)]
pub(super) struct Eval<'c, 'a> {
    pub cand: Cand,
    /// Chosen micro batch and the accumulation that goes with it.
    pub m: u32,
    pub a: u32,
    /// Whether the prediction at `m` meets the strategy's target (false:
    /// only over the target, at micro batch 1 or a batch that already ran).
    pub meets_target: bool,
    /// Best prediction of the peak at `m` (bytes): what is printed.
    pub predicted: f64,
    pub evidence: Evidence,
    pub correction: Option<Correction>,
    /// Runs with exactly this dtype and checkpointing.
    pub similar: usize,
    pub successes: usize,
    pub largest_success: Option<u32>,
    pub oom_min: Option<u32>,
    /// Largest measured batch and its peak, for the reasoning.
    pub measured: Option<(u32, u64)>,
    /// Runs whose peak is only a lower bound (a multi-node job's peak of
    /// fewer nodes than it ran on): floors, not measurements.
    pub lower_bounds: usize,
    /// Similar runs of these settings that nothing confirms ran them
    /// ([`RunRecord::settings_unconfirmed`]): floors only.
    pub unconfirmed: usize,
    pub speed: Speed,
    /// The fastest other candidate that met the target (for the reasoning).
    pub runner_up: Option<(Cand, u32, Speed)>,
    pub warnings: Vec<String>,
    pub pred: Predictor<'c, 'a>,
}

impl Eval<'_, '_> {
    /// Moves the evaluation to micro batch `m` (a strategy's floor or ceiling).
    pub fn move_to(&mut self, ctx: &Ctx<'_>, m: u32) -> Result<(), AdvisorError> {
        self.m = m;
        self.a = ctx.accumulation(m);
        self.predicted = self.pred.best(m)?;
        self.speed = ctx.speed(self.cand, m);
        self.runner_up = None;
        self.warnings.clear();
        Ok(())
    }
}

impl<'a> Ctx<'a> {
    /// Runs recorded with exactly the candidate's memory settings.
    pub(super) fn exact_runs(&self, c: Cand) -> Vec<&'a RunRecord> {
        self.key_runs
            .iter()
            .copied()
            .filter(|r| {
                matches_settings(r, c.dtype, c.ckpt)
                    && r.settings.activation_offloading == c.offload
            })
            .collect()
    }

    /// Largest eligible micro batch up to `limit` whose pessimistic
    /// prediction is within `budget`; 0 when none is.
    fn largest_under(
        &self,
        p: &Predictor<'_, '_>,
        budget: f64,
        limit: u32,
    ) -> Result<u32, AdvisorError> {
        if limit == 0 {
            return Ok(0);
        }
        if self.per_gpu.is_some() {
            // Accumulation changes with m (G / (m × W)), and with it whether
            // gradients stay alive: no monotonicity to bisect on. The
            // divisors are few.
            for m in self.eligible_batches() {
                if m <= limit && p.plan(m)? <= budget {
                    return Ok(m);
                }
            }
            return Ok(0);
        }
        if p.plan(1)? > budget {
            return Ok(0);
        }
        // The prediction grows with m at a fixed accumulation: bisect.
        let (mut lo, mut hi) = (1u32, limit + 1);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if p.plan(mid)? <= budget {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Ok(lo)
    }

    /// Judges candidate `c` for strategy `s`; None when no micro batch of it
    /// can run (an OOM at 1, or over the card even at 1).
    pub(super) fn evaluate<'c>(
        &'c self,
        s: Strategy,
        c: Cand,
    ) -> Result<Option<Eval<'c, 'a>>, AdvisorError> {
        let runs = self.exact_runs(c);
        let pred = self.predictor(self.w, c, &runs)?;
        // OOMs of these settings, or of settings that only save memory on
        // top of them, bound the batch; an untried compile is planned to
        // fit uncompiled too, so the uncompiled OOMs bound it as well.
        let bound = Cand {
            compile: c.compile && !pred.compile_untried,
            ..c
        };
        let bounding: Vec<&RunRecord> = self
            .key_runs
            .iter()
            .copied()
            .filter(|r| saves_at_least(r, bound))
            .collect();
        let oom_min = learner::smallest_oom(&bounding);
        // A success proves these settings fit only where it needed at least
        // as much memory: a compiled run says nothing about uncompiled.
        let fitted: Vec<&RunRecord> = runs
            .iter()
            .copied()
            .filter(|r| !r.settings.compile || c.compile)
            .collect();
        let largest_success =
            learner::largest_success(&fitted).filter(|&m| oom_min.is_none_or(|o| m < o));
        let successes = runs
            .iter()
            .filter(|r| r.result.success() && !r.settings_unconfirmed())
            .count();
        let evidence = if pred.correction.is_some() {
            Evidence::Memory
        } else if successes > 0 {
            Evidence::Success
        } else {
            Evidence::None
        };
        let measured = runs
            .iter()
            .filter(|r| r.result.success())
            .filter_map(|r| Some((r.settings.micro_batch_size, r.full_peak()?)))
            .max();
        let lower_bounds = runs
            .iter()
            .filter(|r| {
                r.result.peak_memory_bytes.is_some()
                    && r.peak_is_lower_bound()
                    && !r.settings_unconfirmed()
            })
            .count();
        let unconfirmed = runs.iter().filter(|r| r.settings_unconfirmed()).count();
        let budget = self.target(s) * self.capacity;
        let mut warnings = Vec::new();

        // Below the smallest OOM, and never beyond a batch of these settings
        // measured at or above the target.
        let limit = oom_min
            .map_or(self.cap(), |o| self.cap().min(o.saturating_sub(1)))
            .min(pred.measured_over(budget).unwrap_or(u32::MAX));
        let (m, meets_target) = if let Some(pm) = self.req.pins.micro_batch_size {
            (pm, pred.best(pm)? <= budget)
        } else {
            let mut m = self.largest_under(&pred, budget, limit)?;
            // No room beyond the largest measured batch under the
            // pessimistic prediction: that batch again would teach nothing.
            // The next batch, if the best prediction meets the target and
            // the pessimistic one fits the card with the run-to-run noise,
            // gives the point that settles it.
            if let Some(corr) = pred.correction {
                let m1 = corr.max_measured_batch;
                if m <= m1 {
                    let next = ((m1 + 1)..=limit).find(|&x| self.eligible(x));
                    if let Some(n) = next {
                        let worst = pred.plan(n)? * (1.0 + learner::PEAK_NOISE);
                        if pred.best(n)? <= budget && worst <= self.capacity {
                            m = n;
                        }
                    }
                }
            }
            let mut meets = m > 0;
            if m == 0 && oom_min != Some(1) && pred.best(1)? <= self.capacity {
                // Over the target even at 1, but predicted to fit the card:
                // micro batch 1 is still an answer (with a warning).
                m = 1;
            }
            // Balanced and aggressive never go below what already ran with
            // these settings (it is measured to fit), unless it was measured
            // at or above the target and a smaller batch meets it.
            if s != Strategy::Conservative {
                if let Some(ls) = largest_success {
                    let measured_over = pred.floor(ls) >= budget;
                    if ls > m && ls <= limit && self.eligible(ls) && !(meets && measured_over) {
                        let p = pred.best(ls)?;
                        if p <= self.capacity {
                            m = ls;
                            meets = p <= budget;
                        }
                    }
                }
            }
            if m == 0 {
                return Ok(None);
            }
            (m, meets)
        };
        let predicted = pred.best(m)?;
        if !meets_target && self.req.pins.micro_batch_size.is_none() {
            warnings.push(format!(
                "micro batch {m} is predicted to need {:.1} GiB, above the {s} target of {:.0} % of {:.1} GiB (it is predicted to fit the card)",
                to_gib(predicted as u64),
                self.target(s) * 100.0,
                to_gib(self.capacity as u64)
            ));
        }
        Ok(Some(Eval {
            cand: c,
            m,
            a: self.accumulation(m),
            meets_target,
            predicted,
            evidence,
            correction: pred.correction,
            similar: runs.len(),
            successes,
            largest_success,
            oom_min,
            measured,
            lower_bounds,
            unconfirmed,
            speed: self.speed(c, m),
            runner_up: None,
            warnings,
            pred,
        }))
    }
}
