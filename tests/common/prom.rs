//! A REAL Prometheus (Debian's `prometheus` binary, loopback, 1 s scrapes)
//! scraping a real `gpufit sidecar --backend simulate`, whose simulated
//! training processes set each pod's GPU memory: for the tests that read
//! peaks the way the controller does in a cluster.
//!
//! Needs `prometheus` on PATH (`apt-get install -y --no-install-recommends
//! prometheus`; scripts/test.sh installs it). Without it the tests fail with
//! that instruction — they are never skipped.

// Each consumer uses part of this module.
#![allow(dead_code)]

use std::io::Read;
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

pub const GIB: u64 = 1 << 30;

/// A child process killed (and reaped) when dropped.
pub struct Proc {
    child: Child,
    what: &'static str,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    fn stderr_tail(&mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let mut s = String::new();
        if let Some(e) = self.child.stderr.as_mut() {
            let _ = e.read_to_string(&mut s);
        }
        format!(
            "{} stderr: {}",
            self.what,
            &s[s.len().saturating_sub(2000)..]
        )
    }
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

fn prometheus_binary() -> String {
    let found = Command::new("sh")
        .args(["-c", "command -v prometheus"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    match found {
        Some(p) if !p.is_empty() => p,
        _ => panic!(
            "the `prometheus` binary is missing: install it with `apt-get install -y --no-install-recommends prometheus` (scripts/test.sh does)"
        ),
    }
}

fn http_ok(url: &str) -> bool {
    ureq::get(url)
        .timeout(Duration::from_millis(500))
        .call()
        .is_ok()
}

/// Polls `f` every 100 ms until it holds; panics naming `what` after `timeout`.
pub fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("{what} not ready within {timeout:?}");
}

/// `gpufit sidecar --backend simulate` with two simulated A100s on node `gpu-1`.
pub fn start_sidecar() -> (Proc, SocketAddr) {
    let port = free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_gpufit"))
        .args([
            "sidecar",
            "--backend",
            "simulate",
            "--simulate-gpus",
            "2",
            "--simulate-model",
            "NVIDIA A100-SXM4-80GB",
            "--node",
            "gpu-1",
            "--listen",
            &addr.to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start gpufit sidecar");
    let mut p = Proc {
        child,
        what: "sidecar",
    };
    let url = format!("http://{addr}/healthz");
    let start = Instant::now();
    while !http_ok(&url) {
        if start.elapsed() > Duration::from_secs(20) {
            panic!("sidecar not ready: {}", p.stderr_tail());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    (p, addr)
}

/// Prometheus scraping `target` every second, its data under `dir`.
pub fn start_prometheus(target: SocketAddr, dir: &std::path::Path) -> (Proc, SocketAddr) {
    let bin = prometheus_binary();
    let port = free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let cfg = dir.join("prometheus.yml");
    std::fs::write(
        &cfg,
        format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nscrape_configs:\n  - job_name: gpufit-sidecar\n    static_configs:\n      - targets: ['{target}']\n"
        ),
    )
    .expect("write prometheus.yml");
    let child = Command::new(bin)
        .arg(format!("--config.file={}", cfg.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address={addr}"))
        .arg("--storage.tsdb.retention.time=1h")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start prometheus");
    let mut p = Proc {
        child,
        what: "prometheus",
    };
    let url = format!("http://{addr}/-/ready");
    let start = Instant::now();
    while !http_ok(&url) {
        if start.elapsed() > Duration::from_secs(30) {
            panic!("prometheus not ready: {}", p.stderr_tail());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    (p, addr)
}

/// A simulated training process `pid` of pod `ns/pod` now using `bytes` on GPU 0.
pub fn simulate(sidecar: SocketAddr, pid: u32, ns: &str, pod: &str, bytes: u64) {
    ureq::post(&format!("http://{sidecar}/v1/simulate/processes"))
        .timeout(Duration::from_secs(5))
        .send_json(json!({"pid": pid, "gpu": 0, "job": {"namespace": ns, "pod": pod}, "memory_bytes": bytes}))
        .expect("simulate a process");
}

/// The simulated process `pid` exits.
pub fn end_process(sidecar: SocketAddr, pid: u32) {
    ureq::delete(&format!("http://{sidecar}/v1/simulate/processes/{pid}"))
        .timeout(Duration::from_secs(5))
        .call()
        .expect("end the process");
}
