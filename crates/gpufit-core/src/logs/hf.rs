//! Hugging Face Trainer logs.
//!
//! The Trainer's `ProgressCallback`/`PrinterCallback` print each `logs`
//! dict with Python's `str()`:
//! `{'loss': 1.8412, 'grad_norm': 0.91, 'learning_rate': 1.9e-05, 'epoch': 0.1}`
//! and at the end of `train()`:
//! `{'train_runtime': 1234.5678, 'train_samples_per_second': 12.96, 'train_steps_per_second': 1.62, 'train_loss': 1.23, 'epoch': 3.0}`.
//! Values may be quoted strings (newer versions format floats), `nan`, or
//! numpy scalars (`np.float64(1.5)`). The example scripts also print
//! `trainer.log_metrics("train", …)` as a block:
//! `***** train metrics *****` then `  train_runtime            = 0:20:34.56`.

use std::sync::LazyLock;

use regex::Regex;

use super::{num, LogFormat, ParsedLog};

/// `'key': value` inside a Python dict repr.
static KV: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"['"]([A-Za-z_][A-Za-z0-9_]*)['"]\s*:\s*(?:np\.float(?:16|32|64)\(|tensor\()?['"]?([-+0-9.eEnaif]+)['"]?"#)
        .expect("static regex")
});
/// `  train_runtime            = 0:20:34.56` from `log_metrics`.
static METRIC_BLOCK: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^\s*(train_[a-z_]+)\s+=\s+(\S+)\s*$").expect("static regex"));

/// The Hugging Face Trainer log parser: what it has read of a log so far.
#[derive(Debug, Default)]
pub struct HfParser {
    seen: bool,
    completed: bool,
    runtime: Option<f64>,
    samples_per_sec: Option<f64>,
    steps_per_sec: Option<f64>,
    tokens_per_sec: Option<f64>,
}

/// `H:MM:SS.ss` (as `log_metrics` prints `train_runtime`) or plain seconds.
fn seconds(s: &str) -> Option<f64> {
    if !s.contains(':') {
        return num(s);
    }
    let mut total = 0.0;
    for part in s.split(':') {
        total = total * 60.0 + num(part)?;
    }
    Some(total)
}

impl HfParser {
    /// Feeds one line (terminator removed, trailing space trimmed).
    pub fn feed(&mut self, line: &str) {
        if let Some(start) = line.find("{'") {
            let dict = &line[start..];
            if dict.contains("'train_runtime'")
                || dict.contains("'loss'")
                || dict.contains("'eval_loss'")
                || dict.contains("'train_loss'")
            {
                self.feed_dict(dict);
            }
        }
        if line.contains("***** train metrics *****") {
            self.seen = true;
        }
        if line.contains("train_") && line.contains('=') {
            if let Some(c) = METRIC_BLOCK.captures(line) {
                self.take(&c[1], &c[2]);
            }
        }
    }

    fn feed_dict(&mut self, dict: &str) {
        let mut any = false;
        for c in KV.captures_iter(dict) {
            any = true;
            self.take(&c[1], &c[2]);
        }
        self.seen |= any;
    }

    fn take(&mut self, key: &str, value: &str) {
        match key {
            "train_runtime" => {
                if let Some(v) = seconds(value) {
                    self.runtime = Some(v);
                    self.completed = true;
                    self.seen = true;
                }
            }
            "train_samples_per_second" => {
                self.samples_per_sec = num(value).or(self.samples_per_sec)
            }
            "train_steps_per_second" => self.steps_per_sec = num(value).or(self.steps_per_sec),
            "train_tokens_per_second" => self.tokens_per_sec = num(value).or(self.tokens_per_sec),
            _ => {}
        }
    }

    /// Writes what was found; returns whether `train()` finished.
    pub fn finish(self, out: &mut ParsedLog) -> bool {
        if !self.seen {
            return false;
        }
        out.formats.push(LogFormat::HfTrainer);
        out.duration_sec = self.runtime.or(out.duration_sec);
        out.samples_per_sec = self.samples_per_sec.or(out.samples_per_sec);
        out.steps_per_sec = self.steps_per_sec.or(out.steps_per_sec);
        out.tokens_per_sec = self.tokens_per_sec.or(out.tokens_per_sec);
        self.completed
    }
}

#[cfg(test)]
mod tests {
    use super::super::{parse_str, LogOutcome};
    use super::*;

    #[test]
    fn the_final_train_runtime_dict_gives_duration_and_throughput() {
        let p = parse_str(
            "{'loss': 2.1043, 'grad_norm': 1.52, 'learning_rate': 1.8e-05, 'epoch': 0.27}\n\
             {'train_runtime': 1234.5678, 'train_samples_per_second': 12.96, 'train_steps_per_second': 1.62, 'train_loss': 1.9, 'epoch': 1.0}\n",
        )
        .unwrap();
        assert_eq!(p.formats, vec![LogFormat::HfTrainer]);
        assert_eq!(p.duration_sec, Some(1234.5678));
        assert_eq!(p.samples_per_sec, Some(12.96));
        assert_eq!(p.steps_per_sec, Some(1.62));
        assert_eq!(p.outcome, Some(LogOutcome::Completed));
    }

    #[test]
    fn quoted_and_numpy_values_are_read() {
        let p = parse_str(
            "{'train_runtime': '98.5', 'train_samples_per_second': np.float64(4.25), 'train_steps_per_second': '0.5'}\n",
        )
        .unwrap();
        assert_eq!(p.duration_sec, Some(98.5));
        assert_eq!(p.samples_per_sec, Some(4.25));
    }

    #[test]
    fn the_log_metrics_block_is_read_with_h_mm_ss_runtime() {
        let p = parse_str(
            "***** train metrics *****\n  epoch                    =        3.0\n  train_loss               =     0.6789\n  train_runtime            = 0:20:34.56\n  train_samples_per_second =     24.303\n  train_steps_per_second   =      3.038\n",
        )
        .unwrap();
        assert!((p.duration_sec.unwrap() - 1234.56).abs() < 1e-6);
        assert_eq!(p.samples_per_sec, Some(24.303));
    }

    #[test]
    fn step_dicts_alone_are_recognised_but_not_completion() {
        let p = parse_str("{'loss': 2.1043, 'learning_rate': 1.8e-05, 'epoch': 0.27}\n").unwrap();
        assert_eq!(p.formats, vec![LogFormat::HfTrainer]);
        assert_eq!(p.outcome, Some(LogOutcome::Unknown));
    }
}
