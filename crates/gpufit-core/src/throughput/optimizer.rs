//! The optimizer step's time: its element-wise kernels at the memory
//! bandwidth, or the host's time to launch them where the optimizer loops
//! over the parameters in Python, whichever is longer (the GPU cannot run
//! ahead of the launches).

use crate::catalog::GpuSpec;
use crate::memory::optimizer_step_bytes;
use crate::settings::EngineeringSettings;
use crate::workload::{ArchKind, LoraTarget, Method, Optimizer, Workload};

/// Host time of one tensor operation an optimizer issues from Python, in
/// seconds (the call, the dispatcher, the kernel launch; no autograd:
/// optimizers step under `no_grad`). Measured on an H100
/// (bench/data/h100/families.csv): BERT-large fp32 at 4 × 512 took 220.2 ms
/// a step with transformers' Adafactor and 120.3 ms with torch's foreach
/// AdamW, whose step the model puts at 8 ms of bandwidth; Adafactor's own
/// bytes take 4 ms, so its loop over the 393 parameter tensors took about
/// 108 ms: 8,320 operations (149 matrices × 28, 244 vectors × 17, see
/// [`ADAFACTOR_OPS_PER_MATRIX`]), 13 µs each. The H200's one step with
/// bitsandbytes' 8-bit AdamW (bench/data/h200/qlora.csv, the same BERT-large
/// step, on another host) is 22 ms slower than that AdamW step: 56 µs a
/// tensor against the 52 this gives for its four operations a tensor.
pub const OPTIMIZER_OP_HOST_S: f64 = 13e-6;

/// Operations transformers' `Adafactor.step` issues for a factored (2-D)
/// parameter, counted from its code (transformers/optimization.py, with
/// `beta1=None`, `weight_decay=0`, `scale_parameter=False`): the two
/// states' `.to(grad)`, the parameter's RMS (norm, divide), `grad**2 +
/// eps` (2), each factor's `mean`, `mul_` and `add_` (6),
/// `_approx_sq_grad` (mean, divide, `rsqrt_`, two `unsqueeze`, `rsqrt`,
/// `mul`: 7), `update.mul_(grad)`, the update's RMS clip (norm, divide,
/// divide, `clamp_`, `div_`: 5), `mul_(lr)`, and `p.add_(-update)` (2).
pub const ADAFACTOR_OPS_PER_MATRIX: f64 = 28.0;
/// The same for a vector (one unfactored state): `.to`, the RMS (2),
/// `grad**2 + eps` (2), `mul_`, `add_`, `rsqrt`, `mul_` (4), the clip (5),
/// `mul_(lr)` and the update (2).
pub const ADAFACTOR_OPS_PER_VECTOR: f64 = 17.0;
/// bitsandbytes' 8-bit AdamW a tensor (`Optimizer8bit.update_step`): the
/// parameter's and the gradient's `contiguous()`, the blockwise update
/// kernel (one call, 32-bit below 4,096 elements), and the state lookup
/// and step count around it.
pub const ADAMW8BIT_OPS_PER_TENSOR: f64 = 4.0;

/// The trainable parameter tensors the optimizer loops over: (matrices,
/// vectors). Counted from the architecture: a full fine-tune trains every
/// linear weight, embedding and norm (biases and LayerNorm's shift where
/// the classic, ungated architectures have them); adapters train two
/// matrices per adapted linear.
pub fn trainable_tensors(w: &Workload) -> (f64, f64) {
    let a = &w.model;
    let layers = a.num_layers as f64;
    let experts = a.num_experts.max(1) as f64;
    if w.method != Method::Full {
        let head = w
            .lora
            .as_ref()
            .is_some_and(|l| l.targets.contains(&LoraTarget::LmHead));
        let head = if head { 2.0 } else { 0.0 };
        return (2.0 * adapted_linears_per_layer(w) * layers + head, 0.0);
    }
    // the classic architectures (GPT-2, BERT, GPT-NeoX, Phi-2) have a bias on
    // every linear and LayerNorm's shift; the gated ones (Llama, Qwen,
    // Gemma, Mistral) RMSNorm and, but for a few, no biases
    let classic = !a.gated_mlp;
    let attention = if a.quirks.fused_qkv { 2.0 } else { 4.0 };
    let mlp = if a.gated_mlp && !a.quirks.fused_gate_up {
        3.0
    } else {
        2.0
    } * experts;
    let router = if experts > 1.0 { 1.0 } else { 0.0 };
    let norms = a.norms_per_block();
    let per_norm = if classic { 2.0 } else { 1.0 };
    let biases = if classic { attention + mlp } else { 0.0 };
    let embeddings = 1.0
        + if a.tied_embeddings { 0.0 } else { 1.0 }
        + if classic && a.kind != ArchKind::EncoderDecoder {
            1.0
        } else {
            0.0
        };
    let matrices = layers * (attention + mlp + router) + embeddings;
    let vectors = layers * (norms * per_norm + biases) + per_norm;
    (matrices, vectors)
}

/// The linears of a block that carry an adapter (the output head aside):
/// one for each of the targets, the MLP's in every expert (transformers'
/// MoE blocks loop over the experts), and one for any of q, k and v where
/// a fused projection computes them (`quirks.fused_qkv`: PEFT adapts
/// `qkv_proj` as a whole; likewise Phi-3's `gate_up_proj`).
pub(super) fn adapted_linears_per_layer(w: &Workload) -> f64 {
    let a = &w.model;
    let (Some(c), Method::Lora | Method::Qlora) = (&w.lora, w.method) else {
        return 0.0;
    };
    let experts = a.num_experts.max(1) as f64;
    use LoraTarget::*;
    let qkv = c.targets.iter().filter(|t| matches!(t, Q | K | V)).count() as f64;
    let qkv = if a.quirks.fused_qkv {
        qkv.min(1.0)
    } else {
        qkv
    };
    qkv + c
        .targets
        .iter()
        .map(|t| match t {
            O => 1.0,
            Gate if !a.gated_mlp || a.quirks.fused_gate_up => 0.0,
            Gate | Up | Down => experts,
            _ => 0.0,
        })
        .sum::<f64>()
}

/// Host seconds of one optimizer step: what the Python loop over the
/// tensors takes (0 for torch's foreach and fused optimizers, which issue
/// a few calls for all tensors at once).
pub fn host_seconds(w: &Workload) -> f64 {
    let (matrices, vectors) = trainable_tensors(w);
    let ops = match w.optimizer {
        Optimizer::Adafactor => {
            matrices * ADAFACTOR_OPS_PER_MATRIX + vectors * ADAFACTOR_OPS_PER_VECTOR
        }
        Optimizer::Adamw8bit => (matrices + vectors) * ADAMW8BIT_OPS_PER_TENSOR,
        Optimizer::Adamw | Optimizer::Sgd => 0.0,
    };
    ops * OPTIMIZER_OP_HOST_S
}

/// Seconds of one optimizer step on one GPU: its bytes at the memory
/// bandwidth (datasheet; a GPU outside the catalog has none and the
/// step's kernels are left out), or the host's loop, whichever is longer.
pub fn step_seconds(w: &Workload, s: &EngineeringSettings, gpu: &GpuSpec) -> f64 {
    let kernels = if gpu.memory_bandwidth_gbs > 0.0 {
        optimizer_step_bytes(w, s) / (gpu.memory_bandwidth_gbs * 1e9)
    } else {
        0.0
    };
    kernels.max(host_seconds(w))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::lookup_gpu;
    use crate::settings::Dtype;
    use crate::throughput::tokens_per_sec;
    use crate::workload::{Attention, LoraConfig};

    fn w(model: &str, method: Method, optimizer: Optimizer, targets: Vec<LoraTarget>) -> Workload {
        Workload {
            optimizer,
            lora: (method != Method::Full).then_some(LoraConfig { rank: 16, targets }),
            ..super::super::tests::w(model, method, 512, Attention::Sdpa)
        }
    }

    /// GPT-2's blocks hold ln_1, c_attn, c_proj, ln_2, c_fc and the MLP's
    /// c_proj, each a weight and a bias: four matrices and eight vectors a
    /// block, then wte, wpe and ln_f (transformers' GPT2Model).
    #[test]
    fn tensor_counts_follow_the_architecture() {
        let gpt2 = w("gpt2-medium", Method::Full, Optimizer::Adamw, vec![]);
        let layers = gpt2.model.num_layers as f64;
        assert_eq!(
            trainable_tensors(&gpt2),
            (4.0 * layers + 2.0, 8.0 * layers + 2.0)
        );
        // Llama: q, k, v, o, gate, up, down and two RMSNorm weights a block,
        // the embedding, the untied head and the final norm
        let llama = w(
            "meta-llama/Llama-3.1-8B",
            Method::Full,
            Optimizer::Adamw,
            vec![],
        );
        assert_eq!(
            trainable_tensors(&llama),
            (7.0 * 32.0 + 2.0, 2.0 * 32.0 + 1.0)
        );
        // LoRA on q and v: an A and a B matrix for each, nothing else
        let lora = w(
            "meta-llama/Llama-3.1-8B",
            Method::Lora,
            Optimizer::Adamw,
            vec![LoraTarget::Q, LoraTarget::V],
        );
        assert_eq!(trainable_tensors(&lora), (2.0 * 2.0 * 32.0, 0.0));
        // Phi-3's fused qkv_proj: one adapter for q, k and v
        let phi3 = w(
            "microsoft/Phi-3-mini-4k-instruct",
            Method::Lora,
            Optimizer::Adamw,
            vec![LoraTarget::Q, LoraTarget::K, LoraTarget::V],
        );
        assert_eq!(trainable_tensors(&phi3), (2.0 * 32.0, 0.0));
    }

    /// transformers' Adafactor loops over the tensors in Python: BERT-large
    /// fp32 at 4 × 512 on the H100 ran 9,299 tokens/s with it, against
    /// 17,030 with foreach AdamW (bench/data/h100/families.csv).
    #[test]
    fn adafactor_steps_at_the_hosts_pace() {
        let h100 = lookup_gpu("NVIDIA H100 80GB HBM3").unwrap();
        let st = EngineeringSettings {
            micro_batch_size: 4,
            dtype: Dtype::Fp32,
            ..EngineeringSettings::default()
        };
        let ada = w(
            "bert-large-uncased",
            Method::Full,
            Optimizer::Adafactor,
            vec![],
        );
        let adamw = w("bert-large-uncased", Method::Full, Optimizer::Adamw, vec![]);
        let (t_ada, t_adamw) = (
            tokens_per_sec(&ada, &h100, &st),
            tokens_per_sec(&adamw, &h100, &st),
        );
        assert!((t_ada / 9_299.0 - 1.0).abs() < 0.15, "{t_ada:.0}");
        assert!(t_ada < 0.7 * t_adamw, "{t_ada:.0} against {t_adamw:.0}");
        // the loop, not the bytes, sets Adafactor's step; foreach AdamW has none
        assert!(host_seconds(&ada) > 0.08 && host_seconds(&ada) < 0.14);
        assert_eq!(host_seconds(&adamw), 0.0);
        assert!(step_seconds(&ada, &st, &h100) == host_seconds(&ada));
        // a GPU outside the catalog (no bandwidth) keeps the host's loop
        let unknown = GpuSpec {
            memory_bandwidth_gbs: 0.0,
            ..h100.clone()
        };
        assert_eq!(step_seconds(&ada, &st, &unknown), host_seconds(&ada));
        assert_eq!(step_seconds(&adamw, &st, &unknown), 0.0);
    }
}
