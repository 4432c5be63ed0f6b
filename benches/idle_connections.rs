//! Each of gpufit's servers under 5,000 idle connections (issue 41's
//! acceptance figure): the sidecar (`--backend simulate`), the controller
//! in `--no-kubernetes` mode (what every Slurm node's TaskProlog calls) and
//! the admission webhook over TLS (a controller whose Kubernetes API never
//! answers). Each is the release binary, started with soft and hard
//! open-file limits of 1,024 and of 65,536 (raising the hard limit needs
//! CAP_SYS_RESOURCE; without it the second is the hard limit in force,
//! said in the table). Per run: `/healthz` latency (median and max of 20 tries on new
//! connections, over TLS for the webhook) and the log lines per second of
//! the kind that grew most, over ~5 s. Run:
//!
//!     cargo bench --bench idle_connections
//!
//! Then, per server at the higher limit, the same under 5,000 stalled
//! request bodies (a head announcing 1,000 bytes and one byte of it, on a
//! route that reads its body; issue 47): `/healthz` latency, and the
//! status the oldest stalled request got (408: its place was taken back).
//!
//! Exits non-zero when a `/healthz` takes 100 ms or more (or fails), or a
//! kind of log line grows by more than one line per second, or a stalled
//! body keeps a `/healthz` waiting 100 ms or more.
//! `IDLE_BENCH_BIN=/path/to/gpufit` measures another build (e.g. main's).

#[path = "../tests/common/serving.rs"]
mod serving;

use std::time::Duration;

use serving::{measure, measure_stalled, set_own_limit, start, Server};

const IDLE: usize = 5_000;
const TRIES: usize = 20;
const WINDOW: Duration = Duration::from_secs(5);
const LIMITS: [u64; 2] = [1_024, 65_536];
const HEALTHZ_LIMIT: Duration = Duration::from_millis(100);

fn ms(d: Option<Duration>) -> String {
    d.map_or_else(|| "-".into(), |d| format!("{:.2}", d.as_secs_f64() * 1e3))
}

fn main() {
    let bin =
        std::env::var("IDLE_BENCH_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_gpufit").into());
    // This process holds the idle connections: room for all of them, and
    // a hard limit the children may be given. Raising a hard limit needs
    // CAP_SYS_RESOURCE; without it the highest limit measured is the hard
    // one in force (said in the table).
    let most = LIMITS
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .max(2 * IDLE as u64 + 1_024);
    let allowed = match set_own_limit(most) {
        Ok(()) => most,
        Err(e) => {
            let hard = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
                .map(|(_, h)| h)
                .unwrap_or(0);
            eprintln!("{e}; measuring at the hard limit {hard} instead");
            if let Err(e) = set_own_limit(hard) {
                eprintln!("{e}");
                std::process::exit(2);
            }
            hard
        }
    };
    if allowed < 2 * IDLE as u64 + 64 {
        eprintln!("this process may hold only {allowed} descriptors: not enough for {IDLE} idle connections");
        std::process::exit(2);
    }
    println!(
        "{IDLE} idle connections per server; /healthz {TRIES} tries over {} s; binary {bin}",
        WINDOW.as_secs()
    );
    println!(
        "| server | fd limit | idle opened | /healthz median ms | /healthz max ms | failed | worst log kind lines/s | pass |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut all_pass = true;
    let mut worst_kinds = Vec::new();
    for which in Server::ALL {
        for wanted in LIMITS {
            let limit = wanted.min(allowed);
            let shown = if limit < wanted {
                format!("{limit} (not {wanted}: hard limit)")
            } else {
                limit.to_string()
            };
            let run = match start(&bin, which, limit) {
                Ok(r) => r,
                Err(e) => {
                    println!(
                        "| {} | {shown} | - | - | - | start failed | - | no |",
                        which.name()
                    );
                    eprintln!("{e}");
                    all_pass = false;
                    continue;
                }
            };
            let f = measure(&run, IDLE, TRIES, WINDOW);
            let pass = f.passes(HEALTHZ_LIMIT);
            all_pass &= pass;
            println!(
                "| {} | {shown} | {} | {} | {} | {} | {:.1} | {} |",
                which.name(),
                f.opened,
                ms(f.median()),
                ms(f.max()),
                f.failures.len(),
                f.worst_lines_per_second(),
                if pass { "yes" } else { "NO" }
            );
            if let Some((kind, n)) = &f.worst_kind {
                worst_kinds.push(format!("{} @ {limit}: {n} × {kind}", which.name()));
            }
            if let Some(e) = f.failures.first() {
                eprintln!("{} @ {limit}: first failure: {e}", which.name());
            }
        }
    }
    println!("\n{IDLE} stalled request bodies per server (head + 1 body byte, then nothing)");
    println!("| server | fd limit | stalled opened | /healthz median ms | /healthz max ms | failed | oldest stalled answered | pass |");
    println!("|---|---|---|---|---|---|---|---|");
    let limit = LIMITS.iter().copied().max().unwrap_or(65_536).min(allowed);
    for which in Server::ALL {
        let run = match start(&bin, which, limit) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("{e}");
                all_pass = false;
                continue;
            }
        };
        let (f, oldest) = measure_stalled(&run, which, IDLE, TRIES);
        let pass = f.failures.is_empty() && f.max().is_some_and(|m| m < HEALTHZ_LIMIT);
        all_pass &= pass;
        println!(
            "| {} | {limit} | {} | {} | {} | {} | {} | {} |",
            which.name(),
            f.opened,
            ms(f.median()),
            ms(f.max()),
            f.failures.len(),
            oldest.map_or_else(|| "-".into(), |s| s.to_string()),
            if pass { "yes" } else { "NO" }
        );
    }
    if !worst_kinds.is_empty() {
        println!("\nlog lines in the window, most frequent kind per run:");
        for k in worst_kinds {
            println!("- {k}");
        }
    }
    if !all_pass {
        eprintln!("FAIL: /healthz must answer in < {HEALTHZ_LIMIT:?} and no log kind may grow by more than one line per second");
        std::process::exit(1);
    }
}
