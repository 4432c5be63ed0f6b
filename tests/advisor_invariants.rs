//! The advisor's invariants over the whole catalog (see tests/common/sweep.rs):
//! prediction = estimate of the suggestion, under the target (or an explicit
//! over-target warning at micro batch 1), never over the card, m × a × W = G,
//! conservative ≤ balanced ≤ aggressive, a first-run plan (estimate + stated
//! margins) under the target, no unjustified cap, "does not fit"
//! only when nothing fits at micro batch 1, sane precisions.

#[path = "common/sweep.rs"]
mod sweep;

#[test]
fn every_catalog_suggestion_keeps_every_invariant() {
    let c = sweep::sweep(None);
    eprintln!("{c:#?}");
    assert!(c.suggestions > 10_000, "sweep too small: {c:?}");
    assert_eq!(c.violations(), 0, "{c:#?}");
}
