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
