//! Counts the advisor's invariant violations over the catalog (no history)
//! and times the sweep: `cargo bench --bench advisor_sweep`.
//! `tests/advisor_invariants.rs` asserts the same counts are zero.

#[path = "../tests/common/sweep.rs"]
mod sweep;

fn main() {
    let t = std::time::Instant::now();
    let c = sweep::sweep(None);
    let secs = t.elapsed().as_secs_f64();
    println!("suggestions          {}", c.suggestions);
    println!("does not fit (exit 3) {}", c.does_not_fit);
    println!("prediction ≠ estimate {}", c.prediction_not_estimate);
    println!("over target          {}", c.over_target);
    println!("over the card        {}", c.over_card);
    println!("m × a × W ≠ G        {}", c.global_batch_broken);
    println!("not monotone         {}", c.not_monotone);
    println!("unjustified cap      {}", c.unjustified_cap);
    println!("false does-not-fit   {}", c.false_does_not_fit);
    println!("bad precision        {}", c.bad_precision);
    println!("other errors         {}", c.errors);
    println!("violations in all    {}", c.violations());
    for e in &c.examples {
        println!("  e.g. {e}");
    }
    println!(
        "{} suggestions in {secs:.2} s ({:.1} µs each)",
        c.suggestions + c.does_not_fit,
        secs * 1e6 / (c.suggestions + c.does_not_fit).max(1) as f64
    );
}
