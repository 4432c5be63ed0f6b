//! "Does not fit" — only when no candidate fits the card at micro batch 1 —
//! with what would, least change first: precision, checkpointing,
//! offloading, an 8-bit optimizer, then QLoRA, then ZeRO-3/FSDP over more
//! GPUs. Each alternative carries its predicted peak against the card.

use super::{AdvisorError, Cand, Ctx, Strategy};
use crate::settings::Dtype;
use crate::units::to_gib;
use crate::workload::{LoraConfig, LoraTarget, Method, Optimizer, Sharding, Workload};

/// A change to the job that would make micro batch 1 fit, in domain terms;
/// each path says how to make it in its own words ([`ChangeNames`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Change {
    /// Pure bf16 weights with checkpointing: `dtype_pinned` when the user
    /// pinned another dtype (else the pure-bf16 switch kept them out).
    PureBf16 {
        dtype_pinned: bool,
    },
    Checkpointing,
    /// Checkpointing plus activation offloading to CPU memory.
    Offloading,
    /// 8-bit AdamW with checkpointing.
    Optimizer8bit,
    /// QLoRA at this rank with checkpointing.
    Qlora {
        rank: u32,
    },
    /// ZeRO-3 / FSDP over this many GPUs with checkpointing.
    Zero3 {
        gpus: u32,
    },
}

/// How a path tells a user to make a [`Change`] (the command line's flags,
/// the spec's fields).
pub trait ChangeNames {
    fn how(&self, change: Change) -> String;
}

/// The domain's words: the fields and values that change.
pub struct DomainChanges;

impl ChangeNames for DomainChanges {
    fn how(&self, change: Change) -> String {
        match change {
            Change::PureBf16 { dtype_pinned: true } => "dtype bf16".into(),
            Change::PureBf16 {
                dtype_pinned: false,
            } => "pure_bf16 allowed".into(),
            Change::Checkpointing => "activation_checkpointing true".into(),
            Change::Offloading => "activation_offloading true".into(),
            Change::Optimizer8bit => "optimizer adamw8bit".into(),
            Change::Qlora { rank } => format!("method qlora, lora_rank {rank}"),
            Change::Zero3 { gpus } => format!("sharding zero3, gpus {gpus}"),
        }
    }
}

/// One line of "what would fit".
#[derive(Debug, Clone, PartialEq)]
pub enum Alternative {
    /// A change that fits the card, with its predicted peak at micro batch 1
    /// and the strategy whose target it is above, if any.
    Fits {
        change: Change,
        peak_gib: f64,
        capacity_gib: f64,
        above_target: Option<Strategy>,
    },
    /// Micro batch 1 already ran out of memory on this GPU.
    OomAtOne { gpu: String },
    /// None of the changes brings micro batch 1 under the card's memory.
    NothingFits { capacity_gib: f64 },
    /// A caller's own finding, already in its words.
    Note(String),
}

impl Alternative {
    /// The line, each change said with `names`.
    pub fn render(&self, names: &dyn ChangeNames) -> String {
        match self {
            Alternative::Fits {
                change,
                peak_gib,
                capacity_gib,
                above_target,
            } => {
                let how = names.how(*change);
                let what = match change {
                    Change::PureBf16 { .. } => format!("pure bf16 weights ({how}) with checkpointing"),
                    Change::Checkpointing => format!("activation checkpointing ({how})"),
                    Change::Offloading => format!(
                        "activation checkpointing plus activation offloading to CPU memory ({how})"
                    ),
                    Change::Optimizer8bit => {
                        format!("an 8-bit optimizer ({how}) with checkpointing")
                    }
                    Change::Qlora { .. } => format!("QLoRA ({how}) with checkpointing"),
                    Change::Zero3 { gpus } => {
                        format!("ZeRO-3/FSDP over {gpus} GPUs ({how}) with checkpointing")
                    }
                };
                let note = above_target
                    .map(|s| format!(", above the {s} target"))
                    .unwrap_or_default();
                format!("{what} ({peak_gib:.1} GiB of {capacity_gib:.1} GiB at micro batch 1{note})")
            }
            Alternative::OomAtOne { gpu } => {
                format!("micro batch 1 already ran out of memory on {gpu} with these settings")
            }
            Alternative::NothingFits { capacity_gib } => format!(
                "none of pure bf16, checkpointing, offloading, an 8-bit optimizer, QLoRA or ZeRO-3 over up to 64 GPUs brings micro batch 1 under the {capacity_gib:.1} GiB of the card: use a GPU with more memory"
            ),
            Alternative::Note(text) => text.clone(),
        }
    }
}

impl std::fmt::Display for Alternative {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.render(&DomainChanges))
    }
}

/// The alternatives as one sentence, each change said with `names`.
pub fn render_alternatives(alternatives: &[Alternative], names: &dyn ChangeNames) -> String {
    alternatives
        .iter()
        .map(|a| a.render(names))
        .collect::<Vec<_>>()
        .join("; ")
}

impl Ctx<'_> {
    /// The error for "not even micro batch 1 fits", with what would.
    pub(super) fn does_not_fit(&self, s: Strategy) -> Result<AdvisorError, AdvisorError> {
        let budget = self.target(s) * self.capacity;
        let policy = self.dtype_policy();
        let dtypes: Vec<Dtype> = policy
            .preferred
            .iter()
            .chain(policy.fallback.iter())
            .copied()
            .collect();
        // The least memory any candidate needs at micro batch 1, and whether
        // history (an OOM at 1) rather than the model ruled it out.
        let mut needed = f64::INFINITY;
        let mut oom_at_one = false;
        for c in self.candidates(s, &dtypes) {
            let runs = self.exact_runs(c);
            let p = self.predictor(self.w, c, &runs)?.best(1)?;
            needed = needed.min(p);
            if runs
                .iter()
                .any(|r| r.is_oom() && r.settings.micro_batch_size == 1)
            {
                oom_at_one = true;
            }
        }
        let base = Cand {
            dtype: dtypes.first().copied().unwrap_or(Dtype::Bf16),
            ckpt: self.req.pins.activation_checkpointing.unwrap_or(true),
            compile: false,
            offload: self.req.pins.activation_offloading.unwrap_or(false),
        };
        let ckpt = Cand { ckpt: true, ..base };
        let at_one = |w: &Workload, c: Cand| -> Result<f64, AdvisorError> {
            self.predictor(w, c, &[])?.best(1)
        };
        let mut alternatives = Vec::new();
        if oom_at_one {
            alternatives.push(Alternative::OomAtOne {
                gpu: self.gpu_name().to_string(),
            });
        }
        let mut offer = |change: Change, p: f64| {
            if p <= self.capacity {
                alternatives.push(Alternative::Fits {
                    change,
                    peak_gib: to_gib(p as u64),
                    capacity_gib: to_gib(self.capacity as u64),
                    above_target: (p > budget).then_some(s),
                });
            }
        };
        // Precision: pure bf16 weights where the pins or the switch kept them out.
        if self.req.gpu.bf16 && !dtypes.contains(&Dtype::Bf16) {
            offer(
                Change::PureBf16 {
                    dtype_pinned: self.req.pins.dtype.is_some(),
                },
                at_one(
                    self.w,
                    Cand {
                        dtype: Dtype::Bf16,
                        ..ckpt
                    },
                )?,
            );
        }
        if !base.ckpt {
            offer(Change::Checkpointing, at_one(self.w, ckpt)?);
        }
        if !base.offload {
            offer(
                Change::Offloading,
                at_one(
                    self.w,
                    Cand {
                        offload: true,
                        ..ckpt
                    },
                )?,
            );
        }
        if self.w.optimizer == Optimizer::Adamw && self.w.method == Method::Full {
            let w8 = Workload {
                optimizer: Optimizer::Adamw8bit,
                ..self.w.clone()
            };
            offer(Change::Optimizer8bit, at_one(&w8, ckpt)?);
        }
        if self.w.method != Method::Qlora {
            let lora = self.w.lora.clone().unwrap_or(LoraConfig {
                rank: 16,
                targets: vec![LoraTarget::Q, LoraTarget::K, LoraTarget::V, LoraTarget::O],
            });
            let rank = lora.rank;
            let q = Workload {
                method: Method::Qlora,
                lora: Some(lora),
                ..self.w.clone()
            };
            // QLoRA computes in 16 bits, never an fp32 base.
            let qc = Cand {
                dtype: if self.req.gpu.bf16 {
                    Dtype::Bf16
                } else {
                    Dtype::Fp16
                },
                ..ckpt
            };
            if q.validate().is_ok() {
                offer(Change::Qlora { rank }, at_one(&q, qc)?);
            }
        }
        if !matches!(self.w.sharding, Sharding::Zero3 | Sharding::Fsdp) || self.w.gpus < 64 {
            for n in [2u32, 4, 8, 16, 32, 64] {
                if n <= self.w.gpus {
                    continue;
                }
                let z = Workload {
                    sharding: Sharding::Zero3,
                    gpus: n,
                    global_batch: None,
                    ..self.w.clone()
                };
                if z.validate().is_err() {
                    continue;
                }
                let p = at_one(&z, ckpt)?;
                if p <= self.capacity {
                    offer(Change::Zero3 { gpus: n }, p);
                    break;
                }
            }
        }
        if alternatives.len() == usize::from(oom_at_one) {
            alternatives.push(Alternative::NothingFits {
                capacity_gib: to_gib(self.capacity as u64),
            });
        }
        Ok(AdvisorError::DoesNotFit {
            model: self.w.model.name.clone(),
            gpu: self.gpu_name().to_string(),
            needed_gib: to_gib(needed.max(0.0) as u64),
            capacity_gib: to_gib(self.capacity as u64),
            alternatives,
        })
    }
}
