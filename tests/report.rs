//! `gpufit report` end to end: the binary over a SQLite file and over a real
//! PostgreSQL server (Debian's binaries on 127.0.0.1, stopped afterwards)
//! with figures worked out by hand, and the HTML page rendered by headless
//! Chromium (Debian's `chromium`), its plots checked in the DOM and in the
//! screenshot's pixels.

use gpufit::core::run::RunOutcome;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use chrono::Utc;
use gpufit::core::run::{RunRecord, RunResult, RunSource};
use gpufit::core::settings::EngineeringSettings;
use gpufit::core::workload::Method;
use serde_json::Value;

const A100_80: &str = "NVIDIA A100-SXM4-80GB";
const A100_40: &str = "NVIDIA A100-SXM4-40GB";
const MODEL: &str = "meta-llama/Llama-3.1-8B";
const GIB: u64 = 1 << 30;

// === fixtures ===

#[allow(clippy::too_many_arguments)]
fn run(
    ago_h: i64,
    gpu: &str,
    method: Method,
    gpus: u32,
    ok: bool,
    peak_gib: Option<u64>,
    predicted_gib: Option<u64>,
    tps: Option<f64>,
    dur: f64,
) -> RunRecord {
    RunRecord {
        confirmation: Default::default(),
        nodes: None,
        id: None,
        timestamp: Utc::now() - chrono::Duration::hours(ago_h),
        cluster: Some("c1".into()),
        node: Some("n1".into()),
        source: RunSource::Cli,
        job_id: Some(format!("job-{ago_h}-{gpus}")),
        model: MODEL.into(),
        method,
        gpu_model: gpu.into(),
        seq_len: 2048,
        lora_rank: Some(16),
        gpus,
        global_batch: Some(64),
        settings: EngineeringSettings {
            micro_batch_size: 4,
            gradient_accumulation_steps: 16,
            ..EngineeringSettings::default()
        },
        result: RunResult {
            outcome: RunOutcome::of(ok, !ok, false),
            peak_memory_bytes: peak_gib.map(|g| g * GIB),
            samples_per_sec: None,
            tokens_per_sec: tps,
            duration_sec: Some(dur),
        },
        predicted_peak_bytes: predicted_gib.map(|g| g * GIB),
    }
}

/// Six runs; the figures each window must give are worked out in the tests.
fn fixture() -> Vec<RunRecord> {
    use Method::{Lora, Qlora};
    vec![
        // Last 24 h.
        run(
            2,
            A100_80,
            Lora,
            2,
            true,
            Some(60),
            Some(63),
            Some(4000.0),
            3600.0,
        ),
        run(3, A100_80, Lora, 1, false, None, Some(70), None, 1800.0),
        run(
            4,
            A100_40,
            Qlora,
            1,
            true,
            Some(30),
            Some(27),
            Some(1000.0),
            7200.0,
        ),
        // Three days ago.
        run(72, A100_80, Lora, 4, false, None, None, None, 900.0),
        run(
            73,
            A100_80,
            Lora,
            1,
            true,
            Some(70),
            Some(77),
            Some(2500.0),
            3600.0,
        ),
        // Ten days ago: outside both windows, but the best known throughput.
        run(
            240,
            A100_80,
            Lora,
            1,
            true,
            Some(50),
            Some(50),
            Some(4000.0),
            3600.0,
        ),
    ]
}

fn fill(url: &str, runs: &[RunRecord]) {
    let store = gpufit::history::open(url).expect("open store");
    let mut it = runs.iter().cloned().map(Ok);
    let n = store.record_batch(&mut it).expect("record fixture");
    assert_eq!(n as usize, runs.len());
}

fn gpufit(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_gpufit"))
        .args(args)
        .env_remove("GPUFIT_HISTORY")
        .env_remove("GPUFIT_OUTPUT")
        .output()
        .expect("run gpufit")
}

fn report_json(url: &str, since: &str) -> Value {
    let out = gpufit(&["report", "--history", url, "--since", since, "-o", "json"]);
    assert!(
        out.status.success(),
        "gpufit report failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("report JSON")
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

fn close(v: &Value, want: f64) -> bool {
    (f(v) - want).abs() < 1e-9
}

fn gpu<'a>(r: &'a Value, name: &str) -> &'a Value {
    r["by_gpu"]
        .as_array()
        .expect("by_gpu")
        .iter()
        .find(|g| g["gpu_model"] == name)
        .unwrap_or_else(|| panic!("no {name} in {r}"))
}

/// The hand-computed figures, for any store holding [`fixture`].
fn check_figures(url: &str) {
    // --since 24h: the first three runs.
    let r = report_json(url, "24h");
    assert_eq!(r["total"]["runs"], 3, "{r}");
    // The window's 3 runs, plus the two older successful runs with a
    // throughput (they only set the best known).
    assert_eq!(r["rows_scanned"], 5);
    let a = gpu(&r, A100_80);
    assert_eq!(a["runs"], 2);
    assert_eq!(a["oom_runs"], 1);
    assert!(close(&a["oom_share"], 0.5));
    // 1 GPU × 0.5 h.
    assert!(close(&a["oom_gpu_hours"], 0.5), "{a}");
    // (63 − 60) / 60.
    assert!(close(&a["prediction_error"]["median_abs"], 0.05), "{a}");
    // (80 − 60) GiB × 1 h × 2 GPUs.
    assert!(close(&a["unused_gib_hours"], 40.0), "{a}");
    // 2000 tokens/s per GPU against the 4000 of ten days ago.
    assert!(close(&a["throughput"]["mean_vs_best"], 0.5), "{a}");
    let b = gpu(&r, A100_40);
    assert!(close(&b["gpu_memory_gib"], 40.0));
    // (40 − 30) GiB × 2 h.
    assert!(close(&b["unused_gib_hours"], 20.0), "{b}");
    assert!(close(&b["prediction_error"]["bias"], -0.1), "{b}");
    assert!(close(&b["throughput"]["mean_vs_best"], 1.0));
    assert!(close(&r["total"]["unused_gib_hours"], 60.0));
    assert!(close(&r["total"]["throughput"]["mean_vs_best"], 0.75));
    let models = r["by_model"].as_array().expect("by_model");
    assert_eq!(models.len(), 2);
    assert!(models
        .iter()
        .any(|m| m["method"] == "qlora" && m["gpu_model"] == A100_40 && m["model"] == MODEL));

    // --since 7d: five runs.
    let r = report_json(url, "7d");
    assert_eq!(r["total"]["runs"], 5);
    let a = gpu(&r, A100_80);
    assert_eq!(
        (a["runs"].clone(), a["oom_runs"].clone()),
        (4.into(), 2.into())
    );
    // 0.5 + 4 GPUs × 0.25 h.
    assert!(close(&a["oom_gpu_hours"], 1.5), "{a}");
    // |errors| 0.05 and 0.1: median 0.075, p90 0.05 + 0.9 × 0.05.
    assert!(close(&a["prediction_error"]["median_abs"], 0.075), "{a}");
    assert!(close(&a["prediction_error"]["p90_abs"], 0.095), "{a}");
    // 40 + (80 − 70) × 1 h.
    assert!(close(&a["unused_gib_hours"], 50.0), "{a}");
    // (2000/4000 + 2500/4000) / 2.
    assert!(close(&a["throughput"]["mean_vs_best"], 0.5625), "{a}");
    // One point per UTC day with runs: 2–4 h ago and 72–73 h ago span two
    // or three dates depending on the time of day the test runs.
    let week_ago = Utc::now() - chrono::Duration::days(7);
    let days: std::collections::BTreeSet<_> = fixture()
        .iter()
        .filter(|x| x.timestamp >= week_ago)
        .map(|x| x.timestamp.date_naive())
        .collect();
    assert_eq!(r["daily"].as_array().map(Vec::len), Some(days.len()));

    // --since all: everything; the old run is now its own best.
    let r = report_json(url, "all");
    assert_eq!(r["total"]["runs"], 6);
    assert_eq!(r["since"], Value::Null);
}

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("temp dir")
}

// === SQLite ===

#[test]
fn report_over_sqlite_gives_the_hand_computed_figures() {
    let dir = tmp();
    let url = format!("sqlite:{}", dir.path().join("h.db").display());
    fill(&url, &fixture());
    check_figures(&url);
}

#[test]
fn report_table_names_every_gpu_and_model_and_the_window() {
    let dir = tmp();
    let url = format!("sqlite:{}", dir.path().join("h.db").display());
    fill(&url, &fixture());
    let out = gpufit(&["report", "--history", &url, "--since", "7d"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = String::from_utf8_lossy(&out.stdout);
    for want in [
        A100_80,
        A100_40,
        MODEL,
        "qlora",
        "all GPUs",
        "OOM GPU-h",
        "2 (50.0%)",
        "1.50",
    ] {
        assert!(s.contains(want), "table lacks `{want}`:\n{s}");
    }
    // An empty store says so instead of printing empty tables.
    let empty = format!("sqlite:{}", dir.path().join("empty.db").display());
    let out = gpufit(&["report", "--history", &empty]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("no runs in this window"));
}

#[test]
fn a_bad_window_is_a_usage_error_naming_the_flag() {
    let dir = tmp();
    let url = format!("sqlite:{}", dir.path().join("h.db").display());
    let out = gpufit(&["report", "--history", &url, "--since", "last week"]);
    assert_eq!(out.status.code(), Some(2));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("--since") && e.contains("7d"), "{e}");
}

#[test]
fn an_unwritable_html_path_fails_with_the_path_in_the_message() {
    let dir = tmp();
    let url = format!("sqlite:{}", dir.path().join("h.db").display());
    fill(&url, &fixture());
    let bad = dir.path().join("no-such-dir").join("r.html");
    let out = gpufit(&["report", "--history", &url, "--html", bad.to_str().unwrap()]);
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("no-such-dir"), "{e}");
}

/// Equal JSON, numbers within 1e-9 relative (sums of floats in another
/// row order differ in the last bits).
fn assert_same(a: &Value, b: &Value, what: &str) {
    match (a, b) {
        (Value::Number(_), Value::Number(_)) => {
            let (x, y) = (f(a), f(b));
            assert!(
                (x - y).abs() <= 1e-9 * x.abs().max(y.abs()).max(1.0),
                "{what}: {x} != {y}"
            );
        }
        (Value::Array(x), Value::Array(y)) => {
            assert_eq!(x.len(), y.len(), "{what}: lengths");
            for (p, q) in x.iter().zip(y) {
                assert_same(p, q, what);
            }
        }
        (Value::Object(x), Value::Object(y)) => {
            assert_eq!(
                x.keys().collect::<Vec<_>>(),
                y.keys().collect::<Vec<_>>(),
                "{what}: fields"
            );
            for (k, p) in x {
                assert_same(p, &y[k], &format!("{what}.{k}"));
            }
        }
        _ => assert_eq!(a, b, "{what}"),
    }
}

/// The store's narrow query and the generic path through whole records
/// (`for_each`) must see the same rows: same report, for every window.
fn narrow_query_matches_whole_records(store: &dyn gpufit::history::HistoryStore) {
    use gpufit::core::report::ReportBuilder;
    use gpufit::history::report_query::via_for_each;
    let now = Utc::now();
    for since in [
        None,
        Some(now - chrono::Duration::hours(24)),
        Some(now - chrono::Duration::days(7)),
    ] {
        let mut narrow = ReportBuilder::new(since, now);
        let n = store
            .report_rows(narrow.since_us(), &mut |r| {
                narrow.add(r);
                Ok(())
            })
            .expect("narrow query");
        let mut whole = ReportBuilder::new(since, now);
        let m = via_for_each(store, whole.since_us(), &mut |r| {
            whole.add(r);
            Ok(())
        })
        .expect("for_each");
        assert_eq!(n, m, "rows read, since {since:?}");
        assert_same(
            &serde_json::to_value(narrow.finish()).expect("json"),
            &serde_json::to_value(whole.finish()).expect("json"),
            &format!("since {since:?}"),
        );
    }
}

#[test]
fn sqlite_narrow_query_reads_what_whole_records_say() {
    let dir = tmp();
    let url = format!("sqlite:{}", dir.path().join("h.db").display());
    let mut runs = fixture();
    runs.extend(demo_fleet());
    fill(&url, &runs);
    let store = gpufit::history::open(&url).expect("open");
    narrow_query_matches_whole_records(store.as_ref());
}

// === PostgreSQL ===

#[test]
fn report_over_postgres_gives_the_same_figures_as_sqlite() {
    let pg = Postgres::start();
    let url = pg.url();
    let runs = fixture();
    fill(&url, &runs);
    check_figures(&url);
    fill(&url, &demo_fleet());
    narrow_query_matches_whole_records(gpufit::history::open(&url).expect("open").as_ref());

    let dir = tmp();
    let runs: Vec<RunRecord> = runs.into_iter().chain(demo_fleet()).collect();
    let lite = format!("sqlite:{}", dir.path().join("h.db").display());
    fill(&lite, &runs);
    let strip = |mut v: Value| {
        v["until"] = Value::Null;
        v["since"] = Value::Null;
        v
    };
    assert_same(
        &strip(report_json(&url, "7d")),
        &strip(report_json(&lite, "7d")),
        "SQLite and PostgreSQL",
    );
}

#[path = "common/postgres.rs"]
mod pg;
use pg::Postgres;

// === HTML in headless Chromium ===

/// A fleet of two weeks over four GPU models (deterministic), for a page
/// with every plot populated.
fn demo_fleet() -> Vec<RunRecord> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(14);
    let gpus = [
        (A100_80, 80u64),
        ("NVIDIA H100 80GB HBM3", 79),
        ("NVIDIA L40S", 44),
        ("NVIDIA A10G", 22),
    ];
    let models = [
        ("meta-llama/Llama-3.1-8B", Method::Lora),
        ("meta-llama/Llama-3.1-8B", Method::Full),
        ("Qwen/Qwen2.5-7B", Method::Qlora),
        ("mistralai/Mistral-7B-v0.3", Method::Lora),
    ];
    (0..400)
        .map(|i| {
            let (gpu, cap) = gpus[i % gpus.len()];
            let (model, method) = models[rng.gen_range(0..models.len())];
            let ok = rng.gen_range(0..100) >= [4, 6, 12, 25][i % gpus.len()];
            let peak = rng.gen_range(cap / 3..cap);
            let gpus_n = [1, 2, 4, 8][rng.gen_range(0..4)];
            let mut r = run(
                rng.gen_range(1..14 * 24),
                gpu,
                method,
                gpus_n,
                ok,
                ok.then_some(peak),
                Some((peak as f64 * rng.gen_range(0.85..1.2)) as u64),
                ok.then(|| rng.gen_range(800.0..3000.0) * gpus_n as f64),
                if ok {
                    rng.gen_range(1800.0..20_000.0)
                } else {
                    rng.gen_range(60.0..1200.0)
                },
            );
            r.model = model.into();
            // Unique job ids: a store that deduplicates by identity keeps all.
            r.job_id = Some(format!("demo-{i}"));
            r
        })
        .collect()
}

/// Runs a command in its own process group, killing the group if it runs
/// past `limit` (Chromium starts helper processes).
fn run_bounded(mut cmd: Command, limit: Duration) -> std::process::Output {
    use std::os::unix::process::CommandExt;
    let child = cmd
        .process_group(0)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("chromium not found: install Debian's `chromium` (scripts/test.sh does it)");
    let pid = child.id() as i32;
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = done.clone();
    let killer = std::thread::spawn(move || {
        let start = Instant::now();
        while start.elapsed() < limit {
            if flag.load(std::sync::atomic::Ordering::SeqCst) {
                return false;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
        true
    });
    let out = child.wait_with_output().expect("wait for chromium");
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let killed = killer.join().unwrap_or(false);
    assert!(!killed, "chromium ran past {limit:?} and was killed");
    // Helpers left behind by a finished browser would outlive the test.
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
    out
}

fn chromium(profile: &Path, extra: &[String], page: &Path) -> std::process::Output {
    let mut c = Command::new("chromium");
    c.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--window-size=1200,1600",
    ])
    .arg(format!("--user-data-dir={}", profile.display()))
    .args(extra)
    .arg(format!("file://{}", page.display()));
    let out = run_bounded(c, Duration::from_secs(90));
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// RGB pixels of a PNG (RGB or RGBA, 8 bit).
fn pixels(path: &Path) -> (u32, u32, Vec<[u8; 3]>) {
    let dec = png::Decoder::new(std::fs::File::open(path).expect("open screenshot"));
    let mut rd = dec.read_info().expect("PNG header");
    let mut buf = vec![0; rd.output_buffer_size()];
    let info = rd.next_frame(&mut buf).expect("PNG frame");
    assert_eq!(info.bit_depth, png::BitDepth::Eight);
    let step = match info.color_type {
        png::ColorType::Rgb => 3,
        png::ColorType::Rgba => 4,
        other => panic!("unexpected PNG colour type {other:?}"),
    };
    let px = buf[..info.buffer_size()]
        .chunks_exact(step)
        .map(|p| [p[0], p[1], p[2]])
        .collect();
    (info.width, info.height, px)
}

fn near(p: [u8; 3], c: [u8; 3]) -> bool {
    p.iter().zip(c).all(|(a, b)| a.abs_diff(b) <= 24)
}

#[test]
fn the_html_report_renders_its_plots_in_headless_chromium() {
    let dir = tmp();
    let url = format!("sqlite:{}", dir.path().join("h.db").display());
    fill(&url, &demo_fleet());
    let page = dir.path().join("report.html");
    let out = gpufit(&[
        "report",
        "--history",
        &url,
        "--since",
        "14d",
        "--html",
        page.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The DOM the browser built: five inline SVG plots with bars and lines,
    // parsed as elements (escaped markup would be text, not elements).
    let out = chromium(
        &dir.path().join("profile-dom"),
        &["--dump-dom".into()],
        &page,
    );
    let dom = String::from_utf8_lossy(&out.stdout);
    assert_eq!(dom.matches("<svg").count(), 5, "SVG plots in the DOM");
    assert!(dom.matches("<rect").count() >= 4 * 4, "bars in the DOM");
    assert!(
        dom.contains("<polyline") || dom.contains("<path"),
        "daily line in the DOM"
    );
    assert!(dom.contains("NVIDIA L40S") && dom.contains("Qwen/Qwen2.5-7B"));

    // The screenshot: not blank, and the bar colours are on it.
    let shot = dir.path().join("report.png");
    chromium(
        &dir.path().join("profile-shot"),
        &[format!("--screenshot={}", shot.display())],
        &page,
    );
    let (w, h, px) = pixels(&shot);
    assert_eq!((w, h), (1200, 1600));
    let inked = px.iter().filter(|p| p.iter().any(|c| *c < 235)).count();
    let share = inked as f64 / px.len() as f64;
    assert!(
        share > 0.03,
        "screenshot nearly blank: {:.2}% non-white",
        share * 100.0
    );
    let red = px.iter().filter(|p| near(**p, [0xc2, 0x3b, 0x22])).count();
    let orange = px.iter().filter(|p| near(**p, [0xe0, 0x8a, 0x1e])).count();
    assert!(
        red > 500,
        "OOM bars missing from the screenshot ({red} red pixels)"
    );
    assert!(
        orange > 500,
        "unused-memory bars missing ({orange} orange pixels)"
    );

    // `GPUFIT_REPORT_SCREENSHOT=docs/img/report.png` keeps the screenshot
    // for the README.
    if let Ok(keep) = std::env::var("GPUFIT_REPORT_SCREENSHOT") {
        let keep = Path::new(env!("CARGO_MANIFEST_DIR")).join(keep);
        std::fs::copy(&shot, &keep).expect("keep the screenshot");
    }
}

/// The fleet view's `path` dimension: a run of each way into the history,
/// told apart by source and job id, counted in the JSON and the table.
#[test]
fn report_counts_the_runs_of_each_path() {
    let dir = tmp();
    let url = format!("sqlite:{}", dir.path().join("h.db").display());
    let with = |source: RunSource, job: &str, ok: bool| RunRecord {
        source,
        job_id: Some(job.into()),
        ..run(
            1,
            A100_80,
            Method::Lora,
            2,
            ok,
            Some(60),
            None,
            None,
            3600.0,
        )
    };
    fill(
        &url,
        &[
            with(RunSource::Kubernetes, "ml/finetune-a1/uid-1", true),
            with(RunSource::Kubernetes, "PyTorchJob:ml/ddp/uid-2", false),
            with(RunSource::Kubernetes, "Job:ml/finetune/uid-3", true),
            with(RunSource::Slurm, "4242", true),
            with(RunSource::Cli, "x", true),
        ],
    );
    let r = report_json(&url, "24h");
    let by: Vec<(String, u64, u64)> = r["by_path"]
        .as_array()
        .expect("by_path")
        .iter()
        .map(|p| {
            (
                p["path"].as_str().unwrap_or_default().to_string(),
                p["runs"].as_u64().unwrap_or(0),
                p["oom_runs"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(
        by,
        vec![
            ("trainingjob".to_string(), 1, 0),
            ("webhook".to_string(), 2, 1),
            ("slurm".to_string(), 1, 0),
            ("cli".to_string(), 1, 0),
        ]
    );
    let out = gpufit(&["report", "--history", &url, "--since", "24h"]);
    let s = String::from_utf8_lossy(&out.stdout);
    for want in ["path", "trainingjob", "webhook", "slurm"] {
        assert!(s.contains(want), "table lacks `{want}`:\n{s}");
    }

    // The HTML report has the same split, as a table the browser parses.
    let page = dir.path().join("paths.html");
    let out = gpufit(&[
        "report",
        "--history",
        &url,
        "--since",
        "24h",
        "--html",
        page.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = chromium(
        &dir.path().join("profile-paths"),
        &["--dump-dom".into()],
        &page,
    );
    let dom = String::from_utf8_lossy(&out.stdout);
    let table = &dom[dom
        .find("<table id=\"by-path\">")
        .expect("the by-path table in the DOM")..];
    let table = &table[..table.find("</table>").expect("the table's end")];
    for (path, runs, ok, oom) in [
        ("trainingjob", 1, 1, 0),
        ("webhook", 2, 1, 1),
        ("slurm", 1, 1, 0),
        ("cli", 1, 1, 0),
    ] {
        let row = format!(
            "<tr><td>{path}</td><td class=\"n\">{runs}</td><td class=\"n\">{ok}</td><td class=\"n\">{oom}</td>"
        );
        assert!(table.contains(&row), "{row} not in {table}");
    }
    assert!(!table.contains("import"), "a path without runs is left out");
}
