//! The fleet report (`gpufit report`): run rows → per-GPU and
//! per-(GPU, model, method) figures. Pure: no I/O; the history stores stream
//! [`ReportRow`]s into a [`ReportBuilder`], the CLI renders the
//! [`FleetReport`].
//!
//! Definitions (also in the README's "Seeing the fleet"):
//! - *GPU-hours lost to OOM*: Σ duration × GPUs of OOM runs (a run without a
//!   duration adds nothing and is counted in `oom_runs_without_duration`).
//! - *Prediction error*: (predicted − measured) / measured peak, for runs
//!   that have both; the median and p90 are of its absolute value
//!   (linear interpolation between closest ranks), `bias` is the signed
//!   median (> 0: gpufit over-predicts, i.e. leaves memory unused).
//! - *Unused GPU memory*: Σ (capacity − peak) × duration × GPUs of
//!   successful runs, in GiB-hours; capacity from the GPU catalog, peak per
//!   GPU. Runs on GPUs the catalog does not know, or without a peak or
//!   duration, are counted in `unused_runs_unmeasured` instead.
//! - A multi-node job's *partial* record (a node never reported) counts as
//!   a run without a peak: its peak is only a lower bound of the job's.
//! - *Throughput against the best known setting*: a successful run's
//!   tokens/s per GPU divided by the best tokens/s per GPU any successful
//!   run of the same key (GPU, model, method, sequence length) reached in
//!   the whole history, before the window included; the mean of that ratio.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use chrono::{DateTime, NaiveDate, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::units::GIB;
use crate::workload::Method;

/// The columns of one run the report needs, borrowed from the store's row
/// so that streaming a million runs allocates nothing per run.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportRow<'a> {
    /// Microseconds since the Unix epoch (UTC).
    pub timestamp_us: i64,
    pub gpu_model: &'a str,
    pub model: &'a str,
    pub method: Method,
    pub seq_len: u32,
    pub gpus: u32,
    pub success: bool,
    pub oom: bool,
    pub peak_memory_bytes: Option<u64>,
    pub predicted_peak_bytes: Option<u64>,
    pub tokens_per_sec: Option<f64>,
    pub duration_sec: Option<f64>,
    /// How the run reached the history ([`crate::run::run_path`]).
    pub path: &'static str,
    /// Whether the run's settings are the ones it ran
    /// ([`crate::confirm::Confirmation::is_confirmed`]); an unconfirmed
    /// run's peak may be another batch's, so it has no prediction error.
    pub confirmed: bool,
}

impl<'a> ReportRow<'a> {
    /// The report's view of a full run record.
    pub fn of(r: &'a crate::run::RunRecord) -> Self {
        ReportRow {
            timestamp_us: r.timestamp.timestamp_micros(),
            gpu_model: &r.gpu_model,
            model: &r.model,
            method: r.method,
            seq_len: r.seq_len,
            gpus: r.gpus,
            success: r.result.success(),
            oom: r.is_oom(),
            // A partial multi-node record's peak (a node missing, or
            // reported without a peak) is only a lower bound (as the
            // stores' narrow query reads it).
            peak_memory_bytes: r.full_peak(),
            predicted_peak_bytes: r.predicted_peak_bytes,
            tokens_per_sec: r.result.tokens_per_sec,
            duration_sec: r.result.duration_sec,
            path: r.path(),
            confirmed: r.confirmation.is_confirmed(),
        }
    }
}

/// Error-percentile summary of prediction errors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ErrorStats {
    /// Runs with both a predicted and a measured peak.
    pub runs: u64,
    /// Median of |predicted − measured| / measured (0.05 = 5 %).
    pub median_abs: Option<f64>,
    /// 90th percentile of the same.
    pub p90_abs: Option<f64>,
    /// Median signed error: > 0 over-predicts, < 0 under-predicts.
    pub bias: Option<f64>,
}

/// Throughput against the best known setting of the same key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ThroughputStats {
    /// Successful runs in the window that reported tokens/s.
    pub runs: u64,
    /// Mean of (run's tokens/s per GPU) / (best known tokens/s per GPU).
    pub mean_vs_best: Option<f64>,
    /// Runs below 90 % of the best known.
    pub runs_below_90pct: u64,
}

/// Figures for one group of runs: the whole fleet, one GPU model, or one
/// GPU model × model × method.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GroupStats {
    /// None for the fleet total.
    pub gpu_model: Option<String>,
    /// Set for per-model groups.
    pub model: Option<String>,
    pub method: Option<Method>,
    /// GPU memory from the catalog (GiB); None when the catalog does not
    /// know the GPU (or for the fleet total).
    pub gpu_memory_gib: Option<f64>,
    pub runs: u64,
    pub succeeded: u64,
    pub oom_runs: u64,
    pub other_failures: u64,
    /// oom_runs / runs.
    pub oom_share: f64,
    /// Σ duration × GPUs of every run with a duration, hours.
    pub gpu_hours: f64,
    /// Σ duration × GPUs of OOM runs, hours.
    pub oom_gpu_hours: f64,
    pub oom_runs_without_duration: u64,
    pub prediction_error: ErrorStats,
    /// Σ (capacity − peak) × duration × GPUs of successful runs, GiB-hours.
    pub unused_gib_hours: f64,
    /// unused / (capacity × duration × GPUs) over the same runs.
    pub unused_share: Option<f64>,
    /// Successful runs whose unused memory could be measured.
    pub unused_runs_measured: u64,
    /// Successful runs without a peak, a duration or a catalog capacity.
    pub unused_runs_unmeasured: u64,
    pub throughput: ThroughputStats,
    /// Runs whose settings the job confirmed (its result record, its log,
    /// or gpufit's filled placeholders), and their share of `runs`.
    #[serde(default)]
    pub confirmed_runs: u64,
    #[serde(default)]
    pub confirmed_share: f64,
}

/// Runs by how they reached the history: `trainingjob`, `webhook`,
/// `slurm`, `cli`, `import` (the fleet view's `path` dimension).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PathStats {
    pub path: String,
    pub runs: u64,
    pub succeeded: u64,
    pub oom_runs: u64,
    pub other_failures: u64,
    /// Σ duration × GPUs of its runs with a duration, hours.
    pub gpu_hours: f64,
}

/// One UTC day of the window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DayStats {
    pub day: NaiveDate,
    pub runs: u64,
    pub oom_runs: u64,
    pub oom_gpu_hours: f64,
    pub unused_gib_hours: f64,
}

/// The whole report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FleetReport {
    /// Start of the window (None: all history).
    pub since: Option<DateTime<Utc>>,
    /// When the report was made (end of the window).
    pub until: DateTime<Utc>,
    /// Rows the store streamed (in the window, plus older successful runs
    /// with a throughput, which only set the best known throughput).
    pub rows_scanned: u64,
    pub total: GroupStats,
    /// Most GPU-hours first.
    pub by_gpu: Vec<GroupStats>,
    /// By GPU model, then most GPU-hours first.
    pub by_model: Vec<GroupStats>,
    /// Oldest first; days without runs are left out.
    pub daily: Vec<DayStats>,
    /// In [`crate::run::RUN_PATHS`] order; paths without runs left out.
    #[serde(default)]
    pub by_path: Vec<PathStats>,
}

/// Sums for one group while rows stream in.
#[derive(Debug, Default, Clone)]
struct Acc {
    runs: u64,
    succeeded: u64,
    oom_runs: u64,
    other_failures: u64,
    gpu_seconds: f64,
    oom_gpu_seconds: f64,
    oom_runs_without_duration: u64,
    errors: Vec<f64>,
    unused_gib_seconds: f64,
    capacity_gib_seconds: f64,
    unused_runs_measured: u64,
    unused_runs_unmeasured: u64,
    confirmed_runs: u64,
    /// (throughput key, tokens/s per GPU) of successful runs in the window.
    throughput: Vec<(u32, f64)>,
}

impl Acc {
    fn merge(&mut self, o: &Acc) {
        self.runs += o.runs;
        self.succeeded += o.succeeded;
        self.oom_runs += o.oom_runs;
        self.other_failures += o.other_failures;
        self.gpu_seconds += o.gpu_seconds;
        self.oom_gpu_seconds += o.oom_gpu_seconds;
        self.oom_runs_without_duration += o.oom_runs_without_duration;
        self.errors.extend_from_slice(&o.errors);
        self.unused_gib_seconds += o.unused_gib_seconds;
        self.capacity_gib_seconds += o.capacity_gib_seconds;
        self.unused_runs_measured += o.unused_runs_measured;
        self.unused_runs_unmeasured += o.unused_runs_unmeasured;
        self.confirmed_runs += o.confirmed_runs;
        self.throughput.extend_from_slice(&o.throughput);
    }
}

#[derive(Debug, Default)]
struct DayAcc {
    runs: u64,
    oom_runs: u64,
    oom_gpu_seconds: f64,
    unused_gib_seconds: f64,
}

/// FxHash (rustc's): the builder hashes four small keys per run, and
/// SipHash's DoS resistance buys nothing for names read from one's own
/// history.
#[derive(Default, Clone, Copy)]
struct Fx(u64);

impl Hasher for Fx {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        for b in chunks.remainder() {
            self.add(u64::from(*b));
        }
    }
    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }
    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

impl Fx {
    fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<Fx>>;

/// A GPU model seen in the rows, with its catalog capacity (looked up once).
#[derive(Debug)]
struct Gpu {
    name: String,
    capacity_bytes: Option<u64>,
}

/// Accumulates rows into a [`FleetReport`]. Memory grows with the number of
/// distinct keys plus one float per run with a prediction error or a
/// throughput (16 MB for a million runs), never with whole records.
#[derive(Debug)]
pub struct ReportBuilder {
    since_us: Option<i64>,
    until: DateTime<Utc>,
    /// GPU capacity by name; the default is the GPU catalog.
    capacity: fn(&str) -> Option<u64>,
    gpus: Vec<Gpu>,
    gpu_ids: FxMap<String, u32>,
    models: Vec<String>,
    model_ids: FxMap<String, u32>,
    groups: Vec<((u32, u32, Method), Acc)>,
    group_ids: FxMap<(u32, u32, Method), usize>,
    tput_keys: FxMap<(u32, u32, Method, u32), u32>,
    best: Vec<f64>,
    days: BTreeMap<i64, DayAcc>,
    rows: u64,
    /// Runs by path (in the window).
    paths: BTreeMap<&'static str, PathStats>,
}

fn catalog_capacity(name: &str) -> Option<u64> {
    crate::catalog::lookup_gpu(name)
        .ok()
        .map(|g| g.memory_bytes)
}

const US_PER_DAY: i64 = 86_400_000_000;

impl ReportBuilder {
    /// A report of the runs at or after `since` (None: all), made at `until`.
    pub fn new(since: Option<DateTime<Utc>>, until: DateTime<Utc>) -> Self {
        Self::with_capacity_fn(since, until, catalog_capacity)
    }

    /// As [`ReportBuilder::new`], with GPU capacities from `capacity`
    /// instead of the catalog (tests, fleets with custom cards).
    pub fn with_capacity_fn(
        since: Option<DateTime<Utc>>,
        until: DateTime<Utc>,
        capacity: fn(&str) -> Option<u64>,
    ) -> Self {
        ReportBuilder {
            since_us: since.map(|t| t.timestamp_micros()),
            until,
            capacity,
            gpus: Vec::new(),
            gpu_ids: FxMap::default(),
            models: Vec::new(),
            model_ids: FxMap::default(),
            groups: Vec::new(),
            group_ids: FxMap::default(),
            tput_keys: FxMap::default(),
            best: Vec::new(),
            days: BTreeMap::new(),
            rows: 0,
            paths: BTreeMap::new(),
        }
    }

    /// Start of the window in microseconds, for stores that can skip older
    /// rows without throughput (see [`FleetReport::rows_scanned`]).
    pub fn since_us(&self) -> Option<i64> {
        self.since_us
    }

    fn gpu_id(&mut self, name: &str) -> u32 {
        if let Some(&i) = self.gpu_ids.get(name) {
            return i;
        }
        let i = self.gpus.len() as u32;
        self.gpus.push(Gpu {
            name: name.to_string(),
            capacity_bytes: (self.capacity)(name),
        });
        self.gpu_ids.insert(name.to_string(), i);
        i
    }

    fn model_id(&mut self, name: &str) -> u32 {
        if let Some(&i) = self.model_ids.get(name) {
            return i;
        }
        let i = self.models.len() as u32;
        self.models.push(name.to_string());
        self.model_ids.insert(name.to_string(), i);
        i
    }

    /// Adds one row. Rows before the window only raise the best known
    /// throughput of their key.
    pub fn add(&mut self, r: &ReportRow<'_>) {
        self.rows += 1;
        let gpu = self.gpu_id(r.gpu_model);
        let model = self.model_id(r.model);
        let gpus = f64::from(r.gpus.max(1));
        // Throughput per GPU, so runs of one key on different GPU counts compare.
        let tput = r
            .tokens_per_sec
            .filter(|t| r.success && t.is_finite() && *t > 0.0)
            .map(|t| t / gpus);
        let tkey = tput.map(|t| {
            let next = self.tput_keys.len() as u32;
            let k = *self
                .tput_keys
                .entry((gpu, model, r.method, r.seq_len))
                .or_insert(next);
            if k == next {
                self.best.push(t);
            } else {
                let b = &mut self.best[k as usize];
                *b = b.max(t);
            }
            (k, t)
        });
        if self.since_us.is_some_and(|s| r.timestamp_us < s) {
            return;
        }

        let capacity = self.gpus[gpu as usize].capacity_bytes;
        let key = (gpu, model, r.method);
        let gi = match self.group_ids.get(&key) {
            Some(&i) => i,
            None => {
                self.groups.push((key, Acc::default()));
                self.group_ids.insert(key, self.groups.len() - 1);
                self.groups.len() - 1
            }
        };
        let p = self.paths.entry(r.path).or_default();
        p.runs += 1;
        if r.success {
            p.succeeded += 1;
        } else if r.oom {
            p.oom_runs += 1;
        } else {
            p.other_failures += 1;
        }
        if let Some(d) = r.duration_sec.filter(|d| d.is_finite() && *d >= 0.0) {
            p.gpu_hours += d * gpus / 3600.0;
        }
        let a = &mut self.groups[gi].1;
        let day = self
            .days
            .entry(r.timestamp_us.div_euclid(US_PER_DAY))
            .or_default();
        a.runs += 1;
        a.confirmed_runs += u64::from(r.confirmed);
        day.runs += 1;
        let dur = r.duration_sec.filter(|d| d.is_finite() && *d >= 0.0);
        if let Some(d) = dur {
            a.gpu_seconds += d * gpus;
        }
        if r.success {
            a.succeeded += 1;
        } else if r.oom {
            a.oom_runs += 1;
            day.oom_runs += 1;
            match dur {
                Some(d) => {
                    a.oom_gpu_seconds += d * gpus;
                    day.oom_gpu_seconds += d * gpus;
                }
                None => a.oom_runs_without_duration += 1,
            }
        } else {
            a.other_failures += 1;
        }
        if let (Some(p), Some(m)) = (r.predicted_peak_bytes, r.peak_memory_bytes) {
            // An unconfirmed run's peak may be another batch's.
            if m > 0 && r.confirmed {
                a.errors.push((p as f64 - m as f64) / m as f64);
            }
        }
        if r.success {
            match (capacity, r.peak_memory_bytes, dur) {
                (Some(c), Some(p), Some(d)) => {
                    let unused = c.saturating_sub(p) as f64 / GIB as f64 * d * gpus;
                    a.unused_gib_seconds += unused;
                    a.capacity_gib_seconds += c as f64 / GIB as f64 * d * gpus;
                    a.unused_runs_measured += 1;
                    day.unused_gib_seconds += unused;
                }
                _ => a.unused_runs_unmeasured += 1,
            }
        }
        if let Some(kt) = tkey {
            a.throughput.push(kt);
        }
    }

    /// The report.
    pub fn finish(self) -> FleetReport {
        let mut by_gpu_acc: BTreeMap<u32, Acc> = BTreeMap::new();
        let mut total = Acc::default();
        let mut by_model = Vec::with_capacity(self.groups.len());
        for ((gpu, model, method), acc) in &self.groups {
            by_gpu_acc.entry(*gpu).or_default().merge(acc);
            total.merge(acc);
            let g = &self.gpus[*gpu as usize];
            by_model.push(self.stats(
                acc,
                Some(g),
                Some(self.models[*model as usize].clone()),
                Some(*method),
            ));
        }
        let mut by_gpu: Vec<GroupStats> = by_gpu_acc
            .iter()
            .map(|(gpu, acc)| self.stats(acc, Some(&self.gpus[*gpu as usize]), None, None))
            .collect();
        let total = self.stats(&total, None, None, None);
        let most_hours = |a: &GroupStats, b: &GroupStats| {
            b.gpu_hours
                .total_cmp(&a.gpu_hours)
                .then(b.runs.cmp(&a.runs))
        };
        by_gpu.sort_by(|a, b| most_hours(a, b).then(a.gpu_model.cmp(&b.gpu_model)));
        by_model.sort_by(|a, b| {
            a.gpu_model
                .cmp(&b.gpu_model)
                .then(most_hours(a, b))
                .then(a.model.cmp(&b.model))
                .then(
                    a.method
                        .map(Method::as_str)
                        .cmp(&b.method.map(Method::as_str)),
                )
        });
        let daily = self
            .days
            .iter()
            .filter_map(|(d, acc)| {
                let day = DateTime::<Utc>::from_timestamp(d * 86_400, 0)?.date_naive();
                Some(DayStats {
                    day,
                    runs: acc.runs,
                    oom_runs: acc.oom_runs,
                    oom_gpu_hours: acc.oom_gpu_seconds / 3600.0,
                    unused_gib_hours: acc.unused_gib_seconds / 3600.0,
                })
            })
            .collect();
        FleetReport {
            since: self
                .since_us
                .and_then(DateTime::<Utc>::from_timestamp_micros),
            until: self.until,
            rows_scanned: self.rows,
            total,
            by_gpu,
            by_model,
            daily,
            by_path: crate::run::RUN_PATHS
                .iter()
                .filter_map(|p| {
                    let mut s = self.paths.get(p)?.clone();
                    s.path = p.to_string();
                    Some(s)
                })
                .collect(),
        }
    }

    fn stats(
        &self,
        a: &Acc,
        gpu: Option<&Gpu>,
        model: Option<String>,
        method: Option<Method>,
    ) -> GroupStats {
        let mut abs: Vec<f64> = a.errors.iter().map(|e| e.abs()).collect();
        let mut signed = a.errors.clone();
        let ratios: Vec<f64> = a
            .throughput
            .iter()
            .map(|&(k, t)| t / self.best[k as usize])
            .collect();
        GroupStats {
            gpu_model: gpu.map(|g| g.name.clone()),
            model,
            method,
            gpu_memory_gib: gpu
                .and_then(|g| g.capacity_bytes)
                .map(|c| c as f64 / GIB as f64),
            runs: a.runs,
            succeeded: a.succeeded,
            oom_runs: a.oom_runs,
            other_failures: a.other_failures,
            oom_share: if a.runs == 0 {
                0.0
            } else {
                a.oom_runs as f64 / a.runs as f64
            },
            gpu_hours: a.gpu_seconds / 3600.0,
            oom_gpu_hours: a.oom_gpu_seconds / 3600.0,
            oom_runs_without_duration: a.oom_runs_without_duration,
            prediction_error: ErrorStats {
                runs: a.errors.len() as u64,
                median_abs: quantile(&mut abs, 0.5),
                p90_abs: quantile(&mut abs, 0.9),
                bias: quantile(&mut signed, 0.5),
            },
            unused_gib_hours: a.unused_gib_seconds / 3600.0,
            unused_share: (a.capacity_gib_seconds > 0.0)
                .then(|| a.unused_gib_seconds / a.capacity_gib_seconds),
            unused_runs_measured: a.unused_runs_measured,
            unused_runs_unmeasured: a.unused_runs_unmeasured,
            confirmed_runs: a.confirmed_runs,
            confirmed_share: if a.runs == 0 {
                0.0
            } else {
                a.confirmed_runs as f64 / a.runs as f64
            },
            throughput: ThroughputStats {
                runs: ratios.len() as u64,
                mean_vs_best: (!ratios.is_empty())
                    .then(|| ratios.iter().sum::<f64>() / ratios.len() as f64),
                runs_below_90pct: ratios.iter().filter(|r| **r < 0.9).count() as u64,
            },
        }
    }
}

/// The `p` quantile of sorted values, interpolating linearly between the
/// closest ranks (NumPy's default): p = 0.5 of [1, 2, 3, 4] is 2.5.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    let n = sorted.len();
    if n == 0 {
        return None;
    }
    let pos = p.clamp(0.0, 1.0) * (n - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = (lo + 1).min(n - 1);
    let frac = pos - lo as f64;
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * frac)
}

/// [`percentile`] of unsorted values, in linear time: selects the two
/// closest ranks instead of sorting (a million runs' errors per report).
/// Reorders `v`.
pub fn quantile(v: &mut [f64], p: f64) -> Option<f64> {
    let n = v.len();
    if n == 0 {
        return None;
    }
    let pos = p.clamp(0.0, 1.0) * (n - 1) as f64;
    let lo = pos.floor() as usize;
    let (_, x, above) = v.select_nth_unstable_by(lo, f64::total_cmp);
    let x = *x;
    let y = above.iter().copied().min_by(f64::total_cmp).unwrap_or(x);
    Some(x + (y - x) * (pos - lo as f64))
}

/// Aggregates full records (tests, stores without a narrow query).
pub fn report_of(
    records: &[crate::run::RunRecord],
    since: Option<DateTime<Utc>>,
    until: DateTime<Utc>,
) -> FleetReport {
    let mut b = ReportBuilder::new(since, until);
    for r in records {
        b.add(&ReportRow::of(r));
    }
    b.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn cap(name: &str) -> Option<u64> {
        match name {
            "G80" => Some(80 * GIB),
            "G40" => Some(40 * GIB),
            _ => None,
        }
    }

    /// Midnight UTC of 2026-03-01 + `h` hours, in microseconds.
    fn at(h: i64) -> i64 {
        Utc.with_ymd_and_hms(2026, 3, 1, 0, 0, 0)
            .single()
            .expect("valid")
            .timestamp_micros()
            + h * 3_600_000_000
    }

    #[allow(clippy::too_many_arguments)]
    fn row(
        h: i64,
        gpu: &'static str,
        model: &'static str,
        method: Method,
        gpus: u32,
        outcome: &str,
        peak_gib: Option<u64>,
        predicted_gib: Option<u64>,
        tps: Option<f64>,
        dur: Option<f64>,
    ) -> ReportRow<'static> {
        ReportRow {
            confirmed: true,
            timestamp_us: at(h),
            gpu_model: gpu,
            model,
            method,
            seq_len: 1024,
            gpus,
            success: outcome == "ok",
            oom: outcome == "oom",
            peak_memory_bytes: peak_gib.map(|g| g * GIB),
            predicted_peak_bytes: predicted_gib.map(|g| g * GIB),
            tokens_per_sec: tps,
            duration_sec: dur,
            path: "cli",
        }
    }

    /// Eight runs whose figures are worked out by hand in the comments.
    fn fixture() -> Vec<ReportRow<'static>> {
        use Method::{Full, Lora};
        vec![
            // 2 GPUs × 1 h, 20 GiB unused each → 40 GiB-h; error +0.1;
            // 1000 tokens/s per GPU.
            row(
                1,
                "G80",
                "m1",
                Lora,
                2,
                "ok",
                Some(60),
                Some(66),
                Some(2000.0),
                Some(3600.0),
            ),
            // 1 GPU × 0.5 h, 40 GiB unused → 20 GiB-h; error −0.25; 1500/GPU.
            row(
                2,
                "G80",
                "m1",
                Lora,
                1,
                "ok",
                Some(40),
                Some(30),
                Some(1500.0),
                Some(1800.0),
            ),
            // OOM, 4 GPUs × 0.25 h → 1 GPU-hour lost.
            row(
                3,
                "G80",
                "m1",
                Lora,
                4,
                "oom",
                None,
                Some(70),
                None,
                Some(900.0),
            ),
            // OOM without a duration.
            row(25, "G80", "m2", Full, 1, "oom", None, None, None, None),
            // Other failure, 1 GPU × 60 s.
            row(
                26,
                "G80",
                "m2",
                Full,
                1,
                "error",
                None,
                None,
                None,
                Some(60.0),
            ),
            // 1 GPU × 2 h, 10 GiB unused → 20 GiB-h; error +0.1; the only
            // run of its throughput key → ratio 1.
            row(
                27,
                "G40",
                "m1",
                Lora,
                1,
                "ok",
                Some(30),
                Some(33),
                Some(500.0),
                Some(7200.0),
            ),
            // Before the window: only sets the best known of (G80, m1,
            // lora, 1024) to 3000/GPU.
            row(
                -5,
                "G80",
                "m1",
                Lora,
                1,
                "ok",
                Some(70),
                Some(70),
                Some(3000.0),
                Some(60.0),
            ),
            // A GPU the catalog does not know: unused memory not measurable.
            row(
                28,
                "Mystery",
                "m3",
                Lora,
                1,
                "ok",
                Some(10),
                None,
                None,
                Some(100.0),
            ),
        ]
    }

    fn build(since_h: Option<i64>) -> FleetReport {
        let since = since_h.map(|h| Utc.timestamp_micros(at(h)).single().expect("valid"));
        let mut b = ReportBuilder::with_capacity_fn(since, Utc::now(), cap);
        for r in fixture() {
            b.add(&r);
        }
        b.finish()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    fn gpu<'a>(r: &'a FleetReport, name: &str) -> &'a GroupStats {
        r.by_gpu
            .iter()
            .find(|g| g.gpu_model.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no group {name}"))
    }

    #[test]
    fn confirmed_runs_are_counted_and_an_unconfirmed_peak_has_no_prediction_error() {
        let mut b = ReportBuilder::with_capacity_fn(None, Utc::now(), cap);
        let confirmed = row(
            1,
            "G80",
            "m",
            Method::Lora,
            1,
            "ok",
            Some(40),
            Some(44),
            None,
            Some(3600.0),
        );
        // Predicted 44 against a peak of 20 that may be another batch's.
        let unconfirmed = ReportRow {
            confirmed: false,
            ..row(
                2,
                "G80",
                "m",
                Method::Lora,
                1,
                "ok",
                Some(20),
                Some(44),
                None,
                Some(3600.0),
            )
        };
        b.add(&confirmed);
        b.add(&unconfirmed);
        let r = b.finish();
        let g = gpu(&r, "G80");
        assert_eq!((g.runs, g.confirmed_runs), (2, 1));
        assert!(close(g.confirmed_share, 0.5), "{}", g.confirmed_share);
        assert_eq!(g.prediction_error.runs, 1, "only the confirmed run's error");
        assert!(close(g.prediction_error.median_abs.unwrap(), 0.1));
        // Its memory was still used: both count in the unused memory.
        assert_eq!(g.unused_runs_measured, 2);
        assert!(close(r.total.confirmed_share, 0.5));
    }

    #[test]
    fn per_gpu_figures_match_the_hand_computed_ones() {
        let r = build(Some(0));
        let g = gpu(&r, "G80");
        assert_eq!(
            (g.runs, g.succeeded, g.oom_runs, g.other_failures),
            (5, 2, 2, 1)
        );
        assert!(close(g.oom_share, 0.4), "{}", g.oom_share);
        assert!(
            close(g.gpu_hours, 2.0 + 0.5 + 1.0 + 60.0 / 3600.0),
            "{}",
            g.gpu_hours
        );
        assert!(close(g.oom_gpu_hours, 1.0), "{}", g.oom_gpu_hours);
        assert_eq!(g.oom_runs_without_duration, 1);
        // |errors| [0.1, 0.25]: median 0.175, p90 0.1 + 0.9 × 0.15 = 0.235;
        // signed [−0.25, 0.1]: median −0.075.
        let e = &g.prediction_error;
        assert_eq!(e.runs, 2);
        assert!(close(e.median_abs.unwrap(), 0.175), "{e:?}");
        assert!(close(e.p90_abs.unwrap(), 0.235), "{e:?}");
        assert!(close(e.bias.unwrap(), -0.075), "{e:?}");
        // 40 + 20 GiB-h unused of 160 + 40 GiB-h.
        assert!(close(g.unused_gib_hours, 60.0), "{}", g.unused_gib_hours);
        assert!(close(g.unused_share.unwrap(), 0.3));
        assert_eq!((g.unused_runs_measured, g.unused_runs_unmeasured), (2, 0));
        // 1000/3000 and 1500/3000: the best is the run before the window.
        assert_eq!(g.throughput.runs, 2);
        assert!(close(g.throughput.mean_vs_best.unwrap(), 5.0 / 12.0));
        assert_eq!(g.throughput.runs_below_90pct, 2);
        assert_eq!(g.gpu_memory_gib, Some(80.0));

        let m = gpu(&r, "Mystery");
        assert_eq!((m.unused_runs_measured, m.unused_runs_unmeasured), (0, 1));
        assert_eq!(m.unused_share, None);
        assert_eq!(m.gpu_memory_gib, None);
        assert_eq!(m.prediction_error.median_abs, None);
        assert_eq!(m.throughput.mean_vs_best, None);
    }

    #[test]
    fn fleet_totals_pool_the_runs_not_the_group_figures() {
        let r = build(Some(0));
        let t = &r.total;
        assert_eq!(t.gpu_model, None);
        assert_eq!(t.runs, 7);
        assert!(close(t.oom_share, 2.0 / 7.0));
        // |errors| [0.1, 0.1, 0.25]: median 0.1, p90 at rank 1.8 → 0.22;
        // signed [−0.25, 0.1, 0.1]: median 0.1.
        let e = &t.prediction_error;
        assert!(close(e.median_abs.unwrap(), 0.1), "{e:?}");
        assert!(close(e.p90_abs.unwrap(), 0.22), "{e:?}");
        assert!(close(e.bias.unwrap(), 0.1), "{e:?}");
        // 40 + 20 + 20 GiB-h unused of 160 + 40 + 80 GiB-h held.
        assert!(close(t.unused_gib_hours, 80.0));
        assert!(close(t.unused_share.unwrap(), 80.0 / 280.0));
        // Ratios 1/3, 1/2, 1 (G40's only run is its own best).
        assert!(close(t.throughput.mean_vs_best.unwrap(), 11.0 / 18.0));
        assert_eq!(t.throughput.runs_below_90pct, 2);
        assert_eq!(r.rows_scanned, 8);
    }

    #[test]
    fn groups_split_by_model_and_method_and_sort_by_gpu_hours() {
        let r = build(Some(0));
        let names: Vec<_> = r
            .by_gpu
            .iter()
            .map(|g| g.gpu_model.clone().unwrap())
            .collect();
        assert_eq!(names, ["G80", "G40", "Mystery"]);
        let keys: Vec<_> = r
            .by_model
            .iter()
            .map(|g| {
                format!(
                    "{}/{}/{}",
                    g.gpu_model.as_deref().unwrap(),
                    g.model.as_deref().unwrap(),
                    g.method.unwrap()
                )
            })
            .collect();
        assert_eq!(
            keys,
            [
                "G40/m1/lora",
                "G80/m1/lora",
                "G80/m2/full",
                "Mystery/m3/lora"
            ]
        );
        let m2 = &r.by_model[2];
        assert_eq!((m2.runs, m2.oom_runs, m2.other_failures), (2, 1, 1));
        assert!(close(m2.oom_gpu_hours, 0.0));
        let m1 = &r.by_model[1];
        assert!(close(m1.oom_gpu_hours, 1.0));
        assert!(close(m1.oom_share, 1.0 / 3.0));
    }

    #[test]
    fn daily_series_has_one_point_per_utc_day_with_runs() {
        let r = build(Some(0));
        assert_eq!(r.daily.len(), 2);
        assert_eq!(r.daily[0].day.to_string(), "2026-03-01");
        assert_eq!((r.daily[0].runs, r.daily[0].oom_runs), (3, 1));
        assert!(close(r.daily[0].oom_gpu_hours, 1.0));
        assert!(close(r.daily[0].unused_gib_hours, 60.0));
        assert_eq!(r.daily[1].day.to_string(), "2026-03-02");
        assert_eq!((r.daily[1].runs, r.daily[1].oom_runs), (4, 1));
        assert!(close(r.daily[1].unused_gib_hours, 20.0));
    }

    #[test]
    fn without_a_window_older_runs_count_too() {
        let r = build(None);
        assert_eq!(r.total.runs, 8);
        assert_eq!(r.since, None);
        let g = gpu(&r, "G80");
        assert_eq!(g.runs, 6);
        // The old run is its key's best: ratios 1/3, 1/2, 1.
        assert!(close(g.throughput.mean_vs_best.unwrap(), 11.0 / 18.0));
        // Its error is 0: |errors| [0, 0.1, 0.25].
        assert!(close(g.prediction_error.median_abs.unwrap(), 0.1));
    }

    #[test]
    fn an_empty_window_gives_zeros_not_nan() {
        let r = build(Some(1000));
        assert_eq!(r.total.runs, 0);
        assert_eq!(r.total.oom_share, 0.0);
        assert!(r.by_gpu.is_empty() && r.by_model.is_empty() && r.daily.is_empty());
        assert_eq!(r.total.prediction_error.median_abs, None);
        assert!(serde_json::to_string(&r).is_ok());
    }

    #[test]
    fn throughput_is_compared_per_gpu_and_only_within_the_same_key() {
        let mut b = ReportBuilder::with_capacity_fn(None, Utc::now(), cap);
        let mut a = row(
            1,
            "G80",
            "m1",
            Method::Lora,
            4,
            "ok",
            None,
            None,
            Some(4000.0),
            None,
        );
        b.add(&a);
        // 1 GPU at 1000 tokens/s = the same per-GPU speed as 4 at 4000.
        a.gpus = 1;
        a.tokens_per_sec = Some(1000.0);
        b.add(&a);
        // Another sequence length is another key: not compared.
        a.seq_len = 4096;
        a.tokens_per_sec = Some(10.0);
        b.add(&a);
        // Non-finite or negative throughput is ignored, not a new best.
        a.seq_len = 1024;
        a.tokens_per_sec = Some(f64::INFINITY);
        b.add(&a);
        a.tokens_per_sec = Some(-5.0);
        b.add(&a);
        let r = b.finish();
        assert_eq!(r.total.throughput.runs, 3);
        assert!(close(r.total.throughput.mean_vs_best.unwrap(), 1.0));
    }

    #[test]
    fn a_peak_above_capacity_counts_zero_unused_not_negative() {
        let mut b = ReportBuilder::with_capacity_fn(None, Utc::now(), cap);
        b.add(&row(
            1,
            "G40",
            "m",
            Method::Full,
            1,
            "ok",
            Some(50),
            None,
            None,
            Some(3600.0),
        ));
        let r = b.finish();
        assert_eq!(r.total.unused_gib_hours, 0.0);
        assert!(close(r.total.unused_share.unwrap(), 0.0));
    }

    #[test]
    fn percentiles_interpolate_between_closest_ranks() {
        assert_eq!(percentile(&[], 0.5), None);
        assert_eq!(percentile(&[7.0], 0.9), Some(7.0));
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 0.5), Some(2.5));
        let v: Vec<f64> = (1..=11).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.9), Some(10.0));
        assert_eq!(percentile(&v, 1.0), Some(11.0));
    }

    #[test]
    fn quantile_without_sorting_matches_the_sorted_percentile() {
        let mut x: u64 = 12345;
        for n in [1usize, 2, 3, 10, 101, 1000] {
            let v: Vec<f64> = (0..n)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (x >> 11) as f64 / (1u64 << 53) as f64 - 0.5
                })
                .collect();
            let mut sorted = v.clone();
            sorted.sort_by(f64::total_cmp);
            for p in [0.0, 0.1, 0.5, 0.9, 0.99, 1.0] {
                let mut w = v.clone();
                assert_eq!(quantile(&mut w, p), percentile(&sorted, p), "n {n} p {p}");
            }
        }
        assert_eq!(quantile(&mut [], 0.5), None);
    }

    #[test]
    fn capacities_come_from_the_gpu_catalog_by_default() {
        let mut b = ReportBuilder::new(None, Utc::now());
        let name = "NVIDIA A100-SXM4-80GB";
        b.add(&ReportRow {
            gpu_model: name,
            ..row(
                1,
                "x",
                "m",
                Method::Lora,
                1,
                "ok",
                Some(60),
                None,
                None,
                Some(3600.0),
            )
        });
        let r = b.finish();
        let cap = crate::catalog::lookup_gpu(name).unwrap().memory_bytes as f64 / GIB as f64;
        assert_eq!(r.by_gpu[0].gpu_memory_gib, Some(cap));
        assert!(close(r.total.unused_gib_hours, cap - 60.0));
    }
}
