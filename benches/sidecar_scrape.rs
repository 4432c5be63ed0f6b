//! Sidecar cost with the simulate backend, 8 GPUs and 64 tracked processes:
//! `/metrics` scrape latency (median, p99), the sidecar's CPU at the default
//! sampling interval, and its resident memory. Run:
//!
//!     cargo bench --bench sidecar_scrape
//!
//! Targets (issue 4): scrape p99 ≤ 5 ms, CPU ≤ 2 % of one core, RSS ≤ 30 MiB.
//! The sidecar is the real release binary, spawned on loopback; CPU comes
//! from its /proc/<pid>/stat (utime + stime), memory from /proc/<pid>/status.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_gpufit");
const GPUS: u32 = 8;
const PROCESSES: u32 = 64;
const SCRAPES: usize = 2000;
const CPU_WINDOW: Duration = Duration::from_secs(20);

struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("sidecar /proc stat");
    // Fields after the `(comm)`: state is field 3; utime 14, stime 15.
    let after = &stat[stat.rfind(')').expect("stat has (comm)") + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    f[11].parse::<u64>().expect("utime") + f[12].parse::<u64>().expect("stime")
}

fn status_kib(pid: u32, key: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("sidecar status");
    status
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .expect("status field")
}

fn clk_tck() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn main() {
    let mut child = Command::new(BIN)
        .args([
            "sidecar",
            "--backend",
            "simulate",
            "--simulate-gpus",
            &GPUS.to_string(),
            "--listen",
            "127.0.0.1:0",
            "--node",
            "bench-node",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the release gpufit binary");
    let pid = child.id();
    let stderr = child.stderr.take().expect("piped stderr");
    let guard = Guard(child);
    let mut lines = BufReader::new(stderr).lines();
    let base = loop {
        let line = lines
            .next()
            .expect("sidecar printed its address")
            .expect("readable stderr");
        if let Some(i) = line.find("listening on http://") {
            break line[i + "listening on ".len()..].trim().to_string();
        }
    };
    // Keep draining stderr so the sidecar never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines.by_ref() {});

    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(10))
        .build();
    for i in 0..PROCESSES {
        // Half pods, half Slurm jobs: one job per process, the most series.
        let job = if i % 2 == 0 {
            serde_json::json!({"namespace": "bench", "pod": format!("train-{i}")})
        } else {
            serde_json::json!({"slurm_job_id": format!("{}", 10_000 + i)})
        };
        agent
            .post(&format!("{base}/v1/simulate/processes"))
            .send_json(serde_json::json!({
                "pid": 100_000 + i, "gpu": i % GPUS, "job": job,
                "memory_bytes": (u64::from(i) + 1) << 28,
            }))
            .expect("register a simulated process");
    }

    let url = format!("{base}/metrics");
    let mut body_len = 0;
    for _ in 0..100 {
        body_len = agent
            .get(&url)
            .call()
            .expect("scrape")
            .into_string()
            .expect("body")
            .len();
    }
    let mut lat_ms = Vec::with_capacity(SCRAPES);
    for _ in 0..SCRAPES {
        let t = Instant::now();
        let text = agent
            .get(&url)
            .call()
            .expect("scrape")
            .into_string()
            .expect("body");
        lat_ms.push(t.elapsed().as_secs_f64() * 1e3);
        assert!(text.contains("gpufit_job_gpu_memory_peak_bytes{"));
    }
    lat_ms.sort_by(f64::total_cmp);
    let series = agent
        .get(&url)
        .call()
        .expect("scrape")
        .into_string()
        .expect("body")
        .lines()
        .filter(|l| l.starts_with("gpufit_"))
        .count();

    // CPU at the default interval, with one scrape a second (a busy Prometheus).
    let t0 = Instant::now();
    let c0 = cpu_ticks(pid);
    while t0.elapsed() < CPU_WINDOW {
        std::thread::sleep(Duration::from_secs(1));
        agent
            .get(&url)
            .call()
            .expect("scrape")
            .into_string()
            .expect("body");
    }
    let ticks = cpu_ticks(pid) - c0;
    let cpu_pct = ticks as f64 / clk_tck() / t0.elapsed().as_secs_f64() * 100.0;
    let rss_kib = status_kib(pid, "VmRSS:");
    let hwm_kib = status_kib(pid, "VmHWM:");
    drop(guard);

    println!("sidecar_scrape: simulate backend, {GPUS} GPUs, {PROCESSES} processes ({PROCESSES} jobs), {series} series, {body_len} bytes/scrape");
    println!(
        "  /metrics latency over {SCRAPES} scrapes (client-side, keep-alive): median {:.3} ms, p99 {:.3} ms, max {:.3} ms   [target p99 <= 5 ms: {}]",
        pct(&lat_ms, 0.5),
        pct(&lat_ms, 0.99),
        lat_ms[lat_ms.len() - 1],
        if pct(&lat_ms, 0.99) <= 5.0 { "PASS" } else { "FAIL" }
    );
    println!(
        "  CPU over {:.1} s at the default 100 ms interval + 1 scrape/s: {:.2} % of one core ({ticks} ticks)   [target <= 2 %: {}]",
        CPU_WINDOW.as_secs_f64(),
        cpu_pct,
        if cpu_pct <= 2.0 { "PASS" } else { "FAIL" }
    );
    println!(
        "  RSS {:.1} MiB (peak {:.1} MiB)   [target <= 30 MiB: {}]",
        rss_kib as f64 / 1024.0,
        hwm_kib as f64 / 1024.0,
        if rss_kib <= 30 * 1024 { "PASS" } else { "FAIL" }
    );
}
