//! What a training step keeps per sample: the tensors each block saves for
//! backward, the loss path's buffers, checkpointing's recomputed block and
//! `torch.compile`'s fusion (docs/design.md, "The memory model").

use crate::core::settings::{Dtype, EngineeringSettings};
use crate::core::workload::{ArchKind, Attention, Framework, LoraTarget, Method, Workload};

use super::plan::Plan;
use super::storage::{base_quant, compute_bytes, kbit_recipe, param_bytes};
use super::t5::t5_layer;
use super::{BaseQuant, Head, ModelOptions};

/// torchtune's `CEWithChunkedOutputLoss` splits the output projection and
/// the loss into 8 chunks (`num_output_chunks = 8` in
/// torchtune/modules/loss/ce_chunked_output_loss.py).
const TORCHTUNE_CE_CHUNKS: f64 = 8.0;
/// Tokens per output-head chunk in litgpt's fine-tuning loop:
/// `model(input_ids, lm_head_chunk_size=128)` in litgpt/finetune/lora.py.
const LITGPT_HEAD_CHUNK: f64 = 128.0;

/// Per-token, per-layer bytes saved for backward, and the per-token
/// transient of one layer's backward.
pub(super) struct LayerActs {
    pub(super) saved: f64,
    /// Bytes per token scaling with sequence length (eager scores): × seq.
    pub(super) saved_per_seq: f64,
    pub(super) backward_transient: f64,
    pub(super) backward_transient_per_seq: f64,
    /// Whether the per-seq backward transients are the size of the saved
    /// per-seq tensor (PyTorch's math SDPA: fp32 probabilities, their
    /// gradient and the scores' gradient, one shape and dtype), so that in
    /// a checkpointed backward they take the blocks the recomputed blocks'
    /// probabilities free and do not add to the turn-taking with the loss
    /// buffers (see `per_sample`).
    pub(super) transient_per_seq_one_size: bool,
    /// The part of `saved` that is MLP-intermediate wide (the rest is
    /// hidden-width tensors and smaller), for the allocator's segment
    /// packing (`allocator::segment_waste_share`).
    pub(super) saved_wide: f64,
    /// Bytes per token of one MLP-intermediate tensor (`intermediate_size`
    /// elements), for the allocator's size test against the cached
    /// parameter-shaped blocks (`allocator::eval`).
    pub(super) wide_tensor: f64,
}

/// The dtype a block's activations follow: under PEFT's QLoRA recipe
/// ([`kbit_recipe`]) without autocast, those of fp32 training; under
/// autocast only its MLP differs (see `mlp_e` below).
pub(super) fn activation_dtype(
    w: &Workload,
    s: &EngineeringSettings,
    opts: &ModelOptions,
) -> Dtype {
    if kbit_recipe(w, opts) && !s.dtype.is_mixed() {
        Dtype::Fp32
    } else {
        s.dtype
    }
}

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
/// batch and heads without grouped-query support). Measured on the H200
/// (bench/data/h200/qlora.csv): QLoRA on Llama-3.2-1B (8 of 32 K/V heads)
/// without autocast held 63.2 GiB at 4 × 2,048 tokens where the flash
/// path would hold about 31 GiB; Phi-3 and Pythia (one K/V head per query
/// head) stayed on the kernel. Falcon-7B/40B always fall there (see
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

pub(super) fn layer_activations(
    w: &Workload,
    s: &EngineeringSettings,
    opts: &ModelOptions,
) -> LayerActs {
    let a = &w.model;
    // T5, the catalog's encoder–decoder, has blocks of its own (t5.rs).
    if a.kind == ArchKind::EncoderDecoder {
        return t5_layer(w, s, opts);
    }
    let quant = base_quant(w, opts);
    let kbit = kbit_recipe(w, opts);
    let dtype = activation_dtype(w, s, opts);
    let e = compute_bytes(dtype);
    // Residual stream dtype: fp32 params make fp32 embeddings and residual
    // adds under autocast.
    let r = param_bytes(dtype);
    // The MLP's intermediates: fp32 behind bitsandbytes projections fed
    // from an fp32 residual (see `kbit_recipe`), even under autocast.
    let mlp_e = if kbit { 4.0 } else { e };
    let h = a.hidden_size as f64;
    let heads = a.num_attention_heads as f64;
    let qd = heads * a.head_dim as f64;
    let i = a.intermediate_size as f64;
    let k = a.experts_per_token.max(1) as f64;
    let full = w.method == Method::Full;
    let targets: &[LoraTarget] = w.lora.as_ref().map(|l| l.targets.as_slice()).unwrap_or(&[]);
    let trains = |t: LoraTarget| full || targets.contains(&t);
    let rank = w.lora.as_ref().map(|l| l.rank as f64).unwrap_or(0.0);
    let classic = !a.gated_mlp;
    let litgpt = w.framework == Framework::Litgpt;
    let hf_code = hf_code(w);
    // where the scores are kept (see `scores_materialized`)
    let fp32_gqa = fp32_grouped_query(w, e);
    let math_sdpa = math_sdpa(w, e);
    let eager = scores_materialized(w, dtype);
    // Softmax in 16 bits: Falcon's eager code (`softmax(..., dtype=
    // hidden_states.dtype)`), which under autocast is the fp32 residual's
    // dtype, like the fp32 softmax below. PyTorch's math SDPA instead
    // upcasts 16-bit inputs to fp32 (`allow_fp16_bf16_reduction_math_sdp`
    // is off by default since torch 2.5), also like the fp32 softmax.
    let softmax_16bit = a.quirks.attn_softmax_16bit && !math_sdpa && !dtype.is_mixed();
    // A plain softmax (BERT, GPT-2) stays 16-bit only outside autocast.
    let no_upcast = a.quirks.attn_softmax_no_upcast && hf_code && !dtype.is_mixed() && e < 4.0;
    // transformers' SDPA path (flash/efficient kernel, no mask in training)
    // passes `enable_gqa=True` instead of repeating K/V (`use_gqa_in_sdpa`,
    // torch ≥ 2.5), so k and v are saved at their own head count, and
    // o_proj's input is a view of the kernel's output, whose layout is
    // already (batch, seq, heads, dim): one tensor, not two. Counted with
    // autograd's saved-tensor hooks (bench/data/saved_tensors.jsonl).
    let hf_sdpa = hf_code && w.attention == Attention::Sdpa && !math_sdpa;
    // q ends up laid out head-major (batch, heads, seq, dim) when partial
    // rotary concatenates its parts, or when RoPE's element-wise ops read
    // a slice of a fused qkv output (not dense, so their output is
    // allocated in q's logical order); GPT-2's unrotated views and the
    // Llama family's own projections stay sequence-major. Counted on the
    // CPU, whose flash kernel also allocates its output like q.
    let q_head_major =
        a.quirks.partial_rotary || (a.quirks.fused_qkv && !a.quirks.unrotated_qkv_views);
    let kvd = a.num_kv_heads as f64 * a.head_dim as f64;
    // PEFT keeps adapters in fp32 on a 16-bit base (`autocast_adapter_dtype`)
    // and casts each adapter's input to the adapter's dtype
    // (`_cast_input_dtype`): every adapter saves its own copy of its input,
    // 4 bytes wide without autocast, the 16-bit autocast cast with it; only
    // fp32 training shares the input. A fused qkv projection is one adapter.
    let peft_cast = hf_code && !full && e < 4.0;
    let peft_input = if dtype.is_mixed() { e } else { 4.0 };
    // Under autocast the residual stream and the norms' outputs are fp32
    // (fp32 parameters), and every linear casts its input to 16 bits
    // itself: autocast caches casts only of leaf tensors that require grad
    // (the weights; `cached_cast` in aten/src/ATen/autocast_mode.cpp), so
    // q, k and v (and gate and up) each keep their own 16-bit copy of the
    // same input for their weight's gradient.
    let autocast_casts = full && dtype.is_mixed() && e < 4.0 && k == 1.0;
    // Every litgpt `LoRALinear` runs its own `lora_dropout` on its input
    // (`self.lora_dropout(x) @ self.lora_A.T`, litgpt/lora.py; 0.05 in its
    // configs): each adapter keeps a bool mask plus the dropped copy that
    // lora_A's matmul saves (counted per adapter below).
    let litgpt_lora = !full && litgpt;
    let litgpt_dropout = litgpt_lora && k == 1.0;
    // MLP input adapters: gate and up, or the one fc1 of a classic MLP.
    let mlp_in_adapters = [LoraTarget::Gate, LoraTarget::Up]
        .iter()
        .filter(|t| targets.contains(t) && (a.gated_mlp || **t == LoraTarget::Up))
        .count() as f64;

    let mut saved = 0.0;
    let mut per_seq = 0.0;

    // --- norms ---
    // RMSNorm (HF LlamaRMSNorm, torchtune/litgpt RMSNorm) upcasts to fp32
    // and saves the fp32 input for the rsqrt product (4h); the normalised
    // value is saved by `weight * x` only when the weight trains. LayerNorm
    // (GPT-2/BERT) saves only its input plus per-token mean/rstd and
    // runs in fp32 under autocast (4h there and in fp32 training).
    //
    // In transformers' classic blocks (counted with autograd's saved-tensor
    // hooks, bench/data/saved_tensors.jsonl) LayerNorm saves its input in
    // the input's dtype — 16 bits in pure 16-bit training, fp32 under
    // autocast or in fp32 — and a parallel residual (GPT-NeoX, Phi, Falcon)
    // normalises one block input for both branches: one saved tensor.
    let hf_classic = classic && hf_code;
    // litgpt's own LayerNorm blocks save the same (counted:
    // bench/data/saved_tensors.jsonl, StableLM and phi-1.5).
    let litgpt_classic = classic && litgpt;
    let norm_input = if (hf_classic || litgpt_classic) && !dtype.is_mixed() {
        e
    } else {
        4.0f64.max(r)
    };
    // Gemma scales in fp32, and so does litgpt's RMSNorm
    // (`x_normed * weight.float()`): a trained weight keeps the fp32
    // normalised value (counted: bench/data/saved_tensors.jsonl, gemma-2-2b
    // and litgpt's Llama full bf16).
    let litgpt_rms = litgpt && !classic;
    let scaled = if (a.quirks.norm_scale_fp32 && hf_code) || litgpt_rms {
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
    saved += norm_count * norm(full);

    // --- attention ---
    let qkv_trains = trains(LoraTarget::Q) || trains(LoraTarget::K) || trains(LoraTarget::V);
    if peft_cast && qkv_trains {
        let adapters = if a.quirks.fused_qkv {
            1.0
        } else {
            [LoraTarget::Q, LoraTarget::K, LoraTarget::V]
                .iter()
                .filter(|t| targets.contains(t))
                .count() as f64
        };
        saved += adapters * peft_input * h;
    } else if qkv_trains && autocast_casts && !a.quirks.fused_qkv {
        saved += 3.0 * e * h;
    } else if qkv_trains && !litgpt_lora {
        // the projections' shared input (norm output or its autocast cast);
        // litgpt's frozen qkv saves nothing, its adapter the dropped copy
        saved += e * h;
    }
    if litgpt_lora && qkv_trains {
        // litgpt's fused qkv adapter: the bool mask and the dropped input …
        saved += h + e * h;
        // … and, when only some of q, k, v are adapted, `zero_pad`'s
        // `index_copy` saves its source, the adapted parts' outputs
        // (counted with saved-tensor hooks: bench/data/saved_tensors.jsonl).
        let enabled = [
            (LoraTarget::Q, qd),
            (LoraTarget::K, kvd),
            (LoraTarget::V, kvd),
        ];
        if enabled.iter().any(|(t, _)| !targets.contains(t)) {
            saved += e * enabled
                .iter()
                .filter(|(t, _)| targets.contains(t))
                .map(|(_, w)| w)
                .sum::<f64>();
        }
    }
    // transformers' classic blocks keep dropout masks only where the
    // config's probability is above 0; litgpt's blocks have no dropout.
    let resid_dropout = classic && !(hf_classic && a.quirks.no_resid_dropout) && !litgpt_classic;
    let attn_dropout = classic && !(hf_classic && a.quirks.no_attn_dropout) && !litgpt_classic;
    if eager {
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
        let kv_view = a.num_kv_heads == 1
            && (!dtype.is_mixed() || a.quirks.rotary_in_value_dtype)
            && !gqa_math;
        let kv_saved = if hf_code && kv_view { kvd } else { qd };
        if math_sdpa {
            // PyTorch's math SDPA upcasts 16-bit q, k and v to fp32 and its
            // matmuls keep those copies (counted with the math backend
            // forced on the CPU, the same composite CUDA runs for Falcon).
            saved += 4.0 * qd + 2.0 * 4.0 * kv_saved;
        } else {
            saved += e * qd + 2.0 * e * kv_saved;
        }
        if hf_code && a.quirks.unrotated_qkv_views {
            // GPT-2: q's view keeps the whole fused output (counted above as
            // q, k, v); k and v are copied for the batched matmuls.
            saved += 2.0 * e * kv_saved;
        }
        if softmax_16bit {
            // Falcon's eager code runs softmax in the activations' dtype,
            // without dropout: PV saves that output.
            per_seq += e * heads;
        } else if math_sdpa {
            // fp32 probabilities saved for PV (no dropout, no 16-bit cast).
            per_seq += 4.0 * heads;
        } else if no_upcast {
            // BERT/GPT-2 eager code in pure 16-bit: the softmax output in
            // the scores' dtype …
            per_seq += e * heads;
        } else {
            // The softmax output is fp32 (HF eager attention upcasts; autocast
            // runs softmax in fp32; fp32 training is fp32 anyway) …
            per_seq += 4.0 * heads;
        }
        if opts.softmax_saves_input && !math_sdpa {
            // … and before PyTorch 1.11 its input too (`ModelOptions::
            // softmax_saves_input`): the masked scores, whose dtype is the
            // mask's, made in the parameters' dtype (fp32 under autocast).
            // The Hugging Face docs' BERT-large runs (V100, January 2022)
            // sit 1,668 MiB above the replay of their step on today's
            // PyTorch at micro batch 4 × 512; 24 layers × 16 heads × 512²
            // × 4 B × 4 is 1,536 MiB.
            per_seq += r * heads;
        }
        if softmax_16bit || math_sdpa {
        } else if attn_dropout {
            // … attention dropout (p = 0.1) keeps a bool mask, and PV saves
            // the dropped probabilities (in fp32, or their 16-bit cast) …
            per_seq += (1.0 + e) * heads;
        } else if e < 4.0 && !no_upcast {
            // … or the 16-bit cast of the probabilities fed to PV.
            per_seq += e * heads;
        }
        if a.quirks.attn_softcapping {
            // Gemma 2 eager: `tanh(scores / cap) * cap` — tanh saves its
            // output for backward (transformers `eager_attention_forward`).
            per_seq += e * heads;
        }
    } else {
        // SDPA saves q, k, v, the output and an fp32 log-sum-exp per head;
        // litgpt and torchtune expand k, v to every head before SDPA.
        let kv = if hf_sdpa { kvd } else { qd };
        saved += e * qd + 2.0 * e * kv + e * qd + 4.0 * heads;
        // litgpt splits its fused qkv output into views; without grouped
        // queries v goes to SDPA as such a view, so the whole qkv output
        // stays alive where v alone is counted above (counted with
        // saved-tensor hooks: bench/data/saved_tensors.jsonl).
        if litgpt && a.num_kv_heads == a.num_attention_heads {
            saved += e * (qd + kvd);
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
            per_seq += e * masked_sdpa_layers(w) as f64 / a.num_layers as f64;
        }
    }
    if trains(LoraTarget::O) {
        if peft_cast {
            // the adapter's own cast of o_proj's input
            saved += peft_input * qd;
        } else if !hf_sdpa {
            // o_proj input: the transposed, contiguous attention output
            // (eager attention, litgpt/torchtune blocks), which litgpt's
            // adapter drops with its own mask.
            saved += e * qd + if litgpt_dropout { qd } else { 0.0 };
        } else if e < 4.0 && q_head_major {
            // 16-bit SDPA runs the flash kernel, whose output follows q's
            // layout (`out = at::empty_like(q_padded)`, ATen flash_api.cpp):
            // a head-major q makes transformers' `transpose(1, 2)
            // .contiguous()` a copy, which o_proj keeps. fp32 runs the
            // memory-efficient kernel, whose output is (batch, seq, heads,
            // dim) whatever q's layout.
            saved += e * qd;
        }
    }
    if resid_dropout {
        // residual dropout masks after attention and MLP (p = 0.1, 1 byte);
        // DistilBERT drops only the FFN's output
        saved += if a.quirks.one_resid_dropout { 1.0 } else { 2.0 } * h;
    }

    // --- MLP ---
    let up_trains = trains(LoraTarget::Gate) || trains(LoraTarget::Up);
    if k > 1.0 {
        // MoE: the router saves its input when trained; every routed copy of
        // the token is gathered (hidden[top_x]) and saved by the experts
        // when they train, and each copy's expert output is saved by its
        // product with the routing weight, which needs a gradient
        // (`current_hidden_states * top_k_weights[...]`, transformers'
        // Mixtral). The router keeps its
        // fp32 probabilities (softmax and top-k), the top-k indices and
        // weights and the grouping's index tensors: 8·E + 40·k + 4 bytes.
        // Counted with saved-tensor hooks (bench/data/saved_tensors.jsonl,
        // Mixtral 8x7B).
        let experts = a.num_experts.max(1) as f64;
        let gathered = if up_trains { e * h * k } else { 0.0 };
        saved +=
            gathered + e * h * k + if full { e * h } else { 0.0 } + 8.0 * experts + 40.0 * k + 4.0;
    } else if up_trains
        && (hf_classic || litgpt_classic)
        && a.quirks.single_norm
        && qkv_trains
        && !peft_cast
        && !litgpt_lora
    {
        // Phi/Falcon: the MLP reads the attention's normalised input, saved
        // once (counted with the attention's) — unless autocast makes fc1
        // cast it to 16 bits again for itself (see `autocast_casts`).
        if autocast_casts {
            saved += e * h;
        }
    } else if peft_cast && up_trains {
        saved += mlp_in_adapters * peft_input * h;
    } else if up_trains && litgpt_dropout && mlp_in_adapters > 0.0 {
        // fc_1 and fc_2 each drop the same input: a mask and a copy each
        saved += mlp_in_adapters * (1.0 + e) * h;
    } else if up_trains && autocast_casts && a.gated_mlp {
        // gate and up each cast the norm's fp32 output (see above); Phi-3's
        // fused gate_up_proj casts it once
        saved += if a.quirks.fused_gate_up { 1.0 } else { 2.0 } * e * h;
    } else if up_trains {
        saved += e * h;
    }
    // down_proj's input when it trains: the adapter's own cast (PEFT), or
    // the 16-bit product (with litgpt's dropout mask beside it).
    let down_input =
        if peft_cast { peft_input } else { e } * i * k + if litgpt_dropout { i } else { 0.0 };
    let before_wide = saved;
    if classic {
        // fc1 output saved by the activation; GPT-2's (and Phi-2's) `gelu_new` is a
        // composite in Python (0.5·x·(1 + tanh(…))) whose mul/tanh save
        // three more I-sized tensors — in fp32 under autocast, whose list
        // runs `pow` in fp32 and type promotion carries it through (counted
        // on fake CUDA tensors); BERT's exact GELU does not.
        saved += mlp_e * i * k;
        if a.quirks.composite_gelu && hf_code {
            let composite = if dtype.is_mixed() { 4.0 } else { mlp_e };
            saved += 3.0 * composite * i * k;
        }
        if trains(LoraTarget::Down) {
            saved += down_input;
        }
    } else {
        // SwiGLU: gate output (silu input), up output and silu output (the
        // mul's operands) always; the product is saved by down_proj only
        // when down trains.
        saved += 3.0 * mlp_e * i * k;
        if trains(LoraTarget::Down) {
            saved += down_input;
        }
    }
    let saved_wide = saved - before_wide;

    // --- bitsandbytes 4-bit bases before 0.43.2 ---
    // `MatMul4Bit.forward` (bitsandbytes/autograd/_functions.py) kept its
    // input on `ctx.tensors` whenever that input required grad, although a
    // frozen 4-bit weight never needs it, until bitsandbytes #1270 (0.43.2,
    // July 2024); a plain frozen linear saves nothing (autograd saves an
    // operand only for the other's gradient). So every quantized linear's
    // input stays alive until its block's backward, unless the same tensor
    // is already counted above. torchtune's NF4 linears (torchao
    // `linear_nf4`) keep only the weight.
    if opts.bnb_keeps_matmul_inputs
        && matches!(quant, BaseQuant::Nf4 | BaseQuant::Nf4NoDoubleQuant)
        && !full
        && w.framework != Framework::Torchtune
    {
        if kbit {
            // fp32 inputs (see `kbit_recipe`): every linear keeps its own
            // cast to the compute dtype — q, k, v (one fused qkv), o_proj
            // (unless autocast already handed SDPA's 16-bit output on),
            // gate and up (one fc1), down.
            let c = compute_bytes(s.dtype);
            let qkv_n = if a.quirks.fused_qkv { 1.0 } else { 3.0 };
            let mlp_n = if a.gated_mlp { 2.0 } else { 1.0 };
            let o = if dtype.is_mixed() && hf_sdpa { 0.0 } else { qd };
            saved += c * (qkv_n * h + o + (mlp_n * h + i) * k);
        } else {
            // q/k/v's input (the norm output), unless the shared-input term
            // above holds it (PEFT's adapters save their own casts, litgpt's
            // their dropped copies, instead).
            if !qkv_trains || peft_cast || litgpt_lora {
                saved += e * h;
            }
            // o_proj's input: a view of SDPA's saved output in transformers'
            // SDPA path; otherwise the contiguous attention output, counted
            // above only when o_proj trains without an adapter's own copy.
            if !hf_sdpa && (!trains(LoraTarget::O) || peft_cast || litgpt_lora) {
                saved += e * qd;
            }
            // The MLP's input (the second norm's output; Phi/Falcon share the
            // attention's), unless saved as the plain shared input above.
            let mlp_input_counted =
                up_trains && !peft_cast && !(litgpt_dropout && mlp_in_adapters > 0.0);
            if !a.quirks.single_norm && !mlp_input_counted {
                saved += e * h * k;
            }
            // down/fc2's input (the SwiGLU product or the activation's output),
            // counted above only when down trains without an adapter's own
            // copy.
            if !trains(LoraTarget::Down) || peft_cast || litgpt_lora {
                saved += e * i * k;
            }
        }
    }

    // --- LoRA adapters: the A output (rank wide) is saved by B. ---
    if !full {
        let n = targets
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
        saved += n * e * rank;
    }

    // Backward of one layer: the residual gradient (r·h, twice while the
    // two branches add) and, in the MLP, the gradients of the product and
    // of the two branches (3·e·I); in eager attention the score gradient
    // (fp32 softmax backward + 16-bit copy).
    let mlp_bt = if classic { 2.0 } else { 3.0 } * mlp_e * i * k;
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
    } + if math_sdpa && a.quirks.sdpa_math_fallback {
        // Falcon's math-kernel backward on CUDA holds one more fp32 tensor
        // of the scores' shape than the same composite traced on the CPU
        // (`scripts/alloc_sim.py`, which matches the CPU's real run):
        // measured allocated peaks sit 1.00–1.07 of one (batch, heads, seq,
        // seq) fp32 tensor above that trace on all six Falcon-7B LoRA SDPA
        // rows, H100 and H200, checkpointed or not (1 × 2,048, 2 × 2,048
        // twice, 4 × 1,024 in bf16 and bf16-mixed, 16 × 2,048), and not on
        // its eager row; fp32 is not measured and counted the same (the
        // safe side). Which kernel allocates it is not identified
        // (BENCHMARKS.md, nineteenth session). The fp32 grouped-query runs
        // through the same composite (`enable_gqa`, no explicit mask;
        // bench/data/h200/qlora.csv) leave no room for one: it would put
        // Llama-3.2-1B QLoRA 4 × 2,048 at +11 % and Llama-3.1-8B 4 × 4,096
        // checkpointed at +12 % of their measured allocated bytes.
        4.0 * heads
    } else {
        0.0
    };

    LayerActs {
        saved,
        saved_per_seq: per_seq,
        backward_transient: bt,
        backward_transient_per_seq: bt_seq,
        transient_per_seq_one_size: math_sdpa,
        saved_wide,
        wide_tensor: mlp_e * i,
    }
}

/// Loss-path bytes per (token × vocabulary entry), per framework. Each is
/// the forward peak (logits + loss intermediates) and the larger of it and
/// the backward peak of the loss (saved log-probs + their gradient + the
/// gradient of the logits). `seq` sets litgpt's chunk count; `full`
/// picks litgpt's full fine-tuning loop, which does not chunk its head.
fn logits_bytes_per_token_vocab(f: Framework, d: Dtype, seq: f64, full: bool) -> (f64, f64) {
    let pd = compute_bytes(d);
    let (fwd, bwd) = match f {
        // transformers ≥ 4.46 `ForCausalLMLoss`: `logits.float()` then
        // cross_entropy; log_softmax saves its fp32 output. Forward: 16-bit
        // logits + fp32 copy + fp32 log-probs; backward: saved log-probs +
        // nll gradient + log_softmax gradient, all fp32 (the 16-bit logits
        // are released with the model output before backward).
        Framework::Hf => {
            let upcast = if pd < 4.0 { 4.0 } else { 0.0 };
            (pd + upcast + 4.0, 12.0)
        }
        // torchtune `CEWithChunkedOutputLoss`: 16-bit logit chunks, each
        // upcast to fp32 only inside its own cross_entropy; all chunks'
        // fp32 log-probs are saved; the recipe `del logits` before backward.
        Framework::Torchtune => {
            let fwd = pd + 4.0 + 4.0 / TORCHTUNE_CE_CHUNKS;
            let bwd = 4.0 + (8.0 + pd) / TORCHTUNE_CE_CHUNKS;
            (fwd, bwd)
        }
        // litgpt's `fit` (finetune/lora.py) runs the head in chunks of
        // `LITGPT_HEAD_CHUNK` tokens and `chunked_cross_entropy` on them
        // without upcast: all chunks' logits (held by the loop's `logits`
        // until the next forward returns) and their 16-bit log-probs, plus
        // one chunk's two transients: the head adapter's two outputs at the
        // forward's end (beside the previous step's logits), the nll and
        // log_softmax gradients in backward. Full fine-tuning
        // (finetune/full.py) runs the whole head and the chunked loss on its
        // shifted view, which `reshape` copies: logits, copy and log-probs
        // at the loss's end; in backward the logits, the chunks' gradients
        // and their concatenation. Replayed (scripts/alloc_sim.py
        // --framework litgpt, the vocabulary halved): 4.92 bytes at
        // 512 tokens (4 chunks) and 4.36 at 2,048 (16) for LoRA.
        Framework::Litgpt if full => (3.0 * pd, 3.0 * pd),
        Framework::Litgpt => {
            let chunks = (seq / LITGPT_HEAD_CHUNK).ceil().max(1.0);
            let both = 2.0 * pd + 2.0 * pd / chunks;
            (both, both)
        }
        // A plain `F.cross_entropy(logits, y)`: under autocast (the -mixed
        // dtypes, Lightning's `bf16-mixed`) cross_entropy is an fp32 op, so
        // it behaves like the HF path; with plain 16-bit or fp32 weights it
        // runs in the logits' dtype: saved log-probs + two gradients.
        Framework::Lightning | Framework::Generic => {
            if d.is_mixed() {
                (pd + 4.0 + 4.0, 12.0)
            } else {
                (2.0 * pd, 3.0 * pd)
            }
        }
    };
    (fwd, fwd.max(bwd))
}

/// The loss path's largest single tensor, bytes per token × vocabulary
/// entry: the fp32 upcast of the logits where the loss runs in fp32 (HF's
/// `ForCausalLMLoss`, cross_entropy under autocast), else the logits in
/// their own dtype (torchtune's and litgpt's chunked losses keep the
/// 16-bit logits whole; plain 16-bit cross_entropy does not upcast). See
/// `logits_bytes_per_token_vocab` for the paths.
fn loss_buffer_bytes_per_token_vocab(f: Framework, d: Dtype) -> f64 {
    match f {
        Framework::Hf => 4.0,
        Framework::Lightning | Framework::Generic if d.is_mixed() => 4.0,
        _ => compute_bytes(d),
    }
}

/// Activations and loss buffers per sample, and checkpointing's overlap.
pub(super) fn per_sample(
    w: &Workload,
    s: &EngineeringSettings,
    opts: &ModelOptions,
    pl: &mut Plan,
) {
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
    // Checkpointed: one block is recomputed at a time during backward, with
    // its saved tensors and backward transients (Korthikanti et al. 2022,
    // §4.2 "full activation recomputation": 2sbhL + one layer). That block
    // is recomputed only after the loss's backward has freed the loss
    // buffers, so it and the loss buffers are never alive together: the
    // peak holds the larger of the two (added below, once both are known).
    let recompute_tokens = per_token_layer + transient;
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
    pl.act_per_sample = seq * (acts_tokens + enc_dec);
    (pl.act_wide_per_sample, pl.wide_tensor_per_sample) = if s.activation_checkpointing {
        (0.0, 0.0)
    } else {
        (seq * layers * la.saved_wide, seq * la.wide_tensor)
    };
    // The hidden-width tensors among them (one is seq · h · e bytes per
    // sample): every block's, or the checkpointed blocks' inputs.
    (pl.act_hidden_per_sample, pl.hidden_tensor_per_sample) = if s.activation_checkpointing {
        (seq * layers * r * h, seq * r * h)
    } else {
        (
            seq * layers * (la.saved - la.saved_wide).max(0.0),
            seq * e * h,
        )
    };

    // --- logits / loss buffers per sample ---
    (pl.logits_fwd_per_sample, pl.logits_per_sample) = match opts.head {
        Head::LanguageModel => {
            // Gemma 2's `final_logit_softcapping`: `tanh(logits / cap) * cap`
            // in the logits' dtype; tanh keeps its output for backward.
            let softcap = if a.quirks.final_softcapping { e } else { 0.0 };
            let tv = seq * a.vocab_size as f64;
            let (fwd, peak) =
                logits_bytes_per_token_vocab(w.framework, dtype, seq, w.method == Method::Full);
            pl.loss_buffer_per_sample = tv * loss_buffer_bytes_per_token_vocab(w.framework, dtype);
            pl.largest_loss_tensor_per_sample = pl.loss_buffer_per_sample;
            if matches!(
                w.framework,
                Framework::Hf | Framework::Lightning | Framework::Generic
            ) {
                pl.head_output_per_sample = tv * e;
            }
            (tv * (fwd + softcap), tv * (peak + softcap))
        }
        // classification: the pooled token and a few logits per sequence
        Head::Classifier => {
            let c = 4.0 * h * 4.0;
            (c, c)
        }
    };
    // litgpt's `fit` holds the step's 16-bit logits in its `logits`
    // variable until the next forward returns, through the optimizer step
    // too (the lists of chunks for LoRA, the whole tensor for full). The
    // replay of litgpt's full loop (scripts/alloc_sim.py --framework litgpt,
    // Llama-3.2-1B bf16 1 × 2,048) peaks in the first optimizer step at
    // 14.46 GiB allocated: weights, gradients, AdamW's new states and
    // temporaries, and those logits (0.49 GiB).
    if w.framework == Framework::Litgpt && opts.head == Head::LanguageModel {
        pl.logits_held_per_sample = seq * a.vocab_size as f64 * e;
    }
    // A checkpointed full fine-tune under autocast makes the output head's
    // 16-bit copy (kept for backward) after the previous step freed its
    // loss buffers and while little else is alive: the copy is cut from a
    // cached fp32 loss segment, and the next loss backward maps one more.
    // Replayed (scripts/alloc_sim.py) for Llama-3.2-1B full bf16-mixed at
    // 12 × 2,048: three cached 11.74 GiB loss segments, one holding the
    // 0.49 GiB head copy, a fourth mapped in the loss backward; reserved
    // 64.74 GiB over 53.04 allocated (measured 64.57 and 53.06). Where the
    // first step's optimizer states cut a loss segment too (see
    // `allocator::first_step_states`), the copy sits in that one; else the
    // allocator keeps the larger of this and its fitted loss shares.
    // Adapter runs under autocast do not show it (Qwen2.5-7B, Llama-3.1-8B
    // and Gemma 2 LoRA bf16-mixed, checkpointed: within 5 % without it,
    // up to 23 % over with it).
    if s.activation_checkpointing
        && s.dtype.is_mixed()
        && w.method == Method::Full
        && opts.head == Head::LanguageModel
        && matches!(
            w.framework,
            Framework::Hf | Framework::Lightning | Framework::Generic
        )
    {
        pl.stranded_loss_buffer_per_sample = seq * a.vocab_size as f64 * 4.0;
    }
    if s.activation_checkpointing {
        // The recomputed block counts where it outgrows the loss buffers;
        // the smaller of the two is what the allocator must fit into the
        // other's freed blocks.
        let recompute = seq * recompute_tokens;
        // The math SDPA's score gradients are the size of its saved
        // probabilities (`LayerActs::transient_per_seq_one_size`): left out
        // of the turn-taking. Measured on an H200 (bench/data/h200/
        // qlora.csv): QLoRA without autocast, checkpointed, Llama-3.2-1B at
        // 8 × 2,048 holds 37.18 GiB reserved (45.56 with them counted,
        // 37.56 without) and Llama-3.1-8B at 4 × 4,096 59.88 (73.51 and
        // 65.27); Falcon-7B's math-kernel LoRA rows move closer too
        // (+3.2 → −2.5 %, +3.7 → +0.5 %, +3.0 → +2.3 %). Eager attention's
        // score transients (an fp32 gradient beside 16-bit copies) stay
        // counted: left out, Gemma 2's eager rows fall 1–4 % lower, below
        // their measurements.
        //
        // The saved probabilities themselves leave the turn-taking too where
        // one of them is larger than a loss buffer (heads × seq above the
        // vocabulary, both fp32): a cached block serves no larger request
        // (best fit by size), so they can never be cut from the loss
        // buffers' freed blocks; they and their gradients pass one shape of
        // block among themselves, recompute after recompute, while the loss
        // buffers' blocks stay with the block's smaller tensors. Replayed
        // (scripts/alloc_sim.py) for Falcon-7B LoRA bf16 16 × 2,048
        // checkpointed: 10.7 GiB reserved over allocated (measured on the
        // H200: 10.6), where counting them gave 28.0; Llama-
        // 3.1-8B QLoRA 4 × 4,096 checkpointed (32 heads × 4,096 over a
        // 128,256 vocabulary) goes from +9.1 % to −4.2 % of its measured
        // reserved bytes. Llama-3.2-1B QLoRA 8 × 2,048 (32 × 2,048 below
        // the vocabulary) keeps them: its probabilities do take those blocks.
        let score_per_sample = seq * seq * la.saved_per_seq;
        let turn = if la.transient_per_seq_one_size {
            let saved_out = if score_per_sample > pl.loss_buffer_per_sample {
                score_per_sample
            } else {
                0.0
            };
            recompute - seq * seq * la.backward_transient_per_seq - saved_out
        } else {
            recompute
        };
        pl.recompute_overlap_per_sample = turn.min(pl.logits_per_sample);
        pl.act_per_sample += (recompute - pl.logits_per_sample).max(0.0);
    }

    // --- torch.compile ---
    // Inductor fuses the elementwise ops, so their intermediates are not
    // saved for backward: the per-sample part shrinks, the fixed part does
    // not move. The blocks (norms, activations, rotary) and the loss (HF's
    // fp32 upcast, log_softmax and nll, traced with the forward) shrink by
    // different factors. Measured on an H100 (bench/data/h100/
    // compile_accum.csv, allocated bytes per sample from micro batch 4 → 8
    // and 2 → 4, fixed parts equal within 0.1 %): Llama-3.2-1B full
    // 4.36 GB compiled and Llama-3.1-8B LoRA 9.92 GB, whose eager per-sample
    // parts the model splits 3.70 + 3.15 GB and 11.53 + 3.15 GB (blocks +
    // loss). The two rows give blocks ×0.711 and loss ×0.547 (rounded up
    // below). Held out, Qwen2.5-0.5B full bf16 4 × 1,024 compiled
    // (expandable/families.csv, mostly loss: 151,936-token vocabulary)
    // measured 10.36 GiB allocated: 10.42 with the two factors, 11.29 with
    // the single ×0.69 used before.
    if s.compile {
        pl.act_per_sample *= COMPILE_BLOCK_FACTOR;
        pl.act_hidden_per_sample *= COMPILE_BLOCK_FACTOR;
        pl.recompute_overlap_per_sample *= COMPILE_BLOCK_FACTOR;
        pl.logits_per_sample *= COMPILE_LOSS_FACTOR;
        pl.logits_fwd_per_sample *= COMPILE_LOSS_FACTOR;
        pl.stranded_loss_buffer_per_sample *= COMPILE_LOSS_FACTOR;
        // The fused loss leaves no hole either: measured with expandable
        // segments, Qwen2.5-0.5B full bf16 4 × 1,024 compiled holds 0.05 GiB
        // reserved over allocated, against 1.24 GiB eager
        // (bench/data/h100/expandable/families.csv).
        pl.loss_buffer_per_sample = 0.0;
        pl.head_output_per_sample = 0.0;
    }
}

/// See the `torch.compile` block of the plan: a transformer block's saved
/// bytes per sample, compiled / eager, fitted on two H100 rows.
pub const COMPILE_BLOCK_FACTOR: f64 = 0.72;

/// See the `torch.compile` block of the plan: the loss path's bytes per
/// sample, compiled / eager, fitted on the same two rows.
pub const COMPILE_LOSS_FACTOR: f64 = 0.55;
