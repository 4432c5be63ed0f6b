//! Every panel query of every Grafana dashboard in `charts/gpufit/dashboards/`
//! evaluated through a REAL Prometheus (Debian's `prometheus`, loopback)
//! scraping a `gpufit sidecar --backend simulate` and a `gpufit controller
//! --no-kubernetes` that served suggestions and recorded runs (one an OOM,
//! each with its prediction). Grafana's `$__range`, `$__rate_interval`,
//! `$__interval`, `$__interval_ms` and the template variables are substituted. A query error
//! or a panel without data fails the test, except the panels listed in
//! [`KUBERNETES_ONLY`] with the reason.

use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpufit::core::run::RUN_PATHS;
use serde_json::{json, Value};

/// Panels whose metrics only a controller in Kubernetes mode produces (its
/// reconcile loop and its admission webhook need an API server, which
/// cannot run here; their metrics are tested over the mocked API in
/// tests/controller.rs and tests/webhook.rs).
const KUBERNETES_ONLY: &[(&str, &str)] = &[
    ("Reconciles", "reconciles need a Kubernetes API server"),
    (
        "Reconcile duration p99",
        "reconciles need a Kubernetes API server",
    ),
    (
        "Webhook admissions by result",
        "the admission webhook needs a Kubernetes API server",
    ),
    (
        "Webhook latency p99",
        "the admission webhook needs a Kubernetes API server",
    ),
];

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
}

fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(5))
        .build()
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

fn spawn(cmd: &mut Command) -> Proc {
    Proc(
        cmd.stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start a process"),
    )
}

/// Every (dashboard, panel title, query) of the chart's dashboards.
fn panel_queries() -> Vec<(String, String, String)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("charts/gpufit/dashboards");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("dashboards dir") {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        let d: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        for p in d["panels"].as_array().into_iter().flatten() {
            for t in p["targets"].as_array().into_iter().flatten() {
                if let Some(expr) = t["expr"].as_str() {
                    out.push((
                        name.clone(),
                        p["title"].as_str().unwrap_or("").to_string(),
                        expr.to_string(),
                    ));
                }
            }
        }
    }
    out
}

/// Grafana's built-in and template variables, as a dashboard over the last
/// 5 minutes with "All" selected would send them.
fn substitute(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m")
        .replace("$__interval_ms", "1000")
        .replace("$__interval", "1s")
        .replace("$__range", "5m")
        .replace("$model", ".*")
        .replace("$node", ".*")
}

fn run_json(job: &str, oom: bool) -> Value {
    json!({
        "id": null, "timestamp": chrono::Utc::now(), "cluster": "site", "node": "gpu-1",
        "source": "slurm", "job_id": job, "model": "meta-llama/Llama-3.1-8B", "method": "lora",
        "gpu_model": "NVIDIA A100-SXM4-80GB", "seq_len": 2048, "lora_rank": 16, "gpus": 1,
        "global_batch": null,
        "settings": {"micro_batch_size": if oom { 16 } else { 4 }, "gradient_accumulation_steps": 1,
            "dtype": "bf16", "activation_checkpointing": false, "activation_offloading": false,
            "compile": false, "dataloader": {"num_workers": 1, "pin_memory": true,
            "persistent_workers": true, "prefetch_factor": 2}},
        "result": {"success": !oom, "failure_reason": if oom { json!("OOM") } else { Value::Null },
            "peak_memory_bytes": if oom { Value::Null } else { json!(41_000_000_000u64) },
            "samples_per_sec": null,
            "tokens_per_sec": if oom { Value::Null } else { json!(9_000.0) }, "duration_sec": 600.0},
        "predicted_peak_bytes": 43_000_000_000u64
    })
}

#[test]
fn every_dashboard_panel_returns_data_from_a_real_prometheus() {
    let dir = tempfile::tempdir().unwrap();
    let bin = env!("CARGO_BIN_EXE_gpufit");
    // The node's sidecar, with a training job using > 1 GiB.
    let sidecar = free_addr();
    let _s = spawn(Command::new(bin).args([
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
        &sidecar.to_string(),
    ]));
    wait_for("sidecar", Duration::from_secs(20), || {
        agent()
            .get(&format!("http://{sidecar}/healthz"))
            .call()
            .is_ok()
    });
    agent()
        .post(&format!("http://{sidecar}/v1/simulate/processes"))
        .send_json(
            json!({"pid": 4242, "gpu": 0, "job": {"namespace": "ml", "pod": "train-0"},
                          "memory_bytes": 30u64 << 30}),
        )
        .expect("simulate a training process");
    // The site's controller (Slurm mode).
    std::fs::write(dir.path().join("token"), "tok").unwrap();
    let controller = free_addr();
    let _c = spawn(
        Command::new(bin)
            .args([
                "controller",
                "--no-kubernetes",
                "--listen",
                &controller.to_string(),
            ])
            .arg("--history")
            .arg(format!("sqlite:{}", dir.path().join("h.db").display()))
            .arg("--token-file")
            .arg(dir.path().join("token")),
    );
    wait_for("controller", Duration::from_secs(20), || {
        agent()
            .get(&format!("http://{controller}/readyz"))
            .call()
            .is_ok()
    });
    // Prometheus scraping both every second.
    let prom = free_addr();
    let cfg = dir.path().join("prometheus.yml");
    std::fs::write(
        &cfg,
        format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nscrape_configs:\n  - job_name: sidecar\n    static_configs: [{{targets: ['{sidecar}']}}]\n  - job_name: controller\n    static_configs: [{{targets: ['{controller}']}}]\n"
        ),
    )
    .unwrap();
    let _p = spawn(
        Command::new("prometheus")
            .arg(format!("--config.file={}", cfg.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={prom}")),
    );
    wait_for(
        "prometheus (`apt-get install prometheus`; scripts/test.sh does)",
        Duration::from_secs(30),
        || {
            agent()
                .get(&format!("http://{prom}/-/ready"))
                .call()
                .is_ok()
        },
    );
    // Let Prometheus see every counter at zero-or-absent first, then drive
    // the scenario: suggestions, runs with predictions, an OOM.
    std::thread::sleep(Duration::from_secs(3));
    for strategy in ["conservative", "balanced", "aggressive"] {
        agent()
            .post(&format!("http://{controller}/v1/suggest"))
            .send_json(json!({
                "workload": {"model": "meta-llama/Llama-3.1-8B", "method": "lora", "lora_rank": 16, "seq_len": 2048},
                "gpu": "NVIDIA A100-SXM4-80GB", "strategy": strategy
            }))
            .expect("a suggestion");
    }
    for (job, oom) in [("101", false), ("102", true), ("103", false)] {
        agent()
            .post(&format!("http://{controller}/v1/runs"))
            .set("Authorization", "Bearer tok")
            .send_json(run_json(job, oom))
            .expect("a run recorded");
        std::thread::sleep(Duration::from_millis(1200));
    }
    // Enough scrapes after the scenario for rate() and increase() windows.
    std::thread::sleep(Duration::from_secs(4));

    let queries = panel_queries();
    assert!(
        queries.len() >= 18,
        "dashboards lost panels: {}",
        queries.len()
    );
    let mut empty = Vec::new();
    let mut skipped = Vec::new();
    // (panel, `path` label value) of every series that has one.
    let mut paths: Vec<(String, String)> = Vec::new();
    for (dash, title, expr) in &queries {
        let q = substitute(expr);
        let resp: Value = agent()
            .get(&format!("http://{prom}/api/v1/query"))
            .query("query", &q)
            .call()
            .unwrap_or_else(|e| panic!("{dash} / {title}: query failed: {e}: {q}"))
            .into_json()
            .unwrap();
        assert_eq!(resp["status"], "success", "{dash} / {title}: {resp}");
        let n = resp["data"]["result"].as_array().map_or(0, Vec::len);
        for series in resp["data"]["result"].as_array().into_iter().flatten() {
            if let Some(p) = series["metric"]["path"].as_str() {
                paths.push((title.clone(), p.to_string()));
            }
        }
        if n == 0 {
            match KUBERNETES_ONLY.iter().find(|(t, _)| t == title) {
                Some((_, why)) => skipped.push(format!("{title}: {why}")),
                None => empty.push(format!("{dash} / {title}: {q}")),
            }
        }
    }
    eprintln!(
        "{} panel queries evaluated; without data only in Kubernetes mode: {skipped:?}",
        queries.len()
    );
    assert!(empty.is_empty(), "panels without data: {empty:#?}");
    // One vocabulary: every `path` a panel shows is one `gpufit report`
    // uses, and the Slurm Epilog's runs and the Prolog's suggestions are
    // `slurm` on both panels, as the report calls them.
    let foreign: Vec<_> = paths
        .iter()
        .filter(|(_, p)| !RUN_PATHS.contains(&p.as_str()))
        .collect();
    assert!(
        foreign.is_empty(),
        "paths gpufit report does not know: {foreign:?}"
    );
    for panel in ["Recorded runs by path", "Suggestions by path"] {
        assert!(
            paths.iter().any(|(t, p)| t == panel && p == "slurm"),
            "{panel}: no slurm series in {paths:?}"
        );
    }
}
