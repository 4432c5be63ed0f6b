//! `gpufit find-max-batch` against fake trial scripts: the search from the
//! prediction against a script that simulates a memory curve and prints
//! PyTorch's OOM message (trials recorded, and what suggest learns from
//! them), a failure that is not an OOM, the time limit; a signal mid-trial
//! stops the trial's whole process group, and trials are recorded with the
//! checkpointing / compile they were really told.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[path = "common/cli.rs"]
mod cli;
use cli::{args, text, Env, A100, BIN, MODEL};

/// Whether a process is alive (a zombie, already dead, counts as gone).
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // `pid (comm) S …`: the state follows the last `)`.
            let state = stat.rsplit(')').next().unwrap_or("").trim_start();
            !state.starts_with('Z') && !state.starts_with('X')
        }
        Err(_) => false,
    }
}

fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let t = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(t.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal_mid_trial_kills_the_trial(signal: nix::sys::signal::Signal, want_exit: i32) {
    let dir = tempfile::tempdir().unwrap();
    let pids = dir.path().join("pids");
    // The trial: a shell that starts a long sleep (a training process
    // stand-in) and waits for it; both pids are written down.
    let script = dir.path().join("trial.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nsleep 60 &\necho \"$$ $!\" > {p}.tmp && mv {p}.tmp {p}\nwait\n",
            p = pids.display()
        ),
    )
    .unwrap();
    let history = format!("sqlite:{}/h.db", dir.path().display());
    let mut child = Command::new(BIN)
        .args(["find-max-batch", "--cmd"])
        .arg(format!("sh {} {{micro_batch_size}}", script.display()))
        .args(["--steps", "1", "--timeout", "120s", "--history", &history])
        .args(MODEL)
        .args(["--gpu", A100])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let text = wait_for("the trial to start", Duration::from_secs(30), || {
        std::fs::read_to_string(&pids).ok()
    });
    let trial: Vec<i32> = text
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(trial.len(), 2, "{text}");
    assert!(trial.iter().all(|p| alive(*p)), "the trial runs: {trial:?}");

    let gpufit = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(gpufit, signal).unwrap();
    let status = wait_for("gpufit to exit", Duration::from_secs(10), || {
        child.try_wait().unwrap()
    });
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(want_exit), "{err}");
    assert!(err.contains("interrupted"), "{err}");
    // Killed with its group, not left behind (as a real trial would be,
    // holding GPU memory).
    wait_for(
        "the trial processes to be gone",
        Duration::from_secs(5),
        || trial.iter().all(|p| !alive(*p)).then_some(()),
    );
}

#[test]
fn sigterm_mid_trial_kills_the_trial_process_group() {
    signal_mid_trial_kills_the_trial(nix::sys::signal::Signal::SIGTERM, 143);
}

#[test]
fn sigint_mid_trial_kills_the_trial_process_group() {
    signal_mid_trial_kills_the_trial(nix::sys::signal::Signal::SIGINT, 130);
}

/// Runs a search with `cmd` (a script whose every micro batch fits up to 4)
/// and returns the recorded runs and the flags each trial saw.
fn search(dir: &Path, cmd_tail: &str, extra: &[&str]) -> (Vec<serde_json::Value>, String) {
    let seen = dir.join("seen");
    let script = dir.join("fit4.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\necho \"$*\" >> {seen}\nif [ \"$1\" -gt 4 ]; then echo 'torch.OutOfMemoryError: CUDA out of memory.' >&2; exit 1; fi\necho 'Peak memory: 30.0 GB'\n",
            seen = seen.display()
        ),
    )
    .unwrap();
    let history = format!("sqlite:{}/h.db", dir.display());
    let o = Command::new(BIN)
        .args(["find-max-batch", "--cmd"])
        .arg(format!(
            "sh {} {{micro_batch_size}}{cmd_tail}",
            script.display()
        ))
        .args(["--steps", "1", "--start", "2", "--max-batch", "8"])
        .args(["--history", &history])
        .args(MODEL)
        .args(["--gpu", A100])
        .args(["--checkpointing", "on", "--compile", "on"])
        .args(extra)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = Command::new(BIN)
        .args(["history", "export", "--history", &history])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let runs: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(!runs.is_empty());
    (runs, std::fs::read_to_string(seen).unwrap_or_default())
}

/// A setting of every recorded run (`config` of the run_logs.jsonl layout).
fn recorded(runs: &[serde_json::Value], key: &str) -> Vec<bool> {
    runs.iter()
        .map(|r| {
            r.pointer(&format!("/config/{key}"))
                .and_then(|v| v.as_bool())
                .unwrap_or_else(|| panic!("no {key} in {r}"))
        })
        .collect()
}

#[test]
fn trials_are_recorded_with_the_settings_the_command_was_told() {
    // Placeholders: the command is told, and the trials are recorded so.
    let dir = tempfile::tempdir().unwrap();
    let (runs, seen) = search(
        dir.path(),
        " --ckpt {activation_checkpointing} --compile {compile}",
        &[],
    );
    assert!(
        seen.lines()
            .all(|l| l.ends_with("--ckpt true --compile true")),
        "{seen}"
    );
    assert!(
        recorded(&runs, "enable_activation_checkpointing")
            .iter()
            .all(|c| *c),
        "{runs:?}"
    );
    assert!(recorded(&runs, "compile").iter().all(|c| *c), "{runs:?}");

    // No placeholder: the command runs with its own default (off), and
    // that is what is recorded, whatever the pins wished.
    let dir = tempfile::tempdir().unwrap();
    let (runs, _) = search(dir.path(), "", &[]);
    assert!(
        recorded(&runs, "enable_activation_checkpointing")
            .iter()
            .all(|c| !*c),
        "{runs:?}"
    );
    assert!(recorded(&runs, "compile").iter().all(|c| !*c), "{runs:?}");

    // A script that reads the environment says so.
    let dir = tempfile::tempdir().unwrap();
    let (runs, _) = search(dir.path(), "", &["--settings-from-env"]);
    assert!(
        recorded(&runs, "enable_activation_checkpointing")
            .iter()
            .all(|c| *c),
        "{runs:?}"
    );
}

/// The model's own line for the pinned settings on a made-up GPU, read
/// through `suggest --micro-batch` (so the test holds for any estimator).
fn model_line(env: &Env, gpu: &[&str]) -> (f64, f64) {
    let at = |m: &str| {
        let v = env.json(
            &args(
                &["suggest", "--no-history"],
                &args(
                    MODEL,
                    &args(
                        gpu,
                        &[
                            "--dtype",
                            "bf16",
                            "--checkpointing",
                            "off",
                            "--micro-batch",
                            m,
                            "-o",
                            "json",
                        ],
                    ),
                ),
            ),
            &[],
        );
        v["predicted_peak_bytes"].as_f64().unwrap()
    };
    let (p1, p2) = (at("1"), at("2"));
    (p1 - (p2 - p1), p2 - p1)
}

#[test]
fn find_max_batch_searches_from_the_prediction_records_trials_and_teaches_suggest() {
    let env = Env::new();
    // A true curve 10 % above the model's fixed part and 30 % above its
    // slope, with capacity for exactly 20 samples.
    let probe = ["--gpu", "Test GPU", "--gpu-memory", "80"];
    let (fixed, slope) = model_line(&env, &probe);
    assert!(fixed > 0.0 && slope > 0.0, "{fixed} {slope}");
    let (tf, ts) = (fixed * 1.1 / 1e6, slope * 1.3 / 1e6);
    let cap_mb = tf + ts * 20.5;
    let gpu_gib = format!("{:.4}", cap_mb * 1e6 / (1u64 << 30) as f64);
    let gpu = ["--gpu", "Test GPU", "--gpu-memory", gpu_gib.as_str()];
    let trials = env.path("trials.txt");
    let fake = [
        ("FAKE_FIXED_MB", format!("{}", tf.round() as u64)),
        ("FAKE_PER_SAMPLE_MB", format!("{}", ts.round() as u64)),
        ("FAKE_CAPACITY_MB", format!("{}", cap_mb.round() as u64)),
        ("FAKE_TRIALS", trials.display().to_string()),
    ];
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fake_train.sh");
    let cmd = format!("sh {} {{micro_batch_size}}", script.display());
    let pins = [
        "--dtype",
        "bf16",
        "--checkpointing",
        "off",
        "--compile",
        "off",
    ];
    let predicted = env.json(
        &args(
            &["suggest", "--strategy", "aggressive"],
            &args(MODEL, &args(&gpu, &args(&pins, &["-o", "json"]))),
        ),
        &[],
    )["micro_batch_size"]
        .as_u64()
        .unwrap();

    let v = env.json(
        &args(
            &[
                "find-max-batch",
                "--cmd",
                cmd.as_str(),
                "--steps",
                "3",
                "--timeout",
                "20s",
            ],
            &args(MODEL, &args(&gpu, &args(&pins, &["-o", "json"]))),
        ),
        &fake,
    );
    assert_eq!(v["max_micro_batch"], 20, "{v}");
    assert_eq!(v["smallest_oom"], 21, "{v}");
    let tried: Vec<u64> = std::fs::read_to_string(&trials)
        .unwrap()
        .lines()
        .map(|l| l.trim().parse().unwrap())
        .collect();
    assert_eq!(
        tried[0], predicted,
        "starts from the advisor's prediction, not 1: {tried:?}"
    );
    let n = v["trials"].as_array().unwrap().len();
    assert_eq!(n, tried.len());
    assert_eq!(v["recorded"].as_u64().unwrap() as usize, n);
    // Each successful trial's throughput (samples/s × seq 2048) is kept.
    for t in v["trials"].as_array().unwrap() {
        if t["outcome"] == "success" {
            let b = t["micro_batch_size"].as_u64().unwrap();
            let tps = t["tokens_per_sec"].as_f64().expect("tokens_per_sec");
            assert_eq!(tps, (1000 * b / (b + 4)) as f64 * 2048.0, "{t}");
        }
    }
    assert!(v["trials"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["outcome"] == "oom"));

    // The recorded trials now drive suggest: measured peaks, OOM boundary.
    let s = env.json(
        &args(
            &["suggest"],
            &args(MODEL, &args(&gpu, &args(&pins, &["-o", "json"]))),
        ),
        &[],
    );
    // The largest success (20) already peaked above the balanced target:
    // nothing to extrapolate, so plain history, no memory analysis.
    assert_eq!(s["source"], "historical_data", "{s}");
    assert!(s["reasoning"].as_str().unwrap().contains("already peaked"));
    // The largest success (20, found by the search) was measured over the
    // balanced target, so balanced suggests the largest batch that meets
    // it instead (issue 40), below 20 and the OOM at 21.
    let m = s["micro_batch_size"].as_u64().unwrap();
    assert!((1..20).contains(&m), "{s}");
    assert!(s["memory_fraction"].as_f64().unwrap() <= 0.85, "{s}");
    // Conservative (70 %) follows the learned line, not the model's.
    let c = env.json(
        &args(
            &["suggest", "--strategy", "conservative"],
            &args(MODEL, &args(&gpu, &args(&pins, &["-o", "json"]))),
        ),
        &[],
    );
    let mc = c["micro_batch_size"].as_u64().unwrap();
    let expected = ((0.70 * cap_mb - tf) / ts).floor() as u64;
    assert!(
        mc <= expected && mc + 1 >= expected,
        "learned line gives {expected} at 70 %, got {mc}: {c}"
    );
    // Aggressive, 93 % target, is capped by the recorded OOM at 21 and the
    // largest success 20.
    let a = env.json(
        &args(
            &["suggest", "--strategy", "aggressive"],
            &args(MODEL, &args(&gpu, &args(&pins, &["-o", "json"]))),
        ),
        &[],
    );
    assert!(a["micro_batch_size"].as_u64().unwrap() <= 20);
    assert!(a["micro_batch_size"].as_u64().unwrap() >= m);
}

#[test]
fn find_max_batch_stops_on_a_failure_that_is_not_an_oom() {
    let env = Env::new();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fake_train.sh");
    let cmd = format!("sh {} {{batch}}", script.display());
    let out = env.run(
        &args(
            &[
                "find-max-batch",
                "--cmd",
                cmd.as_str(),
                "--steps",
                "1",
                "--no-record",
            ],
            &args(MODEL, &["--gpu", A100]),
        ),
        &[("FAKE_MODE", "crash".to_string())],
    );
    assert!(!out.status.success());
    let t = text(&out);
    assert!(t.contains("without a CUDA out-of-memory error"), "{t}");
    assert!(
        t.contains("FileNotFoundError"),
        "the output tail is shown: {t}"
    );
}

#[test]
fn find_max_batch_kills_a_trial_over_its_time_limit() {
    let env = Env::new();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fake_train.sh");
    let cmd = format!("sh {} {{batch}}", script.display());
    let started = Instant::now();
    let out = env.run(
        &args(
            &[
                "find-max-batch",
                "--cmd",
                cmd.as_str(),
                "--timeout",
                "1s",
                "--no-record",
            ],
            &args(MODEL, &["--gpu", A100]),
        ),
        &[("FAKE_MODE", "hang".to_string())],
    );
    assert!(!out.status.success());
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "killed at the limit"
    );
    assert!(text(&out).contains("raise --timeout"), "{}", text(&out));
}
