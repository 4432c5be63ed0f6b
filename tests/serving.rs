//! The one HTTP server (`gpufit::serve`) behind the sidecar, the
//! controller's port and the webhook: each real server under more idle
//! connections than its descriptor limit allows, the TLS-handshake
//! timeout, and the graceful drain. `benches/idle_connections.rs` measures
//! the same at 5,000 connections.

#[path = "common/serving.rs"]
mod serving;

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use gpufit::serve::{serve, ServeConfig};
use http_body_util::Full;
use serving::{measure, start, Server};

const BIN: &str = env!("CARGO_BIN_EXE_gpufit");

/// Under a 256-descriptor limit and 400 idle connections every server
/// still answers `/healthz` at once, says once that it lowered its cap, and
/// its log does not grow by more than a line a second of any kind.
#[test]
fn every_server_answers_under_more_idle_connections_than_descriptors() {
    for which in Server::ALL {
        let run = start(BIN, which, 256).unwrap_or_else(|e| panic!("{e}"));
        let f = measure(&run, 400, 10, Duration::from_secs(2));
        assert_eq!(f.opened, 400, "{}: idle connections opened", which.name());
        assert!(
            f.failures.is_empty(),
            "{}: /healthz failed: {:?}\n{}",
            which.name(),
            f.failures,
            run.log_text()
        );
        let median = f.median().expect("answers");
        assert!(
            median < Duration::from_millis(100),
            "{}: median /healthz {median:?}",
            which.name()
        );
        assert!(
            f.passes(Duration::from_secs(1)),
            "{}: {f:?}\n{}",
            which.name(),
            run.log_text()
        );
        let log = run.log_text();
        let lowered = log
            .lines()
            .filter(|l| l.contains("connection cap lowered"))
            .count();
        // The webhook's controller serves two ports, each saying it once.
        let servers = if which == Server::Webhook { 2 } else { 1 };
        assert_eq!(
            lowered,
            servers,
            "{}: cap lowered lines:\n{log}",
            which.name()
        );
        assert!(
            !log.contains("accept failed"),
            "{}: the cap kept descriptors free, yet:\n{log}",
            which.name()
        );
    }
}

fn ok(body: &'static str) -> gpufit::serve::Reply {
    hyper::Response::new(Full::new(Bytes::from_static(body.as_bytes())))
}

/// A request in flight when shutdown comes is answered; the listener is
/// closed at once and `serve` returns once the request is done.
#[tokio::test]
async fn shutdown_drains_the_request_in_flight_and_closes_the_listener() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
    let started_tx = Arc::new(std::sync::Mutex::new(Some(started_tx)));
    let handler = move |_req| {
        let started_tx = started_tx.clone();
        async move {
            if let Some(tx) = started_tx.lock().unwrap().take() {
                let _ = tx.send(());
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            ok("done")
        }
    };
    let server = tokio::spawn(async move {
        serve(listener, &ServeConfig::default(), None, handler, async {
            let _ = stop_rx.await;
        })
        .await
    });
    let client = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = s.read_to_string(&mut out);
        out
    });
    started_rx.await.expect("the request reached the handler");
    let t = Instant::now();
    stop_tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(3), server)
        .await
        .expect("serve returns after the drain")
        .unwrap();
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    let answer = client.await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("done"), "{answer}");
    assert!(
        std::net::TcpStream::connect(addr).is_err(),
        "the listener is closed after shutdown"
    );
}

/// A TLS client that connects and never says hello is dropped after the
/// handshake timeout, well before the idle timeout.
#[tokio::test]
async fn a_silent_tls_client_is_dropped_after_the_handshake_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let (crt, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::write(&crt, cert.cert.pem()).unwrap();
    std::fs::write(&key, cert.key_pair.serialize_pem()).unwrap();
    let tls = gpufit::controller::webhook::tls_config(&crt, &key).unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let cfg = ServeConfig {
        tls_handshake_timeout: Duration::from_millis(300),
        idle_timeout: Duration::from_secs(60),
        ..ServeConfig::default()
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        serve(
            listener,
            &cfg,
            Some(acceptor),
            |_req| async { ok("ok") },
            async {
                let _ = stop_rx.await;
            },
        )
        .await
    });
    let closed_after = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let t = Instant::now();
        let mut buf = [0u8; 16];
        let r = s.read(&mut buf);
        (t.elapsed(), r.map_err(|e| e.kind()))
    })
    .await
    .unwrap();
    let (took, read) = closed_after;
    assert!(
        matches!(read, Ok(0) | Err(std::io::ErrorKind::ConnectionReset)),
        "{read:?}"
    );
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_secs(3),
        "closed after {took:?}"
    );
    let _ = stop_tx.send(());
    server.await.unwrap();
}
