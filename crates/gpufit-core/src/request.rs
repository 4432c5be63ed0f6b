//! One workload resolver: a [`WorkloadRequest`] — the workload as a user
//! gives it, every field optional — resolved once into a [`Workload`], with
//! errors that name the field at fault. The command line, the TrainingJob
//! CRD, the webhook annotations, the controller's Slurm API and the Slurm
//! hooks all build a request and call [`WorkloadRequest::resolve`], so the
//! same input gives the same workload (and the same suggestion) on every
//! path. The defaults, written down in docs/design.md ("Workload
//! resolution"):
//!
//! * method: as given, else what the model name implies (torchtune recipe
//!   names), else `full` — a given method wins over the name's hint (a
//!   `…_lora_…` recipe trained as QLoRA; the CRD used to refuse this);
//! * LoRA rank 8 (PEFT's `LoraConfig(r=8)` and torchtune's shipped configs);
//!   LoRA targets: the framework's defaults ([`default_lora_targets`]);
//! * `full` with a LoRA rank or targets is an error on every path (it used
//!   to be a warning on the command line, ignored silently by the Slurm
//!   API and an error in the CRD): contradictory input is refused, never
//!   half-used;
//! * optimizer AdamW, 1 data-parallel GPU, no sharding, generic framework,
//!   SDPA attention.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::catalog::lookup_model;
use crate::catalog::models::count_params;
use crate::memory::default_lora_targets;
use crate::workload::{
    ArchKind, Attention, Framework, LoraConfig, LoraTarget, Method, ModelArch, Optimizer, Sharding,
    Workload,
};
pub use crate::workload::{FieldNames, WorkloadError, WorkloadField};

/// The LoRA rank when none is given.
pub const DEFAULT_LORA_RANK: u32 = 8;

/// Which model is trained, as given.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelRequest {
    /// A catalog id (Hugging Face id, short id, torchtune recipe or
    /// component name); the name may imply a method.
    Catalog(String),
    /// Architecture numbers (a config.json, `--params`, a CRD's
    /// `architecture`), read by the adapter; `implied_method` is what its
    /// name implied, if anything.
    Arch {
        arch: ModelArch,
        implied_method: Option<Method>,
    },
    /// A model given by its architecture numbers: over `base` (the command
    /// line's shape flags change the model `--model` names), or from
    /// scratch (a CRD's, an annotation's or a JSON request's
    /// `architecture`). The numbers are checked here, once, for every path.
    Numbers {
        base: Option<Box<ModelRequest>>,
        numbers: ArchNumbers,
    },
}

/// Architecture numbers as a user gives them, every one optional. From
/// scratch, `name`, `params`, `hidden_size`, `layers`, `heads` and
/// `vocab_size` are required; `kv_heads` defaults to `heads`,
/// `intermediate_size` to 4 × `hidden_size` (a plain GPT MLP; a given one is
/// taken to be a gated SwiGLU MLP, as in every Llama-family config).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ArchNumbers {
    /// Name recorded in the history (similar runs share it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub params: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_size: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heads: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_heads: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intermediate_size: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocab_size: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tied_embeddings: Option<bool>,
    /// Longest sequence the model supports (0 or unset: not checked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_seq_len: Option<u32>,
}

impl ArchNumbers {
    /// Whether any number that changes the model's shape is given.
    fn has_shape(&self) -> bool {
        self.hidden_size.is_some()
            || self.layers.is_some()
            || self.heads.is_some()
            || self.kv_heads.is_some()
            || self.intermediate_size.is_some()
            || self.vocab_size.is_some()
    }

    /// Every given number must be positive (`max_seq_len` 0 means unknown).
    fn check_positive(&self) -> Result<(), WorkloadError> {
        use WorkloadField as F;
        for (field, v) in [
            (F::Params, self.params),
            (F::HiddenSize, self.hidden_size.map(u64::from)),
            (F::Layers, self.layers.map(u64::from)),
            (F::Heads, self.heads.map(u64::from)),
            (F::KvHeads, self.kv_heads.map(u64::from)),
            (F::IntermediateSize, self.intermediate_size.map(u64::from)),
            (F::VocabSize, self.vocab_size.map(u64::from)),
        ] {
            if v == Some(0) {
                return Err(WorkloadError::NotPositive { field, value: 0 });
            }
        }
        Ok(())
    }

    /// The numbers over a known architecture: given numbers win; the head
    /// dimension follows a given head count (which must divide the hidden
    /// size); the parameter count is recounted when the shape changed and
    /// no count is given.
    fn over(&self, mut arch: ModelArch) -> Result<ModelArch, WorkloadError> {
        self.check_positive()?;
        if let Some(n) = self
            .name
            .as_deref()
            .map(str::trim)
            .filter(|n| !n.is_empty())
        {
            arch.name = n.to_string();
        }
        if let Some(h) = self.hidden_size {
            arch.hidden_size = h;
        }
        if let Some(l) = self.layers {
            arch.num_layers = l;
        }
        if let Some(a) = self.heads {
            if !arch.hidden_size.is_multiple_of(a) {
                return Err(WorkloadError::HeadsNotDivisor {
                    heads: a,
                    hidden: arch.hidden_size,
                });
            }
            arch.num_attention_heads = a;
            arch.head_dim = arch.hidden_size / a;
        }
        if let Some(k) = self.kv_heads {
            arch.num_kv_heads = k;
        }
        if let Some(i) = self.intermediate_size {
            arch.intermediate_size = i;
        }
        if let Some(v) = self.vocab_size {
            arch.vocab_size = v;
        }
        if self.tied_embeddings == Some(true) {
            arch.tied_embeddings = true;
        }
        if let Some(m) = self.max_seq_len {
            arch.max_position_embeddings = m;
        }
        if let Some(p) = self.params {
            arch.params = p;
        } else if self.has_shape() {
            // Recount only a consistent shape (count_params divides nothing,
            // but a zero head count would make it meaningless).
            arch.check()?;
            arch.params = count_params(&arch);
        }
        Ok(arch)
    }

    /// A model from its numbers alone.
    fn build(&self) -> Result<ModelArch, WorkloadError> {
        use WorkloadField as F;
        let Some(name) = self
            .name
            .as_deref()
            .map(str::trim)
            .filter(|n| !n.is_empty())
        else {
            return Err(WorkloadError::Missing { field: F::ArchName });
        };
        self.check_positive()?;
        let need = |field: F, v: Option<u64>| v.ok_or(WorkloadError::Missing { field });
        let params = need(F::Params, self.params)?;
        let hidden = need(F::HiddenSize, self.hidden_size.map(u64::from))? as u32;
        let layers = need(F::Layers, self.layers.map(u64::from))? as u32;
        let heads = need(F::Heads, self.heads.map(u64::from))? as u32;
        let vocab = need(F::VocabSize, self.vocab_size.map(u64::from))? as u32;
        let base = ModelArch {
            name: name.to_string(),
            kind: ArchKind::DecoderOnly,
            params,
            hidden_size: hidden,
            num_layers: layers,
            num_attention_heads: heads,
            num_kv_heads: heads,
            head_dim: 0,
            // The GPT-style default of a 4× MLP when the config does not say.
            intermediate_size: 4 * hidden,
            vocab_size: vocab,
            tied_embeddings: false,
            gated_mlp: self.intermediate_size.is_some(),
            num_experts: 1,
            experts_per_token: 1,
            max_position_embeddings: 0,
            quirks: Default::default(),
        };
        // The remaining numbers (kv heads, intermediate size…) and the head
        // dimension, as over any base; the count given is kept.
        self.over(base)
    }
}

/// A workload as users give it: every field optional.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkloadRequest {
    pub model: Option<ModelRequest>,
    pub method: Option<Method>,
    pub lora_rank: Option<u32>,
    pub lora_targets: Option<Vec<LoraTarget>>,
    pub seq_len: Option<u32>,
    pub optimizer: Option<Optimizer>,
    pub global_batch: Option<u32>,
    pub gpus: Option<u32>,
    pub sharding: Option<Sharding>,
    pub framework: Option<Framework>,
    pub attention: Option<Attention>,
}

impl ModelRequest {
    /// The model a request names: a catalog id, or architecture numbers —
    /// never both (a CRD's, an annotation's or a JSON request's `model`
    /// and `architecture`).
    pub fn one_of(
        model: Option<String>,
        architecture: Option<ArchNumbers>,
    ) -> Result<Option<ModelRequest>, WorkloadError> {
        match (model, architecture) {
            (Some(_), Some(_)) => Err(WorkloadError::ModelTwice),
            (Some(name), None) => Ok(Some(ModelRequest::Catalog(name))),
            (None, Some(numbers)) => Ok(Some(ModelRequest::Numbers {
                base: None,
                numbers,
            })),
            (None, None) => Ok(None),
        }
    }

    /// The architecture and the method its name implies, if any.
    fn resolve(&self) -> Result<(ModelArch, Option<Method>), WorkloadError> {
        match self {
            ModelRequest::Catalog(name) if name.trim().is_empty() => Err(WorkloadError::Empty {
                field: WorkloadField::Model,
            }),
            ModelRequest::Catalog(name) => {
                let r = lookup_model(name.trim()).map_err(|e| WorkloadError::UnknownModel {
                    message: e.to_string(),
                })?;
                Ok((r.arch, r.method))
            }
            ModelRequest::Arch {
                arch,
                implied_method,
            } => Ok((arch.clone(), *implied_method)),
            ModelRequest::Numbers {
                base: Some(base),
                numbers,
            } => {
                let (arch, implied) = base.resolve()?;
                Ok((numbers.over(arch)?, implied))
            }
            ModelRequest::Numbers {
                base: None,
                numbers,
            } => Ok((numbers.build()?, None)),
        }
    }
}

impl WorkloadRequest {
    /// Resolves the request with the model catalog and the defaults above,
    /// and checks the result ([`Workload::validate`]).
    pub fn resolve(&self) -> Result<Workload, WorkloadError> {
        use WorkloadField as F;
        let (arch, implied) = match &self.model {
            None => return Err(WorkloadError::Missing { field: F::Model }),
            Some(m) => m.resolve()?,
        };
        // The user's statement wins over the hint a recipe name gives.
        let method = self.method.or(implied).unwrap_or(Method::Full);
        let framework = self.framework.unwrap_or(Framework::Generic);
        let lora = match method {
            Method::Full => {
                if self.lora_rank.is_some() || self.lora_targets.is_some() {
                    let field = if self.lora_rank.is_some() {
                        F::LoraRank
                    } else {
                        F::LoraTargets
                    };
                    return Err(WorkloadError::LoraWithFull { field });
                }
                None
            }
            Method::Lora | Method::Qlora => Some(LoraConfig {
                rank: self.lora_rank.unwrap_or(DEFAULT_LORA_RANK),
                targets: match &self.lora_targets {
                    Some(t) if t.is_empty() => {
                        return Err(WorkloadError::Empty {
                            field: F::LoraTargets,
                        })
                    }
                    Some(t) => t.clone(),
                    None => default_lora_targets(framework),
                },
            }),
        };
        let seq_len = self
            .seq_len
            .ok_or(WorkloadError::Missing { field: F::SeqLen })?;
        let workload = Workload {
            model: arch,
            method,
            lora,
            seq_len,
            optimizer: self.optimizer.unwrap_or(Optimizer::Adamw),
            global_batch: self.global_batch,
            gpus: self.gpus.unwrap_or(1),
            sharding: self.sharding.unwrap_or(Sharding::None),
            framework,
            attention: self.attention.unwrap_or(Attention::Sdpa),
        };
        workload.validate()?;
        Ok(workload)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::DomainNames;

    fn lora_request() -> WorkloadRequest {
        WorkloadRequest {
            model: Some(ModelRequest::Catalog("meta-llama/Llama-3.1-8B".into())),
            method: Some(Method::Lora),
            seq_len: Some(2048),
            ..Default::default()
        }
    }

    #[test]
    fn lora_defaults_rank_8_and_the_frameworks_targets() {
        let w = lora_request().resolve().unwrap();
        let l = w.lora.unwrap();
        assert_eq!(l.rank, DEFAULT_LORA_RANK);
        assert_eq!(l.targets, default_lora_targets(Framework::Generic));
        let tt = WorkloadRequest {
            framework: Some(Framework::Torchtune),
            ..lora_request()
        };
        assert_eq!(
            tt.resolve().unwrap().lora.unwrap().targets,
            default_lora_targets(Framework::Torchtune)
        );
    }

    #[test]
    fn full_with_a_rank_is_refused_naming_the_field() {
        let r = WorkloadRequest {
            method: Some(Method::Full),
            lora_rank: Some(16),
            ..lora_request()
        };
        let e = r.resolve().unwrap_err();
        assert_eq!(e.field(), WorkloadField::LoraRank);
        assert!(e.render(&DomainNames).starts_with("lora_rank: "), "{e}");
        // A path's own names, inside the message too.
        struct Upper;
        impl FieldNames for Upper {
            fn name(&self, f: WorkloadField) -> String {
                f.domain_name().to_ascii_uppercase()
            }
        }
        assert_eq!(
            e.render(&Upper),
            "LORA_RANK: is set but the method is `full`: use METHOD lora or qlora, or drop LORA_RANK/LORA_TARGETS"
        );
    }

    #[test]
    fn missing_and_inconsistent_fields_are_named() {
        let e = WorkloadRequest {
            seq_len: None,
            ..lora_request()
        }
        .resolve()
        .unwrap_err();
        assert_eq!(e.field(), WorkloadField::SeqLen);
        assert_eq!(
            e.to_string(),
            "seq_len: missing: give the training sequence length in tokens, e.g. 2048"
        );
        let e = WorkloadRequest {
            seq_len: Some(1 << 30),
            ..lora_request()
        }
        .resolve()
        .unwrap_err();
        assert_eq!(e.field(), WorkloadField::SeqLen);
        assert!(
            e.to_string().starts_with("seq_len 1073741824 is longer"),
            "{e}"
        );
        let e = WorkloadRequest {
            model: None,
            ..lora_request()
        }
        .resolve()
        .unwrap_err();
        assert_eq!(e.field(), WorkloadField::Model);
    }

    #[test]
    fn every_catalog_model_passes_the_architecture_checks() {
        for m in crate::catalog::all_models() {
            assert_eq!(m.check(), Ok(()), "{}", m.name);
        }
    }

    #[test]
    fn numbers_over_a_model_follow_its_heads_and_recount_the_params() {
        let base = lookup_model("meta-llama/Llama-3.1-8B").unwrap().arch;
        let numbers = ArchNumbers {
            heads: Some(16),
            kv_heads: Some(4),
            ..Default::default()
        };
        let a = numbers.over(base.clone()).unwrap();
        assert_eq!(a.head_dim, base.hidden_size / 16);
        assert_eq!(a.params, count_params(&a));
        let bad = ArchNumbers {
            heads: Some(30),
            ..Default::default()
        };
        assert_eq!(bad.over(base).unwrap_err().field(), WorkloadField::Heads);
    }

    #[test]
    fn a_model_and_its_numbers_together_are_refused() {
        let e =
            ModelRequest::one_of(Some("gpt2".into()), Some(ArchNumbers::default())).unwrap_err();
        assert_eq!(e.field(), WorkloadField::Model);
        let e = ModelRequest::Numbers {
            base: None,
            numbers: ArchNumbers::default(),
        }
        .resolve()
        .unwrap_err();
        assert_eq!(e.field(), WorkloadField::ArchName);
    }

    #[test]
    fn a_given_method_wins_over_the_one_the_name_implies() {
        let r = WorkloadRequest {
            model: Some(ModelRequest::Catalog(
                "llama3_1/8B_lora_single_device".into(),
            )),
            seq_len: Some(2048),
            ..Default::default()
        };
        assert_eq!(r.resolve().unwrap().method, Method::Lora);
        let q = WorkloadRequest {
            method: Some(Method::Qlora),
            ..r
        };
        assert_eq!(q.resolve().unwrap().method, Method::Qlora);
    }

    #[test]
    fn every_alias_parses_the_same_from_text_and_json() {
        for (text, want) in [
            ("tune", Framework::Torchtune),
            ("pl", Framework::Lightning),
            ("PyTorch-Lightning", Framework::Lightning),
            ("transformers", Framework::Hf),
            ("torch", Framework::Generic),
        ] {
            assert_eq!(text.parse::<Framework>().unwrap(), want, "{text}");
            let j: Framework = serde_json::from_value(serde_json::json!(text)).unwrap();
            assert_eq!(j, want, "{text} from JSON");
        }
        assert_eq!(
            "paged_adamw_8bit".parse::<Optimizer>().unwrap(),
            Optimizer::Adamw8bit
        );
        assert_eq!("3".parse::<Sharding>().unwrap(), Sharding::Zero3);
        assert_eq!(
            "flash_attention_2".parse::<Attention>().unwrap(),
            Attention::Sdpa
        );
        assert_eq!("FFT".parse::<Method>().unwrap(), Method::Full);
        assert_eq!(
            LoraTarget::parse_list("q_proj+v_proj:output_proj").unwrap(),
            vec![LoraTarget::Q, LoraTarget::V, LoraTarget::O]
        );
        assert!(LoraTarget::parse_list(" , ").is_err());
        // Serialization keeps the canonical names.
        assert_eq!(
            serde_json::to_value(Framework::Torchtune).unwrap(),
            "torchtune"
        );
    }
}
