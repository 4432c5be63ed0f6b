//! The learner: fits peak ≈ fixed + slope × micro_batch from measured peaks
//! (one point scales the memory model; two or more: least squares), reads a
//! single measured batch with the worst split of its error between the
//! model's fixed and per-sample parts, treats OOMs as upper bounds, and
//! tracks prediction error.
//!
//! Everything here is plain arithmetic over `f64` bytes; the advisor decides
//! what to do with the fitted line.

use serde::{Deserialize, Serialize};

use crate::run::RunRecord;

/// A straight line `peak(m) = fixed + slope × m`, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Line {
    pub fixed: f64,
    pub slope: f64,
}

impl Line {
    /// Predicted peak at micro batch `m`.
    pub fn at(&self, m: u32) -> f64 {
        self.fixed + self.slope * m as f64
    }

    /// Largest `m ≥ 1` with `at(m) ≤ budget`, capped at `cap`; None when even
    /// `m = 1` is over the budget.
    pub fn max_batch_under(&self, budget: f64, cap: u32) -> Option<u32> {
        if self.at(1) > budget {
            return None;
        }
        if self.slope <= 0.0 {
            return Some(cap.max(1));
        }
        let m = ((budget - self.fixed) / self.slope).floor();
        Some((m.max(1.0).min(cap as f64)) as u32)
    }
}

/// How a [`Fit`] was obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FitKind {
    /// One distinct micro batch measured: the memory model's line scaled so it
    /// passes through the measurement.
    ScaledModel,
    /// Two or more distinct micro batches: ordinary least squares.
    LeastSquares,
    /// Least squares gave a physically impossible line (slope ≤ 0, negative
    /// fixed part, far off the model); the scaled model is used instead.
    DegenerateFallback,
}

/// A line fitted to measurements.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Fit {
    pub line: Line,
    pub kind: FitKind,
    /// Measurements used.
    pub points: usize,
    /// Distinct micro batches among them.
    pub distinct_batches: usize,
    /// Largest micro batch measured (extrapolation starts beyond it).
    pub max_measured_batch: u32,
    /// Standard error of the slope (bytes per sample): from the residuals
    /// when there are more points than parameters, and never below what
    /// [`PEAK_NOISE`] alone would give. 0 for a scaled model.
    pub slope_stderr: f64,
}

/// Run-to-run variation of a measured peak, relative: the caching allocator
/// rounds blocks and data batches differ in padding, so the same settings
/// peak a few percent apart between runs.
pub const PEAK_NOISE: f64 = 0.02;

/// One measured peak.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Observation {
    pub micro_batch: u32,
    pub peak_bytes: u64,
}

/// A least-squares slope further than this factor from the memory model's
/// slope is treated as degenerate (two noisy points close together can give
/// any slope; activations do not really differ from the model by 4×).
const MAX_SLOPE_RATIO: f64 = 4.0;

/// Fits the line through `obs`, using `model` (the memory model's own line
/// for the same settings) as the shape when there is only one distinct micro
/// batch. Returns None when there is no usable observation.
pub fn fit(model: Line, obs: &[Observation]) -> Option<Fit> {
    let obs: Vec<Observation> = obs
        .iter()
        .copied()
        .filter(|o| o.micro_batch > 0 && o.peak_bytes > 0)
        .collect();
    if obs.is_empty() {
        return None;
    }
    let mut batches: Vec<u32> = obs.iter().map(|o| o.micro_batch).collect();
    batches.sort_unstable();
    batches.dedup();
    let distinct = batches.len();
    let max_measured_batch = *batches.last()?;
    let scaled = scale_model(model, &obs);
    let base = Fit {
        line: scaled,
        kind: FitKind::ScaledModel,
        points: obs.len(),
        distinct_batches: distinct,
        max_measured_batch,
        slope_stderr: 0.0,
    };
    if distinct < 2 {
        return Some(base);
    }
    let n = obs.len() as f64;
    let mean_m = obs.iter().map(|o| o.micro_batch as f64).sum::<f64>() / n;
    let mean_p = obs.iter().map(|o| o.peak_bytes as f64).sum::<f64>() / n;
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for o in &obs {
        let dx = o.micro_batch as f64 - mean_m;
        sxy += dx * (o.peak_bytes as f64 - mean_p);
        sxx += dx * dx;
    }
    let slope = sxy / sxx;
    let fixed = mean_p - slope * mean_m;
    let plausible = slope.is_finite()
        && fixed.is_finite()
        && slope > 0.0
        && fixed >= 0.0
        && (model.slope <= 0.0
            || (slope <= model.slope * MAX_SLOPE_RATIO && slope >= model.slope / MAX_SLOPE_RATIO));
    if !plausible {
        return Some(Fit {
            kind: FitKind::DegenerateFallback,
            ..base
        });
    }
    let noise_se = PEAK_NOISE * mean_p / sxx.sqrt();
    let resid_se = if obs.len() > 2 {
        let ss: f64 = obs
            .iter()
            .map(|o| {
                let r = o.peak_bytes as f64 - (fixed + slope * o.micro_batch as f64);
                r * r
            })
            .sum();
        (ss / (obs.len() - 2) as f64 / sxx).sqrt()
    } else {
        0.0
    };
    Some(Fit {
        line: Line { fixed, slope },
        kind: FitKind::LeastSquares,
        slope_stderr: noise_se.max(resid_se),
        ..base
    })
}

/// The model's line scaled by one factor so that it passes through the mean
/// of the measurements (least squares for a pure scale factor).
fn scale_model(model: Line, obs: &[Observation]) -> Line {
    let (mut num, mut den) = (0.0, 0.0);
    for o in obs {
        let p = model.at(o.micro_batch);
        num += p * o.peak_bytes as f64;
        den += p * p;
    }
    if den <= 0.0 || !num.is_finite() {
        // The model knows nothing (zero line): a line through the origin and
        // the mean measurement is the least-assuming shape.
        let n = obs.len() as f64;
        let mean_m = obs.iter().map(|o| o.micro_batch as f64).sum::<f64>() / n;
        let mean_p = obs.iter().map(|o| o.peak_bytes as f64).sum::<f64>() / n;
        return Line {
            fixed: 0.0,
            slope: mean_p / mean_m.max(1.0),
        };
    }
    let k = num / den;
    Line {
        fixed: model.fixed * k,
        slope: model.slope * k,
    }
}

/// Uses an OOM at micro batch `oom_batch` on a GPU of `capacity` bytes as an
/// upper bound: the true peak there was above capacity, so a line that says
/// otherwise has too small a slope. Returns the line with its slope raised
/// just enough that `at(oom_batch) ≥ capacity` (the fixed part is kept: it is
/// the better-measured end).
pub fn respect_oom(line: Line, oom_batch: u32, capacity: f64) -> Line {
    if oom_batch == 0 || line.at(oom_batch) >= capacity {
        return line;
    }
    Line {
        fixed: line.fixed,
        slope: ((capacity - line.fixed) / oom_batch as f64).max(line.slope),
    }
}

// === correcting the memory model with measurements ===

/// One measured peak next to the memory model's prediction for exactly the
/// settings it ran with (micro batch, accumulation, dtype …).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measured {
    pub micro_batch: u32,
    /// The memory model's peak for those settings.
    pub model_bytes: f64,
    /// The memory model's per-sample slope there (phase A).
    pub model_slope: f64,
    /// The fixed part of the memory model's forward/backward line there
    /// (`model_fixed + model_slope × m` is the line; `model_bytes` is never
    /// below it, above it where the optimizer step sets the peak).
    pub model_fixed: f64,
    pub peak_bytes: f64,
}

impl Measured {
    /// A measured peak and a model prediction, both positive and finite.
    fn usable(&self) -> bool {
        self.micro_batch > 0
            && self.peak_bytes.is_finite()
            && self.peak_bytes > 0.0
            && self.model_bytes.is_finite()
            && self.model_bytes > 0.0
    }
}

/// How measurements correct the memory model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CorrectionKind {
    /// One distinct micro batch measured: the model scaled through it.
    Scale,
    /// Two or more distinct micro batches: the model plus a least-squares
    /// residual line `r0 + r1 × m`.
    ResidualLine,
    /// The residual line was physically impossible (the corrected slope
    /// negative or far off the model's): the scale is used instead.
    DegenerateFallback,
}

/// A correction of the memory model learned from measured peaks:
/// `corrected(m) = scale × model(m) + r0 + r1 × m`. It corrects the model
/// at every micro batch — both phases of a step, the accumulation the
/// suggestion really uses — rather than replacing it with a line that
/// forgets the optimizer-step peak.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Correction {
    pub kind: CorrectionKind,
    pub scale: f64,
    pub r0: f64,
    pub r1: f64,
    /// Standard error of `r1` (bytes per sample); never below what
    /// [`PEAK_NOISE`] alone gives. 0 for a scale.
    pub r1_stderr: f64,
    /// Measurements used (after outliers were dropped).
    pub points: usize,
    pub distinct_batches: usize,
    /// Largest micro batch measured: extrapolation starts beyond it.
    pub max_measured_batch: u32,
    /// Measurements left out as inconsistent with all the others.
    pub outliers: usize,
}

impl Correction {
    /// The corrected peak for a model prediction at micro batch `m`.
    pub fn apply(&self, model_bytes: f64, m: u32) -> f64 {
        self.scale * model_bytes + self.r0 + self.r1 * m as f64
    }
}

/// A measurement further than this from the fit of the other measurements
/// (relative to its own value) is an outlier when those others agree among
/// themselves within [`OUTLIER_CONSISTENT`]. 10 % is five times the
/// run-to-run noise of a peak ([`PEAK_NOISE`]): no honest repeat lands there.
pub const OUTLIER_REL: f64 = 0.10;
/// See [`OUTLIER_REL`]: the others agree when each is within this of their
/// own fit (2.5 × [`PEAK_NOISE`]).
pub const OUTLIER_CONSISTENT: f64 = 0.05;

/// Learns a correction of the memory model from measured peaks, resisting a
/// single outlier: with three or more measurements, each is checked against
/// the fit of the others, and one that is far off while the others agree is
/// left out (one bad record must not move a learned suggestion). None when
/// there is no usable measurement.
pub fn correct(points: &[Measured]) -> Option<Correction> {
    let mut pts: Vec<Measured> = points.iter().copied().filter(Measured::usable).collect();
    if pts.is_empty() {
        return None;
    }
    let mut outliers = 0;
    while pts.len() >= 3 {
        // Each point against the fit of the others, without copying the
        // others (a popular workload has hundreds of runs: the admission
        // webhook asks this on every pod).
        let batches = BatchCounts::of(&pts);
        let totals = Totals::of(&pts);
        let mut worst: Option<(usize, f64)> = None;
        for i in 0..pts.len() {
            let Some(c) = correction_without(&pts, Some(i), &batches, &totals) else {
                continue;
            };
            let p = pts[i];
            let off = (c.apply(p.model_bytes, p.micro_batch) - p.peak_bytes).abs() / p.peak_bytes;
            // (a NaN is never an outlier, as before the sums)
            if off.is_nan() || off <= OUTLIER_REL || worst.is_some_and(|(_, w)| off <= w) {
                continue;
            }
            let consistent = except(&pts, Some(i)).all(|o| {
                (c.apply(o.model_bytes, o.micro_batch) - o.peak_bytes).abs() / o.peak_bytes
                    <= OUTLIER_CONSISTENT
            });
            if consistent {
                worst = Some((i, off));
            }
        }
        match worst {
            Some((i, _)) => {
                pts.remove(i);
                outliers += 1;
            }
            None => break,
        }
    }
    correct_plain(&pts).map(|c| Correction { outliers, ..c })
}

/// The points but the one at `skip`.
fn except(pts: &[Measured], skip: Option<usize>) -> impl Iterator<Item = &Measured> {
    pts.iter()
        .enumerate()
        .filter(move |(j, _)| Some(*j) != skip)
        .map(|(_, p)| p)
}

/// The micro batches measured and how often each (sorted): a fit leaving
/// one point out reads its distinct count and largest batch from here.
struct BatchCounts(Vec<(u32, usize)>);

impl BatchCounts {
    fn of(pts: &[Measured]) -> BatchCounts {
        let mut batches: Vec<u32> = pts.iter().map(|p| p.micro_batch).collect();
        batches.sort_unstable();
        let mut counts: Vec<(u32, usize)> = Vec::new();
        for b in batches {
            match counts.last_mut() {
                Some((last, n)) if *last == b => *n += 1,
                _ => counts.push((b, 1)),
            }
        }
        BatchCounts(counts)
    }

    /// Distinct batches and the largest, without one measurement at `m`.
    fn without(&self, m: Option<u32>) -> (usize, Option<u32>) {
        let gone = |&(b, n): &(u32, usize)| Some(b) == m && n == 1;
        let distinct = self.0.iter().filter(|c| !gone(c)).count();
        let max = self.0.iter().rev().find(|c| !gone(c)).map(|(b, _)| *b);
        (distinct, max)
    }
}

fn correct_plain(pts: &[Measured]) -> Option<Correction> {
    correction_without(pts, None, &BatchCounts::of(pts), &Totals::of(pts))
}

/// The sums a correction is fitted from, so that a fit leaving one point
/// out subtracts that point instead of passing over the others again (the
/// outlier check fits every point's others: quadratic otherwise).
#[derive(Clone, Copy, Default)]
struct Totals {
    model_peak: f64,
    model_sq: f64,
    m: f64,
    m_sq: f64,
    r: f64,
    r_sq: f64,
    m_r: f64,
    slope: f64,
    peak: f64,
    /// Bounds over every point added (taking a point out keeps them: they
    /// stay bounds of the rest), for a quick plausibility test.
    min_model: f64,
    min_m: f64,
    max_m: f64,
}

impl Totals {
    fn of(pts: &[Measured]) -> Totals {
        let start = Totals {
            min_model: f64::INFINITY,
            min_m: f64::INFINITY,
            max_m: f64::NEG_INFINITY,
            ..Totals::default()
        };
        pts.iter().fold(start, |t, p| {
            let m = p.micro_batch as f64;
            Totals {
                min_model: t.min_model.min(p.model_bytes),
                min_m: t.min_m.min(m),
                max_m: t.max_m.max(m),
                ..t.plus(p, 1.0)
            }
        })
    }

    /// `sign` 1 adds the point to the sums, -1 takes it out (the bounds
    /// stay: see the fields).
    fn plus(self, p: &Measured, sign: f64) -> Totals {
        let m = p.micro_batch as f64;
        let r = p.peak_bytes - p.model_bytes;
        Totals {
            model_peak: self.model_peak + sign * p.model_bytes * p.peak_bytes,
            model_sq: self.model_sq + sign * p.model_bytes * p.model_bytes,
            m: self.m + sign * m,
            m_sq: self.m_sq + sign * m * m,
            r: self.r + sign * r,
            r_sq: self.r_sq + sign * r * r,
            m_r: self.m_r + sign * m * r,
            slope: self.slope + sign * p.model_slope,
            peak: self.peak + sign * p.peak_bytes,
            ..self
        }
    }
}

/// Whether the corrected line stays positive at every point: first by the
/// bounds (enough when they hold), else point by point.
fn every_line_point_positive<'a>(
    t: &Totals,
    r0: f64,
    r1: f64,
    mut pts: impl Iterator<Item = &'a Measured>,
) -> bool {
    let lowest_m = if r1 >= 0.0 { t.min_m } else { t.max_m };
    if t.min_model.is_finite() && t.min_model + r0 + r1 * lowest_m > 0.0 {
        return true;
    }
    pts.all(|p| p.model_bytes + r0 + r1 * p.micro_batch as f64 > 0.0)
}

/// The correction fitted to `all` without the point at `skip`.
fn correction_without(
    all: &[Measured],
    skip: Option<usize>,
    batches: &BatchCounts,
    totals: &Totals,
) -> Option<Correction> {
    let skipped = skip.and_then(|i| all.get(i));
    let t = match skipped {
        Some(p) => totals.plus(p, -1.0),
        None => *totals,
    };
    let len = all.len() - usize::from(skipped.is_some());
    if len == 0 {
        return None;
    }
    let (distinct, max_measured_batch) = batches.without(skipped.map(|p| p.micro_batch));
    let max_measured_batch = max_measured_batch?;
    // Least squares for a pure scale factor.
    let (num, den) = (t.model_peak, t.model_sq);
    let scale = if den > 0.0 && num.is_finite() && num > 0.0 {
        num / den
    } else {
        1.0
    };
    let base = Correction {
        kind: CorrectionKind::Scale,
        scale,
        r0: 0.0,
        r1: 0.0,
        r1_stderr: 0.0,
        points: len,
        distinct_batches: distinct,
        max_measured_batch,
        outliers: 0,
    };
    if distinct < 2 {
        return Some(base);
    }
    // Least squares for the residual (measured − model) as a line in m.
    let n = len as f64;
    let mean_m = t.m / n;
    let mean_r = t.r / n;
    let sxy = t.m_r - n * mean_m * mean_r;
    let sxx = t.m_sq - n * mean_m * mean_m;
    let r1 = sxy / sxx;
    let r0 = mean_r - r1 * mean_m;
    let model_slope = t.slope / n;
    let slope = model_slope + r1;
    let plausible = r0.is_finite()
        && r1.is_finite()
        && slope > 0.0
        && (model_slope <= 0.0
            || (slope <= model_slope * MAX_SLOPE_RATIO && slope >= model_slope / MAX_SLOPE_RATIO))
        && every_line_point_positive(&t, r0, r1, except(all, skip));
    if !plausible {
        return Some(Correction {
            kind: CorrectionKind::DegenerateFallback,
            ..base
        });
    }
    let mean_p = t.peak / n;
    let noise_se = PEAK_NOISE * mean_p / sxx.sqrt();
    let resid_se = if len > 2 {
        // the residuals' spread around the line: Syy − r1·Sxy (never below
        // 0: with an exact line the difference is rounding)
        let ss = (t.r_sq - n * mean_r * mean_r - r1 * sxy).max(0.0);
        (ss / (len - 2) as f64 / sxx).sqrt()
    } else {
        0.0
    };
    Some(Correction {
        kind: CorrectionKind::ResidualLine,
        scale: 1.0,
        r0,
        r1,
        r1_stderr: noise_se.max(resid_se),
        ..base
    })
}

/// How far the memory model's line may be off in each of its parts, as
/// the ratio of the truth to the model: the range a measurement of a single
/// micro batch is read with (see [`worst_split`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ErrorRange {
    /// The true fixed part is at least this multiple of the model's.
    pub fixed_low: f64,
    /// The true per-sample part is at most this multiple of the model's.
    pub slope_high: f64,
}

/// A line read off measurements of a single micro batch as the worst split
/// of their error: the truth is taken as `fixed × F + slope × S × m`, with
/// `F + S × m` the memory model's forward/backward line for the settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Split {
    /// Ratio of the true fixed part to the model's.
    pub fixed: f64,
    /// Ratio of the true per-sample part to the model's.
    pub slope: f64,
}

impl Split {
    /// The split line at micro batch `m` for a model line `fixed + slope × m`.
    pub fn at(&self, model_fixed: f64, model_slope: f64, m: u32) -> f64 {
        self.fixed * model_fixed + self.slope * model_slope * m as f64
    }
}

/// The worst split of the measured error between the model's fixed and
/// per-sample parts that the measurements allow, for extrapolating beyond
/// them when they cannot tell the two apart (one distinct micro batch, or a
/// degenerate least-squares line).
///
/// A measured peak is at least the forward/backward line at its batch (the
/// optimizer step can set it higher), and the fixed part is at least
/// `range.fixed_low` of the model's, so the per-sample ratio is at most
/// `(P − fixed_low × F) / (S × m)` at every measured point and at most
/// `range.slope_high`; the steepest such slope, never below the scale that
/// fits the model's peak through the measurements (the model's own shape),
/// with the highest fixed part that keeps the line at or under every
/// measurement, is the line that grows fastest beyond the largest measured
/// batch. None when no point has a usable model line.
pub fn worst_split(points: &[Measured], range: ErrorRange) -> Option<Split> {
    let pts: Vec<&Measured> = points
        .iter()
        .filter(|p| {
            p.usable()
                && p.model_slope.is_finite()
                && p.model_slope > 0.0
                && p.model_fixed.is_finite()
                && p.model_fixed >= 0.0
        })
        .collect();
    if pts.is_empty() {
        return None;
    }
    let (num, den) = pts.iter().fold((0.0, 0.0), |(n, d), p| {
        (
            n + p.model_bytes * p.peak_bytes,
            d + p.model_bytes * p.model_bytes,
        )
    });
    let scale = num / den;
    let allowed = pts
        .iter()
        .map(|p| {
            (p.peak_bytes - range.fixed_low * p.model_fixed)
                / (p.model_slope * p.micro_batch as f64)
        })
        .fold(f64::INFINITY, f64::min);
    let slope = allowed.min(range.slope_high).max(scale);
    let fixed = pts
        .iter()
        .filter(|p| p.model_fixed > 0.0)
        .map(|p| (p.peak_bytes - slope * p.model_slope * p.micro_batch as f64) / p.model_fixed)
        .fold(f64::INFINITY, f64::min);
    // No fixed part in the model: the line is its per-sample part alone.
    let fixed = if fixed.is_finite() {
        fixed.max(0.0)
    } else {
        0.0
    };
    (slope.is_finite() && slope > 0.0).then_some(Split { fixed, slope })
}

/// Measured peaks of the successful runs among `runs`: whole runs' peaks
/// only (a partial multi-node peak is a lower bound, not a measurement to
/// fit: [`RunRecord::full_peak`]).
pub fn observations(runs: &[&RunRecord]) -> Vec<Observation> {
    runs.iter()
        .filter(|r| r.result.success())
        .filter_map(|r| {
            Some(Observation {
                micro_batch: r.settings.micro_batch_size,
                peak_bytes: r.full_peak()?,
            })
        })
        .filter(|o| o.micro_batch > 0 && o.peak_bytes > 0)
        .collect()
}

/// Smallest micro batch that ran out of memory among `runs`, if any.
pub fn smallest_oom(runs: &[&RunRecord]) -> Option<u32> {
    runs.iter()
        .filter(|r| r.is_oom())
        .map(|r| r.settings.micro_batch_size)
        .filter(|&m| m > 0)
        .min()
}

/// Largest micro batch that succeeded among `runs`, if any: a multi-node
/// job some node of which never reported is not known to have succeeded
/// ([`RunRecord::outcome_is_whole`]).
pub fn largest_success(runs: &[&RunRecord]) -> Option<u32> {
    runs.iter()
        // An unconfirmed success may have run another micro batch: no proof.
        .filter(|r| r.result.success() && r.outcome_is_whole() && !r.settings_unconfirmed())
        .map(|r| r.settings.micro_batch_size)
        .max()
}

// === host memory and the data loader ===

/// What runs killed for host memory teach the data loader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostMemoryLesson {
    /// Most data-loader workers to suggest: half the fewest a killed run had.
    pub max_workers: u32,
    /// The fewest workers a killed run had.
    pub killed_with: u32,
    /// Killed runs learned from.
    pub killed: usize,
}

/// What the runs among `runs` that were killed for host memory
/// ([`crate::run::RunResult::host_oom`]) teach: at most half the
/// fewest workers any of them had, and no pinned memory. Each DataLoader
/// worker is a process holding its own copy of the dataset object and its
/// prefetched batches (PyTorch, `torch.utils.data`, "Multi-process data
/// loading"), and pinned memory is page-locked host memory the kernel
/// cannot reclaim; both count against the job's memory limit, the
/// micro batch's GPU memory does not. A kill is forgotten once a later run
/// succeeded with at least as many workers (its memory limit was raised).
/// None when no run was killed for host memory.
pub fn host_memory_lesson(runs: &[&RunRecord]) -> Option<HostMemoryLesson> {
    let workers = |r: &RunRecord| r.settings.dataloader.num_workers;
    let killed: Vec<&RunRecord> = runs
        .iter()
        .copied()
        .filter(|k| k.result.host_oom())
        .filter(|k| {
            !runs.iter().any(|r| {
                r.result.success() && r.timestamp > k.timestamp && workers(r) >= workers(k)
            })
        })
        .collect();
    let killed_with = killed.iter().map(|r| workers(r)).min()?;
    Some(HostMemoryLesson {
        max_workers: killed_with / 2,
        killed_with,
        killed: killed.len(),
    })
}

// === prediction error tracking ===

/// How well predictions matched measurements over a set of runs.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct ErrorStats {
    /// Runs with both a prediction and a measured peak.
    pub count: usize,
    /// Median of |predicted − measured| / measured.
    pub median_abs: f64,
    /// 90th percentile of the same.
    pub p90_abs: f64,
    /// Largest of the same.
    pub max_abs: f64,
    /// Mean signed error: > 0 means gpufit over-predicts.
    pub mean_signed: f64,
}

/// Prediction-error statistics over runs that carry both numbers
/// (see [`RunRecord::prediction_error`]).
pub fn error_stats<'a>(runs: impl IntoIterator<Item = &'a RunRecord>) -> ErrorStats {
    let errs: Vec<f64> = runs
        .into_iter()
        .filter_map(RunRecord::prediction_error)
        .filter(|e| e.is_finite())
        .collect();
    error_stats_of(&errs)
}

/// Statistics of signed relative errors.
pub fn error_stats_of(errs: &[f64]) -> ErrorStats {
    if errs.is_empty() {
        return ErrorStats::default();
    }
    let mut abs: Vec<f64> = errs.iter().map(|e| e.abs()).collect();
    abs.sort_by(|a, b| a.total_cmp(b));
    ErrorStats {
        count: errs.len(),
        median_abs: percentile(&abs, 0.5),
        p90_abs: percentile(&abs, 0.9),
        max_abs: abs[abs.len() - 1],
        mean_signed: errs.iter().sum::<f64>() / errs.len() as f64,
    }
}

/// Nearest-rank percentile of an ascending slice (`q` in 0..=1); 0 when empty.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q.clamp(0.0, 1.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: f64 = 1e9;

    fn obs(m: u32, gb: f64) -> Observation {
        Observation {
            micro_batch: m,
            peak_bytes: (gb * GB) as u64,
        }
    }

    fn model() -> Line {
        Line {
            fixed: 10.0 * GB,
            slope: 2.0 * GB,
        }
    }

    #[test]
    fn one_point_scales_the_model_through_the_measurement() {
        // Model says 14 GB at m=2; measured 21 GB → everything ×1.5.
        let f = fit(model(), &[obs(2, 21.0)]).unwrap();
        assert_eq!(f.kind, FitKind::ScaledModel);
        assert!((f.line.at(2) - 21.0 * GB).abs() < 1e3);
        assert!((f.line.slope / model().slope - 1.5).abs() < 1e-9);
        assert!((f.line.fixed / model().fixed - 1.5).abs() < 1e-9);
    }

    #[test]
    fn two_points_recover_fixed_and_slope_by_least_squares() {
        // True line 12 + 3m, quite unlike the model (10 + 2m).
        let f = fit(model(), &[obs(2, 18.0), obs(6, 30.0), obs(4, 24.0)]).unwrap();
        assert_eq!(f.kind, FitKind::LeastSquares);
        assert!((f.line.fixed / GB - 12.0).abs() < 1e-6);
        assert!((f.line.slope / GB - 3.0).abs() < 1e-6);
        assert_eq!(f.max_measured_batch, 6);
        // Exact points: the error is the assumed measurement noise alone.
        assert!(f.slope_stderr > 0.0 && f.slope_stderr < 0.1 * f.line.slope);
    }

    #[test]
    fn repeated_measurements_at_one_batch_still_scale_the_model() {
        let f = fit(model(), &[obs(4, 18.0), obs(4, 18.2)]).unwrap();
        assert_eq!(f.kind, FitKind::ScaledModel);
        assert_eq!(f.distinct_batches, 1);
    }

    #[test]
    fn a_decreasing_peak_is_a_degenerate_fit_and_falls_back_to_the_scaled_model() {
        let f = fit(model(), &[obs(2, 20.0), obs(3, 19.0)]).unwrap();
        assert_eq!(f.kind, FitKind::DegenerateFallback);
        assert!(f.line.slope > 0.0);
    }

    #[test]
    fn a_slope_wildly_off_the_model_is_treated_as_degenerate() {
        // 2 → 3 adds 40 GB per sample: 20× the model's slope, noise not physics.
        let f = fit(model(), &[obs(2, 14.0), obs(3, 54.0)]).unwrap();
        assert_eq!(f.kind, FitKind::DegenerateFallback);
    }

    #[test]
    fn no_usable_observation_gives_no_fit() {
        assert!(fit(model(), &[]).is_none());
        assert!(fit(model(), &[obs(0, 10.0), obs(3, 0.0)]).is_none());
    }

    #[test]
    fn an_oom_below_the_line_raises_the_slope_to_reach_capacity() {
        let line = Line {
            fixed: 10.0 * GB,
            slope: 2.0 * GB,
        };
        // Line says 30 GB at m=10 but m=10 OOMed on a 40 GB card.
        let l2 = respect_oom(line, 10, 40.0 * GB);
        assert!(l2.at(10) >= 40.0 * GB - 1.0);
        assert_eq!(l2.fixed, line.fixed);
        // An OOM the line already explains changes nothing.
        assert_eq!(respect_oom(line, 20, 40.0 * GB), line);
    }

    #[test]
    fn max_batch_under_a_budget_is_the_largest_fitting_batch() {
        let l = model();
        assert_eq!(l.max_batch_under(20.0 * GB, 1000), Some(5));
        assert_eq!(l.max_batch_under(11.9 * GB, 1000), None);
        assert_eq!(l.max_batch_under(1e6 * GB, 64), Some(64));
    }

    #[test]
    fn error_stats_report_median_p90_and_bias() {
        let s = error_stats_of(&[0.1, -0.2, 0.05, 0.3, -0.1]);
        assert_eq!(s.count, 5);
        assert!((s.median_abs - 0.1).abs() < 1e-12);
        assert!((s.max_abs - 0.3).abs() < 1e-12);
        assert!((s.p90_abs - 0.3).abs() < 1e-12);
        assert!((s.mean_signed - 0.03).abs() < 1e-12);
        assert_eq!(error_stats_of(&[]).count, 0);
    }

    const RANGE: ErrorRange = ErrorRange {
        fixed_low: 0.85,
        slope_high: 1.5,
    };

    fn measured(m: u32, fixed: f64, slope: f64, peak: f64) -> Measured {
        Measured {
            micro_batch: m,
            model_bytes: (fixed + slope * m as f64) * GB,
            model_slope: slope * GB,
            model_fixed: fixed * GB,
            peak_bytes: peak * GB,
        }
    }

    /// Issue 40: one batch measured exactly as the model says cannot tell
    /// a fixed part 15 % over-predicted from a per-sample part under-
    /// predicted; the worst split puts everything the fixed part's floor
    /// leaves into the per-sample part.
    #[test]
    fn one_batch_is_extrapolated_with_the_worst_split_of_its_error() {
        // Model 10 + 1·m GB, measured 13 GB at m = 3 (what the model says).
        let sp = worst_split(&[measured(3, 10.0, 1.0, 13.0)], RANGE).unwrap();
        // Fixed part at its floor 8.5, so the slope is (13 − 8.5) / 3 = 1.5.
        assert!((sp.fixed - 0.85).abs() < 1e-9, "{sp:?}");
        assert!((sp.slope - 1.5).abs() < 1e-9, "{sp:?}");
        // Through the measurement, and above the scaled model beyond it.
        assert!((sp.at(10.0 * GB, GB, 3) - 13.0 * GB).abs() < 1.0);
        assert!((sp.at(10.0 * GB, GB, 8) - 20.5 * GB).abs() < 1.0);
        // A true line u = 0.85, v = 1.5 through the same point is covered;
        // the scaled model (×1) would have said 18 GB at 8.
        assert!(sp.at(10.0 * GB, GB, 8) >= (0.85 * 10.0 + 1.5 * 8.0) * GB - 1.0);
    }

    #[test]
    fn the_worst_slope_is_capped_by_the_range_and_never_below_the_scale() {
        // Fixed part dominates a small batch: (13 − 8.5) / 1 = 4.5 > 1.5, so
        // the slope stops at 1.5× and the fixed part takes the rest.
        let sp = worst_split(&[measured(1, 12.0, 1.0, 13.0)], RANGE).unwrap();
        assert!((sp.slope - 1.5).abs() < 1e-9, "{sp:?}");
        assert!((sp.at(12.0 * GB, GB, 1) - 13.0 * GB).abs() < 1.0);
        // Measured at 2× the model: the scale (2) is above the range's cap
        // and is kept (the model's own shape is never made flatter).
        let sp = worst_split(&[measured(2, 10.0, 2.0, 28.0)], RANGE).unwrap();
        assert!((sp.slope - 2.0).abs() < 1e-9, "{sp:?}");
    }

    /// With the optimizer step setting the model's peak at the measured
    /// batch, the measured peak bounds the forward/backward line from above
    /// only: the worst case is the line reaching it.
    #[test]
    fn a_peak_set_by_the_optimizer_step_still_bounds_the_line() {
        let mut p = measured(2, 10.0, 1.0, 12.0);
        // Model peak 15 GB (optimizer step) over its line of 12 GB.
        p.model_bytes = 15.0 * GB;
        let sp = worst_split(&[p], RANGE).unwrap();
        // scale 12 / 15 = 0.8 < allowed (12 − 8.5) / 2 = 1.75 → capped 1.5.
        assert!((sp.slope - 1.5).abs() < 1e-9, "{sp:?}");
        assert!(sp.at(10.0 * GB, GB, 2) <= 12.0 * GB + 1.0);
        assert!(worst_split(&[], RANGE).is_none());
    }

    /// The outlier check fits each point's others by taking the point out
    /// of the sums; that must be the fit of a list without it.
    #[test]
    fn a_fit_leaving_one_point_out_is_the_fit_of_the_others() {
        // a line with scatter, two points at one batch, one far off
        let pts: Vec<Measured> = [
            (1, 20.0, 21.0),
            (2, 22.0, 23.5),
            (2, 22.0, 23.1),
            (4, 26.0, 27.9),
            (8, 34.0, 44.0),
            (12, 42.0, 44.8),
            (16, 50.0, 52.5),
        ]
        .iter()
        .map(|&(m, model, peak)| Measured {
            micro_batch: m,
            model_bytes: model * 1e9,
            model_slope: 2e9,
            model_fixed: model * 1e9 - 2e9 * m as f64,
            peak_bytes: peak * 1e9,
        })
        .collect();
        let batches = BatchCounts::of(&pts);
        let totals = Totals::of(&pts);
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0);
        for i in 0..pts.len() {
            let others: Vec<Measured> = except(&pts, Some(i)).copied().collect();
            let left_out = correction_without(&pts, Some(i), &batches, &totals).unwrap();
            let refit = correct_plain(&others).unwrap();
            assert_eq!(left_out.kind, refit.kind, "point {i}");
            assert_eq!(left_out.points, refit.points);
            assert_eq!(left_out.distinct_batches, refit.distinct_batches);
            assert_eq!(left_out.max_measured_batch, refit.max_measured_batch);
            for (a, b) in [
                (left_out.scale, refit.scale),
                (left_out.r0, refit.r0),
                (left_out.r1, refit.r1),
                (left_out.r1_stderr, refit.r1_stderr),
            ] {
                assert!(close(a, b), "point {i}: {a} vs {b}");
            }
        }
        // and the far point is the one left out
        let c = correct(&pts).unwrap();
        assert_eq!(c.outliers, 1);
        assert_eq!(c.points, pts.len() - 1);
    }
}
