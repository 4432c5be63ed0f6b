//! Step 3: pick one candidate — the fastest that meets the strategy's
//! target, measured candidates before unmeasured ones.

use super::evaluate::{Eval, Evidence};
use super::speed::{self, SPEED_NOISE};
use super::{AdvisorError, Ctx, Strategy};
use crate::settings::Dtype;
use crate::units::to_gib;

impl<'a> Ctx<'a> {
    fn evaluate_all<'c>(
        &'c self,
        s: Strategy,
        dtypes: &[Dtype],
    ) -> Result<Vec<Eval<'c, 'a>>, AdvisorError> {
        let mut out = Vec::new();
        for c in self.candidates(s, dtypes) {
            if let Some(e) = self.evaluate(s, c)? {
                out.push(e);
            }
        }
        Ok(out)
    }

    /// The candidate strategy `s` picks, never below `floor` when possible
    /// and never above `ceil`.
    pub(super) fn pick<'c>(
        &'c self,
        s: Strategy,
        floor: u32,
        ceil: u32,
    ) -> Result<Eval<'c, 'a>, AdvisorError> {
        let policy = self.dtype_policy();
        let mut evals = self.evaluate_all(s, &policy.preferred)?;
        let mut fallback_used = false;
        if !policy.fallback.is_empty() && !evals.iter().any(|e| e.meets_target) {
            // Pure bf16 only where it is the way to fit: nothing with fp32
            // master weights meets the target.
            let more = self.evaluate_all(s, &policy.fallback)?;
            if evals.is_empty() || more.iter().any(|e| e.meets_target) {
                fallback_used = !more.is_empty();
                evals.extend(more);
            }
        }
        let pinned_m = self.req.pins.micro_batch_size.is_some();
        if !pinned_m {
            let ceil_m = (1..=ceil.min(self.cap())).rev().find(|&m| self.eligible(m));
            for e in evals.iter_mut() {
                if let Some(cm) = ceil_m.filter(|&cm| e.m > cm) {
                    e.move_to(self, cm)?;
                }
            }
        }
        let mut chosen = if pinned_m {
            self.pick_pinned(s, evals)?
        } else {
            self.pick_fastest(s, floor, evals)?
        };
        if fallback_used && chosen.cand.dtype == Dtype::Bf16 {
            chosen.warnings.push(format!(
                "pure bf16 weights (no fp32 master copy): with {} nothing meets the {s} target of {:.0} % of {:.1} GiB. Pure bf16 can lose precision in long full fine-tunes; pass --pure-bf16 forbid to keep fp32 master weights",
                Dtype::Bf16Mixed,
                self.target(s) * 100.0,
                to_gib(self.capacity as u64)
            ));
        }
        Ok(chosen)
    }

    fn pick_fastest<'c>(
        &'c self,
        s: Strategy,
        floor: u32,
        mut evals: Vec<Eval<'c, 'a>>,
    ) -> Result<Eval<'c, 'a>, AdvisorError> {
        if evals.is_empty() {
            return Err(self.does_not_fit(s)?);
        }
        // "The fastest that meets the target": candidates over the target
        // are used only when no candidate meets it, and then the one with
        // the most room, not the fastest.
        if evals.iter().any(|e| e.meets_target) {
            evals.retain(|e| e.meets_target);
        } else if let Some(lowest) = evals
            .iter()
            .min_by(|a, b| a.predicted.total_cmp(&b.predicted))
            .cloned()
        {
            evals = vec![lowest];
        }
        let above: Vec<Eval> = evals.iter().filter(|e| e.m >= floor).cloned().collect();
        let pool = if above.is_empty() {
            let mut best = evals
                .into_iter()
                .max_by_key(|e| e.m)
                .ok_or_else(|| AdvisorError::BadPin("no candidate settings".into()))?;
            best.warnings.push(format!(
                "the {s} micro batch is below balanced's: its settings leave less room"
            ));
            vec![best]
        } else {
            above
        };
        // The fastest by throughput (measured where it ran, else predicted
        // and calibrated). An untried candidate must beat the best measured
        // one by more than the run-to-run noise to be tried: then it is
        // (one change per run, safe by the memory model, never past an
        // OOM); otherwise the measured one stays.
        // A legacy history without any throughput figure keeps the
        // evidence order: measured settings beat unmeasured ones, and
        // without memory data, the settings most of those runs used.
        if !self
            .key_runs
            .iter()
            .any(|r| speed::run_tokens_per_sec(r).is_some())
        {
            if let Some(e) = Self::pick_by_evidence(&pool) {
                return Ok(e);
            }
        }
        let tps = |e: &Eval| e.speed.tokens_per_sec;
        let fastest = pool
            .iter()
            .max_by(|a, b| tps(a).total_cmp(&tps(b)))
            .ok_or_else(|| AdvisorError::BadPin("no candidate settings".into()))?;
        let measured = |e: &Eval| {
            self.key_runs.iter().any(|r| {
                r.result.success()
                    && Self::same_speed_settings(r, e.cand)
                    && speed::run_tokens_per_sec(r).is_some()
            })
        };
        let incumbent = pool
            .iter()
            .filter(|e| measured(e))
            .max_by(|a, b| tps(a).total_cmp(&tps(b)));
        let chosen = match incumbent {
            Some(inc) if !measured(fastest) && tps(fastest) <= tps(inc) * (1.0 + SPEED_NOISE) => {
                inc
            }
            _ => fastest,
        };
        let mut chosen = chosen.clone();
        if let Some(r) = pool
            .iter()
            .filter(|e| e.cand != chosen.cand)
            .max_by(|a, b| tps(a).total_cmp(&tps(b)))
        {
            chosen.runner_up = Some((r.cand, r.m, r.speed));
        }
        Ok(chosen)
    }

    /// The evidence order (no throughput measured anywhere): memory data,
    /// then successes, then the model; among equals the fastest, or with
    /// successes only, the settings most runs used.
    fn pick_by_evidence<'c>(pool: &[Eval<'c, 'a>]) -> Option<Eval<'c, 'a>> {
        let top = pool.iter().map(|e| e.evidence).max()?;
        if top == Evidence::None {
            return None;
        }
        let mut chosen: Vec<&Eval> = match top {
            Evidence::Memory => pool
                .iter()
                .filter(|e| e.evidence >= Evidence::Success)
                .collect(),
            _ => pool.iter().filter(|e| e.evidence == top).collect(),
        };
        chosen.sort_by(|a, b| {
            let key = |e: &Eval| {
                if top == Evidence::Success {
                    (e.successes as f64, e.speed.tokens_per_sec)
                } else {
                    (e.speed.tokens_per_sec, e.successes as f64)
                }
            };
            let (ka, kb) = (key(a), key(b));
            kb.0.total_cmp(&ka.0).then(kb.1.total_cmp(&ka.1))
        });
        chosen.first().map(|e| (*e).clone())
    }

    /// A pinned micro batch: keep it; choose the other settings so it fits
    /// best, and warn when it is predicted to run out of memory.
    fn pick_pinned<'c>(
        &'c self,
        s: Strategy,
        evals: Vec<Eval<'c, 'a>>,
    ) -> Result<Eval<'c, 'a>, AdvisorError> {
        let budget = self.target(s) * self.capacity;
        let mut fitting: Vec<&Eval> = evals
            .iter()
            .filter(|e| e.predicted <= budget && e.oom_min.is_none_or(|o| e.m < o))
            .collect();
        fitting.sort_by(|a, b| b.speed.tokens_per_sec.total_cmp(&a.speed.tokens_per_sec));
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
}
