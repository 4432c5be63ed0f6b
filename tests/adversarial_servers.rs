//! Issue 47, item 5: clients that send a request head and one byte of its
//! body, then nothing, against each of gpufit's real servers (the sidecar,
//! the controller's API, the admission webhook over TLS), loopback only.
//! Thousands of them must not keep a new request waiting: each server
//! answers `/healthz` on a new connection well under a second while they
//! are held, and answers a stalled request 408 and closes it (when its
//! place is needed, or once the body timeout has passed).
//!
//! `cargo test --test adversarial_servers -- --nocapture` prints the
//! figures (median and max of 20 `/healthz` tries).

#[path = "common/serving.rs"]
mod serving;

use std::time::{Duration, Instant};

use serving::{body_route, start, Server};

const BIN: &str = env!("CARGO_BIN_EXE_gpufit");

/// Stalled bodies held at once: more than twice what each server may hold
/// under the open-file limit below (1,024 less the reserve: 896).
const STALLED: usize = 2_000;
const NOFILE: u64 = 1_024;
const TRIES: usize = 20;

#[test]
fn thousands_of_stalled_bodies_do_not_keep_a_new_request_waiting() {
    let mut report = Vec::new();
    for which in Server::ALL {
        let run = start(BIN, which, NOFILE).unwrap_or_else(|e| panic!("{e}"));
        let opened = Instant::now();
        let mut held = run.open_stalled(STALLED, body_route(which));
        let opening = opened.elapsed();
        assert_eq!(
            held.len(),
            STALLED,
            "{}: stalled connections opened\n{}",
            which.name(),
            run.log_text()
        );
        let mut answers = Vec::with_capacity(TRIES);
        for _ in 0..TRIES {
            match run.healthz(Duration::from_secs(5)) {
                Ok(t) => answers.push(t),
                Err(e) => panic!(
                    "{}: /healthz under {STALLED} stalled bodies: {e}\n{}",
                    which.name(),
                    run.log_text()
                ),
            }
        }
        answers.sort();
        let (median, max) = (answers[TRIES / 2], answers[TRIES - 1]);
        report.push(format!(
            "{}: {STALLED} stalled bodies held (opened in {:.1} s), /healthz median {:.2} ms, max {:.2} ms",
            which.name(),
            opening.as_secs_f64(),
            median.as_secs_f64() * 1e3,
            max.as_secs_f64() * 1e3
        ));
        assert!(
            max < Duration::from_millis(500),
            "{}: /healthz took up to {max:?} under stalled bodies",
            which.name()
        );
        // The oldest stalled request lost its place to the newcomers: it
        // was answered 408, not left hanging.
        let first = held[0].status(Duration::from_secs(15));
        assert_eq!(first, Ok(408), "{}: the oldest stalled body", which.name());
        if which == Server::Sidecar {
            // The newest kept its place: its body timeout (10 s) answers it.
            let t = Instant::now();
            let last = held.last_mut().map(|s| s.status(Duration::from_secs(20)));
            assert_eq!(last, Some(Ok(408)), "the newest stalled body");
            assert!(t.elapsed() < Duration::from_secs(12), "{:?}", t.elapsed());
        }
    }
    for line in &report {
        eprintln!("{line}");
    }
}

/// The same in process, small: a server holding at most 8 connections, a
/// handler that reads its body, 40 stalled bodies. A new request is
/// answered at once, the stalled ones that lost their place are answered
/// 408, and one that keeps its place is answered 408 once the body timeout
/// has passed.
#[test]
fn a_stalled_body_loses_its_place_and_times_out_with_408() {
    use http_body_util::BodyExt;
    use std::io::{Read, Write};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let cfg = gpufit::serve::ServeConfig {
        max_connections: 8,
        body_timeout: Duration::from_secs(1),
        ..gpufit::serve::ServeConfig::default()
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    rt.spawn(async move {
        gpufit::serve::serve(
            listener,
            &cfg,
            None,
            |req: hyper::Request<gpufit::serve::Body>| async move {
                let status = match req.into_body().collect().await {
                    Ok(_) => 200,
                    Err(_) => 400,
                };
                let mut r = hyper::Response::new(http_body_util::Full::new(
                    bytes::Bytes::from_static(b"{}"),
                ));
                *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
                r
            },
            async {
                let _ = stopped.await;
            },
        )
        .await
    });
    let stall = || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            .unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s
    };
    let status = |s: &mut std::net::TcpStream| {
        let mut buf = [0u8; 12];
        match s.read_exact(&mut buf) {
            Ok(()) => String::from_utf8_lossy(&buf[9..12]).to_string(),
            Err(e) => format!("no answer: {e}"),
        }
    };
    // One after another, each read by the server before the next comes
    // (a connection closed with bytes it never read is reset, not answered).
    let mut held: Vec<_> = (0..40)
        .map(|_| {
            let s = stall();
            std::thread::sleep(Duration::from_millis(10));
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    let mut fresh = std::net::TcpStream::connect(addr).unwrap();
    fresh
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    fresh
        .write_all(
            b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
        )
        .unwrap();
    assert_eq!(status(&mut fresh), "200");
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
    // The oldest lost its place: answered 408 at once.
    assert_eq!(status(&mut held[0]), "408");
    // The newest kept its place: answered 408 when its body timed out.
    let t = Instant::now();
    let last = held.len() - 1;
    assert_eq!(status(&mut held[last]), "408");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    let _ = stop.send(());
    rt.shutdown_timeout(Duration::from_secs(2));
}
