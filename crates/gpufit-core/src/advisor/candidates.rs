//! Step 1: the candidate settings, and the precision policy.
//!
//! Precision policy (docs/design.md, "The advisor", the precision policy):
//! * A pinned dtype is the only candidate.
//! * LoRA / QLoRA: the frozen base is stored in 16 bits (bf16 where the GPU
//!   has it, else fp16; QLoRA's NF4 base computes in that dtype) and never in
//!   fp32 unless pinned — holding a frozen base in fp32 buys nothing under
//!   autocast (the matmuls run in 16 bits either way) and costs twice the
//!   weight memory. gpufit's `bf16` for a LoRA job means exactly that: a
//!   16-bit base, adapters as the framework keeps them (PEFT: fp32).
//!   torchtune on a GPU without bf16 is the exception: it trains in bf16 or
//!   fp32 only.
//! * Full fine-tunes keep the framework's default: fp32 master weights
//!   (`bf16-mixed`) for the HF Trainer and Lightning, pure `bf16` for
//!   torchtune, litgpt and generic loops. Pure bf16 is offered to a
//!   mixed-default framework only where the user allows it (`pure_bf16`
//!   pinned true) or, in auto, where it is the only way to meet the target;
//!   the reasoning and warnings then say so. `pure_bf16` pinned false
//!   forbids it.
//! * fp32 is never chosen unpinned on a bf16-capable GPU; on older GPUs
//!   fp16 autocast (`fp16-mixed`) is the half-precision path.

use super::{Ctx, Strategy};
use crate::settings::{Dtype, EngineeringSettings};
use crate::workload::{Framework, Method};

/// One candidate setting (everything but the micro batch and accumulation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cand {
    pub dtype: Dtype,
    pub ckpt: bool,
    pub compile: bool,
    pub offload: bool,
}

impl Cand {
    /// The engineering settings of this candidate at micro batch `m` with
    /// accumulation `a` (data loader irrelevant to memory).
    pub fn settings(self, m: u32, a: u32) -> EngineeringSettings {
        EngineeringSettings {
            micro_batch_size: m,
            gradient_accumulation_steps: a,
            dtype: self.dtype,
            activation_checkpointing: self.ckpt,
            activation_offloading: self.offload,
            compile: self.compile,
            ..EngineeringSettings::default()
        }
    }
}

/// The dtypes to consider: `preferred` always, `fallback` only when no
/// preferred candidate meets the target.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct DtypePolicy {
    pub preferred: Vec<Dtype>,
    pub fallback: Vec<Dtype>,
}

impl Ctx<'_> {
    /// Whether the framework trains full fine-tunes with fp32 master weights
    /// by default (HF Trainer `bf16=True` on an fp32 model; Lightning
    /// `precision="bf16-mixed"`).
    pub(super) fn mixed_default(&self) -> bool {
        matches!(self.w.framework, Framework::Hf | Framework::Lightning)
    }

    pub(super) fn dtype_policy(&self) -> DtypePolicy {
        let only = |d: Dtype| DtypePolicy {
            preferred: vec![d],
            fallback: Vec::new(),
        };
        if let Some(d) = self.req.pins.dtype {
            return only(d);
        }
        let bf16 = self.req.gpu.bf16;
        let torchtune = self.w.framework == Framework::Torchtune;
        if matches!(self.w.method, Method::Lora | Method::Qlora) {
            return match (bf16, torchtune) {
                (true, _) => only(Dtype::Bf16),
                // torchtune refuses fp16 training.
                (false, true) => only(Dtype::Fp32),
                (false, false) => only(Dtype::Fp16),
            };
        }
        if !bf16 {
            return only(if torchtune {
                Dtype::Fp32
            } else {
                Dtype::Fp16Mixed
            });
        }
        let pure = self.req.pins.pure_bf16;
        if self.mixed_default() {
            match pure {
                Some(true) => DtypePolicy {
                    preferred: vec![Dtype::Bf16Mixed, Dtype::Bf16],
                    fallback: Vec::new(),
                },
                Some(false) => only(Dtype::Bf16Mixed),
                None => DtypePolicy {
                    preferred: vec![Dtype::Bf16Mixed],
                    fallback: vec![Dtype::Bf16],
                },
            }
        } else if pure == Some(false) {
            // Pure bf16 forbidden where it is the framework's default.
            only(if torchtune {
                Dtype::Fp32
            } else {
                Dtype::Bf16Mixed
            })
        } else {
            only(Dtype::Bf16)
        }
    }

    /// The half-precision dtype the policy starts from (for "does not fit"
    /// advice and learned-from-failures).
    pub(super) fn first_dtype(&self) -> Dtype {
        self.dtype_policy()
            .preferred
            .first()
            .copied()
            .unwrap_or(Dtype::Bf16)
    }

    /// Candidates for a strategy over the given dtypes.
    pub(super) fn candidates(&self, s: Strategy, dtypes: &[Dtype]) -> Vec<Cand> {
        let pins = self.req.pins;
        let ckpts: Vec<bool> = match (pins.activation_checkpointing, s) {
            (Some(c), _) => vec![c],
            (None, Strategy::Conservative) => vec![true],
            (None, _) => vec![false, true],
        };
        let compiles: Vec<bool> = match (pins.compile, s) {
            (Some(c), _) => vec![c],
            (None, Strategy::Conservative) => vec![false],
            (None, Strategy::Aggressive) => vec![true],
            // Balanced tries compile once this workload has run without it
            // (its speed is known, and the memory model — which treats
            // compile as memory-neutral, while the H100 measured 24–34 %
            // less — says the compiled run fits): a failed compile then
            // costs one retry, not an OOM. A compile that failed for another
            // reason than memory, and never succeeded, is not tried again.
            (None, Strategy::Balanced) => {
                let compiled_ok = self
                    .key_runs
                    .iter()
                    .any(|r| r.result.success() && r.settings.compile);
                let compiled_broke = self.key_runs.iter().any(|r| {
                    r.settings.compile && !r.result.success() && !r.is_oom() && !r.result.host_oom()
                });
                let baseline = self
                    .key_runs
                    .iter()
                    .any(|r| r.result.success() && !r.settings.compile);
                if compiled_ok || (baseline && !compiled_broke) {
                    vec![false, true]
                } else {
                    vec![false]
                }
            }
        };
        let offload = pins.activation_offloading.unwrap_or(false);
        let mut out = Vec::new();
        for &dtype in dtypes {
            for &ckpt in &ckpts {
                for &compile in &compiles {
                    out.push(Cand {
                        dtype,
                        ckpt,
                        compile,
                        offload,
                    });
                }
            }
        }
        out
    }
}
