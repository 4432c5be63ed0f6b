//! `gpufit apply`: writes suggested engineering settings into a torchtune,
//! Hugging Face or Lightning YAML config, keeping every earlier backup
//! (`FILE.bak`, `FILE.bak.1`, …). A symlinked config is written through the
//! link; mode and line endings are kept; the framework is read from the
//! file's keys when they tell it.
//!
//! The file is edited line by line so comments and layout survive; the
//! result is then parsed and compared with the original: every key except
//! the engineering keys written here must be identical, or nothing is
//! written. Scientific keys (learning rate, LoRA rank, data, epochs, seed,
//! sequence length) therefore cannot change.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use serde::Serialize;
use serde_yaml::Value;

use super::suggest::AdviceArgs;
use super::{print_json, Global, OutputFormat};
use crate::core::advisor::{Strategy, Suggestion};
use crate::core::settings::{Dtype, EngineeringSettings};

/// Config layouts gpufit can write (chosen with the workload's `--framework`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ConfigFramework {
    /// torchtune recipe config (`batch_size`, `enable_activation_checkpointing`, …).
    Torchtune,
    /// Hugging Face `TrainingArguments` YAML (`per_device_train_batch_size`, …).
    Hf,
    /// LightningCLI config (`trainer.precision`, `data.batch_size`, …).
    Lightning,
}

#[derive(Debug, clap::Args)]
pub struct ApplyArgs {
    /// The YAML config to update (backups: FILE.bak, then FILE.bak.1, …).
    #[arg(long)]
    pub config: PathBuf,
    /// A suggestion saved with `gpufit suggest --output json` (`-` for
    /// stdin). Without it, the advisor is asked with the flags below.
    #[arg(long)]
    pub suggestion: Option<String>,
    /// Strategy when asking the advisor.
    #[arg(long, default_value = "balanced")]
    pub strategy: Strategy,
    /// Show the changes without writing anything.
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    pub advice: AdviceArgs,
}

/// One key written.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Change {
    pub key: String,
    pub old: Option<String>,
    pub new: String,
}

#[derive(Debug, Serialize)]
struct Applied {
    config: String,
    backup: Option<String>,
    framework: ConfigFramework,
    changes: Vec<Change>,
    warnings: Vec<String>,
}

pub fn run(g: &Global, args: ApplyArgs) -> crate::Result<ExitCode> {
    let original = std::fs::read_to_string(&args.config).map_err(|e| crate::Error::Io {
        context: format!("cannot read config {}", args.config.display()),
        source: e,
    })?;
    let framework = choose_framework(&args.advice.workload.framework, &original)?;
    let settings = match &args.suggestion {
        Some(src) => read_suggestion(src)?.settings,
        None => args.advice.resolve()?.suggest(args.strategy)?.settings,
    };
    let (updated, changes, warnings) = apply_to_text(&original, framework, &settings)?;
    let mut backup = None;
    if !args.dry_run && updated != original {
        // Through a symlink: the file it points to is updated, the link kept.
        let target = std::fs::canonicalize(&args.config).map_err(|e| crate::Error::Io {
            context: format!("cannot resolve config {}", args.config.display()),
            source: e,
        })?;
        let bak = backup_path(&args.config);
        std::fs::copy(&target, &bak).map_err(|e| crate::Error::Io {
            context: format!("cannot write backup {}", bak.display()),
            source: e,
        })?;
        write_atomically(&target, &updated)?;
        backup = Some(bak.display().to_string());
    }
    let out = Applied {
        config: args.config.display().to_string(),
        backup,
        framework,
        changes,
        warnings,
    };
    match g.output {
        OutputFormat::Json => print_json(&out)?,
        OutputFormat::Table => {
            for c in &out.changes {
                println!(
                    "{}: {} → {}",
                    c.key,
                    c.old.as_deref().unwrap_or("(unset)"),
                    c.new
                );
            }
            if out.changes.is_empty() {
                println!("{} already has these settings.", out.config);
            } else if let Some(b) = &out.backup {
                println!("Wrote {} (backup: {b}).", out.config);
            } else {
                println!("Dry run: {} not changed.", out.config);
            }
            for w in &out.warnings {
                println!("warning: {w}");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn read_suggestion(src: &str) -> crate::Result<Suggestion> {
    let text = if src == "-" {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s).map_err(|e| {
            crate::Error::Io {
                context: "cannot read the suggestion from stdin".into(),
                source: e,
            }
        })?;
        s
    } else {
        std::fs::read_to_string(src).map_err(|e| crate::Error::Io {
            context: format!("cannot read suggestion {src}"),
            source: e,
        })?
    };
    serde_json::from_str(&text).map_err(|e| {
        crate::Error::Usage(format!(
            "--suggestion {src} is not a gpufit suggestion ({e}): save one with `gpufit suggest … --output json > s.json`"
        ))
    })
}

/// `--framework` when it names a config layout, else what the file's keys
/// say. A given framework the file contradicts is refused: writing its keys
/// would add foreign ones.
fn choose_framework(flag: &str, text: &str) -> crate::Result<ConfigFramework> {
    let given = match flag.trim().to_ascii_lowercase().as_str() {
        "torchtune" => Some(ConfigFramework::Torchtune),
        "hf" | "huggingface" | "transformers" => Some(ConfigFramework::Hf),
        "lightning" => Some(ConfigFramework::Lightning),
        "generic" | "" => None,
        other => {
            return Err(crate::Error::Usage(format!(
                "gpufit apply writes torchtune, hf or lightning configs (got --framework {other}): pass --framework torchtune|hf|lightning"
            )))
        }
    };
    let detected = detect_framework(text);
    match (given, detected) {
        (Some(g), Some((d, key))) if g != d => Err(crate::Error::Usage(format!(
            "the config is a {} config (it has `{key}`), not {}: nothing was written; pass --framework {} or the right file",
            d.name(),
            g.name(),
            d.name()
        ))),
        (Some(g), _) => Ok(g),
        (None, Some((d, _))) => Ok(d),
        (None, None) => Err(crate::Error::Usage(
            "cannot tell the config's framework from its keys: pass --framework torchtune|hf|lightning".into(),
        )),
    }
}

/// The framework a config's keys mark (with the key that tells), when
/// exactly one does.
pub fn detect_framework(text: &str) -> Option<(ConfigFramework, &'static str)> {
    let v: Value = serde_yaml::from_str(text).ok()?;
    let top = |k: &str| v.get(k).is_some();
    let torchtune = ["enable_activation_checkpointing", "_component_"]
        .into_iter()
        .find(|k| top(k) || (*k == "_component_" && has_key_anywhere(&v, k)));
    let hf = [
        "per_device_train_batch_size",
        "gradient_checkpointing",
        "num_train_epochs",
        "torch_compile",
    ]
    .into_iter()
    .find(|k| top(k));
    let lightning = ["trainer", "seed_everything"].into_iter().find(|k| top(k));
    let found: Vec<(ConfigFramework, &'static str)> = [
        torchtune.map(|k| (ConfigFramework::Torchtune, k)),
        hf.map(|k| (ConfigFramework::Hf, k)),
        lightning.map(|k| (ConfigFramework::Lightning, k)),
    ]
    .into_iter()
    .flatten()
    .collect();
    match found.as_slice() {
        [one] => Some(*one),
        _ => None,
    }
}

fn has_key_anywhere(v: &Value, key: &str) -> bool {
    match v {
        Value::Mapping(m) => m
            .iter()
            .any(|(k, v)| k.as_str() == Some(key) || has_key_anywhere(v, key)),
        Value::Sequence(s) => s.iter().any(|v| has_key_anywhere(v, key)),
        _ => false,
    }
}

impl ConfigFramework {
    fn name(self) -> &'static str {
        match self {
            ConfigFramework::Torchtune => "torchtune",
            ConfigFramework::Hf => "hf",
            ConfigFramework::Lightning => "lightning",
        }
    }
}

/// The first free backup name: `FILE.bak`, then `FILE.bak.1`, `FILE.bak.2`…
/// so every earlier backup (the original among them) is kept.
fn backup_path(p: &Path) -> PathBuf {
    let with = |suffix: String| {
        let mut s = p.as_os_str().to_owned();
        s.push(suffix);
        PathBuf::from(s)
    };
    let first = with(".bak".into());
    if std::fs::symlink_metadata(&first).is_err() {
        return first;
    }
    (1u32..)
        .map(|n| with(format!(".bak.{n}")))
        .find(|b| std::fs::symlink_metadata(b).is_err())
        .unwrap_or(first)
}

/// Replaces `p` (a regular file: the caller resolved links) through a temp
/// file in its directory, keeping its permission bits.
fn write_atomically(p: &Path, text: &str) -> crate::Result<()> {
    let mut tmp = p.as_os_str().to_owned();
    tmp.push(".gpufit-tmp");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, text).map_err(|e| crate::Error::Io {
        context: format!("cannot write {}", tmp.display()),
        source: e,
    })?;
    if let Ok(meta) = std::fs::metadata(p) {
        std::fs::set_permissions(&tmp, meta.permissions()).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            crate::Error::Io {
                context: format!("cannot keep the mode of {}", p.display()),
                source: e,
            }
        })?;
    }
    std::fs::rename(&tmp, p).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        crate::Error::Io {
            context: format!("cannot replace {}", p.display()),
            source: e,
        }
    })
}

/// A key path in the config and the YAML scalar to write there.
type KeyValue = (Vec<&'static str>, String);

/// The engineering keys a framework's config carries, with values.
fn keys_for(
    fw: ConfigFramework,
    s: &EngineeringSettings,
    text: &str,
) -> crate::Result<(Vec<KeyValue>, Vec<String>)> {
    let b = |v: bool| v.to_string();
    let mut warnings = Vec::new();
    let dl = &s.dataloader;
    let keys = match fw {
        ConfigFramework::Torchtune => {
            let dtype =
                match s.dtype {
                    Dtype::Bf16 | Dtype::Bf16Mixed => "bf16",
                    Dtype::Fp32 => "fp32",
                    Dtype::Fp16 | Dtype::Fp16Mixed => return Err(crate::Error::Usage(
                        "torchtune trains in bf16 or fp32 only: pin --dtype bf16 or --dtype fp32"
                            .into(),
                    )),
                };
            vec![
                (vec!["batch_size"], s.micro_batch_size.to_string()),
                (
                    vec!["gradient_accumulation_steps"],
                    s.gradient_accumulation_steps.to_string(),
                ),
                (vec!["dtype"], dtype.to_string()),
                (
                    vec!["enable_activation_checkpointing"],
                    b(s.activation_checkpointing),
                ),
                (
                    vec!["enable_activation_offloading"],
                    b(s.activation_offloading),
                ),
                (vec!["compile"], b(s.compile)),
            ]
        }
        ConfigFramework::Hf => {
            let (bf16, fp16) = match s.dtype {
                Dtype::Bf16 | Dtype::Bf16Mixed => (true, false),
                Dtype::Fp16 | Dtype::Fp16Mixed => (false, true),
                Dtype::Fp32 => (false, false),
            };
            let mut k = vec![
                (
                    vec!["per_device_train_batch_size"],
                    s.micro_batch_size.to_string(),
                ),
                (
                    vec!["gradient_accumulation_steps"],
                    s.gradient_accumulation_steps.to_string(),
                ),
                (vec!["bf16"], b(bf16)),
                (vec!["fp16"], b(fp16)),
                (
                    vec!["gradient_checkpointing"],
                    b(s.activation_checkpointing),
                ),
                (vec!["torch_compile"], b(s.compile)),
                (vec!["dataloader_num_workers"], dl.num_workers.to_string()),
                (vec!["dataloader_pin_memory"], b(dl.pin_memory)),
                (
                    vec!["dataloader_persistent_workers"],
                    b(dl.persistent_workers),
                ),
            ];
            if dl.num_workers > 0 {
                k.push((
                    vec!["dataloader_prefetch_factor"],
                    dl.prefetch_factor.to_string(),
                ));
            }
            if s.activation_offloading {
                warnings.push("Hugging Face TrainingArguments has no activation-offloading switch: enable it in your training code".into());
            }
            k
        }
        ConfigFramework::Lightning => {
            let precision = match s.dtype {
                Dtype::Bf16Mixed => "bf16-mixed",
                Dtype::Bf16 => "bf16-true",
                Dtype::Fp16Mixed => "16-mixed",
                Dtype::Fp16 => "16-true",
                Dtype::Fp32 => "32-true",
            };
            // LightningCLI puts DataModule arguments under data.init_args
            // when a class_path is given, else directly under data.
            let parsed: Value = serde_yaml::from_str(text).unwrap_or(Value::Null);
            let data_init = parsed
                .get("data")
                .and_then(|d| d.get("init_args"))
                .is_some();
            let data = |k: &'static str| -> Vec<&'static str> {
                if data_init {
                    vec!["data", "init_args", k]
                } else {
                    vec!["data", k]
                }
            };
            warnings.push(format!(
                "Lightning has no config key for activation checkpointing ({}) or compile ({}): set them in your LightningModule",
                on_off(s.activation_checkpointing),
                on_off(s.compile)
            ));
            vec![
                (vec!["trainer", "precision"], format!("\"{precision}\"")),
                (
                    vec!["trainer", "accumulate_grad_batches"],
                    s.gradient_accumulation_steps.to_string(),
                ),
                (data("batch_size"), s.micro_batch_size.to_string()),
                (data("num_workers"), dl.num_workers.to_string()),
            ]
        }
    };
    Ok((keys, warnings))
}

fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// Writes the settings into a config text; returns the new text, the
/// changes and warnings. Fails, writing nothing, if the result would not
/// parse or any other key would differ.
pub fn apply_to_text(
    text: &str,
    fw: ConfigFramework,
    s: &EngineeringSettings,
) -> crate::Result<(String, Vec<Change>, Vec<String>)> {
    // A CRLF file is edited as LF and written back as CRLF.
    if text.contains("\r\n") {
        let (out, changes, warnings) = apply_to_text(&text.replace("\r\n", "\n"), fw, s)?;
        return Ok((out.replace('\n', "\r\n"), changes, warnings));
    }
    let before: Value = serde_yaml::from_str(text).map_err(|e| {
        crate::Error::Usage(format!("the config is not valid YAML ({e}): fix it first"))
    })?;
    if !matches!(before, Value::Mapping(_) | Value::Null) {
        return Err(crate::Error::Usage(
            "the config's top level is not a mapping of keys: is this a training config?".into(),
        ));
    }
    let (keys, warnings) = keys_for(fw, s, text)?;
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let mut changes = Vec::new();
    for (path, value) in &keys {
        let old = set_path(&mut lines, path, value)?;
        let unquoted = value.trim_matches('"').to_string();
        if old
            .as_deref()
            .map(|o| o.trim_matches(|c| c == '"' || c == '\''))
            != Some(&unquoted)
        {
            changes.push(Change {
                key: path.join("."),
                old,
                new: unquoted,
            });
        }
    }
    let mut out = lines.join("\n");
    if text.ends_with('\n') || text.is_empty() {
        out.push('\n');
    }
    let after: Value = serde_yaml::from_str(&out).map_err(|e| {
        crate::Error::Usage(format!(
            "writing the settings would break the YAML ({e}); nothing was written: edit the keys by hand"
        ))
    })?;
    // The guard: apart from the engineering keys, nothing may differ.
    let strip = |mut v: Value| {
        for (path, _) in &keys {
            remove_path(&mut v, path);
        }
        v
    };
    if strip(before) != strip(after.clone()) {
        return Err(crate::Error::Usage(
            "writing the settings would change other keys of the config; nothing was written: edit it by hand".into(),
        ));
    }
    for (path, value) in &keys {
        let got = get_path(&after, path).map(scalar_text);
        if got.as_deref() != Some(value.trim_matches('"')) {
            return Err(crate::Error::Usage(format!(
                "could not write {} (read back {:?}); nothing was written",
                path.join("."),
                got
            )));
        }
    }
    Ok((out, changes, warnings))
}

fn scalar_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        other => format!("{other:?}"),
    }
}

fn get_path<'v>(v: &'v Value, path: &[&str]) -> Option<&'v Value> {
    path.iter().try_fold(v, |v, k| v.get(*k))
}

fn remove_path(v: &mut Value, path: &[&str]) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut cur = &mut *v;
    for k in parents {
        match cur.get_mut(*k) {
            Some(next) => cur = next,
            None => return,
        }
    }
    if let Value::Mapping(m) = cur {
        m.remove(*last);
        // A parent created only for our keys compares equal to a missing one.
    }
    // Drop now-empty parents so a created section does not count as a change.
    prune_empty(v, parents);
}

fn prune_empty(v: &mut Value, parents: &[&str]) {
    if parents.is_empty() {
        return;
    }
    let Some((last, up)) = parents.split_last() else {
        return;
    };
    let mut cur = &mut *v;
    for k in up {
        match cur.get_mut(*k) {
            Some(next) => cur = next,
            None => return,
        }
    }
    let empty = cur
        .get(*last)
        .is_some_and(|x| matches!(x, Value::Mapping(m) if m.is_empty()));
    if empty {
        if let Value::Mapping(m) = cur {
            m.remove(*last);
        }
        prune_empty(v, up);
    }
}

fn indent_of(line: &str) -> usize {
    line.len() - line.trim_start_matches(' ').len()
}

fn is_content(line: &str) -> bool {
    let t = line.trim();
    !t.is_empty() && !t.starts_with('#')
}

/// Splits `key: value  # comment` into (value, comment) if the line is `key`.
fn key_line<'l>(line: &'l str, key: &str) -> Option<(&'l str, &'l str)> {
    let rest = line.trim_start().strip_prefix(key)?;
    let rest = rest.trim_start_matches(' ').strip_prefix(':')?;
    if !(rest.is_empty() || rest.starts_with(' ') || rest.starts_with('\t')) {
        return None;
    }
    let hash = rest.find(" #").unwrap_or(rest.len());
    // The comment keeps its original spacing.
    let value_end = rest[..hash].trim_end().len();
    Some((rest[..value_end].trim(), &rest[value_end..]))
}

/// Sets `path` to the scalar `value`, editing in place when the key exists
/// and appending it (and any missing parents) otherwise. Returns the old value.
fn set_path(lines: &mut Vec<String>, path: &[&str], value: &str) -> crate::Result<Option<String>> {
    let (mut start, mut end) = (0usize, lines.len());
    let mut parent_indent: Option<usize> = None;
    for (depth, key) in path.iter().enumerate() {
        let last = depth + 1 == path.len();
        // Children of the current block share the first content line's indent.
        let child_indent = lines[start..end]
            .iter()
            .find(|l| is_content(l))
            .map(|l| indent_of(l))
            .filter(|&i| parent_indent.is_none_or(|p| i > p));
        let found = child_indent.and_then(|ci| {
            (start..end).find(|&i| indent_of(&lines[i]) == ci && key_line(&lines[i], key).is_some())
        });
        match found {
            Some(i) => {
                let ind = indent_of(&lines[i]);
                let (old, comment) = key_line(&lines[i], key)
                    .map(|(v, c)| (v.to_string(), c.to_string()))
                    .unwrap_or_default();
                let block_end = (i + 1..end)
                    .find(|&j| is_content(&lines[j]) && indent_of(&lines[j]) <= ind)
                    .unwrap_or(end);
                if last {
                    let has_children = lines[i + 1..block_end].iter().any(|l| is_content(l));
                    if old.is_empty() && has_children {
                        return Err(crate::Error::Usage(format!(
                            "{} in the config is a section, not a value: edit it by hand",
                            path.join(".")
                        )));
                    }
                    lines[i] = format!("{}{key}: {value}{comment}", " ".repeat(ind));
                    return Ok((!old.is_empty()).then_some(old));
                }
                if !old.is_empty() && !old.starts_with('#') {
                    return Err(crate::Error::Usage(format!(
                        "{} in the config is a value, not a section: edit it by hand",
                        path[..=depth].join(".")
                    )));
                }
                start = i + 1;
                end = block_end;
                parent_indent = Some(ind);
            }
            None => {
                // Insert the rest of the path at the end of this block.
                let base = child_indent.unwrap_or_else(|| parent_indent.map_or(0, |p| p + 2));
                let mut at = end;
                // Keep trailing blank lines / comments after the insertion.
                while at > start && !is_content(&lines[at - 1]) {
                    at -= 1;
                }
                let mut new = Vec::new();
                for (k, key) in path[depth..].iter().enumerate() {
                    let ind = " ".repeat(base + 2 * k);
                    if depth + k + 1 == path.len() {
                        new.push(format!("{ind}{key}: {value}"));
                    } else {
                        new.push(format!("{ind}{key}:"));
                    }
                }
                lines.splice(at..at, new);
                return Ok(None);
            }
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> EngineeringSettings {
        EngineeringSettings {
            micro_batch_size: 6,
            gradient_accumulation_steps: 4,
            dtype: Dtype::Bf16,
            activation_checkpointing: true,
            activation_offloading: false,
            compile: true,
            ..EngineeringSettings::default()
        }
    }

    const TORCHTUNE: &str = "\
# Config for single device LoRA finetuning
output_dir: /tmp/out
model:
  _component_: torchtune.models.llama3_1.lora_llama3_1_8b
  lora_attn_modules: ['q_proj', 'v_proj']
  lora_rank: 8  # scientific
  lora_alpha: 16
optimizer:
  _component_: torch.optim.AdamW
  lr: 3e-4
batch_size: 2  # per device
epochs: 1
max_steps_per_epoch: null
gradient_accumulation_steps: 8
seed: 42
dtype: bf16
enable_activation_checkpointing: False
compile: False
tokenizer:
  max_seq_len: 2048
";

    #[test]
    fn torchtune_keys_are_rewritten_in_place_keeping_comments() {
        let (out, changes, _) =
            apply_to_text(TORCHTUNE, ConfigFramework::Torchtune, &settings()).unwrap();
        assert!(out.contains("batch_size: 6  # per device"), "{out}");
        assert!(out.contains("# Config for single device LoRA finetuning"));
        assert!(out.contains("gradient_accumulation_steps: 4\n"));
        assert!(out.contains("enable_activation_checkpointing: true\n"));
        assert!(
            out.contains("enable_activation_offloading: false\n"),
            "appended: {out}"
        );
        assert!(changes
            .iter()
            .any(|c| c.key == "batch_size" && c.old.as_deref() == Some("2")));
    }

    #[test]
    fn no_scientific_key_changes() {
        let (out, _, _) =
            apply_to_text(TORCHTUNE, ConfigFramework::Torchtune, &settings()).unwrap();
        let a: Value = serde_yaml::from_str(TORCHTUNE).unwrap();
        let b: Value = serde_yaml::from_str(&out).unwrap();
        for k in [
            "output_dir",
            "model",
            "optimizer",
            "epochs",
            "seed",
            "tokenizer",
            "max_steps_per_epoch",
        ] {
            assert_eq!(a.get(k), b.get(k), "{k} changed");
        }
        assert_eq!(b["model"]["lora_rank"], Value::from(8));
        assert_eq!(b["optimizer"]["lr"], a["optimizer"]["lr"]);
    }

    #[test]
    fn hf_training_arguments_get_their_own_keys() {
        let text = "learning_rate: 2.0e-5\nper_device_train_batch_size: 8\nnum_train_epochs: 3\nbf16: false\n";
        let (out, _, _) = apply_to_text(text, ConfigFramework::Hf, &settings()).unwrap();
        let v: Value = serde_yaml::from_str(&out).unwrap();
        assert_eq!(v["per_device_train_batch_size"], Value::from(6));
        assert_eq!(v["bf16"], Value::from(true));
        assert_eq!(v["gradient_checkpointing"], Value::from(true));
        assert_eq!(v["torch_compile"], Value::from(true));
        assert_eq!(v["learning_rate"], Value::from(2.0e-5));
        assert_eq!(v["num_train_epochs"], Value::from(3));
    }

    #[test]
    fn lightning_writes_precision_and_data_init_args() {
        let text = "\
seed_everything: 7
trainer:
  max_epochs: 3
  precision: 32-true
model:
  learning_rate: 0.001
data:
  class_path: my.DataModule
  init_args:
    batch_size: 16
";
        let (out, _, warnings) =
            apply_to_text(text, ConfigFramework::Lightning, &settings()).unwrap();
        let v: Value = serde_yaml::from_str(&out).unwrap();
        assert_eq!(v["trainer"]["precision"], Value::from("bf16-true"));
        assert_eq!(v["trainer"]["accumulate_grad_batches"], Value::from(4));
        assert_eq!(v["trainer"]["max_epochs"], Value::from(3));
        assert_eq!(v["data"]["init_args"]["batch_size"], Value::from(6));
        assert_eq!(v["model"]["learning_rate"], Value::from(0.001));
        assert!(warnings.iter().any(|w| w.contains("LightningModule")));
    }

    #[test]
    fn a_missing_section_is_created() {
        let (out, _, _) = apply_to_text(
            "seed_everything: 1\n",
            ConfigFramework::Lightning,
            &settings(),
        )
        .unwrap();
        let v: Value = serde_yaml::from_str(&out).unwrap();
        assert_eq!(v["data"]["batch_size"], Value::from(6));
        assert_eq!(v["seed_everything"], Value::from(1));
    }

    #[test]
    fn broken_yaml_and_fp16_for_torchtune_are_clear_errors() {
        assert!(apply_to_text("a: [1, 2\n", ConfigFramework::Hf, &settings()).is_err());
        let fp16 = EngineeringSettings {
            dtype: Dtype::Fp16Mixed,
            ..settings()
        };
        let e = apply_to_text(TORCHTUNE, ConfigFramework::Torchtune, &fp16).unwrap_err();
        assert!(e.to_string().contains("bf16 or fp32"));
    }

    #[test]
    fn an_engineering_key_that_is_a_section_is_refused() {
        let text = "compile:\n  mode: max-autotune\n";
        assert!(apply_to_text(text, ConfigFramework::Torchtune, &settings()).is_err());
    }

    #[test]
    fn crlf_line_endings_are_kept() {
        let crlf = TORCHTUNE.replace('\n', "\r\n");
        let (out, changes, _) =
            apply_to_text(&crlf, ConfigFramework::Torchtune, &settings()).unwrap();
        assert!(!changes.is_empty());
        assert!(out.contains("batch_size: 6  # per device\r\n"), "{out:?}");
        assert_eq!(
            out.matches('\n').count(),
            out.matches("\r\n").count(),
            "every line ends in CRLF: {out:?}"
        );
        // The same edit as on the LF file.
        let (lf, _, _) = apply_to_text(TORCHTUNE, ConfigFramework::Torchtune, &settings()).unwrap();
        assert_eq!(out.replace("\r\n", "\n"), lf);
    }

    #[test]
    fn the_framework_is_told_from_the_file_and_a_contradiction_refused() {
        assert_eq!(
            detect_framework(TORCHTUNE).map(|d| d.0),
            Some(ConfigFramework::Torchtune)
        );
        let hf = "output_dir: out\nper_device_train_batch_size: 4\nlearning_rate: 2e-5\n";
        assert_eq!(detect_framework(hf).map(|d| d.0), Some(ConfigFramework::Hf));
        let pl = "trainer:\n  max_epochs: 1\ndata:\n  batch_size: 2\n";
        assert_eq!(
            detect_framework(pl).map(|d| d.0),
            Some(ConfigFramework::Lightning)
        );
        assert_eq!(detect_framework("lr: 1\n"), None);
        assert_eq!(
            choose_framework("generic", hf).unwrap(),
            ConfigFramework::Hf
        );
        assert_eq!(choose_framework("hf", hf).unwrap(), ConfigFramework::Hf);
        let err = choose_framework("torchtune", hf).unwrap_err().to_string();
        assert!(
            err.contains("hf config") && err.contains("per_device_train_batch_size"),
            "{err}"
        );
        assert!(choose_framework("generic", "lr: 1\n").is_err());
        assert_eq!(
            choose_framework("lightning", "lr: 1\n").unwrap(),
            ConfigFramework::Lightning
        );
    }
}
