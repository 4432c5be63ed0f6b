//! The throughput model: predicted training tokens/s of a step, from the
//! workload's FLOPs per token, the GPU's dense tensor throughput and an
//! efficiency curve in tokens per micro batch. It ranks candidate settings
//! where nothing is measured; measured tokens/s from the history calibrate
//! it (the advisor does that) and replace it where a setting ran.
//!
//! Pure arithmetic, no I/O. Every constant says where it comes from; the
//! ones fitted to `bench/data/h100/throughput.csv` (a real H100, HF training
//! loop, see its README) say so.

use crate::core::catalog::GpuSpec;
use crate::core::memory::{attention_materializes_scores, compute_dtype, optimizer_step_bytes};
use crate::core::settings::{Dtype, EngineeringSettings};
use crate::core::workload::{ArchKind, Method, ModelArch, Workload};

/// Best model-FLOPs utilisation a large micro batch reaches with fused
/// (SDPA/flash) attention in bf16. Fitted to the H100 table: the saturating
/// curve's asymptote gives 40 % (Llama-3.2-1B full), 43 % (Llama-3.1-8B
/// LoRA) and 46 % (Qwen2.5-7B LoRA) of the 989 TFLOP/s dense bf16 peak;
/// the median is used. (Megatron-LM reports 40–55 % on A100/H100 for
/// larger, tuned runs, Narayanan et al. 2021.)
pub const MFU_MAX: f64 = 0.43;

/// Tokens per micro batch at which a step reaches half of [`MFU_MAX`], for a
/// model of hidden size [`HALF_TOKENS_HIDDEN`]; it shrinks with the hidden
/// size to the power [`HALF_TOKENS_EXPONENT`] (larger GEMMs fill the GPU
/// with fewer rows). Fitted to the H100 table: 1,590 tokens at hidden 2048
/// (Llama-3.2-1B), 960 at 2304 (gemma-2-2b), 330 at 3584 (Qwen2.5-7B), 230
/// at 4096 (Llama-3.1-8B) — `1600 × (2048 / h)^2.8` is within 20 % of each.
pub const HALF_TOKENS: f64 = 1600.0;
/// See [`HALF_TOKENS`].
pub const HALF_TOKENS_HIDDEN: f64 = 2048.0;
/// See [`HALF_TOKENS`].
pub const HALF_TOKENS_EXPONENT: f64 = 2.8;

/// Eager attention materialises the score matrices and runs the softmax
/// unfused: gemma-2-2b (eager, as its soft-capping requires) reached 21 %
/// MFU against 40–46 % for SDPA models in the H100 table.
pub const EAGER_ATTENTION_SPEED: f64 = 0.5;

/// `bf16-mixed` / `fp16-mixed` (autocast over fp32 weights) relative to pure
/// 16-bit weights: the casts of every weight per step and the fp32 optimizer
/// update. H100 table: 0.875 (Llama-3.2-1B full, micro batch 8) and 0.93
/// (Llama-3.1-8B LoRA, micro batch 2); the mean is used.
pub const MIXED_SPEED: f64 = 0.9;

/// fp32 (TF32 tensor cores) relative to bf16: half the dense tensor
/// throughput on A100/H100 datasheets (156 vs 312, 495 vs 989 TFLOP/s).
pub const FP32_SPEED_TF32: f64 = 0.5;
/// fp32 without TF32 (pre-Ampere: V100 15.7 vs 125 TFLOP/s, T4 8.1 vs 65).
pub const FP32_SPEED_NO_TF32: f64 = 0.125;

/// `torch.compile` speed-up on training steps: +21 % to +44 % measured on
/// the H100 (`bench/data/h100/compile_accum.csv`: Llama-3.2-1B full and
/// Llama-3.1-8B LoRA); the lower end is used until a workload's own
/// compiled runs say more.
pub const COMPILE_SPEED: f64 = 1.2;

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
/// mean. With it the six QLoRA rows without autocast are within −11 … +16 %
/// (median |error| 9 %) where one factor for the whole step gave −3 …
/// +102 % (`cargo bench --bench accuracy`, tokens/s).
pub const FP32_MATMUL_EFFICIENCY: f64 = 0.5;

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
    let h = a.hidden_size as f64;
    let qd = a.num_attention_heads as f64 * a.head_dim as f64;
    let kvd = a.num_kv_heads as f64 * a.head_dim as f64;
    let attn = h * qd + 2.0 * h * kvd + qd * h;
    let i = a.intermediate_size as f64;
    let mlp_one = if a.gated_mlp {
        3.0 * h * i
    } else {
        2.0 * h * i
    };
    let active = a.experts_per_token.max(1).min(a.num_experts.max(1)) as f64;
    let per_layer = attn + mlp_one * active;
    a.num_layers as f64 * per_layer + head_params(a)
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
    flops_of(w, s, attention_materializes_scores(w, s))
}

/// [`flops_per_token`] with whether the attention keeps its scores
/// (`memory::attention_materializes_scores`) already known.
fn flops_of(w: &Workload, s: &EngineeringSettings, scores_kept: bool) -> Flops {
    let dense = 2.0 * matmul_params(&w.model);
    let attn = attention_flops(w, scores_kept);
    let forward = dense + attn;
    // Backward: input gradients (≈ one forward) plus weight gradients (≈ one
    // forward of the trainable weights; LoRA adapters are negligible).
    let backward = match w.method {
        Method::Full => 2.0 * forward,
        Method::Lora | Method::Qlora => forward + attn,
    };
    // Checkpointing recomputes the blocks' forward, not the LM head's:
    // transformers, litgpt and torchtune checkpoint each decoder block.
    let recompute = if s.activation_checkpointing {
        forward - 2.0 * head_params(&w.model)
    } else {
        0.0
    };
    Flops {
        forward,
        step: forward + backward + recompute,
    }
}

/// Half-saturation tokens per micro batch for a hidden size (see [`HALF_TOKENS`]).
pub fn half_tokens(hidden: u32) -> f64 {
    HALF_TOKENS * (HALF_TOKENS_HIDDEN / hidden.max(1) as f64).powf(HALF_TOKENS_EXPONENT)
}

/// FLOPs per token of the step that run as fp32 matmuls beside a 16-bit
/// base: PEFT's QLoRA recipe without autocast (`memory::compute_dtype` is
/// fp32 while the training dtype is not) runs the LM head (its forward and
/// its input gradient: the head is frozen) and the attention's score and
/// value products (forward, the two products of each in backward, and the
/// recomputed forward) in fp32. The adapters are fp32 too, but rank r
/// against the hidden size: left out. 0 otherwise.
fn fp32_flops(w: &Workload, s: &EngineeringSettings, scores_kept: bool) -> f64 {
    if compute_dtype(w, s) != Dtype::Fp32 || s.dtype == Dtype::Fp32 {
        return 0.0;
    }
    let head = 2.0 * head_params(&w.model);
    let passes = if s.activation_checkpointing { 4.0 } else { 3.0 };
    2.0 * head + passes * attention_flops(w, scores_kept)
}

/// Attention's forward FLOPs per token (see [`flops_per_token`]).
fn attention_flops(w: &Workload, scores_kept: bool) -> f64 {
    let a = &w.model;
    let d_attn = a.num_attention_heads as f64 * a.head_dim as f64;
    let causal = a.kind != ArchKind::EncoderOnly;
    let attn_share = if causal && !scores_kept { 0.5 } else { 1.0 };
    4.0 * a.num_layers as f64 * w.seq_len as f64 * d_attn * attn_share
}

/// Predicted tokens/s of one GPU for the workload and settings.
pub fn tokens_per_sec(w: &Workload, gpu: &GpuSpec, s: &EngineeringSettings) -> f64 {
    let scores_kept = attention_materializes_scores(w, s);
    let step_flops = flops_of(w, s, scores_kept).step;
    if step_flops <= 0.0 || gpu.bf16_tflops <= 0.0 {
        return 0.0;
    }
    // What runs as fp32 matmuls goes at the fp32 rate (see `fp32_flops`),
    // the rest at the tensor cores' rate below.
    let fp32 = fp32_flops(w, s, scores_kept).min(step_flops);
    let flops = step_flops - fp32;
    let tokens = s.micro_batch_size as f64 * w.seq_len as f64;
    let util = MFU_MAX * tokens / (tokens + half_tokens(w.model.hidden_size));
    let precision = match s.dtype {
        Dtype::Fp32 if gpu.bf16 => FP32_SPEED_TF32,
        Dtype::Fp32 => FP32_SPEED_NO_TF32,
        Dtype::Bf16Mixed | Dtype::Fp16Mixed => MIXED_SPEED,
        Dtype::Bf16 | Dtype::Fp16 => 1.0,
    };
    // Scores kept by fp32 attention beside a 16-bit base are in `fp32`.
    let attention = if scores_kept && fp32 == 0.0 {
        EAGER_ATTENTION_SPEED
    } else {
        1.0
    };
    let qlora = if w.method == Method::Qlora {
        QLORA_SPEED
    } else {
        1.0
    };
    let compile = if s.compile { COMPILE_SPEED } else { 1.0 };
    let offload = if s.activation_offloading && s.activation_checkpointing {
        OFFLOAD_SPEED
    } else {
        1.0
    };
    // tokens/s of the forward and backward passes
    let tensor_rate =
        gpu.bf16_tflops * 1e12 * util * precision * attention * qlora * compile * offload;
    let fp32_rate = if gpu.fp32_tflops > 0.0 {
        gpu.fp32_tflops
    } else {
        gpu.bf16_tflops * FP32_SPEED_NO_TF32
    } * 1e12
        * FP32_MATMUL_EFFICIENCY;
    let rate = 1.0 / (flops / tensor_rate + fp32 / fp32_rate);
    // The optimizer step runs once per `gradient_accumulation_steps` micro
    // batches; its element-wise kernels move `optimizer_step_bytes` at the
    // memory bandwidth (datasheet; a GPU outside the catalog has none and
    // the step is left out). It is what makes a full fine-tune's small
    // micro batches slow: Llama-3.1-8B full bf16 at 1 × 512 tokens on the
    // H100 took 342 ms a step, 106 ms predicted without it
    // (bench/data/h100/peaks.csv).
    let step_tokens = tokens * s.gradient_accumulation_steps.max(1) as f64;
    let optimizer = if gpu.memory_bandwidth_gbs > 0.0 {
        optimizer_step_bytes(w, s) / (gpu.memory_bandwidth_gbs * 1e9)
    } else {
        0.0
    };
    step_tokens / (step_tokens / rate + optimizer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::catalog::{lookup_gpu, lookup_model};
    use crate::core::workload::{
        Attention, Framework, LoraConfig, LoraTarget, Optimizer, Sharding,
    };

    fn w(model: &str, method: Method, seq: u32, attention: Attention) -> Workload {
        Workload {
            model: lookup_model(model).unwrap().arch,
            method,
            lora: (method != Method::Full).then(|| LoraConfig {
                rank: 16,
                targets: crate::core::memory::default_lora_targets(Framework::Hf),
            }),
            seq_len: seq,
            optimizer: Optimizer::Adamw,
            global_batch: None,
            gpus: 1,
            sharding: Sharding::None,
            framework: Framework::Hf,
            attention,
        }
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
    /// K/V head with an explicit mask), which computes the scores like
    /// eager attention: measured on the H100 (bench/data/h100/holdout.csv),
    /// LoRA at 2 × 2,048 checkpointed ran 5,017 tokens/s with "eager" and
    /// 4 × 1,024 ran 4,246 with "sdpa". Predicted at fused-kernel speed the
    /// "sdpa" rows came out 2.6–3.6 times their measurement.
    #[test]
    fn a_math_kernel_sdpa_runs_at_eager_speed() {
        let h100 = lookup_gpu("NVIDIA H100 80GB HBM3").unwrap();
        let settings = s(4, Dtype::Bf16, true);
        let falcon = crate::core::catalog::arch_from_hf_config(
            "tiiuae__falcon-7b.json",
            include_str!("../../bench/data/configs/tiiuae__falcon-7b.json"),
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
        let p_sdpa = tokens_per_sec(&sdpa, &h100, &settings);
        assert_eq!(p_sdpa, tokens_per_sec(&eager, &h100, &settings));
        let err = (p_sdpa - 4245.8) / 4245.8;
        assert!(
            err.abs() < 0.35,
            "{p_sdpa:.0} vs 4,246 measured ({err:+.2})"
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
        // the rest is per-step overhead (kernel launches, Python) that the
        // model does not count.
        let err = (p - 1497.0) / 1497.0;
        assert!(
            err > 0.0 && err < 0.7,
            "{p:.0} vs 1,497 measured ({err:+.2})"
        );
        // 42 bytes per bf16 parameter for foreach AdamW
        let bytes = optimizer_step_bytes(&wl, &one);
        let per_param = bytes / wl.model.params as f64;
        assert!((per_param - 42.0).abs() < 0.5, "{per_param}");
        // accumulation amortises the step
        let accum = EngineeringSettings {
            gradient_accumulation_steps: 8,
            ..one.clone()
        };
        assert!(tokens_per_sec(&wl, &h100, &accum) > 1.5 * p);
        // without a known bandwidth the step is left out (FLOPs only)
        let unknown = GpuSpec {
            memory_bandwidth_gbs: 0.0,
            ..h100.clone()
        };
        assert!(tokens_per_sec(&wl, &unknown, &one) > 1.5 * p);
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
    /// tokens/s within 15 % of the prediction, and autocast faster, as
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
            assert!(err.abs() < 0.15, "{model}: {plain:.0} against {measured}");
            assert!(fp32_flops(&q, &s(m, Dtype::Bf16, false), true) > 0.0);
            // under autocast everything is on the tensor cores
            let mixed = s(m, Dtype::Bf16Mixed, false);
            assert_eq!(fp32_flops(&q, &mixed, false), 0.0);
            assert!(tokens_per_sec(&q, &h200, &mixed) > 1.5 * plain, "{model}");
            // LoRA on a bf16 base has no fp32 part
            let l = w(model, Method::Lora, 2048, Attention::Sdpa);
            assert_eq!(fp32_flops(&l, &s(m, Dtype::Bf16, false), false), 0.0);
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
}
