//! Accuracy of the memory model against measured peaks.
//!
//! Sources (all under `bench/data/`, each described in its README):
//! - `published_peaks.csv`: peaks published by framework documentation and
//!   papers; each row says which quantity it is (allocated, reserved or
//!   device memory) and in which unit. Every row is scored unless its
//!   setting is one gpufit cannot express (`include=no`, the reason in its
//!   note); a row's model options are the `gpufit estimate` flags its
//!   columns stand for, parsed by the CLI's own parser (`option_flags`).
//! - `h100/peaks.csv`, `h100/throughput.csv`, `h100/compile_accum.csv`,
//!   `h100/families.csv`, `h100/holdout.csv`, `h100/steps.csv` (its
//!   fixed-length rows) and the same grids under `h100/expandable/`:
//!   measured on a real H100 80GB with the Hugging Face training step;
//!   scored on reserved bytes (what the allocator holds), and every row, the
//!   OOMs included, is checked for fit/no-fit on the card.
//!
//! - `h200/grid.csv`, `h200/qlora.csv`, `h200/expandable/grid.csv`: the
//!   same step measured the same way on an H200 (141 GB): the
//!   configurations of `synthetic/grid.csv` (which the replay had only
//!   replayed), PEFT's QLoRA recipe and bitsandbytes' 8-bit AdamW. Scored
//!   in all rows and as their own figures; fit/no-fit is checked on the
//!   H200, and on the 80 GB card where the measurement decides it.
//! - `h200/recheck.csv`, `h200/neighbours.csv`, `h200/grid_instep.csv`,
//!   `h100/neighbours.csv`, `h100/grid_tail.csv`: the rows the model
//!   missed most measured again, their neighbours, and the synthetic grid
//!   again, the last three with cuBLAS's workspaces made in the first
//!   step (as a fresh job makes them; `grid_instep.csv` is also held
//!   against the in-step replay). Scored like the rows above.
//! - `h200/replayed_neighbours.csv`: the neighbours replayed the same way,
//!   printed beside both cards' measurements (not scored).
//!
//! - `h100/replayed.csv`: rows of those files replayed without a GPU through
//!   the caching-allocator model of `scripts/alloc_sim.py`, printed beside
//!   the measurement and the memory model (not scored: a check of how far
//!   the allocator's rules explain the reserved bytes).
//! - `synthetic/replayed_workspaces.csv`: rows of the synthetic grid
//!   replayed with cuBLAS's workspaces made inside the first step, as a
//!   fresh job makes them, printed beside the replay without them (not
//!   scored: how far that one early allocation moves a reserved peak).
//! - `synthetic/replayed.csv`: configurations nobody measured
//!   (`synthetic/grid.csv`, `synthetic/expandable/grid.csv`) replayed the
//!   same way, printed beside the model (not scored: how the model fares
//!   where there is no GPU figure; the bench fails if the advisor's
//!   first-run plan falls below a replayed peak).
//!
//! Models that are not in the catalog are read from
//! `bench/data/configs/<owner>__<name>.json` (their published config.json).
//!
//! Prints every row, then median/worst relative error per source, per
//! framework and over everything, the share and depth of under-prediction
//! (the dangerous direction), how far repeated measurements of one
//! configuration disagree, and whether the targets are met. It also
//! prints the throughput model's (`core::throughput`) predicted tokens/s
//! against every measured step's, per card and attention kind (not a
//! target of issue 11; its figures are what the advisor ranks first runs
//! by). The Trainer rows measured before `scripts/gpu_measure.py` timed
//! the Trainer's steps 2..N (no `timed` column) divided the whole
//! `train()` call, setup and first step included, by its steps: they are
//! printed as their own group and left out of the figures. It exits
//! non-zero when the advisor's stated margins
//! (`crates/gpufit-core/src/advisor/margin.rs`) no longer cover the measured
//! under-prediction, or when the advisor's first-run plan falls below a
//! replayed peak of `synthetic/` — the targets themselves are reported,
//! not enforced.
//!
//! Run: `cargo bench --bench accuracy` (or `cargo test --bench accuracy`
//! for a debug build that prints the same table). With
//! `GPUFIT_ACCURACY_DUMP=FILE` it also appends the model's phase terms for
//! every measured row to FILE (with the loss path's largest tensor, the
//! largest gradient block, the optimizer states, the predicted reserved
//! bytes and whether the row ran with expandable segments): what the
//! allocator shares in `crates/gpufit-core/src/memory/allocator.rs` were fitted from.
//! With `GPUFIT_ACCURACY_SPEED_DUMP=FILE` it writes every measured step's
//! tokens/s beside the throughput model's prediction (id, group, measured,
//! predicted): what the constants of `crates/gpufit-core/src/throughput/` are checked
//! against.

#[path = "common/model_config.rs"]
mod model_config;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::ExitCode;

use gpufit::cli::common::{parse_framework, parse_lora_targets, parse_optimizer};
use gpufit::cli::estimate::ModelOptionArgs;
use gpufit::core::advisor::{
    first_run_plan, margin_from, under_prediction_margin, HEURISTIC_FIXED_MARGIN,
    HEURISTIC_SLOPE_MARGIN, UNDER_PREDICTION_P99_ALL,
};
use gpufit::core::catalog::lookup_gpu;
use gpufit::core::memory::{
    attention_materializes_scores, estimate_with, phase_terms, Estimate, ModelOptions,
};
use gpufit::core::settings::{Dtype, EngineeringSettings};
use gpufit::core::throughput::tokens_per_sec;
use gpufit::core::units::{GB, GIB, MIB};
use gpufit::core::workload::{Attention, LoraConfig, Method, Sharding, Workload};

/// Targets from issue 11; issue 40 holds the published rows (all sources,
/// none left out for disagreeing) to the all-rows ones.
const ALL_MEDIAN: f64 = 0.06;
const ALL_WORST: f64 = 0.20;
const H100_MEDIAN: f64 = 0.03;
const H100_WORST: f64 = 0.10;
const MAX_UNDER: f64 = 0.10;
/// The H100's NVML total (bench/data/h100/README.md): 81,559 MiB.
const H100_CAPACITY: f64 = 81_559.0 * MIB as f64;
/// The H200's NVML total as nvidia-smi printed it on the machine that
/// measured bench/data/h200/ (its logs/run1.txt): 143,771 MiB.
const H200_CAPACITY: f64 = 143_771.0 * MIB as f64;

/// The card a row was measured on (the `gpu` column; files without one
/// were all measured on the H100).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Card {
    H100,
    H200,
}

impl Card {
    fn capacity(self) -> f64 {
        match self {
            Card::H100 => H100_CAPACITY,
            Card::H200 => H200_CAPACITY,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Card::H100 => "H100",
            Card::H200 => "H200",
        }
    }

    /// The card's catalog entry (what the throughput model reads).
    fn gpu(self) -> &'static str {
        match self {
            Card::H100 => "NVIDIA H100 80GB HBM3",
            Card::H200 => "NVIDIA H200",
        }
    }
}
/// The CUDA context and kernels beside the allocator that
/// scripts/gpu_measure.py measured on it (the replays leave it out).
const H100_CONTEXT: f64 = 610.0 * MIB as f64;

/// Reads one data file into scored rows (path, source label).
type Reader = fn(&Path, &str) -> Result<Vec<Row>, String>;

struct Row {
    source: String,
    id: String,
    framework: String,
    quantity: String,
    /// `None` for a point that ran out of memory.
    measured: Option<f64>,
    predicted: f64,
    /// The least device memory the step runs in when the card is full and
    /// the allocator releases its cache (fit/no-fit on the H100: what runs
    /// out of memory).
    predicted_min_device: f64,
    /// What the advisor plans with for a first run (the estimate plus its
    /// stated margins), in device bytes, and the measured device bytes.
    first_plan: f64,
    measured_device: Option<f64>,
    /// The card a measured-step row ran on; `None` for published rows.
    card: Option<Card>,
    /// Measured with `expandable_segments:True` (reported on its own).
    expandable: bool,
    include: bool,
    /// H100 rows measured by `scripts/gpu_measure.py` before it recorded
    /// `reserved_at_start`: the previous point's weights were still cached
    /// when this point began, and they were another model's (or another
    /// parameter dtype's) — see `carried_cache`.
    carried: Option<String>,
    /// The row's file says what the allocator held when each point began
    /// (`reserved_at_start`, or gpu_measure.py's known point order).
    carry_known: bool,
    /// H100 rows: `h100/<file>.csv:<line>`, as bench/data/h100/replayed.csv
    /// names them.
    origin: String,
    note: String,
    /// H100 rows: the configuration's every field, to find the same
    /// configuration measured in more than one run.
    key: String,
    /// H100 rows that ran: measured and predicted allocated bytes (the
    /// tensors alone, without the allocator's cache).
    allocated: Option<(f64, f64)>,
    /// Rows that ran with fixed-length batches: measured and predicted
    /// training tokens/s (`core::throughput`), and the group the
    /// throughput report prints them in.
    tokens: Option<(f64, f64, String)>,
}

impl Row {
    fn on(&self, card: Card) -> bool {
        self.card == Some(card)
    }

    fn error(&self) -> Option<f64> {
        self.measured.map(|m| (self.predicted - m) / m)
    }

    /// Whether the reserved bytes are one job's: not when the default
    /// allocator began the point with another model's segments cached
    /// (they are reused only by tensors that fit them, and the rest stays
    /// reserved beside the new model's own segments). Expandable segments
    /// coalesce the freed range, so there the carried cache is reused by
    /// any size and the row is scored (the bench prints both splits).
    fn reserved_scored(&self) -> bool {
        self.include && (self.carried.is_none() || self.expandable)
    }
}

fn main() -> ExitCode {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/data");
    let mut rows = Vec::new();
    let files: [(&str, &str, Reader); 18] = [
        ("published_peaks.csv", "", read_published),
        ("h100/peaks.csv", "h100 peaks grid", read_gpu),
        ("h100/throughput.csv", "h100 throughput series", read_gpu),
        (
            "h100/compile_accum.csv",
            "h100 compile/accumulation",
            read_gpu,
        ),
        ("h100/families.csv", "h100 families", read_gpu),
        (
            "h100/holdout.csv",
            "h100 holdout (measured after the fit)",
            read_gpu,
        ),
        (
            "h100/steps.csv",
            "h100 30-step runs (fixed-length rows scored)",
            read_gpu,
        ),
        (
            "h100/expandable/steps.csv",
            "h100 expandable_segments 30-step runs",
            read_gpu,
        ),
        (
            "h100/expandable/families.csv",
            "h100 expandable_segments families",
            read_gpu,
        ),
        (
            "h100/expandable/holdout.csv",
            "h100 expandable_segments holdout",
            read_gpu,
        ),
        (
            "h200/grid.csv",
            "h200 grid (the synthetic configurations)",
            read_gpu,
        ),
        ("h200/qlora.csv", "h200 QLoRA and 8-bit AdamW", read_gpu),
        (
            "h200/expandable/grid.csv",
            "h200 expandable_segments grid",
            read_gpu,
        ),
        (
            "h200/recheck.csv",
            "h200 rechecks (rows above, measured again)",
            read_gpu,
        ),
        (
            "h200/neighbours.csv",
            "h200 rechecks and their neighbours (workspaces made in step)",
            read_gpu,
        ),
        (
            "h200/grid_instep.csv",
            "h200 grid again (workspaces made in step)",
            read_gpu,
        ),
        (
            "h100/neighbours.csv",
            "h100 rechecks and their neighbours (gpu_measure.py)",
            read_gpu,
        ),
        (
            "h100/grid_tail.csv",
            "h100 last grid rows (gpu_measure.py)",
            read_gpu,
        ),
    ];
    for (file, source, read) in files {
        match read(&root.join(file), source) {
            Ok(mut r) => rows.append(&mut r),
            Err(e) => {
                eprintln!("accuracy: {file}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }

    println!(
        "{:<44} {:<9} {:>9} {:>11} {:>11} {:>8}  note",
        "row", "framework", "quantity", "measured", "predicted", "error"
    );
    for r in &rows {
        let measured = r
            .measured
            .map(|m| format!("{:>7.2} GiB", m / GIB as f64))
            .unwrap_or_else(|| "        OOM".into());
        let err = r
            .error()
            .map(|e| format!("{:>+7.1}%", 100.0 * e))
            .unwrap_or_else(|| "       -".into());
        println!(
            "{:<44} {:<9} {:>9} {} {:>7.2} GiB {}  {}",
            r.id,
            r.framework,
            r.quantity,
            measured,
            r.predicted / GIB as f64,
            err,
            &r.note
        );
    }

    let scored: Vec<&Row> = rows
        .iter()
        .filter(|r| r.reserved_scored() && r.measured.is_some())
        .collect();
    if scored.is_empty() {
        eprintln!("accuracy: no rows to score");
        return ExitCode::FAILURE;
    }
    let mut by_source: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut by_framework: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for r in &scored {
        let e = r.error().unwrap_or(0.0);
        by_source.entry(&r.source).or_default().push(e);
        by_framework.entry(&r.framework).or_default().push(e);
    }
    println!("\nper source:");
    for (k, v) in &by_source {
        println!("  {}", summary(k, v));
    }
    println!("per framework:");
    for (k, v) in &by_framework {
        println!("  {}", summary(k, v));
    }
    let all: Vec<f64> = scored.iter().filter_map(|r| r.error()).collect();
    let on_card = |card: Card, es: bool| -> Vec<f64> {
        scored
            .iter()
            .filter(|r| r.on(card) && r.expandable == es)
            .filter_map(|r| r.error())
            .collect()
    };
    let h100 = on_card(Card::H100, false);
    let published: Vec<f64> = scored
        .iter()
        .filter(|r| r.card.is_none())
        .filter_map(|r| r.error())
        .collect();
    println!("overall:");
    println!("  {}", summary("all scored rows", &all));
    println!("  {}", summary("published rows, all sources", &published));
    // The published rows left out: only those whose setting gpufit cannot
    // express (each says why in its note), never for disagreeing.
    let unscored: Vec<&str> = rows
        .iter()
        .filter(|r| r.card.is_none() && !r.include)
        .map(|r| r.id.as_str())
        .collect();
    println!(
        "  published rows not scored (a setting gpufit cannot express, see each note): {}{}",
        unscored.len(),
        listed(" — ", "", &unscored)
    );
    println!("  {}", summary("H100 rows (default allocator)", &h100));
    println!(
        "  {}",
        summary("H100 rows, expandable segments", &on_card(Card::H100, true))
    );
    println!(
        "  {}",
        summary("H200 rows (default allocator)", &on_card(Card::H200, false))
    );
    println!(
        "  {}",
        summary("H200 rows, expandable segments", &on_card(Card::H200, true))
    );
    // allocated bytes are the tensors' alone: a carried cache does not
    // change them, so every row that ran counts
    for card in [Card::H100, Card::H200] {
        let alloc: Vec<f64> = rows
            .iter()
            .filter(|r| r.on(card) && !r.expandable && r.include)
            .filter_map(|r| r.allocated.map(|(m, p)| (p - m) / m))
            .collect();
        let mut abs: Vec<f64> = alloc.iter().map(|e| e.abs()).collect();
        abs.sort_by(|a, b| a.total_cmp(b));
        if !abs.is_empty() {
            println!(
                "  {:<34} n={:>3}  median {:>5.1}%  p90 {:>5.1}%  worst {:>5.1}%",
                format!("{} allocated bytes (tensors only)", card.name()),
                abs.len(),
                100.0 * abs[abs.len() / 2],
                100.0 * abs[(abs.len() * 9 / 10).min(abs.len() - 1)],
                100.0 * abs[abs.len() - 1]
            );
        }
    }

    // The rows that began with another model's weights cached, beside the
    // rest of the same files: the default allocator's reserved bytes carry
    // them, expandable segments reuse them (the evidence for not scoring the
    // former; allocated bytes and fit/no-fit are kept).
    let signed = |es: bool, carried: bool| -> Vec<f64> {
        rows.iter()
            .filter(|r| r.include && r.expandable == es && r.carry_known)
            .filter(|r| r.carried.is_some() == carried)
            .filter_map(|r| r.error())
            .collect()
    };
    println!("rows measured by scripts/gpu_measure.py, by what the allocator held when the point began (signed error):");
    for (es, label) in [(false, "default allocator"), (true, "expandable segments")] {
        for (carried, what) in [
            (false, "empty, the same weights or pinned"),
            (true, "another model's weights"),
        ] {
            let v = signed(es, carried);
            println!("  {}", signed_summary(&format!("{label}, {what}"), &v));
        }
    }

    if let Err(e) = replay_report(&root.join("h100/replayed.csv"), &rows) {
        eprintln!("accuracy: h100/replayed.csv: {e}");
        return ExitCode::FAILURE;
    }
    if let Err(e) = neighbours_replay_report(&root) {
        eprintln!("accuracy: h200/replayed_neighbours.csv: {e}");
        return ExitCode::FAILURE;
    }
    let synthetic = match Synthetic::read(&root) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("accuracy: synthetic/: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = unmeasured_report(&synthetic) {
        eprintln!("accuracy: synthetic/replayed.csv: {e}");
        return ExitCode::FAILURE;
    }
    if let Err(e) = measured_replay_report(&synthetic) {
        eprintln!("accuracy: h200 against synthetic/replayed.csv: {e}");
        return ExitCode::FAILURE;
    }
    if let Err(e) = workspaces_report(&synthetic) {
        eprintln!("accuracy: synthetic/replayed_workspaces.csv: {e}");
        return ExitCode::FAILURE;
    }

    // Fit / no-fit on the card each row ran on (OOMs included).
    let mut fit_wrong = Vec::new();
    for card in [Card::H100, Card::H200] {
        let mut wrong = Vec::new();
        let mut checked = 0;
        for r in rows.iter().filter(|r| r.on(card) && r.include) {
            checked += 1;
            let fits = r.predicted_min_device <= card.capacity();
            if fits != r.measured.is_some() {
                wrong.push(r.id.clone());
            }
        }
        println!(
            "fit/no-fit on the {} ({:.0} MiB): {}/{} right{}",
            card.name(),
            card.capacity() / MIB as f64,
            checked - wrong.len(),
            checked,
            listed(" — wrong: ", "", &wrong)
        );
        if card == Card::H100 {
            fit_wrong = wrong;
        }
    }
    // The H200 rows on the 80 GB card, where their measurement decides:
    // tensors alone above the card do not fit; the whole reserved peak
    // (and the context) within it fits. Between the two, the allocator's
    // release of its cache decides, which the H200 never needed.
    let (mut decided, mut wrong_80) = (0, Vec::new());
    for r in rows.iter().filter(|r| r.on(Card::H200) && r.include) {
        let (Some(device), Some((alloc, _))) = (r.measured_device, r.allocated) else {
            continue;
        };
        let context = device - r.measured.unwrap_or(device);
        let truth = if alloc + context > H100_CAPACITY {
            false
        } else if device <= H100_CAPACITY {
            true
        } else {
            continue;
        };
        decided += 1;
        if (r.predicted_min_device <= H100_CAPACITY) != truth {
            wrong_80.push(r.id.as_str());
        }
    }
    println!(
        "fit/no-fit of the H200 rows on the H100 (where the measurement decides): {}/{} right{}",
        decided - wrong_80.len(),
        decided,
        listed(" — wrong: ", "", &wrong_80)
    );
    let worst_under = all.iter().copied().fold(0.0f64, f64::min);
    let under = all.iter().filter(|e| **e < 0.0).count();
    println!(
        "under-prediction: {under}/{} rows below the measurement; deepest {:.1}% (limit {:.0}%)",
        all.len(),
        100.0 * worst_under,
        100.0 * MAX_UNDER
    );

    // The stated margins the advisor plans a first run with: does the plan
    // cover what the GPU really held?
    let covered: Vec<(&str, f64)> = rows
        .iter()
        .filter(|r| r.card.is_some() && r.reserved_scored())
        .filter_map(|r| {
            r.measured_device
                .map(|m| (r.id.as_str(), (r.first_plan - m) / m))
        })
        .collect();
    let short: Vec<&(&str, f64)> = covered.iter().filter(|(_, d)| *d < 0.0).collect();
    println!(
        "first-run plan (estimate + {:.0} % fixed / {:.0} % per-sample margins, at least the stated margin below) covers the measured device peak: {}/{} H100 and H200 rows{}",
        100.0 * HEURISTIC_FIXED_MARGIN,
        100.0 * HEURISTIC_SLOPE_MARGIN,
        covered.len() - short.len(),
        covered.len(),
        short
            .iter()
            .map(|(id, d)| format!("; {id} short by {:.1}%", -100.0 * d))
            .collect::<String>()
    );
    let all_p99 = p99_under(&all);
    println!(
        "99th percentile of the raise that brings an under-predicted estimate to the measurement (over the {} under-predicted rows): {:.2}%",
        all.iter().filter(|e| **e < 0.0).count(),
        100.0 * all_p99
    );

    // The stated margins the advisor plans first runs with
    // (crates/gpufit-core/src/advisor/margin.rs) must still cover what the data say.
    println!("stated margins (advisor::under_prediction_margin) against the data:");
    let mut stale = Vec::new();
    for (k, v) in &by_framework {
        let p = p99_under(v);
        let stated = match parse_framework(k) {
            Ok(f) => under_prediction_margin(f),
            Err(e) => {
                eprintln!("accuracy: framework `{k}`: {e}");
                return ExitCode::FAILURE;
            }
        };
        let n_under = v.iter().filter(|e| **e < 0.0).count();
        // the advisor's rule, on today's figures
        let needed = margin_from(p, n_under, all_p99);
        let ok = stated + 0.0005 >= needed;
        println!(
            "  {:<10} n={:>3}  under-predicted {:>3}  raise p99 {:>5.2}%  stated {:>5.1}%  {}",
            k,
            v.len(),
            n_under,
            100.0 * p,
            100.0 * stated,
            if ok { "covers" } else { "STALE" }
        );
        if !ok {
            stale.push(k.to_string());
        }
    }
    if UNDER_PREDICTION_P99_ALL + 0.0005 < all_p99 {
        stale.push("all rows".into());
    }

    // The same configuration measured in separate runs: how far apart the
    // measurements themselves are (the floor under any model's error).
    let mut repeats: BTreeMap<&str, Vec<(&str, f64)>> = BTreeMap::new();
    for r in rows.iter().filter(|r| r.card.is_some() && r.include) {
        if let Some(m) = r.measured {
            repeats.entry(&r.key).or_default().push((&r.id, m));
        }
    }
    let mut spreads: Vec<(f64, String)> = repeats
        .values()
        .filter(|v| v.len() > 1)
        .map(|v| {
            let lo = v.iter().map(|x| x.1).fold(f64::INFINITY, f64::min);
            let hi = v.iter().map(|x| x.1).fold(0.0, f64::max);
            let ids: Vec<String> = v
                .iter()
                .map(|(id, m)| format!("{id} {:.2} GiB", m / GIB as f64))
                .collect();
            (hi / lo - 1.0, ids.join(" / "))
        })
        .collect();
    spreads.sort_by(|a, b| b.0.total_cmp(&a.0));
    if let Some((worst, ids)) = spreads.first() {
        let mut s: Vec<f64> = spreads.iter().map(|x| x.0).collect();
        s.sort_by(|a, b| a.total_cmp(b));
        println!(
            "repeat measurements (same configuration, separate runs): {} configurations, median spread {:.1}%, largest {:.1}% ({ids})",
            spreads.len(),
            100.0 * s[s.len() / 2],
            100.0 * worst
        );
        for (spread, ids) in spreads.iter().skip(1).filter(|x| x.0 > 0.05) {
            println!("  also {:.1}%: {ids}", 100.0 * spread);
        }
    }
    // The same figures with each configuration's repeated measurements
    // averaged (one error per configuration), beside the per-row ones.
    let mut by_config: BTreeMap<&str, (f64, f64, usize, bool)> = BTreeMap::new();
    for r in scored.iter().filter(|r| r.on(Card::H100)) {
        if let Some(m) = r.measured {
            let e = by_config
                .entry(&r.key)
                .or_insert((0.0, r.predicted, 0, r.expandable));
            e.0 += m;
            e.2 += 1;
        }
    }
    let averaged = |es: bool| -> Vec<f64> {
        by_config
            .values()
            .filter(|v| v.3 == es)
            .map(|(sum, predicted, n, _)| {
                let m = sum / *n as f64;
                (predicted - m) / m
            })
            .collect()
    };
    let h100_avg = averaged(false);
    let mut all_avg = averaged(true);
    all_avg.extend(h100_avg.iter().copied());
    all_avg.extend(published.iter().copied());
    all_avg.extend(on_card(Card::H200, false));
    all_avg.extend(on_card(Card::H200, true));
    println!("with repeated measurements of a configuration averaged:");
    println!("  {}", summary("all scored configurations", &all_avg));
    println!("  {}", summary("H100 configurations (default)", &h100_avg));

    let (am, aw) = median_worst(&all);
    let (hm, hw) = median_worst(&h100);
    let (pm, pw) = median_worst(&published);
    let published_under = published.iter().copied().fold(0.0f64, f64::min);
    let measured_under = scored
        .iter()
        .filter(|r| r.card.is_some())
        .filter_map(|r| r.error())
        .fold(0.0f64, f64::min);
    let checks = [
        ("all rows median", am <= ALL_MEDIAN),
        ("all rows worst", aw <= ALL_WORST),
        ("H100 median", hm <= H100_MEDIAN),
        ("H100 worst", hw <= H100_WORST),
        ("H100 fit/no-fit", fit_wrong.is_empty()),
        ("no under-prediction beyond 10%", -worst_under <= MAX_UNDER),
        (
            "H100/H200 rows: no under beyond 10%",
            -measured_under <= MAX_UNDER,
        ),
        ("published median", pm <= ALL_MEDIAN),
        ("published worst", pw <= ALL_WORST),
        (
            "published: no under beyond 10%",
            -published_under <= MAX_UNDER,
        ),
    ];
    throughput_report(&rows);
    println!("\ntargets (issue 11; the published ones, issue 40):");
    let mut regressed = Vec::new();
    for (name, pass) in checks {
        println!("  {:<32} {}", name, if pass { "met" } else { "NOT met" });
        if !pass && !NOT_YET_MET.contains(&name) {
            regressed.push(name);
        }
        if pass && NOT_YET_MET.contains(&name) {
            println!("  ({name} is met now: take it out of NOT_YET_MET so that it stays met)");
        }
    }
    // What fails the run: a stated margin the data no longer support (the
    // advisor would plan first runs too tight), or a target that was met
    // and no longer is.
    let mut ok = true;
    if !stale.is_empty() {
        eprintln!(
            "accuracy: the stated margins in crates/gpufit-core/src/advisor/margin.rs are below the measured \
             99th percentile for: {}",
            stale.join(", ")
        );
        ok = false;
    }
    if !regressed.is_empty() {
        eprintln!(
            "accuracy: targets met before are not met now: {}",
            regressed.join(", ")
        );
        ok = false;
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The targets the model does not meet yet, with the reason beside each;
/// every target not listed failing fails the run. The issue-11 ones were
/// all met from the twenty-first session (BENCHMARKS.md); when issue 40
/// scored every published row the two under-prediction bounds were missed
/// by published rows alone until litgpt's previous-step 4-bit inputs were
/// modelled and torchtune's 8-bit AdamW row (torchao's compiled
/// optimizer, which gpufit cannot express) was left out with its reason:
/// every target is met, so none may regress.
const NOT_YET_MET: &[&str] = &[];

/// The default-allocator grid of `synthetic/` (the name its replays give).
const GRID: &str = "synthetic/grid.csv";

/// The files of `bench/data/synthetic/` and the H200 measurements of its
/// grids, read once for the three reports that compare them.
struct Synthetic {
    /// `synthetic/replayed.csv` (workspaces made before the step).
    replayed: Vec<HashMap<String, String>>,
    /// `synthetic/replayed_workspaces.csv` (made in the first step).
    workspaces: Vec<HashMap<String, String>>,
    /// The grid files by the name the replays give them.
    grids: HashMap<String, Vec<HashMap<String, String>>>,
    /// Their H200 measurements (line for line), by the same name.
    measured: HashMap<String, Vec<HashMap<String, String>>>,
    /// `h200/grid_instep.csv`: the first rows of `synthetic/grid.csv`
    /// measured again with the workspaces made in each point's first step
    /// (the condition `replayed_workspaces.csv` replays).
    instep: Vec<HashMap<String, String>>,
}

impl Synthetic {
    fn read(root: &Path) -> Result<Self, String> {
        let mut grids = HashMap::new();
        let mut measured = HashMap::new();
        for (grid, h200) in [
            (GRID, "h200/grid.csv"),
            ("synthetic/expandable/grid.csv", "h200/expandable/grid.csv"),
        ] {
            grids.insert(grid.to_string(), read_csv(&root.join(grid))?);
            measured.insert(grid.to_string(), read_csv(&root.join(h200))?);
        }
        Ok(Synthetic {
            replayed: read_csv(&root.join("synthetic/replayed.csv"))?,
            workspaces: read_csv(&root.join("synthetic/replayed_workspaces.csv"))?,
            instep: read_csv(&root.join("h200/grid_instep.csv"))?,
            grids,
            measured,
        })
    }

    /// The rows of grid file `name` in `files` (`grids` or `measured`).
    fn rows<'a>(
        files: &'a HashMap<String, Vec<HashMap<String, String>>>,
        name: &str,
    ) -> Result<&'a [HashMap<String, String>], String> {
        files
            .get(name)
            .map(Vec::as_slice)
            .ok_or_else(|| format!("{name}: not a grid file of synthetic/"))
    }
}

/// The configurations of `synthetic/` replayed before any GPU ran them,
/// against their measurement on the H200 (`h200/grid.csv` and
/// `h200/expandable/grid.csv` hold the grid files' rows, line for line):
/// how far the replay's allocator rules held where nothing had been fitted.
fn measured_replay_report(syn: &Synthetic) -> Result<(), String> {
    let (mut alloc_diff, mut reserved_err) = (Vec::new(), Vec::new());
    let mut far = Vec::new();
    let mut cuda_only = Vec::new();
    for rec in &syn.replayed {
        let file = field(rec, "file")?;
        let line: usize = num(rec, "line")?;
        let Some(rows) = syn.measured.get(file) else {
            continue;
        };
        let Some(m) = line.checked_sub(2).and_then(|i| rows.get(i)) else {
            continue; // not measured (the expandable grid's last rows)
        };
        same_configuration(m, rec).map_err(|e| format!("{file}:{line}: {e}"))?;
        if field(m, "status")? != "ok" {
            continue;
        }
        let (ma, mr): (f64, f64) = (num(m, "allocated_bytes")?, num(m, "reserved_bytes")?);
        let (ra, rr): (f64, f64) = (num(rec, "allocated_bytes")?, num(rec, "reserved_bytes")?);
        alloc_diff.push((ma - ra) / MIB as f64);
        let label = format!(
            "{file}:{line} {} {} {} {}×{}",
            field(m, "model")?.rsplit('/').next().unwrap_or(""),
            field(m, "method")?,
            field(m, "dtype")?,
            field(m, "micro_batch")?,
            field(m, "seq_len")?,
        );
        if ma - ra > CUDA_ONLY_BYTES {
            cuda_only.push(format!("{label} +{:.2} GiB", (ma - ra) / GIB as f64));
        }
        let e = (rr - mr) / mr;
        reserved_err.push(e);
        if e.abs() > 0.05 {
            far.push(format!("{label} {:+.1}%", 100.0 * e));
        }
    }
    alloc_diff.sort_by(|a, b| a.total_cmp(b));
    println!("\nthe replay of synthetic/ against its measurement on the H200 (bench/data/h200/):");
    if let (Some(lo), Some(hi)) = (alloc_diff.first(), alloc_diff.last()) {
        println!(
            "  allocated bytes, measured minus replayed: n={} median {:.0} MiB (range {:.0} .. {:.0} MiB)",
            alloc_diff.len(),
            alloc_diff[alloc_diff.len() / 2],
            lo,
            hi
        );
    }
    println!("  {}", summary("reserved bytes, replay", &reserved_err));
    if !far.is_empty() {
        println!("  replay off by more than 5 %: {}", far.join("; "));
    }
    print_cuda_only(&cuda_only);
    Ok(())
}

/// A measured allocated peak this far above the replay of the same step is
/// a tensor CUDA's kernels make that the CPU trace does not (the replay
/// counts tensors exactly otherwise: median 0.2 %); cuBLAS's workspaces
/// (64 MiB) stay below it. Falcon-7B's math-kernel rows were found so
/// (BENCHMARKS.md, nineteenth session).
const CUDA_ONLY_BYTES: f64 = 512.0 * MIB as f64;

fn print_cuda_only(rows: &[String]) {
    if rows.is_empty() {
        println!("  measured allocated bytes above the replay by more than 512 MiB: none");
    } else {
        println!(
            "  measured allocated bytes above the replay by more than 512 MiB (tensors CUDA makes that the CPU trace does not): {}",
            rows.join("; ")
        );
    }
}

/// The rows the model misses most and their neighbours
/// (`h200/neighbours.csv`, `h100/neighbours.csv`: the same 16 points, line
/// for line), replayed with the workspaces made in the first step as they
/// were measured (`h200/replayed_neighbours.csv`, `scripts/replay_grid.py
/// --workspaces-mib 32`): whether the allocator's rules alone explain what
/// the closed form misses. Not scored.
fn neighbours_replay_report(root: &Path) -> Result<(), String> {
    let replayed = read_csv(&root.join("h200/replayed_neighbours.csv"))?;
    let h200 = read_csv(&root.join("h200/neighbours.csv"))?;
    let h100 = read_csv(&root.join("h100/neighbours.csv"))?;
    println!("\nthe worst rows and their neighbours, replayed with the workspaces made in step (h200/replayed_neighbours.csv), GiB:");
    println!(
        "  {:<50} {:>9} {:>9} {:>9} {:>9} {:>8}",
        "configuration", "H200", "H100", "replay", "model", "model"
    );
    let (mut replay_err, mut model_err) = (Vec::new(), Vec::new());
    for rec in &replayed {
        let line: usize = num(rec, "line")?;
        let (m200, m100) = (
            measured_at(&h200, line, rec)?,
            measured_at(&h100, line, rec)?,
        );
        let (a, b) = (ok_reserved(Some(m200)), ok_reserved(Some(m100)));
        let r: f64 = num(rec, "reserved_bytes")?;
        // the model as the accuracy rows score it: from the measured row
        let (w, st, o) = scenario(m200).map_err(|e| format!("line {line}: {e}"))?;
        let model = estimate_with(&w, &st, &o)
            .map_err(|e| format!("line {line}: {e}"))?
            .peak_reserved_bytes as f64;
        for m in [a, b].into_iter().flatten() {
            replay_err.push((r - m) / m);
            model_err.push((model - m) / m);
        }
        let id = grid_id(rec, "", st.activation_checkpointing)?;
        let worst = [a, b]
            .into_iter()
            .flatten()
            .map(|m| (model - m) / m)
            .fold(0.0f64, |x, e| if e.abs() > x.abs() { e } else { x });
        println!(
            "  {:<50} {:>9} {:>9} {:>9.2} {:>9.2} {:>+7.1}%",
            id,
            gib_or_dash(a),
            gib_or_dash(b),
            r / GIB as f64,
            model / GIB as f64,
            100.0 * worst
        );
    }
    println!(
        "  {}",
        summary("the replay against both cards' measurements", &replay_err)
    );
    println!(
        "  {}",
        summary("the memory model against the same", &model_err)
    );
    Ok(())
}

/// When cuBLAS's workspaces are made: the synthetic grid replayed with
/// them made at each handle's first matmul inside the first step
/// (`synthetic/replayed_workspaces.csv`, `scripts/replay_grid.py
/// --workspaces-mib 32`), as a fresh job makes them, against the replay
/// with them made before (`synthetic/replayed.csv`, as the H200 rows of
/// `h200/grid.csv` after each process's first point were measured). Two
/// 32 MiB blocks early in the step move some rows' reserved peak by
/// gigabytes (bench/data/h200/README.md); this prints how often and how
/// far, and the memory model against the fresh-job replay. Not scored.
fn workspaces_report(syn: &Synthetic) -> Result<(), String> {
    let key = |r: &HashMap<String, String>| -> Result<(String, usize), String> {
        Ok((field(r, "file")?.to_string(), num(r, "line")?))
    };
    let mut before: HashMap<(String, usize), f64> = HashMap::new();
    for rec in &syn.replayed {
        before.insert(key(rec)?, num(rec, "reserved_bytes")?);
    }
    let measured = Synthetic::rows(&syn.measured, GRID)?;
    let grid = Synthetic::rows(&syn.grids, GRID)?;
    let (mut moved, mut model_err, mut far) = (Vec::new(), Vec::new(), Vec::new());
    // the in-step measurement against the in-step replay, and against the
    // measurement with the workspaces made before
    let (mut replay_err, mut measured_moved) = (Vec::new(), Vec::new());
    println!("\nwhen cuBLAS's workspaces are made, GiB (rep.step: replayed with them made in the first step, as a fresh job, synthetic/replayed_workspaces.csv; rep.bef: before it, synthetic/replayed.csv; meas.bef / meas.step: measured on the H200 each way, h200/grid.csv / h200/grid_instep.csv; error: the model against rep.step):");
    println!(
        "  {:<50} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8}",
        "configuration (moved by more than 3 %)",
        "rep.bef",
        "rep.step",
        "meas.bef",
        "meas.step",
        "model",
        "error"
    );
    for rec in &syn.workspaces {
        let (file, line) = key(rec)?;
        if file != GRID {
            continue;
        }
        let r = line
            .checked_sub(2)
            .and_then(|i| grid.get(i))
            .ok_or_else(|| format!("{file}:{line}: no such row"))?;
        let fresh: f64 = num(rec, "reserved_bytes")?;
        let Some(&old) = before.get(&(file.clone(), line)) else {
            return Err(format!("{file}:{line}: not in synthetic/replayed.csv"));
        };
        let (w, st, o) = scenario(r).map_err(|e| format!("{file}:{line}: {e}"))?;
        let est = estimate_with(&w, &st, &o).map_err(|e| format!("{file}:{line}: {e}"))?;
        let predicted = est.peak_reserved_bytes as f64;
        let d = (fresh - old) / old;
        moved.push(d);
        let e = (predicted - fresh) / fresh;
        model_err.push(e);
        let id = grid_id(r, "", st.activation_checkpointing)?;
        if e.abs() > 0.10 {
            far.push(format!("{id} {:+.1}%", 100.0 * e));
        }
        let before_m = ok_reserved(measured.get(line - 2));
        let instep_m = ok_reserved(syn.instep.get(line - 2));
        if let Some(m) = syn.instep.get(line - 2) {
            same_configuration(m, r).map_err(|e| format!("h200/grid_instep.csv:{line}: {e}"))?;
        }
        if let Some(m) = instep_m {
            replay_err.push((fresh - m) / m);
            if let Some(b) = before_m {
                measured_moved.push((m - b) / b);
            }
        }
        let moved_far = |a: Option<f64>, b: Option<f64>| matches!((a, b), (Some(a), Some(b)) if ((a - b) / b).abs() > 0.03);
        if d.abs() > 0.03 || moved_far(instep_m, before_m) {
            println!(
                "  {:<50} {:>9.2} {:>9.2} {:>9} {:>9} {:>9.2} {:>+7.1}%",
                id,
                old / GIB as f64,
                fresh / GIB as f64,
                gib_or_dash(before_m),
                gib_or_dash(instep_m),
                predicted / GIB as f64,
                100.0 * e
            );
        }
    }
    println!(
        "  {}",
        signed_summary("reserved, in step against before (replay)", &moved)
    );
    println!(
        "  {}",
        summary("the memory model against the in-step replay", &model_err)
    );
    println!(
        "  model off the in-step replay by more than 10 %: {}",
        or_none(&far)
    );
    println!(
        "  {}",
        signed_summary("measured, in step against before (H200)", &measured_moved)
    );
    println!(
        "  {}",
        summary("the in-step replay against its measurement", &replay_err)
    );
    Ok(())
}

/// The measured row at CSV line `line` of `rows`, checked to be the
/// configuration of `rec`.
fn measured_at<'a>(
    rows: &'a [HashMap<String, String>],
    line: usize,
    rec: &HashMap<String, String>,
) -> Result<&'a HashMap<String, String>, String> {
    let m = line
        .checked_sub(2)
        .and_then(|i| rows.get(i))
        .ok_or_else(|| format!("line {line}: no measured row"))?;
    same_configuration(m, rec).map_err(|e| format!("line {line}: {e}"))?;
    Ok(m)
}

/// Bytes as GiB with two decimals, or `-` where there is no figure.
fn gib_or_dash(b: Option<f64>) -> String {
    b.map(|b| format!("{:.2}", b / GIB as f64))
        .unwrap_or_else(|| "-".into())
}

/// A measured row's peak reserved bytes, where it ran (`status=ok`).
fn ok_reserved(m: Option<&HashMap<String, String>>) -> Option<f64> {
    m.filter(|m| m.get("status").map(String::as_str) == Some("ok"))
        .and_then(|m| m.get("reserved_bytes"))
        .and_then(|v| v.parse::<f64>().ok())
}

/// Whether measured row `m` is the configuration of grid row `r` (or the
/// files have drifted apart).
fn same_configuration(
    m: &HashMap<String, String>,
    r: &HashMap<String, String>,
) -> Result<(), String> {
    for k in [
        "model",
        "method",
        "dtype",
        "micro_batch",
        "seq_len",
        "checkpointing",
    ] {
        if field(m, k)? != field(r, k)? {
            return Err(format!("`{k}` differs from the grid row"));
        }
    }
    Ok(())
}

/// The items joined with ", ", or "none".
fn or_none(items: &[String]) -> String {
    if items.is_empty() {
        "none".to_string()
    } else {
        items.join(", ")
    }
}

/// A grid row's short name in the bench's tables:
/// `[es:]model:method:dtype:mM:sS[:ckpt]`.
fn grid_id(r: &HashMap<String, String>, prefix: &str, ckpt: bool) -> Result<String, String> {
    Ok(format!(
        "{prefix}{}:{}:{}:m{}:s{}{}",
        field(r, "model")?.rsplit('/').next().unwrap_or(""),
        field(r, "method")?,
        field(r, "dtype")?,
        field(r, "micro_batch")?,
        field(r, "seq_len")?,
        if ckpt { ":ckpt" } else { "" }
    ))
}

/// `items` joined with ", " between `before` and `after`, or nothing when
/// there are none (the exceptions a summary line lists).
fn listed<S: AsRef<str>>(before: &str, after: &str, items: &[S]) -> String {
    if items.is_empty() {
        return String::new();
    }
    let joined: Vec<&str> = items.iter().map(AsRef::as_ref).collect();
    format!("{before}{}{after}", joined.join(", "))
}

/// The 99th percentile, over the rows a model under-predicts, of the
/// share the estimate must be raised by to reach the measurement (0 when
/// it under-predicts none). An error `e` is `(predicted − measured) /
/// measured`, so the raise is `−e / (1 + e)`: a row 10.3 % under needs
/// the estimate raised by 11.5 %, not 10.3 %, and the raise is what the
/// advisor's margin does (`first_run_plan`: the estimate × (1 + margin)).
fn p99_under(errors: &[f64]) -> f64 {
    let mut unders: Vec<f64> = errors
        .iter()
        .filter(|e| **e < 0.0 && **e > -1.0)
        .map(|e| -e / (1.0 + e))
        .collect();
    if unders.is_empty() {
        return 0.0;
    }
    unders.sort_by(|a, b| a.total_cmp(b));
    unders[((unders.len() as f64 * 0.99).ceil() as usize).min(unders.len()) - 1]
}

/// The allocator replay (`scripts/alloc_sim.py` through
/// `scripts/replay_grid.py`: the step's real allocation sequence, captured
/// on fake tensors, through a model of the caching allocator) beside the
/// measurements and the memory model: how much of the reserved-over-
/// allocated gap is the allocator's rules, and what the carried cache did.
fn replay_report(path: &Path, rows: &[Row]) -> Result<(), String> {
    let by_origin: HashMap<&str, &Row> = rows.iter().map(|r| (r.origin.as_str(), r)).collect();
    let context = H100_CONTEXT;
    println!("\nallocator replay (scripts/alloc_sim.py; bench/data/h100/replayed.csv):");
    println!(
        "  {:<52} {:>9} {:>9} {:>8} {:>9} {:>8}  began with",
        "row", "measured", "replayed", "error", "model", "error"
    );
    let (mut replay_err, mut model_err, mut replay_alloc) = (Vec::new(), Vec::new(), Vec::new());
    let mut cuda_only = Vec::new();
    // the same, split by allocator mode: (default, expandable segments)
    let (mut replay_default, mut replay_expandable) = (Vec::new(), Vec::new());
    let (mut model_default, mut model_expandable) = (Vec::new(), Vec::new());
    let (mut fresh_vs_model, mut fit_right, mut fit_n) = (Vec::new(), 0, 0);
    for rec in read_csv(path)? {
        let origin = format!("{}:{}", field(&rec, "file")?, field(&rec, "line")?);
        let Some(row) = by_origin.get(origin.as_str()) else {
            return Err(format!("{origin}: no such measured row"));
        };
        let replayed: f64 = num(&rec, "reserved_bytes")?;
        let least: f64 = num(&rec, "least_bytes")?;
        let carry = opt(&rec, "carry", "");
        let began = if carry.is_empty() { "empty" } else { carry };
        // a replay from an empty allocator of a point measured with a
        // carried cache: what a job on its own would hold
        let fresh = carry.is_empty() && row.carried.is_some();
        let gib = |b: f64| b / GIB as f64;
        let fits = least + context <= H100_CAPACITY;
        // the replays that repeat the measured conditions
        if !fresh {
            fit_n += 1;
            fit_right += usize::from(fits == row.measured.is_some());
        }
        let Some(measured) = row.measured else {
            println!(
                "  {:<52} {:>9} {:>9.2} {:>8} {:>9.2} {:>8}  {}",
                row.id,
                "OOM",
                gib(least),
                if fits { "fits" } else { "OOM" },
                gib(row.predicted),
                "",
                began
            );
            continue;
        };
        // beside the model
        if fresh {
            fresh_vs_model.push((row.predicted - replayed) / replayed);
            println!(
                "  {:<52} {:>9} {:>9.2} {:>8} {:>9.2} {:>+7.1}%  empty (measured after {})",
                row.id,
                "-",
                gib(replayed),
                "",
                gib(row.predicted),
                100.0 * (row.predicted - replayed) / replayed,
                row.carried.as_deref().unwrap_or("")
            );
            continue;
        }
        // above the card unpressed, but the allocator releases its cache
        // and retries before failing: on the card it holds between the
        // least it needs and the card (`least_bytes`), so only the verdict
        // is compared
        if replayed + context > H100_CAPACITY && fits {
            println!(
                "  {:<52} {:>9.2} {:>9} {:>8} {:>9.2} {:>+7.1}%  {} (unpressed {:.2}, runs in {:.2} GiB by releasing cache)",
                row.id,
                gib(measured),
                "released",
                "fits",
                gib(row.predicted),
                100.0 * (row.predicted - measured) / measured,
                began,
                gib(replayed),
                gib(least)
            );
            continue;
        }
        let e = (replayed - measured) / measured;
        let m = (row.predicted - measured) / measured;
        if let Some((a, _)) = row.allocated {
            let ra = num::<f64>(&rec, "allocated_bytes")?;
            replay_alloc.push((ra - a) / a);
            if a - ra > CUDA_ONLY_BYTES {
                cuda_only.push(format!("{} +{:.2} GiB", row.id, gib(a - ra)));
            }
        }
        replay_err.push(e);
        model_err.push(m);
        if origin.starts_with("h100/expandable/") {
            replay_expandable.push(e);
            model_expandable.push(m);
        } else {
            replay_default.push(e);
            model_default.push(m);
        }
        println!(
            "  {:<52} {:>9.2} {:>9.2} {:>+7.1}% {:>9.2} {:>+7.1}%  {}",
            row.id,
            gib(measured),
            gib(replayed),
            100.0 * e,
            gib(row.predicted),
            100.0 * m,
            began
        );
    }
    println!(
        "  {}",
        summary("replay against the measured reserved bytes", &replay_err)
    );
    println!(
        "  {}",
        summary("the memory model on the same rows", &model_err)
    );
    for (mode, replay, model) in [
        ("default allocator", &replay_default, &model_default),
        ("expandable segments", &replay_expandable, &model_expandable),
    ] {
        println!(
            "  {}",
            summary(&format!("  {mode}: replay, reserved"), replay)
        );
        println!("  {}", summary(&format!("  {mode}: memory model"), model));
    }
    println!(
        "  {}",
        summary("replay against the measured allocated bytes", &replay_alloc)
    );
    print_cuda_only(&cuda_only);
    println!(
        "  {}",
        summary(
            "the memory model against the replay of an empty allocator (carried rows)",
            &fresh_vs_model
        )
    );
    println!("  fit/no-fit by the replay (pressure releases included): {fit_right}/{fit_n} right");
    Ok(())
}

/// The memory model against the replay on configurations nobody measured
/// (`bench/data/synthetic/`: the HF step across the replayable families,
/// methods, dtypes, checkpointing and sequence lengths, both allocator
/// modes). The replay holds the measured rows' reserved bytes within a
/// median 0.4 %, so this is how the model fares where there is no GPU
/// figure: not scored, and not part of the targets. It fails (an error)
/// where the advisor's first-run plan is below the replayed device peak.
fn unmeasured_report(syn: &Synthetic) -> Result<(), String> {
    let context = H100_CONTEXT;
    let verdict = |fits: bool| if fits { "fits" } else { "OOM" };
    println!("\nthe memory model against the replay of synthetic/ (bench/data/synthetic/replayed.csv, replayed before any was measured; bench/data/h200/ holds the measurements):");
    println!(
        "  {:<58} {:>9} {:>9} {:>8} {:>9} {:>9} {:>8}",
        "configuration", "alloc", "model", "error", "reserved", "model", "error"
    );
    let mut alloc_err = Vec::new();
    let (mut default_err, mut expandable_err) = (Vec::new(), Vec::new());
    let (mut fit_right, mut fit_n, mut far) = (0, 0, Vec::new());
    let mut fit_disagree = Vec::new();
    // the advisor's first-run plan against the replayed device peak
    let (mut covered, mut plan_n, mut uncovered) = (0, 0, Vec::new());
    for rec in &syn.replayed {
        let file = field(rec, "file")?.to_string();
        let line: usize = num(rec, "line")?;
        let grid = Synthetic::rows(&syn.grids, &file)?;
        let r = line
            .checked_sub(2)
            .and_then(|i| grid.get(i))
            .ok_or_else(|| format!("{file}:{line}: no such row"))?;
        let expandable = file.contains("/expandable/");
        let (w, s, mut o) = scenario(r).map_err(|e| format!("{file}:{line}: {e}"))?;
        o.expandable_segments = expandable;
        let est = estimate_with(&w, &s, &o).map_err(|e| format!("{file}:{line}: {e}"))?;
        let id = grid_id(
            r,
            if expandable { "es:" } else { "" },
            s.activation_checkpointing,
        )?;
        let (alloc, reserved, least): (f64, f64, f64) = (
            num(rec, "allocated_bytes")?,
            num(rec, "reserved_bytes")?,
            num(rec, "least_bytes")?,
        );
        let gib = |b: f64| b / GIB as f64;
        let replay_fits = least + context <= H100_CAPACITY;
        let model_fits = est.min_device_bytes as f64 <= H100_CAPACITY;
        fit_n += 1;
        if replay_fits == model_fits {
            fit_right += 1;
        } else {
            fit_disagree.push(format!(
                "{id} (replay {}, model {})",
                verdict(replay_fits),
                verdict(model_fits)
            ));
        }
        let a = (est.peak_allocated_bytes as f64 - alloc) / alloc;
        alloc_err.push(a);
        if replay_fits {
            // the model's context beside the replayed allocator bytes
            let device = reserved.min(H100_CAPACITY - context)
                + (est.device_bytes - est.peak_reserved_bytes) as f64;
            plan_n += 1;
            if first_run_plan(&est, w.framework) >= device {
                covered += 1;
            } else {
                uncovered.push(id.clone());
            }
        }
        // above the card unpressed: only the verdict compares
        if reserved + context > H100_CAPACITY {
            println!(
                "  {:<58} {:>9.2} {:>9.2} {:>+7.1}% {:>9} {:>9} {:>8}",
                id,
                gib(alloc),
                gib(est.peak_allocated_bytes as f64),
                100.0 * a,
                verdict(replay_fits),
                verdict(model_fits),
                ""
            );
            continue;
        }
        let e = (est.peak_reserved_bytes as f64 - reserved) / reserved;
        if expandable {
            expandable_err.push(e);
        } else {
            default_err.push(e);
        }
        if e.abs() > 0.10 {
            far.push(format!("{id} {:+.1}%", 100.0 * e));
        }
        println!(
            "  {:<58} {:>9.2} {:>9.2} {:>+7.1}% {:>9.2} {:>9.2} {:>+7.1}%",
            id,
            gib(alloc),
            gib(est.peak_allocated_bytes as f64),
            100.0 * a,
            gib(reserved),
            gib(est.peak_reserved_bytes as f64),
            100.0 * e
        );
    }
    println!("  {}", summary("allocated bytes", &alloc_err));
    println!(
        "  {}",
        summary("reserved bytes, default allocator", &default_err)
    );
    println!(
        "  {}",
        summary("reserved bytes, expandable segments", &expandable_err)
    );
    // " (not: a, b)" after a count, or nothing
    let except = |v: &[String]| listed(" (not: ", ")", v);
    println!(
        "  fit/no-fit on the H100, model against replay: {fit_right}/{fit_n} agree{}",
        except(&fit_disagree)
    );
    println!(
        "  first-run plan covers the replayed device peak: {covered}/{plan_n}{}",
        except(&uncovered)
    );
    println!("  reserved off by more than 10 %: {}", or_none(&far));
    // The advisor's first run must hold what the replay says a step needs,
    // measured or not: a model change that breaks this fails the bench.
    if !uncovered.is_empty() {
        return Err(format!(
            "the first-run plan is below the replayed device peak of {}",
            uncovered.join(", ")
        ));
    }
    Ok(())
}

/// Count, median signed error and its extremes (which way a group leans).
fn signed_summary(name: &str, errors: &[f64]) -> String {
    if errors.is_empty() {
        return format!("{name:<55} n=  0");
    }
    let mut v = errors.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let abs = median_worst(errors).0;
    let median_signed = median_of_sorted(&v);
    format!(
        "{name:<55} n={:>3}  median {:>+5.1}%  median |error| {:>4.1}%  range {:>+6.1}% .. {:>+5.1}%  under >10%: {}",
        v.len(),
        100.0 * median_signed,
        100.0 * abs,
        100.0 * v[0],
        100.0 * v[v.len() - 1],
        v.iter().filter(|e| **e < -MAX_UNDER).count()
    )
}

fn median_worst(errors: &[f64]) -> (f64, f64) {
    let mut a: Vec<f64> = errors.iter().map(|e| e.abs()).collect();
    if a.is_empty() {
        return (0.0, 0.0);
    }
    a.sort_by(|x, y| x.total_cmp(y));
    (median_of_sorted(&a), a[a.len() - 1])
}

/// The median of a sorted, non-empty slice (the mean of the middle two
/// for an even count).
fn median_of_sorted(v: &[f64]) -> f64 {
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn summary(name: &str, errors: &[f64]) -> String {
    let (m, w) = median_worst(errors);
    let under = errors.iter().copied().fold(0.0f64, f64::min);
    format!(
        "{:<34} n={:>3}  median {:>5.1}%  worst {:>5.1}%  deepest under {:>+6.1}%",
        name,
        errors.len(),
        100.0 * m,
        100.0 * w,
        100.0 * under
    )
}

/// A tiny CSV reader for our own files: a header, comma-separated fields,
/// no quoting (lists inside a field use `;`).
fn read_csv(path: &Path) -> Result<Vec<HashMap<String, String>>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let header: Vec<String> = lines
        .next()
        .ok_or_else(|| format!("{} is empty", path.display()))?
        .split(',')
        .map(|s| s.trim().to_string())
        .collect();
    let mut out = Vec::new();
    for (n, line) in lines.enumerate() {
        let fields: Vec<&str> = line.split(',').collect();
        if fields.len() != header.len() {
            return Err(format!(
                "line {}: {} fields, header has {}",
                n + 2,
                fields.len(),
                header.len()
            ));
        }
        out.push(
            header
                .iter()
                .cloned()
                .zip(fields.iter().map(|f| f.trim().to_string()))
                .collect(),
        );
    }
    Ok(out)
}

fn field<'a>(r: &'a HashMap<String, String>, k: &str) -> Result<&'a str, String> {
    r.get(k)
        .map(String::as_str)
        .ok_or_else(|| format!("missing column `{k}`"))
}

/// A column that some files lack: `default` when absent or empty.
fn opt<'a>(r: &'a HashMap<String, String>, k: &str, default: &'a str) -> &'a str {
    match r.get(k).map(String::as_str) {
        Some("") | None => default,
        Some(v) => v,
    }
}

fn num<T: std::str::FromStr>(r: &HashMap<String, String>, k: &str) -> Result<T, String> {
    let v = field(r, k)?;
    v.parse()
        .map_err(|_| format!("column `{k}`: cannot parse `{v}`"))
}

/// A catalog model, or the config.json under bench/data/configs/.
/// Builds the workload, settings and options a row describes. Columns a
/// file lacks take the H100 README's defaults (HF loop, LoRA r=16 on q,v,
/// AdamW foreach, one GPU).
fn scenario(
    r: &HashMap<String, String>,
) -> Result<(Workload, EngineeringSettings, ModelOptions), String> {
    let arch = model_config::model(field(r, "model")?)?;
    let method: Method = field(r, "method")?.parse()?;
    let framework = parse_framework(opt(r, "framework", "hf")).map_err(|e| e.to_string())?;
    let lora = if method == Method::Full {
        None
    } else {
        let targets = match opt(r, "lora_targets", "q;v") {
            "all-linear" => "q,k,v,o,gate,up,down".to_string(),
            t => t.replace(';', ","),
        };
        Some(LoraConfig {
            rank: opt(r, "lora_rank", "16")
                .parse()
                .map_err(|_| "bad lora_rank".to_string())?,
            targets: parse_lora_targets(&targets).map_err(|e| e.to_string())?,
        })
    };
    let w = Workload {
        model: arch,
        method,
        lora,
        seq_len: num(r, "seq_len")?,
        optimizer: parse_optimizer(opt(r, "optimizer", "adamw")).map_err(|e| e.to_string())?,
        global_batch: None,
        gpus: opt(r, "gpus", "1")
            .parse()
            .map_err(|_| "bad gpus".to_string())?,
        sharding: Sharding::None,
        framework,
        attention: if opt(r, "attention", "sdpa") == "eager" {
            Attention::Eager
        } else {
            Attention::Sdpa
        },
    };
    let dtype: Dtype = field(r, "dtype")?.parse()?;
    let s = EngineeringSettings {
        micro_batch_size: num(r, "micro_batch")?,
        gradient_accumulation_steps: opt(r, "grad_accum", "1")
            .parse()
            .map_err(|_| "bad grad_accum".to_string())?,
        dtype,
        activation_checkpointing: opt(r, "checkpointing", "off") == "on",
        compile: matches!(opt(r, "compile", "false"), "True" | "true" | "on"),
        activation_offloading: opt(r, "offloading", "off") == "on",
        ..Default::default()
    };
    let o = options_of(r)?;
    Ok((w, s, o))
}

/// The flags of `gpufit estimate` that state a row's model options, parsed
/// by the CLI's own parser ([`ModelOptionArgs`]): the bench scores each row
/// through the path a user takes, with nothing a user cannot state.
#[derive(clap::Parser)]
struct OptionFlags {
    #[command(flatten)]
    options: ModelOptionArgs,
}

/// The command-line flags a row's columns stand for (`base_quant`, `head`,
/// `optimizer_impl`, `optimizer_in_backward`, `chunked_loss`, `grads_kept`, the `bitsandbytes` and `torch` releases,
/// `longest_first`, `expandable_segments`, the measured CUDA context), and the options the
/// CLI makes of them.
fn option_flags(r: &HashMap<String, String>) -> Result<Vec<String>, String> {
    let mut flags = vec!["estimate".to_string()];
    let mut flag = |name: &str, value: Option<&str>| {
        flags.push(format!("--{name}"));
        if let Some(v) = value {
            flags.push(v.to_string());
        }
    };
    match opt(r, "base_quant", "none") {
        "none" => {}
        q => flag("base-quant", Some(q)),
    }
    if opt(r, "head", "lm") != "lm" {
        flag("head", Some(opt(r, "head", "lm")));
    }
    if let v @ ("foreach" | "fused" | "per-parameter") = opt(r, "optimizer_impl", "") {
        flag("optimizer-impl", Some(v));
    } else if !opt(r, "optimizer_impl", "").is_empty() {
        return Err(format!(
            "unknown optimizer_impl `{}`",
            opt(r, "optimizer_impl", "")
        ));
    }
    match opt(r, "chunked_loss", "") {
        "" => {}
        v @ ("on" | "off") => flag("chunked-loss", Some(v)),
        v => return Err(format!("unknown chunked_loss `{v}`")),
    }
    match opt(r, "optimizer_in_backward", "") {
        "" => {}
        v @ ("on" | "off") => flag("optimizer-in-backward", Some(v)),
        v => return Err(format!("unknown optimizer_in_backward `{v}`")),
    }
    if opt(r, "grads_kept", "false") == "true" {
        flag("grads-kept", None);
    }
    if version_before(opt(r, "bitsandbytes", ""), (0, 43, 2))? {
        flag("old-bitsandbytes", None);
    }
    if opt(r, "longest_first", "false") == "true" {
        flag("longest-first", None);
    }
    if version_before(opt(r, "torch", ""), (1, 11, 0))? {
        flag("old-torch", None);
    }
    if opt(r, "expandable_segments", "false") == "true" {
        flag("expandable-segments", None);
    }
    // The H100 files give the context in bytes as measured (`context_bytes`).
    let ctx_bytes = opt(r, "context_bytes", "");
    let ctx = if ctx_bytes.is_empty() {
        opt(r, "cuda_context_mib", "").to_string()
    } else {
        (ctx_bytes
            .parse::<u64>()
            .map_err(|_| format!("bad context_bytes `{ctx_bytes}`"))?
            / MIB)
            .to_string()
    };
    if !ctx.is_empty() {
        flag("cuda-context-mib", Some(&ctx));
    }
    Ok(flags)
}

fn options_of(r: &HashMap<String, String>) -> Result<ModelOptions, String> {
    let flags = option_flags(r)?;
    let parsed = <OptionFlags as clap::Parser>::try_parse_from(&flags)
        .map_err(|e| format!("{}: {e}", flags.join(" ")))?;
    parsed.options.options(None).map_err(|e| e.to_string())
}

/// Whether a row's release of a library (its `bitsandbytes` or `torch`
/// column) predates `first`: bitsandbytes 0.43.2 (#1270) stopped
/// `MatMul4Bit` from keeping its input, PyTorch 1.11 stopped softmax from
/// keeping its input. Empty: none, or current.
fn version_before(v: &str, first: (u32, u32, u32)) -> Result<bool, String> {
    if v.is_empty() {
        return Ok(false);
    }
    // a local build tag (`2.11.0+cu130`) does not change the release
    let release = v.split('+').next().unwrap_or(v);
    let mut parts = release
        .split('.')
        .map(|p| p.parse::<u32>().map_err(|_| format!("bad version `{v}`")));
    let mut next = || parts.next().unwrap_or(Ok(0));
    let version = (next()?, next()?, next()?);
    Ok(version < first)
}

fn quantity_of(e: &Estimate, q: &str) -> Result<f64, String> {
    Ok(match q {
        "allocated" => e.peak_allocated_bytes,
        "reserved" => e.peak_reserved_bytes,
        "device" => e.device_bytes,
        other => return Err(format!("unknown quantity `{other}`")),
    } as f64)
}

fn unit_bytes(u: &str) -> Result<f64, String> {
    Ok(match u {
        "GB" => GB as f64,
        "GiB" => GIB as f64,
        "MiB" => MIB as f64,
        "MB" => 1e6,
        "B" => 1.0,
        other => return Err(format!("unknown unit `{other}`")),
    })
}

fn read_published(path: &Path, _: &str) -> Result<Vec<Row>, String> {
    let mut out = Vec::new();
    for r in read_csv(path)? {
        let id = field(&r, "id")?.to_string();
        let (w, s, o) = scenario(&r).map_err(|e| format!("row {id}: {e}"))?;
        let est = estimate_with(&w, &s, &o).map_err(|e| format!("row {id}: {e}"))?;
        let q = field(&r, "quantity")?.to_string();
        // "litgpt tutorials/resource-tables.md (LoRA on 1 GPU)" → "litgpt tutorials/resource-tables.md"
        let source = field(&r, "source")?;
        let source = source.split(" (").next().unwrap_or(source).to_string();
        out.push(Row {
            source,
            framework: field(&r, "framework")?.to_string(),
            predicted: quantity_of(&est, &q)?,
            predicted_min_device: est.min_device_bytes as f64,
            first_plan: first_run_plan(&est, w.framework),
            measured_device: None,
            measured: Some(num::<f64>(&r, "peak")? * unit_bytes(field(&r, "unit")?)?),
            quantity: q,
            card: None,
            expandable: false,
            carried: None,
            carry_known: false,
            origin: String::new(),
            include: field(&r, "include")? == "yes",
            note: field(&r, "note")?.to_string(),
            key: String::new(),
            allocated: None,
            tokens: None,
            id,
        });
    }
    Ok(out)
}

/// What the allocator held when an H100 point began, when that was not an
/// empty cache or this model's own weights: `None` otherwise.
///
/// Files with a `reserved_at_start` column say it. Older files written by
/// `scripts/gpu_measure.py` (those with its per-phase `fwd_peak` column)
/// called `empty_cache()` while the point's model was still referenced, so
/// the previous point's weights (their parameter dtype, as stored) stayed
/// cached into the next point: harmless when the next point builds the same
/// model in the same dtype (its tensors take the same blocks back), not
/// otherwise. The shared harness's files (peaks, throughput,
/// compile_accum) do not say how their points were separated and are
/// scored as they are.
fn carried_cache(
    r: &HashMap<String, String>,
    prev: Option<&HashMap<String, String>>,
) -> Result<Option<String>, String> {
    if r.get("reserved_at_start").is_some_and(|v| !v.is_empty()) {
        // The harness freed the previous point's tensors and emptied the
        // cache before this one: what is left is no model's weights but
        // segments a live block pins (see `pinned_at_start`).
        return Ok(None);
    }
    let Some(p) = prev.filter(|_| r.contains_key("fwd_peak")) else {
        return Ok(None);
    };
    // the parameters as the point stored them: bf16 for `bf16`, fp32 for
    // autocast, fp32 and the Trainer (fp32-loaded)
    let stored = |x: &HashMap<String, String>| {
        let bf16 = opt(x, "dtype", "") == "bf16" && opt(x, "loop", "manual") != "trainer";
        (
            opt(x, "model", "").to_string(),
            if bf16 { "bf16" } else { "fp32" },
            opt(x, "head", "lm").to_string(),
        )
    };
    let prev = stored(p);
    if prev == stored(r) || prev.0.is_empty() {
        return Ok(None);
    }
    let (model, dtype, _) = prev;
    // the previous point's weights as gpufit counts them (a point that
    // failed before building its model left less: a bound)
    let weights = scenario(p)
        .and_then(|(w, s, o)| estimate_with(&w, &s, &o).map_err(|e| e.to_string()))
        .map(|e| e.breakdown.weights as f64 / GIB as f64)
        .map_err(|e| format!("previous point {model}: {e}"))?;
    let name = model.rsplit('/').next().unwrap_or(&model);
    Ok(Some(format!(
        "{name}'s {dtype} weights (~{weights:.1} GiB)"
    )))
}

/// What the allocator still held when a point of a harness that frees
/// each point began (`reserved_at_start`), when more than a few pages:
/// segments `empty_cache` could not return because a live block sits in
/// them. In bench/data/h200/ it is the first point's segment holding the
/// cuBLAS workspaces (the 64 MiB every row allocates beyond the replay),
/// 1.42 GiB of which the next points reuse the free part: their replays
/// from an empty allocator match them as closely as the first point's.
/// Scored; printed beside the row. Those points began with the workspaces
/// already made, which a fresh job does not: `workspaces_report` prints
/// how much that moves the grid's reserved peaks.
fn pinned_at_start(r: &HashMap<String, String>) -> Result<Option<String>, String> {
    let Some(v) = r.get("reserved_at_start").filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    let b: f64 = v
        .parse()
        .map_err(|_| format!("bad reserved_at_start `{v}`"))?;
    // a few pages (the batch, the RNG state) are nothing to say
    Ok((b > 64.0 * MIB as f64).then(|| format!("{:.2} GiB", b / GIB as f64)))
}

/// The files measured by a training step on a GPU (bench/data/h100/ and
/// bench/data/h200/, each README): reserved bytes are scored,
/// `status=oom` rows only checked for fit/no-fit; rows with other statuses
/// (a point that could not run) are left out.
fn read_gpu(path: &Path, source: &str) -> Result<Vec<Row>, String> {
    let mut out = Vec::new();
    let stem = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("h100")
        .to_string();
    let expandable = path.components().any(|c| c.as_os_str() == "expandable");
    let records = read_csv(path)?;
    for (n, mut r) in records.iter().cloned().enumerate() {
        if expandable {
            r.insert("expandable_segments".into(), "true".into());
        }
        let status = field(&r, "status")?;
        if status != "ok" && status != "oom" {
            continue;
        }
        let card = match opt(&r, "gpu", "") {
            g if g.contains("H200") => Card::H200,
            "" => Card::H100,
            g if g.contains("H100") => Card::H100,
            g => return Err(format!("row {}: unknown gpu `{g}`", n + 2)),
        };
        let carried = carried_cache(&r, n.checked_sub(1).and_then(|p| records.get(p)))?;
        let pinned = pinned_at_start(&r)?;
        let varlen = matches!(opt(&r, "varlen", "False"), "True" | "true");
        // every field that changes memory, with the files' defaults for
        // the columns older files lack
        let key = [
            ("model", ""),
            ("framework", "hf"),
            ("method", ""),
            ("lora_rank", "16"),
            ("lora_targets", "q;v"),
            ("dtype", ""),
            ("optimizer", "adamw"),
            ("micro_batch", ""),
            ("seq_len", ""),
            ("checkpointing", "off"),
            ("attention", "sdpa"),
            ("head", "lm"),
            ("compile", "False"),
            ("loop", "manual"),
            ("grad_accum", "1"),
        ]
        .iter()
        .map(|(k, d)| match opt(&r, k, d) {
            "" => d.to_string(),
            v => v.to_string(),
        })
        .collect::<Vec<_>>()
        .join("|")
            + if expandable { "|es" } else { "" };
        let id = format!(
            "{stem}:{}:{}:{}:m{}:s{}{}{}{}",
            field(&r, "model")?.rsplit('/').next().unwrap_or(""),
            field(&r, "method")?,
            field(&r, "dtype")?,
            field(&r, "micro_batch")?,
            field(&r, "seq_len")?,
            if opt(&r, "checkpointing", "off") == "on" {
                ":ckpt"
            } else {
                ""
            },
            if opt(&r, "attention", "sdpa") == "eager" {
                ":eager"
            } else {
                ""
            },
            match (opt(&r, "compile", "false"), opt(&r, "loop", "manual")) {
                ("True" | "true", _) => ":compile".to_string(),
                (_, "trainer") => ":trainer".to_string(),
                _ => match opt(&r, "grad_accum", "1") {
                    "1" => String::new(),
                    a => format!(":a{a}"),
                },
            }
        );
        let id = format!(
            "{}{}{id}#{}",
            if card == Card::H200 { "h200:" } else { "" },
            if expandable { "es:" } else { "" },
            n + 2
        );
        let (w, s, o) = scenario(&r).map_err(|e| format!("row {id}: {e}"))?;
        let est = estimate_with(&w, &s, &o).map_err(|e| format!("row {id}: {e}"))?;
        if let Ok(dump) = std::env::var("GPUFIT_ACCURACY_DUMP") {
            // one line of model terms per H100 row, for fitting by hand
            let t = phase_terms(&w, &s, &o);
            let line = format!(
                "{id},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
                status,
                opt(&r, "allocated_bytes", "0"),
                opt(&r, "reserved_bytes", "0"),
                t.persistent,
                t.grads,
                t.grads_in_a,
                t.weights_transient_a,
                t.activations,
                t.logits,
                t.step_transient,
                s.activation_checkpointing,
                est.peak_allocated_bytes,
                t.recompute_overlap,
                t.largest_loss_tensor,
                t.largest_grad_block,
                t.opt_state,
                est.peak_reserved_bytes,
                expandable
            );
            use std::io::Write;
            if let Ok(mut f) = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&dump)
            {
                let _ = f.write_all(line.as_bytes());
            }
        }
        out.push(Row {
            source: source.to_string(),
            framework: opt(&r, "framework", "hf").to_string(),
            quantity: "reserved".into(),
            measured: if status == "ok" {
                Some(num::<f64>(&r, "reserved_bytes")?)
            } else {
                None
            },
            // On the card: a step that needs more than the card unpressed
            // but fits by releasing the cache holds at most the card (less
            // the context); the model says no more than that.
            predicted: if est.device_bytes as f64 > card.capacity()
                && est.min_device_bytes as f64 <= card.capacity()
            {
                card.capacity() - (est.device_bytes - est.peak_reserved_bytes) as f64
            } else {
                est.peak_reserved_bytes as f64
            },
            predicted_min_device: est.min_device_bytes as f64,
            first_plan: first_run_plan(&est, w.framework),
            // reserved + the context the row measured (or the model's)
            measured_device: if status == "ok" {
                Some(
                    num::<f64>(&r, "reserved_bytes")? + est.device_bytes as f64
                        - est.peak_reserved_bytes as f64,
                )
            } else {
                None
            },
            card: Some(card),
            expandable,
            carried: carried.clone(),
            carry_known: r.contains_key("reserved_at_start") || r.contains_key("fwd_peak"),
            origin: format!(
                "{}/{}{stem}.csv:{}",
                card.name().to_lowercase(),
                if expandable { "expandable/" } else { "" },
                n + 2
            ),
            // Variable-length batches (steps.csv): the reserved peak is the
            // cache climbing toward the card over 30 steps, not one step's
            // need; the advisor treats such peaks as "fits" (see
            // advisor::cache_filled_the_card), so they are not scored.
            include: !varlen,
            // the allocated peak beside it shows which part of an error is
            // the allocator's
            note: match status {
                "ok" => format!(
                    "allocated {:.2} → {:.2} GiB{}{}",
                    num::<f64>(&r, "allocated_bytes")? / GIB as f64,
                    est.peak_allocated_bytes as f64 / GIB as f64,
                    if varlen {
                        "; excluded: variable-length batches (cache growth, not a step's peak)"
                    } else {
                        ""
                    },
                    match (&carried, expandable) {
                        (Some(c), false) => format!(
                            "; reserved not scored: began with {c} cached (allocated scored)"
                        ),
                        (Some(c), true) => format!("; began with {c} cached"),
                        _ => match &pinned {
                            Some(p) => format!("; began with {p} pinned (scored)"),
                            None => String::new(),
                        },
                    }
                ),
                _ => String::new(),
            },
            key,
            allocated: if status == "ok" {
                Some((
                    num::<f64>(&r, "allocated_bytes")?,
                    est.peak_allocated_bytes as f64,
                ))
            } else {
                None
            },
            tokens: match (status, opt(&r, "tokens_per_sec", "")) {
                ("ok", t) if !varlen && !t.is_empty() => {
                    let gpu = lookup_gpu(card.gpu()).map_err(|e| e.to_string())?;
                    // The Trainer rows measured before scripts/gpu_measure.py
                    // timed steps 2..N (no `timed` column) divided the whole
                    // `train()` call, setup and first step included, by its
                    // steps: not a training step's throughput.
                    let untimed =
                        opt(&r, "loop", "manual") == "trainer" && opt(&r, "timed", "").is_empty();
                    Some((
                        num::<f64>(&r, "tokens_per_sec")?,
                        tokens_per_sec(&w, &gpu, &s),
                        if untimed {
                            TRAINER_SETUP_TIMED.to_string()
                        } else {
                            throughput_group(card, &w, &s)
                        },
                    ))
                }
                _ => None,
            },
            id,
        });
    }
    Ok(out)
}

/// The throughput report's group of steps whose measured tokens/s include
/// the Trainer's setup and first step: printed, not scored.
const TRAINER_SETUP_TIMED: &str = "Trainer: setup and first step timed too (not scored)";

/// The throughput report's groups: the card, then the model's factors
/// that change speed (`core::throughput`: attention kind, compile).
fn throughput_group(card: Card, w: &Workload, s: &EngineeringSettings) -> String {
    format!(
        "{} {}{}",
        card.name(),
        if attention_materializes_scores(w, s) {
            "scores kept (eager or math SDPA)"
        } else {
            "fused attention"
        },
        if s.compile { " compile" } else { "" }
    )
}

/// Predicted against measured training tokens/s of every measured step
/// with fixed-length batches (each configuration once per file; the same
/// configuration in several files counts in each, as above).
fn throughput_report(rows: &[Row]) {
    let mut groups: BTreeMap<&str, Vec<(f64, &str)>> = BTreeMap::new();
    for r in rows {
        if let Some((m, p, g)) = &r.tokens {
            if *m > 0.0 {
                groups
                    .entry(g.as_str())
                    .or_default()
                    .push(((p - m) / m, r.id.as_str()));
            }
        }
    }
    // Per-row figures for fitting or checking the model's constants.
    if let Ok(path) = std::env::var("GPUFIT_ACCURACY_SPEED_DUMP") {
        let mut text = String::from("id,group,measured,predicted\n");
        for r in rows {
            if let Some((m, p, g)) = &r.tokens {
                text.push_str(&format!("{},{g},{m:.1},{p:.1}\n", r.id));
            }
        }
        if let Err(e) = std::fs::write(&path, text) {
            eprintln!("cannot write {path}: {e}");
        }
    }
    println!("\ntokens/s, the throughput model (core::throughput) against the measured steps:");
    let mut all = Vec::new();
    for (g, v) in &mut groups {
        let errors: Vec<f64> = v.iter().map(|(e, _)| *e).collect();
        println!("  {}", signed_summary(g, &errors));
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        let ends = |it: &mut dyn Iterator<Item = &(f64, &str)>| -> String {
            it.take(3)
                .map(|(e, id)| format!("{id} {:+.0}%", 100.0 * e))
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!("    lowest: {}", ends(&mut v.iter()));
        println!("    highest: {}", ends(&mut v.iter().rev()));
        if *g != TRAINER_SETUP_TIMED {
            all.extend(errors);
        }
    }
    println!("  {}", signed_summary("all", &all));
}
