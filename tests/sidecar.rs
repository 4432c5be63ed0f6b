//! `gpufit sidecar` end to end: the real binary on loopback, driven over HTTP.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_gpufit");
const GIB: u64 = 1 << 30;

/// A sidecar process, killed on drop.
struct Sidecar {
    child: Child,
    base: String,
    _stderr: mpsc::Receiver<String>,
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `gpufit sidecar` on a free port (port 0; the bound address is read
/// from its start-up line on stderr).
fn start(args: &[&str], env: &[(&str, &str)]) -> Sidecar {
    start_cmd(Command::new(BIN), args, env)
}

/// [`start`] through a given command (a shell that sets limits, then execs gpufit).
fn start_cmd(mut cmd: Command, args: &[&str], env: &[(&str, &str)]) -> Sidecar {
    cmd.arg("sidecar")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if !args.contains(&"--listen") && !env.iter().any(|(k, _)| *k == "GPUFIT_SIDECAR_LISTEN") {
        cmd.args(["--listen", "127.0.0.1:0"]);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("gpufit binary starts");
    let stderr = child.stderr.take().expect("piped stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    let base = loop {
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(line) => {
                if let Some(i) = line.find("listening on http://") {
                    break line[i + "listening on ".len()..].trim().to_string();
                }
                seen.push(line);
            }
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "sidecar did not start within 30 s; stderr:\n{}",
                    seen.join("\n")
                );
            }
        }
    };
    Sidecar {
        child,
        base,
        _stderr: rx,
    }
}

fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(10))
        .build()
}

/// Any status, with the body.
fn call(method: &str, url: &str, body: Option<Value>) -> (u16, String) {
    let req = agent().request(method, url);
    let res = match body {
        Some(b) => req.send_json(b),
        None => req.call(),
    };
    match res {
        Ok(r) => (r.status(), r.into_string().expect("readable body")),
        Err(ureq::Error::Status(code, r)) => (code, r.into_string().expect("readable body")),
        Err(e) => panic!("{method} {url}: {e}"),
    }
}

/// Like [`call`], with `Authorization: Bearer <token>`.
fn call_auth(method: &str, url: &str, token: &str, body: Value) -> (u16, String) {
    let res = agent()
        .request(method, url)
        .set("Authorization", &format!("Bearer {token}"))
        .send_json(body);
    match res {
        Ok(r) => (r.status(), r.into_string().expect("readable body")),
        Err(ureq::Error::Status(code, r)) => (code, r.into_string().expect("readable body")),
        Err(e) => panic!("{method} {url}: {e}"),
    }
}

/// A token file in a temp dir (kept alive by the returned guard).
fn token_file(token: &str) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("token");
    std::fs::write(&p, format!("{token}\n")).unwrap();
    let path = p.display().to_string();
    (dir, path)
}

fn get_json(url: &str) -> Value {
    let (code, body) = call("GET", url, None);
    assert_eq!(code, 200, "GET {url}: {body}");
    serde_json::from_str(&body).expect("JSON body")
}

fn post(sc: &Sidecar, pid: u32, gpu: u32, job: Value, bytes: u64) -> Value {
    let (code, body) = call(
        "POST",
        &format!("{}/v1/simulate/processes", sc.base),
        Some(json!({"pid": pid, "gpu": gpu, "job": job, "memory_bytes": bytes})),
    );
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).expect("JSON body")
}

/// The value of the one series of `name` whose label set contains every `labels` pair.
fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .find(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[test]
fn pod_job_that_rises_peaks_and_falls_keeps_its_peak_in_the_api_and_the_metrics() {
    let sc = start(
        &[
            "--backend",
            "simulate",
            "--simulate-gpus",
            "8",
            "--node",
            "sim-node",
        ],
        &[],
    );
    let job = json!({"namespace": "team-a", "pod": "train-0"});
    for gib in [4u64, 18, 42, 30, 12] {
        let r = post(&sc, 1001, 3, job.clone(), gib * GIB);
        assert_eq!(r["job"]["current_bytes"], gib * GIB);
    }
    let j = get_json(&format!("{}/v1/jobs/team-a/train-0", sc.base));
    assert_eq!(j["id"], "team-a/train-0");
    assert_eq!(j["kind"], "pod");
    assert_eq!(j["running"], true);
    assert_eq!(j["current_bytes"], 12 * GIB);
    assert_eq!(j["peak_bytes"], 42 * GIB);
    assert_eq!(j["method"], "sampled");
    assert_eq!(j["node"], "sim-node");

    let gpus = get_json(&format!("{}/v1/gpus", sc.base));
    assert_eq!(gpus["gpus"].as_array().map(Vec::len), Some(8));
    assert_eq!(gpus["gpus"][3]["memory_used_bytes"], 12 * GIB);
    assert_eq!(gpus["gpus"][2]["memory_used_bytes"], 0);

    let text = call("GET", &format!("{}/metrics", sc.base), None).1;
    let job_labels = [
        ("namespace", "team-a"),
        ("pod", "train-0"),
        ("gpu", "3"),
        ("node", "sim-node"),
    ];
    assert_eq!(
        metric(&text, "gpufit_job_gpu_memory_peak_bytes", &job_labels),
        Some((42 * GIB) as f64),
        "{text}"
    );
    assert_eq!(
        metric(&text, "gpufit_job_gpu_memory_bytes", &job_labels),
        Some((12 * GIB) as f64)
    );
    assert_eq!(
        metric(
            &text,
            "gpufit_gpu_memory_used_bytes",
            &[("gpu", "3"), ("node", "sim-node")]
        ),
        Some((12 * GIB) as f64)
    );
    assert!(
        text.contains("# HELP gpufit_gpu_utilization_ratio "),
        "{text}"
    );

    // The job ends: current drops to 0, the peak survives, in both views.
    let (code, body) = call(
        "DELETE",
        &format!("{}/v1/simulate/processes/1001", sc.base),
        None,
    );
    assert_eq!(code, 200, "{body}");
    let j = get_json(&format!("{}/v1/jobs/team-a%2Ftrain-0", sc.base));
    assert_eq!(j["running"], false);
    assert_eq!(j["current_bytes"], 0);
    assert_eq!(j["peak_bytes"], 42 * GIB);
    assert!(j["ended_at"].is_string());
    let text = call("GET", &format!("{}/metrics", sc.base), None).1;
    assert_eq!(
        metric(&text, "gpufit_job_gpu_memory_peak_bytes", &job_labels),
        Some((42 * GIB) as f64)
    );
    assert_eq!(
        metric(&text, "gpufit_job_gpu_memory_bytes", &job_labels),
        Some(0.0)
    );
}

#[test]
fn slurm_job_on_two_gpus_reports_the_larger_per_gpu_peak_and_a_log_peak_wins() {
    let (_tok, tok_path) = token_file("peak-token");
    let sc = start(
        &[
            "--backend",
            "simulate",
            "--simulate-gpus",
            "2",
            "--token-file",
            &tok_path,
        ],
        &[],
    );
    let job = json!({"slurm_job_id": "4242"});
    post(&sc, 1, 0, job.clone(), 20 * GIB);
    post(&sc, 2, 1, job.clone(), 25 * GIB);
    post(&sc, 2, 1, job.clone(), 5 * GIB);
    let j = get_json(&format!("{}/v1/jobs/4242", sc.base));
    assert_eq!(j["kind"], "slurm");
    assert_eq!(j["slurm_job_id"], "4242");
    assert_eq!(j["peak_bytes"], 25 * GIB);
    assert_eq!(j["current_bytes"], 20 * GIB);
    assert_eq!(j["current_total_bytes"], 25 * GIB);
    assert_eq!(j["gpus"].as_array().map(Vec::len), Some(2));

    let (code, body) = call_auth(
        "POST",
        &format!("{}/v1/jobs/4242/log-peak", sc.base),
        "peak-token",
        json!({"peak_bytes": 26 * GIB}),
    );
    assert_eq!(code, 200, "{body}");
    let j = get_json(&format!("{}/v1/jobs/4242", sc.base));
    assert_eq!(j["peak_bytes"], 26 * GIB);
    assert_eq!(j["method"], "log");
    assert_eq!(j["measured_peak_bytes"], 25 * GIB);
    let text = call("GET", &format!("{}/metrics", sc.base), None).1;
    assert_eq!(
        metric(
            &text,
            "gpufit_job_gpu_memory_peak_bytes",
            &[("slurm_job_id", "4242"), ("method", "log")]
        ),
        Some((26 * GIB) as f64)
    );
    let all = get_json(&format!("{}/v1/jobs", sc.base));
    assert_eq!(all["per_job_data"], true);
    assert_eq!(all["jobs"].as_array().map(Vec::len), Some(1));
}

#[test]
fn unknown_paths_jobs_and_methods_answer_with_json_errors() {
    let (_tok, tok_path) = token_file("t0k");
    let sc = start(&["--backend", "simulate", "--token-file", &tok_path], &[]);
    for (method, path, want) in [
        ("GET", "/nope", 404),
        ("GET", "/v1/jobs/does-not-exist", 404),
        ("GET", "/v1/jobs/ns/missing", 404),
        ("POST", "/v1/gpus", 405),
        ("DELETE", "/v1/simulate/processes/77", 404),
        ("DELETE", "/v1/simulate/processes/not-a-pid", 400),
    ] {
        let (code, body) = call(method, &format!("{}{path}", sc.base), None);
        assert_eq!(code, want, "{method} {path}: {body}");
        let v: Value = serde_json::from_str(&body).expect("error body is JSON");
        assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{body}");
    }
    for (body, what) in [
        (
            json!({"pid": 1, "gpu": 99, "job": {"slurm_job_id": "1"}, "memory_bytes": 1}),
            "gpu 99",
        ),
        (
            json!({"pid": 1, "gpu": 0, "job": {"who": "knows"}, "memory_bytes": 1}),
            "invalid JSON",
        ),
        (
            json!({"pid": 1, "gpu": 0, "job": {"slurm_job_id": "1"}, "memory_bytes": u64::MAX}),
            "more than",
        ),
    ] {
        let (code, text) = call(
            "POST",
            &format!("{}/v1/simulate/processes", sc.base),
            Some(body),
        );
        assert_eq!(code, 400, "{text}");
        assert!(text.contains(what), "{text}");
    }
    // A pod may be called `log-peak`: GET reads it, only POST reports a log peak.
    post(&sc, 9, 0, json!({"namespace": "x", "pod": "log-peak"}), GIB);
    let j = get_json(&format!("{}/v1/jobs/x/log-peak", sc.base));
    assert_eq!(j["peak_bytes"], GIB);
    let (code, body) = call_auth(
        "POST",
        &format!("{}/v1/jobs/x/log-peak", sc.base),
        "t0k",
        json!({"peak": 1}),
    );
    assert_eq!(code, 400, "{body}");
    let health = get_json(&format!("{}/healthz", sc.base));
    assert_eq!(health["status"], "ok");
    assert_eq!(health["backend"], "simulate");
}

#[test]
fn nvml_backend_without_nvml_exits_non_zero_saying_what_was_tried_and_what_to_do() {
    let mut runs = vec![vec!["--nvml-lib", "/nonexistent/libnvidia-ml.so.1"]];
    // The default loader path fails too on a machine without an NVIDIA driver.
    if !std::path::Path::new("/dev/nvidiactl").exists() {
        runs.push(vec![]);
    }
    for extra in runs {
        let out = Command::new(BIN)
            .args(["sidecar", "--backend", "nvml", "--listen", "127.0.0.1:0"])
            .args(&extra)
            .env_remove("GPUFIT_SIDECAR_BACKEND")
            .output()
            .expect("gpufit binary runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(4), "{extra:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
        for want in [
            "libnvidia-ml.so.1",
            "nvidia-smi",
            "LD_LIBRARY_PATH",
            "--backend inventory",
            "--backend simulate",
        ] {
            assert!(err.contains(want), "{extra:?}: missing `{want}` in: {err}");
        }
    }
}

#[test]
fn inventory_backend_serves_declared_gpus_and_no_job_data() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("gpus.yaml");
    std::fs::write(
        &file,
        "gpus:\n  - name: Lab Card\n    count: 3\n    memory_gib: 48\n    compute_capability: \"8.9\"\n",
    )
    .expect("write inventory");
    let sc = start(
        &[
            "--backend",
            "inventory",
            "--inventory",
            file.to_str().expect("utf-8 path"),
        ],
        &[],
    );
    let gpus = get_json(&format!("{}/v1/gpus", sc.base));
    assert_eq!(gpus["backend"], "inventory");
    let list = gpus["gpus"].as_array().expect("gpu list");
    assert_eq!(list.len(), 3);
    assert_eq!(list[2]["memory_total_bytes"], 48 * GIB);
    assert_eq!(list[2]["compute_capability"], "8.9");
    let jobs = get_json(&format!("{}/v1/jobs", sc.base));
    assert_eq!(jobs["per_job_data"], false);
    let (code, body) = call(
        "POST",
        &format!("{}/v1/simulate/processes", sc.base),
        Some(json!({"pid": 1, "gpu": 0, "job": {"slurm_job_id": "1"}, "memory_bytes": 1})),
    );
    assert_eq!(code, 404, "{body}");
    assert!(body.contains("--backend simulate"), "{body}");
}

#[test]
fn every_sidecar_flag_has_a_gpufit_environment_counterpart() {
    let out = Command::new(BIN)
        .args(["sidecar", "--help"])
        .output()
        .expect("gpufit binary runs");
    let help = String::from_utf8_lossy(&out.stdout);
    // Option blocks start with an indented `--flag` (or `-x, --flag`) line.
    let mut blocks: Vec<String> = Vec::new();
    for line in help.lines() {
        let t = line.trim_start();
        if t.starts_with("--") || (t.starts_with('-') && t.get(2..4) == Some(", ")) {
            blocks.push(String::new());
        }
        if let Some(b) = blocks.last_mut() {
            b.push_str(line);
            b.push('\n');
        }
    }
    let flags: Vec<&String> = blocks.iter().filter(|b| !b.contains("--help")).collect();
    assert!(
        flags.len() >= 10,
        "expected the sidecar's flags in:\n{help}"
    );
    for b in flags {
        assert!(
            b.contains("[env: GPUFIT_"),
            "flag without a GPUFIT_ variable:\n{b}"
        );
    }
}

#[test]
fn environment_variables_configure_the_sidecar_like_flags() {
    let sc = start(
        &[],
        &[
            ("GPUFIT_SIDECAR_BACKEND", "simulate"),
            ("GPUFIT_SIDECAR_LISTEN", "127.0.0.1:0"),
            ("GPUFIT_SIDECAR_INTERVAL", "50ms"),
            ("GPUFIT_NODE_NAME", "env-node"),
            ("GPUFIT_SIDECAR_SIMULATE_GPUS", "3"),
            ("GPUFIT_SIDECAR_SIMULATE_MODEL", "Custom Sim"),
            ("GPUFIT_SIDECAR_SIMULATE_MEMORY_GIB", "16"),
        ],
    );
    let gpus = get_json(&format!("{}/v1/gpus", sc.base));
    assert_eq!(gpus["node"], "env-node");
    assert_eq!(gpus["gpus"].as_array().map(Vec::len), Some(3));
    assert_eq!(gpus["gpus"][0]["name"], "Custom Sim");
    assert_eq!(gpus["gpus"][0]["memory_total_bytes"], 16 * GIB);
}

#[test]
fn bad_flags_are_usage_errors_not_panics() {
    for args in [
        vec!["--backend", "simulate", "--interval", "1ms"],
        vec!["--backend", "inventory"],
        vec!["--backend", "simulate", "--simulate-gpus", "0"],
    ] {
        let out = Command::new(BIN)
            .arg("sidecar")
            .args(&args)
            .args(["--listen", "127.0.0.1:0"])
            .output()
            .expect("gpufit binary runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            matches!(out.status.code(), Some(2) | Some(4)),
            "{args:?}: {err}"
        );
        assert!(err.starts_with("error: "), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn in_process_sidecar_serves_until_stopped_and_then_refuses_connections() {
    use gpufit::sidecar::{
        Backend, BackendConfig, SidecarConfig, SimulateConfig, TrackerConfig, DEFAULT_INTERVAL,
    };
    let cfg = SidecarConfig {
        backend: BackendConfig {
            backend: Backend::Simulate,
            inventory: None,
            nvml_lib: None,
            simulate: SimulateConfig {
                gpus: 2,
                model: "Test Card".into(),
                memory_bytes: Some(8 * GIB),
                node: "inproc".into(),
                demo_jobs: 0,
                mig: Default::default(),
                mig_parent_refused: false,
            },
        },
        listen: "127.0.0.1:0".parse().expect("socket address"),
        interval: DEFAULT_INTERVAL,
        node: "inproc".into(),
        mapping_dir: None,
        proc_root: "/proc".into(),
        tracker: TrackerConfig::default(),
        http: gpufit::sidecar::HttpConfig::default(),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let running = gpufit::sidecar::start(&cfg).await.expect("sidecar starts");
        let base = format!("http://{}", running.addr);
        let b = base.clone();
        let gpus = tokio::task::spawn_blocking(move || get_json(&format!("{b}/v1/gpus")))
            .await
            .expect("request thread");
        assert_eq!(gpus["node"], "inproc");
        assert_eq!(gpus["gpus"][1]["memory_total_bytes"], 8 * GIB);
        running.stop().await;
        let refused = tokio::task::spawn_blocking(move || {
            agent().get(&format!("{base}/healthz")).call().is_err()
        })
        .await
        .expect("request thread");
        assert!(refused, "stopped sidecar still answers");
    });
}

#[test]
fn gpus_live_lists_what_the_source_sees_and_fails_clearly_without_nvml() {
    let out = Command::new(BIN)
        .args([
            "-o",
            "json",
            "gpus",
            "--live",
            "--backend",
            "simulate",
            "--simulate-gpus",
            "2",
        ])
        .output()
        .expect("gpufit binary runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON list");
    let list = v.as_array().expect("a list of GPUs");
    assert_eq!(list.len(), 2);
    assert_eq!(list[1]["index"], 1);
    assert!(list[0]["memory_total_bytes"]
        .as_u64()
        .is_some_and(|b| b > 0));

    let out = Command::new(BIN)
        .args([
            "gpus",
            "--live",
            "--backend",
            "nvml",
            "--nvml-lib",
            "/nonexistent/libnvidia-ml.so.1",
        ])
        .output()
        .expect("gpufit binary runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{err}");
    assert!(err.contains("--backend inventory"), "{err}");
}

#[test]
fn a_wrong_method_on_a_known_path_is_405_with_allow() {
    let sc = start(&["--backend", "simulate"], &[]);
    for (method, path, allow) in [
        ("POST", "/healthz", "GET"),
        ("DELETE", "/metrics", "GET"),
        ("POST", "/v1/gpus", "GET"),
        ("PUT", "/v1/jobs", "GET"),
        ("POST", "/v1/jobs/123", "GET"),
        ("PUT", "/v1/jobs/123/log-peak", "GET, POST"),
        ("DELETE", "/v1/simulate/processes", "GET, POST"),
        ("POST", "/v1/simulate/processes/5", "DELETE"),
    ] {
        let res = agent()
            .request(method, &format!("{}{path}", sc.base))
            .call();
        let r = match res {
            Err(ureq::Error::Status(_, r)) | Ok(r) => r,
            Err(e) => panic!("{method} {path}: {e}"),
        };
        assert_eq!(r.status(), 405, "{method} {path}");
        assert_eq!(r.header("allow"), Some(allow), "{method} {path}");
        let v: Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
        assert!(v["error"].as_str().unwrap().contains(allow), "{v}");
    }
}

#[test]
fn log_peak_needs_the_token_and_a_peak_the_gpu_can_hold() {
    // Without a token file the sidecar takes no writes.
    let open = start(&["--backend", "simulate"], &[]);
    let (code, body) = call_auth(
        "POST",
        &format!("{}/v1/jobs/7/log-peak", open.base),
        "anything",
        json!({"peak_bytes": GIB}),
    );
    assert_eq!(code, 403, "{body}");
    assert!(body.contains("--token-file"), "{body}");

    let (_tok, tok_path) = token_file("s3cret");
    // The environment variable the controller reads configures it too.
    let sc = start(
        &["--backend", "simulate", "--simulate-gpus", "1"],
        &[("GPUFIT_TOKEN_FILE", &tok_path)],
    );
    let url = format!("{}/v1/jobs/7/log-peak", sc.base);
    let (code, body) = call("POST", &url, Some(json!({"peak_bytes": GIB})));
    assert_eq!(code, 401, "{body}");
    assert!(body.contains("Authorization: Bearer"), "{body}");
    let (code, body) = call_auth("POST", &url, "wrong", json!({"peak_bytes": GIB}));
    assert_eq!(code, 401, "{body}");
    assert!(body.contains("wrong bearer token"), "{body}");

    // Simulated H100 80GB: 79.65 GiB. A rounded log value just over is
    // kept; a sum over GPUs, a zero, a fraction, a negative are refused.
    let total = get_json(&format!("{}/v1/gpus", sc.base))["gpus"][0]["memory_total_bytes"]
        .as_u64()
        .unwrap();
    for (peak, want, why) in [
        (json!(0), 400, "positive"),
        (json!(-5), 400, "whole number"),
        (json!(1.5), 400, "whole number"),
        (json!("40GB"), 400, "invalid JSON"),
        (json!(2 * total), 400, "above this node's GPU memory"),
        (json!(total + total / 200), 200, ""),
    ] {
        let (code, body) = call_auth("POST", &url, "s3cret", json!({ "peak_bytes": peak }));
        assert_eq!(code, want, "peak {peak}: {body}");
        assert!(body.contains(why), "peak {peak}: {body}");
    }
    let j = get_json(&format!("{}/v1/jobs/7", sc.base));
    assert_eq!(j["peak_bytes"], total + total / 200);
    assert_eq!(j["method"], "log");
}

#[test]
fn idle_connections_do_not_block_the_sidecar_and_are_closed() {
    // A shell soft limit of 1,024 open files, as systemd's default.
    let mut sh = Command::new("sh");
    sh.args(["-c", &format!("ulimit -Sn 1024 && exec {BIN} \"$@\""), "sh"]);
    let sc = start_cmd(sh, &["--backend", "simulate", "--idle-timeout", "3s"], &[]);
    let addr = sc.base.trim_start_matches("http://").to_string();
    let opened = std::time::Instant::now();
    let idle: Vec<std::net::TcpStream> = (0..1100)
        .map(|i| {
            std::net::TcpStream::connect(&addr)
                .unwrap_or_else(|e| panic!("idle connection {i}: {e}"))
        })
        .collect();
    // Let the sidecar accept them all before asking.
    std::thread::sleep(Duration::from_millis(300));
    let t = std::time::Instant::now();
    let health = get_json(&format!("{}/healthz", sc.base));
    let took = t.elapsed();
    assert_eq!(health["status"], "ok");
    assert!(
        took < Duration::from_secs(2),
        "/healthz took {took:?} with 1,100 idle connections"
    );
    // Past the idle timeout every idle connection has been closed.
    std::thread::sleep(Duration::from_secs(4).saturating_sub(opened.elapsed()));
    for (i, mut s) in idle.into_iter().enumerate() {
        use std::io::Read;
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut buf = [0u8; 16];
        match s.read(&mut buf) {
            Ok(0) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            other => panic!("idle connection {i} still open after the idle timeout: {other:?}"),
        }
    }
    assert_eq!(get_json(&format!("{}/healthz", sc.base))["status"], "ok");
}

/// Registers a process on MIG slice `mig` of GPU `gpu` (simulate backend).
fn post_on_slice(sc: &Sidecar, pid: u32, gpu: u32, mig: u32, job: Value, bytes: u64) -> Value {
    let (code, body) = call(
        "POST",
        &format!("{}/v1/simulate/processes", sc.base),
        Some(json!({"pid": pid, "gpu": gpu, "mig": mig, "job": job, "memory_bytes": bytes})),
    );
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).expect("JSON body")
}

#[test]
fn mig_slices_serve_their_own_memory_and_per_job_peaks_that_stay_on_their_slice() {
    let sc = start(
        &[
            "--backend",
            "simulate",
            "--simulate-model",
            "NVIDIA A100-SXM4-40GB",
            "--simulate-gpus",
            "2",
            "--simulate-mig",
            "0:1g.5gb,1g.5gb,3g.20gb",
            "--node",
            "mig-node",
        ],
        &[],
    );
    const MIB: u64 = 1 << 20;
    let (a, b) = (
        json!({"namespace": "team-a", "pod": "small-0"}),
        json!({"namespace": "team-a", "pod": "small-1"}),
    );
    // Job a rises to 4 GiB on slice 0 and falls; job b holds 512 MiB on
    // slice 1; Slurm job 77 holds 12 GiB on the 3g.20gb slice, then ends.
    for gib in [1u64, 4, 2] {
        post_on_slice(&sc, 11, 0, 0, a.clone(), gib * GIB);
    }
    post_on_slice(&sc, 12, 0, 1, b.clone(), 512 * MIB);
    post_on_slice(&sc, 13, 0, 2, json!({"slurm_job_id": "77"}), 12 * GIB);

    let gpus = get_json(&format!("{}/v1/gpus", sc.base));
    let list = gpus["gpus"].as_array().expect("a list");
    let rows: Vec<(u64, &str, u64, u64)> = list
        .iter()
        .map(|g| {
            (
                g["index"].as_u64().unwrap_or(99),
                g["name"].as_str().unwrap_or(""),
                g["memory_total_bytes"].as_u64().unwrap_or(0),
                g["memory_used_bytes"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    // The catalog's slice memory: 4.75 GiB (nvidia-smi mig -lgip), 19.50 GiB (go-nvml's A100 mock, the lower source).
    assert_eq!(
        rows,
        [
            (
                0,
                "NVIDIA A100-SXM4-40GB",
                40960 * MIB,
                2 * GIB + 512 * MIB + 12 * GIB
            ),
            (0, "NVIDIA A100-SXM4-40GB MIG 1g.5gb", 4864 * MIB, 2 * GIB),
            (0, "NVIDIA A100-SXM4-40GB MIG 1g.5gb", 4864 * MIB, 512 * MIB),
            (
                0,
                "NVIDIA A100-SXM4-40GB MIG 3g.20gb",
                19968 * MIB,
                12 * GIB
            ),
            (1, "NVIDIA A100-SXM4-40GB", 40960 * MIB, 0),
        ]
    );
    assert_eq!(list[0]["mig_enabled"], true);
    assert_eq!(list[2]["mig"]["device"], 1);
    assert_eq!(list[2]["mig"]["profile"], "1g.5gb");
    assert_eq!(list[2]["mig"]["parent_uuid"], list[0]["uuid"]);
    assert!(list[4].get("mig").is_none(), "a whole GPU has no mig field");

    // Per-job peaks per slice: a's 4 GiB never reaches its sibling b.
    let ja = get_json(&format!("{}/v1/jobs/team-a/small-0", sc.base));
    let jb = get_json(&format!("{}/v1/jobs/team-a/small-1", sc.base));
    assert_eq!(
        (ja["peak_bytes"].as_u64(), ja["current_bytes"].as_u64()),
        (Some(4 * GIB), Some(2 * GIB))
    );
    assert_eq!(jb["peak_bytes"].as_u64(), Some(512 * MIB));
    assert_eq!(
        ja["gpus"][0]["mig"],
        json!({"device": 0, "profile": "1g.5gb"})
    );
    assert_eq!(jb["gpus"].as_array().map(Vec::len), Some(1));
    assert_eq!(jb["gpus"][0]["mig"]["device"], 1);

    let text = call("GET", &format!("{}/metrics", sc.base), None).1;
    let peak = |pod: &str, device: &str| {
        metric(
            &text,
            "gpufit_job_gpu_memory_peak_bytes",
            &[
                ("pod", pod),
                ("gpu", "0"),
                ("mig_device", device),
                ("mig_profile", "1g.5gb"),
            ],
        )
    };
    assert_eq!(peak("small-0", "0"), Some((4 * GIB) as f64), "{text}");
    assert_eq!(peak("small-1", "1"), Some((512 * MIB) as f64));
    assert_eq!(peak("small-0", "1"), None, "no series of a on b's slice");
    // The controller's peak query filters on namespace and pod only: it
    // finds the slice's series (max over the pod's series).
    assert_eq!(
        metric(
            &text,
            "gpufit_job_gpu_memory_peak_bytes",
            &[("namespace", "team-a"), ("pod", "small-0")]
        ),
        Some((4 * GIB) as f64)
    );
    assert_eq!(
        metric(
            &text,
            "gpufit_gpu_memory_total_bytes",
            &[
                ("gpu", "0"),
                ("mig_device", "2"),
                ("mig_profile", "3g.20gb")
            ]
        ),
        Some((19968 * MIB) as f64)
    );
    // The MIG-mode card: healthy, but its memory only through its slices.
    let card = [("gpu", "0"), ("mig_device", ""), ("node", "mig-node")];
    assert_eq!(metric(&text, "gpufit_gpu_healthy", &card), Some(1.0));
    assert_eq!(metric(&text, "gpufit_gpu_memory_total_bytes", &card), None);
    assert_eq!(
        metric(
            &text,
            "gpufit_gpu_memory_total_bytes",
            &[("gpu", "1"), ("mig_device", "")]
        ),
        Some((40960 * MIB) as f64)
    );

    // The Slurm Epilog's read of an ended job on a slice: its slice peak.
    let (code, _) = call(
        "DELETE",
        &format!("{}/v1/simulate/processes/13", sc.base),
        None,
    );
    assert_eq!(code, 200);
    let peak = gpufit::slurm::exec::sidecar_peak(&sc.base, "77").expect("the sidecar answers");
    assert_eq!(peak, Some(12 * GIB));

    // A process on the MIG-mode card itself, or on a slice that is not there, is refused.
    for body in [
        json!({"pid": 20, "gpu": 0, "job": {"slurm_job_id": "1"}, "memory_bytes": 1}),
        json!({"pid": 20, "gpu": 0, "mig": 3, "job": {"slurm_job_id": "1"}, "memory_bytes": 1}),
        json!({"pid": 20, "gpu": 0, "mig": 0, "job": {"slurm_job_id": "1"}, "memory_bytes": 5 * GIB}),
    ] {
        let (code, body) = call(
            "POST",
            &format!("{}/v1/simulate/processes", sc.base),
            Some(body),
        );
        assert_eq!(code, 400, "{body}");
    }

    // `gpus --live` lists the slices.
    let out = Command::new(BIN)
        .args([
            "gpus",
            "--live",
            "--backend",
            "simulate",
            "--simulate-model",
            "NVIDIA A100-SXM4-40GB",
            "--simulate-gpus",
            "1",
            "--simulate-mig",
            "0:3g.20gb,3g.20gb",
        ])
        .output()
        .expect("gpufit binary runs");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        table.matches("NVIDIA A100-SXM4-40GB MIG 3g.20gb").count(),
        2,
        "{table}"
    );
    assert!(table.contains("slice 1 (GI 2)"), "{table}");
    let bad = Command::new(BIN)
        .args([
            "gpus",
            "--live",
            "--backend",
            "simulate",
            "--simulate-mig",
            "0:9g.99gb",
        ])
        .output()
        .expect("gpufit binary runs");
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        !bad.status.success() && err.contains("not a MIG profile"),
        "{err}"
    );
}

/// Acceptance (issue 46): a MIG node read without MIG monitoring
/// privileges. NVML refuses the card's own memory (NoPermission) and gives
/// no per-process figure on the slices; the card is still listed, healthy,
/// with the reason, its slices with their own memory, and a job's peak is
/// tracked on its slice from the slice's own use. A log-stated peak is
/// checked against the job's slice, not the card.
#[test]
fn a_mig_card_whose_own_reading_is_refused_lists_its_slices_and_tracks_peaks_on_them() {
    const MIB: u64 = 1 << 20;
    let (_tok, tok_path) = token_file("mig-token");
    let sc = start(
        &[
            "--backend",
            "simulate",
            "--simulate-model",
            "NVIDIA A100-SXM4-80GB",
            "--simulate-gpus",
            "1",
            "--simulate-mig",
            "0:1g.10gb,3g.40gb",
            "--simulate-mig-parent-refused",
            "--token-file",
            &tok_path,
            "--node",
            "refused-node",
        ],
        &[],
    );
    let job = json!({"slurm_job_id": "88"});
    for gib in [6u64, 9, 3] {
        post_on_slice(&sc, 21, 0, 1, job.clone(), gib * GIB);
    }
    post_on_slice(&sc, 22, 0, 0, json!({"slurm_job_id": "89"}), 2 * GIB);

    let gpus = get_json(&format!("{}/v1/gpus", sc.base));
    let list = gpus["gpus"].as_array().expect("a list");
    assert_eq!(list.len(), 3, "the card and its two slices: {gpus}");
    let card = &list[0];
    assert_eq!(card["healthy"], true, "{card}");
    assert_eq!(card["mig_enabled"], true);
    assert_eq!(card["memory_total_bytes"], 0, "refused: no aggregate");
    let why = card["error"].as_str().unwrap_or("");
    assert!(
        why.contains("CAP_SYS_ADMIN") && why.contains("NVIDIA_MIG_MONITOR_DEVICES"),
        "{why}"
    );
    let slices: Vec<(String, u64, u64)> = list[1..]
        .iter()
        .map(|g| {
            (
                g["name"].as_str().unwrap_or("").to_string(),
                g["memory_total_bytes"].as_u64().unwrap_or(0),
                g["memory_used_bytes"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(
        slices,
        [
            (
                "NVIDIA A100-SXM4-80GB MIG 1g.10gb".to_string(),
                9728 * MIB,
                2 * GIB
            ),
            (
                "NVIDIA A100-SXM4-80GB MIG 3g.40gb".to_string(),
                40192 * MIB,
                3 * GIB
            ),
        ]
    );
    // The job's peak: 9 GiB on its 3g.40gb slice, though NVML gave no
    // per-process figure (the slice's own use stands in).
    let j = get_json(&format!("{}/v1/jobs/88", sc.base));
    assert_eq!(j["peak_bytes"].as_u64(), Some(9 * GIB), "{j}");
    assert_eq!(j["current_bytes"].as_u64(), Some(3 * GIB));
    assert_eq!(
        j["gpus"][0]["mig"],
        json!({"device": 1, "profile": "3g.40gb"})
    );
    let other = get_json(&format!("{}/v1/jobs/89", sc.base));
    assert_eq!(other["peak_bytes"].as_u64(), Some(2 * GIB));

    // log-peak: checked against the job's slice (39.25 GiB), not the card.
    let url = |id: &str| format!("{}/v1/jobs/{id}/log-peak", sc.base);
    let (code, body) = call_auth(
        "POST",
        &url("88"),
        "mig-token",
        json!({"peak_bytes": 45 * GIB}),
    );
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("MIG slice 3g.40gb"), "{body}");
    let (code, body) = call_auth(
        "POST",
        &url("88"),
        "mig-token",
        json!({"peak_bytes": 30 * GIB}),
    );
    assert_eq!(code, 200, "{body}");
    // Job 89's slice is a 1g.10gb: 30 GiB cannot be its.
    let (code, body) = call_auth(
        "POST",
        &url("89"),
        "mig-token",
        json!({"peak_bytes": 30 * GIB}),
    );
    assert_eq!(code, 400, "{body}");
    // A job never seen: the node's largest device, the 3g.40gb slice (not the card).
    let (code, body) = call_auth(
        "POST",
        &url("90"),
        "mig-token",
        json!({"peak_bytes": 45 * GIB}),
    );
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("this node's GPU memory"), "{body}");
}
