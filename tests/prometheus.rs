//! The controller's Prometheus client against a REAL Prometheus server (the
//! Debian `prometheus` binary, started here on loopback) scraping a real
//! `gpufit sidecar --backend simulate`: a simulated training pod's memory
//! rises to a peak and falls, and the controller's PromQL reads the peak.
//! Also: the sidecar fallback, and a Prometheus that never answers.
//!
//! Needs `prometheus` on PATH (`apt-get install -y --no-install-recommends
//! prometheus`; scripts/test.sh installs it). Without it the tests fail with
//! that instruction — they are never skipped.

use std::io::Read;
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpufit::controller::prom::{render_query, PromClient, PromError, DEFAULT_PEAK_QUERY};
use gpufit::controller::reconcile::{PeakQuery, PeakReader, PodRef, PromThenSidecar};
use gpufit::controller::sidecar_client::SidecarClient;
use serde_json::json;

const GIB: u64 = 1 << 30;

/// A child process killed (and reaped) when dropped.
struct Proc {
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

fn free_port() -> u16 {
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

fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("{what} not ready within {timeout:?}");
}

fn start_sidecar() -> (Proc, SocketAddr) {
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

fn start_prometheus(target: SocketAddr, dir: &std::path::Path) -> (Proc, SocketAddr) {
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

fn simulate(sidecar: SocketAddr, pid: u32, ns: &str, pod: &str, bytes: u64) {
    ureq::post(&format!("http://{sidecar}/v1/simulate/processes"))
        .timeout(Duration::from_secs(5))
        .send_json(json!({"pid": pid, "gpu": 0, "job": {"namespace": ns, "pod": pod}, "memory_bytes": bytes}))
        .expect("simulate a process");
}

fn end_process(sidecar: SocketAddr, pid: u32) {
    ureq::delete(&format!("http://{sidecar}/v1/simulate/processes/{pid}"))
        .timeout(Duration::from_secs(5))
        .call()
        .expect("end the process");
}

#[test]
fn the_controller_reads_a_finished_pods_peak_from_a_real_prometheus_scraping_the_sidecar() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (_sidecar, sc) = start_sidecar();
    let (_prom, pa) = start_prometheus(sc, dir.path());

    let pod = "llama-lora-1-x7k2p";
    let t0 = Instant::now();
    for gib in [10, 30, 42] {
        simulate(sc, 4242, "ml", pod, gib * GIB);
    }
    // Prometheus must scrape the peak at least once (1 s interval).
    std::thread::sleep(Duration::from_millis(2500));
    simulate(sc, 4242, "ml", pod, 20 * GIB);
    end_process(sc, 4242);
    // Another pod of another job must not leak into this job's peak.
    simulate(sc, 5151, "ml", "other-job-1-aaaaa", 70 * GIB);

    let client = PromClient::new(&format!("http://{pa}"), Duration::from_secs(5));
    let q = render_query(
        DEFAULT_PEAK_QUERY,
        "ml",
        "llama-lora-1",
        &[pod.to_string()],
        Duration::from_secs(300),
    );
    let mut peak = None;
    wait_for("the scraped peak", Duration::from_secs(30), || {
        peak = client.query_max(&q, None).expect("query succeeds");
        peak.is_some()
    });
    assert_eq!(peak, Some((42 * GIB) as f64), "query: {q}");

    // The same through the controller's peak reader (Prometheus first).
    let reader = PromThenSidecar {
        prom: Some(client),
        query_template: DEFAULT_PEAK_QUERY.to_string(),
        sidecar: None,
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let measured = reader
        .job_peak(&PeakQuery {
            namespace: "ml".into(),
            job: "llama-lora-1".into(),
            pods: vec![],
            start: Some(now - t0.elapsed().as_secs_f64() - 5.0),
            end: Some(now),
        })
        .expect("reader answers")
        .expect("a peak");
    assert_eq!(measured.bytes, 42 * GIB);
    assert_eq!(measured.source, "prometheus");
}

#[test]
fn without_prometheus_data_the_peak_comes_from_the_sidecar() {
    let (_sidecar, sc) = start_sidecar();
    for gib in [8, 24, 12] {
        simulate(sc, 77, "ml", "train-2-abcde", gib * GIB);
    }
    end_process(sc, 77);
    // A Prometheus that is not there: the reader falls back to the sidecar.
    let dead = free_port();
    let reader = PromThenSidecar {
        prom: Some(PromClient::new(
            &format!("http://127.0.0.1:{dead}"),
            Duration::from_secs(1),
        )),
        query_template: DEFAULT_PEAK_QUERY.to_string(),
        sidecar: Some(SidecarClient::new(
            &format!("http://{{host_ip}}:{}", sc.port()),
            Duration::from_secs(2),
        )),
    };
    let measured = reader
        .job_peak(&PeakQuery {
            namespace: "ml".into(),
            job: "train-2".into(),
            pods: vec![PodRef {
                name: "train-2-abcde".into(),
                node: Some("gpu-1".into()),
                host_ip: Some("127.0.0.1".into()),
            }],
            start: None,
            end: None,
        })
        .expect("the sidecar answers")
        .expect("a peak");
    assert_eq!(measured.bytes, 24 * GIB);
    assert_eq!(measured.source, "sidecar");
}

#[test]
fn a_prometheus_that_never_answers_times_out_with_a_clear_error() {
    // Accepts connections, never replies.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().unwrap();
    let hold = std::thread::spawn(move || {
        let conns: Vec<_> = listener.incoming().take(1).filter_map(Result::ok).collect();
        std::thread::sleep(Duration::from_secs(3));
        drop(conns);
    });
    let client = PromClient::new(&format!("http://{addr}"), Duration::from_millis(500));
    let start = Instant::now();
    let err = client.query("up", None).expect_err("must time out");
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "took {:?}",
        start.elapsed()
    );
    assert!(matches!(err, PromError::Timeout { .. }), "{err:?}");
    assert!(err.to_string().contains("did not answer"), "{err}");
    let _ = hold.join();
}

#[test]
fn a_bad_query_is_reported_with_prometheus_own_message() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (_sidecar, sc) = start_sidecar();
    let (_prom, pa) = start_prometheus(sc, dir.path());
    let client = PromClient::new(&format!("http://{pa}"), Duration::from_secs(5));
    let err = client.query("max(", None).expect_err("bad PromQL");
    match err {
        PromError::Query {
            status, message, ..
        } => {
            assert_eq!(status, "bad_data");
            assert!(!message.is_empty());
        }
        other => panic!("expected a query error, got {other:?}"),
    }
}
