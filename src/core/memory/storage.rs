//! What is stored: parameter groups, bytes per element, frozen and
//! trainable weights, gradients, optimizer state and the optimizer step's
//! temporaries — the persistent terms of the plan (docs/design.md, "The
//! memory model").

use crate::core::settings::{Dtype, EngineeringSettings};
use crate::core::workload::{
    ArchKind, Framework, LoraTarget, Method, ModelArch, Optimizer, Sharding, Workload,
};

use super::plan::{Layout, Plan};
use super::{BaseQuant, ModelOptions, OptimizerImpl};

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

/// Bytes of one element of a dtype's *stored* parameters.
pub(super) fn param_bytes(d: Dtype) -> f64 {
    match d {
        Dtype::Fp32 | Dtype::Bf16Mixed | Dtype::Fp16Mixed => 4.0,
        Dtype::Bf16 | Dtype::Fp16 => 2.0,
    }
}

/// The frozen base's storage: the option, or what the method implies (NF4
/// for QLoRA, the training dtype otherwise).
pub(super) fn base_quant(w: &Workload, opts: &ModelOptions) -> BaseQuant {
    opts.base_quant.unwrap_or(if w.method == Method::Qlora {
        BaseQuant::Nf4
    } else {
        BaseQuant::None
    })
}

/// PEFT's QLoRA recipe (`prepare_model_for_kbit_training`,
/// peft/utils/other.py), which transformers' quantized LoRA runs: every
/// parameter that is not quantized — embeddings, norms, output head — is
/// cast to fp32 (stored so in `weights`), and a bitsandbytes linear returns
/// its output in its input's dtype (`Linear4bit.forward`:
/// `x.to(compute_dtype)` … `out.to(inp_dtype)`), so the residual stream
/// and every projection's output are fp32 (`activations::activation_dtype`).
/// Counted on the CPU (bench/data/saved_tensors.jsonl): Llama-3.2-1B with
/// q/v adapters keeps 143,560 bytes per token and block this way against
/// 92,360 for LoRA on a bf16 base.
pub(super) fn kbit_recipe(w: &Workload, opts: &ModelOptions) -> bool {
    w.framework == Framework::Hf
        && w.method != Method::Full
        && base_quant(w, opts) != BaseQuant::None
}

/// Bytes of one activation element (matmul outputs): 16-bit except fp32.
pub(super) fn compute_bytes(d: Dtype) -> f64 {
    match d {
        Dtype::Fp32 => 4.0,
        _ => 2.0,
    }
}

/// Tokens per head chunk in litgpt's fine-tuning loops
/// (`lm_head_chunk_size=128`, litgpt/finetune/lora.py and adapter.py).
pub(super) const LITGPT_LM_HEAD_CHUNK: f64 = 128.0;

/// Parameter groups of an architecture.
pub(super) struct Params {
    /// Linear weights inside the transformer blocks (all experts).
    pub(super) body_linear: f64,
    /// Everything else: embeddings, untied head, norms, positions.
    pub(super) rest: f64,
    /// The output head (its own matrix, or the tied embedding).
    pub(super) head: f64,
    /// Largest single linear weight (for one-at-a-time dequantization).
    pub(super) largest_linear: f64,
}

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

impl Params {
    /// The largest single parameter tensor (embedding or one linear).
    fn largest_param(&self) -> f64 {
        self.head.max(self.largest_linear)
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
/// full fine-tune configs): gradients never all exist at once.
pub(super) fn optimizer_in_backward(w: &Workload) -> bool {
    w.framework == Framework::Torchtune
        && w.method == Method::Full
        && w.gpus == 1
        && w.sharding == Sharding::None
}

/// Stored weights (frozen and trainable, with master copies) and the
/// weight copies alive only in phase A (autocast casts, all-gathered
/// shards, dequantized linears).
pub(super) fn weights(
    w: &Workload,
    s: &EngineeringSettings,
    opts: &ModelOptions,
    l: &Layout,
    pl: &mut Plan,
) {
    let a = &w.model;
    let Layout {
        ref p,
        pb,
        e,
        mixed,
        deepspeed,
        shard_opt,
        shard_param,
        trainable,
        train_store,
        master_bytes,
        ..
    } = *l;
    let (frozen_body, frozen_rest) = match w.method {
        Method::Full => (0.0, 0.0),
        Method::Lora | Method::Qlora => (p.body_linear, p.rest),
    };
    let quant = base_quant(w, opts);
    // Frozen bases: quantized linear weights; embeddings, head and norms
    // stay in the compute dtype (bitsandbytes and torchtune quantize only
    // the block linears).
    // PEFT's `prepare_model_for_kbit_training` (the HF QLoRA recipe) casts
    // every parameter that is not quantized — embeddings, output head, norms —
    // to fp32 (peft/utils/other.py).
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
            .map(|l| targeted_linear_params(a, &l.targets))
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
    let frozen = (quantized_body * frozen_body_bytes
        + unquantized_body * unquantized_body_bytes
        + frozen_rest * frozen_rest_bytes)
        / shard_param;

    let trained_store = trainable * train_store / shard_param;

    // In -mixed the stored fp32 trainable params *are* the master weights;
    // the breakdown shows them as such and counts the 16-bit copies autocast
    // caches for the step (torch autocast weight cache, kept until the
    // autocast region exits and saved by the matmuls for backward) as weights.
    if mixed && !deepspeed {
        pl.master = trained_store;
        pl.weights_stored = frozen;
        // Every matmul weight is cast once per forward; the casts of frozen
        // weights are not cached but are saved by their matmul for backward,
        // so all of them are alive at the boundary.
        // With checkpointing, a frozen (LoRA) block's casts are dropped when
        // its checkpointed forward ends and remade one block at a time in
        // backward; autocast caches only casts of weights that need a
        // gradient, so a full fine-tune keeps them all either way.
        let body_casts = if w.method != Method::Full && s.activation_checkpointing {
            p.body_linear / a.num_layers.max(1) as f64
        } else {
            p.body_linear
        };
        // litgpt's LoRA loop runs the head in 128-token chunks
        // (`model(input_ids, lm_head_chunk_size=128)`, litgpt/finetune/
        // lora.py): a frozen head is cast once per chunk, and each chunk's
        // matmul saves its own cast.
        let head_casts = if w.framework == Framework::Litgpt && w.method != Method::Full {
            (w.seq_len as f64 / LITGPT_LM_HEAD_CHUNK).ceil().max(1.0)
        } else {
            1.0
        };
        pl.weights_transient_a = 2.0 * (body_casts + head_casts * p.head) / shard_param;
        // A full fine-tune caches every weight's cast until the autocast
        // region exits after the forward; checkpointed blocks saved nothing,
        // so their casts are freed before the loss's backward (recomputation
        // casts one block at a time again).
        if w.method == Method::Full && s.activation_checkpointing {
            pl.casts_freed_before_backward = 2.0 * p.body_linear / shard_param;
        }
    } else {
        pl.weights_stored = frozen + trained_store;
        pl.master = trainable * master_bytes / shard_opt;
    }

    // ZeRO-3 / FSDP all-gather one block's full weights at a time and
    // prefetch the next (FSDP `forward_prefetch`/`backward_prefetch`
    // defaults; DeepSpeed `stage3_prefetch_bucket_size`): two blocks.
    if shard_param > 1.0 {
        let block = p.body_linear / a.num_layers.max(1) as f64;
        pl.weights_transient_a += 2.0 * block * e;
    }
    // Quantized bases are dequantized one linear at a time into the compute
    // dtype for the matmul (bitsandbytes `dequantize_4bit`).
    if quant != BaseQuant::None && w.method != Method::Full {
        pl.weights_transient_a += p.largest_linear * e;
    }
}

/// Gradients, and whether they are alive in phase A.
pub(super) fn gradients(
    w: &Workload,
    s: &EngineeringSettings,
    opts: &ModelOptions,
    l: &Layout,
    pl: &mut Plan,
) {
    let Layout {
        ref p,
        deepspeed,
        shard_grad,
        trainable,
        grad_bytes,
        ..
    } = *l;
    // --- gradients: same dtype as the stored trainable params (see
    // `Layout::grad_bytes`) ---
    pl.grads = trainable * grad_bytes / shard_grad;
    if w.gpus > 1 && w.sharding == Sharding::None {
        // DDP's reducer keeps flat bucket buffers as large as all gradients
        // unless `gradient_as_bucket_view=True` (torch DDP docs).
        pl.grads += trainable * grad_bytes;
    }
    if optimizer_in_backward(w) {
        // Only the gradient being applied exists: the largest tensor.
        pl.grads = p.head.max(p.largest_linear) * grad_bytes;
    }
    // One tensor per parameter (torch's `AccumulateGrad`): the largest is
    // the embedding's or the head's. Sharded and bucketed gradients are
    // flat buffers of other sizes, and adapters are small: none counted.
    pl.largest_grad_block = if w.method == Method::Full
        && shard_grad == 1.0
        && !deepspeed
        && w.gpus <= 1
        && !optimizer_in_backward(w)
    {
        p.largest_param() * grad_bytes
    } else {
        0.0
    };
    pl.mlp_grad_block = if pl.largest_grad_block > 0.0 {
        p.largest_linear * grad_bytes
    } else {
        0.0
    };
    // Gradients exist during the next forward when accumulation keeps them
    // between micro steps, or when zero_grad only zeroes them (torch < 2.0
    // default `set_to_none=False`).
    pl.grads_in_a = if s.gradient_accumulation_steps > 1 || opts.grads_kept_between_steps {
        pl.grads
    } else {
        0.0
    };
}

/// The bytes phase B caches in blocks of the largest gradient's size
/// (`Plan::largest_grad_block`), which the loss buffers can take when each
/// fits in one: per parameter of that size its gradient, and the
/// optimizer's temporary of its shape where the step makes one (foreach
/// AdamW makes all at once, transformers' per-parameter AdamW one at a
/// time); a tied embedding adds the gradient of its second use, which
/// autograd sums into the first and frees. Returns all of them and the
/// second use's alone.
pub(super) fn grad_blocks(w: &Workload, l: &Layout, pl: &Plan) -> (f64, f64) {
    let block = pl.largest_grad_block;
    if block <= 0.0 {
        return (0.0, 0.0);
    }
    let head_largest = l.p.head >= l.p.largest_linear;
    // litgpt unties the head (see `plan::layout`)
    let tied = head_largest && w.model.tied_embeddings && w.framework != Framework::Litgpt;
    let params = match (head_largest, tied) {
        (true, true) => 1.0,
        (true, false) => 2.0,
        (false, _) => w.model.num_layers as f64,
    };
    let temporaries = (pl.step_transient / block).floor().min(params);
    let second_use = if tied { 1.0 } else { 0.0 };
    (
        (params + temporaries + second_use) * block,
        second_use * block,
    )
}

/// Optimizer state and the optimizer step's temporaries (phase B).
pub(super) fn optimizer(w: &Workload, opts: &ModelOptions, l: &Layout, pl: &mut Plan) {
    let Layout {
        ref p,
        mixed,
        deepspeed,
        shard_opt,
        trainable,
        train_store,
        ..
    } = *l;
    // --- optimizer state ---
    // torch optimizers create state like the parameter (`zeros_like(p)`),
    // so AdamW on bf16 params keeps bf16 moments; DeepSpeed keeps fp32.
    let state_elem = if deepspeed || mixed { 4.0 } else { train_store };
    let adafactor_elems = adafactor_state_elems(w);
    let opt = match w.optimizer {
        // exp_avg + exp_avg_sq (Loshchilov & Hutter 2019; torch.optim.AdamW).
        Optimizer::Adamw => trainable * 2.0 * state_elem,
        Optimizer::Adamw8bit => trainable * ADAMW8BIT_BYTES_PER_PARAM,
        // one momentum buffer (torch.optim.SGD, momentum > 0).
        Optimizer::Sgd => trainable * state_elem,
        // factored second moment: a row and a column vector per matrix
        // (Shazeer & Stern 2018, "Adafactor", §3); HF Adafactor, beta1=None.
        Optimizer::Adafactor => adafactor_elems * state_elem,
    };
    pl.opt_state = opt / shard_opt;

    // --- optimizer-step temporaries ---
    // torch's default foreach AdamW (`_multi_tensor_adamw`) materialises
    // `exp_avg_sq.sqrt()` for every parameter at once: one more state-sized
    // buffer. torchtune's configs set `fused: True` and DeepSpeed ZeRO uses
    // its own fused Adam kernel (no temporaries); bitsandbytes and SGD
    // update in place.
    let imp = opts
        .optimizer_impl
        .unwrap_or(if w.framework == Framework::Torchtune || deepspeed {
            OptimizerImpl::Fused
        } else {
            OptimizerImpl::Foreach
        });
    pl.step_transient = match (w.optimizer, imp) {
        _ if optimizer_in_backward(w) => 0.0,
        (Optimizer::Adamw, OptimizerImpl::Foreach) => trainable * state_elem / shard_opt,
        // transformers' legacy AdamW: `exp_avg_sq.sqrt()` of one parameter.
        (Optimizer::Adamw, OptimizerImpl::PerParameter) => p.largest_param() * state_elem,
        _ => 0.0,
    };

    // --- bytes the optimizer step reads and writes (its time: element-wise
    // kernels run at the memory bandwidth, see `core::throughput`) ---
    // Per GPU: the shard of parameters it updates (the fp32 master copy
    // where there is one), their gradients and the states.
    let param = trainable * if deepspeed { 4.0 } else { train_store } / shard_opt;
    let grad = trainable * l.grad_bytes / shard_opt;
    let state = pl.opt_state;
    pl.optimizer_step_bytes = match (w.optimizer, imp) {
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
        (Optimizer::Adafactor, _) => 2.0 * param + grad + 8.0 * trainable * 4.0 / shard_opt,
    };
}
