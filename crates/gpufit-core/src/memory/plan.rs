//! The plan: every term of the memory model that does not depend on the
//! micro batch, built part by part from the workload and settings
//! (storage → gradients → optimizer → loss buffers → activations).

use crate::settings::EngineeringSettings;
use crate::workload::{Framework, Method, Workload};

use super::activations;
use super::allocator::{CACHING_ALLOCATOR, EXPANDABLE_SEGMENTS};
use super::constants::{
    COMPILE_BLOCK_FACTOR, COMPILE_LOSS_FACTOR, CUBLAS_WORKSPACES_BYTES, CUDA_CONTEXT_BYTES,
    TORCHTUNE_CE_CHUNKS,
};
use super::loss;
use super::precision::{activation_dtype, compute_bytes};
use super::storage::{gradients, largest_size_blocks, layout, optimizer, weights};
use super::types::{Activations, AllocatorSetup, Head, LossBuffers, ModelOptions, Overheads, Plan};

/// The plan of a workload under some settings.
pub(super) fn plan(w: &Workload, s: &EngineeringSettings, opts: &ModelOptions) -> Plan {
    let l = layout(w, s);
    let weights = weights(w, s, opts, &l);
    let mut gradients = gradients(w, s, opts, &l);
    let mut optimizer = optimizer(w, s, opts, &l);
    (gradients.largest_size_blocks, gradients.second_use_block) =
        largest_size_blocks(w, &l, gradients.largest_block, optimizer.step_temporaries);
    let mut loss = loss::buffers(w, s, opts);
    let mut activations = activations::per_sample(w, s, opts, &loss);
    if s.compile {
        compiled(&mut activations, &mut loss);
        if w.framework == Framework::Torchtune && opts.head == Head::LanguageModel {
            if loss::torchtune_plain(w, opts) {
                torchtune_compiled_plain_loss(w, s, opts, &mut loss);
            } else {
                torchtune_compiled_loss(w, s, opts, &mut loss);
            }
        }
    }
    let checkpointing = s.activation_checkpointing;
    // AdamW and the others make their states in the first `step()`, and a
    // full fine-tune's are weight-shaped (large-pool blocks); an adapter's
    // are small tensors of the small pool.
    if checkpointing && w.method == Method::Full && loss.head_output > 0.0 {
        optimizer.first_step_states = optimizer.states;
    }
    let shares = if opts.expandable_segments {
        EXPANDABLE_SEGMENTS
    } else {
        CACHING_ALLOCATOR
    };
    let released_under_pressure = checkpointing
        && shares.fixed_segments
        && w.method != Method::Full
        && !l.mixed
        && weights.phase_a_copies == 0.0;
    Plan {
        weights,
        gradients,
        optimizer,
        activations,
        loss,
        overheads: Overheads {
            cuda_context: opts.cuda_context_bytes.unwrap_or(CUDA_CONTEXT_BYTES) as f64,
            cublas_workspaces: CUBLAS_WORKSPACES_BYTES as f64,
        },
        allocator: AllocatorSetup {
            shares,
            checkpointing,
            released_under_pressure,
        },
    }
}

/// `torch.compile`: Inductor fuses the element-wise ops, so their
/// intermediates are not saved for backward. The per-sample part shrinks
/// (the blocks and the loss by different factors, see
/// `COMPILE_BLOCK_FACTOR`), the fixed part does not move, and the fused
/// loss leaves no hole (measured with expandable segments:
/// bench/data/h100/expandable/families.csv, the test
/// `expandable_segments_hold_a_loss_buffer_hole_and_holes_between_new_states`).
fn compiled(acts: &mut Activations, loss: &mut LossBuffers) {
    acts.total *= COMPILE_BLOCK_FACTOR;
    acts.hidden_width *= COMPILE_BLOCK_FACTOR;
    acts.recompute_overlap *= COMPILE_BLOCK_FACTOR;
    loss.peak *= COMPILE_LOSS_FACTOR;
    loss.at_forward_end *= COMPILE_LOSS_FACTOR;
    loss.stranded_buffer *= COMPILE_LOSS_FACTOR;
    loss.eager_buffer = 0.0;
    loss.head_output = 0.0;
}

/// torchtune under `compile: True` compiles only the upcast and
/// cross-entropy of each chunk of `CEWithChunkedOutputLoss`
/// (torchtune/training/_compile.py `compile_loss`:
/// `loss.compute_cross_entropy = torch.compile(loss.compute_cross_entropy)`,
/// not the chunking). Inductor fuses the fp32 upcast and the log-softmax
/// into the loss kernel and recomputes them in backward from the chunk's
/// 16-bit logits, so the loss holds the chunks' logits (kept for that
/// backward) and, in backward, one chunk's 16-bit gradient: not the fitted
/// HF factor, which scales a loss that keeps its fp32 log-probs.
fn torchtune_compiled_loss(
    w: &Workload,
    s: &EngineeringSettings,
    opts: &ModelOptions,
    loss: &mut LossBuffers,
) {
    let tv = w.seq_len as f64 * w.model.vocab_size as f64;
    let e = compute_bytes(activation_dtype(w, s, opts));
    loss.at_forward_end = tv * e;
    loss.peak = tv * (e + e / TORCHTUNE_CE_CHUNKS);
}

/// torchtune under `compile: True` with `torch.nn.CrossEntropyLoss`
/// compiles the whole loss (`compile_loss`: `loss = torch.compile(loss)`
/// for any loss but the chunked ones) and, per layer, the transformer
/// layers only (`compile_model`), so the output head and its `.float()`
/// stay eager. Forward: the 16-bit logits and their fp32 cast are both
/// alive while the cast runs; the compiled loss fuses log-softmax and nll
/// and saves its fp32 input, the logits. Backward: that input and the
/// fp32 gradient the fused kernel writes (8 bytes per token × vocabulary
/// entry).
fn torchtune_compiled_plain_loss(
    w: &Workload,
    s: &EngineeringSettings,
    opts: &ModelOptions,
    loss: &mut LossBuffers,
) {
    let tv = w.seq_len as f64 * w.model.vocab_size as f64;
    let e = compute_bytes(activation_dtype(w, s, opts));
    // fp32 logits need no cast (`.float()` returns the tensor itself)
    let cast = if e < 4.0 { e + 4.0 } else { 4.0 };
    loss.at_forward_end = tv * cast;
    loss.peak = tv * cast.max(8.0);
}

/// The optimizer step's bytes alone (see `storage::optimizer`), without
/// the rest of the plan: the throughput model asks for them once per
/// candidate.
pub(super) fn optimizer_step_bytes(
    w: &Workload,
    s: &EngineeringSettings,
    opts: &ModelOptions,
) -> f64 {
    optimizer(w, s, opts, &layout(w, s)).step_traffic
}
