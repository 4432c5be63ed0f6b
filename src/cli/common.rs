//! Flags shared by several commands: the workload description, pinned
//! engineering settings, and the history store.

use crate::core::workload::Workload;

/// `on` / `off` switch for flags like `--checkpointing`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

impl OnOff {
    pub fn as_bool(self) -> bool {
        self == OnOff::On
    }
}

/// What is trained.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkloadArgs {
    /// Model: catalog id (`meta-llama/Llama-3.1-8B`, `llama-3.1-8b`), torchtune
    /// config name or component path, or a path to a Hugging Face config.json.
    #[arg(long, env = "GPUFIT_MODEL")]
    pub model: Option<String>,
    /// Total parameters, for a model not in the catalog (e.g. `7e9`).
    #[arg(long)]
    pub params: Option<f64>,
    /// Hidden size (with --params).
    #[arg(long)]
    pub hidden_size: Option<u32>,
    /// Transformer layers (with --params).
    #[arg(long)]
    pub layers: Option<u32>,
    /// Attention heads (with --params).
    #[arg(long)]
    pub heads: Option<u32>,
    /// Key/value heads for grouped-query attention (with --params).
    #[arg(long)]
    pub kv_heads: Option<u32>,
    /// MLP intermediate size (with --params).
    #[arg(long)]
    pub intermediate_size: Option<u32>,
    /// Vocabulary size (with --params).
    #[arg(long)]
    pub vocab_size: Option<u32>,
    /// Input and output embeddings share weights (with --params).
    #[arg(long)]
    pub tied_embeddings: bool,
    /// Training method: full, lora or qlora.
    #[arg(long, env = "GPUFIT_METHOD")]
    pub method: Option<String>,
    /// LoRA rank (scientific: never changed by gpufit).
    #[arg(long, env = "GPUFIT_LORA_RANK")]
    pub lora_rank: Option<u32>,
    /// LoRA targets: comma list of q,k,v,o,gate,up,down,lm_head, or all-linear.
    #[arg(long)]
    pub lora_targets: Option<String>,
    /// Framework whose defaults decide memory: generic, hf, torchtune, litgpt, lightning.
    #[arg(long, default_value = "generic", env = "GPUFIT_FRAMEWORK")]
    pub framework: String,
    /// Training sequence length in tokens.
    #[arg(long, env = "GPUFIT_SEQ_LEN")]
    pub seq_len: Option<u32>,
    /// Optimizer: adamw, adamw8bit, sgd, adafactor.
    #[arg(long, default_value = "adamw", env = "GPUFIT_OPTIMIZER")]
    pub optimizer: String,
    /// Global batch size (scientific: kept exactly via gradient accumulation).
    #[arg(long, env = "GPUFIT_GLOBAL_BATCH")]
    pub global_batch: Option<u32>,
    /// Data-parallel GPUs.
    #[arg(long, default_value_t = 1, env = "GPUFIT_GPUS")]
    pub gpus: u32,
    /// ZeRO stage 0–3 (3 = FSDP full shard).
    #[arg(long, default_value_t = 0)]
    pub zero: u8,
    /// Attention kernel: sdpa (flash) or eager.
    #[arg(long, default_value = "sdpa")]
    pub attention: String,
}

impl WorkloadArgs {
    /// Resolves the flags into a validated workload.
    pub fn resolve(&self) -> crate::Result<Workload> {
        Err(crate::Error::Usage(
            "workload resolution is not implemented yet".into(),
        ))
    }
}
