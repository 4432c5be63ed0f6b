//! The throughput model: predicted training tokens/s of a step. The step's
//! time per token is its matmuls' FLOPs at the GPU's dense tensor
//! throughput, each matmul at an efficiency that grows with the tokens
//! of a micro batch and with the matmul's size, plus its element-wise
//! kernels' bytes at the memory bandwidth (`elementwise`), plus the
//! optimizer step's. It ranks candidate settings where nothing is
//! measured; measured tokens/s from the history calibrate it (the advisor
//! does that) and replace it where a setting ran.
//!
//! Pure arithmetic, no I/O. Every constant says where it comes from; the
//! ones fitted to `bench/data/h100/throughput.csv` (a real H100, HF training
//! loop, see its README) say so.

pub mod dispatch;
pub mod elementwise;
pub mod optimizer;

use crate::catalog::GpuSpec;
use crate::memory::{step_kernels, StepKernels};
use crate::settings::{Dtype, EngineeringSettings};
use crate::workload::{ArchKind, Method, ModelArch, Workload};

/// Share of the dense bf16 peak that a large matmul reaches, with many
/// tokens: the asymptote of the efficiency curve (see [`HALF_TOKENS`]).
/// Fitted with [`HALF_TOKENS`] and [`HALF_TOKENS_EXPONENT`] to the H100's
/// measured steps (bench/data/h100/, 281 steps; `cargo bench --bench
/// accuracy` with `GPUFIT_ACCURACY_SPEED_DUMP`; the H200's 169 were the
/// check), once the element-wise kernels and the host's dispatch had their
/// own time: 613 of the datasheet's 989 TFLOP/s. Before that split one
/// curve had to absorb them: 43 %.
pub const MFU_MAX: f64 = 0.62;

/// Tokens per micro batch at which a matmul reaches half of [`MFU_MAX`],
/// for a weight of [`HALF_TOKENS_WEIGHT`] elements; it shrinks with the
/// weight's size (out × in features) to the power [`HALF_TOKENS_EXPONENT`]:
/// a GEMM's output tiles are tokens × out features, so a wider weight fills
/// the GPU's SMs with fewer tokens, and a deeper one has more arithmetic
/// per byte. The LM head (hidden × a 32–256 k vocabulary) is saturated
/// from a few hundred tokens while a 0.5 B model's 896-wide projections
/// need tens of thousands. Fitted with [`MFU_MAX`] (see there).
pub const HALF_TOKENS: f64 = 5600.0;
/// See [`HALF_TOKENS`]: a 2,048 × 2,048 weight (Llama-3.2-1B's q and o).
pub const HALF_TOKENS_WEIGHT: f64 = 2048.0 * 2048.0;
/// See [`HALF_TOKENS`].
pub const HALF_TOKENS_EXPONENT: f64 = 1.2;

/// Eager attention's matmuls (`q @ kᵀ` and `probs @ v`, batched over heads
/// with the head dimension as their depth) against the fused kernels'
/// rate: their score traffic is counted in `elementwise`. Fitted to the
/// H100's 36 steps with materialised scores (Gemma 2 eager, Llama eager,
/// Falcon): 0.4 gives median |error| 6.4 %, 0.5 4.5 %, 0.7 7.7 % (before
/// the dispatch time; 3.6 % now).
pub const EAGER_ATTENTION_SPEED: f64 = 0.5;

/// `bf16-mixed` / `fp16-mixed` (autocast over fp32 weights) relative to pure
/// 16-bit weights: the casts of every weight per step and the fp32 optimizer
/// update. H100 table: 0.875 (Llama-3.2-1B full, micro batch 8) and 0.93
/// (Llama-3.1-8B LoRA, micro batch 2); the mean is used. Kept when the
/// element-wise bytes got their own time (fp32 residual traffic under
/// autocast included): all steps' median |error| 6.4 % with 0.9, 7.7 %
/// with 1.0 (before the fp32 attention and the dispatch time).
pub const MIXED_SPEED: f64 = 0.9;

/// A GPU outside the catalog has no fp32 (CUDA-core) figure: its fp32
/// rate is taken as this share of its 16-bit tensor rate (V100 15.7 vs
/// 125 TFLOP/s, T4 8.1 vs 65; H100 SXM 67 vs 989 is lower still).
pub const FP32_FALLBACK_SHARE: f64 = 0.125;

/// QLoRA dequantises every NF4 weight in every forward and backward pass
/// (bitsandbytes kernels), which costs about a third of the step on current
/// GPUs (QLoRA paper, Dettmers et al. 2023, and the PEFT docs report QLoRA
/// slower than LoRA; assumed 0.7 until measured).
pub const QLORA_SPEED: f64 = 0.7;

/// Share of the datasheet fp32 rate (CUDA cores, [`GpuSpec::fp32_tflops`])
/// that the fp32 matmuls of PEFT's QLoRA recipe without autocast reach: the
/// LM head and the attention run in fp32 there (the bitsandbytes linears
/// hand back their fp32 inputs' dtype; PyTorch leaves TF32 off), while the
/// 4-bit linears compute in bf16. From the H200's QLoRA rows
/// (bench/data/h200/qlora.csv): Llama-3.2-1B at 4 × 2,048 took 57.9 µs a
/// token more than LoRA on a bf16 base at the same settings, for 1.86
/// GFLOP a token of head and attention (32 TFLOP/s, 0.48 of 66.9), and
/// Llama-3.1-8B at 2 × 2,048 151 µs for 5.3 GFLOP (35 TFLOP/s, 0.52): their
/// mean. It also holds for PyTorch's math SDPA, which multiplies in fp32
/// too: the 14 Falcon-7B steps on the H100 and H200, not used to choose
/// it, come out within −3 … +7 % (0.6 gives −1 … +16 %). The six QLoRA
/// rows without autocast read −20 … +8 % since their element-wise kernels
/// count in fp32 as well (`elementwise`), against −3 … +102 % with one
/// factor for the whole step (`cargo bench --bench accuracy`, tokens/s).
pub const FP32_MATMUL_EFFICIENCY: f64 = 0.5;

/// Share of the datasheet fp32 rate that an fp32 run's matmuls reach (all
/// of them on the CUDA cores: TF32 is off by default, see
/// `tokens_per_sec`). Its GEMMs are the model's own linears, larger than
/// the QLoRA recipe's per-head attention products, and fill the cores
/// better. Fitted on the four H100 steps of BERT-large fp32 with AdamW
/// (bench/data/h100/families.csv, holdout.csv: 4 × 512, 4 × 512
/// checkpointed, 8 × 512 checkpointed, 16 × 512): 0.6, 0.65, 0.7, 0.75 give
/// a median |error| of 14, 9, 7.5 and 8 % (+10, −14, −1 and −5 % at 0.7;
/// the checkpointed 4 × 512 is held by the dispatch floor).
pub const FP32_RUN_MATMUL_EFFICIENCY: f64 = 0.7;

/// Activation offloading copies every checkpoint to host memory and back
/// over PCIe; torchtune documents it as overlapping with compute "at a small
/// cost" — assumed 0.9 until measured.
pub const OFFLOAD_SPEED: f64 = 0.9;

/// FLOPs of one training token, split into the passes a step runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Flops {
    /// One forward pass, per token.
    pub forward: f64,
    /// The whole step (forward, backward, recomputation), per token.
    pub step: f64,
}

/// Matmul parameters a token passes through: every linear layer of the
/// active experts and the LM head (an embedding lookup is no matmul).
fn matmul_params(a: &ModelArch) -> f64 {
    block_matmuls(a).iter().map(|k| k.0).sum::<f64>() + head_params(a)
}

/// The blocks' matmuls by weight shape, each as (the parameters a token
/// passes through, summed over the blocks and the active experts; one
/// weight's elements): q and o, k and v, the MLP's input projections
/// (gate and up, or fc1) with its output projection.
fn block_matmuls(a: &ModelArch) -> [(f64, f64); 3] {
    let h = a.hidden_size as f64;
    let qd = a.num_attention_heads as f64 * a.head_dim as f64;
    let kvd = a.num_kv_heads as f64 * a.head_dim as f64;
    let i = a.intermediate_size as f64;
    let layers = a.num_layers as f64;
    let active = a.active_experts();
    let mlp_in = if a.gated_mlp { 2.0 } else { 1.0 };
    [
        (layers * 2.0 * h * qd, h * qd),
        (layers * 2.0 * h * kvd, h * kvd),
        (layers * (mlp_in + 1.0) * h * i * active, h * i),
    ]
}

/// The LM head's matmul parameters (hidden × vocabulary).
fn head_params(a: &ModelArch) -> f64 {
    a.vocab_size as f64 * a.hidden_size as f64
}

/// FLOPs per token of a training step (Kaplan et al. 2020, "Scaling Laws",
/// §2.1: 2N per token forward, 4N backward; plus attention's
/// `4 × layers × seq × d_attn` forward, halved for causal fused kernels
/// that skip the masked half). LoRA skips the frozen weights' gradients
/// (≈ one forward less in backward); checkpointing adds one forward
/// of the blocks (not of the LM head, which no framework checkpoints).
pub fn flops_per_token(w: &Workload, s: &EngineeringSettings) -> Flops {
    flops_of(w, s, step_kernels(w, s))
}

/// [`flops_per_token`] with the step's kernels ([`StepKernels`]: whether
/// the attention keeps its scores, which layers pass SDPA a mask) already
/// known.
fn flops_of(w: &Workload, s: &EngineeringSettings, kernels: StepKernels) -> Flops {
    let head = 2.0 * head_params(&w.model);
    let blocks = 2.0 * matmul_params(&w.model) - head;
    let attn = attention_flops(w, kernels);
    let (block_passes, head_passes, attn_passes) = passes(w, s, kernels.scores_kept);
    Flops {
        forward: blocks + head + attn,
        step: block_passes * blocks + head_passes * head + attn_passes * attn,
    }
}

/// Half-saturation tokens per micro batch for a matmul whose weight has
/// `weight` elements (see [`HALF_TOKENS`]).
pub fn half_tokens(weight: f64) -> f64 {
    HALF_TOKENS * (HALF_TOKENS_WEIGHT / weight.max(1.0)).powf(HALF_TOKENS_EXPONENT)
}

/// The matmuls of a step that run in fp32 on the CUDA cores. An fp32 run
/// multiplies there throughout: PyTorch leaves TF32 off for matmuls
/// (`torch.backends.cuda.matmul.allow_tf32` is False by default since
/// 1.12; transformers' Trainer and Lightning keep that default). Measured
/// on an H100 (bench/data/h100/families.csv, holdout.csv): BERT-large fp32
/// at 16 × 512 ran 21,059 tokens/s, 41 TFLOP/s of its ~2 GFLOP a token,
/// 0.62 of the 67 TFLOP/s fp32 line and a sixth of TF32's 495; counted at
/// TF32 the model said 44,304. Beside a 16-bit step: PEFT's QLoRA recipe
/// without autocast (`memory::StepKernels::compute` is fp32 while the
/// training dtype is not) runs the LM head (its forward and its input
/// gradient: the head is frozen) and the attention's score and value
/// products in fp32; PyTorch's math SDPA composite (Falcon's shared K/V
/// head) upcasts 16-bit q, k and v and multiplies in fp32
/// (`memory::StepKernels::math_sdpa`). The adapters are fp32 too, but
/// rank r against the hidden size: left out.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct Fp32Parts {
    /// Every matmul of the step (an fp32 run).
    whole_step: bool,
    head: bool,
    attention: bool,
}

fn fp32_parts(s: &EngineeringSettings, kernels: StepKernels) -> Fp32Parts {
    if s.dtype == Dtype::Fp32 {
        return Fp32Parts {
            whole_step: true,
            head: true,
            attention: true,
        };
    }
    if kernels.compute == Dtype::Fp32 {
        return Fp32Parts {
            whole_step: false,
            head: true,
            attention: true,
        };
    }
    Fp32Parts {
        whole_step: false,
        head: false,
        attention: kernels.math_sdpa,
    }
}

/// How many forward-equivalents of each kind of matmul a step runs: the
/// blocks' weights, the LM head, the attention's products. The backward
/// makes the input gradient (one) and, in a full fine-tune, the weight
/// gradient (one more; adapters over a frozen base have none, their own
/// matmuls are rank r: left out). The attention's two products have two
/// backward products each (two); a fused kernel recomputes the scores
/// in its backward as well (FlashAttention-2: five matmuls against the
/// forward's two, 2.5). Checkpointing recomputes the blocks' forward,
/// not the LM head's: transformers, litgpt and torchtune checkpoint each
/// decoder block.
fn passes(w: &Workload, s: &EngineeringSettings, scores_kept: bool) -> (f64, f64, f64) {
    let ckpt = if s.activation_checkpointing { 1.0 } else { 0.0 };
    let weights = if w.method == Method::Full { 3.0 } else { 2.0 };
    let attention_backward = if scores_kept {
        2.0
    } else {
        FUSED_ATTENTION_BACKWARD
    };
    (weights + ckpt, weights, 1.0 + attention_backward + ckpt)
}

/// The memory-efficient SDPA kernel's rate over the flash kernel's, in
/// the layers that pass it an explicit mask (see
/// [`StepKernels::masked_sdpa_layers`]; their FLOPs already count every
/// block of the scores). It also reads the mask, converted to a 16-bit
/// bias of (batch, 1, seq, seq), for every head. Fitted on the two
/// Mistral-7B-v0.1 configurations measured at its 4,096-token window
/// (bench/data/h100/holdout.csv: LoRA bf16 4 × 4,096 checkpointed, 7,641
/// tokens/s; bench/data/h200/grid.csv and grid_instep.csv: 8 × 4,096
/// checkpointed, 8,090 and 8,126), which the flash kernel put 19 and 24 %
/// too fast. Counting every block alone leaves them 11 and 15 % fast; 0.5,
/// 0.35 and 0.25 give −3 / 0 %, −12 / −10 % and −22 / −21 %.
pub const MASKED_SDPA_SPEED: f64 = 0.5;

/// A fused attention kernel's backward FLOPs over its forward's
/// (FlashAttention-2, Dao 2023, §3.2: the backward recomputes the scores,
/// five matmuls against two).
pub const FUSED_ATTENTION_BACKWARD: f64 = 2.5;

/// FLOPs per token of the step that run as fp32 matmuls (see
/// [`Fp32Parts`]); 0 when none do.
fn fp32_flops(w: &Workload, s: &EngineeringSettings, fp32: Fp32Parts, kernels: StepKernels) -> f64 {
    if fp32.whole_step {
        return flops_of(w, s, kernels).step;
    }
    let (_, head_passes, attn_passes) = passes(w, s, kernels.scores_kept);
    let head = if fp32.head {
        head_passes * 2.0 * head_params(&w.model)
    } else {
        0.0
    };
    let attention = if fp32.attention {
        attn_passes * attention_flops(w, kernels)
    } else {
        0.0
    };
    head + attention
}

/// The tensor cores' utilisation over the step's 16-bit matmuls: each
/// kind (the blocks' projections by weight shape, the LM head, the
/// attention's products) at its own efficiency for `tokens` per micro
/// batch, weighted by its FLOPs: total FLOPs over total time.
fn tensor_utilization(
    w: &Workload,
    s: &EngineeringSettings,
    tokens: f64,
    fp32: Fp32Parts,
    kernels: StepKernels,
) -> f64 {
    let a = &w.model;
    let qd = a.num_attention_heads as f64 * a.head_dim as f64;
    let (block, head, attn) = passes(w, s, kernels.scores_kept);
    let util = |weight: f64| MFU_MAX * tokens / (tokens + half_tokens(weight));
    // (FLOPs per token over the step, the efficiency they run at): the
    // blocks' matmuls, then the head and the attention where they are not
    // fp32
    let [qo, kv, mlp] =
        block_matmuls(a).map(|(params, weight)| (block * 2.0 * params, util(weight)));
    let mut kinds = [qo, kv, mlp, (0.0, 1.0), (0.0, 1.0), (0.0, 1.0)];
    if !fp32.head {
        kinds[3] = (head * 2.0 * head_params(a), util(head_params(a)));
    }
    if !fp32.attention {
        // the fused kernels run at the projections' rate; eager attention's
        // batched products slower (its score traffic is in `elementwise`),
        // and the memory-efficient kernel of the masked layers slower too
        let rate = util(a.hidden_size as f64 * qd);
        let eager = if kernels.scores_kept {
            EAGER_ATTENTION_SPEED
        } else {
            1.0
        };
        let all = attn * attention_flops(w, kernels);
        let masked = attn * masked_attention_flops(w, kernels);
        kinds[4] = (all - masked, rate * eager);
        kinds[5] = (masked, rate * MASKED_SDPA_SPEED);
    }
    let flops: f64 = kinds.iter().map(|k| k.0).sum();
    let time: f64 = kinds.iter().map(|k| k.0 / k.1).sum();
    if time > 0.0 {
        flops / time
    } else {
        0.0
    }
}

/// Attention's forward FLOPs per token (see [`flops_per_token`]): a causal
/// fused kernel skips the masked half of the scores; the layers that pass
/// SDPA a mask ([`StepKernels::masked_sdpa_layers`]) compute all of it.
fn attention_flops(w: &Workload, kernels: StepKernels) -> f64 {
    let a = &w.model;
    let causal = a.kind != ArchKind::EncoderOnly;
    let attn_share = if causal && !kernels.scores_kept {
        0.5
    } else {
        1.0
    };
    let masked = (kernels.masked_sdpa_layers.min(a.num_layers)) as f64;
    attention_flops_per_layer(w) * ((a.num_layers as f64 - masked) * attn_share + masked)
}

/// The part of [`attention_flops`] in the masked layers.
fn masked_attention_flops(w: &Workload, kernels: StepKernels) -> f64 {
    attention_flops_per_layer(w) * kernels.masked_sdpa_layers.min(w.model.num_layers) as f64
}

/// One layer's attention products, forward, per token: `q k^T` and
/// `p v`, 2 × 2 × seq × d_attn.
fn attention_flops_per_layer(w: &Workload) -> f64 {
    let a = &w.model;
    4.0 * w.seq_len as f64 * a.num_attention_heads as f64 * a.head_dim as f64
}

/// Predicted tokens/s of one GPU for the workload and settings.
pub fn tokens_per_sec(w: &Workload, gpu: &GpuSpec, s: &EngineeringSettings) -> f64 {
    let kernels = step_kernels(w, s);
    let step_flops = flops_of(w, s, kernels).step;
    if step_flops <= 0.0 || gpu.bf16_tflops <= 0.0 {
        return 0.0;
    }
    // What runs as fp32 matmuls goes at the fp32 rate (see `Fp32Parts`),
    // the rest at the tensor cores' rate below.
    let parts = fp32_parts(s, kernels);
    let fp32 = if parts.whole_step {
        step_flops
    } else {
        fp32_flops(w, s, parts, kernels).min(step_flops)
    };
    let flops = step_flops - fp32;
    let tokens = s.micro_batch_size as f64 * w.seq_len as f64;
    let util = tensor_utilization(w, s, tokens, parts, kernels);
    let precision = if s.dtype.is_mixed() { MIXED_SPEED } else { 1.0 };
    let qlora = if w.method == Method::Qlora {
        QLORA_SPEED
    } else {
        1.0
    };
    let offload = if s.activation_offloading && s.activation_checkpointing {
        OFFLOAD_SPEED
    } else {
        1.0
    };
    // tokens/s of the forward and backward passes
    let tensor_rate = gpu.bf16_tflops * 1e12 * util * precision * qlora * offload;
    let fp32_rate = if gpu.fp32_tflops > 0.0 {
        gpu.fp32_tflops
    } else {
        gpu.bf16_tflops * FP32_FALLBACK_SHARE
    } * 1e12
        * if parts.whole_step {
            FP32_RUN_MATMUL_EFFICIENCY
        } else {
            FP32_MATMUL_EFFICIENCY
        };

    // The element-wise kernels at the memory bandwidth (a GPU outside the
    // catalog has none: left out, as the optimizer step below).
    let elementwise = if gpu.memory_bandwidth_gbs > 0.0 {
        elementwise::bytes_per_token(w, s, kernels)
            / (gpu.memory_bandwidth_gbs * 1e9 * elementwise::BANDWIDTH_EFFICIENCY)
    } else {
        0.0
    };
    let rate = 1.0 / (flops / tensor_rate + fp32 / fp32_rate + elementwise);
    // The optimizer step runs once per `gradient_accumulation_steps` micro
    // batches (see `optimizer::step_seconds`). It is what makes a full
    // fine-tune's small micro batches slow: Llama-3.1-8B full bf16 at
    // 1 × 512 tokens on the H100 took 342 ms a step, 106 ms predicted
    // without it (bench/data/h100/peaks.csv).
    let accumulation = s.gradient_accumulation_steps.max(1) as f64;
    let optimizer = optimizer::step_seconds(w, s, gpu);
    // A micro batch takes at least the time eager PyTorch needs to
    // dispatch its kernels (see `dispatch::seconds`): the GPU waits for
    // the host below it.
    let micro = (tokens / rate).max(dispatch::seconds(w, s, kernels));
    accumulation * tokens / (accumulation * micro + optimizer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::{lookup_gpu, lookup_model};
    use crate::memory::optimizer_step_bytes;
    use crate::request::{ModelRequest, WorkloadRequest};
    use crate::workload::{Attention, Framework, LoraConfig, LoraTarget, Optimizer};

    /// [`fp32_parts`] of a workload and settings.
    fn parts_of(w: &Workload, st: &EngineeringSettings) -> Fp32Parts {
        fp32_parts(st, step_kernels(w, st))
    }

    /// [`elementwise::bytes_per_token`] of a workload and settings.
    fn ew(w: &Workload, st: &EngineeringSettings) -> f64 {
        elementwise::bytes_per_token(w, st, step_kernels(w, st))
    }

    /// An HF workload of a catalog model (AdamW; LoRA rank 16 on HF's
    /// default targets), resolved as a user's request is; the optimizer's
    /// tests build on it too.
    pub(super) fn w(model: &str, method: Method, seq: u32, attention: Attention) -> Workload {
        WorkloadRequest {
            model: Some(ModelRequest::Catalog(model.to_string())),
            method: Some(method),
            lora_rank: (method != Method::Full).then_some(16),
            seq_len: Some(seq),
            framework: Some(Framework::Hf),
            attention: Some(attention),
            ..WorkloadRequest::default()
        }
        .resolve()
        .unwrap()
    }

    fn s(m: u32, dtype: Dtype, ckpt: bool) -> EngineeringSettings {
        EngineeringSettings {
            micro_batch_size: m,
            dtype,
            activation_checkpointing: ckpt,
            ..EngineeringSettings::default()
        }
    }

    #[test]
    fn full_fine_tune_flops_are_about_six_times_the_parameters() {
        let wl = w(
            "meta-llama/Llama-3.1-8B",
            Method::Full,
            2048,
            Attention::Sdpa,
        );
        let f = flops_per_token(&wl, &s(1, Dtype::Bf16, false));
        let n = wl.model.params as f64;
        assert!((f.step / n - 6.0).abs() < 0.6, "{}", f.step / n);
        // LoRA: no weight gradients of the frozen base, two thirds of it.
        let lora = w(
            "meta-llama/Llama-3.1-8B",
            Method::Lora,
            2048,
            Attention::Sdpa,
        );
        let fl = flops_per_token(&lora, &s(1, Dtype::Bf16, false));
        assert!((fl.step / f.step - 2.0 / 3.0).abs() < 0.05);
        // Checkpointing adds one forward of the blocks: the LM head (a
        // matmul of hidden × vocab) is not recomputed.
        let fc = flops_per_token(&wl, &s(1, Dtype::Bf16, true));
        let head = 2.0 * head_params(&wl.model);
        assert!((fc.step - f.step - (f.forward - head)).abs() < 1.0);
        assert!(head > 0.0 && head < 0.2 * f.forward);
    }

    /// Within 15 % of every measured bf16 point of the H100 table it was
    /// fitted to (checkpointing off), and in the measured order.
    #[test]
    fn predictions_track_the_h100_measurements() {
        let h100 = lookup_gpu("NVIDIA H100 80GB HBM3").unwrap();
        let cases = [
            (
                "meta-llama/Llama-3.2-1B",
                Method::Full,
                2048,
                Attention::Sdpa,
                2,
                37894.9,
            ),
            (
                "meta-llama/Llama-3.2-1B",
                Method::Full,
                2048,
                Attention::Sdpa,
                8,
                46570.3,
            ),
            (
                "meta-llama/Llama-3.1-8B",
                Method::Lora,
                2048,
                Attention::Sdpa,
                1,
                11575.1,
            ),
            (
                "meta-llama/Llama-3.1-8B",
                Method::Lora,
                2048,
                Attention::Sdpa,
                4,
                12509.1,
            ),
            (
                "Qwen/Qwen2.5-7B",
                Method::Lora,
                4096,
                Attention::Sdpa,
                1,
                13115.7,
            ),
            (
                "google/gemma-2-2b",
                Method::Lora,
                2048,
                Attention::Eager,
                2,
                14823.4,
            ),
        ];
        for (model, method, seq, attn, m, measured) in cases {
            let wl = w(model, method, seq, attn);
            let p = tokens_per_sec(&wl, &h100, &s(m, Dtype::Bf16, false));
            let err = (p - measured) / measured;
            assert!(
                err.abs() < 0.15,
                "{model} m {m}: {p:.0} vs {measured} ({err:+.2})"
            );
        }
        // Checkpointing costs throughput; the curve saturates.
        let wl = w(
            "meta-llama/Llama-3.1-8B",
            Method::Lora,
            2048,
            Attention::Sdpa,
        );
        let off2 = tokens_per_sec(&wl, &h100, &s(2, Dtype::Bf16, false));
        let on12 = tokens_per_sec(&wl, &h100, &s(12, Dtype::Bf16, true));
        assert!(off2 > on12, "{off2} vs {on12}: measured 12,272 vs 9,509");
    }

    /// Falcon-7B's SDPA call falls to PyTorch's math composite (one shared
    /// K/V head with an explicit mask), which keeps the scores like eager
    /// attention and upcasts q, k and v to fp32: its products run at the
    /// fp32 rate. Measured on the H100 (bench/data/h100/holdout.csv), LoRA
    /// at 2 × 2,048 checkpointed ran 5,017 tokens/s with "eager" and
    /// 4 × 1,024 ran 4,246 with "sdpa". Predicted at fused-kernel speed the
    /// "sdpa" rows came out 2.6–3.6 times their measurement.
    #[test]
    fn a_math_kernel_sdpa_multiplies_in_fp32() {
        let h100 = lookup_gpu("NVIDIA H100 80GB HBM3").unwrap();
        let settings = s(4, Dtype::Bf16, true);
        let falcon = crate::catalog::arch_from_hf_config(
            "tiiuae__falcon-7b.json",
            include_str!("../../../../bench/data/configs/tiiuae__falcon-7b.json"),
        )
        .unwrap();
        let with = |attention| Workload {
            model: falcon.clone(),
            lora: Some(LoraConfig {
                rank: 16,
                targets: vec![LoraTarget::Q, LoraTarget::K, LoraTarget::V],
            }),
            ..w("meta-llama/Llama-3.1-8B", Method::Lora, 1024, attention)
        };
        let sdpa = with(Attention::Sdpa);
        let eager = with(Attention::Eager);
        assert_eq!(
            parts_of(&sdpa, &settings),
            Fp32Parts {
                whole_step: false,
                head: false,
                attention: true
            }
        );
        assert_eq!(parts_of(&eager, &settings), Fp32Parts::default());
        let p_sdpa = tokens_per_sec(&sdpa, &h100, &settings);
        // eager multiplies in bf16: faster at the same settings
        assert!(tokens_per_sec(&eager, &h100, &settings) > 1.2 * p_sdpa);
        let err = (p_sdpa - 4245.8) / 4245.8;
        assert!(
            err.abs() < 0.15,
            "{p_sdpa:.0} vs 4,246 measured ({err:+.2})"
        );
        let eager_2k = Workload {
            seq_len: 2048,
            ..eager.clone()
        };
        let p_eager = tokens_per_sec(&eager_2k, &h100, &s(2, Dtype::Bf16, true));
        let err = (p_eager - 5017.0) / 5017.0;
        assert!(
            err.abs() < 0.15,
            "{p_eager:.0} vs 5,017 measured ({err:+.2})"
        );
        // a model whose SDPA call keeps the fused kernel is unaffected
        let llama = w(
            "meta-llama/Llama-3.1-8B",
            Method::Lora,
            1024,
            Attention::Sdpa,
        );
        let llama_eager = w(
            "meta-llama/Llama-3.1-8B",
            Method::Lora,
            1024,
            Attention::Eager,
        );
        assert!(
            tokens_per_sec(&llama, &h100, &settings)
                > tokens_per_sec(&llama_eager, &h100, &settings)
        );
    }

    /// A full fine-tune's optimizer step is a pass of element-wise kernels
    /// over the model state at the memory bandwidth, once per optimizer
    /// step: Llama-3.1-8B full bf16 at 1 × 512 tokens, checkpointed, ran
    /// 1,497 tokens/s on the H100 (342 ms a step; bench/data/h100/peaks.csv),
    /// which the FLOPs alone put at 4,844.
    #[test]
    fn the_optimizer_step_runs_at_the_memory_bandwidth_once_per_accumulation() {
        let h100 = lookup_gpu("NVIDIA H100 80GB HBM3").unwrap();
        let wl = w(
            "meta-llama/Llama-3.1-8B",
            Method::Full,
            512,
            Attention::Sdpa,
        );
        let one = s(1, Dtype::Bf16, true);
        let p = tokens_per_sec(&wl, &h100, &one);
        // The FLOPs alone: 4,844 tokens/s (+224 %). With the step: +66 %;
        // with the host's dispatch time, which 512 tokens cannot hide
        // (`dispatch::seconds`), the rest.
        let err = (p - 1497.0) / 1497.0;
        assert!(err.abs() < 0.15, "{p:.0} vs 1,497 measured ({err:+.2})");
        // 42 bytes per bf16 parameter for foreach AdamW
        let bytes = optimizer_step_bytes(&wl, &one);
        let per_param = bytes / wl.model.params as f64;
        assert!((per_param - 42.0).abs() < 0.5, "{per_param}");
        // accumulation amortises the step
        let accum = EngineeringSettings {
            gradient_accumulation_steps: 8,
            ..one.clone()
        };
        // (each micro batch still pays its dispatch time)
        assert!(tokens_per_sec(&wl, &h100, &accum) > 1.25 * p);
        // without a known bandwidth the step is left out (FLOPs and
        // dispatch only)
        let unknown = GpuSpec {
            memory_bandwidth_gbs: 0.0,
            ..h100.clone()
        };
        assert!(tokens_per_sec(&wl, &unknown, &one) > 1.25 * p);
        // LoRA's adapters are a few MB: the step costs next to nothing
        let lora = w(
            "meta-llama/Llama-3.1-8B",
            Method::Lora,
            512,
            Attention::Sdpa,
        );
        let with = tokens_per_sec(&lora, &h100, &one);
        let without = tokens_per_sec(&lora, &unknown, &one);
        assert!(with > 0.99 * without && with <= without);
    }

    /// PEFT's QLoRA recipe without autocast runs its head and attention as
    /// fp32 matmuls: measured on an H200 (bench/data/h200/qlora.csv),
    /// tokens/s within 25 % of the prediction (−15 % and −20 % since its
    /// element-wise kernels count in fp32 too), and autocast faster, as
    /// measured (3.4× for Llama-3.2-1B).
    #[test]
    fn qlora_without_autocast_runs_its_head_and_attention_at_the_fp32_rate() {
        let h200 = lookup_gpu("NVIDIA H200").unwrap();
        for (model, m, measured) in [
            ("meta-llama/Llama-3.2-1B", 4, 13_175.0),
            ("meta-llama/Llama-3.1-8B", 2, 4_348.0),
        ] {
            let q = w(model, Method::Qlora, 2048, Attention::Sdpa);
            let plain = tokens_per_sec(&q, &h200, &s(m, Dtype::Bf16, false));
            let err = plain / measured - 1.0;
            assert!(err.abs() < 0.25, "{model}: {plain:.0} against {measured}");
            let plain_settings = s(m, Dtype::Bf16, false);
            let parts = parts_of(&q, &plain_settings);
            assert!(parts.head && parts.attention);
            assert!(
                fp32_flops(
                    &q,
                    &plain_settings,
                    parts,
                    step_kernels(&q, &plain_settings)
                ) > 0.0
            );
            // under autocast everything is on the tensor cores
            let mixed = s(m, Dtype::Bf16Mixed, false);
            assert_eq!(parts_of(&q, &mixed), Fp32Parts::default());
            assert!(tokens_per_sec(&q, &h200, &mixed) > 1.5 * plain, "{model}");
            // LoRA on a bf16 base has no fp32 part
            let l = w(model, Method::Lora, 2048, Attention::Sdpa);
            assert_eq!(
                parts_of(&l, &s(m, Dtype::Bf16, false)),
                Fp32Parts::default()
            );
        }
        // A GPU with no fp32 figure falls back to a share of its bf16 rate
        // instead of dividing by zero.
        let q = w(
            "meta-llama/Llama-3.2-1B",
            Method::Qlora,
            2048,
            Attention::Sdpa,
        );
        let unknown = GpuSpec {
            fp32_tflops: 0.0,
            ..h200.clone()
        };
        let t = tokens_per_sec(&q, &unknown, &s(4, Dtype::Bf16, false));
        assert!(t.is_finite() && t > 0.0);
    }

    /// An fp32 run multiplies on the CUDA cores (PyTorch leaves TF32 off):
    /// BERT-large fp32 at 16 × 512 on the H100 ran 21,059 tokens/s
    /// (bench/data/h100/families.csv), which TF32's rate put at 44,304.
    /// The same step in bf16 is several times faster, not twice.
    #[test]
    fn fp32_runs_multiply_on_the_cuda_cores() {
        let h100 = lookup_gpu("NVIDIA H100 80GB HBM3").unwrap();
        let bert = Workload {
            optimizer: Optimizer::Adamw,
            ..w("bert-large-uncased", Method::Full, 512, Attention::Sdpa)
        };
        let fp32 = tokens_per_sec(&bert, &h100, &s(16, Dtype::Fp32, false));
        assert!((fp32 / 21_059.0 - 1.0).abs() < 0.15, "{fp32:.0}");
        let bf16 = tokens_per_sec(&bert, &h100, &s(16, Dtype::Bf16, false));
        assert!(bf16 > 3.0 * fp32, "bf16 {bf16:.0} against fp32 {fp32:.0}");
        // every FLOP of the run is an fp32 FLOP, at the run's own efficiency
        let per_token = flops_per_token(&bert, &s(16, Dtype::Fp32, false)).step;
        let matmul_only = h100.fp32_tflops * 1e12 * FP32_RUN_MATMUL_EFFICIENCY / per_token;
        assert!(fp32 < matmul_only, "{fp32:.0} against {matmul_only:.0}");
        assert!(
            fp32 > 0.7 * matmul_only,
            "{fp32:.0} against {matmul_only:.0}"
        );
    }

    /// From a sequence that reaches the model's sliding window, transformers
    /// hands SDPA a mask and PyTorch runs the memory-efficient kernel over
    /// every block of the scores: Mistral-7B-v0.1 (window 4,096) LoRA bf16 at
    /// 4 × 4,096 checkpointed ran 7,641 tokens/s on the H100
    /// (bench/data/h100/holdout.csv), 19 % below the flash kernel's figure.
    #[test]
    fn a_reached_sliding_window_runs_the_masked_kernel() {
        let h100 = lookup_gpu("NVIDIA H100 80GB HBM3").unwrap();
        let st = s(4, Dtype::Bf16, true);
        let v01 = w(
            "mistralai/Mistral-7B-v0.1",
            Method::Lora,
            4096,
            Attention::Sdpa,
        );
        let v03 = w(
            "mistralai/Mistral-7B-v0.3",
            Method::Lora,
            4096,
            Attention::Sdpa,
        );
        assert_eq!(step_kernels(&v01, &st).masked_sdpa_layers, 32);
        assert_eq!(step_kernels(&v03, &st).masked_sdpa_layers, 0);
        let t = tokens_per_sec(&v01, &h100, &st);
        assert!((t / 7_641.0 - 1.0).abs() < 0.1, "{t:.0}");
        assert!(t < 0.9 * tokens_per_sec(&v03, &h100, &st));
        // below the window the two are the same model
        let short = |id| w(id, Method::Lora, 4095, Attention::Sdpa);
        assert_eq!(
            step_kernels(&short("mistralai/Mistral-7B-v0.1"), &st).masked_sdpa_layers,
            0
        );
        let mut unwindowed = short("mistralai/Mistral-7B-v0.1");
        unwindowed.model.quirks.sliding_window = 0;
        assert_eq!(
            tokens_per_sec(&short("mistralai/Mistral-7B-v0.1"), &h100, &st),
            tokens_per_sec(&unwindowed, &h100, &st)
        );
        // Gemma 2: every other layer; eager attention keeps its scores instead
        let gemma = w("google/gemma-2-2b", Method::Lora, 4096, Attention::Sdpa);
        assert_eq!(step_kernels(&gemma, &st).masked_sdpa_layers, 13);
        let eager = w("google/gemma-2-2b", Method::Lora, 4096, Attention::Eager);
        assert_eq!(step_kernels(&eager, &st).masked_sdpa_layers, 0);
        // litgpt builds its own mask: not transformers' switch
        let litgpt = Workload {
            framework: Framework::Litgpt,
            ..v01.clone()
        };
        assert_eq!(step_kernels(&litgpt, &st).masked_sdpa_layers, 0);
    }

    /// A 0.5 B model spends its step in element-wise kernels and in
    /// matmuls too narrow to fill the GPU: measured on the H100
    /// (bench/data/h100/families.csv), Qwen2.5-0.5B full bf16 at 4 × 1,024
    /// ran 39,043 tokens/s, which one efficiency curve in the hidden size
    /// put 26 % lower. Its element-wise bytes weigh more against its
    /// FLOPs than Llama-3.1-8B's.
    #[test]
    fn small_models_spend_their_step_in_element_wise_kernels() {
        let h100 = lookup_gpu("NVIDIA H100 80GB HBM3").unwrap();
        let st = s(4, Dtype::Bf16, false);
        let small = w("Qwen/Qwen2.5-0.5B", Method::Full, 1024, Attention::Sdpa);
        let large = w(
            "meta-llama/Llama-3.1-8B",
            Method::Full,
            1024,
            Attention::Sdpa,
        );
        let share = |wl: &Workload| ew(wl, &st) / flops_per_token(wl, &st).step;
        assert!(
            share(&small) > 2.0 * share(&large),
            "{} vs {}",
            share(&small),
            share(&large)
        );
        let p = tokens_per_sec(&small, &h100, &st);
        let err = (p - 39_043.0) / 39_043.0;
        assert!(err.abs() < 0.15, "{p:.0} vs 39,043 measured ({err:+.2})");
        // LoRA adds its adapters' sums; Gemma 2's four norms a block weigh
        // more than two
        let lora = w("Qwen/Qwen2.5-0.5B", Method::Lora, 1024, Attention::Sdpa);
        let lora_frozen = Workload {
            lora: None,
            ..lora.clone()
        };
        assert!(ew(&lora, &st) > ew(&lora_frozen, &st));
        // compiled, the fused chains move about a third of the bytes
        let compiled = EngineeringSettings {
            compile: true,
            ..st.clone()
        };
        let ratio = ew(&small, &compiled) / ew(&small, &st);
        assert!((ratio - elementwise::COMPILE_ELEMENTWISE_SHARE).abs() < 1e-9);
    }

    /// The LM head's weight (hidden × vocabulary) fills the GPU with a few
    /// hundred tokens; a 896-wide projection needs tens of thousands.
    #[test]
    fn a_matmul_fills_the_gpu_with_fewer_tokens_the_larger_its_weight() {
        let qwen = lookup_model("Qwen/Qwen2.5-0.5B").unwrap().arch;
        let h = qwen.hidden_size as f64;
        let head = half_tokens(head_params(&qwen));
        let proj = half_tokens(h * h);
        assert!(head < 200.0, "{head}");
        assert!(proj > 10_000.0, "{proj}");
        assert!((half_tokens(HALF_TOKENS_WEIGHT) - HALF_TOKENS).abs() < 1e-9);
        // monotone in the weight
        let mut last = f64::INFINITY;
        for side in [256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0] {
            let t = half_tokens(side * side);
            assert!(t < last);
            last = t;
        }
    }

    /// With few tokens a micro batch takes the host's dispatch time, not
    /// the GPU's: Llama-3.2-1B full bf16 at 1 × 512 on the H100 measured
    /// 5,141–7,064 tokens/s over five runs (bench/data/h100/): 4.5–6.2 ms
    /// a block a step, where its matmuls take about 0.6 ms (the model
    /// without the floor said 9,694). Compiled steps have no such floor.
    #[test]
    fn the_host_dispatch_time_bounds_small_micro_batches() {
        let h100 = lookup_gpu("NVIDIA H100 80GB HBM3").unwrap();
        let wl = w(
            "meta-llama/Llama-3.2-1B",
            Method::Full,
            512,
            Attention::Sdpa,
        );
        let one = s(1, Dtype::Bf16, false);
        let p = tokens_per_sec(&wl, &h100, &one);
        assert!((5_141.0 * 0.9..7_064.0 * 1.1).contains(&p), "{p:.0}");
        let dispatch_seconds = |wl: &Workload, st: &EngineeringSettings| {
            dispatch::seconds(wl, st, step_kernels(wl, st))
        };
        let d = dispatch_seconds(&wl, &one);
        // a Llama block's forward is 51 operations (`dispatch::ops_per_block`)
        assert!((d - 16.0 * 3.0 * 51.0 * dispatch::DISPATCH_PER_OP_S).abs() < 1e-12);
        // checkpointing adds a pass and its bookkeeping
        let ckpt = s(1, Dtype::Bf16, true);
        assert!(dispatch_seconds(&wl, &ckpt) > d * 4.0 / 3.0);
        // compiled: no floor, and faster
        let compiled = EngineeringSettings {
            compile: true,
            ..one.clone()
        };
        assert_eq!(dispatch_seconds(&wl, &compiled), 0.0);
        assert!(tokens_per_sec(&wl, &h100, &compiled) > p);
        // a large micro batch is the GPU's: the floor does not bind
        let big = s(8, Dtype::Bf16, false);
        let wl2k = Workload {
            seq_len: 2048,
            ..wl.clone()
        };
        let tokens = 8.0 * 2048.0;
        assert!(tokens / tokens_per_sec(&wl2k, &h100, &big) > 1.2 * dispatch_seconds(&wl2k, &big));
    }

    /// The host's time follows the operations each family's eager block
    /// issues: GPT-NeoX's fused LayerNorms and GELU against Llama's Python
    /// RMSNorm and rotary, Gemma 2's four fp32-scaled norms above both.
    /// Measured on the H200 (bench/data/h200/grid.csv): Pythia-1.4B full
    /// bf16 at 2 × 1,024 ran 27,562 tokens/s, which one time a block for
    /// every family put at 18,090.
    #[test]
    fn dispatch_follows_each_familys_operations() {
        // Pythia is read from the config.json the measurement built it from
        let pythia_arch = crate::catalog::arch_from_hf_config(
            "EleutherAI/pythia-1.4b",
            include_str!("../../../../bench/data/configs/EleutherAI__pythia-1.4b.json"),
        )
        .unwrap();
        let model = |id: &str, method: Method, attention: Attention| {
            if id == "EleutherAI/pythia-1.4b" {
                Workload {
                    model: pythia_arch.clone(),
                    ..w("meta-llama/Llama-3.2-1B", method, 1024, attention)
                }
            } else {
                w(id, method, 1024, attention)
            }
        };
        let ops = |id: &str, method: Method, attention: Attention, dtype: Dtype| {
            let wl = model(id, method, attention);
            let st = s(1, dtype, false);
            dispatch::ops_per_block(&wl, &st, step_kernels(&wl, &st))
        };
        let llama = ops(
            "meta-llama/Llama-3.2-1B",
            Method::Full,
            Attention::Sdpa,
            Dtype::Bf16,
        );
        let pythia = ops(
            "EleutherAI/pythia-1.4b",
            Method::Full,
            Attention::Sdpa,
            Dtype::Bf16,
        );
        let gemma = ops(
            "google/gemma-2-2b",
            Method::Full,
            Attention::Eager,
            Dtype::Bf16,
        );
        assert_eq!(llama, 51.0);
        assert!(
            pythia < 0.8 * llama && gemma > 1.4 * llama,
            "{pythia} {llama} {gemma}"
        );
        // autocast casts every weight; adapters add their own operations
        assert!(
            ops(
                "meta-llama/Llama-3.2-1B",
                Method::Full,
                Attention::Sdpa,
                Dtype::Bf16Mixed
            ) > llama
        );
        assert!(
            ops(
                "meta-llama/Llama-3.2-1B",
                Method::Lora,
                Attention::Sdpa,
                Dtype::Bf16
            ) > llama
        );
        let h200 = lookup_gpu("NVIDIA H200").unwrap();
        let p = tokens_per_sec(
            &model("EleutherAI/pythia-1.4b", Method::Full, Attention::Sdpa),
            &h200,
            &s(2, Dtype::Bf16, false),
        );
        assert!((p / 27_562.0 - 1.0).abs() < 0.2, "{p:.0}");
    }

    /// Over the whole catalog (every model, GPU, method, precision,
    /// checkpointing, compile, micro batch and sequence length): a finite,
    /// positive prediction; compiling never slower, checkpointing never
    /// faster, and a larger micro batch never fewer tokens/s.
    #[test]
    fn predictions_are_finite_and_ordered_over_the_catalog() {
        use crate::catalog::{all_gpus, all_models};
        let gpus = all_gpus();
        let mut checked = 0;
        for model in all_models() {
            for method in [Method::Full, Method::Lora, Method::Qlora] {
                for attention in [Attention::Sdpa, Attention::Eager] {
                    for seq in [512, 4096] {
                        let wl = Workload {
                            model: model.clone(),
                            ..w("meta-llama/Llama-3.2-1B", method, seq, attention)
                        };
                        for gpu in &gpus {
                            for dtype in [Dtype::Bf16, Dtype::Bf16Mixed, Dtype::Fp32] {
                                let mut last = 0.0;
                                for m in [1, 4, 32] {
                                    let plain = s(m, dtype, false);
                                    let p = tokens_per_sec(&wl, gpu, &plain);
                                    let ctx = format!(
                                        "{} {method:?} {attention:?} {seq} {} {dtype:?} m{m}",
                                        model.name, gpu.name
                                    );
                                    assert!(p.is_finite() && p > 0.0, "{ctx}: {p}");
                                    assert!(p >= last * (1.0 - 1e-9), "{ctx}: {p} < {last}");
                                    last = p;
                                    let ckpt = tokens_per_sec(&wl, gpu, &s(m, dtype, true));
                                    assert!(
                                        ckpt <= p * (1.0 + 1e-9),
                                        "{ctx}: checkpointed {ckpt} > {p}"
                                    );
                                    let compiled = EngineeringSettings {
                                        compile: true,
                                        ..plain.clone()
                                    };
                                    let c = tokens_per_sec(&wl, gpu, &compiled);
                                    assert!(c >= p * (1.0 - 1e-9), "{ctx}: compiled {c} < {p}");
                                    checked += 1;
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(checked > 1000, "{checked}");
    }
}
