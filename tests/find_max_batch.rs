//! `gpufit find-max-batch` against fake trial scripts: a signal mid-trial
//! stops the trial's whole process group, and trials are recorded with the
//! checkpointing / compile they were really told.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_gpufit");

const WORKLOAD: &[&str] = &[
    "--model",
    "meta-llama/Llama-3.1-8B",
    "--method",
    "lora",
    "--lora-rank",
    "16",
    "--seq-len",
    "2048",
    "--gpu",
    "NVIDIA A100-SXM4-80GB",
];

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
        .args(WORKLOAD)
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
        .args(WORKLOAD)
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
