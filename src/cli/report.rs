//! `gpufit report`: what the fleet lost to OOMs, left unused, and how well
//! gpufit predicted, per GPU model and per model × method, over a window.
//! The history store streams narrow rows ([`HistoryStore::report_rows`]),
//! the core aggregates them ([`crate::core::report`]), this module prints a
//! table or JSON and writes the static HTML page ([`html`]).

pub mod html;

use crate::cli::common::TextRows;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use chrono::{DateTime, NaiveDate, Utc};
use comfy_table::{CellAlignment, Table};

use super::history::StoreArgs;
use super::{Global, OutputFormat};
use crate::core::report::{FleetReport, GroupStats, ReportBuilder};
use crate::history::HistoryStore;

#[derive(Debug, clap::Args)]
pub struct ReportArgs {
    #[command(flatten)]
    pub store: StoreArgs,
    /// Window: runs of the last `7d`, `24h`, `90m`, …, since a date
    /// (`2026-11-01`) or an RFC 3339 time, or `all`.
    #[arg(long, default_value = "7d")]
    pub since: String,
    /// Also write a self-contained HTML page with plots (SVG, no scripts) to this file.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
}

/// Parses `--since` against `now`: a duration back from now, a date
/// (midnight UTC), an RFC 3339 time, or `all` (None).
pub fn parse_since(s: &str, now: DateTime<Utc>) -> crate::Result<Option<DateTime<Utc>>> {
    let t = s.trim();
    if t.eq_ignore_ascii_case("all") {
        return Ok(None);
    }
    if let Ok(d) = humantime::parse_duration(t) {
        let d = chrono::Duration::from_std(d)
            .ok()
            .filter(|d| *d > chrono::Duration::zero());
        return match d.and_then(|d| now.checked_sub_signed(d)) {
            Some(since) => Ok(Some(since)),
            None => Err(crate::Error::Usage(format!(
                "--since {s}: the window must be longer than zero and reach no further back than year 1"
            ))),
        };
    }
    if let Ok(d) = NaiveDate::parse_from_str(t, "%Y-%m-%d") {
        if let Some(dt) = d.and_hms_opt(0, 0, 0) {
            return Ok(Some(dt.and_utc()));
        }
    }
    if let Ok(dt) = DateTime::parse_from_rfc3339(t) {
        return Ok(Some(dt.with_timezone(&Utc)));
    }
    Err(crate::Error::Usage(format!(
        "--since {s}: give a duration back from now (`7d`, `24h`, `30m`), a date (`2026-11-01`), an RFC 3339 time, or `all`"
    )))
}

/// Streams the store's rows through the core aggregation.
pub fn build_report(
    store: &dyn HistoryStore,
    since: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
) -> crate::Result<FleetReport> {
    let mut b = ReportBuilder::new(since, now);
    store.report_rows(b.since_us(), &mut |r| {
        b.add(r);
        Ok(())
    })?;
    Ok(b.finish())
}

/// Runs `gpufit report`.
pub fn run(g: &Global, args: ReportArgs) -> crate::Result<ExitCode> {
    let now = Utc::now();
    let since = parse_since(&args.since, now)?;
    let store = args.store.open()?;
    let t = Instant::now();
    let report = build_report(store.as_ref(), since, now)?;
    tracing::info!(
        rows = report.rows_scanned,
        seconds = t.elapsed().as_secs_f64(),
        "aggregated the history for the report"
    );
    if let Some(path) = &args.html {
        let page = html::render(&report, &store.url())?;
        std::fs::write(path, page).map_err(|e| crate::Error::Io {
            context: format!("cannot write the HTML report to {}", path.display()),
            source: e,
        })?;
        eprintln!("wrote {}", path.display());
    }
    match g.output {
        OutputFormat::Json => super::print_json(&report)?,
        OutputFormat::Table => print_tables(&report, &store.url()),
    }
    Ok(ExitCode::SUCCESS)
}

/// `0.123` → `12.3%`; None → `-`.
pub fn pct(x: Option<f64>) -> String {
    x.map_or_else(|| "-".into(), |v| format!("{:.1}%", v * 100.0))
}

/// A number of hours (GPU-hours, GiB-hours) with sensible precision.
pub fn hours(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if x < 10.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.0}")
    }
}

/// A one-line description of the window.
pub fn window(r: &FleetReport) -> String {
    match r.since {
        Some(s) => format!(
            "{} to {} UTC",
            s.format("%Y-%m-%d %H:%M"),
            r.until.format("%Y-%m-%d %H:%M")
        ),
        None => format!("all runs up to {} UTC", r.until.format("%Y-%m-%d %H:%M")),
    }
}

const FIGURES: [&str; 10] = [
    "runs",
    "confirmed",
    "OOM",
    "OOM GPU-h",
    "err p50",
    "err p90",
    "bias",
    "unused GiB-h",
    "unused",
    "tok/s vs best",
];

fn figures(g: &GroupStats) -> Vec<String> {
    vec![
        g.runs.to_string(),
        pct(Some(g.confirmed_share)),
        format!("{} ({})", g.oom_runs, pct(Some(g.oom_share))),
        hours(g.oom_gpu_hours),
        pct(g.prediction_error.median_abs),
        pct(g.prediction_error.p90_abs),
        g.prediction_error
            .bias
            .map_or_else(|| "-".into(), |b| format!("{:+.1}%", b * 100.0)),
        hours(g.unused_gib_hours),
        pct(g.unused_share),
        pct(g.throughput.mean_vs_best),
    ]
}

fn table(head: &[&str], rows: Vec<Vec<String>>, left: usize) -> Table {
    let mut t = Table::new();
    t.load_preset(comfy_table::presets::UTF8_BORDERS_ONLY);
    t.set_header(
        head.iter()
            .chain(FIGURES.iter())
            .copied()
            .collect::<Vec<_>>(),
    );
    for r in rows {
        t.add_text_row(r);
    }
    for k in left..left + FIGURES.len() {
        if let Some(c) = t.column_mut(k) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    t
}

fn print_tables(r: &FleetReport, url: &str) {
    println!("Fleet report for {url}: {}", window(r));
    if r.total.runs == 0 {
        println!("no runs in this window");
        return;
    }
    let mut rows: Vec<Vec<String>> = r
        .by_gpu
        .iter()
        .map(|g| {
            let mut v = vec![g.gpu_model.clone().unwrap_or_default()];
            v.extend(figures(g));
            v
        })
        .collect();
    let mut total = vec!["all GPUs".to_string()];
    total.extend(figures(&r.total));
    rows.push(total);
    println!("{}", table(&["GPU"], rows, 1));
    let rows = r
        .by_model
        .iter()
        .map(|g| {
            let mut v = vec![
                g.gpu_model.clone().unwrap_or_default(),
                g.model.clone().unwrap_or_default(),
                g.method.map(|m| m.to_string()).unwrap_or_default(),
            ];
            v.extend(figures(g));
            v
        })
        .collect();
    println!("{}", table(&["GPU", "model", "method"], rows, 3));
    let rows: Vec<Vec<String>> = r
        .by_path
        .iter()
        .map(|p| {
            vec![
                p.path.clone(),
                p.runs.to_string(),
                p.succeeded.to_string(),
                p.oom_runs.to_string(),
                p.other_failures.to_string(),
                hours(p.gpu_hours),
            ]
        })
        .collect();
    let mut paths = Table::new();
    paths.load_preset(comfy_table::presets::UTF8_BORDERS_ONLY);
    paths.set_header(["path", "runs", "ok", "OOM", "other", "GPU-h"]);
    for r in rows {
        paths.add_text_row(r);
    }
    println!("{paths}");
    let t = &r.total;
    println!(
        "err: |predicted − measured| / measured peak over {} run(s) with both; unused: (capacity − peak) × duration × GPUs of {} successful run(s){}; tok/s vs best: tokens/s per GPU against the best known run of the same GPU, model, method and sequence length ({} run(s))",
        t.prediction_error.runs,
        t.unused_runs_measured,
        if t.unused_runs_unmeasured > 0 {
            format!(
                " ({} more without a peak (or with a partial multi-node one), a duration or a catalog GPU)",
                t.unused_runs_unmeasured
            )
        } else {
            String::new()
        },
        t.throughput.runs
    );
    if t.oom_runs_without_duration > 0 {
        println!(
            "{} OOM run(s) have no duration and add nothing to the OOM GPU-hours",
            t.oom_runs_without_duration
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn now() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 22, 12, 0, 0)
            .single()
            .unwrap()
    }

    #[test]
    fn since_accepts_durations_dates_times_and_all() {
        let n = now();
        assert_eq!(
            parse_since("7d", n).unwrap(),
            Some(Utc.with_ymd_and_hms(2026, 11, 15, 12, 0, 0).unwrap())
        );
        assert_eq!(
            parse_since("24h", n).unwrap(),
            Some(Utc.with_ymd_and_hms(2026, 11, 21, 12, 0, 0).unwrap())
        );
        assert_eq!(
            parse_since("2026-11-01", n).unwrap(),
            Some(Utc.with_ymd_and_hms(2026, 11, 1, 0, 0, 0).unwrap())
        );
        assert_eq!(
            parse_since("2026-11-01T06:00:00+02:00", n).unwrap(),
            Some(Utc.with_ymd_and_hms(2026, 11, 1, 4, 0, 0).unwrap())
        );
        assert_eq!(parse_since("ALL", n).unwrap(), None);
    }

    #[test]
    fn a_bad_since_names_the_flag_and_the_accepted_forms() {
        for bad in ["yesterday", "0s", "", "-3d", "100000000y"] {
            let e = parse_since(bad, now()).unwrap_err().to_string();
            assert!(e.contains("--since"), "{bad}: {e}");
        }
    }

    #[test]
    fn numbers_are_formatted_for_people() {
        assert_eq!(pct(Some(0.1234)), "12.3%");
        assert_eq!(pct(None), "-");
        assert_eq!(hours(0.0), "0");
        assert_eq!(hours(1.234), "1.23");
        assert_eq!(hours(1234.4), "1234");
    }
}
