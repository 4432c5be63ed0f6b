//! Element sizes: bytes per stored parameter and per activation element,
//! the frozen base's storage, and the dtype a block's activations follow.

use crate::settings::{Dtype, EngineeringSettings};
use crate::workload::{Framework, Method, Workload};

use super::types::{BaseQuant, ModelOptions};

/// Bytes of one element of a dtype's *stored* parameters.
pub(super) fn param_bytes(d: Dtype) -> f64 {
    match d {
        Dtype::Fp32 | Dtype::Bf16Mixed | Dtype::Fp16Mixed => 4.0,
        Dtype::Bf16 | Dtype::Fp16 => 2.0,
    }
}

/// Bytes of one activation element (matmul outputs): 16-bit except fp32.
pub(super) fn compute_bytes(d: Dtype) -> f64 {
    match d {
        Dtype::Fp32 => 4.0,
        _ => 2.0,
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
/// cast to fp32 (stored so in `storage::weights`), and a bitsandbytes
/// linear returns its output in its input's dtype (`Linear4bit.forward`:
/// `x.to(compute_dtype)` … `out.to(inp_dtype)`), so the residual stream
/// and every projection's output are fp32 ([`activation_dtype`]).
/// Counted on the CPU (bench/data/saved_tensors.jsonl, the test
/// `peft_qlora_recipe_runs_the_block_in_fp32`).
pub(super) fn kbit_recipe(w: &Workload, opts: &ModelOptions) -> bool {
    w.framework == Framework::Hf
        && w.method != Method::Full
        && base_quant(w, opts) != BaseQuant::None
}

/// The dtype a block's activations follow: under PEFT's QLoRA recipe
/// ([`kbit_recipe`]) without autocast, those of fp32 training; under
/// autocast only its MLP differs (see `activations::ElementSizes::mlp`).
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
