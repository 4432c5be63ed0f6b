//! The `gpufit` binary run as a user would, for the CLI test files: a
//! private temp directory for HOME and the history, a time limit, JSON out.

// Each consumer uses part of this module.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_gpufit");

pub const MODEL: &[&str] = &[
    "--model",
    "meta-llama/Llama-3.1-8B",
    "--method",
    "lora",
    "--lora-rank",
    "16",
    "--seq-len",
    "2048",
];

pub const A100: &str = "NVIDIA A100-SXM4-80GB";

pub struct Env {
    pub dir: tempfile::TempDir,
}

impl Env {
    pub fn new() -> Env {
        Env {
            dir: tempfile::tempdir().expect("temp dir"),
        }
    }

    pub fn history(&self) -> String {
        format!("sqlite:{}", self.dir.path().join("history.db").display())
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Runs gpufit with a private history and HOME, killed after 60 s.
    pub fn run(&self, args: &[&str], extra_env: &[(&str, String)]) -> Output {
        let mut c = Command::new(BIN);
        c.args(args)
            .env("GPUFIT_HISTORY", self.history())
            .env("HOME", self.dir.path())
            .env("XDG_DATA_HOME", self.dir.path())
            .env_remove("GPUFIT_OUTPUT")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in extra_env {
            c.env(k, v);
        }
        let mut child = c.spawn().expect("gpufit starts");
        let started = Instant::now();
        loop {
            if child.try_wait().expect("wait").is_some() {
                break;
            }
            if started.elapsed() > Duration::from_secs(60) {
                let _ = child.kill();
                panic!("gpufit {args:?} did not finish within 60 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        child.wait_with_output().expect("output")
    }

    pub fn json(&self, args: &[&str], extra_env: &[(&str, String)]) -> Value {
        let out = self.run(args, extra_env);
        assert!(
            out.status.success(),
            "gpufit {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "gpufit {args:?} printed no JSON ({e}): {}",
                String::from_utf8_lossy(&out.stdout)
            )
        })
    }
}

pub fn args<'a>(base: &[&'a str], more: &[&'a str]) -> Vec<&'a str> {
    base.iter().chain(more.iter()).copied().collect()
}

pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}
