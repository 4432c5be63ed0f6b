//! `gpufit controller --no-kubernetes` (the Slurm site's controller) serves
//! `/metrics`, `/healthz` and `/readyz` like Kubernetes mode, counts the
//! suggestions, OOMs and prediction errors of its Slurm API, and stops on
//! SIGTERM (systemd's stop signal) promptly.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_gpufit");

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(5))
        .build()
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn slurm_mode_serves_metrics_and_readiness_counts_its_work_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("token"), "t0k3n").unwrap();
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let mut child = Command::new(BIN)
        .args(["controller", "--no-kubernetes", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .arg("--history")
        .arg(format!("sqlite:{}", dir.path().join("h.db").display()))
        .arg("--token-file")
        .arg(dir.path().join("token"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while agent().get(&format!("{base}/readyz")).call().is_err() {
        assert!(Instant::now() < deadline, "/readyz never answered 200");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        agent()
            .get(&format!("{base}/healthz"))
            .call()
            .unwrap()
            .status(),
        200
    );

    // A suggestion and an OOM run through the Slurm API are counted.
    let sug = agent()
        .post(&format!("{base}/v1/suggest"))
        .send_json(serde_json::json!({
            "workload": {"model": "meta-llama/Llama-3.1-8B", "method": "lora", "lora_rank": 16, "seq_len": 2048},
            "gpu": "NVIDIA A100-SXM4-80GB"
        }));
    assert!(sug.is_ok(), "{:?}", sug.err());
    let run = serde_json::json!({
        "id": null, "timestamp": chrono::Utc::now(), "cluster": "s", "node": "n1", "source": "slurm",
        "job_id": "77", "model": "meta-llama/Llama-3.1-8B", "method": "lora",
        "gpu_model": "NVIDIA A100-SXM4-80GB", "seq_len": 2048, "lora_rank": 16, "gpus": 1,
        "global_batch": null,
        "settings": {"micro_batch_size": 16, "gradient_accumulation_steps": 1, "dtype": "bf16",
            "activation_checkpointing": false, "activation_offloading": false, "compile": false,
            "dataloader": {"num_workers": 1, "pin_memory": true, "persistent_workers": true, "prefetch_factor": 2}},
        "result": {"success": false, "failure_reason": "OOM", "peak_memory_bytes": null,
            "samples_per_sec": null, "tokens_per_sec": null, "duration_sec": 12.0},
        "predicted_peak_bytes": 70000000000u64
    });
    let posted = agent()
        .post(&format!("{base}/v1/runs"))
        .set("Authorization", "Bearer t0k3n")
        .send_json(run);
    assert!(posted.is_ok(), "{:?}", posted.err());
    let text = agent()
        .get(&format!("{base}/metrics"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    assert!(
        metric(&text, "gpufit_controller_suggestions_total") >= 1.0,
        "{text}"
    );
    assert_eq!(metric(&text, "gpufit_controller_ooms_total"), 1.0, "{text}");

    // SIGTERM: gone within 5 s.
    let t = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "{status:?}");
            break;
        }
        if t.elapsed() > Duration::from_secs(5) {
            let _ = child.kill();
            let mut err = String::new();
            let _ = child.stderr.take().unwrap().read_to_string(&mut err);
            panic!("still running 5 s after SIGTERM: {err}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Kubernetes mode against an API server that never answers (unreachable,
/// or RBAC missing): the caches never fill, and a SIGTERM must still stop
/// the controller within a pod's grace period.
#[test]
fn sigterm_stops_a_controller_still_waiting_for_its_caches() {
    let dir = tempfile::tempdir().unwrap();
    // A listener that accepts and never answers: the watches hang.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let api_port = silent.local_addr().unwrap().port();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: http://127.0.0.1:{api_port}\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: u\ncurrent-context: c\nusers:\n- name: u\n  user:\n    token: x\n"
        ),
    )
    .unwrap();
    let port = free_port();
    let mut child = Command::new(BIN)
        .args(["controller", "--no-leader-election", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .arg("--history")
        .arg(format!("sqlite:{}", dir.path().join("h.db").display()))
        .env("KUBECONFIG", &kubeconfig)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Up (its HTTP port answers) but not ready.
    let deadline = Instant::now() + Duration::from_secs(30);
    while agent()
        .get(&format!("http://127.0.0.1:{port}/healthz"))
        .call()
        .is_err()
    {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the controller exited early"
        );
        assert!(Instant::now() < deadline, "/healthz never answered");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        child.try_wait().unwrap().is_none(),
        "still waiting for caches"
    );
    let t = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if t.elapsed() > Duration::from_secs(5) {
            let _ = child.kill();
            let mut err = String::new();
            let _ = child.stderr.take().unwrap().read_to_string(&mut err);
            panic!("still running 5 s after SIGTERM: {err}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(silent);
}
