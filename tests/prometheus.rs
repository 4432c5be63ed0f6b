//! The controller's Prometheus client against a REAL Prometheus server (the
//! Debian `prometheus` binary, started here on loopback) scraping a real
//! `gpufit sidecar --backend simulate`: a simulated training pod's memory
//! rises to a peak and falls, and the controller's PromQL reads the peak.
//! Also: the sidecar fallback, and a Prometheus that never answers.
//!
//! Needs `prometheus` on PATH (`apt-get install -y --no-install-recommends
//! prometheus`; scripts/test.sh installs it). Without it the tests fail with
//! that instruction — they are never skipped.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use gpufit::controller::prom::{render_query, PromClient, PromError, DEFAULT_PEAK_QUERY};
use gpufit::controller::reconcile::{PeakQuery, PeakReader, PodRef, PromThenSidecar};
use gpufit::controller::sidecar_client::SidecarClient;

#[path = "common/prom.rs"]
mod prom;
use prom::{end_process, free_port, simulate, start_prometheus, start_sidecar, wait_for, GIB};

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
