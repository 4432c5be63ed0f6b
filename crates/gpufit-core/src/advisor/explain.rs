//! Step 4: the suggestion — source, confidence and a reasoning whose
//! numbers are the prediction for exactly the settings suggested; and the
//! `learned_from_failures` path, where every similar run failed.

use super::evaluate::{Eval, Evidence};
use super::margin::under_prediction_margin;
use super::speed::SPEED_NOISE;
use super::{
    AdvisorError, Cand, Ctx, Strategy, Suggestion, SuggestionSource, HEURISTIC_FIXED_MARGIN,
    HEURISTIC_SLOPE_MARGIN, MAX_CONFIDENCE,
};
use crate::learner::{self, CorrectionKind};
use crate::memory;
use crate::run::RunRecord;
use crate::settings::{DataLoaderSettings, EngineeringSettings};
use crate::throughput;
use crate::units::to_gib;
use crate::workload::{Attention, Workload};

impl<'a> Ctx<'a> {
    /// Source, confidence and reasoning for a picked candidate.
    pub(super) fn finish(&self, s: Strategy, e: Eval<'_, '_>) -> Suggestion {
        let cap_gib = to_gib(self.capacity as u64);
        let pct = |b: f64| 100.0 * b / self.capacity;
        let budget = self.target(s) * self.capacity;
        let target_pct = self.target(s) * 100.0;
        let boundary = match e.oom_min {
            Some(o) if o > e.m => format!("; micro batch {o} ran out of memory before"),
            _ => String::new(),
        };
        // A run already at or above the target leaves nothing to
        // extrapolate: plain history, no memory analysis.
        let measured_over_target = e.measured.is_some_and(|(_, p)| p as f64 >= budget);
        let (source, mut conf, reason) = match (e.evidence, e.correction) {
            (Evidence::Memory, Some(c)) if !measured_over_target => {
                let (mm, mp) = e.measured.unwrap_or((c.max_measured_batch, 0));
                let how = match c.kind {
                    CorrectionKind::ResidualLine => format!(
                        "the memory model corrected by a line fitted over {} measured batch sizes",
                        c.distinct_batches
                    ),
                    _ => format!(
                        "the memory model scaled ×{:.2} to that measurement",
                        c.scale
                    ),
                };
                // Beyond a single measured batch the batch was chosen with
                // the worst split of the measured error: say so, in numbers.
                let how = match e.pred.split {
                    Some(sp) if c.kind != CorrectionKind::ResidualLine && e.m > mm => {
                        let planned = e.pred.plan(e.m).unwrap_or(e.predicted);
                        format!(
                            "{how}, planned beyond it for the worst split of the measured error between fixed part and per-sample part (fixed part ×{:.2}, per sample ×{:.2} of the model: {:.1} GiB),",
                            sp.fixed,
                            sp.slope,
                            to_gib(planned as u64)
                        )
                    }
                    _ => how,
                };
                let outliers = if c.outliers > 0 {
                    format!(
                        " ({} measurement{} left out: inconsistent with the others, or the allocator's cache filling the card)",
                        c.outliers,
                        plural(c.outliers)
                    )
                } else {
                    String::new()
                };
                let r = format!(
                    "Memory analysis of {} successful run{}: micro batch {mm} measured {:.1} GiB, and {how}{outliers} predicts {:.1} GiB at micro batch {} ({:.0} % of {cap_gib:.1} GiB, target {target_pct:.0} %){boundary}",
                    e.successes,
                    plural(e.successes),
                    to_gib(mp),
                    to_gib(e.predicted as u64),
                    e.m,
                    pct(e.predicted),
                );
                let c = 0.6
                    + 0.05 * (c.points.min(4) as f64)
                    + if c.kind == CorrectionKind::ResidualLine {
                        0.05
                    } else {
                        0.0
                    };
                (SuggestionSource::HistoricalDataWithMemory, c, r)
            }
            (Evidence::Success, _) | (Evidence::Memory, _) => {
                let ls = e.largest_success.unwrap_or(e.m);
                let over = match e.measured {
                    Some((mm, mp)) if measured_over_target => format!(
                        "; micro batch {mm} already peaked at {:.1} GiB, at or above the {s} target of {target_pct:.0} %",
                        to_gib(mp)
                    ),
                    _ => String::new(),
                };
                let r = format!(
                    "{} similar run{} succeeded with {}, the largest at micro batch {ls}{over}; this suggests micro batch {} (predicted {:.1} GiB){boundary}",
                    e.successes,
                    plural(e.successes),
                    describe(e.cand),
                    e.m,
                    to_gib(e.predicted as u64),
                );
                let c = 0.5 + 0.05 * (e.successes.min(6) as f64);
                (SuggestionSource::HistoricalData, c, r)
            }
            (Evidence::None, _) => {
                // The figure the micro batch was chosen with: the estimate
                // plus the stated margins (predict::first_run_plan).
                let planned = e.pred.plan(e.m).unwrap_or(e.predicted);
                let r = format!(
                    "No similar runs of {} on {} with {} yet, so the memory model alone predicts {:.1} GiB at micro batch {} ({:.0} % of {cap_gib:.1} GiB, target {target_pct:.0} %); it was chosen with {:.1} GiB, the prediction plus the stated margins for the model's error (+{:.0} % fixed part, +{:.0} % per sample, at least +{:.1} %: the raise that covers the model's under-prediction on 99 of 100 measured {} jobs it under-predicts){boundary}",
                    self.w.model.name,
                    self.gpu_name(),
                    describe(e.cand),
                    to_gib(e.predicted as u64),
                    e.m,
                    pct(e.predicted),
                    to_gib(planned as u64),
                    100.0 * HEURISTIC_FIXED_MARGIN,
                    100.0 * HEURISTIC_SLOPE_MARGIN,
                    100.0 * under_prediction_margin(self.w.framework),
                    self.w.framework,
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
        let partial = match e.lower_bounds {
            0 => String::new(),
            n => format!(
                "; {n} multi-node run{} recorded the peak of only some of {} nodes: that peak is a lower bound, used to raise the floor at and above its batch, never to extrapolate to a larger one",
                plural(n),
                if n == 1 { "its" } else { "their" }
            ),
        };
        let unconfirmed = match e.unconfirmed {
            0 => String::new(),
            n => format!(
                "; {n} run{} did not confirm that {} the injected settings (no result record, no settings in {} log, no filled placeholders): {} peak only raises the floor, never sets a larger batch",
                plural(n),
                if n == 1 { "it ran" } else { "they ran" },
                if n == 1 { "its" } else { "their" },
                if n == 1 { "its" } else { "their" }
            ),
        };
        let reason = format!("{reason}{partial}{unconfirmed}{}", speed_clause(&e));
        self.build(s, e, source, conf, reason)
    }

    pub(super) fn build(
        &self,
        s: Strategy,
        e: Eval<'_, '_>,
        source: SuggestionSource,
        confidence: f64,
        reason: String,
    ) -> Suggestion {
        let mut warnings = e.warnings.clone();
        let w = self.w;
        let a = e.a;
        let batch_sentence = match w.global_batch {
            Some(g) => format!(
                "Gradient accumulation {a} keeps the global batch at {g} ({} × {a} × {} GPU{}).",
                e.m,
                w.gpus,
                plural(w.gpus as usize)
            ),
            None => format!(
                "No global batch was given, so the effective batch changed to {} samples per step ({} × {a} × {} GPU{}); pass --global-batch to keep it fixed.",
                e.m.saturating_mul(a).saturating_mul(w.gpus),
                e.m,
                w.gpus,
                plural(w.gpus as usize)
            ),
        };
        if e.cand.dtype.needs_bf16() && !self.req.gpu.bf16 {
            warnings.push(format!(
                "{} does not support bf16 (compute capability {}): use fp16-mixed or fp32",
                self.gpu_name(),
                self.req.gpu.compute_capability
            ));
        }
        let (dataloader, host_memory) = self.dataloader(&mut warnings);
        let settings = EngineeringSettings {
            micro_batch_size: e.m,
            gradient_accumulation_steps: a,
            dtype: e.cand.dtype,
            activation_checkpointing: e.cand.ckpt,
            activation_offloading: e.cand.offload,
            compile: e.cand.compile,
            dataloader,
        };
        if let Some(advice) = self.eager_attention_advice(&settings) {
            warnings.push(advice);
        }
        let predicted = e.predicted.max(0.0).round() as u64;
        Suggestion {
            settings,
            predicted_peak_bytes: predicted,
            memory_fraction: predicted as f64 / self.capacity,
            confidence,
            source,
            strategy: s,
            gpu: self.gpu_name().to_string(),
            reasoning: format!("{reason}. {batch_sentence}{host_memory}"),
            warnings,
            predicted_tokens_per_sec: e.speed.predicted,
            measured_tokens_per_sec: e.speed.measured,
        }
    }

    /// Data-loader advice: one core per GPU stays with the training process;
    /// the rest (up to 8, beyond which tokenised text loading gains nothing)
    /// become workers. Pinned host memory speeds host→device copies; workers
    /// persist across epochs to avoid re-forking. A similar run killed for
    /// host memory ([`learner::host_memory_lesson`]) lowers the workers and
    /// turns pinned memory off — never the micro batch; the sentence for
    /// the reasoning says so (empty otherwise).
    fn dataloader(&self, warnings: &mut Vec<String>) -> (DataLoaderSettings, String) {
        let d = DataLoaderSettings::default();
        let lesson = learner::host_memory_lesson(&self.key_runs);
        let pinned = self.req.pins.num_workers;
        let mut workers = pinned.unwrap_or_else(|| match self.opts.cpus_per_gpu {
            Some(c) => c.saturating_sub(1).min(8),
            None => d.num_workers,
        });
        let mut sentence = String::new();
        if let Some(l) = lesson {
            match pinned {
                Some(p) if p > l.max_workers => warnings.push(format!(
                    "num_workers is pinned at {p}, but a similar run with {} workers was killed for host memory: {} or fewer would be safer, or raise the job's memory limit",
                    l.killed_with, l.max_workers
                )),
                Some(_) => {}
                None => workers = workers.min(l.max_workers),
            }
            sentence = format!(
                " {} similar run{} {} killed for host memory (OOMKilled / OUT_OF_MEMORY, not GPU memory; the smallest had {} data-loader worker{}), so the data loader gets {workers} worker{} and no pinned memory; the micro batch is not lowered for it.",
                l.killed,
                plural(l.killed),
                if l.killed == 1 { "was" } else { "were" },
                l.killed_with,
                plural(l.killed_with as usize),
                plural(workers as usize),
            );
        }
        (
            DataLoaderSettings {
                num_workers: workers,
                pin_memory: lesson.is_none(),
                persistent_workers: workers > 0,
                prefetch_factor: if workers > 0 { d.prefetch_factor } else { 0 },
            },
            sentence,
        )
    }

    /// `learned_from_failures`: every similar run failed, so micro batch 1
    /// (or the pinned one) with checkpointing on, in the policy's dtype.
    pub(super) fn learned_from_failures(
        &self,
        s: Strategy,
    ) -> Result<Option<Suggestion>, AdvisorError> {
        let pins = self.req.pins;
        let runs: Vec<&RunRecord> = self
            .key_runs
            .iter()
            .copied()
            .filter(|r| pins.dtype.is_none_or(|d| r.settings.dtype == d))
            .collect();
        // A run killed for host memory says nothing about the GPU's.
        let runs: Vec<&RunRecord> = runs.into_iter().filter(|r| !r.result.host_oom()).collect();
        if runs.is_empty() || runs.iter().any(|r| r.result.success()) {
            return Ok(None);
        }
        let c = Cand {
            dtype: self.first_dtype(),
            ckpt: pins.activation_checkpointing.unwrap_or(true),
            compile: pins.compile.unwrap_or(s == Strategy::Aggressive),
            offload: pins.activation_offloading.unwrap_or(false),
        };
        let m = pins.micro_batch_size.unwrap_or(1);
        let exact = self.exact_runs(c);
        let oom_min = learner::smallest_oom(&exact);
        let pred = self.predictor(self.w, c, &exact)?;
        let predicted = pred.best(m)?;
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
        let reason = format!(
            "All {} similar run{} of {} on {} failed ({} out of memory), so this falls back to micro batch {m} with activation checkpointing {} (predicted {:.1} GiB)",
            runs.len(),
            plural(runs.len()),
            self.w.model.name,
            self.gpu_name(),
            ooms,
            on_off(c.ckpt),
            to_gib(predicted as u64),
        );
        let e = Eval {
            cand: c,
            m,
            a: self.accumulation(m),
            meets_target: predicted <= self.target(s) * self.capacity,
            predicted,
            evidence: Evidence::None,
            correction: None,
            similar: runs.len(),
            successes: 0,
            largest_success: None,
            oom_min,
            measured: None,
            lower_bounds: 0,
            unconfirmed: 0,
            speed: self.speed(c, m),
            runner_up: None,
            warnings,
            pred,
        };
        let conf = (0.4 + 0.05 * runs.len().min(4) as f64).min(MAX_CONFIDENCE);
        Ok(Some(self.build(
            s,
            e,
            SuggestionSource::LearnedFromFailures,
            conf,
            reason,
        )))
    }
}

impl Ctx<'_> {
    /// Where transformers' SDPA call runs PyTorch's math composite (Falcon's
    /// one K/V head with an explicit mask; fp32 q, k and v with grouped K/V
    /// heads), the scores are materialised anyway and the eager code path
    /// may be both faster and smaller. The attention implementation is the
    /// job's code, not a setting gpufit injects, so this is advice: given
    /// when the models predict eager faster (beyond the speed noise) and no
    /// larger at the suggested settings. Measured on an H100 (bench/data/
    /// h100/families.csv #25, holdout.csv #16): Falcon-7B LoRA bf16
    /// 2 × 2,048 checkpointed ran 2,680 tokens/s in 23.30 GiB on SDPA and
    /// 5,017 in 18.81 GiB eager.
    fn eager_attention_advice(&self, s: &EngineeringSettings) -> Option<String> {
        let w = self.w;
        if w.attention != Attention::Sdpa || !memory::step_kernels(w, s).math_sdpa {
            return None;
        }
        let eager = Workload {
            attention: Attention::Eager,
            ..w.clone()
        };
        let sdpa_peak = self.opts.model.estimate(w, s).ok()?.peak_bytes;
        let eager_peak = self.opts.model.estimate(&eager, s).ok()?.peak_bytes;
        let sdpa_tps = throughput::tokens_per_sec(w, self.req.gpu, s);
        let eager_tps = throughput::tokens_per_sec(&eager, self.req.gpu, s);
        if eager_tps <= sdpa_tps * (1.0 + SPEED_NOISE) || eager_peak > sdpa_peak {
            return None;
        }
        let why = if w.model.quirks.sdpa_math_fallback {
            "its one shared K/V head with an explicit mask"
        } else {
            "fp32 q, k and v with grouped K/V heads"
        };
        Some(format!(
            "transformers' SDPA runs PyTorch's math kernel for {} ({why}): with attn_implementation=\"eager\" these settings are predicted at {} tokens/s instead of {} and {:.1} GiB instead of {:.1} (gpufit does not change the attention implementation)",
            w.model.name,
            thousands(eager_tps),
            thousands(sdpa_tps),
            to_gib(eager_peak),
            to_gib(sdpa_peak),
        ))
    }
}

/// "; 12,300 tokens/s measured with …, vs 9,500 predicted with … at micro
/// batch 12": the trade-off that decided, in numbers. Both sides name their
/// settings, each with every switch either of them turns on, so two
/// candidates that differ only in compile (or offloading) never read alike.
fn speed_clause(e: &Eval<'_, '_>) -> String {
    match e.runner_up {
        Some((c, m, sp)) => format!(
            "; {} tokens/s {} with {} at micro batch {}, vs {} tokens/s {} with {} at micro batch {m}",
            thousands(e.speed.tokens_per_sec),
            e.speed.label(),
            describe_beside(e.cand, c),
            e.m,
            thousands(sp.tokens_per_sec),
            sp.label(),
            describe_beside(c, e.cand)
        ),
        None => format!(
            "; {} tokens/s {} at micro batch {}",
            thousands(e.speed.tokens_per_sec),
            e.speed.label(),
            e.m
        ),
    }
}

fn thousands(x: f64) -> String {
    let n = x.max(0.0).round() as u64;
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// A candidate's settings: dtype and checkpointing, and offloading and
/// compile where they are on.
pub(super) fn describe(c: Cand) -> String {
    describe_beside(c, c)
}

/// [`describe`] for `c` set against `other`: offloading and compile are
/// named, "off" included, whenever either candidate turns them on.
fn describe_beside(c: Cand, other: Cand) -> String {
    let mut d = format!("{}, checkpointing {}", c.dtype, on_off(c.ckpt));
    if c.offload || other.offload {
        d.push_str(&format!(", offloading {}", on_off(c.offload)));
    }
    if c.compile || other.compile {
        d.push_str(&format!(", compile {}", on_off(c.compile)));
    }
    d
}

pub(super) fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

pub(super) fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}
