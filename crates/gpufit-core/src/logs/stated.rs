//! The engineering settings a job *says* it ran with, read from what
//! frameworks print at start. gpufit injects settings and must not believe
//! them blindly: a script that ignores `GPUFIT_MICRO_BATCH_SIZE` runs another
//! micro batch, and a run is only evidence for the settings it really ran.
//!
//! Recognised, each from the framework's own source:
//! - Hugging Face Trainer (`transformers/trainer.py`, `_inner_training_loop`)
//!   logs `  Instantaneous batch size per device = 8` (with `:,`, so
//!   `1,024`) and `  Gradient Accumulation steps = 4`. The same two lines are
//!   printed by the `accelerate`-based `*_no_trainer.py` example scripts.
//! - torchtune (`torchtune/config/_utils.py::log_config`) logs
//!   `Running <Recipe> with resolved config:` followed by a blank line and the
//!   whole config as YAML (`OmegaConf.to_yaml`); the top-level keys
//!   `batch_size`, `gradient_accumulation_steps`, `dtype`,
//!   `enable_activation_checkpointing`, `enable_activation_offloading` and
//!   `compile` are the settings gpufit sets.
//! - Lightning (`lightning/pytorch/trainer/connectors/accelerator_connector.py`)
//!   logs `Using 16bit Automatic Mixed Precision (AMP)` for `16-mixed` and
//!   `Using bfloat16 Automatic Mixed Precision (AMP)` for `bf16-mixed`.
//!
//! The first statement of a field wins: a job states its configuration once,
//! at start, and later lines (an evaluation loop, a second `Trainer`) are not
//! the training run gpufit configured.

use serde::{Deserialize, Serialize};

pub use crate::result_record::StatedSettings;
use crate::settings::Dtype;

/// Who stated a setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StatedBy {
    /// The Hugging Face Trainer's "***** Running training *****" block.
    HfTrainer,
    /// torchtune's "Running … with resolved config:" echo.
    TorchtuneConfig,
    /// Lightning's mixed-precision line.
    LightningPrecision,
}

/// The largest micro batch or accumulation a log may state; above it the
/// line is not a setting gpufit could have injected (the history's own
/// bound on a micro batch is far lower) and is ignored rather than trusted.
const MAX_STATED: u64 = 1 << 20;

fn count(s: &str) -> Option<u32> {
    let digits: String = s.trim().chars().filter(|c| *c != ',').collect();
    let n: u64 = digits.parse().ok()?;
    (1..=MAX_STATED).contains(&n).then_some(n as u32)
}

fn boolean(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "true" => Some(true),
        "false" => Some(false),
        _ => None,
    }
}

/// Fills `slot` if still empty; returns whether it was filled now.
fn first<T>(slot: &mut Option<T>, v: Option<T>) -> bool {
    if slot.is_none() && v.is_some() {
        *slot = v;
        return true;
    }
    false
}

/// Streaming reader of stated settings.
#[derive(Debug, Default)]
pub struct StatedParser {
    out: StatedSettings,
    by: Vec<StatedBy>,
    /// Inside torchtune's YAML echo.
    in_torchtune_config: bool,
}

impl StatedParser {
    /// Feeds one line (terminator removed, trailing space trimmed).
    pub fn feed(&mut self, line: &str) {
        if self.in_torchtune_config {
            if self.torchtune_yaml(line) {
                return;
            }
            self.in_torchtune_config = false;
        }
        if line.contains(" with resolved config:") && line.contains("Running ") {
            self.in_torchtune_config = true;
            return;
        }
        let t = line.trim_start();
        // The HF lines may carry a logger prefix (`INFO|trainer.py:2345] …`).
        if let Some(i) = t.find("Instantaneous batch size per device = ") {
            let v = &t[i + "Instantaneous batch size per device = ".len()..];
            if first(&mut self.out.micro_batch_size, count(v)) {
                self.by(StatedBy::HfTrainer);
            }
        } else if let Some(i) = t.find("Gradient Accumulation steps = ") {
            let v = &t[i + "Gradient Accumulation steps = ".len()..];
            if first(&mut self.out.gradient_accumulation_steps, count(v)) {
                self.by(StatedBy::HfTrainer);
            }
        } else if t.contains("Automatic Mixed Precision (AMP)") {
            let d = if t.contains("Using 16bit ") {
                Some(Dtype::Fp16Mixed)
            } else if t.contains("Using bfloat16 ") {
                Some(Dtype::Bf16Mixed)
            } else {
                None
            };
            if first(&mut self.out.dtype, d) {
                self.by(StatedBy::LightningPrecision);
            }
        }
    }

    /// One line of torchtune's YAML echo; false when the echo has ended.
    fn torchtune_yaml(&mut self, line: &str) -> bool {
        if line.is_empty() || line.starts_with(' ') || line.starts_with('-') {
            // Blank lines and nested keys / list items belong to the YAML.
            return true;
        }
        let Some((key, value)) = line.split_once(':') else {
            return false;
        };
        // A log record (`INFO:torchtune.utils._logging:…`, `DEBUG:…`) ends
        // the echo; YAML keys are lower-case identifiers.
        if key.is_empty()
            || !key
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            return false;
        }
        let v = value.trim();
        let hit = match key {
            "batch_size" => first(&mut self.out.micro_batch_size, count(v)),
            "gradient_accumulation_steps" => {
                first(&mut self.out.gradient_accumulation_steps, count(v))
            }
            "dtype" => first(&mut self.out.dtype, v.parse::<Dtype>().ok()),
            "enable_activation_checkpointing" => {
                first(&mut self.out.activation_checkpointing, boolean(v))
            }
            "enable_activation_offloading" => {
                first(&mut self.out.activation_offloading, boolean(v))
            }
            "compile" => first(&mut self.out.compile, boolean(v)),
            _ => false,
        };
        if hit {
            self.by(StatedBy::TorchtuneConfig);
        }
        true
    }

    fn by(&mut self, who: StatedBy) {
        if !self.by.contains(&who) {
            self.by.push(who);
            self.by.sort();
        }
    }

    /// What was stated and by whom (sorted), or None when nothing was.
    pub fn finish(self) -> Option<(StatedSettings, Vec<StatedBy>)> {
        (self.out != StatedSettings::default()).then_some((self.out, self.by))
    }
}

#[cfg(test)]
mod tests {
    use super::super::parse_str;
    use super::*;

    #[test]
    fn hf_trainers_running_training_block_states_micro_batch_and_accumulation() {
        // The block as transformers' Trainer logs it (thousands separators from `:,`).
        let log = "***** Running training *****\n  Num examples = 10,000\n  Num Epochs = 3\n  Instantaneous batch size per device = 8\n  Training with DataParallel so batch size has been adjusted to: 8\n  Total train batch size (w. parallel, distributed & accumulation) = 32\n  Gradient Accumulation steps = 4\n  Total optimization steps = 939\n{'train_runtime': 12.5, 'train_samples_per_second': 3.2, 'epoch': 1.0}\n";
        let p = parse_str(log).unwrap();
        let s = p.stated.expect("stated settings");
        assert_eq!(s.micro_batch_size, Some(8));
        assert_eq!(s.gradient_accumulation_steps, Some(4));
        assert_eq!(s.dtype, None);
        assert_eq!(p.stated_by, vec![StatedBy::HfTrainer]);
    }

    #[test]
    fn thousands_separators_and_logger_prefixes_are_read_and_absurd_values_ignored() {
        let mut p = StatedParser::default();
        p.feed(
            "[INFO|trainer.py:2314] 2024-05-01 >>   Instantaneous batch size per device = 1,024",
        );
        p.feed("  Gradient Accumulation steps = 99999999999");
        let (s, _) = p.finish().unwrap();
        assert_eq!(s.micro_batch_size, Some(1024));
        assert_eq!(s.gradient_accumulation_steps, None);
    }

    #[test]
    fn torchtunes_config_echo_states_every_engineering_setting_and_ends_at_the_next_log_record() {
        let log = "INFO:torchtune.utils._logging:Running LoRAFinetuneRecipeSingleDevice with resolved config:\n\nbatch_size: 4\ncheckpointer:\n  _component_: torchtune.training.FullModelHFCheckpointer\n  checkpoint_dir: /tmp/Meta-Llama-3.1-8B-Instruct/\ncompile: false\ndataset:\n  _component_: torchtune.datasets.alpaca_cleaned_dataset\n  packed: false\ndevice: cuda\ndtype: bf16\nenable_activation_checkpointing: true\nenable_activation_offloading: false\nepochs: 1\ngradient_accumulation_steps: 8\nmax_steps_per_epoch: null\n\nDEBUG:torchtune.utils._logging:Setting manual seed to local seed 1234. Local seed is seed + rank = 1234 + 0\nbatch_size: 64\nStep 1 | loss:1.2 lr:0.0003 tokens_per_second_per_gpu:1500.0 peak_memory_alloc:20.1 peak_memory_reserved:22.3 peak_memory_active:20.1\n";
        let p = parse_str(log).unwrap();
        let s = p.stated.expect("stated settings");
        assert_eq!(
            s.micro_batch_size,
            Some(4),
            "the line after the echo is not config"
        );
        assert_eq!(s.gradient_accumulation_steps, Some(8));
        assert_eq!(s.dtype, Some(Dtype::Bf16));
        assert_eq!(s.activation_checkpointing, Some(true));
        assert_eq!(s.activation_offloading, Some(false));
        assert_eq!(s.compile, Some(false));
        assert_eq!(p.stated_by, vec![StatedBy::TorchtuneConfig]);
    }

    #[test]
    fn lightnings_precision_line_states_the_mixed_precision_dtype() {
        for (line, dtype) in [
            (
                "Using 16bit Automatic Mixed Precision (AMP)",
                Dtype::Fp16Mixed,
            ),
            (
                "Using bfloat16 Automatic Mixed Precision (AMP)",
                Dtype::Bf16Mixed,
            ),
        ] {
            let mut p = StatedParser::default();
            p.feed(line);
            let (s, by) = p.finish().unwrap();
            assert_eq!(s.dtype, Some(dtype), "{line}");
            assert_eq!(by, vec![StatedBy::LightningPrecision]);
        }
    }

    #[test]
    fn a_log_that_states_nothing_has_no_stated_settings() {
        let p = parse_str("Peak memory: 20.0 GB\nThroughput: 5 samples/sec\n").unwrap();
        assert_eq!(p.stated, None);
    }
}
