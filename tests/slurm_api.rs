//! The controller's HTTP API that the Slurm hooks call, served in process:
//! the bearer token on writes, JSON errors that say what is wrong, the
//! body-size limit.

use gpufit::core::run::RunOutcome;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use gpufit::controller::api::{self, ApiState};
use gpufit::controller::metrics::{Health, Metrics, Routes};
use gpufit::core::run::{RunRecord, RunResult, RunSource};
use gpufit::core::settings::EngineeringSettings;
use gpufit::core::workload::Method;

#[path = "common/loopback.rs"]
mod loopback;
use loopback::{agent, call};

/// An API server on a free port, stopped on drop.
struct ApiServer {
    addr: SocketAddr,
    _dir: tempfile::TempDir,
    rt: Option<tokio::runtime::Runtime>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl ApiServer {
    fn start(token: Option<&str>) -> ApiServer {
        ApiServer::start_as(token, false)
    }

    /// As the controller serves it (`gpufit controller --no-kubernetes`):
    /// the API beside `/metrics`, counting what it does.
    fn start_with_metrics(token: Option<&str>) -> ApiServer {
        ApiServer::start_as(token, true)
    }

    fn start_as(token: Option<&str>, with_metrics: bool) -> ApiServer {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let store = gpufit::history::open(&format!("sqlite:{}/h.db", dir.path().display()))
            .expect("a SQLite history in a temp dir");
        let state = ApiState::new(Arc::from(store), token.map(str::to_string));
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        if with_metrics {
            let metrics = Metrics::new();
            let routes = Routes {
                metrics: metrics.clone(),
                health: Arc::new(Health::default()),
                api: Some(Arc::new(state.with_metrics(metrics))),
            };
            rt.spawn(routes.serve(listener, async {
                let _ = rx.await;
            }));
        } else {
            let state = Arc::new(state);
            let handler = move |req| api::handle(state.clone(), req);
            rt.spawn(async move {
                let cfg = gpufit::serve::ServeConfig::default();
                gpufit::serve::serve(listener, &cfg, None, handler, async {
                    let _ = rx.await;
                })
                .await
            });
        }
        ApiServer {
            addr,
            _dir: dir,
            rt: Some(rt),
            stop: Some(tx),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(2));
        }
    }
}

fn run_record(job: &str) -> RunRecord {
    RunRecord {
        confirmation: Default::default(),
        nodes: None,
        id: None,
        timestamp: chrono::Utc::now(),
        cluster: Some("test".into()),
        node: Some("n1".into()),
        source: RunSource::Slurm,
        job_id: Some(job.into()),
        model: "my-org/custom-model".into(),
        method: Method::Full,
        gpu_model: "NVIDIA A100-SXM4-80GB".into(),
        seq_len: 2048,
        lora_rank: None,
        gpus: 1,
        global_batch: Some(16),
        settings: EngineeringSettings {
            micro_batch_size: 4,
            gradient_accumulation_steps: 4,
            ..EngineeringSettings::default()
        },
        result: RunResult {
            outcome: RunOutcome::Succeeded,
            peak_memory_bytes: Some(50_000_000_000),
            samples_per_sec: None,
            tokens_per_sec: None,
            duration_sec: Some(60.0),
        },
        predicted_peak_bytes: Some(48_000_000_000),
    }
}

#[test]
fn writes_need_the_bearer_token_and_reads_do_not() {
    let srv = ApiServer::start(Some("s3cret-token"));
    let a = agent();
    let body = serde_json::to_string(&run_record("1")).unwrap();

    let (status, err) = call(a.post(&srv.url("/v1/runs")), Some(&body));
    assert_eq!(status, 401, "{err}");
    assert!(
        err["error"]
            .as_str()
            .unwrap()
            .contains("Authorization: Bearer"),
        "{err}"
    );

    let (status, err) = call(
        a.post(&srv.url("/v1/runs"))
            .set("Authorization", "Bearer wrong"),
        Some(&body),
    );
    assert_eq!(status, 401, "{err}");
    assert!(
        err["error"]
            .as_str()
            .unwrap()
            .contains("wrong bearer token"),
        "{err}"
    );

    let (status, ok) = call(
        a.post(&srv.url("/v1/runs"))
            .set("Authorization", "Bearer s3cret-token"),
        Some(&body),
    );
    assert_eq!(status, 201, "{ok}");
    assert_eq!(ok["id"], 1);

    let (status, runs) = call(
        a.get(&srv.url("/v1/runs?gpu=NVIDIA+A100-SXM4-80GB&limit=5")),
        None,
    );
    assert_eq!(status, 200);
    let runs: Vec<RunRecord> = serde_json::from_value(runs).unwrap();
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0].job_id.as_deref(), Some("1"));
    assert_eq!(runs[0].settings.micro_batch_size, 4);

    let (status, runs) = call(a.get(&srv.url("/v1/runs?gpu=Tesla+T4")), None);
    assert_eq!((status, runs.as_array().map(Vec::len)), (200, Some(0)));
}

#[test]
fn without_a_token_file_writes_are_refused() {
    let srv = ApiServer::start(None);
    let body = serde_json::to_string(&run_record("1")).unwrap();
    let (status, err) = call(
        agent()
            .post(&srv.url("/v1/runs"))
            .set("Authorization", "Bearer anything"),
        Some(&body),
    );
    assert_eq!(status, 403, "{err}");
    assert!(
        err["error"].as_str().unwrap().contains("--token-file"),
        "{err}"
    );
}

#[test]
fn bad_requests_get_json_errors_that_say_what_is_wrong() {
    let srv = ApiServer::start(Some("t"));
    let a = agent();
    let cases: Vec<(ureq::Request, Option<&str>, u16, &str)> = vec![
        (
            a.post(&srv.url("/v1/suggest")),
            Some("{not json"),
            400,
            "invalid JSON body",
        ),
        (
            a.post(&srv.url("/v1/suggest")),
            Some(""),
            400,
            "empty request body",
        ),
        (
            a.post(&srv.url("/v1/suggest")),
            Some(r#"{"workload":{"model":"x","seq_len":8},"gpu":"T4","colour":1}"#),
            400,
            "unknown field `colour`",
        ),
        (
            a.post(&srv.url("/v1/runs"))
                .set("Authorization", "Bearer t"),
            Some(r#"{"model":"x"}"#),
            400,
            "missing field",
        ),
        (a.get(&srv.url("/v1/runs?limit=0")), None, 400, "limit=0"),
        (
            a.get(&srv.url("/v1/nothing")),
            None,
            404,
            "no route /v1/nothing",
        ),
        (a.get(&srv.url("/v1/suggest")), None, 405, "use POST"),
    ];
    for (req, body, want_status, want_msg) in cases {
        let (status, err) = call(req, body);
        assert_eq!(status, want_status, "{err}");
        assert_eq!(err["status"], want_status);
        assert!(
            err["error"].as_str().unwrap().contains(want_msg),
            "want `{want_msg}` in {err}"
        );
    }
    let (status, ok) = call(a.get(&srv.url("/healthz")), None);
    assert_eq!((status, ok["status"].as_str()), (200, Some("ok")));
}

#[test]
fn a_body_over_the_size_limit_is_refused_with_413() {
    let srv = ApiServer::start(Some("t"));
    // A declared Content-Length over the limit is refused before the body is
    // read. (A client that writes the whole body may see its write cut short
    // by the early 413, so this side sends only the headers.)
    let mut s = std::net::TcpStream::connect(srv.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST /v1/suggest HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        200 * 1024
    )
    .unwrap();
    let mut resp = vec![0u8; 4096];
    let n = s.read(&mut resp).unwrap();
    let text = String::from_utf8_lossy(&resp[..n]);
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("limit"), "{text}");

    // Without a Content-Length (chunked), the limit still holds.
    let mut s = std::net::TcpStream::connect(srv.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST /v1/suggest HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    .unwrap();
    let chunk = "y".repeat(32 * 1024);
    for _ in 0..4 {
        if write!(s, "{:x}\r\n{chunk}\r\n", chunk.len()).is_err() {
            break;
        }
    }
    let _ = write!(s, "0\r\n\r\n");
    let mut resp = vec![0u8; 4096];
    let n = s.read(&mut resp).unwrap();
    let head = String::from_utf8_lossy(&resp[..n]);
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
}

/// One node's report of a 2-node job, as its Epilog posts it.
fn node_report(job: &str, node: &str, peak: u64) -> RunRecord {
    let mut r = run_record(job);
    r.node = Some(node.into());
    r.gpus = 16;
    r.global_batch = Some(256);
    r.result.peak_memory_bytes = Some(peak);
    r.nodes = Some(gpufit::core::run::NodeReports {
        reported: 1,
        expected: 2,
        without_peak: Vec::new(),
    });
    r
}

#[test]
fn the_nodes_of_a_multi_node_job_make_one_record_with_the_largest_peak() {
    let srv = ApiServer::start(Some("tok"));
    let post = |r: &RunRecord| {
        let body = serde_json::to_string(r).unwrap();
        call(
            agent()
                .post(&srv.url("/v1/runs"))
                .set("Authorization", "Bearer tok"),
            Some(&body),
        )
    };
    let list = || {
        let (status, runs) = call(agent().get(&srv.url("/v1/runs")), None);
        assert_eq!(status, 200);
        serde_json::from_value::<Vec<RunRecord>>(runs).unwrap()
    };
    // Job 7: only gpu02 ever reports → one partial record, 1 of 2.
    let (status, body) = post(&node_report("7", "gpu02", 60_000_000_000));
    assert_eq!(status, 201, "{body}");
    let runs = list();
    assert_eq!(runs.len(), 1);
    let n = runs[0].nodes.clone().expect("node counts");
    assert_eq!((n.reported, n.expected, n.partial()), (1, 2, true));

    // Job 8: both nodes report at once (and gpu01 twice): one record,
    // the larger peak, 2 of 2.
    std::thread::scope(|s| {
        s.spawn(|| post(&node_report("8", "gpu01", 71_000_000_000)));
        s.spawn(|| post(&node_report("8", "gpu02", 64_000_000_000)));
    });
    assert_eq!(post(&node_report("8", "gpu01", 79_000_000_000)).0, 201);
    let runs = list();
    let job8: Vec<&RunRecord> = runs
        .iter()
        .filter(|r| r.job_id.as_deref() == Some("8"))
        .collect();
    assert_eq!(job8.len(), 1, "{runs:?}");
    assert_eq!(job8[0].result.peak_memory_bytes, Some(71_000_000_000));
    let n = job8[0].nodes.clone().expect("node counts");
    assert_eq!((n.reported, n.expected, n.partial()), (2, 2, false));
    assert_eq!(job8[0].node.as_deref(), Some("gpu01,gpu02"));

    // Job 7's other node, two hours after the job's end: refused (422,
    // not a 503 to retry), and the record stays 1 of 2 with its peak.
    let mut late = node_report("7", "gpu01", 75_000_000_000);
    late.timestamp -= chrono::Duration::hours(2);
    let (status, body) = post(&late);
    assert_eq!(status, 422, "{body}");
    assert!(body.to_string().contains("job's end"), "{body}");
    // A report naming no node cannot be counted once: refused too.
    let mut nameless = node_report("9", "x", 60_000_000_000);
    nameless.node = None;
    assert_eq!(post(&nameless).0, 422);
    let runs = list();
    let job7: Vec<&RunRecord> = runs
        .iter()
        .filter(|r| r.job_id.as_deref() == Some("7"))
        .collect();
    assert_eq!(job7.len(), 1, "{runs:?}");
    assert_eq!(job7[0].result.peak_memory_bytes, Some(60_000_000_000));
    assert_eq!(job7[0].nodes.as_ref().map(|n| n.reported), Some(1));
    assert!(runs.iter().all(|r| r.job_id.as_deref() != Some("9")));

    // Job 10: gpu02's Epilog could not read its sidecar and posts no peak.
    // Both nodes reported, but the peak is gpu01's only: partial, and it
    // names gpu02. gpu02 again without a peak changes nothing; with one,
    // it joins the peak and the record is whole.
    let job10 = |runs: &[RunRecord]| -> RunRecord {
        let mine: Vec<&RunRecord> = runs
            .iter()
            .filter(|r| r.job_id.as_deref() == Some("10"))
            .collect();
        assert_eq!(mine.len(), 1, "{runs:?}");
        mine[0].clone()
    };
    let mut peakless = node_report("10", "gpu02", 0);
    peakless.result.peak_memory_bytes = None;
    assert_eq!(post(&node_report("10", "gpu01", 70_000_000_000)).0, 201);
    assert_eq!(post(&peakless).0, 201);
    let lacking = job10(&list());
    let n = lacking.nodes.clone().expect("node counts");
    assert_eq!((n.reported, n.peaks(), n.partial()), (2, 1, true));
    assert_eq!(n.without_peak, vec!["gpu02".to_string()]);
    assert_eq!(lacking.result.peak_memory_bytes, Some(70_000_000_000));
    assert_eq!(post(&peakless).0, 201);
    assert_eq!(
        job10(&list()),
        lacking,
        "a repeated peakless report changes nothing"
    );
    assert_eq!(post(&node_report("10", "gpu02", 77_000_000_000)).0, 201);
    let whole = job10(&list());
    let n = whole.nodes.clone().expect("node counts");
    assert_eq!((n.reported, n.peaks(), n.partial()), (2, 2, false));
    assert_eq!(whole.result.peak_memory_bytes, Some(77_000_000_000));

    // A report's peakless list is its peak's absence: one that names
    // another node, or itself next to a peak, is refused.
    let mut other = node_report("11", "gpu01", 60_000_000_000);
    other.result.peak_memory_bytes = None;
    other.nodes.as_mut().unwrap().without_peak = vec!["gpu02".into()];
    let (status, body) = post(&other);
    assert_eq!(status, 400, "{body}");
    assert!(body.to_string().contains("without_peak"), "{body}");
    let mut beside = node_report("11", "gpu01", 60_000_000_000);
    beside.nodes.as_mut().unwrap().without_peak = vec!["gpu01".into()];
    assert_eq!(post(&beside).0, 400);
    let mut own = node_report("11", "gpu01", 0);
    own.result.peak_memory_bytes = None;
    own.nodes.as_mut().unwrap().without_peak = vec!["gpu01".into()];
    assert_eq!(
        post(&own).0,
        201,
        "its own name, without a peak: consistent"
    );
    let runs = list();
    let job11: Vec<&RunRecord> = runs
        .iter()
        .filter(|r| r.job_id.as_deref() == Some("11"))
        .collect();
    assert_eq!(job11.len(), 1, "{runs:?}");
    assert_eq!(
        job11[0].nodes.as_ref().map(|n| n.without_peak.clone()),
        Some(vec!["gpu01".to_string()])
    );
}

/// The sum of a metric's samples in `/metrics` text whose labels contain
/// every one of `labels` (`name{…} value` lines; `name value` when unlabelled).
fn metric_sum(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn a_two_node_job_is_one_run_in_the_metrics_and_a_retried_report_is_not_counted() {
    let srv = ApiServer::start_with_metrics(Some("tok"));
    let post = |r: &RunRecord| {
        let body = serde_json::to_string(r).unwrap();
        call(
            agent()
                .post(&srv.url("/v1/runs"))
                .set("Authorization", "Bearer tok"),
            Some(&body),
        )
    };
    let metrics = || {
        agent()
            .get(&srv.url("/metrics"))
            .call()
            .expect("/metrics answers")
            .into_string()
            .expect("text")
    };
    let runs = |m: &str| metric_sum(m, "gpufit_controller_runs_total", &[]);
    let errors = |m: &str| metric_sum(m, "gpufit_controller_prediction_error_ratio_count", &[]);
    let ooms = |m: &str| metric_sum(m, "gpufit_controller_ooms_total", &[]);
    assert_eq!(runs(&metrics()), 0.0);

    // Job 20 on two nodes: gpu01 succeeds, gpu02 runs out of memory; gpu01's
    // Epilog is retried (the first answer lost), and gpu02's too.
    let mut a = node_report("20", "gpu01", 70_000_000_000);
    a.predicted_peak_bytes = Some(72_000_000_000);
    let mut b = node_report("20", "gpu02", 80_000_000_000);
    b.predicted_peak_bytes = Some(72_000_000_000);
    b.result.outcome = RunOutcome::GpuOom;
    assert_eq!(post(&a).0, 201);
    let m = metrics();
    assert_eq!(
        runs(&m),
        0.0,
        "one node of two: the job's outcome is not known yet\n{m}"
    );
    assert_eq!(errors(&m), 1.0, "gpu01's own peak is a sample\n{m}");
    assert_eq!(post(&a).0, 201, "a retried report is accepted");
    assert_eq!(post(&b).0, 201);
    assert_eq!(post(&b).0, 201);
    let m = metrics();
    assert_eq!(runs(&m), 1.0, "one job, one run\n{m}");
    assert_eq!(
        metric_sum(
            &m,
            "gpufit_controller_runs_total",
            &["outcome=\"oom\"", "path=\"slurm\""]
        ),
        1.0,
        "the job's outcome is its OOM node's\n{m}"
    );
    assert_eq!(ooms(&m), 1.0, "{m}");
    assert_eq!(errors(&m), 2.0, "one sample per node, none per retry\n{m}");

    // A report the store refuses (past the window) counts nothing either.
    let mut late = node_report("21", "gpu01", 60_000_000_000);
    late.timestamp -= chrono::Duration::hours(2);
    assert_eq!(post(&node_report("21", "gpu02", 60_000_000_000)).0, 201);
    assert_eq!(post(&late).0, 422);
    let m = metrics();
    assert_eq!((runs(&m), ooms(&m)), (1.0, 1.0), "{m}");

    // A one-node run is counted as before.
    assert_eq!(post(&run_record("22")).0, 201);
    assert_eq!(runs(&metrics()), 2.0);
}
