//! PyTorch's caching allocator: what `max_memory_reserved` holds beyond
//! the tensors, per allocator mode (docs/design.md, "The memory model").

use super::plan::Plan;
use crate::core::units;

/// Caching-allocator overhead: `max_memory_reserved` exceeds
/// `max_memory_allocated` because blocks freed by the step's transient
/// tensors (activations, loss buffers, optimizer temporaries) are kept in
/// segments that later, differently sized requests cannot fully reuse
/// (c10/cuda/CUDACachingAllocator.cpp: requests over 1 MiB are rounded to
/// 2 MiB and served best-fit from cached blocks, splitting them; a request
/// no cached block can hold maps a new segment, and nothing is returned to
/// the driver without `empty_cache`). Reserved memory therefore only grows
/// during the run: the reserved peak is the larger of
/// * phase A's allocation plus the unreusable share of its own transients
///   (blocks split by tensors of other sizes in the same forward/backward),
/// * phase B's allocation plus the part of phase A's cached transients that
///   the gradients and the optimizer's temporaries could not reuse.
///
/// The shares below are fitted to the reserved-byte measurements on an
/// H100 in bench/data/h100/ (`cargo bench --bench accuracy` prints the
/// residuals; `GPUFIT_ACCURACY_DUMP` writes the phase terms they were
/// fitted from); the phase terms they multiply are the model's own. The
/// last refit used every default-allocator row, the holdout grid included.
///
/// How much of each transient the allocator keeps reserved beside the
/// allocation (see above); one set per allocator mode.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct AllocatorShares {
    /// Phase A: share of its hidden-width transients (activations,
    /// autocast/dequantization copies: many tensors of a few sizes) that
    /// stays reserved but unusable.
    transient: f64,
    /// Phase A: the same for the loss buffers (a few vocabulary-wide
    /// tensors, each its own segment, whose sizes the other tensors do not
    /// share).
    transient_loss: f64,
    /// Phase A: share of one loss buffer (the loss path's largest tensor,
    /// see `Plan::loss_buffer_per_sample`) left as a hole.
    loss_holes: f64,
    /// Checkpointed phase A: share of the optimizer states left as holes
    /// (see `EXPANDABLE_SEGMENTS`).
    state_holes: f64,
    /// Checkpointed phase A: the loss buffers (vocabulary-wide) and the
    /// recomputed block's tensors (hidden/intermediate-wide) take turns but
    /// do not fit into each other's freed blocks: this share of the smaller
    /// of the two stays reserved beside the larger.
    recompute: f64,
    /// Phase B without checkpointing: gradients replace activations as the
    /// backward frees them (similar sizes), so only the optimizer
    /// temporaries miss the cache: this share of the smaller of phase A's
    /// transients and the temporaries stays reserved.
    cross_phase: f64,
    /// Phase B with checkpointing: gradients are made one recomputed block
    /// at a time, in between that block's activations, and split the cached
    /// loss blocks; the optimizer's temporaries then find no block large
    /// enough among them: this share of phase A's loss buffers stays
    /// reserved. The activations' blocks (hidden-width inputs, one block's
    /// tensors) do take the temporaries: only what exceeds the temporaries
    /// stays (the replay of BERT-large fp32 at 8 × 512, checkpointed:
    /// reserved = allocated in phase B, measured 6.33 against 6.31 GiB).
    cross_phase_checkpointed: f64,
    /// Fixed-size segments (the default allocator): requests of 1–10 MiB
    /// share 20 MiB segments (see [`segment_waste_share`]), and a freed
    /// block serves only requests that fit in it, so the last step's
    /// parameter-shaped blocks wait beside a forward that cannot use them.
    /// Expandable segments have neither.
    pub(super) fixed_segments: bool,
}

/// The default caching allocator. First fitted to the reserved-byte
/// measurements of all 195 default-allocator H100 rows in bench/data/h100/
/// (holdout grid included) after the per-block terms were counted with
/// autograd's saved-tensor hooks (bench/data/saved_tensors.jsonl): median
/// 2.6 %. Refitted on all 507 scored rows of `cargo bench --bench accuracy`
/// (H100 and H200 measurements and the published tables) under the bound
/// that no row is predicted more than 10 % below its measurement (issue
/// 11; under-prediction is what turns a suggestion into an OOM): of the
/// grid points that meet it, one whose median is lower than before over
/// all rows and the same over the H100's. The median is flat along a
/// valley that trades the loss buffers' share (`transient_loss`) against
/// the checkpointed turn-taking share (`recompute`): (0.10, 1.0) and
/// (0.12, 0.9) both give
/// a median of 1.7 % over all rows and 2.0 % over the H100's, but the
/// first leaves Gemma 2's eager LoRA bf16-mixed 4 × 1,024 checkpointed
/// row 10.2 % below its measurement (31.72 GiB; 27.75 in another series,
/// 28.85 replayed as a fresh job) and the second 9.8 % (28.60 GiB).
/// Once the first step's optimizer states were counted in the loss
/// segments (`first_step_states`), the checkpointed phase-B share went
/// from 1.0 to 0.95 on the same grid, the others kept: 1.0 had stood in
/// for some of those states' segments, and left Llama-3.2-1B full bf16
/// 4 × 2,048 checkpointed at 23.41 GiB, 11.3 % above a fresh job's 21.04
/// (22.83 now; 24.89 where cuBLAS's workspaces were made before the
/// step: −8.3 %). The grid that chose them: `python3
/// scripts/refit_shares.py`; its figures are in BENCHMARKS.md ("Issue 11,
/// twentieth session" and "twenty-first session").
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
/// replay (`scripts/alloc_sim.py --expandable`, which reproduces the 56
/// replayable rows of bench/data/h100/expandable/ within a median 0.3 %):
/// * `loss_holes`: one loss buffer's block, freed in the loss's forward or
///   backward and partly refilled by small tensors, sits below live ones
///   when the next buffer of that size is requested, so the segment grows
///   by one buffer. Mistral-7B LoRA bf16 at 4 × 4,096, checkpointed: at
///   the allocated peak one 1.60 GiB hole where a 1.95 GiB fp32 buffer
///   was; measured gap 1.69 GiB. Over the phase-A rows the gap is
///   0.5–0.7 buffers (median 0.6) whether checkpointed or not.
/// * `state_holes` (checkpointed): AdamW makes its states in the first
///   optimizer step, when the freed loss buffers and the recomputed
///   blocks' tensors are most of the cache, so the states are cut from
///   them and leave holes between them that the next step's loss buffers
///   cannot use. Gemma 2 2B full bf16 at 4 × 1,024: 6.4 GiB of holes
///   between and around 9.7 GiB of states (measured gap 6.40 GiB).
///
/// The two shares were chosen on the 69 expandable-segments rows (a grid
/// of 0.5–0.7 × 0.2–0.3, `cargo bench --bench accuracy`): median 1.4 %,
/// worst 7.4 % (with the compile factors of `activations`), against
/// 2.0 % and 13.4 % for the previous shares
/// (loss-buffer share 0.10 and the recomputed block's turn-taking, which
/// over-counted models with small vocabularies: Mistral and Falcon LoRA
/// at +12 %).
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
/// are 1–10 MiB: the replay of BERT-large in fp32 at 4 × 512 tokens
/// (scripts/alloc_sim.py) holds 120 segments of 20 MiB with two 8 MiB
/// tensors each and the 4 MiB tail free (0.47 GiB of its 0.83 GiB gap over
/// the tensors; measured gap 0.85 GiB). The tails are counted as lost:
/// the replay leaves them free, the activations' other sizes being larger
/// or landing in the small pool.
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

pub(super) fn eval(pl: &Plan, m: f64) -> Eval {
    let persistent = pl.persistent();
    let a = allocated_phase_a(pl, m);
    let b = persistent + pl.grads + pl.step_transient + pl.logits_held_per_sample * m;
    let phase_a = a >= b;
    // Allocated bytes: the forward's end (every cast, the forward's loss
    // buffers) or the loss's backward (without the casts freed in between).
    // The freed casts' blocks stay cached and the loss buffers cannot use
    // them, so the reserved bytes below keep `a`.
    let a_allocated = a - pl
        .casts_freed_before_backward
        .min((pl.logits_per_sample - pl.logits_fwd_per_sample) * m);
    let allocated = a_allocated.max(b);
    let loss_in_grad_blocks = loss_in_grad_blocks(pl, m);
    let dyn_a = (pl.act_per_sample + pl.logits_per_sample) * m;
    let (reserved_a, kept_a) = reserved_phase_a(pl, m);
    let reserved_a = through_the_dips(pl, m, reserved_a);
    // The tied embedding's second-use gradient is made in every backward
    // and freed before the optimizer step. Replayed (scripts/alloc_sim.py,
    // Qwen2.5-0.5B full bf16-mixed 1 × 512, checkpointed), its block is
    // the free 0.51 GiB segment at phase B's peak, once the loss buffers
    // have taken the blocks of its size; on the H100 AdamW's temporary
    // took it (Llama-3.2-1B bf16-mixed 1 × 2,048: 23.10 GiB reserved over
    // 23.08 allocated). Counted beside phase B: the safe side.
    let second_use = if loss_in_grad_blocks > 0.0 {
        pl.second_use_block
    } else {
        0.0
    };
    let reserved_b = b + if pl.checkpointing {
        pl.shares.cross_phase_checkpointed
            * (pl.logits_per_sample * m - loss_in_grad_blocks
                + second_use
                + (pl.act_per_sample * m - pl.step_transient).max(0.0))
    } else {
        pl.shares.cross_phase * dyn_a.min(pl.step_transient)
    };
    let persistent_share = ALLOCATOR_PERSISTENT_SHARE * (persistent + pl.grads);
    let reserved = reserved_a.max(reserved_b) + persistent_share;
    // Under pressure, what the release can return: the loss buffers' own
    // segments and the recomputed blocks' (they take turns, each whole when
    // free), and phase B's cache of phase A's transients. What stays is the
    // split blocks (the `transient` share). Only where the step cuts nothing
    // long-lived from those segments (`cache_released_under_pressure`):
    // otherwise an optimizer state, a gradient or a kept autocast copy sits
    // in them and nothing goes (scripts/alloc_sim.py: Qwen2.5-7B LoRA bf16
    // 8 × 4,096 checkpointed needs 91.0 GiB unpressed and runs in 78.0 GiB,
    // measured 77.9; the same in bf16-mixed, and full fine-tunes, need their
    // unpressed peak).
    let least_reserved = if pl.cache_released_under_pressure {
        kept_a.max(b) + persistent_share
    } else {
        reserved
    };
    Eval {
        allocated,
        reserved,
        device: reserved + pl.cuda_context,
        least_device: least_reserved.min(reserved) + pl.cuda_context,
        phase_a,
    }
}

/// Phase A's allocated bytes at micro batch `m`: the persistent bytes,
/// the gradients accumulation keeps, the autocast copies, activations and
/// loss buffers.
fn allocated_phase_a(pl: &Plan, m: f64) -> f64 {
    pl.persistent()
        + pl.grads_in_a
        + pl.weights_transient_a
        + pl.act_per_sample * m
        + pl.logits_per_sample * m
}

/// Where each loss buffer fits in the largest gradient's block (see
/// [`loss_fits_grad_blocks`]), the loss buffers are cut from those cached
/// blocks, as many as they hold.
fn loss_in_grad_blocks(pl: &Plan, m: f64) -> f64 {
    if loss_fits_grad_blocks(pl, m) {
        (pl.logits_per_sample * m).min(pl.grad_blocks)
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
    let packing = if pl.shares.fixed_segments {
        segment_waste_share(pl.hidden_tensor_per_sample * m) * pl.act_hidden_per_sample * m
    } else {
        0.0
    };
    let loss_in_grad_blocks = loss_in_grad_blocks(pl, m);
    // The previous step's phase B left its freed gradients (set to None
    // before this forward) and optimizer temporaries cached: blocks of
    // parameter shapes, which this phase's activations and autocast weight
    // copies reuse but its loss buffers (vocabulary-wide) cannot, unless
    // they fit (above). Replayed (scripts/alloc_sim.py) for Qwen2.5-0.5B
    // full bf16 at 1 × 512: 30 empty 20 MiB segments of AdamW's
    // temporaries still cached at the next forward's peak. Checkpointed
    // runs are left to `cross_phase_checkpointed`, whose recomputed blocks
    // take them.
    let reusing_act = activations_reusing_grad_blocks(pl, m, loss_in_grad_blocks);
    let carried_b = if pl.shares.fixed_segments && !pl.checkpointing {
        (pl.grads - pl.grads_in_a + pl.step_transient
            - reusing_act
            - pl.weights_transient_a
            - loss_in_grad_blocks)
            .max(0.0)
    } else {
        0.0
    };
    let loss_cache = pl.shares.transient_loss * pl.logits_per_sample * m
        + pl.shares.recompute * pl.recompute_overlap_per_sample * m
        + pl.shares.loss_holes * pl.loss_buffer_per_sample * m
        + state_holes(pl);
    // The first step's optimizer states in the loss segments (see
    // `first_step_states`): a whole buffer more per segment they cut,
    // less the states that sit in the cache instead of beside it.
    let loss_cache = match first_step_states(pl, m) {
        Some((_, gain)) => (loss_cache + gain).max(0.0),
        None if pl.shares.fixed_segments => loss_cache.max(pl.stranded_loss_buffer_per_sample * m),
        None => loss_cache,
    };
    // blocks split by tensors of other sizes in the same phase
    let split = pl.shares.transient * (pl.act_per_sample * m + pl.weights_transient_a);
    (
        a + packing + carried_b + split + loss_cache,
        a + packing + split,
    )
}

/// The optimizer states a checkpointed full fine-tune makes in its first
/// optimizer step, and the loss path's segments. The first step's forward
/// runs without them (AdamW makes its states in the first `step()`), so
/// its loss phase maps one segment per loss buffer — the head's 16-bit
/// logits and the fp32 buffers — and the reserved bytes of that step are
/// the step's allocation less the states plus the fitted loss cache. Then
/// the loss buffers are freed and the states, weight-shaped requests
/// served best fit, are cut from those cached segments, the smallest
/// (the head's logits) first. Each fp32 segment a state is cut from can
/// no longer hold the next step's buffer of its size, which maps a new
/// one. So phase A's reserved bytes gain, beside the fitted loss cache,
/// one loss buffer per segment cut less the states that sit inside the
/// cache (they were counted beside it in `a`).
///
/// Replayed (scripts/alloc_sim.py --workspaces-mib 32) for Llama-3.2-1B
/// full bf16 at m × 2,048, checkpointed (4.60 GiB of states, a 0.49·m GiB
/// head segment, 0.98·m GiB buffers): at m = 8 the head segment holds
/// 3.91 GiB, 0.69 GiB of states cut an fp32 segment and the second step
/// maps a fourth: 39.90 GiB reserved over 31.74 allocated (measured
/// 39.79–40.10 on H100s); at m = 12 the states fit in the 5.87 GiB head
/// segment, the peak is the first step's: 46.89 over 44.12 (measured
/// 46.75); at m = 9 35.80 — less than at m = 8. Measured gaps over the
/// allocated bytes at m = 4, 6, 8, 12 and 16 were 0.45, 0.84, 1.05, 0.23
/// and 0.33 loss buffers, where the fitted shares alone gave 0.65 each.
///
/// Under autocast the states are fp32 (9.21 GiB for the same model) and
/// the head's 16-bit weight copy, made in every forward, is cut from a
/// free fp32 loss segment too (`Plan::stranded_loss_buffer_per_sample`):
/// where the states cut one, the copy sits beside them in it (replayed at
/// 8 × 2,048: 4.98 GiB of states and the 0.49 GiB copy in one 7.83 GiB
/// segment, one buffer mapped in the second step, 44.82 GiB reserved;
/// measured 45.27), so at least one segment counts as cut.
///
/// Where the states overflow the head's segment by little, the freed
/// segments of the recomputed blocks' tensors take the rest and nothing
/// is cut (replayed at 9 × 2,048: 0.2 GiB over the 4.40 GiB head segment,
/// 35.80 GiB reserved). The rule does not count those holes, so there it
/// keeps one buffer too many (44.79 GiB): the safe side, at the few micro
/// batches where the head's segment just falls short.
///
/// Returns the segments cut and what phase A's reserved bytes gain (less
/// than 0 where the states fit in the head's segment), or None where the
/// rule does not apply (see `Plan::first_step_states`).
fn first_step_states(pl: &Plan, m: f64) -> Option<(f64, f64)> {
    if !first_step_states_apply(pl) {
        return None;
    }
    let states = pl.first_step_states;
    let buffer = round_large(pl.loss_buffer_per_sample * m);
    let head = round_large(pl.head_output_per_sample * m);
    // the fp32 segments of the loss phase: its bytes over one buffer's
    // (3 for transformers' upcast loss: the upcast, log-softmax, gradient)
    let segments = (pl.logits_per_sample / pl.loss_buffer_per_sample + 1e-9).floor();
    let cut = ((states - head).max(0.0) / buffer).ceil().min(segments);
    // under autocast the head's 16-bit copy strands a segment of its own
    // where the states cut none
    let cut = if pl.stranded_loss_buffer_per_sample > 0.0 {
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
/// a plan that has such states (`Plan::first_step_states`, set only where
/// the loss path has a head segment) and fp32 loss buffers to cut.
fn first_step_states_apply(pl: &Plan) -> bool {
    pl.shares.fixed_segments && pl.first_step_states > 0.0 && pl.loss_buffer_per_sample > 0.0
}

/// Phase A's reserved bytes `reserved_a` at micro batch `m`, kept at least
/// at those of any smaller micro batch. Where a larger micro batch's head
/// segment holds states that a smaller one's could not (see
/// [`first_step_states`]), the reserved bytes fall by up to a loss buffer
/// — replayed, Llama-3.2-1B full bf16 at 8 × 2,048 holds 39.90 GiB and at
/// 9 × 2,048 35.80 — and the advisor's search for the largest micro batch
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
/// checkpointing; see `carried_b` in [`eval`]). The allocator serves a
/// request only from a cached block at least as large (best fit after
/// rounding to 2 MiB), so an MLP-intermediate activation (tokens ×
/// `intermediate_size`) fits in an MLP weight's gradient block (`hidden ×
/// intermediate_size`) only while the micro batch's tokens are at most
/// `hidden_size` (the same element size). Past that, those activations
/// map segments of their own beside the cached blocks, except for what the
/// embedding-shaped blocks (`grad_blocks`, less what the loss buffers
/// took) hold. Replayed (scripts/alloc_sim.py) for Qwen2.5-1.5B full bf16
/// at 2 × 1,024 (2,048 tokens over a hidden size of 1,536: 35 MiB
/// activations against 26.25 MiB blocks): reserved 22.47 GiB over 17.85
/// allocated, measured 22.63–22.70 on an H100 and an H200, where counting
/// every activation as reusing the cache gave 18.73; Qwen2.5-3B at the
/// same shape (hidden size 2,048: they fit) holds 33.56 over 30.14, as
/// the cache-reusing count says.
fn activations_reusing_grad_blocks(pl: &Plan, m: f64, loss_in_grad_blocks: f64) -> f64 {
    let act = pl.act_per_sample * m;
    let wide_tensor = round_large(pl.wide_tensor_per_sample * m);
    if pl.mlp_grad_block <= 0.0 || wide_tensor <= round_large(pl.mlp_grad_block) {
        return act;
    }
    let wide = pl.act_wide_per_sample * m;
    let embedding_blocks = if wide_tensor <= round_large(pl.largest_grad_block) {
        (pl.grad_blocks - loss_in_grad_blocks).max(0.0)
    } else {
        0.0
    };
    act - wide + wide.min(embedding_blocks)
}

/// Phase A's allocator overhead on its fixed part (the line `fixed + slope × m`),
/// the checkpointed optimizer states' holes included (as in [`eval`]).
pub(super) fn allocator_overhead(pl: &Plan, persistent: f64, transient: f64) -> f64 {
    // The first step's states counted inside the loss cache (see
    // `first_step_states`: it takes back at most all of them), so the line
    // stays a floor of the peak.
    let states_in_cache = if first_step_states_apply(pl) {
        pl.first_step_states
    } else {
        0.0
    };
    ALLOCATOR_PERSISTENT_SHARE * persistent + pl.shares.transient * transient + state_holes(pl)
        - states_in_cache
}

/// Phase A's reserved bytes per sample: activations and loss buffers with
/// their allocator share, plus the checkpointed turn-taking share and the
/// loss buffer's hole (as in [`eval`]).
pub(super) fn reserved_slope(pl: &Plan) -> f64 {
    pl.act_per_sample * (1.0 + pl.shares.transient)
        + pl.logits_per_sample * (1.0 + pl.shares.transient_loss)
        + pl.shares.recompute * pl.recompute_overlap_per_sample
        + pl.shares.loss_holes * pl.loss_buffer_per_sample
}

/// Whether phase A's loss buffers fit, one each, in the blocks phase B
/// caches for the largest parameter (its gradient and the optimizer's
/// temporary of its shape). The default allocator serves a request from
/// the smallest cached free block at least as large (`get_free_block`,
/// a `lower_bound` on size after rounding to 2 MiB), so the loss buffers
/// and the embedding-shaped blocks trade places across the step only when
/// a buffer is no larger than that block. Measured on an H100
/// (bench/data/h100/throughput.csv): Llama-3.2-1B full bf16-mixed,
/// checkpointed, at 1 × 2,048 tokens — the fp32 loss buffer (2,048 ×
/// 128,256 × 4 B) is exactly the fp32 embedding's gradient (128,256 ×
/// 2,048 × 4 B) — holds 23.10 GiB reserved over 23.08 allocated; at
/// 2 × 2,048, where the buffer is twice that block, 28.97 over 23.08: the
/// loss buffers' 5.87 GiB in segments of their own.
fn loss_fits_grad_blocks(pl: &Plan, m: f64) -> bool {
    pl.shares.fixed_segments
        && pl.largest_loss_tensor_per_sample > 0.0
        && pl.largest_grad_block > 0.0
        && round_large(pl.largest_loss_tensor_per_sample * m) <= round_large(pl.largest_grad_block)
}

/// Holes among the optimizer states made in the first step (checkpointed;
/// see [`EXPANDABLE_SEGMENTS`]).
fn state_holes(pl: &Plan) -> f64 {
    if pl.checkpointing {
        pl.shares.state_holes * pl.opt_state
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
        let py = include_str!("../../../scripts/alloc_sim.py");
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
