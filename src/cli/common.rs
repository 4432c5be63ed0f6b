//! Flags shared by several commands: the workload description, pinned
//! engineering settings, and the history store.

use std::path::Path;

use crate::core::advisor::{Change, ChangeNames};
use crate::core::catalog::{
    all_models, arch_from_hf_config, lookup_model, small_task_head_in_hf_config,
};
use crate::core::request::{ArchNumbers, ModelRequest, WorkloadRequest};
use crate::core::workload::{
    ArchKind, Attention, FieldNames, Framework, LoraTarget, Method, ModelArch, Optimizer, Sharding,
    Workload, WorkloadField,
};

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
    /// The flags as a workload request (the model read here: a config.json
    /// path is the command line's own). Enum values are parsed by the core's
    /// `FromStr`, the same aliases as every other path.
    pub fn request(&self) -> crate::Result<WorkloadRequest> {
        let (arch, implied_method) = self.base_model()?;
        let base = ModelRequest::Arch {
            arch,
            implied_method,
        };
        // The shape flags change the model; the core checks the numbers.
        let numbers = ArchNumbers {
            params: self.params.map(params_count).transpose()?,
            hidden_size: self.hidden_size,
            layers: self.layers,
            heads: self.heads,
            kv_heads: self.kv_heads,
            intermediate_size: self.intermediate_size,
            vocab_size: self.vocab_size,
            tied_embeddings: self.tied_embeddings.then_some(true),
            ..ArchNumbers::default()
        };
        let model = if numbers == ArchNumbers::default() {
            base
        } else {
            ModelRequest::Numbers {
                base: Some(Box::new(base)),
                numbers,
            }
        };
        let method = match &self.method {
            Some(m) => Some(m.parse::<Method>().map_err(|e| usage("--method", &e))?),
            None => None,
        };
        let lora_targets = match &self.lora_targets {
            Some(t) => Some(parse_lora_targets(t)?),
            None => None,
        };
        Ok(WorkloadRequest {
            model: Some(model),
            method,
            lora_rank: self.lora_rank,
            lora_targets,
            seq_len: self.seq_len,
            optimizer: Some(parse_optimizer(&self.optimizer)?),
            global_batch: self.global_batch,
            gpus: Some(self.gpus),
            sharding: Some(parse_zero(self.zero)?),
            framework: Some(parse_framework(&self.framework)?),
            attention: Some(parse_attention(&self.attention)?),
        })
    }

    /// Resolves the flags into a validated workload (the core's one
    /// resolver: docs/design.md, "Workload resolution").
    pub fn resolve(&self) -> crate::Result<Workload> {
        Ok(self.request()?.resolve()?)
    }

    /// Whether `--model` is a config.json whose `architectures` names a
    /// small task head (a classifier): what `from_pretrained` builds.
    /// `false` for catalog ids (their heads are the LM heads).
    pub fn config_names_small_head(&self) -> crate::Result<bool> {
        let Some(m) = &self.model else {
            return Ok(false);
        };
        let path = Path::new(m);
        if m.ends_with(".json") || path.is_dir() || path.is_file() {
            let (_, text) = config_text(path)?;
            Ok(small_task_head_in_hf_config(&text))
        } else {
            Ok(false)
        }
    }

    /// The model the shape flags start from: `--model` (catalog name or
    /// config.json path), else the catalog shape closest to `--params`;
    /// plus the method the name implies (torchtune recipe names).
    fn base_model(&self) -> crate::Result<(ModelArch, Option<Method>)> {
        match (&self.model, self.params) {
            (Some(m), _) => {
                let path = Path::new(m);
                if m.ends_with(".json") || path.is_dir() || path.is_file() {
                    Ok((read_config(path)?, None))
                } else {
                    let r = lookup_model(m)?;
                    Ok((r.arch, r.method))
                }
            }
            (None, Some(p)) => Ok((arch_from_params(p)?, None)),
            (None, None) => Err(crate::Error::Usage(
                "no model given: pass --model (a catalog id such as meta-llama/Llama-3.1-8B, see `gpufit models`, or a config.json path) or --params 7e9"
                    .into(),
            )),
        }
    }
}

/// The command line's names for the workload's fields: its flags.
pub struct CliNames;

impl FieldNames for CliNames {
    fn name(&self, field: WorkloadField) -> String {
        use WorkloadField as F;
        match field {
            F::Sharding => "--zero",
            // The command line names a model (`--model`), not its name or
            // context alone.
            F::Model | F::ArchName | F::MaxSeqLen => "--model",
            F::Method => "--method",
            F::LoraRank => "--lora-rank",
            F::LoraTargets => "--lora-targets",
            F::SeqLen => "--seq-len",
            F::Optimizer => "--optimizer",
            F::GlobalBatch => "--global-batch",
            F::Gpus => "--gpus",
            F::Framework => "--framework",
            F::Attention => "--attention",
            F::Params => "--params",
            F::HiddenSize => "--hidden-size",
            F::Layers => "--layers",
            F::Heads => "--heads",
            F::KvHeads => "--kv-heads",
            F::IntermediateSize => "--intermediate-size",
            F::VocabSize => "--vocab-size",
        }
        .to_string()
    }
}

/// How the command line says to make a change that would fit: its flags.
pub struct CliChanges;

impl ChangeNames for CliChanges {
    fn how(&self, change: Change) -> String {
        match change {
            Change::PureBf16 { dtype_pinned: true } => "--dtype bf16".into(),
            Change::PureBf16 {
                dtype_pinned: false,
            } => "--pure-bf16 allow".into(),
            Change::Checkpointing => "--checkpointing on".into(),
            Change::Offloading => "--offloading on".into(),
            Change::Optimizer8bit => "--optimizer adamw8bit".into(),
            Change::Qlora { rank } => format!("--method qlora --lora-rank {rank}"),
            Change::Zero3 { gpus } => format!("--zero 3 --gpus {gpus}"),
        }
    }
}

fn usage(flag: &str, msg: &str) -> crate::Error {
    crate::Error::Usage(format!("{flag}: {msg}"))
}

/// Reads a Hugging Face config.json (or a directory holding one).
fn read_config(path: &Path) -> crate::Result<ModelArch> {
    let (file, text) = config_text(path)?;
    Ok(arch_from_hf_config(&file.display().to_string(), &text)?)
}

/// The config.json at `path` (a file, or a directory holding one).
fn config_text(path: &Path) -> crate::Result<(std::path::PathBuf, String)> {
    let file = if path.is_dir() {
        path.join("config.json")
    } else {
        path.to_path_buf()
    };
    let text = std::fs::read_to_string(&file).map_err(|e| {
        crate::Error::Usage(format!(
            "--model {}: cannot read the config ({e}); give a catalog id (see `gpufit models`) or the path of a Hugging Face config.json",
            file.display()
        ))
    })?;
    Ok((file, text))
}

/// `--params 7e9`, `7B`, `1.5b`, `350M`: a positive parameter count.
fn params_count(p: f64) -> crate::Result<u64> {
    if !p.is_finite() || p < 1.0 {
        return Err(usage(
            "--params",
            &format!("must be a positive parameter count (got {p}), e.g. --params 7e9"),
        ));
    }
    Ok(p.round() as u64)
}

/// A model described only by its size: the shape of the catalog's
/// closest dense decoder (so activations scale plausibly), with the given
/// parameter count. Shape flags then override it.
fn arch_from_params(p: f64) -> crate::Result<ModelArch> {
    let n = params_count(p)?;
    let best = all_models()
        .into_iter()
        .filter(|a| a.kind == ArchKind::DecoderOnly && a.num_experts <= 1 && a.gated_mlp)
        .min_by(|a, b| {
            let da = (a.params as f64 / n as f64).ln().abs();
            let db = (b.params as f64 / n as f64).ln().abs();
            da.total_cmp(&db)
        })
        .ok_or_else(|| crate::Error::Usage("the model catalog is empty".into()))?;
    Ok(ModelArch {
        name: format!("custom-{:.2}B", n as f64 / 1e9),
        params: n,
        // unknown context: do not reject any --seq-len
        max_position_embeddings: 0,
        quirks: Default::default(),
        ..best
    })
}

/// `--framework` (the core's `FromStr`: the aliases every path accepts).
pub fn parse_framework(s: &str) -> crate::Result<Framework> {
    s.parse().map_err(|e: String| usage("--framework", &e))
}

/// `--optimizer`.
pub fn parse_optimizer(s: &str) -> crate::Result<Optimizer> {
    s.parse().map_err(|e: String| usage("--optimizer", &e))
}

/// `--attention`.
pub fn parse_attention(s: &str) -> crate::Result<Attention> {
    s.parse().map_err(|e: String| usage("--attention", &e))
}

/// `--zero 0|1|2|3`.
pub fn parse_zero(z: u8) -> crate::Result<Sharding> {
    if z > 3 {
        return Err(usage(
            "--zero",
            &format!("ZeRO stage {z} does not exist: use 0, 1, 2 or 3"),
        ));
    }
    z.to_string()
        .parse()
        .map_err(|e: String| usage("--zero", &e))
}

/// `--lora-targets q,k,v,o,gate,up,down,lm_head` or `all-linear` (PEFT's
/// spelling: every linear of the blocks, not the output head).
pub fn parse_lora_targets(s: &str) -> crate::Result<Vec<LoraTarget>> {
    LoraTarget::parse_list(s).map_err(|e| usage("--lora-targets", &e))
}

/// SIGINT (a terminal) or SIGTERM (systemd, Kubernetes) stops it.
pub(crate) async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        w: WorkloadArgs,
    }

    fn args(a: &[&str]) -> WorkloadArgs {
        let mut v = vec!["t"];
        v.extend_from_slice(a);
        T::try_parse_from(v).unwrap().w
    }

    #[test]
    fn torchtune_recipe_name_implies_lora_with_torchtune_defaults() {
        let w = args(&[
            "--model",
            "llama3_1/8B_lora_single_device",
            "--seq-len",
            "2048",
            "--framework",
            "torchtune",
        ])
        .resolve()
        .unwrap();
        assert_eq!(w.method, Method::Lora);
        assert_eq!(w.lora.unwrap().targets.len(), 6);
    }

    #[test]
    fn explicit_method_wins_over_the_implied_one() {
        let w = args(&[
            "--model",
            "llama3_1/8B_lora_single_device",
            "--seq-len",
            "512",
            "--method",
            "qlora",
        ])
        .resolve()
        .unwrap();
        assert_eq!(w.method, Method::Qlora);
    }

    #[test]
    fn params_alone_describe_a_model() {
        let w = args(&["--params", "7e9", "--seq-len", "4096"])
            .resolve()
            .unwrap();
        assert_eq!(w.model.params, 7_000_000_000);
        assert_eq!(w.model.hidden_size, 4096);
    }

    #[test]
    fn bad_flags_name_the_flag() {
        let e = args(&["--params", "0", "--seq-len", "10"])
            .resolve()
            .unwrap_err();
        assert!(e.to_string().contains("--params"), "{e}");
        let e = args(&["--model", "gpt2"]).resolve().unwrap_err();
        assert!(e.to_string().contains("--seq-len"), "{e}");
        let e = args(&["--model", "gpt2", "--seq-len", "4096"])
            .resolve()
            .unwrap_err();
        assert!(e.to_string().contains("--seq-len"), "{e}");
        let e = args(&[
            "--model",
            "gpt2",
            "--seq-len",
            "64",
            "--method",
            "lora",
            "--lora-rank",
            "4096",
        ])
        .resolve()
        .unwrap_err();
        assert!(e.to_string().contains("--lora-rank"), "{e}");
        let e = args(&["--model", "gpt2", "--seq-len", "64", "--zero", "4"])
            .resolve()
            .unwrap_err();
        assert!(e.to_string().contains("--zero"), "{e}");
        let e = args(&["--model", "gpt2", "--seq-len", "64", "--optimizer", "lion"])
            .resolve()
            .unwrap_err();
        assert!(e.to_string().contains("--optimizer"), "{e}");
    }

    #[test]
    fn lora_targets_parse_all_linear_and_hf_module_names() {
        assert_eq!(parse_lora_targets("all-linear").unwrap().len(), 7);
        assert_eq!(
            parse_lora_targets("q_proj, v_proj").unwrap(),
            vec![LoraTarget::Q, LoraTarget::V]
        );
        assert!(parse_lora_targets("q,zz").is_err());
    }
}

// === tables ===

/// Text as a table cell prints it: control characters (ESC, CR, LF, tab,
/// DEL, C1) escaped as `\u{1b}`, `\r`, `\n` …, so a stored string (a model
/// name, a GPU name, a log line) can neither drive the terminal (clear the
/// screen, move the cursor) nor break a cell into a fake row.
pub fn cell_text(s: &str) -> String {
    if !s.chars().any(char::is_control) {
        return s.to_string();
    }
    s.chars()
        .flat_map(|c| {
            let escaped: Vec<char> = if c.is_control() {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            escaped
        })
        .collect()
}

/// Adds rows of text to a table with [`cell_text`] applied to each cell:
/// how every table gpufit prints takes its rows.
pub trait TextRows {
    fn add_text_row<I, S>(&mut self, row: I) -> &mut Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>;
}

impl TextRows for comfy_table::Table {
    fn add_text_row<I, S>(&mut self, row: I) -> &mut Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        self.add_row(
            row.into_iter()
                .map(|c| cell_text(c.as_ref()))
                .collect::<Vec<_>>(),
        )
    }
}

#[cfg(test)]
mod table_tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_in_cells_and_text_is_kept() {
        assert_eq!(cell_text("llama-3 ü"), "llama-3 ü");
        assert_eq!(cell_text("m\u{1b}[2J\r\nfake"), "m\\u{1b}[2J\\r\\nfake");
        let mut t = comfy_table::Table::new();
        t.add_text_row(["a\u{1b}[H", "b"]);
        let out = t.to_string();
        assert!(!out.contains('\u{1b}'), "{out:?}");
        assert!(out.contains("a\\u{1b}[H"), "{out}");
    }
}
