//! Throughput of a candidate at a micro batch: measured where exactly that
//! setting ran, else the throughput model ([`crate::throughput`])
//! calibrated by what was measured — by the candidate's own runs at other
//! micro batches, else by any run of the same workload on this GPU model.

use super::{Cand, Ctx};
use crate::run::RunRecord;
use crate::throughput;

/// Two settings whose throughputs are within this fraction are a tie: run
/// to run, tokens/s vary by a few percent (data, clocks, neighbours), so the
/// advisor does not leave a measured setting for one predicted less than
/// this much faster (no flip-flopping between equals).
pub const SPEED_NOISE: f64 = 0.03;

/// Where a throughput figure comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpeedSource {
    /// Runs with exactly these settings reported it.
    Measured,
    /// The throughput model, scaled by measurements of this workload.
    Calibrated,
    /// The throughput model alone.
    Model,
}

/// Predicted (or measured) training tokens/s of one GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Speed {
    /// The figure candidates are ranked by: measured, else predicted.
    pub tokens_per_sec: f64,
    /// The (calibrated) prediction, measured or not.
    pub predicted: f64,
    pub measured: Option<f64>,
    pub source: SpeedSource,
}

impl Speed {
    pub fn label(&self) -> &'static str {
        match self.source {
            SpeedSource::Measured => "measured",
            SpeedSource::Calibrated => "predicted from measured runs",
            SpeedSource::Model => "predicted",
        }
    }
}

/// Tokens/s a run reported (tokens/s, or samples/s × sequence length).
pub fn run_tokens_per_sec(r: &RunRecord) -> Option<f64> {
    let t = r
        .result
        .tokens_per_sec
        .or_else(|| r.result.samples_per_sec.map(|s| s * r.seq_len as f64))?;
    (t.is_finite() && t > 0.0).then_some(t)
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Some(v[v.len() / 2])
}

impl Ctx<'_> {
    /// The throughput model for the settings a run used, at its sequence length.
    fn model_tps_of_run(&self, r: &RunRecord) -> f64 {
        let mut w = self.w.clone();
        if r.seq_len > 0 {
            w.seq_len = r.seq_len;
        }
        throughput::tokens_per_sec(&w, self.req.gpu, &r.settings)
    }

    /// measured / model over successful runs that reported throughput.
    fn calibration<'r>(&self, runs: impl Iterator<Item = &'r RunRecord>) -> Option<f64> {
        median(
            runs.filter(|r| r.result.success())
                .filter_map(|r| {
                    let m = run_tokens_per_sec(r)?;
                    let p = self.model_tps_of_run(r);
                    (p > 0.0).then_some(m / p)
                })
                .collect(),
        )
    }

    /// Whether a run used the settings that decide a candidate's speed.
    pub(super) fn same_speed_settings(r: &RunRecord, c: Cand) -> bool {
        r.settings.dtype == c.dtype
            && r.settings.activation_checkpointing == c.ckpt
            && r.settings.activation_offloading == c.offload
            && r.settings.compile == c.compile
    }

    /// Throughput of candidate `c` at micro batch `m`.
    pub(super) fn speed(&self, c: Cand, m: u32) -> Speed {
        let own: Vec<&RunRecord> = self
            .key_runs
            .iter()
            .copied()
            .filter(|r| Self::same_speed_settings(r, c))
            .collect();
        let exact: Vec<f64> = own
            .iter()
            .filter(|r| r.result.success() && r.settings.micro_batch_size == m)
            .filter_map(|r| run_tokens_per_sec(r))
            .collect();
        let model =
            throughput::tokens_per_sec(self.w, self.req.gpu, &c.settings(m, self.accumulation(m)));
        let cached = self.calibrations.borrow().get(&c).copied();
        let factor = match cached {
            Some(f) => f,
            None => {
                let f = self
                    .calibration(own.iter().copied())
                    .or_else(|| self.calibration(self.key_runs.iter().copied()));
                self.calibrations.borrow_mut().insert(c, f);
                f
            }
        };
        let predicted = model * factor.unwrap_or(1.0);
        let (tokens_per_sec, measured, source) = match (median(exact), factor) {
            (Some(t), _) => (t, Some(t), SpeedSource::Measured),
            (None, Some(_)) => (predicted, None, SpeedSource::Calibrated),
            (None, None) => (predicted, None, SpeedSource::Model),
        };
        Speed {
            tokens_per_sec,
            predicted,
            measured,
            source,
        }
    }
}
