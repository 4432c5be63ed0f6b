//! The report as one static HTML page a platform team can mail around:
//! inline CSS, plots drawn as inline SVG by `plotters`, no scripts, nothing
//! loaded from the network. Every name from the history (GPU, model) is
//! escaped: they come from users.

use std::fmt::Write as _;

use plotters::prelude::*;

use super::{hours, pct, window};
use crate::core::report::{FleetReport, GroupStats};

/// At most this many bars per plot (most GPU-hours first).
const MAX_BARS: usize = 15;
const WIDTH: u32 = 540;

const BLUE: RGBColor = RGBColor(0x3b, 0x6e, 0xa8);
const RED: RGBColor = RGBColor(0xc2, 0x3b, 0x22);
const ORANGE: RGBColor = RGBColor(0xe0, 0x8a, 0x1e);
const GREEN: RGBColor = RGBColor(0x3a, 0x8a, 0x4f);

/// Escapes text for HTML element content and attribute values.
pub fn escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

fn draw_err(e: impl std::fmt::Display) -> crate::Error {
    crate::Error::Io {
        context: "cannot draw the report's plots".into(),
        source: std::io::Error::other(e.to_string()),
    }
}

/// Short enough for an axis label (long model ids keep their tail).
fn label(s: &str) -> String {
    let n = s.chars().count();
    if n <= 34 {
        s.to_string()
    } else {
        let tail: String = s.chars().skip(n - 33).collect();
        format!("…{tail}")
    }
}

/// Axis tick text: no decimals on large numbers (`35000`, not `35000.0`).
fn axis_number(x: f64) -> String {
    if x.abs() >= 100.0 || x == x.round() {
        format!("{x:.0}")
    } else {
        format!("{x:.1}")
    }
}

/// One bar series: a value per category.
struct Series {
    color: RGBColor,
    values: Vec<f64>,
}

/// Horizontal bars, one row per category (the first at the top), one bar
/// per series in each row. Rows are the unit intervals of an f64 axis, so
/// bars keep their proportions whatever the number of rows.
fn bars(title: &str, unit: &str, cats: &[String], series: &[Series]) -> crate::Result<String> {
    let n = cats.len();
    let per = series.len().max(1);
    let height = 80 + (n * (8 + 16 * per)) as u32;
    let max = series
        .iter()
        .flat_map(|s| s.values.iter().copied())
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max);
    let xmax = if max > 0.0 { max * 1.1 } else { 1.0 };
    let rows = n.max(1) as f64;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE).map_err(draw_err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 15))
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(190)
            .build_cartesian_2d(0f64..xmax, 0f64..rows)
            .map_err(draw_err)?;
        let names = cats.to_vec();
        chart
            .configure_mesh()
            .disable_y_mesh()
            // 2n + 1 key points: a step of 0.5, so every row centre gets one.
            .y_labels(2 * n + 1)
            .y_label_formatter(&move |y| {
                let row = y.floor();
                if (y - row - 0.5).abs() > 1e-6 || row < 0.0 {
                    return String::new();
                }
                let i = n as i64 - 1 - row as i64;
                usize::try_from(i)
                    .ok()
                    .and_then(|i| names.get(i))
                    .map(|s| label(s))
                    .unwrap_or_default()
            })
            .x_label_formatter(&|x| axis_number(*x))
            .x_desc(unit)
            .label_style(("sans-serif", 11))
            .draw()
            .map_err(draw_err)?;
        // Each row: 10 % gap, then one band per series, first on top.
        let band = 0.8 / per as f64;
        for (k, s) in series.iter().enumerate() {
            chart
                .draw_series(s.values.iter().enumerate().map(|(i, v)| {
                    let v = if v.is_finite() { v.max(0.0) } else { 0.0 };
                    let row = (n - 1 - i) as f64;
                    let top = row + 0.9 - k as f64 * band;
                    Rectangle::new([(0.0, top - band * 0.9), (v, top)], s.color.filled())
                }))
                .map_err(draw_err)?;
        }
        root.present().map_err(draw_err)?;
    }
    Ok(svg)
}

/// Runs and OOM runs per UTC day.
fn daily(r: &FleetReport) -> crate::Result<String> {
    let days = &r.daily;
    let n = days.len();
    let ymax = days.iter().map(|d| d.runs).max().unwrap_or(0).max(1) as f64 * 1.1;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH * 2 + 20, 300)).into_drawing_area();
        root.fill(&WHITE).map_err(draw_err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption("Runs and OOM runs per day (UTC)", ("sans-serif", 16))
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0f64..ymax)
            .map_err(draw_err)?;
        let labels: Vec<String> = days
            .iter()
            .map(|d| d.day.format("%m-%d").to_string())
            .collect();
        chart
            .configure_mesh()
            .x_labels(n.clamp(1, 14))
            .x_label_formatter(&move |x| {
                let i = x.round();
                if (x - i).abs() < 1e-6 && i >= 0.0 {
                    labels.get(i as usize).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .y_label_formatter(&|y| axis_number(*y))
            .y_desc("runs")
            .label_style(("sans-serif", 11))
            .draw()
            .map_err(draw_err)?;
        for (name, color, values) in [
            (
                "runs",
                BLUE,
                days.iter().map(|d| d.runs).collect::<Vec<_>>(),
            ),
            ("OOM runs", RED, days.iter().map(|d| d.oom_runs).collect()),
        ] {
            let pts: Vec<(f64, f64)> = values
                .iter()
                .enumerate()
                .map(|(i, v)| (i as f64, *v as f64))
                .collect();
            chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                .map_err(draw_err)?
                .label(name)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 14, y)], color.stroke_width(2))
                });
            chart
                .draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))
                .map_err(draw_err)?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK.mix(0.3))
            .label_font(("sans-serif", 11))
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(draw_err)?;
        root.present().map_err(draw_err)?;
    }
    Ok(svg)
}

fn plots(r: &FleetReport) -> crate::Result<Vec<String>> {
    let shown: Vec<&GroupStats> = r.by_gpu.iter().take(MAX_BARS).collect();
    let cats: Vec<String> = shown
        .iter()
        .map(|g| g.gpu_model.clone().unwrap_or_default())
        .collect();
    let col = |f: &dyn Fn(&GroupStats) -> f64| shown.iter().map(|g| f(g)).collect::<Vec<f64>>();
    let pct100 = |x: Option<f64>| x.map_or(0.0, |v| v * 100.0);
    Ok(vec![
        bars(
            "GPU-hours lost to OOM runs",
            "GPU-hours",
            &cats,
            &[Series {
                color: RED,
                values: col(&|g| g.oom_gpu_hours),
            }],
        )?,
        bars(
            "GPU memory left unused by successful runs",
            "GiB-hours",
            &cats,
            &[Series {
                color: ORANGE,
                values: col(&|g| g.unused_gib_hours),
            }],
        )?,
        bars(
            "Peak-memory prediction error: median (dark), p90 (light)",
            "|predicted − measured| / measured, %",
            &cats,
            &[
                Series {
                    color: BLUE,
                    values: col(&|g| pct100(g.prediction_error.median_abs)),
                },
                Series {
                    color: RGBColor(0x9d, 0xb9, 0xd9),
                    values: col(&|g| pct100(g.prediction_error.p90_abs)),
                },
            ],
        )?,
        bars(
            "Throughput against the best known setting",
            "mean tokens/s per GPU vs best of the same key, %",
            &cats,
            &[Series {
                color: GREEN,
                values: col(&|g| pct100(g.throughput.mean_vs_best)),
            }],
        )?,
        daily(r)?,
    ])
}

fn row_cells(o: &mut String, g: &GroupStats) {
    let bias = g
        .prediction_error
        .bias
        .map_or_else(|| "-".into(), |b| format!("{:+.1}%", b * 100.0));
    for v in [
        g.runs.to_string(),
        format!("{} ({})", g.oom_runs, pct(Some(g.oom_share))),
        hours(g.oom_gpu_hours),
        pct(g.prediction_error.median_abs),
        pct(g.prediction_error.p90_abs),
        bias,
        hours(g.unused_gib_hours),
        pct(g.unused_share),
        pct(g.throughput.mean_vs_best),
    ] {
        let _ = write!(o, "<td class=n>{}</td>", escape(&v));
    }
}

const HEAD: &str = "<th>runs</th><th>OOM</th><th>OOM GPU-h</th><th>err p50</th><th>err p90</th><th>bias</th><th>unused GiB-h</th><th>unused</th><th>tok/s vs best</th>";

const STYLE: &str = "body{font-family:sans-serif;margin:24px;color:#222;background:#fff}\
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px}\
.sub{color:#666;margin-bottom:16px}\
.cards{display:flex;flex-wrap:wrap;gap:12px}\
.card{border:1px solid #ddd;border-radius:6px;padding:10px 14px;min-width:150px}\
.card b{display:block;font-size:20px}.card span{color:#666;font-size:12px}\
.plots{display:flex;flex-wrap:wrap;gap:20px}.plots svg{border:1px solid #eee}\
table{border-collapse:collapse;font-size:13px}th,td{padding:4px 8px;border-bottom:1px solid #eee}\
th{text-align:left;background:#f6f6f6}td.n{text-align:right;font-variant-numeric:tabular-nums}\
.note{color:#666;font-size:12px;max-width:1100px}";

/// The runs of each way into the history (`trainingjob`, `webhook`,
/// `slurm`, `cli`, `import`: the names the dashboards' `path` label uses).
fn by_path(o: &mut String, r: &FleetReport) {
    o.push_str(
        "<h2>By path</h2><table id=by-path><tr><th>path</th><th>runs</th><th>ok</th>\
         <th>OOM</th><th>other failures</th><th>GPU-h</th></tr>",
    );
    for p in &r.by_path {
        let _ = write!(o, "<tr><td>{}</td>", escape(&p.path));
        for v in [
            p.runs.to_string(),
            p.succeeded.to_string(),
            p.oom_runs.to_string(),
            p.other_failures.to_string(),
            hours(p.gpu_hours),
        ] {
            let _ = write!(o, "<td class=n>{}</td>", escape(&v));
        }
        o.push_str("</tr>");
    }
    o.push_str("</table>");
}

/// The whole page.
pub fn render(r: &FleetReport, store: &str) -> crate::Result<String> {
    let mut o = String::with_capacity(64 * 1024);
    let t = &r.total;
    let _ = write!(
        o,
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>\
         <title>gpufit fleet report</title><style>{STYLE}</style></head><body>\
         <h1>gpufit fleet report</h1><div class=sub>{} · {} · generated by gpufit {}</div>",
        escape(&window(r)),
        escape(store),
        env!("CARGO_PKG_VERSION"),
    );
    o.push_str("<div class=cards>");
    for (value, what) in [
        (t.runs.to_string(), "runs".to_string()),
        (pct(Some(t.oom_share)), format!("OOM ({} runs)", t.oom_runs)),
        (hours(t.oom_gpu_hours), "GPU-hours lost to OOM".into()),
        (
            hours(t.unused_gib_hours),
            "GiB-hours of GPU memory unused".into(),
        ),
        (
            pct(t.prediction_error.median_abs),
            format!(
                "median prediction error (p90 {})",
                pct(t.prediction_error.p90_abs)
            ),
        ),
        (
            pct(t.throughput.mean_vs_best),
            "throughput vs best known".into(),
        ),
    ] {
        let _ = write!(
            o,
            "<div class=card><b>{}</b><span>{}</span></div>",
            escape(&value),
            escape(&what)
        );
    }
    o.push_str("</div>");
    if t.runs == 0 {
        o.push_str("<p>No runs in this window.</p>");
    } else {
        o.push_str("<h2>By GPU model</h2><div class=plots>");
        for svg in plots(r)? {
            o.push_str(&svg);
        }
        o.push_str("</div>");
        if r.by_gpu.len() > MAX_BARS {
            let _ = write!(
                o,
                "<p class=note>Plots show the {MAX_BARS} GPU models with the most GPU-hours of {}; the table has all.</p>",
                r.by_gpu.len()
            );
        }
        let _ = write!(o, "<h2>GPU models</h2><table><tr><th>GPU</th>{HEAD}</tr>");
        for g in &r.by_gpu {
            let _ = write!(
                o,
                "<tr><td>{}</td>",
                escape(g.gpu_model.as_deref().unwrap_or(""))
            );
            row_cells(&mut o, g);
            o.push_str("</tr>");
        }
        o.push_str("<tr><td><b>all GPUs</b></td>");
        row_cells(&mut o, t);
        o.push_str("</tr></table>");
        let _ = write!(
            o,
            "<h2>Model × method</h2><table><tr><th>GPU</th><th>model</th><th>method</th>{HEAD}</tr>"
        );
        for g in &r.by_model {
            let _ = write!(
                o,
                "<tr><td>{}</td><td>{}</td><td>{}</td>",
                escape(g.gpu_model.as_deref().unwrap_or("")),
                escape(g.model.as_deref().unwrap_or("")),
                g.method.map(|m| m.as_str()).unwrap_or("")
            );
            row_cells(&mut o, g);
            o.push_str("</tr>");
        }
        o.push_str("</table>");
        by_path(&mut o, r);
    }
    o.push_str(
        "<p class=note>OOM GPU-h: duration × GPUs of runs that ran out of memory. \
         err: |predicted − measured| / measured peak (bias: signed median, &gt; 0 over-predicts). \
         unused: (GPU memory − peak) × duration × GPUs of successful runs, GPU memory from gpufit's catalog. \
         tok/s vs best: a run's tokens/s per GPU against the best any run of the same GPU, model, method and \
         sequence length reached in the whole history.</p></body></html>\n",
    );
    Ok(o)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::report::{ReportBuilder, ReportRow};
    use crate::core::workload::Method;

    fn report(gpu: &str, model: &str) -> FleetReport {
        let mut b = ReportBuilder::new(None, chrono::Utc::now());
        let row = ReportRow {
            confirmed: true,
            timestamp_us: 1_700_000_000_000_000,
            gpu_model: gpu,
            model,
            method: Method::Lora,
            seq_len: 1024,
            gpus: 1,
            success: false,
            oom: true,
            peak_memory_bytes: None,
            predicted_peak_bytes: None,
            tokens_per_sec: None,
            duration_sec: Some(3600.0),
            path: "cli",
        };
        b.add(&row);
        b.finish()
    }

    #[test]
    fn names_from_the_history_cannot_inject_markup() {
        let evil = "<script>alert(1)</script>";
        let page = render(
            &report(evil, "m\"><img src=x onerror=alert(1)>"),
            "sqlite:<x>",
        )
        .unwrap();
        assert!(!page.contains("<script"), "unescaped GPU name in the page");
        assert!(!page.contains("<img"), "unescaped model name in the page");
        assert!(page.contains("&lt;script&gt;"));
    }

    #[test]
    fn the_page_has_the_plots_and_no_external_resources() {
        let page = render(&report("NVIDIA A100-SXM4-80GB", "m"), "sqlite:h.db").unwrap();
        assert_eq!(page.matches("<svg").count(), 5, "five plots");
        assert!(page.contains("<rect"), "bars drawn");
        assert!(page.contains("GPU-hours lost to OOM runs"));
        // The only URL allowed is the SVG namespace, which loads nothing.
        let stripped = page.replace("xmlns=\"http://www.w3.org/2000/svg\"", "");
        for bad in [
            "<script", "http://", "https://", "src=", "@import", "url(", "<link",
        ] {
            assert!(!stripped.contains(bad), "page references `{bad}`");
        }
    }

    #[test]
    fn the_page_tables_the_runs_of_each_path() {
        let page = render(&report("NVIDIA H100 80GB HBM3", "m"), "sqlite:x").unwrap();
        let table = &page[page.find("<table id=by-path>").expect("the by-path table")..];
        let table = &table[..table.find("</table>").unwrap()];
        assert!(
            table
                .contains("<tr><td>cli</td><td class=n>1</td><td class=n>0</td><td class=n>1</td>"),
            "{table}"
        );
        assert!(!table.contains("webhook"), "paths without runs left out");
    }

    #[test]
    fn an_empty_report_renders_without_plots() {
        let r = ReportBuilder::new(None, chrono::Utc::now()).finish();
        let page = render(&r, "sqlite:h.db").unwrap();
        assert!(page.contains("No runs in this window"));
        assert!(!page.contains("<svg"));
    }

    #[test]
    fn a_large_fleet_plots_the_busiest_gpus_and_tables_them_all() {
        let names: Vec<String> = (0..20).map(|i| format!("GPU-{i:02}")).collect();
        let mut b = ReportBuilder::new(None, chrono::Utc::now());
        for (i, n) in names.iter().enumerate() {
            b.add(&ReportRow {
                confirmed: true,
                timestamp_us: 1_700_000_000_000_000,
                gpu_model: n,
                model: "m",
                method: Method::Lora,
                seq_len: 1024,
                gpus: 1,
                success: false,
                oom: true,
                peak_memory_bytes: None,
                predicted_peak_bytes: None,
                tokens_per_sec: None,
                duration_sec: Some(3600.0 * (i + 1) as f64),
                path: "cli",
            });
        }
        let page = render(&b.finish(), "sqlite:h.db").unwrap();
        assert!(page.contains("Plots show the 15 GPU models with the most GPU-hours of 20"));
        // The busiest (GPU-19) is plotted; the idlest (GPU-00) only in the table.
        let plots = &page[..page.find("<h2>GPU models</h2>").unwrap()];
        assert!(plots.contains("GPU-19") && !plots.contains("GPU-00"));
        assert!(page.contains("<td>GPU-00</td>"));
    }

    #[test]
    fn long_labels_keep_their_tail() {
        let l = label("an-organisation-with-a-long-name/Llama-3.1-70B-Instruct");
        assert!(l.starts_with('…') && l.ends_with("70B-Instruct"), "{l}");
        assert_eq!(label("short"), "short");
    }
}
