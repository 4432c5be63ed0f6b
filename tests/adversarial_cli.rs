//! Issue 47, items 3, 7 and 8 at the command line: `gpufit record` with a
//! GPU that is no GPU, the pin variable gpufit injects, control characters
//! stored in the history (written straight into the file, as an older
//! gpufit let them in) printed by `history list` and `report`, a bad
//! `--simulate-mig`, and `--max-jobs` on the simulate backend.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[path = "common/cli.rs"]
mod cli;
use cli::{args, text, Env, A100, MODEL};

#[path = "common/loopback.rs"]
mod loopback;
use loopback::{agent, call, free_port};

#[test]
fn record_refuses_a_gpu_that_is_no_gpu_and_stores_nothing() {
    let env = Env::new();
    for gpu in ["cpu", "auto", "Zzz\u{1b}[2J"] {
        let out = env.run(
            &args(
                &["record"],
                &args(MODEL, &["--gpu", gpu, "--micro-batch", "4"]),
            ),
            &[],
        );
        assert_eq!(out.status.code(), Some(2), "--gpu {gpu:?}: {}", text(&out));
    }
    let list = env.json(&["-o", "json", "history", "list"], &[]);
    assert_eq!(list.as_array().map(Vec::len), Some(0), "{list}");
}

#[test]
fn the_cli_pin_reads_the_variable_gpufit_injects() {
    let env = Env::new();
    let s = env.json(
        &args(&["-o", "json", "suggest"], &args(MODEL, &["--gpu", A100])),
        &[("GPUFIT_MICRO_BATCH_SIZE", "3".into())],
    );
    assert_eq!(s["micro_batch_size"], 3, "{s}");
}

/// A history holding a model name with terminal control characters (an
/// escape that clears the screen, a carriage return and a newline that
/// fake a row): every table prints them escaped.
#[test]
fn tables_escape_control_characters_of_stored_strings() {
    let env = Env::new();
    env.json(
        &args(
            &["-o", "json", "record"],
            &args(
                MODEL,
                &["--gpu", A100, "--micro-batch", "4", "--peak-gb", "40"],
            ),
        ),
        &[],
    );
    let evil = "evil\u{1b}[2J\u{1b}[H\rfake\nrow";
    let db = env.dir.path().join("history.db");
    let c = rusqlite::Connection::open(&db).unwrap();
    let n = c
        .execute("UPDATE runs SET model = ?1", rusqlite::params![evil])
        .unwrap();
    assert_eq!(n, 1);
    drop(c);
    for cmd in [&["history", "list"][..], &["report"][..]] {
        let out = env.run(cmd, &[]);
        assert!(out.status.success(), "{cmd:?}: {}", text(&out));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            !stdout.contains('\u{1b}'),
            "{cmd:?} printed a raw ESC:\n{stdout}"
        );
        assert!(
            !stdout.contains('\r'),
            "{cmd:?} printed a raw CR:\n{stdout}"
        );
        assert!(
            stdout.contains("evil\\u{1b}[2J"),
            "{cmd:?} shows the name escaped:\n{stdout}"
        );
        assert!(
            !stdout.lines().any(|l| l.trim_start().starts_with("row")),
            "{cmd:?}: a newline in a name made a row:\n{stdout}"
        );
    }
}

#[test]
fn a_bad_simulate_mig_is_a_usage_error() {
    for layout in ["0:9g.99gb", "zz", "0:1g.10gb;0:1g.10gb"] {
        let out = Command::new(cli::BIN)
            .args([
                "sidecar",
                "--backend",
                "simulate",
                "--listen",
                "127.0.0.1:0",
            ])
            .args(["--simulate-mig", layout])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert_eq!(
            out.status.code(),
            Some(2),
            "--simulate-mig {layout}: {}",
            text(&out)
        );
    }
}

/// The simulate backend holds at most `--max-jobs` running jobs: a process
/// of one more job is refused (429), one of a job already held is taken.
#[test]
fn the_simulate_backend_keeps_max_jobs() {
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let mut child = Command::new(cli::BIN)
        .args(["sidecar", "--backend", "simulate", "--max-jobs", "2"])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || for _ in BufReader::new(stderr).lines() {});
    let started = Instant::now();
    while agent().get(&format!("{base}/healthz")).call().is_err() {
        assert!(started.elapsed() < Duration::from_secs(30), "sidecar start");
        std::thread::sleep(Duration::from_millis(50));
    }
    let post = |pid: u32, job: &str| {
        call(
            agent().post(&format!("{base}/v1/simulate/processes")),
            Some(
                &serde_json::json!({"pid": pid, "gpu": 0, "job": {"slurm_job_id": job}, "memory_bytes": 1_000_000_000u64})
                    .to_string(),
            ),
        )
    };
    assert_eq!(post(1, "1").0, 200);
    assert_eq!(post(2, "2").0, 200);
    let (status, body) = post(3, "3");
    assert_eq!(status, 429, "{body}");
    assert!(body.to_string().contains("--max-jobs"), "{body}");
    assert_eq!(post(4, "2").0, 200, "another process of a held job");
    let (_, jobs) = call(agent().get(&format!("{base}/v1/jobs")), None);
    let running = jobs["jobs"]
        .as_array()
        .map(|j| j.iter().filter(|j| j["running"] == true).count());
    assert_eq!(running, Some(2), "{jobs}");
    let _ = child.kill();
    let _ = child.wait();
}
