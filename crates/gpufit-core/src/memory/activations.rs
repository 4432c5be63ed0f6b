//! What one transformer block keeps for backward, per token: the tensors
//! autograd saves (Korthikanti et al. 2022, re-derived tensor by tensor,
//! counted with saved-tensor hooks in bench/data/saved_tensors.jsonl), the
//! transients of its backward, and the activations per sample built from
//! them (docs/memory-model.md).

use crate::settings::{Dtype, EngineeringSettings};
use crate::workload::{ArchKind, Attention, Framework, LoraTarget, Method, ModelArch, Workload};

use super::precision::{activation_dtype, base_quant, compute_bytes, kbit_recipe, param_bytes};
use super::t5::t5_layer;
use super::types::{Activations, BaseQuant, LayerActs, LossBuffers, ModelOptions};

/// Whether the blocks are transformers' modelling code: litgpt and
/// torchtune write their own (fused `gelu(approximate="tanh")`, K/V
/// expanded before SDPA), so transformers' quirks do not apply there.
fn hf_code(w: &Workload) -> bool {
    w.framework != Framework::Litgpt && w.framework != Framework::Torchtune
}

/// fp32 q, k and v with grouped K/V heads in transformers' code (see
/// [`math_sdpa`]).
fn fp32_grouped_query(w: &Workload, e: f64) -> bool {
    let a = &w.model;
    e >= 4.0 && a.num_kv_heads < a.num_attention_heads && hf_code(w)
}

/// Whether transformers' SDPA call falls to PyTorch's math composite,
/// which keeps the score matrices. fp32 q, k and v (fp32 training, or
/// PEFT's k-bit recipe without autocast, whose bitsandbytes projections
/// hand back fp32) rule out PyTorch's flash and cuDNN kernels (16-bit
/// only), and the `enable_gqa=True` transformers passes for grouped K/V
/// heads rules out the memory-efficient one (sdp_utils.cpp checks its
/// batch and heads without grouped-query support); measured in
/// bench/data/h200/qlora.csv. Falcon-7B/40B always fall there (see
/// `ArchQuirks::sdpa_math_fallback`).
pub(super) fn math_sdpa(w: &Workload, e: f64) -> bool {
    w.attention == Attention::Sdpa
        && (w.model.quirks.sdpa_math_fallback || fp32_grouped_query(w, e))
        && hf_code(w)
}

/// Layers whose SDPA call gets an explicit mask: transformers leaves the
/// causal mask out (SDPA then runs its flash kernel with `is_causal`) only
/// while the keys are fewer than the model's sliding window
/// (`_ignore_causal_mask_sdpa` in transformers' masking_utils.py:
/// `kv_length < local_attention_size`); from there a windowed layer passes
/// a (batch, 1, seq, seq) mask, which the flash kernel does not take, and
/// PyTorch runs the memory-efficient kernel. Mistral-7B-v0.1 (window 4,096)
/// at 4,096 tokens; Phi-3-mini-4k (2,047) from 2,048. The math fallback
/// keeps its scores instead (`math_sdpa`).
pub(super) fn masked_sdpa_layers(w: &Workload) -> u32 {
    let window = w.model.quirks.sliding_window;
    if w.attention != Attention::Sdpa || !hf_code(w) || window == 0 || w.seq_len < window {
        return 0;
    }
    if w.model.quirks.alternating_sliding_window {
        w.model.num_layers / 2
    } else {
        w.model.num_layers
    }
}

/// Whether the step's attention materialises its score matrices, in
/// activations of `dtype` (`activation_dtype`): eager attention, an SDPA
/// call that runs the math composite ([`math_sdpa`]), or litgpt's
/// soft-capped attention — litgpt cannot use SDPA with attention
/// soft-capping (Gemma 2): its `scaled_dot_product_attention` computes
/// `q @ k.mT`, tanh, an fp32 softmax and its 16-bit cast in Python
/// (litgpt/model.py), whatever attention the job asked for. The memory
/// model keeps the scores then; the throughput model runs them at eager
/// attention's speed.
pub(super) fn scores_materialized(w: &Workload, dtype: Dtype) -> bool {
    let litgpt_softcap = w.framework == Framework::Litgpt && w.model.quirks.attn_softcapping;
    w.attention == Attention::Eager || math_sdpa(w, compute_bytes(dtype)) || litgpt_softcap
}

/// The sizes a block's terms are counted in (elements per token).
struct Dims {
    hidden: f64,
    heads: f64,
    /// Query width: heads × head_dim.
    q_width: f64,
    /// Key/value width: K/V heads × head_dim.
    kv_width: f64,
    intermediate: f64,
    /// Experts each token is routed to (1 for a dense MLP).
    routed: f64,
    /// LoRA rank (0 for a full fine-tune).
    rank: f64,
}

/// Element sizes, bytes.
struct ElementSizes {
    /// The dtype the block's activations follow ([`activation_dtype`]).
    dtype: Dtype,
    /// An activation (matmul output) element.
    act: f64,
    /// The residual stream: fp32 params make fp32 embeddings and residual
    /// adds under autocast.
    residual: f64,
    /// The MLP's intermediates: fp32 behind bitsandbytes projections fed
    /// from an fp32 residual (see `kbit_recipe`), even under autocast.
    mlp: f64,
}

/// Whose code runs the block, and the block's shape.
struct Code {
    /// transformers' modelling code ([`hf_code`]).
    hf: bool,
    litgpt: bool,
    /// A LayerNorm block with a plain MLP (GPT-2, BERT, Phi, Falcon), not
    /// an RMSNorm + SwiGLU decoder.
    classic: bool,
    hf_classic: bool,
    litgpt_classic: bool,
    /// transformers' classic blocks keep dropout masks only where the
    /// config's probability is above 0; litgpt's blocks have no dropout.
    resid_dropout: bool,
    attn_dropout: bool,
}

/// How the attention runs.
struct AttentionPath {
    /// The score matrices are materialised ([`scores_materialized`]).
    scores_kept: bool,
    /// transformers' SDPA call runs PyTorch's math composite ([`math_sdpa`]).
    math_sdpa: bool,
    /// fp32 q, k and v with grouped K/V heads ([`fp32_grouped_query`]).
    fp32_gqa: bool,
    /// transformers' SDPA path (flash/efficient kernel, no mask in
    /// training) passes `enable_gqa=True` instead of repeating K/V
    /// (`use_gqa_in_sdpa`, torch ≥ 2.5), so k and v are saved at their own
    /// head count, and o_proj's input is a view of the kernel's output,
    /// whose layout is already (batch, seq, heads, dim): one tensor, not two.
    hf_sdpa: bool,
    /// Softmax in 16 bits: Falcon's eager code (`softmax(..., dtype=
    /// hidden_states.dtype)`), which under autocast is the fp32 residual's
    /// dtype. PyTorch's math SDPA instead upcasts 16-bit inputs to fp32
    /// (`allow_fp16_bf16_reduction_math_sdp` is off by default since torch
    /// 2.5).
    softmax_16bit: bool,
    /// A plain softmax (BERT, GPT-2): 16-bit only outside autocast.
    softmax_no_upcast: bool,
    /// q ends up laid out head-major (batch, heads, seq, dim) when partial
    /// rotary concatenates its parts, or when RoPE's element-wise ops read
    /// a slice of a fused qkv output (not dense, so their output is
    /// allocated in q's logical order); GPT-2's unrotated views and the
    /// Llama family's own projections stay sequence-major. Counted on the
    /// CPU, whose flash kernel also allocates its output like q.
    q_head_major: bool,
}

/// Who saves the trainable linears' inputs.
struct Inputs {
    /// A full fine-tune (every linear trains).
    full: bool,
    /// PEFT keeps adapters in fp32 on a 16-bit base
    /// (`autocast_adapter_dtype`) and casts each adapter's input to the
    /// adapter's dtype (`_cast_input_dtype`): every adapter saves its own
    /// copy of its input; only fp32 training shares the input. A fused qkv
    /// projection is one adapter.
    peft_cast: bool,
    /// … that copy's bytes per element: 4 without autocast, the 16-bit
    /// autocast cast with it.
    peft_input: f64,
    /// Under autocast the residual stream and the norms' outputs are fp32
    /// (fp32 parameters), and every linear casts its input to 16 bits
    /// itself: autocast caches casts only of leaf tensors that require grad
    /// (the weights; `cached_cast` in aten/src/ATen/autocast_mode.cpp), so
    /// q, k and v (and gate and up) each keep their own 16-bit copy of the
    /// same input for their weight's gradient.
    autocast_casts: bool,
    /// litgpt LoRA: every `LoRALinear` runs its own `lora_dropout` on its
    /// input (`self.lora_dropout(x) @ self.lora_A.T`, litgpt/lora.py; 0.05
    /// in its configs), so each adapter keeps a bool mask plus the dropped
    /// copy that lora_A's matmul saves …
    litgpt_lora: bool,
    /// … for dense MLPs (the dropout terms).
    litgpt_dropout: bool,
    /// q, k or v trains.
    qkv_trains: bool,
    /// gate or up (fc1) trains.
    up_trains: bool,
    /// MLP input adapters: gate and up, or the one fc1 of a classic MLP.
    mlp_in_adapters: f64,
}

/// Everything one block's terms depend on, derived once.
struct Block<'a> {
    w: &'a Workload,
    a: &'a ModelArch,
    s: &'a EngineeringSettings,
    opts: &'a ModelOptions,
    targets: &'a [LoraTarget],
    quant: BaseQuant,
    /// PEFT's k-bit recipe ([`kbit_recipe`]).
    kbit: bool,
    dims: Dims,
    bytes: ElementSizes,
    code: Code,
    attn: AttentionPath,
    inputs: Inputs,
}

impl<'a> Block<'a> {
    fn new(w: &'a Workload, s: &'a EngineeringSettings, opts: &'a ModelOptions) -> Self {
        let a = &w.model;
        let kbit = kbit_recipe(w, opts);
        let dtype = activation_dtype(w, s, opts);
        let e = compute_bytes(dtype);
        let heads = a.num_attention_heads as f64;
        let routed = a.experts_per_token.max(1) as f64;
        let full = w.method == Method::Full;
        let targets: &[LoraTarget] = w.lora.as_ref().map(|l| l.targets.as_slice()).unwrap_or(&[]);
        let trains = |t: LoraTarget| full || targets.contains(&t);
        let classic = !a.gated_mlp;
        let litgpt = w.framework == Framework::Litgpt;
        let hf = hf_code(w);
        let (hf_classic, litgpt_classic) = (classic && hf, classic && litgpt);
        let math = math_sdpa(w, e);
        let litgpt_lora = !full && litgpt;
        Block {
            w,
            a,
            s,
            opts,
            targets,
            quant: base_quant(w, opts),
            kbit,
            dims: Dims {
                hidden: a.hidden_size as f64,
                heads,
                q_width: heads * a.head_dim as f64,
                kv_width: a.num_kv_heads as f64 * a.head_dim as f64,
                intermediate: a.intermediate_size as f64,
                routed,
                rank: w.lora.as_ref().map(|l| l.rank as f64).unwrap_or(0.0),
            },
            bytes: ElementSizes {
                dtype,
                act: e,
                residual: param_bytes(dtype),
                mlp: if kbit { 4.0 } else { e },
            },
            code: Code {
                hf,
                litgpt,
                classic,
                hf_classic,
                litgpt_classic,
                resid_dropout: classic
                    && !(hf_classic && a.quirks.no_resid_dropout)
                    && !litgpt_classic,
                attn_dropout: classic
                    && !(hf_classic && a.quirks.no_attn_dropout)
                    && !litgpt_classic,
            },
            attn: AttentionPath {
                scores_kept: scores_materialized(w, dtype),
                math_sdpa: math,
                fp32_gqa: fp32_grouped_query(w, e),
                hf_sdpa: hf && w.attention == Attention::Sdpa && !math,
                softmax_16bit: a.quirks.attn_softmax_16bit && !math && !dtype.is_mixed(),
                softmax_no_upcast: a.quirks.attn_softmax_no_upcast
                    && hf
                    && !dtype.is_mixed()
                    && e < 4.0,
                q_head_major: a.quirks.partial_rotary
                    || (a.quirks.fused_qkv && !a.quirks.unrotated_qkv_views),
            },
            inputs: Inputs {
                full,
                peft_cast: hf && !full && e < 4.0,
                peft_input: if dtype.is_mixed() { e } else { 4.0 },
                autocast_casts: full && dtype.is_mixed() && e < 4.0 && routed == 1.0,
                litgpt_lora,
                litgpt_dropout: litgpt_lora && routed == 1.0,
                qkv_trains: trains(LoraTarget::Q) || trains(LoraTarget::K) || trains(LoraTarget::V),
                up_trains: trains(LoraTarget::Gate) || trains(LoraTarget::Up),
                mlp_in_adapters: [LoraTarget::Gate, LoraTarget::Up]
                    .iter()
                    .filter(|t| targets.contains(t) && (a.gated_mlp || **t == LoraTarget::Up))
                    .count() as f64,
            },
        }
    }

    /// Whether linear `t`'s weight trains.
    fn trains(&self, t: LoraTarget) -> bool {
        self.inputs.full || self.targets.contains(&t)
    }
}

/// What a block saves per token, summed step by step. The steps add their
/// terms in a fixed order: a floating-point sum depends on it, and the
/// accuracy benchmark's figures on the sum.
#[derive(Default)]
struct Saved {
    /// Bytes per token.
    saved: f64,
    /// Bytes per token and key (eager scores): × seq.
    per_seq: f64,
}

/// Bytes one layer saves per token and the transients of its backward.
pub(super) fn layer_activations(
    w: &Workload,
    s: &EngineeringSettings,
    opts: &ModelOptions,
) -> LayerActs {
    // T5, the catalog's encoder–decoder, has blocks of its own (t5.rs).
    if w.model.kind == ArchKind::EncoderDecoder {
        return t5_layer(w, s, opts);
    }
    let b = Block::new(w, s, opts);
    let mut acc = Saved::default();
    norms(&b, &mut acc);
    attention_inputs(&b, &mut acc);
    if b.attn.scores_kept {
        eager_attention(&b, &mut acc);
    } else {
        sdpa_attention(&b, &mut acc);
    }
    o_proj_input(&b, &mut acc);
    if b.code.resid_dropout {
        // residual dropout masks after attention and MLP (p = 0.1, 1 byte);
        // DistilBERT drops only the FFN's output
        acc.saved += if b.a.quirks.one_resid_dropout {
            1.0
        } else {
            2.0
        } * b.dims.hidden;
    }
    mlp_inputs(&b, &mut acc);
    let saved_wide = mlp_body(&b, &mut acc);
    if b.opts.bnb_keeps_matmul_inputs
        && matches!(b.quant, BaseQuant::Nf4 | BaseQuant::Nf4NoDoubleQuant)
        && !b.inputs.full
        && w.framework != Framework::Torchtune
    {
        old_bitsandbytes_inputs(&b, &mut acc);
    }
    adapter_outputs(&b, &mut acc);
    let (bt, bt_seq) = backward_transients(&b);
    LayerActs {
        saved: acc.saved,
        saved_per_seq: acc.per_seq,
        backward_transient: bt,
        backward_transient_per_seq: bt_seq,
        transient_per_seq_one_size: b.attn.math_sdpa,
        saved_wide,
        wide_tensor: b.bytes.mlp * b.dims.intermediate,
    }
}

/// The norms. RMSNorm (HF LlamaRMSNorm, torchtune/litgpt RMSNorm) upcasts
/// to fp32 and saves the fp32 input for the rsqrt product (4h); the
/// normalised value is saved by `weight * x` only when the weight trains.
/// LayerNorm (GPT-2/BERT) saves only its input plus per-token mean/rstd
/// and runs in fp32 under autocast. In transformers' and litgpt's classic
/// blocks LayerNorm saves its input in the input's dtype — 16 bits in pure
/// 16-bit training, fp32 under autocast or in fp32 — and a parallel
/// residual (GPT-NeoX, Phi, Falcon) normalises one block input for both
/// branches: one saved tensor (counted: bench/data/saved_tensors.jsonl).
fn norms(b: &Block, acc: &mut Saved) {
    let (a, h) = (b.a, b.dims.hidden);
    let (e, r) = (b.bytes.act, b.bytes.residual);
    let Code {
        hf_classic,
        litgpt_classic,
        classic,
        ..
    } = b.code;
    let norm_input = if (hf_classic || litgpt_classic) && !b.bytes.dtype.is_mixed() {
        e
    } else {
        4.0f64.max(r)
    };
    // Gemma scales in fp32, and so does litgpt's RMSNorm
    // (`x_normed * weight.float()`): a trained weight keeps the fp32
    // normalised value (counted: bench/data/saved_tensors.jsonl, gemma-2-2b
    // and litgpt's Llama full bf16).
    let litgpt_rms = b.code.litgpt && !classic;
    let scaled = if (a.quirks.norm_scale_fp32 && b.code.hf) || litgpt_rms {
        4.0
    } else {
        r
    };
    let norm = |trainable: bool| {
        norm_input * h
            + if trainable && !classic {
                scaled * h
            } else {
                0.0
            }
    };
    // Gemma 2 normalises before and after attention and the MLP (its
    // `pre/post_attention_layernorm`, `pre/post_feedforward_layernorm`).
    let norm_count = if a.quirks.sandwich_norms {
        4.0
    } else if (hf_classic || litgpt_classic) && a.quirks.parallel_residual {
        1.0
    } else {
        2.0
    };
    acc.saved += norm_count * norm(b.inputs.full);
}

/// The q, k and v projections' inputs when they train.
fn attention_inputs(b: &Block, acc: &mut Saved) {
    let (a, h, e) = (b.a, b.dims.hidden, b.bytes.act);
    let (qd, kvd) = (b.dims.q_width, b.dims.kv_width);
    let targets = b.targets;
    let Inputs {
        peft_cast,
        peft_input,
        autocast_casts,
        litgpt_lora,
        qkv_trains,
        ..
    } = b.inputs;
    if peft_cast && qkv_trains {
        let adapters = if a.quirks.fused_qkv {
            1.0
        } else {
            [LoraTarget::Q, LoraTarget::K, LoraTarget::V]
                .iter()
                .filter(|t| targets.contains(t))
                .count() as f64
        };
        acc.saved += adapters * peft_input * h;
    } else if qkv_trains && autocast_casts && !a.quirks.fused_qkv {
        acc.saved += 3.0 * e * h;
    } else if qkv_trains && !litgpt_lora {
        // the projections' shared input (norm output or its autocast cast);
        // litgpt's frozen qkv saves nothing, its adapter the dropped copy
        acc.saved += e * h;
    }
    if litgpt_lora && qkv_trains {
        // litgpt's fused qkv adapter: the bool mask and the dropped input …
        acc.saved += h + e * h;
        // … and, when only some of q, k, v are adapted, `zero_pad`'s
        // `index_copy` saves its source, the adapted parts' outputs
        // (counted with saved-tensor hooks: bench/data/saved_tensors.jsonl).
        let enabled = [
            (LoraTarget::Q, qd),
            (LoraTarget::K, kvd),
            (LoraTarget::V, kvd),
        ];
        if enabled.iter().any(|(t, _)| !targets.contains(t)) {
            acc.saved += e * enabled
                .iter()
                .filter(|(t, _)| targets.contains(t))
                .map(|(_, w)| w)
                .sum::<f64>();
        }
    }
}

/// Attention that keeps its scores: eager, the math SDPA composite, or
/// litgpt's soft-capped attention ([`scores_materialized`]).
fn eager_attention(b: &Block, acc: &mut Saved) {
    let (w, a) = (b.w, b.a);
    let Dims {
        heads,
        q_width: qd,
        kv_width: kvd,
        ..
    } = b.dims;
    let (e, r, dtype) = (b.bytes.act, b.bytes.residual, b.bytes.dtype);
    let AttentionPath {
        math_sdpa,
        fp32_gqa,
        softmax_16bit,
        softmax_no_upcast: no_upcast,
        ..
    } = b.attn;
    let hf_code = b.code.hf;
    // q, k (expanded to all heads) saved by QKᵀ, v by PV. With a single
    // K/V head (Gemma-2B, Falcon-7B) transformers' `repeat_kv`
    // (`expand` + `reshape`) is a view, so the matmuls keep the one
    // head's k and v (counted: bench/data/saved_tensors.jsonl); grouped
    // heads need a copy. Under autocast the Llama family's RoPE makes k
    // fp32 (cos/sin take the fp32 hidden states' dtype), and the
    // matmul's 16-bit cast of the expanded view materialises every
    // head; Falcon's rotary takes the value's (16-bit) dtype and keeps
    // the view (counted on fake CUDA tensors under CUDA's autocast).
    // The math SDPA reached through `enable_gqa` (`fp32_gqa`) repeats
    // k and v itself (`repeat_interleave`: copies, counted with the
    // math backend forced: Gemma-2B fp32, one K/V head).
    let gqa_math = fp32_gqa && !a.quirks.sdpa_math_fallback && w.attention == Attention::Sdpa;
    let kv_view =
        a.num_kv_heads == 1 && (!dtype.is_mixed() || a.quirks.rotary_in_value_dtype) && !gqa_math;
    let kv_saved = if hf_code && kv_view { kvd } else { qd };
    if math_sdpa {
        // PyTorch's math SDPA upcasts 16-bit q, k and v to fp32 and its
        // matmuls keep those copies (counted with the math backend
        // forced on the CPU, the same composite CUDA runs for Falcon).
        acc.saved += 4.0 * qd + 2.0 * 4.0 * kv_saved;
    } else {
        acc.saved += e * qd + 2.0 * e * kv_saved;
    }
    if hf_code && a.quirks.unrotated_qkv_views {
        // GPT-2: q's view keeps the whole fused output (counted above as
        // q, k, v); k and v are copied for the batched matmuls.
        acc.saved += 2.0 * e * kv_saved;
    }
    if softmax_16bit {
        // Falcon's eager code runs softmax in the activations' dtype,
        // without dropout: PV saves that output.
        acc.per_seq += e * heads;
    } else if math_sdpa {
        // fp32 probabilities saved for PV (no dropout, no 16-bit cast).
        acc.per_seq += 4.0 * heads;
    } else if no_upcast {
        // BERT/GPT-2 eager code in pure 16-bit: the softmax output in
        // the scores' dtype …
        acc.per_seq += e * heads;
    } else {
        // The softmax output is fp32 (HF eager attention upcasts; autocast
        // runs softmax in fp32; fp32 training is fp32 anyway) …
        acc.per_seq += 4.0 * heads;
    }
    if b.opts.softmax_saves_input && !math_sdpa {
        // … and before PyTorch 1.11 its input too (`ModelOptions::
        // softmax_saves_input`): the masked scores, whose dtype is the
        // mask's, made in the parameters' dtype (fp32 under autocast);
        // checked against the Hugging Face docs' BERT-large runs
        // (bench/data/published_peaks.csv; docs/memory-model.md, "Older
        // releases").
        acc.per_seq += r * heads;
    }
    if softmax_16bit || math_sdpa {
    } else if b.code.attn_dropout {
        // … attention dropout (p = 0.1) keeps a bool mask, and PV saves
        // the dropped probabilities (in fp32, or their 16-bit cast) …
        acc.per_seq += (1.0 + e) * heads;
    } else if e < 4.0 && !no_upcast {
        // … or the 16-bit cast of the probabilities fed to PV.
        acc.per_seq += e * heads;
    }
    if a.quirks.attn_softcapping {
        // Gemma 2 eager: `tanh(scores / cap) * cap` — tanh saves its
        // output for backward (transformers `eager_attention_forward`).
        acc.per_seq += e * heads;
    }
}

/// SDPA's flash or memory-efficient kernel: q, k, v, the output and an
/// fp32 log-sum-exp per head; litgpt and torchtune expand k, v to every
/// head before SDPA.
fn sdpa_attention(b: &Block, acc: &mut Saved) {
    let (w, a, e) = (b.w, b.a, b.bytes.act);
    let Dims {
        heads,
        q_width: qd,
        kv_width: kvd,
        ..
    } = b.dims;
    let kv = if b.attn.hf_sdpa { kvd } else { qd };
    acc.saved += e * qd + 2.0 * e * kv + e * qd + 4.0 * heads;
    // litgpt splits its fused qkv output into views; without grouped
    // queries v goes to SDPA as such a view, so the whole qkv output
    // stays alive where v alone is counted above (counted with
    // saved-tensor hooks: bench/data/saved_tensors.jsonl).
    if b.code.litgpt && a.num_kv_heads == a.num_attention_heads {
        acc.saved += e * (qd + kvd);
    }
    // Where the sequence reaches the sliding window, the layer passes
    // SDPA a boolean mask (`masked_sdpa_layers`): PyTorch converts it to
    // a bias in q's dtype, (batch, 1, seq, seq) (`convert_boolean_attn_
    // mask`, aten/src/ATen/native/transformers/attention.cpp), and the
    // memory-efficient kernel's backward takes that bias
    // (`_scaled_dot_product_efficient_attention` in derivatives.yaml):
    // one kept per such layer, e × seq a token. Counted from the code,
    // not measured (the measured rows at a window are checkpointed,
    // where only the recomputed layer holds one).
    if a.num_layers > 0 {
        acc.per_seq += e * masked_sdpa_layers(w) as f64 / a.num_layers as f64;
    }
}

/// o_proj's input when o_proj trains.
fn o_proj_input(b: &Block, acc: &mut Saved) {
    if !b.trains(LoraTarget::O) {
        return;
    }
    let (e, qd) = (b.bytes.act, b.dims.q_width);
    if b.inputs.peft_cast {
        // the adapter's own cast of o_proj's input
        acc.saved += b.inputs.peft_input * qd;
    } else if !b.attn.hf_sdpa {
        // o_proj input: the transposed, contiguous attention output
        // (eager attention, litgpt/torchtune blocks), which litgpt's
        // adapter drops with its own mask.
        acc.saved += e * qd + if b.inputs.litgpt_dropout { qd } else { 0.0 };
    } else if e < 4.0 && b.attn.q_head_major {
        // 16-bit SDPA runs the flash kernel, whose output follows q's
        // layout (`out = at::empty_like(q_padded)`, ATen flash_api.cpp):
        // a head-major q makes transformers' `transpose(1, 2)
        // .contiguous()` a copy, which o_proj keeps. fp32 runs the
        // memory-efficient kernel, whose output is (batch, seq, heads,
        // dim) whatever q's layout.
        acc.saved += e * qd;
    }
}

/// The MLP's input projections' inputs (and, for MoE, the router's and
/// the routed copies).
fn mlp_inputs(b: &Block, acc: &mut Saved) {
    let (a, h, e, k) = (b.a, b.dims.hidden, b.bytes.act, b.dims.routed);
    let Inputs {
        full,
        peft_cast,
        peft_input,
        autocast_casts,
        litgpt_lora,
        litgpt_dropout,
        qkv_trains,
        up_trains,
        mlp_in_adapters,
    } = b.inputs;
    if k > 1.0 {
        // MoE: the router saves its input when trained; every routed copy of
        // the token is gathered (hidden[top_x]) and saved by the experts
        // when they train, and each copy's expert output is saved by its
        // product with the routing weight, which needs a gradient
        // (`current_hidden_states * top_k_weights[...]`, transformers'
        // Mixtral). The router keeps its fp32 probabilities (softmax and
        // top-k), the top-k indices and weights and the grouping's index
        // tensors: 8·E + 40·k + 4 bytes. Counted with saved-tensor hooks
        // (bench/data/saved_tensors.jsonl, Mixtral 8x7B).
        let experts = a.num_experts.max(1) as f64;
        let gathered = if up_trains { e * h * k } else { 0.0 };
        acc.saved +=
            gathered + e * h * k + if full { e * h } else { 0.0 } + 8.0 * experts + 40.0 * k + 4.0;
    } else if up_trains
        && (b.code.hf_classic || b.code.litgpt_classic)
        && a.quirks.single_norm
        && qkv_trains
        && !peft_cast
        && !litgpt_lora
    {
        // Phi/Falcon: the MLP reads the attention's normalised input, saved
        // once (counted with the attention's) — unless autocast makes fc1
        // cast it to 16 bits again for itself (see `Inputs::autocast_casts`).
        if autocast_casts {
            acc.saved += e * h;
        }
    } else if peft_cast && up_trains {
        acc.saved += mlp_in_adapters * peft_input * h;
    } else if up_trains && litgpt_dropout && mlp_in_adapters > 0.0 {
        // fc_1 and fc_2 each drop the same input: a mask and a copy each
        acc.saved += mlp_in_adapters * (1.0 + e) * h;
    } else if up_trains && autocast_casts && a.gated_mlp {
        // gate and up each cast the norm's fp32 output (see above); Phi-3's
        // fused gate_up_proj casts it once
        acc.saved += if a.quirks.fused_gate_up { 1.0 } else { 2.0 } * e * h;
    } else if up_trains {
        acc.saved += e * h;
    }
}

/// The MLP's intermediate-wide tensors; returns their bytes per token.
fn mlp_body(b: &Block, acc: &mut Saved) -> f64 {
    let (e, mlp_e) = (b.bytes.act, b.bytes.mlp);
    let (i, k) = (b.dims.intermediate, b.dims.routed);
    // down_proj's input when it trains: the adapter's own cast (PEFT), or
    // the 16-bit product (with litgpt's dropout mask beside it).
    let down_input = if b.inputs.peft_cast {
        b.inputs.peft_input
    } else {
        e
    } * i
        * k
        + if b.inputs.litgpt_dropout { i } else { 0.0 };
    let before_wide = acc.saved;
    if b.code.classic {
        // fc1 output saved by the activation; GPT-2's (and Phi-2's)
        // `gelu_new` is a composite in Python (0.5·x·(1 + tanh(…))) whose
        // mul/tanh save three more I-sized tensors — in fp32 under
        // autocast, whose list runs `pow` in fp32 and type promotion
        // carries it through (counted on fake CUDA tensors); BERT's exact
        // GELU does not.
        acc.saved += mlp_e * i * k;
        if b.a.quirks.composite_gelu && b.code.hf {
            let composite = if b.bytes.dtype.is_mixed() { 4.0 } else { mlp_e };
            acc.saved += 3.0 * composite * i * k;
        }
        if b.trains(LoraTarget::Down) {
            acc.saved += down_input;
        }
    } else {
        // SwiGLU: gate output (silu input), up output and silu output (the
        // mul's operands) always; the product is saved by down_proj only
        // when down trains.
        acc.saved += 3.0 * mlp_e * i * k;
        if b.trains(LoraTarget::Down) {
            acc.saved += down_input;
        }
    }
    acc.saved - before_wide
}

/// bitsandbytes 4-bit bases before 0.43.2: `MatMul4Bit.forward`
/// (bitsandbytes/autograd/_functions.py) kept its input on `ctx.tensors`
/// whenever that input required grad, although a frozen 4-bit weight never
/// needs it, until bitsandbytes #1270 (0.43.2, July 2024); a plain frozen
/// linear saves nothing (autograd saves an operand only for the other's
/// gradient). So every quantized linear's input stays alive until its
/// block's backward, unless the same tensor is already counted. torchtune's
/// NF4 linears (torchao `linear_nf4`) keep only the weight.
fn old_bitsandbytes_inputs(b: &Block, acc: &mut Saved) {
    let a = b.a;
    let (h, qd) = (b.dims.hidden, b.dims.q_width);
    let (i, k) = (b.dims.intermediate, b.dims.routed);
    let (e, dtype) = (b.bytes.act, b.bytes.dtype);
    let inputs = &b.inputs;
    let (peft_cast, litgpt_lora) = (inputs.peft_cast, inputs.litgpt_lora);
    let hf_sdpa = b.attn.hf_sdpa;
    if b.kbit {
        // fp32 inputs (see `kbit_recipe`): every linear keeps its own
        // cast to the compute dtype — q, k, v (one fused qkv), o_proj
        // (unless autocast already handed SDPA's 16-bit output on),
        // gate and up (one fc1), down.
        let c = compute_bytes(b.s.dtype);
        let qkv_n = if a.quirks.fused_qkv { 1.0 } else { 3.0 };
        let mlp_n = if a.gated_mlp { 2.0 } else { 1.0 };
        let o = if dtype.is_mixed() && hf_sdpa { 0.0 } else { qd };
        acc.saved += c * (qkv_n * h + o + (mlp_n * h + i) * k);
        return;
    }
    // q/k/v's input (the norm output), unless the shared-input term
    // above holds it (PEFT's adapters save their own casts, litgpt's
    // their dropped copies, instead).
    if !inputs.qkv_trains || peft_cast || litgpt_lora {
        acc.saved += e * h;
    }
    // o_proj's input: a view of SDPA's saved output in transformers'
    // SDPA path; otherwise the contiguous attention output, counted
    // above only when o_proj trains without an adapter's own copy.
    if !hf_sdpa && (!b.trains(LoraTarget::O) || peft_cast || litgpt_lora) {
        acc.saved += e * qd;
    }
    // The MLP's input (the second norm's output; Phi/Falcon share the
    // attention's), unless saved as the plain shared input above.
    let mlp_input_counted =
        inputs.up_trains && !peft_cast && !(inputs.litgpt_dropout && inputs.mlp_in_adapters > 0.0);
    if !a.quirks.single_norm && !mlp_input_counted {
        acc.saved += e * h * k;
    }
    // down/fc2's input (the SwiGLU product or the activation's output),
    // counted above only when down trains without an adapter's own
    // copy.
    if !b.trains(LoraTarget::Down) || peft_cast || litgpt_lora {
        acc.saved += e * i * k;
    }
}

/// What litgpt's loop keeps of the previous step's graph, bytes per
/// sample, under bitsandbytes before 0.43.2 (0 elsewhere).
///
/// `MatMul4Bit.forward` put its input on `ctx.tensors`, a plain attribute
/// of the autograd node, not `save_for_backward`: the engine frees a
/// node's saved tensors after its backward runs, never its attributes, so
/// those inputs live as long as the node (bitsandbytes #1270, "fix QLoRA
/// mem bug: delete useless buffered activation", 0.43.2, July 2024). And
/// litgpt's `fit` (finetune/lora.py, every release) holds the step's
/// `logits` (a list of head chunks whose `grad_fn` reaches every node of
/// the graph) in a loop variable until the next `logits = model(...)`
/// returns; the test `litgpt_holds_its_logits_through_the_optimizer_step`
/// counts the logits themselves. So through the optimizer step and the
/// whole next forward, every 4-bit linear's input of the previous step is
/// still allocated: all the distinct ones per block (q/k/v's and the MLP's
/// norm outputs, o_proj's and down/fc2's inputs), including those the
/// current step's graph counts as saved by another op (that op freed its
/// copy in the previous backward; `ctx.tensors` did not), and the head's
/// (Fabric quantizes the head; its chunks are views of the final norm's
/// output).
///
/// That is a full-length step only where the step before was as long:
/// litgpt ≥ 0.4 draws shuffled batches (its data modules, #950), so a
/// dataset with more than one sample at the cap has such pairs; the lit-gpt
/// scripts of 2023 ran the longest sample first, alone
/// (`ModelOptions::longest_sample_first`). Under reentrant checkpointing
/// the forward runs without grad and `MatMul4Bit` keeps nothing (see
/// `old_bitsandbytes_inputs`).
pub(super) fn previous_step_inputs(
    w: &Workload,
    s: &EngineeringSettings,
    opts: &ModelOptions,
) -> f64 {
    let b = Block::new(w, s, opts);
    let kept = opts.bnb_keeps_matmul_inputs
        && matches!(b.quant, BaseQuant::Nf4 | BaseQuant::Nf4NoDoubleQuant)
        && w.framework == Framework::Litgpt
        && !b.inputs.full;
    if !kept || s.activation_checkpointing || opts.longest_sample_first {
        return 0.0;
    }
    let (h, qd) = (b.dims.hidden, b.dims.q_width);
    let (i, k) = (b.dims.intermediate, b.dims.routed);
    let e = b.bytes.act;
    // the MLP's input is the attention's under one shared norm (Phi, Falcon)
    let mlp_input = if b.a.quirks.single_norm { 0.0 } else { h * k };
    let per_layer = e * (h + qd + mlp_input + i * k);
    let head_input = e * h;
    w.seq_len as f64 * (w.model.num_layers as f64 * per_layer + head_input)
}

/// LoRA adapters: the A output (rank wide) is saved by B.
fn adapter_outputs(b: &Block, acc: &mut Saved) {
    if b.inputs.full {
        return;
    }
    let k = b.dims.routed;
    let n = b
        .targets
        .iter()
        .filter(|t| **t != LoraTarget::LmHead)
        .map(|t| {
            if matches!(t, LoraTarget::Gate | LoraTarget::Up | LoraTarget::Down) {
                k
            } else {
                1.0
            }
        })
        .sum::<f64>();
    acc.saved += n * b.bytes.act * b.dims.rank;
}

/// Backward of one layer, per token (and per token and key): the residual
/// gradient (r·h, twice while the two branches add) and, in the MLP, the
/// gradients of the product and of the two branches (3·e·I); in eager
/// attention the score gradient (fp32 softmax backward + 16-bit copy).
fn backward_transients(b: &Block) -> (f64, f64) {
    let (h, i, k) = (b.dims.hidden, b.dims.intermediate, b.dims.routed);
    let heads = b.dims.heads;
    let (e, r, mlp_e) = (b.bytes.act, b.bytes.residual, b.bytes.mlp);
    let (eager, softmax_16bit) = (b.attn.scores_kept, b.attn.softmax_16bit);
    let (no_upcast, math_sdpa) = (b.attn.softmax_no_upcast, b.attn.math_sdpa);
    let mlp_bt = if b.code.classic { 2.0 } else { 3.0 } * mlp_e * i * k;
    let bt = 2.0 * r * h + mlp_bt;
    let bt_seq = match (eager, softmax_16bit) {
        (false, _) => 0.0,
        // the score gradient in the activations' dtype, twice while softmax's
        // backward runs
        (true, true) => 2.0 * e * heads,
        // a plain 16-bit softmax: its backward and the dropout's, in 16 bits
        (true, false) if no_upcast => 2.0 * e * heads,
        // fp32 scores (fp32 training, the k-bit recipe without autocast):
        // the probabilities' gradient and softmax's, with no 16-bit copy
        (true, false) if e >= 4.0 => 8.0 * heads,
        (true, false) => (4.0 + 2.0 * e) * heads,
    } + if math_sdpa && b.a.quirks.sdpa_math_fallback {
        // Falcon's math-kernel backward on CUDA holds one more fp32 tensor
        // of the scores' shape than the same composite traced on the CPU;
        // which kernel allocates it is not identified. Measured on every
        // Falcon-7B LoRA SDPA row of bench/data/h100 and h200, not on the
        // fp32 grouped-query runs of the same composite
        // (docs/memory-model.md, "Families and attention kernels").
        4.0 * heads
    } else {
        0.0
    };
    (bt, bt_seq)
}

/// The activations per sample (one sequence of the micro batch), given
/// the loss buffers they take turns with when checkpointed.
pub(super) fn per_sample(
    w: &Workload,
    s: &EngineeringSettings,
    opts: &ModelOptions,
    loss: &LossBuffers,
) -> Activations {
    let a = &w.model;
    let dtype = activation_dtype(w, s, opts);
    let e = compute_bytes(dtype);
    let seq = w.seq_len as f64;
    let layers = a.num_layers as f64;
    let la = layer_activations(w, s, opts);
    let per_token_layer = la.saved + la.saved_per_seq * seq;
    let r = param_bytes(dtype);
    let h = a.hidden_size as f64;
    // Final norm + head input (saved only when the head trains).
    let head_trains = w.method == Method::Full
        || w.lora
            .as_ref()
            .is_some_and(|l| l.targets.contains(&LoraTarget::LmHead));
    let tail = 4.0f64.max(r) * h + if head_trains { e * h } else { 0.0 };
    let transient = la.backward_transient + la.backward_transient_per_seq * seq;
    let acts_tokens = if s.activation_checkpointing {
        // Checkpointed blocks keep only their input (r·h per token).
        layers * r * h + tail
    } else {
        layers * per_token_layer + transient + tail
    };
    let acts_tokens = if s.activation_offloading && s.activation_checkpointing {
        // torchtune activation offloading moves the checkpointed inputs to
        // CPU; one block's input stays on the GPU while it streams.
        acts_tokens - (layers - 1.0).max(0.0) * r * h
    } else {
        acts_tokens
    };
    // Encoder–decoder: decoder tokens attend to the encoder output, which is
    // kept; counted as one more hidden-size tensor per token.
    let enc_dec = if a.kind == ArchKind::EncoderDecoder {
        r * h
    } else {
        0.0
    };
    let mut acts = Activations {
        total: seq * (acts_tokens + enc_dec),
        ..Activations::default()
    };
    (acts.mlp_wide, acts.mlp_wide_tensor) = if s.activation_checkpointing {
        (0.0, 0.0)
    } else {
        (seq * layers * la.saved_wide, seq * la.wide_tensor)
    };
    // The hidden-width tensors among them (one is seq · h · e bytes per
    // sample): every block's, or the checkpointed blocks' inputs.
    (acts.hidden_width, acts.hidden_tensor) = if s.activation_checkpointing {
        (seq * layers * r * h, seq * r * h)
    } else {
        (
            seq * layers * (la.saved - la.saved_wide).max(0.0),
            seq * e * h,
        )
    };
    if s.activation_checkpointing {
        let recompute = seq * (per_token_layer + transient);
        acts.recompute_overlap = recompute_overlap(&la, seq, recompute, loss);
        acts.total += (recompute - loss.peak).max(0.0);
    }
    // The previous step's kept inputs are alive when this forward ends,
    // beside this step's saved tensors, new logits and the previous
    // logits (`held_through_step`); the loss and the backward come after
    // the loop drops them. So they raise phase A by what they outgrow
    // the loss's part beyond the two logits and the block's backward
    // transients by.
    acts.previous_step = previous_step_inputs(w, s, opts);
    if acts.previous_step > 0.0 {
        let after_forward = loss.peak - 2.0 * loss.held_through_step;
        acts.total += (acts.previous_step - after_forward - seq * transient).max(0.0);
    }
    acts
}

/// Checkpointed: one block is recomputed at a time during backward, with
/// its saved tensors and backward transients (Korthikanti et al. 2022,
/// §4.2 "full activation recomputation": 2sbhL + one layer). That block is
/// recomputed only after the loss's backward has freed the loss buffers,
/// so the two are never alive together: the peak holds the larger (the
/// caller adds what the block outgrows them by), and this returns the
/// smaller, which the allocator must fit into the other's freed blocks.
///
/// The math SDPA's score gradients are the size of its saved
/// probabilities (`LayerActs::transient_per_seq_one_size`) and leave the
/// turn-taking; so do the saved probabilities where one of them is larger
/// than a loss buffer (a cached block serves no larger request). Eager
/// attention's score transients stay counted. The measurements behind
/// both are in docs/memory-model.md ("Checkpointing's turn-taking").
fn recompute_overlap(la: &LayerActs, seq: f64, recompute: f64, loss: &LossBuffers) -> f64 {
    let score_per_sample = seq * seq * la.saved_per_seq;
    let turn = if la.transient_per_seq_one_size {
        let saved_out = if score_per_sample > loss.eager_buffer {
            score_per_sample
        } else {
            0.0
        };
        recompute - seq * seq * la.backward_transient_per_seq - saved_out
    } else {
        recompute
    };
    turn.min(loss.peak)
}
