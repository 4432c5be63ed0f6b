//! The suggest → run → record loop replayed against the real H100 table:
//! `cargo bench --bench replay`. Prints each run as a fraction of the best
//! feasible throughput, OOMs, and runs until within 3 % of the best.

#[path = "../tests/common/replay.rs"]
mod replay;

use std::path::Path;

fn main() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/data/h100/throughput.csv");
    let outcomes = replay::replay(&path);
    let mut firsts = Vec::new();
    let mut after3 = Vec::new();
    let mut ooms = 0;
    for o in &outcomes {
        let (d, c, m, t) = o.best;
        println!(
            "{}: best feasible {} ckpt {} m {} = {:.0} tokens/s (any dtype {:.0})",
            o.name,
            d,
            if c { "on" } else { "off" },
            m,
            t,
            o.best_any_dtype
        );
        for (i, s) in o.steps.iter().enumerate() {
            println!(
                "  run {}: {} ckpt {} m {:>2} → {} {:>6.0} tokens/s = {:5.1} %  peak predicted {:.1} GiB, measured {:.1} GiB",
                i + 1,
                s.dtype,
                if s.ckpt { "on " } else { "off" },
                s.m,
                if s.oom { "OOM" } else { "ok " },
                s.tokens_per_sec,
                100.0 * s.fraction,
                s.predicted_peak / (1u64 << 30) as f64,
                s.measured_peak / (1u64 << 30) as f64
            );
        }
        println!(
            "  OOM runs {}, runs until within 3 %: {}",
            o.ooms(),
            o.runs_to_within_3pct()
                .map(|n| n.to_string())
                .unwrap_or_else(|| "never".into())
        );
        firsts.push(o.steps[0].fraction);
        after3.push(o.steps[3].fraction);
        ooms += o.ooms();
    }
    let worst3 = after3.iter().copied().fold(f64::INFINITY, f64::min);
    println!(
        "overall: first suggestion median {:.1} %, after 3 runs median {:.1} % worst {:.1} %, OOM runs {ooms}",
        100.0 * replay::median(&firsts),
        100.0 * replay::median(&after3),
        100.0 * worst3
    );
}
