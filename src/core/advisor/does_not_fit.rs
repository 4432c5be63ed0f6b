//! "Does not fit" — only when no candidate fits the card at micro batch 1 —
//! with what would, least change first: precision, checkpointing,
//! offloading, an 8-bit optimizer, then QLoRA, then ZeRO-3/FSDP over more
//! GPUs. Each alternative carries its predicted peak against the card.

use super::{AdvisorError, Cand, Ctx, Strategy};
use crate::core::settings::Dtype;
use crate::core::units::to_gib;
use crate::core::workload::{LoraConfig, LoraTarget, Method, Optimizer, Sharding, Workload};

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
            alternatives.push(format!(
                "micro batch 1 already ran out of memory on {} with these settings",
                self.gpu_name()
            ));
        }
        let mut offer = |what: String, p: f64| {
            if p <= self.capacity {
                let note = if p > budget {
                    format!(", above the {s} target")
                } else {
                    String::new()
                };
                alternatives.push(format!(
                    "{what} ({:.1} GiB of {:.1} GiB at micro batch 1{note})",
                    to_gib(p as u64),
                    to_gib(self.capacity as u64)
                ));
            }
        };
        // Precision: pure bf16 weights where the pins or the switch kept them out.
        if self.req.gpu.bf16 && !dtypes.contains(&Dtype::Bf16) {
            let how = if self.req.pins.dtype.is_some() {
                "--dtype bf16"
            } else {
                "--pure-bf16 allow"
            };
            offer(
                format!("pure bf16 weights ({how}) with checkpointing"),
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
            offer(
                "activation checkpointing (--checkpointing on)".into(),
                at_one(self.w, ckpt)?,
            );
        }
        if !base.offload {
            offer(
                "activation checkpointing plus activation offloading to CPU memory (--offloading on)"
                    .into(),
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
            offer(
                "an 8-bit optimizer (--optimizer adamw8bit) with checkpointing".into(),
                at_one(&w8, ckpt)?,
            );
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
                offer(
                    format!("QLoRA (--method qlora --lora-rank {rank}) with checkpointing"),
                    at_one(&q, qc)?,
                );
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
                    offer(
                        format!(
                            "ZeRO-3/FSDP over {n} GPUs (--zero 3 --gpus {n}) with checkpointing"
                        ),
                        p,
                    );
                    break;
                }
            }
        }
        if alternatives.len() == usize::from(oom_at_one) {
            alternatives.push(format!(
                "none of pure bf16, checkpointing, offloading, an 8-bit optimizer, QLoRA or ZeRO-3 over up to 64 GPUs brings micro batch 1 under the {:.1} GiB of the card: use a GPU with more memory",
                to_gib(self.capacity as u64)
            ));
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
