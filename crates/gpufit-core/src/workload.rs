//! The workload: *what* is trained. Every field here is scientific or
//! structural; gpufit reads them and never changes them.

use schemars::JsonSchema;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// A field of a workload as users give it: the scientific fields and, for a
/// model given by its numbers, each architecture number. Errors name the
/// field; each path spells it its own way ([`FieldNames`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WorkloadField {
    Model,
    Method,
    LoraRank,
    LoraTargets,
    SeqLen,
    Optimizer,
    GlobalBatch,
    Gpus,
    Sharding,
    Framework,
    Attention,
    /// The name of a model given by numbers.
    ArchName,
    Params,
    HiddenSize,
    Layers,
    Heads,
    KvHeads,
    IntermediateSize,
    VocabSize,
    MaxSeqLen,
}

impl WorkloadField {
    /// The domain name (snake_case; `architecture.` before a number of a
    /// model given by numbers).
    pub fn domain_name(self) -> &'static str {
        use WorkloadField as F;
        match self {
            F::Model => "model",
            F::Method => "method",
            F::LoraRank => "lora_rank",
            F::LoraTargets => "lora_targets",
            F::SeqLen => "seq_len",
            F::Optimizer => "optimizer",
            F::GlobalBatch => "global_batch",
            F::Gpus => "gpus",
            F::Sharding => "sharding",
            F::Framework => "framework",
            F::Attention => "attention",
            F::ArchName => "architecture.name",
            F::Params => "architecture.params",
            F::HiddenSize => "architecture.hidden_size",
            F::Layers => "architecture.layers",
            F::Heads => "architecture.heads",
            F::KvHeads => "architecture.kv_heads",
            F::IntermediateSize => "architecture.intermediate_size",
            F::VocabSize => "architecture.vocab_size",
            F::MaxSeqLen => "architecture.max_seq_len",
        }
    }
}

/// How a path spells the fields in its messages: each adapter has one
/// mapping (the command line's flags, the CRD's paths, the webhook's
/// annotations, the JSON request's keys, the Slurm hooks' variables).
pub trait FieldNames {
    fn name(&self, field: WorkloadField) -> String;
}

/// The domain's own names ([`WorkloadField::domain_name`]).
pub struct DomainNames;

impl FieldNames for DomainNames {
    fn name(&self, field: WorkloadField) -> String {
        field.domain_name().to_string()
    }
}

/// What is wrong with a workload, in domain terms: which field, which
/// value, which rule. [`WorkloadError::render`] writes it with a path's
/// field names; `Display` uses the domain's.
#[derive(Debug, Error, Clone, PartialEq)]
#[error("{}", self.render(&DomainNames))]
pub enum WorkloadError {
    /// A size that must be positive is zero.
    NotPositive {
        field: WorkloadField,
        value: u64,
    },
    /// A required field is not given.
    Missing {
        field: WorkloadField,
    },
    /// A field is given but empty.
    Empty {
        field: WorkloadField,
    },
    /// The model is not in the catalog (the catalog's message).
    UnknownModel {
        message: String,
    },
    /// Both a catalog model and architecture numbers.
    ModelTwice,
    /// A LoRA rank or targets with a full fine-tune.
    LoraWithFull {
        field: WorkloadField,
    },
    /// LoRA / QLoRA without a rank (a workload built by hand).
    LoraNeedsRank,
    SeqTooLong {
        model: String,
        seq_len: u32,
        max: u32,
    },
    LoraRankTooLarge {
        model: String,
        rank: u32,
        hidden: u32,
    },
    GlobalBatchNotDivisible {
        global: u32,
        gpus: u32,
    },
    KvHeadsNotDivisor {
        kv_heads: u32,
        heads: u32,
    },
    HeadsNotDivisor {
        heads: u32,
        hidden: u32,
    },
}

/// A message: the part after `field: `, or a sentence that names the
/// field itself first.
enum Said {
    After(String),
    Sentence(String),
}

impl WorkloadError {
    /// The field at fault.
    pub fn field(&self) -> WorkloadField {
        use WorkloadError as E;
        use WorkloadField as F;
        match self {
            E::NotPositive { field, .. }
            | E::Missing { field }
            | E::Empty { field }
            | E::LoraWithFull { field } => *field,
            E::UnknownModel { .. } | E::ModelTwice => F::Model,
            E::LoraNeedsRank | E::LoraRankTooLarge { .. } => F::LoraRank,
            E::SeqTooLong { .. } => F::SeqLen,
            E::GlobalBatchNotDivisible { .. } => F::GlobalBatch,
            E::KvHeadsNotDivisor { .. } => F::KvHeads,
            E::HeadsNotDivisor { .. } => F::Heads,
        }
    }

    fn said(&self, names: &dyn FieldNames) -> Said {
        use WorkloadError as E;
        use WorkloadField as F;
        let n = |f: WorkloadField| names.name(f);
        match self {
            E::NotPositive { field, value } => {
                let name = n(*field);
                let hint = match field {
                    F::SeqLen => {
                        format!("give the training sequence length in tokens, e.g. {name} 2048")
                    }
                    F::Gpus => format!("give the number of data-parallel GPUs, e.g. {name} 1"),
                    F::GlobalBatch => "give the global batch in samples, or leave it out".into(),
                    F::LoraRank => "typical ranks are 8–64".into(),
                    _ => "describe the model with positive numbers".into(),
                };
                Said::Sentence(format!(
                    "{name} must be a positive number (got {value}): {hint}"
                ))
            }
            E::Missing { field } => Said::After(match field {
                F::Model => "missing: give a catalog model id (e.g. meta-llama/Llama-3.1-8B; `gpufit models` lists them) or the architecture numbers".into(),
                F::SeqLen => "missing: give the training sequence length in tokens, e.g. 2048".into(),
                F::ArchName => "missing: name the model so similar runs can be found in the history".into(),
                _ => "missing: give the number from the model's config.json".into(),
            }),
            E::Empty { field: F::LoraTargets } => Said::After(
                "is empty: list the layers that get adapters (q, k, v, o, gate, up, down, lm_head) or leave it out".into(),
            ),
            E::Empty { .. } => Said::After("is empty".into()),
            E::UnknownModel { message } => Said::After(message.clone()),
            E::ModelTwice => Said::After(
                "both `model` and `architecture` are set: give one of them".into(),
            ),
            E::LoraWithFull { .. } => Said::After(format!(
                "is set but the method is `full`: use {} lora or qlora, or drop {}/{}",
                n(F::Method),
                n(F::LoraRank),
                n(F::LoraTargets)
            )),
            E::LoraNeedsRank => Said::After("missing: LoRA/QLoRA needs a rank".into()),
            E::SeqTooLong {
                model,
                seq_len,
                max,
            } => {
                let name = n(F::SeqLen);
                Said::Sentence(format!(
                    "{name} {seq_len} is longer than {model}'s context of {max} tokens: use {name} {max} or less"
                ))
            }
            E::LoraRankTooLarge {
                model,
                rank,
                hidden,
            } => Said::Sentence(format!(
                "{} {rank} is larger than the hidden size {hidden} of {model}: use a rank of at most {hidden} (typically 8–64)",
                n(F::LoraRank)
            )),
            E::GlobalBatchNotDivisible { global, gpus } => Said::Sentence(format!(
                "{} {global} is not divisible by {gpus} data-parallel GPUs: choose {} as a multiple of {}",
                n(F::GlobalBatch),
                n(F::GlobalBatch),
                n(F::Gpus)
            )),
            E::KvHeadsNotDivisor { kv_heads, heads } => Said::Sentence(format!(
                "{} {kv_heads} does not divide {} {heads}: grouped-query attention shares each key/value head among an equal number of attention heads",
                n(F::KvHeads),
                n(F::Heads)
            )),
            E::HeadsNotDivisor { heads, hidden } => Said::Sentence(format!(
                "{} {heads} does not divide {} {hidden}: each attention head gets hidden size / heads dimensions",
                n(F::Heads),
                n(F::HiddenSize)
            )),
        }
    }

    /// The field's name and what is wrong, in `names`' words (the message
    /// may itself start with the field's name).
    pub fn parts(&self, names: &dyn FieldNames) -> (String, String) {
        let name = names.name(self.field());
        match self.said(names) {
            Said::After(m) | Said::Sentence(m) => (name, m),
        }
    }

    /// The whole message in `names`' words, the field at fault first.
    pub fn render(&self, names: &dyn FieldNames) -> String {
        match self.said(names) {
            Said::After(m) => format!("{}: {m}", names.name(self.field())),
            Said::Sentence(m) => m,
        }
    }
}

/// Transformer family layout, which decides the per-layer activation terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum ArchKind {
    /// GPT / Llama style causal LM.
    DecoderOnly,
    /// BERT style encoder (MLM head over the vocabulary).
    EncoderOnly,
    /// T5 style encoder–decoder (layers counted per stack).
    EncoderDecoder,
}

/// Architecture numbers of a model, as its Hugging Face `config.json` gives them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ModelArch {
    /// Canonical id (Hugging Face id for catalog models).
    pub name: String,
    pub kind: ArchKind,
    /// Total parameters (all experts counted for MoE).
    pub params: u64,
    pub hidden_size: u32,
    /// Transformer blocks (for encoder–decoder: encoder + decoder blocks).
    pub num_layers: u32,
    pub num_attention_heads: u32,
    pub num_kv_heads: u32,
    /// Per-head dimension; hidden_size / heads when the config does not say.
    pub head_dim: u32,
    pub intermediate_size: u32,
    pub vocab_size: u32,
    pub tied_embeddings: bool,
    /// Gated MLP (SwiGLU/GeGLU: gate, up, down) versus plain two-matrix MLP.
    pub gated_mlp: bool,
    /// Experts per MoE layer (1 = dense).
    pub num_experts: u32,
    /// Experts each token is routed to (1 = dense).
    pub experts_per_token: u32,
    /// Longest sequence the model supports.
    pub max_position_embeddings: u32,
    /// Family details that change what a block saves for backward.
    #[serde(default)]
    pub quirks: ArchQuirks,
}

impl ModelArch {
    /// The architecture's own consistency, whatever gave it (catalog,
    /// config.json, numbers): positive sizes, and key/value heads that
    /// divide the attention heads.
    pub fn check(&self) -> Result<(), WorkloadError> {
        for (field, v) in [
            (WorkloadField::Params, self.params),
            (WorkloadField::HiddenSize, self.hidden_size as u64),
            (WorkloadField::Layers, self.num_layers as u64),
            (WorkloadField::Heads, self.num_attention_heads as u64),
            (WorkloadField::VocabSize, self.vocab_size as u64),
        ] {
            if v == 0 {
                return Err(WorkloadError::NotPositive { field, value: 0 });
            }
        }
        let (kv, heads) = (self.num_kv_heads, self.num_attention_heads);
        if kv == 0 || kv > heads || !heads.is_multiple_of(kv) {
            return Err(WorkloadError::KvHeadsNotDivisor {
                kv_heads: kv,
                heads,
            });
        }
        if self.head_dim == 0 {
            return Err(WorkloadError::HeadsNotDivisor {
                heads,
                hidden: self.hidden_size,
            });
        }
        Ok(())
    }

    /// Experts a token passes through (1 for a dense model).
    pub fn active_experts(&self) -> f64 {
        self.experts_per_token.max(1).min(self.num_experts.max(1)) as f64
    }

    /// Norms a block has: Gemma 2's four (before and after attention and
    /// MLP), one shared by both branches (Phi, Falcon-7B), else two.
    pub fn norms_per_block(&self) -> f64 {
        if self.quirks.sandwich_norms {
            4.0
        } else if self.quirks.single_norm {
            1.0
        } else {
            2.0
        }
    }
}

/// What some families do differently inside a block, read from their
/// `config.json` (see `memory::activations::layer_activations` for what each costs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, rename_all = "camelCase")]
pub struct ArchQuirks {
    /// The MLP activation is transformers' Python `NewGELUActivation`
    /// (`gelu_new`: GPT-2, Phi-2), whose mul/pow/tanh each save a tensor;
    /// exact or fused GELU (`gelu`, `gelu_pytorch_tanh`) saves only its input.
    pub composite_gelu: bool,
    /// Norms before *and* after attention and MLP (Gemma 2: four per block).
    pub sandwich_norms: bool,
    /// `attn_logit_softcapping`: eager attention keeps `tanh(scores / cap)`.
    pub attn_softcapping: bool,
    /// `final_logit_softcapping`: the head keeps `tanh(logits / cap)`.
    pub final_softcapping: bool,
    /// Its SDPA call runs PyTorch's math kernel, which materialises the
    /// score matrix like eager attention: Falcon-7B/40B hand one shared K/V
    /// head with an explicit mask to `scaled_dot_product_attention`, which
    /// the flash and memory-efficient kernels do not take (measured on the
    /// H100: Falcon-7B LoRA at 2,048 tokens holds 61 GB with "sdpa", the
    /// size of eager scores; bench/data/h100/holdout.csv).
    pub sdpa_math_fallback: bool,
    /// Eager attention runs softmax in the activations' dtype without
    /// dropout (transformers' Falcon: `F.softmax(..., dtype=hidden_states.dtype)`),
    /// not in fp32.
    pub attn_softmax_16bit: bool,
    /// Eager attention calls a plain `softmax(scores)` (then dropout) in
    /// the scores' dtype, without the fp32 upcast of the Llama family's
    /// code: BERT, DistilBERT, RoBERTa and GPT-2 in transformers. Only pure
    /// 16-bit training sees it: autocast runs softmax in fp32 anyway.
    pub attn_softmax_no_upcast: bool,
    /// q, k and v come from one fused projection (GPT-NeoX
    /// `query_key_value`, Phi-3 `qkv_proj`, GPT-2 `c_attn`, Falcon): a LoRA
    /// on "q and v" is one adapter there.
    pub fused_qkv: bool,
    /// Attention and MLP both read the block input (`x + attn(ln1(x)) +
    /// mlp(ln2(x))`: GPT-NeoX's `use_parallel_residual`, Phi, Falcon's
    /// `parallel_attn`), so the norms' saved input is one tensor, not two.
    pub parallel_residual: bool,
    /// One norm feeds both branches (Phi's single `input_layernorm`,
    /// Falcon-7B without `new_decoder_architecture`).
    pub single_norm: bool,
    /// The block's residual dropout probability is 0 (`hidden_dropout`,
    /// `resid_pdrop`): no masks are kept.
    pub no_resid_dropout: bool,
    /// The attention-probability dropout is 0 (`attention_dropout`,
    /// `attn_pdrop`): eager attention keeps no mask.
    pub no_attn_dropout: bool,
    /// Rotary embedding on part of each head only (GPT-NeoX `rotary_pct`,
    /// Phi/StableLM `partial_rotary_factor` below 1): `torch.cat` of the
    /// rotated and the passed-through parts lays q out head-major.
    pub partial_rotary: bool,
    /// The rotary embedding's cos/sin take the value's dtype (transformers'
    /// Falcon), not the hidden states' (the Llama family): under autocast
    /// q and k stay 16-bit instead of turning fp32.
    pub rotary_in_value_dtype: bool,
    /// The MLP's gate and up projections are one fused linear (Phi-3's
    /// `gate_up_proj`): under autocast it casts its input once, not twice.
    pub fused_gate_up: bool,
    /// One residual-branch dropout per block, not two (DistilBERT: its
    /// attention output goes to the norm undropped; the FFN's is dropped).
    pub one_resid_dropout: bool,
    /// q, k and v are views of one fused projection's output with no
    /// rotary step between (GPT-2's `c_attn(...).split(...)`): eager
    /// attention's matmul keeps q as a view of the whole output and
    /// reshapes k and v into copies for its batched matmuls.
    pub unrotated_qkv_views: bool,
    /// The norm scales in fp32 (Gemma's `output * (1.0 + weight.float())`):
    /// a trained norm weight keeps the fp32 normalised value for its
    /// gradient, not a 16-bit one.
    pub norm_scale_fp32: bool,
    /// Tokens a query attends back over (config `sliding_window`; 0 when
    /// none): from a sequence that reaches it, transformers hands SDPA an
    /// explicit mask, not `is_causal` (see `memory::StepKernels::
    /// masked_sdpa_layers`).
    pub sliding_window: u32,
    /// Only every other layer has the window (Gemma 2's alternating
    /// `sliding_attention` / `full_attention` layers).
    pub alternating_sliding_window: bool,
}

/// How the model is trained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    Full,
    Lora,
    /// LoRA over a 4-bit NF4 frozen base.
    Qlora,
}

impl Method {
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Full => "full",
            Method::Lora => "lora",
            Method::Qlora => "qlora",
        }
    }
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A linear layer LoRA adapters can be attached to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum LoraTarget {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
    LmHead,
}

/// LoRA adapter configuration (scientific: rank and targets are never changed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct LoraConfig {
    pub rank: u32,
    pub targets: Vec<LoraTarget>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Optimizer {
    Adamw,
    Adamw8bit,
    Sgd,
    Adafactor,
}

impl Optimizer {
    /// The name the CLI and the history use.
    pub fn as_str(self) -> &'static str {
        match self {
            Optimizer::Adamw => "adamw",
            Optimizer::Adamw8bit => "adamw8bit",
            Optimizer::Sgd => "sgd",
            Optimizer::Adafactor => "adafactor",
        }
    }
}

/// Sharding of model state over data-parallel GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Sharding {
    None,
    Zero1,
    Zero2,
    Zero3,
    /// FSDP full sharding: memory like ZeRO-3.
    Fsdp,
}

/// The training framework, whose defaults change memory for the same flags
/// (loss path, LoRA default targets, what the optimizer step keeps).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Framework {
    Generic,
    Hf,
    Torchtune,
    Litgpt,
    Lightning,
}

/// Attention kernel: flash/SDPA keeps O(seq) per head, eager keeps the
/// seq × seq score matrix per head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Attention {
    Sdpa,
    Eager,
}

// === parsing: one FromStr per enum, used by every path ===
//
// The command line, the TrainingJob CRD, the webhook annotations, the Slurm
// hooks and the controller's JSON API all accept the same spellings:
// serde deserializes these enums through `FromStr` (the JSON schema still
// lists the canonical names), so an alias that works in one place works in
// all of them (docs/design.md, "Workload resolution").

/// Deserializes an enum through its `FromStr` (the one list of aliases).
macro_rules! deserialize_via_from_str {
    ($($t:ty),*) => {$(
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    )*};
}
deserialize_via_from_str!(Method, LoraTarget, Optimizer, Sharding, Framework, Attention);

/// Lower case, `-` and spaces as `_`: the spellings people use for one name.
fn norm(s: &str) -> String {
    s.trim().to_ascii_lowercase().replace(['-', ' '], "_")
}

impl FromStr for Method {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match norm(s).as_str() {
            "full" | "full_finetune" | "fft" => Ok(Method::Full),
            "lora" => Ok(Method::Lora),
            "qlora" => Ok(Method::Qlora),
            _ => Err(format!(
                "unknown method `{}`: use full, lora or qlora",
                s.trim()
            )),
        }
    }
}

impl Framework {
    /// The name the CLI and the history use (`hf`, `torchtune`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Framework::Generic => "generic",
            Framework::Hf => "hf",
            Framework::Torchtune => "torchtune",
            Framework::Litgpt => "litgpt",
            Framework::Lightning => "lightning",
        }
    }
}

impl std::fmt::Display for Framework {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Framework {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match norm(s).as_str() {
            "generic" | "pytorch" | "torch" => Ok(Framework::Generic),
            "hf" | "huggingface" | "transformers" | "trl" => Ok(Framework::Hf),
            "torchtune" | "tune" => Ok(Framework::Torchtune),
            "litgpt" => Ok(Framework::Litgpt),
            "lightning" | "pytorch_lightning" | "pl" => Ok(Framework::Lightning),
            _ => Err(format!(
                "unknown framework `{}`: use generic, hf, torchtune, litgpt or lightning",
                s.trim()
            )),
        }
    }
}

impl FromStr for Optimizer {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        // Punctuation-free: `adamw_torch_fused`, `paged-adamw-8bit`, `AdamW8bit`.
        let n: String = s
            .trim()
            .to_ascii_lowercase()
            .chars()
            .filter(|c| c.is_ascii_alphanumeric())
            .collect();
        match n.as_str() {
            "adamw" | "adam" | "adamwtorch" | "adamwtorchfused" => Ok(Optimizer::Adamw),
            "adamw8bit" | "adam8bit" | "adamwbnb8bit" | "pagedadamw8bit" | "bnbadamw8bit" => {
                Ok(Optimizer::Adamw8bit)
            }
            "sgd" | "sgdmomentum" => Ok(Optimizer::Sgd),
            "adafactor" => Ok(Optimizer::Adafactor),
            _ => Err(format!(
                "unknown optimizer `{}`: use adamw, adamw8bit, sgd or adafactor",
                s.trim()
            )),
        }
    }
}

impl FromStr for Sharding {
    type Err = String;
    /// `none`, `zero1`–`zero3`, `fsdp`; a bare ZeRO stage `0`–`3` as the
    /// command line's `--zero` and Slurm's `GPUFIT_ZERO` give it.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match norm(s).replace('_', "").as_str() {
            "none" | "0" | "zero0" | "ddp" => Ok(Sharding::None),
            "zero1" | "1" => Ok(Sharding::Zero1),
            "zero2" | "2" => Ok(Sharding::Zero2),
            "zero3" | "3" => Ok(Sharding::Zero3),
            "fsdp" | "fullshard" => Ok(Sharding::Fsdp),
            _ => Err(format!(
                "unknown sharding `{}`: use none, zero1, zero2, zero3 or fsdp (ZeRO stage 0-3)",
                s.trim()
            )),
        }
    }
}

impl FromStr for Attention {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match norm(s).as_str() {
            "sdpa" | "flash" | "flash_attention" | "flash_attention_2" | "flash_attn" => {
                Ok(Attention::Sdpa)
            }
            "eager" | "math" => Ok(Attention::Eager),
            _ => Err(format!(
                "unknown attention `{}`: use sdpa or eager",
                s.trim()
            )),
        }
    }
}

impl LoraTarget {
    /// The targets one name stands for: a layer (`q`, `q_proj`, `w1`), or a
    /// group (`all-linear`: every linear of the blocks, PEFT's spelling;
    /// `mlp`). torchtune's `output_proj` is the attention output (`o`).
    fn group(name: &str) -> Option<&'static [LoraTarget]> {
        use LoraTarget::*;
        let n = norm(name);
        Some(match n.trim_end_matches("_proj") {
            "all_linear" | "all" => &[Q, K, V, O, Gate, Up, Down],
            "q" | "query" => &[Q],
            "k" | "key" => &[K],
            "v" | "value" => &[V],
            "o" | "output" | "out" | "dense" => &[O],
            "gate" | "w1" => &[Gate],
            "up" | "w3" => &[Up],
            "down" | "w2" => &[Down],
            "lm_head" | "head" | "output_head" => &[LmHead],
            "mlp" => &[Gate, Up, Down],
            _ => return None,
        })
    }

    /// A list of targets: names separated by `,` (or `+` / `:`, which a
    /// Slurm job comment needs because `,` separates its pairs); groups
    /// expanded, duplicates dropped, sorted. Empty is an error.
    pub fn parse_list(s: &str) -> Result<Vec<LoraTarget>, String> {
        let mut out = Vec::new();
        for part in s
            .split([',', '+', ':'])
            .map(str::trim)
            .filter(|p| !p.is_empty())
        {
            let targets = LoraTarget::group(part).ok_or_else(|| {
                format!("unknown target `{part}`: use a comma list of q,k,v,o,gate,up,down,lm_head, or all-linear")
            })?;
            for t in targets {
                if !out.contains(t) {
                    out.push(*t);
                }
            }
        }
        if out.is_empty() {
            return Err(
                "is empty: name at least one of q,k,v,o,gate,up,down,lm_head, or all-linear".into(),
            );
        }
        out.sort();
        Ok(out)
    }
}

impl FromStr for LoraTarget {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match LoraTarget::group(s) {
            Some([one]) => Ok(*one),
            _ => Err(format!(
                "`{}` is not one of q, k, v, o, gate, up, down, lm_head",
                s.trim()
            )),
        }
    }
}

/// Everything that describes what is trained.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Workload {
    pub model: ModelArch,
    pub method: Method,
    /// Required for LoRA / QLoRA.
    pub lora: Option<LoraConfig>,
    pub seq_len: u32,
    pub optimizer: Optimizer,
    /// Global batch size G (scientific). None: gpufit sets only the micro batch.
    pub global_batch: Option<u32>,
    /// Data-parallel GPUs W.
    pub gpus: u32,
    pub sharding: Sharding,
    pub framework: Framework,
    pub attention: Attention,
}

impl Workload {
    /// Checks the workload's internal consistency (positive sizes, sequence
    /// within context, LoRA rank within hidden size, G divisible by W).
    pub fn validate(&self) -> Result<(), WorkloadError> {
        let zero = |field| WorkloadError::NotPositive { field, value: 0 };
        if self.seq_len == 0 {
            return Err(zero(WorkloadField::SeqLen));
        }
        if self.gpus == 0 {
            return Err(zero(WorkloadField::Gpus));
        }
        self.model.check()?;
        if self.model.max_position_embeddings > 0
            && self.seq_len > self.model.max_position_embeddings
        {
            return Err(WorkloadError::SeqTooLong {
                model: self.model.name.clone(),
                seq_len: self.seq_len,
                max: self.model.max_position_embeddings,
            });
        }
        if let Some(g) = self.global_batch {
            if g == 0 {
                return Err(zero(WorkloadField::GlobalBatch));
            }
            if g % self.gpus != 0 {
                return Err(WorkloadError::GlobalBatchNotDivisible {
                    global: g,
                    gpus: self.gpus,
                });
            }
        }
        if matches!(self.method, Method::Lora | Method::Qlora) {
            let Some(lora) = &self.lora else {
                return Err(WorkloadError::LoraNeedsRank);
            };
            if lora.rank == 0 {
                return Err(zero(WorkloadField::LoraRank));
            }
            if lora.rank > self.model.hidden_size {
                return Err(WorkloadError::LoraRankTooLarge {
                    model: self.model.name.clone(),
                    rank: lora.rank,
                    hidden: self.model.hidden_size,
                });
            }
        }
        Ok(())
    }
}
