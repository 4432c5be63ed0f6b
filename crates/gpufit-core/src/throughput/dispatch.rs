//! The host's side of an eager step: Python, the dispatcher and autograd
//! issue one operation after another, and the GPU cannot run ahead of
//! them. With few tokens a micro batch this, not the kernels, sets the
//! step's time. It grows with the operations a block's eager code issues,
//! which differ by family: transformers' RMSNorm is eight operations where
//! LayerNorm is one, rotary embeddings fourteen, a GELU written in Python
//! eight.

use crate::memory::StepKernels;
use crate::settings::EngineeringSettings;
use crate::workload::{ArchKind, Attention, Workload};

/// Host time of one operation of a block's forward, in seconds, with its
/// share of the module calls around it and of autograd's bookkeeping; the
/// backward counts as two forwards (`PASSES`). Fitted to the H100's
/// measured steps (`cargo bench --bench accuracy`, tokens/s; the Trainer
/// rows left out): 20, 24, 25, 26, 27.5 and 30 µs give a 90th percentile
/// |error| of 25.3, 19.2, 19.1, 19.2, 19.2 and 20.0 %, and 22, 29, 30, 36,
/// 43 and 61 steps under by more than 10 %. The H200's steps, the check:
/// median |error| 7.0 → 6.2 %, 90th percentile 21.3 → 18.6 % against one
/// time for every family's block. A Llama block's forward (51 operations,
/// [`ops_per_block`]) takes 1.3 ms with it; the fit of one time a block
/// for every family had said 1.4 ms.
pub const DISPATCH_PER_OP_S: f64 = 25e-6;

/// What a checkpointed block adds beyond its recomputed forward (counted
/// as one more pass): the non-reentrant checkpoint's saved-tensor hooks
/// and its recomputation's Python frames. Checkpointed full fine-tunes at
/// 512–1,024 tokens took 7–11 ms a block a step on the H100 and H200.
/// Fitted with the per-block time before it (1, 2 and 3 ms: 28.5, 27.4
/// and 27.1 % at the 90th percentile of |error|, with more rows under by
/// 10 % as it grows; 2 ms chosen), and swept again with the counted
/// operations at 25 µs: 0, 1, 2, 3 and 4 ms give the H100's steps a 90th
/// percentile of 24.7, 20.7, 19.1, 19.7 and 21.7 %.
pub const CHECKPOINT_DISPATCH_S: f64 = 2.0e-3;

/// Passes of a block's operations a step dispatches: the forward, and a
/// backward that counts as two (every operation's gradient, and
/// autograd's engine walking the graph).
const PASSES: f64 = 3.0;

/// Operations a block's forward issues, counted from transformers' eager
/// code (and PEFT's `lora.Linear`):
/// - a norm: RMSNorm (`to(float32)`, `pow`, `mean`, `+ eps`, `rsqrt`, two
///   `mul`s, `to`: 8), Gemma's with its fp32 `1 + weight` (10), LayerNorm
///   (one kernel);
/// - a linear: one, plus the weight's cast under autocast, plus an
///   adapter's four (`lora_A`, `lora_B`, the scaling, the sum);
/// - q, k and v: a view and a transpose each (6), the output's transpose,
///   `contiguous` and reshape (3);
/// - rotary (`apply_rotary_pos_emb` on q and k: two `unsqueeze`s, `* cos`,
///   `rotate_half`'s two slices, negation and `cat`, `* sin`, the sum: 7
///   each), with the pass-through slices and their `cat` where only part
///   of the head rotates (6 more);
/// - the attention: one SDPA call; eager attention's `matmul`, scaling,
///   mask, `softmax`, cast, dropout and `matmul` (7), soft-capping's
///   divide, `tanh` and multiply (3);
/// - the MLP's activation: `act(gate) * up` (2), a fused GELU (1),
///   `NewGELUActivation` in Python (8);
/// - two residual adds, and the residual dropouts of the classic blocks.
pub fn ops_per_block(w: &Workload, s: &EngineeringSettings, kernels: StepKernels) -> f64 {
    let a = &w.model;
    let q = &a.quirks;
    let classic = !a.gated_mlp;
    let norm = if classic {
        1.0
    } else if q.norm_scale_fp32 {
        10.0
    } else {
        8.0
    };
    let norms = a.norms_per_block();
    // transformers' MoE blocks loop over every expert that got tokens:
    // all of them, at a training batch's token counts
    let experts = a.num_experts.max(1) as f64;
    let attn_linears = if q.fused_qkv { 2.0 } else { 4.0 };
    let mlp_linears = if !a.gated_mlp || q.fused_gate_up {
        2.0
    } else {
        3.0
    } * experts;
    let router = if a.num_experts > 1 { 1.0 } else { 0.0 };
    let mixed = s.dtype.is_mixed();
    let per_linear = 1.0 + if mixed { 1.0 } else { 0.0 };
    let adapters = 4.0 * super::optimizer::adapted_linears_per_layer(w);
    let linears = (attn_linears + mlp_linears + router) * per_linear + adapters;
    let views = 9.0;
    let rotary = if a.kind != ArchKind::DecoderOnly || q.unrotated_qkv_views {
        0.0
    } else if q.partial_rotary {
        20.0
    } else {
        14.0
    };
    let attention = if kernels.scores_kept || w.attention == Attention::Eager {
        7.0 + if q.attn_softcapping { 3.0 } else { 0.0 }
    } else {
        1.0
    };
    let act = if a.gated_mlp {
        2.0
    } else if q.composite_gelu {
        8.0
    } else {
        1.0
    };
    let dropouts = if !classic || q.no_resid_dropout {
        0.0
    } else if q.one_resid_dropout {
        1.0
    } else {
        2.0
    };
    norms * norm + linears + views + rotary + attention + act + 2.0 + dropouts
}

/// The host's dispatch time of one micro batch; none under
/// `torch.compile`, whose generated code launches the fused kernels
/// without Python in between (Qwen2.5-0.5B full bf16 at 4 × 1,024 on the
/// H100: 39,043 tokens/s eager, 76,335 compiled).
pub fn seconds(w: &Workload, s: &EngineeringSettings, kernels: StepKernels) -> f64 {
    if s.compile {
        return 0.0;
    }
    let block_pass = ops_per_block(w, s, kernels) * DISPATCH_PER_OP_S;
    let (passes, extra) = if s.activation_checkpointing {
        (PASSES + 1.0, CHECKPOINT_DISPATCH_S)
    } else {
        (PASSES, 0.0)
    };
    w.model.num_layers as f64 * (passes * block_pass + extra)
}
