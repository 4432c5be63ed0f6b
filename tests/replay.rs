//! The replay targets on the real H100 table (tests/common/replay.rs):
//! first suggestion ≥ 90 % of the best feasible throughput (median over
//! workloads), the suggestion after 3 runs ≥ 97 % on every workload, and
//! no run out of memory.

#[path = "common/replay.rs"]
mod replay;

use std::path::Path;

#[test]
fn the_loop_reaches_the_fastest_setting_that_fits_without_an_oom() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/data/h100/throughput.csv");
    let outcomes = replay::replay(&path);
    assert_eq!(outcomes.len(), 4, "the table's four workloads");
    let mut firsts = Vec::new();
    for o in &outcomes {
        let trace: Vec<String> = o
            .steps
            .iter()
            .map(|s| {
                format!(
                    "{} ckpt {} m {} → {:.0} % ",
                    s.dtype,
                    s.ckpt,
                    s.m,
                    100.0 * s.fraction
                )
            })
            .collect();
        eprintln!("{}: {}", o.name, trace.join(" | "));
        assert_eq!(o.ooms(), 0, "{}: {trace:?}", o.name);
        assert!(
            o.steps[3].fraction >= 0.97,
            "{} after 3 runs: {trace:?}",
            o.name
        );
        firsts.push(o.steps[0].fraction);
    }
    let med = replay::median(&firsts);
    assert!(med >= 0.90, "median first suggestion {med:.3}: {firsts:?}");
}
