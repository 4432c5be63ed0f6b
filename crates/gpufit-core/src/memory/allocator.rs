//! PyTorch's caching allocator: what `max_memory_reserved` holds beyond
//! the tensors, per allocator mode, and the plan evaluated at a micro
//! batch (docs/memory-model.md, "The caching allocator").
//!
//! `max_memory_reserved` exceeds `max_memory_allocated` because blocks
//! freed by the step's transient tensors (activations, loss buffers,
//! optimizer temporaries) are kept in segments that later, differently
//! sized requests cannot fully reuse (c10/cuda/CUDACachingAllocator.cpp:
//! requests over 1 MiB are rounded to 2 MiB and served best-fit from cached
//! blocks, splitting them; a request no cached block can hold maps a new
//! segment, and nothing is returned to the driver without `empty_cache`).
//! Reserved memory therefore only grows during the run: the reserved peak
//! is the larger of
//! * phase A's allocation plus the unreusable share of its own transients
//!   (blocks split by tensors of other sizes in the same forward/backward),
//! * phase B's allocation plus the part of phase A's cached transients that
//!   the gradients and the optimizer's temporaries could not reuse.

use super::types::{AllocatorShares, Plan};
use crate::units;

/// The default caching allocator's shares, fitted to the reserved bytes of
/// every scored row of `cargo bench --bench accuracy` (the H100 and H200
/// measurements in bench/data and the published tables) under the bound
/// that no row is predicted more than 10 % below its measurement
/// (under-prediction is what turns a suggestion into an OOM). The grid
/// that chose them: `python3 scripts/refit_shares.py`; the fit and its
/// trade-offs are in docs/memory-model.md ("The caching allocator", "The
/// default allocator's shares").
pub(super) const CACHING_ALLOCATOR: AllocatorShares = AllocatorShares {
    transient: 0.03,
    transient_loss: 0.12,
    loss_holes: 0.0,
    state_holes: 0.0,
    recompute: 0.9,
    cross_phase: 0.75,
    cross_phase_checkpointed: 0.95,
    fixed_segments: true,
};

/// `expandable_segments:True`: one segment per pool grows page by page
/// and a freed range serves any request that fits in it, so neither the
/// hidden-width transients nor the cross-phase cache strand anything. What
/// stays reserved beside the allocation is holes of two kinds, seen in the
/// replay (`scripts/alloc_sim.py --expandable`, which reproduces the
/// replayable rows of bench/data/h100/expandable/):
/// * `loss_holes`: one loss buffer's block, freed in the loss's forward or
///   backward and partly refilled by small tensors, sits below live ones
///   when the next buffer of that size is requested, so the segment grows
///   by one buffer (0.5–0.7 buffers over the phase-A rows, median 0.6);
/// * `state_holes` (checkpointed): AdamW makes its states in the first
///   optimizer step, when the freed loss buffers and the recomputed
///   blocks' tensors are most of the cache, so the states are cut from
///   them and leave holes between them that the next step's loss buffers
///   cannot use.
///
/// Both shares were chosen on the expandable-segments rows of
/// `cargo bench --bench accuracy` (docs/memory-model.md, "Expandable
/// segments").
pub(super) const EXPANDABLE_SEGMENTS: AllocatorShares = AllocatorShares {
    transient: 0.0,
    transient_loss: 0.0,
    loss_holes: 0.6,
    state_holes: 0.25,
    recompute: 0.0,
    cross_phase: 0.0,
    cross_phase_checkpointed: 0.0,
    // one segment per pool grows page by page: no fixed segments to pack
    fixed_segments: false,
};

/// Plus per-segment rounding: the allocator maps memory in 2 MiB pages;
/// each persistent parameter/state tensor wastes on average half a page
/// only when it is small, which for transformer weights is below 1 % — we
/// count 1 % of persistent bytes (kRoundLarge = 2 MiB).
pub(super) const ALLOCATOR_PERSISTENT_SHARE: f64 = 0.01;

/// Sizes from c10/cuda/CUDACachingAllocator.cpp: requests up to kSmallSize
/// (1 MiB) come from 2 MiB segments (kSmallBuffer); requests under
/// kMinLargeAlloc (10 MiB) from 20 MiB segments (kLargeBuffer); larger
/// ones get a segment of their size rounded up to kRoundLarge (2 MiB).
/// Every request is first rounded up to kMinBlockSize (512 B).
const MIB: f64 = units::MIB as f64;
const K_SMALL_SIZE: f64 = MIB;
const K_SMALL_BUFFER: f64 = 2.0 * MIB;
const K_LARGE_BUFFER: f64 = 20.0 * MIB;
const K_MIN_LARGE_ALLOC: f64 = 10.0 * MIB;
const K_ROUND_LARGE: f64 = 2.0 * MIB;
const K_MIN_BLOCK: f64 = 512.0;

/// A large request's size as the allocator maps it: rounded up to
/// kRoundLarge (2 MiB), the size best fit compares.
fn round_large(bytes: f64) -> f64 {
    (bytes / K_ROUND_LARGE).ceil() * K_ROUND_LARGE
}

/// What the default allocator maps beyond a tensor of `bytes` when many
/// tensors of that size are alive together (a share of the tensor): a
/// segment holds ⌊segment / size⌋ of them and the rest of it stays empty
/// unless a smaller request fits there. Hidden-width activations are such
/// a crowd (every block saves several), and at a few thousand tokens they
/// are 1–10 MiB (replayed with scripts/alloc_sim.py and measured: the test
/// `bert_large_fp32_at_2048_tokens_keeps_its_segment_tails`). The tails
/// are counted as lost: the replay leaves them free, the activations'
/// other sizes being larger or landing in the small pool.
pub(super) fn segment_waste_share(bytes: f64) -> f64 {
    if bytes <= 0.0 {
        return 0.0;
    }
    let size = (bytes / K_MIN_BLOCK).ceil() * K_MIN_BLOCK;
    let per_tensor = if size <= K_SMALL_SIZE {
        K_SMALL_BUFFER / (K_SMALL_BUFFER / size).floor()
    } else if size < K_MIN_LARGE_ALLOC {
        K_LARGE_BUFFER / (K_LARGE_BUFFER / size).floor()
    } else {
        round_large(size)
    };
    (per_tensor - size) / size
}

/// Result of evaluating a plan at a micro batch.
pub(super) struct Eval {
    pub(super) allocated: f64,
    pub(super) reserved: f64,
    pub(super) device: f64,
    /// The least device memory the step runs in: when mapping a segment
    /// would exceed the card, the allocator returns every cached segment
    /// with no live block and retries before it fails
    /// (`release_cached_blocks` in CUDACachingAllocator.cpp). Equal to
    /// `device` unless the plan's cache can go that way.
    pub(super) least_device: f64,
    pub(super) phase_a: bool,
}

/// The plan at micro batch `m`: phase A (forward/backward boundary) and
/// phase B (optimizer step), allocated and reserved.
pub(super) fn eval(pl: &Plan, m: f64) -> Eval {
    let persistent = pl.persistent();
    let a = allocated_phase_a(pl, m);
    let b = persistent
        + pl.gradients.total
        + pl.optimizer.step_temporaries
        + pl.loss.held_through_step * m
        + pl.activations.previous_step * m;
    let phase_a = a >= b;
    // Allocated bytes: the forward's end (every cast, the forward's loss
    // buffers) or the loss's backward (without the casts freed in between).
    // The freed casts' blocks stay cached and the loss buffers cannot use
    // them, so the reserved bytes below keep `a`.
    let a_allocated = a - pl
        .weights
        .casts_freed_before_loss_backward
        .min((pl.loss.peak - pl.loss.at_forward_end) * m);
    let allocated = a_allocated.max(b);
    let loss_in_grad_blocks = loss_in_grad_blocks(pl, m);
    let dyn_a = (pl.activations.total + pl.loss.peak) * m;
    let (reserved_a, kept_a) = reserved_phase_a(pl, m);
    let reserved_a = through_the_dips(pl, m, reserved_a);
    // The tied embedding's second-use gradient is made in every backward
    // and freed before the optimizer step: replayed (scripts/alloc_sim.py),
    // its block is free at phase B's peak once the loss buffers have taken
    // the blocks of its size; on the H100 AdamW's temporary took it (the
    // test `loss_buffers_share_the_embedding_gradients_blocks_only_when_they_fit`).
    // Counted beside phase B: the safe side.
    let second_use = if loss_in_grad_blocks > 0.0 {
        pl.gradients.second_use_block
    } else {
        0.0
    };
    let reserved_b = b + if pl.allocator.checkpointing {
        pl.allocator.shares.cross_phase_checkpointed
            * (pl.loss.peak * m - loss_in_grad_blocks
                + second_use
                + (pl.activations.total * m - pl.optimizer.step_temporaries).max(0.0))
    } else {
        pl.allocator.shares.cross_phase * dyn_a.min(pl.optimizer.step_temporaries)
    };
    let persistent_share = ALLOCATOR_PERSISTENT_SHARE * (persistent + pl.gradients.total);
    let reserved = reserved_a.max(reserved_b) + persistent_share;
    // Under pressure, what the release can return: the loss buffers' own
    // segments and the recomputed blocks' (they take turns, each whole when
    // free), and phase B's cache of phase A's transients. What stays is the
    // split blocks (the `transient` share). Only where the step cuts nothing
    // long-lived from those segments (`AllocatorSetup::released_under_pressure`):
    // otherwise an optimizer state, a gradient or a kept autocast copy sits
    // in them and nothing goes (replayed with scripts/alloc_sim.py; the test
    // `only_a_cache_nothing_long_lived_was_cut_from_is_released_under_pressure`).
    let least_reserved = if pl.allocator.released_under_pressure {
        kept_a.max(b) + persistent_share
    } else {
        reserved
    };
    Eval {
        allocated,
        reserved,
        device: reserved + pl.overheads.cuda_context,
        least_device: least_reserved.min(reserved) + pl.overheads.cuda_context,
        phase_a,
    }
}

/// Phase A's allocated bytes at micro batch `m`: the persistent bytes,
/// the gradients accumulation keeps, the autocast copies, activations and
/// loss buffers.
fn allocated_phase_a(pl: &Plan, m: f64) -> f64 {
    pl.persistent()
        + pl.gradients.kept_in_phase_a
        + pl.weights.phase_a_copies
        + pl.activations.total * m
        + pl.loss.peak * m
}

/// Where each loss buffer fits in the largest gradient's block (see
/// [`loss_fits_grad_blocks`]), the loss buffers are cut from those cached
/// blocks, as many as they hold.
fn loss_in_grad_blocks(pl: &Plan, m: f64) -> f64 {
    if loss_fits_grad_blocks(pl, m) {
        (pl.loss.peak * m).min(pl.gradients.largest_size_blocks)
    } else {
        0.0
    }
}

/// Phase A's reserved bytes at micro batch `m`, before the persistent
/// tensors' rounding (see [`eval`]), and the part of them a release under
/// pressure cannot return (the allocation, the activations' segment
/// packing and the blocks split among them).
fn reserved_phase_a(pl: &Plan, m: f64) -> (f64, f64) {
    let a = allocated_phase_a(pl, m);
    // The hidden-width activations' segment packing (see
    // `segment_waste_share`): held while they are, in phase A.
    let packing = if pl.allocator.shares.fixed_segments {
        segment_waste_share(pl.activations.hidden_tensor * m) * pl.activations.hidden_width * m
    } else {
        0.0
    };
    let loss_in_grad_blocks = loss_in_grad_blocks(pl, m);
    // The previous step's phase B left its freed gradients (set to None
    // before this forward) and optimizer temporaries cached: blocks of
    // parameter shapes, which this phase's activations and autocast weight
    // copies reuse but its loss buffers (vocabulary-wide) cannot, unless
    // they fit (above): replayed with scripts/alloc_sim.py, the test
    // `the_last_steps_gradients_and_temporaries_stay_cached_beside_a_small_forward`.
    // Checkpointed runs are left to `cross_phase_checkpointed`, whose
    // recomputed blocks take them.
    let reusing_act = activations_reusing_grad_blocks(pl, m, loss_in_grad_blocks);
    let carried_b = if pl.allocator.shares.fixed_segments && !pl.allocator.checkpointing {
        (pl.gradients.total - pl.gradients.kept_in_phase_a + pl.optimizer.step_temporaries
            - reusing_act
            - pl.weights.phase_a_copies
            - loss_in_grad_blocks)
            .max(0.0)
    } else {
        0.0
    };
    let loss_cache = pl.allocator.shares.transient_loss * pl.loss.peak * m
        + pl.allocator.shares.recompute * pl.activations.recompute_overlap * m
        + pl.allocator.shares.loss_holes * pl.loss.eager_buffer * m
        + state_holes(pl);
    // The first step's optimizer states in the loss segments (see
    // `first_step_states`): a whole buffer more per segment they cut,
    // less the states that sit in the cache instead of beside it.
    let loss_cache = match first_step_states(pl, m) {
        Some((_, gain)) => (loss_cache + gain).max(0.0),
        None if pl.allocator.shares.fixed_segments => loss_cache.max(pl.loss.stranded_buffer * m),
        None => loss_cache,
    };
    // blocks split by tensors of other sizes in the same phase
    let split =
        pl.allocator.shares.transient * (pl.activations.total * m + pl.weights.phase_a_copies);
    (
        a + packing + carried_b + split + loss_cache,
        a + packing + split,
    )
}

/// The optimizer states a checkpointed full fine-tune makes in its first
/// optimizer step, and the loss path's segments. The first step's forward
/// runs without them (AdamW makes its states in the first `step()`), so
/// its loss phase maps one segment per loss buffer — the head's 16-bit
/// logits and the fp32 buffers. Then the loss buffers are freed and the
/// states, weight-shaped requests served best fit, are cut from those
/// cached segments, the smallest (the head's logits) first. Each fp32
/// segment a state is cut from can no longer hold the next step's buffer
/// of its size, which maps a new one. So phase A's reserved bytes gain,
/// beside the fitted loss cache, one loss buffer per segment cut less the
/// states that sit inside the cache (they were counted beside it in `a`).
/// Under autocast the head's 16-bit weight copy is cut from a free fp32
/// loss segment too (`LossBuffers::stranded_buffer`), so at least one
/// segment counts as cut. The replays and measurements behind the rule are
/// in docs/memory-model.md ("The caching allocator") and the
/// test `the_first_steps_states_cut_a_loss_segment_only_when_the_heads_is_too_small`.
///
/// Returns the segments cut and what phase A's reserved bytes gain (less
/// than 0 where the states fit in the head's segment), or None where the
/// rule does not apply (see `OptimizerTerms::first_step_states`).
fn first_step_states(pl: &Plan, m: f64) -> Option<(f64, f64)> {
    if !first_step_states_apply(pl) {
        return None;
    }
    let states = pl.optimizer.first_step_states;
    let buffer = round_large(pl.loss.eager_buffer * m);
    let head = round_large(pl.loss.head_output * m);
    // the fp32 segments of the loss phase: its bytes over one buffer's
    // (3 for transformers' upcast loss: the upcast, log-softmax, gradient)
    let segments = (pl.loss.peak / pl.loss.eager_buffer + 1e-9).floor();
    let cut = ((states - head).max(0.0) / buffer).ceil().min(segments);
    // under autocast the head's 16-bit copy strands a segment of its own
    // where the states cut none
    let cut = if pl.loss.stranded_buffer > 0.0 {
        cut.max(1.0)
    } else {
        cut
    };
    let placed = states.min(head + cut * buffer);
    // where they cut every fp32 segment, the head's logits find no free
    // segment of their size either and map one too: the next loss phase
    // maps all its segments anew, as if the states sat beside them
    let remapped = if cut >= segments { head } else { 0.0 };
    Some((cut, cut * buffer + remapped - placed))
}

/// Whether [`first_step_states`] applies to the plan: fixed segments and
/// a plan that has such states (`OptimizerTerms::first_step_states`, set only where
/// the loss path has a head segment) and fp32 loss buffers to cut.
fn first_step_states_apply(pl: &Plan) -> bool {
    pl.allocator.shares.fixed_segments
        && pl.optimizer.first_step_states > 0.0
        && pl.loss.eager_buffer > 0.0
}

/// Phase A's reserved bytes `reserved_a` at micro batch `m`, kept at least
/// at those of any smaller micro batch. Where a larger micro batch's head
/// segment holds states that a smaller one's could not (see
/// [`first_step_states`]), the reserved bytes fall by up to a loss buffer
/// (replayed: Llama-3.2-1B full bf16 at 9 × 2,048 holds less than at 8),
/// and the advisor's search for the largest micro batch
/// that fits assumes they only grow: in such a dip the estimate keeps the
/// smaller micro batch's figure (the safe side). Within a stretch of one
/// number of cut segments they grow with `m`, so the maximum is at the
/// last micro batch of each earlier stretch.
fn through_the_dips(pl: &Plan, m: f64, reserved_a: f64) -> f64 {
    let cuts = |x: f64| first_step_states(pl, x).map_or(0.0, |(cut, _)| cut);
    let Some((cut_here, _)) = first_step_states(pl, m) else {
        return reserved_a;
    };
    let below = m.ceil() - 1.0;
    let most = cuts(1.0);
    let mut reserved = reserved_a;
    let mut k = cut_here + 1.0;
    while below >= 1.0 && k <= most {
        // the largest micro batch below m that cuts at least k segments
        // (the count only falls as m grows): cuts(lo) >= k > cuts(hi)
        let (mut lo, mut hi) = (1.0, below + 1.0);
        while hi - lo > 1.0 {
            let mid = ((lo + hi) / 2.0).floor();
            if cuts(mid) >= k {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        reserved = reserved.max(reserved_phase_a(pl, lo).0);
        k = cuts(lo) + 1.0;
    }
    reserved
}

/// The part of phase A's activations at micro batch `m` that can take the
/// previous step's cached parameter-shaped blocks (runs without
/// checkpointing; see `carried_b` in [`reserved_phase_a`]). The allocator
/// serves a request only from a cached block at least as large (best fit
/// after rounding to 2 MiB), so an MLP-intermediate activation (tokens ×
/// `intermediate_size`) fits in an MLP weight's gradient block (`hidden ×
/// intermediate_size`) only while the micro batch's tokens are at most
/// `hidden_size` (the same element size). Past that, those activations
/// map segments of their own beside the cached blocks, except for what the
/// embedding-shaped blocks (`Gradients::largest_size_blocks`, less what the
/// loss buffers took) hold. Replayed with scripts/alloc_sim.py and measured
/// (the test `wide_activations_miss_the_cached_gradient_blocks_once_tokens_exceed_hidden`).
fn activations_reusing_grad_blocks(pl: &Plan, m: f64, loss_in_grad_blocks: f64) -> f64 {
    let act = pl.activations.total * m;
    let wide_tensor = round_large(pl.activations.mlp_wide_tensor * m);
    if pl.gradients.mlp_block <= 0.0 || wide_tensor <= round_large(pl.gradients.mlp_block) {
        return act;
    }
    let wide = pl.activations.mlp_wide * m;
    let embedding_blocks = if wide_tensor <= round_large(pl.gradients.largest_block) {
        (pl.gradients.largest_size_blocks - loss_in_grad_blocks).max(0.0)
    } else {
        0.0
    };
    act - wide + wide.min(embedding_blocks)
}

/// Phase A as a line in m, `fixed + slope × m`, its allocator share and
/// the CUDA context included: what the estimate prints, and where the
/// search for the largest micro batch jumps to.
pub(super) fn line(pl: &Plan) -> (f64, f64) {
    let persistent = pl.persistent();
    let fixed = persistent
        + pl.gradients.kept_in_phase_a
        + pl.weights.phase_a_copies
        + allocator_overhead(
            pl,
            persistent + pl.gradients.total,
            pl.weights.phase_a_copies,
        )
        + pl.overheads.cuda_context;
    (fixed, reserved_slope(pl))
}

/// Phase A's allocator overhead on its fixed part (the line `fixed + slope × m`),
/// the checkpointed optimizer states' holes included (as in [`eval`]).
fn allocator_overhead(pl: &Plan, persistent: f64, transient: f64) -> f64 {
    // The first step's states counted inside the loss cache (see
    // `first_step_states`: it takes back at most all of them), so the line
    // stays a floor of the peak.
    let states_in_cache = if first_step_states_apply(pl) {
        pl.optimizer.first_step_states
    } else {
        0.0
    };
    ALLOCATOR_PERSISTENT_SHARE * persistent
        + pl.allocator.shares.transient * transient
        + state_holes(pl)
        - states_in_cache
}

/// Phase A's reserved bytes per sample: activations and loss buffers with
/// their allocator share, plus the checkpointed turn-taking share and the
/// loss buffer's hole (as in [`eval`]).
fn reserved_slope(pl: &Plan) -> f64 {
    pl.activations.total * (1.0 + pl.allocator.shares.transient)
        + pl.loss.peak * (1.0 + pl.allocator.shares.transient_loss)
        + pl.allocator.shares.recompute * pl.activations.recompute_overlap
        + pl.allocator.shares.loss_holes * pl.loss.eager_buffer
}

/// Whether phase A's loss buffers fit, one each, in the blocks phase B
/// caches for the largest parameter (its gradient and the optimizer's
/// temporary of its shape). The default allocator serves a request from
/// the smallest cached free block at least as large (`get_free_block`,
/// a `lower_bound` on size after rounding to 2 MiB), so the loss buffers
/// and the embedding-shaped blocks trade places across the step only when
/// a buffer is no larger than that block (measured on an H100:
/// bench/data/h100/throughput.csv, the test
/// `loss_buffers_share_the_embedding_gradients_blocks_only_when_they_fit`).
fn loss_fits_grad_blocks(pl: &Plan, m: f64) -> bool {
    pl.allocator.shares.fixed_segments
        && pl.loss.largest_tensor > 0.0
        && pl.gradients.largest_block > 0.0
        && round_large(pl.loss.largest_tensor * m) <= round_large(pl.gradients.largest_block)
}

/// Holes among the optimizer states made in the first step (checkpointed;
/// see [`EXPANDABLE_SEGMENTS`]).
fn state_holes(pl: &Plan) -> f64 {
    if pl.allocator.checkpointing {
        pl.allocator.shares.state_holes * pl.optimizer.states
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The replay (scripts/alloc_sim.py) restates the same allocator sizes:
    /// the two copies must agree, or the replay and the model describe
    /// different allocators.
    #[test]
    fn the_replay_uses_the_same_allocator_sizes() {
        let py = include_str!("../../../../scripts/alloc_sim.py");
        let value = |name: &str| -> f64 {
            let line = py
                .lines()
                .find(|l| l.starts_with(&format!("{name} =")))
                .unwrap_or_else(|| panic!("{name} not in alloc_sim.py"));
            let expr = line.split('=').nth(1).unwrap().split('#').next().unwrap();
            let expr = expr.trim().replace('_', "");
            match expr.split_once('*') {
                Some((n, unit)) => {
                    assert_eq!(unit.trim(), "MB", "{line}");
                    n.trim().parse::<f64>().unwrap() * MIB
                }
                None => expr.parse::<f64>().unwrap(),
            }
        };
        assert_eq!(value("K_MIN_BLOCK"), K_MIN_BLOCK);
        assert_eq!(value("K_SMALL_SIZE"), K_SMALL_SIZE);
        assert_eq!(value("K_SMALL_BUFFER"), K_SMALL_BUFFER);
        assert_eq!(value("K_LARGE_BUFFER"), K_LARGE_BUFFER);
        assert_eq!(value("K_MIN_LARGE_ALLOC"), K_MIN_LARGE_ALLOC);
        assert_eq!(value("K_ROUND_LARGE"), K_ROUND_LARGE);
        // and MB there is a mebibyte
        assert!(py.lines().any(|l| l == "KB, MB = 1024, 1024 * 1024"));
    }
}
