//! The step's element-wise work: norms, residual adds, rotary embeddings,
//! MLP activations, dropout and LoRA's adapter sums. Each is a kernel that
//! reads and writes whole activations and does next to no arithmetic, so
//! it runs at the memory bandwidth, not at the tensor cores' rate: its
//! time per token is the bytes it moves over the GPU's bandwidth. For a
//! small hidden size these bytes (∝ hidden) weigh against the matmuls'
//! FLOPs (∝ hidden²): that is why a 0.5 B model's tokens/s is far below
//! what its FLOPs promise, and why LoRA on a small model saves less time
//! than the dropped weight gradients suggest.
//!
//! The bytes are counted from the eager code the frameworks run
//! (transformers' `modeling_llama.py` and its relatives, PEFT's
//! `lora.Linear.forward`), op by op, per token and block; the counts are
//! in the comments. Backward kernels read the output gradient and the
//! saved input(s) and write the input gradient: counted as twice the
//! forward's bytes. A checkpointed block runs its forward twice.

use crate::memory::StepKernels;
use crate::settings::{Dtype, EngineeringSettings};
use crate::workload::{ArchKind, Attention, LoraTarget, Method, Workload};

/// Backward element-wise bytes over forward ones: each backward kernel
/// reads the output gradient and the saved input and writes the input
/// gradient (3 tensors against the forward's 2–3); the RMSNorm backward
/// in fp32 moves more, the residual adds' less (the gradient passes
/// through). Two is the round figure.
const BACKWARD_BYTES: f64 = 2.0;

/// Share of the datasheet bandwidth that element-wise kernels reach: an
/// assumption, not a fit — PyTorch's vectorised element-wise kernels
/// stream most of the HBM peak on large tensors, less on per-token
/// reductions and broadcasts. What was checked instead is the byte
/// counts' scale: × 0.5, × 1 and × 1.5 over all measured steps gave a
/// median |error| of 9.1, 7.3 and 7.8 % (BENCHMARKS.md, seventeenth
/// session).
pub const BANDWIDTH_EFFICIENCY: f64 = 0.85;

/// Share of the element-wise bytes left under `torch.compile`: Inductor
/// fuses each chain (a norm's seven kernels, rotary's five, the gated
/// activation's two) into one kernel that reads its inputs and writes its
/// outputs once — about a third of the eager bytes by the counts below
/// (RMSNorm 36 → 4 bytes an element, rotary 20 → 6, the MLP's 10 → 6).
/// Fitted on the H100's compiled steps (bench/data/h100/compile_accum.csv:
/// Llama-3.2-1B full and Llama-3.1-8B LoRA): 0.35 puts the four within
/// −6 … +5 %. With no dispatch floor for compiled steps (`super::
/// dispatch::seconds`) it replaces a factor of 1.2 on the whole step (the
/// four within −9 … −3 % with it); Qwen2.5-0.5B compiled stays 44 % under
/// with either.
pub const COMPILE_ELEMENTWISE_SHARE: f64 = 0.35;

/// Bytes the step's element-wise kernels move per token: forward,
/// backward and a checkpointed block's second forward. `kernels` is
/// `memory::step_kernels(w, s)`.
pub fn bytes_per_token(w: &Workload, s: &EngineeringSettings, kernels: StepKernels) -> f64 {
    let a = &w.model;
    let h = a.hidden_size as f64;
    let qd = a.num_attention_heads as f64 * a.head_dim as f64;
    let kvd = a.num_kv_heads as f64 * a.head_dim as f64;
    let active = a.active_experts();
    let i = a.intermediate_size as f64 * active;
    // Matmul outputs (q, k, v, the MLP's) are 16-bit unless the blocks
    // compute in fp32; the residual stream is fp32 under autocast too (the
    // weights, and so the embedding's output and every norm's, are fp32).
    let e = if kernels.compute == Dtype::Fp32 {
        4.0
    } else {
        2.0
    };
    let mixed = s.dtype.is_mixed();
    let r = if mixed { 4.0 } else { e };
    let classic = !a.gated_mlp;

    // Norms. transformers' RMSNorm (the Llama family, Gemma) is Python:
    // `x.to(float32)` (r + 4 bytes an element), `pow(2)` (8), `mean` (4),
    // `x * rsqrt(var + eps)` (8), `.to(input dtype)` (4 + r), `weight * x`
    // (2r): 28 + 4r bytes, of which the two casts vanish when the input is
    // already fp32 (28). LayerNorm (GPT-2, BERT, GPT-NeoX, Phi, Falcon) is
    // one fused kernel: reads r, writes r.
    let norm = if classic {
        2.0 * r
    } else if r >= 4.0 {
        28.0
    } else {
        28.0 + 4.0 * r
    };
    let norms = a.norms_per_block();
    // Residual adds: two a block (read two, write one).
    let residual = 2.0 * 3.0 * r;
    // Residual dropout (the classic blocks: GPT-2, BERT, GPT-NeoX, Phi;
    // the Llama family has none): reads one, writes one and a one-byte
    // mask.
    let dropouts = if !classic || a.quirks.no_resid_dropout {
        0.0
    } else if a.quirks.one_resid_dropout {
        1.0
    } else {
        2.0
    };
    let dropout = dropouts * (2.0 * r + 1.0);
    // Rotary (`apply_rotary_pos_emb`, on q and k): `q * cos` (2e),
    // `rotate_half` (`-x2`: e, `cat`: 2e), `* sin` (2e), the sum (3e):
    // 10e an element. Encoders and GPT-2 add learned positions once, at
    // the embedding, and T5 a relative bias to its scores: none in the
    // blocks.
    let rotary = if a.kind != ArchKind::DecoderOnly || a.quirks.unrotated_qkv_views {
        0.0
    } else {
        10.0 * e * (qd + kvd)
    };
    // The attention's output, transposed back to tokens × heads and made
    // contiguous for `o_proj`: read and write.
    let attn_out = 2.0 * e * qd;
    // MLP activation: gated `act(gate) * up` (2e + 3e an element); a fused
    // GELU reads and writes (2e); transformers' `NewGELUActivation` is nine
    // ops (`pow`, three `mul`s, two `add`s, `tanh`, the scalings): ~18e.
    let mlp = if a.gated_mlp {
        5.0 * e * i
    } else if a.quirks.composite_gelu {
        18.0 * e * i
    } else {
        2.0 * e * i
    };
    let block = norms * h * norm + h * (residual + dropout) + rotary + attn_out + mlp;

    // LoRA (PEFT `lora.Linear.forward`, no dropout): `lora_B(lora_A(x))`
    // writes the output width N, `* scaling` reads and writes it, the sum
    // with the base output reads two and writes one: 6 N elements of e.
    let adapters = match (&w.lora, w.method) {
        (Some(c), Method::Lora | Method::Qlora) => c
            .targets
            .iter()
            .map(|t| match t {
                LoraTarget::Q => qd,
                LoraTarget::K | LoraTarget::V => kvd,
                LoraTarget::O | LoraTarget::Down => h,
                LoraTarget::Gate | LoraTarget::Up => i,
                // once per token, not per block: left out
                LoraTarget::LmHead => 0.0,
            })
            .sum::<f64>(),
        _ => 0.0,
    };
    let lora = 6.0 * e * adapters;

    let forward = a.num_layers as f64 * (block + lora + scores_bytes(w, kernels, e, mixed));
    let passes = 1.0 + BACKWARD_BYTES + if s.activation_checkpointing { 1.0 } else { 0.0 };
    let compiled = if s.compile {
        COMPILE_ELEMENTWISE_SHARE
    } else {
        1.0
    };
    forward * passes * compiled
}

/// Forward bytes a token's attention scores move in one block where they
/// are materialised (eager attention, or the math SDPA composite; fused
/// kernels keep them on chip): one element per head and key — the whole
/// square, the causal half is masked, not skipped. transformers'
/// `eager_attention_forward` writes the scores (e), scales them (2e),
/// adds the mask (2e), runs `softmax(dtype=float32)` and casts back
/// (e + 4, then 4 + e) and dropout where the model has it (2e + a one-byte
/// mask); Gemma 2's soft-capping adds `/ cap`, `tanh`, `* cap` (6e).
/// Falcon's eager softmax and BERT/GPT-2's plain one stay in the scores'
/// 16-bit dtype (2e). The math SDPA composite upcasts 16-bit q, k and v
/// (its scores are fp32: e = 4 here), scales q and k before the product
/// and adds the mask and runs the softmax in that dtype.
fn scores_bytes(w: &Workload, kernels: StepKernels, e: f64, mixed: bool) -> f64 {
    if !kernels.scores_kept {
        return 0.0;
    }
    let a = &w.model;
    let q = &a.quirks;
    let eager = w.attention == Attention::Eager;
    let e = if eager { e } else { 4.0 };
    let scale = if eager { 2.0 * e } else { 0.0 };
    let softcap = if q.attn_softcapping { 6.0 * e } else { 0.0 };
    let mask = 2.0 * e;
    let plain_softmax = !eager || q.attn_softmax_16bit || (q.attn_softmax_no_upcast && !mixed);
    let softmax = if plain_softmax {
        2.0 * e
    } else {
        8.0 + 2.0 * e
    };
    let dropout = if q.no_attn_dropout || !eager {
        0.0
    } else {
        2.0 * e + 1.0
    };
    let per_score = e + scale + softcap + mask + softmax + dropout;
    a.num_attention_heads as f64 * w.seq_len as f64 * per_score
}
