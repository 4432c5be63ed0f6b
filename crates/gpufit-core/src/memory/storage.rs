//! What is stored: parameter groups, frozen and trainable weights,
//! gradients, optimizer state and the optimizer step's temporaries — the
//! persistent parts of the plan (docs/memory-model.md).

use crate::settings::{Dtype, EngineeringSettings};
use crate::workload::{
    ArchKind, Framework, LoraTarget, Method, ModelArch, Optimizer, Sharding, Workload,
};

use super::constants::LITGPT_LM_HEAD_CHUNK;
use super::precision::{base_quant, compute_bytes, kbit_recipe, param_bytes};
use super::types::{
    BaseQuant, Gradients, Head, Layout, ModelOptions, OptimizerImpl, OptimizerTerms, Params,
    Weights,
};

/// NF4 storage per weight: 4 bits plus double-quantized block constants
/// (blocksize 64 with 8-bit absmax and a second-level fp32 constant per
/// 256 blocks): 4 + 8/64 + 32/(64·256) = 4.127 bits (Dettmers et al. 2023,
/// "QLoRA", §3 "Double Quantization").
const NF4_BYTES_PER_PARAM: f64 = 4.127 / 8.0;

/// NF4 without double quantization: 4 bits + one fp32 absmax per 64
/// weights = 4.5 bits (QLoRA §3).
const NF4_NO_DQ_BYTES_PER_PARAM: f64 = 4.5 / 8.0;

/// LLM.int8 storage: 1 byte per weight plus an fp32 scale per output row
/// (bitsandbytes `Int8Params`, Dettmers et al. 2022), the row scale is
/// negligible.
const INT8_BYTES_PER_PARAM: f64 = 1.0;

/// bitsandbytes 8-bit AdamW: two 8-bit states plus one fp32 absmax per
/// 2048-element block (Dettmers et al. 2022, "8-bit Optimizers via
/// Block-wise Quantization", §2): 2 + 8/2048 bytes per parameter.
const ADAMW8BIT_BYTES_PER_PARAM: f64 = 2.0 + 8.0 / 2048.0;

/// The parameter groups, element sizes and sharding of a workload.
pub(super) fn layout(w: &Workload, s: &EngineeringSettings) -> Layout {
    let a = &w.model;
    let mut params = params_of(a);
    let mut total = a.params as f64;
    // litgpt never ties the output head to the embedding: its `GPT` builds
    // `lm_head` and `transformer.wte` as separate modules and the checkpoint
    // converter copies a tied embedding into both (litgpt/model.py,
    // `GPT.__init__`), so tied models (Gemma, Llama 3.2) carry it twice.
    if w.framework == Framework::Litgpt && a.tied_embeddings {
        params.rest += params.head;
        total += params.head;
    }
    let param_elem_bytes = param_bytes(s.dtype);
    let mixed = s.dtype.is_mixed();
    let gpus = w.gpus.max(1) as f64;
    let deepspeed = matches!(
        w.sharding,
        Sharding::Zero1 | Sharding::Zero2 | Sharding::Zero3
    );
    let shards_if = |sharded: bool| if sharded { gpus } else { 1.0 };
    let trainable_params = match w.method {
        Method::Full => total,
        Method::Lora | Method::Qlora => w
            .lora
            .as_ref()
            .map(|l| lora_params(a, l.rank, &l.targets) as f64)
            .unwrap_or(0.0),
    };
    // Trainable parameters' storage: DeepSpeed ZeRO keeps 16-bit module
    // params plus a separate fp32 master copy in the optimizer (Rajbhandari
    // et al. 2020, "ZeRO", §3: 2Ψ + 2Ψ + KΨ with K = 12). PEFT keeps LoRA
    // adapters in fp32 even on a 16-bit base (`autocast_adapter_dtype=True`).
    let (trainable_elem_bytes, master_elem_bytes) = if deepspeed && s.dtype != Dtype::Fp32 {
        (2.0, 4.0)
    } else if w.method != Method::Full && w.framework == Framework::Hf {
        (4.0, 0.0)
    } else {
        (param_elem_bytes, 0.0)
    };
    let grad_elem_bytes = if deepspeed && s.dtype != Dtype::Fp32 {
        2.0
    } else if mixed {
        4.0
    } else {
        trainable_elem_bytes
    };
    Layout {
        params,
        param_elem_bytes,
        compute_elem_bytes: compute_bytes(s.dtype),
        mixed,
        deepspeed,
        optimizer_shards: shards_if(w.sharding != Sharding::None),
        gradient_shards: shards_if(matches!(
            w.sharding,
            Sharding::Zero2 | Sharding::Zero3 | Sharding::Fsdp
        )),
        param_shards: shards_if(matches!(w.sharding, Sharding::Zero3 | Sharding::Fsdp)),
        trainable_params,
        trainable_elem_bytes,
        master_elem_bytes,
        grad_elem_bytes,
    }
}

/// Parameter groups of an architecture.
pub(super) fn params_of(a: &ModelArch) -> Params {
    let h = a.hidden_size as f64;
    let qd = a.num_attention_heads as f64 * a.head_dim as f64;
    let kvd = a.num_kv_heads as f64 * a.head_dim as f64;
    let i = a.intermediate_size as f64;
    let attn = 2.0 * h * qd + 2.0 * h * kvd;
    let mlp = if a.gated_mlp { 3.0 } else { 2.0 } * h * i * a.num_experts.max(1) as f64;
    let mut layers = a.num_layers as f64 * (attn + mlp);
    if a.kind == ArchKind::EncoderDecoder {
        // decoder cross-attention
        layers += (a.num_layers / 2) as f64 * attn;
    }
    let total = a.params as f64;
    let body_linear = layers.min(total);
    Params {
        body_linear,
        rest: (total - body_linear).max(0.0),
        head: a.vocab_size as f64 * h,
        largest_linear: (h * i).max(h * qd).max(a.vocab_size as f64 * h * 0.0),
    }
}

/// (in, out) features of a LoRA target per layer, and how many copies
/// (experts) exist per layer.
fn target_dims(a: &ModelArch, t: LoraTarget) -> (f64, f64, f64) {
    let h = a.hidden_size as f64;
    let qd = a.num_attention_heads as f64 * a.head_dim as f64;
    let kvd = a.num_kv_heads as f64 * a.head_dim as f64;
    let i = a.intermediate_size as f64;
    let e = a.num_experts.max(1) as f64;
    match t {
        LoraTarget::Q => (h, qd, 1.0),
        LoraTarget::K | LoraTarget::V => (h, kvd, 1.0),
        LoraTarget::O => (qd, h, 1.0),
        LoraTarget::Gate | LoraTarget::Up => (h, i, e),
        // A classic MLP has no gate: `down` is fc2 (I → h).
        LoraTarget::Down => (i, h, e),
        LoraTarget::LmHead => (h, a.vocab_size as f64, 1.0),
    }
}

/// Base weights of the block linears that carry a LoRA adapter (the
/// output head excluded).
fn targeted_linear_params(a: &ModelArch, targets: &[LoraTarget]) -> f64 {
    targets
        .iter()
        .filter(|t| **t != LoraTarget::LmHead && (**t != LoraTarget::Gate || a.gated_mlp))
        .map(|&t| {
            let (din, dout, copies) = target_dims(a, t);
            din * dout * copies * a.num_layers as f64
        })
        .sum()
}

/// LoRA adapter parameters: r × (in + out) per targeted matrix.
pub fn lora_params(a: &ModelArch, rank: u32, targets: &[LoraTarget]) -> u64 {
    let r = rank as f64;
    let mut n = 0.0;
    for &t in targets {
        if t == LoraTarget::Gate && !a.gated_mlp {
            continue;
        }
        let (din, dout, copies) = target_dims(a, t);
        let per = r * (din + dout) * copies;
        n += if t == LoraTarget::LmHead {
            per
        } else {
            per * a.num_layers as f64
        };
    }
    n as u64
}

/// The LoRA targets a framework uses when the user names none.
///
/// * torchtune: `lora_attn_modules: ['q_proj', 'v_proj', 'output_proj']`
///   (llama3_1/8B_lora*.yaml); `apply_lora_to_mlp` is True in the 8B
///   single-device config but the builder default is q, v — we follow the
///   shipped Llama 3.1 8B config: q, v, o + MLP.
/// * Hugging Face PEFT: for Llama-family models
///   `TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["llama"] =
///   ["q_proj", "v_proj"]` (peft/utils/constants.py).
/// * litgpt: `lora_query`, `lora_value` True, the rest False
///   (litgpt/finetune/lora.py defaults).
/// * generic / lightning: q, v — the LoRA paper's (Hu et al. 2021, §7.1) choice.
pub fn default_lora_targets(f: Framework) -> Vec<LoraTarget> {
    use LoraTarget::*;
    match f {
        Framework::Torchtune => vec![Q, V, O, Gate, Up, Down],
        Framework::Hf | Framework::Litgpt | Framework::Lightning | Framework::Generic => vec![Q, V],
    }
}

/// Adafactor state elements: rows + cols per trainable matrix, full size
/// for vectors.
pub(super) fn adafactor_state_elems(w: &Workload) -> f64 {
    let a = &w.model;
    let h = a.hidden_size as f64;
    let layers = a.num_layers as f64;
    match w.method {
        Method::Full => {
            let qd = a.num_attention_heads as f64 * a.head_dim as f64;
            let kvd = a.num_kv_heads as f64 * a.head_dim as f64;
            let i = a.intermediate_size as f64;
            let mats = (h + qd) * 2.0
                + (h + kvd) * 2.0
                + (h + i) * if a.gated_mlp { 3.0 } else { 2.0 } * a.num_experts.max(1) as f64;
            layers * (mats + 2.0 * h)
                + (a.vocab_size as f64 + h) * if a.tied_embeddings { 1.0 } else { 2.0 }
        }
        Method::Lora | Method::Qlora => {
            let Some(l) = &w.lora else { return 0.0 };
            let r = l.rank as f64;
            l.targets
                .iter()
                .map(|&t| {
                    let (din, dout, copies) = target_dims(a, t);
                    let n = (din + r + r + dout) * copies;
                    if t == LoraTarget::LmHead {
                        n
                    } else {
                        n * layers
                    }
                })
                .sum()
        }
    }
}

/// Whether the optimizer step runs inside backward, one parameter at a
/// time (torchtune `optimizer_in_bwd: True`, shipped in its single-device
/// full fine-tune configs; `--optimizer-in-backward`): gradients never all
/// exist at once. It needs a step after every backward of one GPU's
/// unsharded full fine-tune: torchtune refuses it with gradient
/// accumulation ("Gradient accumulation is not supported with optimizer
/// in bwd", recipes/full_finetune_single_device.py), so an accumulating
/// run steps after backward with every gradient whatever the option says.
/// Unstated, torchtune's single-GPU full fine-tune runs it (its configs)
/// and every other framework steps after backward.
pub(super) fn optimizer_in_backward(
    w: &Workload,
    s: &EngineeringSettings,
    opts: &ModelOptions,
) -> bool {
    optimizer_in_backward_unavailable(w, s).is_none()
        && opts
            .optimizer_in_backward
            .unwrap_or(w.framework == Framework::Torchtune)
}

/// Why the optimizer cannot step inside backward for this run, or `None`
/// where it can: the step per parameter needs each full gradient once, on
/// this GPU, after every backward (torchtune's single-device full
/// fine-tune; it refuses gradient accumulation).
pub fn optimizer_in_backward_unavailable(
    w: &Workload,
    s: &EngineeringSettings,
) -> Option<&'static str> {
    if w.method != Method::Full {
        Some("it is modelled for full fine-tunes (torchtune's LoRA recipes do not run it)")
    } else if w.gpus != 1 || w.sharding != Sharding::None {
        Some("it is modelled for one GPU (torchtune's full_finetune_single_device)")
    } else if s.gradient_accumulation_steps > 1 {
        Some("gradient accumulation needs the gradients kept between micro steps (torchtune refuses the two together)")
    } else {
        None
    }
}

/// Stored weights (frozen and trainable, with master copies) and the
/// weight copies alive only in phase A (autocast casts, all-gathered
/// shards, dequantized linears).
pub(super) fn weights(
    w: &Workload,
    s: &EngineeringSettings,
    opts: &ModelOptions,
    l: &Layout,
) -> Weights {
    let a = &w.model;
    let p = &l.params;
    let frozen = frozen_weights(w, opts, l);
    let trained_store = l.trainable_params * l.trainable_elem_bytes / l.param_shards;
    let mut weights = Weights::default();
    // In -mixed the stored fp32 trainable params *are* the master weights;
    // the breakdown shows them as such and counts the 16-bit copies autocast
    // caches for the step (torch autocast weight cache, kept until the
    // autocast region exits and saved by the matmuls for backward) as weights.
    if l.mixed && !l.deepspeed {
        weights.master = trained_store;
        weights.stored = frozen;
        (
            weights.phase_a_copies,
            weights.casts_freed_before_loss_backward,
        ) = autocast_casts(w, s, l);
    } else {
        weights.stored = frozen + trained_store;
        weights.master = l.trainable_params * l.master_elem_bytes / l.optimizer_shards;
    }

    // ZeRO-3 / FSDP all-gather one block's full weights at a time and
    // prefetch the next (FSDP `forward_prefetch`/`backward_prefetch`
    // defaults; DeepSpeed `stage3_prefetch_bucket_size`): two blocks.
    if l.param_shards > 1.0 {
        let block = p.body_linear / a.num_layers.max(1) as f64;
        weights.phase_a_copies += 2.0 * block * l.compute_elem_bytes;
    }
    // Quantized bases are dequantized one linear at a time into the compute
    // dtype for the matmul (bitsandbytes `dequantize_4bit`).
    if base_quant(w, opts) != BaseQuant::None && w.method != Method::Full {
        weights.phase_a_copies += if fabric_quantizes_head(w, opts) {
            fabric_dequantized_linear(s, l)
        } else {
            p.largest_linear * l.compute_elem_bytes
        };
    }
    weights
}

/// Whether Lightning Fabric's `BitsandbytesPrecision` quantized the base,
/// as litgpt's `--quantize bnb.*` does: its `module_init_context` swaps
/// `torch.nn.Linear` for a bitsandbytes layer while the model is built
/// (`_ClassReplacementContextManager`, lightning/fabric/plugins/precision/
/// bitsandbytes.py at 29136332, the `lightning==2.3.0.dev20240428` litgpt
/// 0.4.5 pinned), and litgpt passes no `ignore_modules`, so every linear
/// is replaced — the output head (`lm_head`, a `LoRALinear` whose `linear`
/// is an `nn.Linear`) too, not only the block linears. Only 4-bit modes:
/// `bnb.int8-training` keeps 16-bit weights.
fn fabric_quantizes_head(w: &Workload, opts: &ModelOptions) -> bool {
    w.framework == Framework::Litgpt
        && w.method != Method::Full
        && matches!(
            base_quant(w, opts),
            BaseQuant::Nf4 | BaseQuant::Nf4NoDoubleQuant
        )
}

/// The dequantized copy of the largest 4-bit linear under Fabric, alive
/// while its matmul runs (forward, and again in backward while every saved
/// activation is still held — the output head's backward is the first).
/// Fabric quantizes from fp16 (`_Linear4bit.quantize`:
/// `weight.to(device, dtype=torch.half)`), so `quant_state.dtype` is fp16
/// and bitsandbytes' `MatMul4Bit` (autograd/_functions.py, 0.41–0.43:
/// `F.dequantize_4bit(B, state).to(A.dtype)`) makes an fp16 copy and then,
/// for bf16 or fp32 activations, a second copy in their dtype while the
/// first is alive. The largest is the output head (vocab × hidden) for
/// every model litgpt ships.
fn fabric_dequantized_linear(s: &EngineeringSettings, l: &Layout) -> f64 {
    let p = &l.params;
    let fp16 = 2.0;
    let cast = if s.dtype == Dtype::Fp16 {
        0.0
    } else {
        l.compute_elem_bytes
    };
    p.head.max(p.largest_linear) * (fp16 + cast)
}

/// The frozen base's bytes on this GPU: quantized block linears; the
/// embeddings, head and norms in the compute dtype (transformers'
/// bitsandbytes integration and torchtune quantize only the block linears;
/// litgpt's Fabric also the head, [`fabric_quantizes_head`]), or in fp32
/// under PEFT's k-bit recipe ([`kbit_recipe`]).
fn frozen_weights(w: &Workload, opts: &ModelOptions, l: &Layout) -> f64 {
    let (pb, e) = (l.param_elem_bytes, l.compute_elem_bytes);
    let (frozen_body, frozen_rest) = match w.method {
        Method::Full => (0.0, 0.0),
        Method::Lora | Method::Qlora => (l.params.body_linear, l.params.rest),
    };
    let quant = base_quant(w, opts);
    let frozen_rest_bytes = match quant {
        BaseQuant::None => pb,
        _ if kbit_recipe(w, opts) => 4.0,
        _ => e,
    };
    // Which block linears are quantized: bitsandbytes (HF, litgpt) converts
    // every block linear; torchtune quantizes only the linears that carry an
    // adapter (`LoRALinear(quantize_base=True)`, torchtune QLoRA tutorial),
    // the others stay in the compute dtype.
    let quantized_body = match (quant, w.method) {
        (BaseQuant::None, _) | (_, Method::Full) => 0.0,
        _ if w.framework == Framework::Torchtune => w
            .lora
            .as_ref()
            .map(|lora| targeted_linear_params(&w.model, &lora.targets))
            .unwrap_or(0.0)
            .min(frozen_body),
        _ => frozen_body,
    };
    let unquantized_body = frozen_body - quantized_body;
    let unquantized_body_bytes = if quant == BaseQuant::None { pb } else { e };
    let frozen_body_bytes = match quant {
        BaseQuant::None => pb,
        BaseQuant::Int8 => INT8_BYTES_PER_PARAM,
        BaseQuant::Nf4 => NF4_BYTES_PER_PARAM,
        BaseQuant::Nf4NoDoubleQuant => NF4_NO_DQ_BYTES_PER_PARAM,
    };
    // Fabric quantizes litgpt's output head as well ([`fabric_quantizes_head`]);
    // litgpt's head is always its own matrix (see `layout`).
    let quantized_head = if fabric_quantizes_head(w, opts) {
        l.params.head.min(frozen_rest)
    } else {
        0.0
    };
    (quantized_body * frozen_body_bytes
        + unquantized_body * unquantized_body_bytes
        + quantized_head * frozen_body_bytes
        + (frozen_rest - quantized_head) * frozen_rest_bytes)
        / l.param_shards
}

/// Under autocast: the 16-bit weight casts alive at the forward/backward
/// boundary, and those of them freed before the loss's backward.
fn autocast_casts(w: &Workload, s: &EngineeringSettings, l: &Layout) -> (f64, f64) {
    let p = &l.params;
    // Every matmul weight is cast once per forward; the casts of frozen
    // weights are not cached but are saved by their matmul for backward,
    // so all of them are alive at the boundary. With checkpointing, a
    // frozen (LoRA) block's casts are dropped when its checkpointed forward
    // ends and remade one block at a time in backward; autocast caches only
    // casts of weights that need a gradient, so a full fine-tune keeps them
    // all either way.
    let body_casts = if w.method != Method::Full && s.activation_checkpointing {
        p.body_linear / w.model.num_layers.max(1) as f64
    } else {
        p.body_linear
    };
    // litgpt's LoRA loop runs the head in chunks (`LITGPT_LM_HEAD_CHUNK`):
    // a frozen head is cast once per chunk, and each chunk's matmul saves
    // its own cast.
    let head_casts = if w.framework == Framework::Litgpt && w.method != Method::Full {
        (w.seq_len as f64 / LITGPT_LM_HEAD_CHUNK).ceil().max(1.0)
    } else {
        1.0
    };
    let casts = 2.0 * (body_casts + head_casts * p.head) / l.param_shards;
    // A full fine-tune caches every weight's cast until the autocast region
    // exits after the forward; checkpointed blocks saved nothing, so their
    // casts are freed before the loss's backward (recomputation casts one
    // block at a time again).
    let freed = if w.method == Method::Full && s.activation_checkpointing {
        2.0 * p.body_linear / l.param_shards
    } else {
        0.0
    };
    (casts, freed)
}

/// Gradients, and whether they are alive in phase A. The blocks of the
/// largest gradient's size are filled in by [`largest_size_blocks`].
pub(super) fn gradients(
    w: &Workload,
    s: &EngineeringSettings,
    opts: &ModelOptions,
    l: &Layout,
) -> Gradients {
    let p = &l.params;
    let (trainable, grad_bytes) = (l.trainable_params, l.grad_elem_bytes);
    let mut g = Gradients {
        total: trainable * grad_bytes / l.gradient_shards,
        ..Gradients::default()
    };
    if w.gpus > 1 && w.sharding == Sharding::None {
        // DDP's reducer keeps flat bucket buffers as large as all gradients
        // unless `gradient_as_bucket_view=True` (torch DDP docs).
        g.total += trainable * grad_bytes;
    }
    if optimizer_in_backward(w, s, opts) {
        // Only the gradient being applied exists: the largest tensor.
        g.total = p.head.max(p.largest_linear) * grad_bytes;
    }
    // One tensor per parameter (torch's `AccumulateGrad`): the largest is
    // the embedding's or the head's. Sharded and bucketed gradients are
    // flat buffers of other sizes, and adapters are small: none counted.
    if w.method == Method::Full
        && l.gradient_shards == 1.0
        && !l.deepspeed
        && w.gpus <= 1
        && !optimizer_in_backward(w, s, opts)
    {
        g.largest_block = p.largest_param() * grad_bytes;
    }
    if g.largest_block > 0.0 {
        g.mlp_block = p.largest_linear * grad_bytes;
    }
    // Gradients exist during the next forward when accumulation keeps them
    // between micro steps, or when zero_grad only zeroes them (torch < 2.0
    // default `set_to_none=False`).
    if s.gradient_accumulation_steps > 1 || opts.grads_kept_between_steps {
        g.kept_in_phase_a = g.total;
    }
    // With torchtune's chunked output (`CEWithChunkedOutputLoss`, its
    // configs' loss) the output head's gradient is made by the backward of
    // the last chunk's projection and accumulates over every other chunk
    // (and, tied, over the embedding's use at the very end), so it exists
    // beside the remaining chunks' loss buffers and the saved activations
    // at the start of backward, the phase-A peak — whether the optimizer
    // then steps after backward or, in backward, once it is complete
    // (`register_post_accumulate_grad_hook`, torchtune/training/memory.py
    // `register_optim_in_bwd_hooks`). Stepping in backward keeps it there
    // with a plain loss too (fitted on the README's optimizer_in_bwd row).
    if optimizer_in_backward(w, s, opts) || torchtune_chunked_head(w, opts) {
        g.kept_in_phase_a = g.kept_in_phase_a.max(p.head * grad_bytes);
    }
    g
}

/// Whether a torchtune full fine-tune trains its output head in chunks
/// (`CEWithChunkedOutputLoss`, unless `--chunked-loss off`).
fn torchtune_chunked_head(w: &Workload, opts: &ModelOptions) -> bool {
    w.framework == Framework::Torchtune
        && w.method == Method::Full
        && opts.head == Head::LanguageModel
        && !opts.torchtune_plain_loss
}

/// The bytes phase B caches in blocks of the largest gradient's size
/// (`Gradients::largest_block`), which the loss buffers can take when each
/// fits in one: per parameter of that size its gradient, and the
/// optimizer's temporary of its shape where the step makes one (foreach
/// AdamW makes all at once, transformers' per-parameter AdamW one at a
/// time); a tied embedding adds the gradient of its second use, which
/// autograd sums into the first and frees. Returns all of them and the
/// second use's alone.
pub(super) fn largest_size_blocks(
    w: &Workload,
    l: &Layout,
    largest_block: f64,
    step_temporaries: f64,
) -> (f64, f64) {
    let block = largest_block;
    if block <= 0.0 {
        return (0.0, 0.0);
    }
    let head_largest = l.params.head >= l.params.largest_linear;
    // litgpt unties the head (see `layout`)
    let tied = head_largest && w.model.tied_embeddings && w.framework != Framework::Litgpt;
    let params = match (head_largest, tied) {
        (true, true) => 1.0,
        (true, false) => 2.0,
        (false, _) => w.model.num_layers as f64,
    };
    let temporaries = (step_temporaries / block).floor().min(params);
    let second_use = if tied { 1.0 } else { 0.0 };
    (
        (params + temporaries + second_use) * block,
        second_use * block,
    )
}

/// The optimizer implementation: the option, or the framework's default
/// (torchtune's configs set `fused: True`, DeepSpeed ZeRO runs its own
/// fused Adam; torch defaults to foreach on CUDA).
fn optimizer_impl(w: &Workload, opts: &ModelOptions, l: &Layout) -> OptimizerImpl {
    opts.optimizer_impl
        .unwrap_or(if w.framework == Framework::Torchtune || l.deepspeed {
            OptimizerImpl::Fused
        } else {
            OptimizerImpl::Foreach
        })
}

/// Optimizer state, the optimizer step's temporaries (phase B) and the
/// bytes the step moves.
pub(super) fn optimizer(
    w: &Workload,
    s: &EngineeringSettings,
    opts: &ModelOptions,
    l: &Layout,
) -> OptimizerTerms {
    let trainable = l.trainable_params;
    // torch optimizers create state like the parameter (`zeros_like(p)`),
    // so AdamW on bf16 params keeps bf16 moments; DeepSpeed keeps fp32.
    let state_elem = if l.deepspeed || l.mixed {
        4.0
    } else {
        l.trainable_elem_bytes
    };
    let adafactor_elems = adafactor_state_elems(w);
    let states = match w.optimizer {
        // exp_avg + exp_avg_sq (Loshchilov & Hutter 2019; torch.optim.AdamW).
        Optimizer::Adamw => trainable * 2.0 * state_elem,
        Optimizer::Adamw8bit => trainable * ADAMW8BIT_BYTES_PER_PARAM,
        // one momentum buffer (torch.optim.SGD, momentum > 0).
        Optimizer::Sgd => trainable * state_elem,
        // factored second moment: a row and a column vector per matrix
        // (Shazeer & Stern 2018, "Adafactor", §3); HF Adafactor, beta1=None.
        Optimizer::Adafactor => adafactor_elems * state_elem,
    } / l.optimizer_shards;

    // torch's foreach AdamW (`_multi_tensor_adamw`) materialises
    // `exp_avg_sq.sqrt()` for every parameter at once: one more state-sized
    // buffer. Fused kernels make none; bitsandbytes and SGD update in place.
    let imp = optimizer_impl(w, opts, l);
    let step_temporaries = match (w.optimizer, imp) {
        _ if optimizer_in_backward(w, s, opts) => 0.0,
        (Optimizer::Adamw, OptimizerImpl::Foreach) => trainable * state_elem / l.optimizer_shards,
        // transformers' legacy AdamW: `exp_avg_sq.sqrt()` of one parameter.
        (Optimizer::Adamw, OptimizerImpl::PerParameter) => l.params.largest_param() * state_elem,
        _ => 0.0,
    };
    OptimizerTerms {
        states,
        step_temporaries,
        step_traffic: step_traffic(w, l, imp, states),
        first_step_states: 0.0,
    }
}

/// Bytes the optimizer step reads and writes on this GPU (its time:
/// element-wise kernels run at the memory bandwidth, see
/// `core::throughput`): the shard of parameters it updates (the fp32
/// master copy where there is one), their gradients and the states.
fn step_traffic(w: &Workload, l: &Layout, imp: OptimizerImpl, state: f64) -> f64 {
    let trainable = l.trainable_params;
    let param = trainable
        * if l.deepspeed {
            4.0
        } else {
            l.trainable_elem_bytes
        }
        / l.optimizer_shards;
    let grad = trainable * l.grad_elem_bytes / l.optimizer_shards;
    match (w.optimizer, imp) {
        // `_multi_tensor_adam` with decoupled weight decay (torch/optim/
        // adam.py), element accesses per parameter: `_foreach_mul_(params)`
        // 2, `_foreach_lerp_(exp_avgs, grads)` 3, `_foreach_mul_(exp_avg_sqs)`
        // 2, `_foreach_addcmul_(exp_avg_sqs, grads, grads)` 4, `_foreach_sqrt`
        // 2, `_foreach_div_` 2, `_foreach_add_(eps)` 2, `_foreach_addcdiv_
        // (params, exp_avgs, denom)` 4: params 4, grads 3, exp_avg 3,
        // exp_avg_sq 5 and the state-sized `denom` 6 — 4P + 3G + 7 × (both
        // states), 42 B per bf16 parameter. The per-parameter loop does
        // the same passes one tensor at a time.
        (Optimizer::Adamw, OptimizerImpl::Foreach | OptimizerImpl::PerParameter) => {
            4.0 * param + 3.0 * grad + 7.0 * state
        }
        // One fused kernel per tensor list (torch `fused=True`, DeepSpeed's
        // FusedAdam): reads the parameter, gradient and both states, writes
        // the parameter and both states.
        (Optimizer::Adamw, OptimizerImpl::Fused) => 2.0 * param + grad + 2.0 * state,
        // bitsandbytes' 8-bit AdamW: one fused kernel per tensor, the same
        // accesses on 1-byte states (quantile maps aside).
        (Optimizer::Adamw8bit, _) => 2.0 * param + grad + 2.0 * state,
        // torch SGD with momentum (foreach): `buf.mul_(m).add_(grad)` and
        // `param.add_(buf, -lr)`.
        (Optimizer::Sgd, _) => 2.0 * param + grad + 3.0 * state,
        // transformers' Adafactor updates each parameter in fp32 through
        // about eight passes over parameter-sized temporaries (squared
        // gradient, its factored estimate, the update and its RMS clip);
        // its factored state is small. Not measured.
        (Optimizer::Adafactor, _) => {
            2.0 * param + grad + 8.0 * trainable * 4.0 / l.optimizer_shards
        }
    }
}
