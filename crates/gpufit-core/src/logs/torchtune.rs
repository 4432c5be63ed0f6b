//! torchtune logs.
//!
//! What torchtune prints (recipes under `recipes/`, helpers in
//! `torchtune/training/memory.py` and `metric_logging.py`):
//! - after model init, `training.log_memory_stats`:
//!   ```text
//!   Memory stats after model init:
//!       GPU peak memory allocation: 16.50 GiB
//!       GPU peak memory reserved: 16.64 GiB
//!       GPU peak memory active: 16.50 GiB
//!   ```
//!   (torchtune ≤ 0.2 divided by 1e9 and printed `GB`; newer versions divide
//!   by 2^30 and print `GiB`; NPU/XPU builds print their device name instead
//!   of `GPU`);
//! - the metric logger's lines (`DiskLogger`/`StdoutLogger.log_dict`):
//!   `Step 10 | loss:1.23 lr:3e-05 tokens_per_second_per_gpu:2890.1 peak_memory_active:18.2 peak_memory_alloc:18.2 peak_memory_reserved:19.9 `
//!   — memory values there are bare numbers in the unit of `get_memory_stats`
//!   (GiB today; GB when the init stats say `GB`);
//! - the tqdm bar `1|25|Loss: 1.2345:  2%|▏ | 25/1617 [...]`;
//! - `Model checkpoint of size 15.02 GiB saved to …` /
//!   `Adapter checkpoint of size 0.08 GiB saved to …` when an epoch ends.

use std::sync::LazyLock;

use regex::Regex;

use super::{max_opt, median, num, push_sample, to_bytes, LogFormat, ParsedLog};

static MEM_STAT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"\b(?:GPU|NPU|XPU|MPS|CUDA)? ?peak memory (allocation|reserved|active): ([0-9]+(?:\.[0-9]+)?) ?(GiB|GB|MiB|MB)\b",
    )
    .expect("static regex")
});
static STEP_LINE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^Step ([0-9]+) \| (.*)$").expect("static regex"));
static BAR: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\b[0-9]+\|[0-9]+\|Loss: [-0-9.naife+]+").expect("static regex"));
static CKPT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"(?:Model|Adapter|Recipe) checkpoint of size [0-9.]+ ?(?:GiB|GB|MiB|MB) (?:is )?saved to",
    )
    .expect("static regex")
});

/// Which unit bare metric-line memory values are in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum BareUnit {
    #[default]
    Gib,
    Gb,
}

/// The torchtune log parser: what it has read of a log so far.
#[derive(Debug, Default)]
pub struct TorchtuneParser {
    seen: bool,
    alloc: Option<u64>,
    reserved: Option<u64>,
    active: Option<u64>,
    /// Raw bare values from `Step N |` lines: (alloc, reserved, active) maxima.
    bare_alloc: Option<f64>,
    bare_reserved: Option<f64>,
    bare_active: Option<f64>,
    bare_unit: BareUnit,
    tokens_per_sec: Vec<f64>,
    checkpoint_saved: bool,
}

fn fmax(a: Option<f64>, b: f64) -> Option<f64> {
    Some(a.map_or(b, |x| x.max(b)))
}

impl TorchtuneParser {
    /// Feeds one line (terminator removed, trailing space trimmed).
    pub fn feed(&mut self, line: &str) {
        if line.contains("peak memory ") {
            for c in MEM_STAT.captures_iter(line) {
                let (Some(v), Some(unit)) = (num(&c[2]), c.get(3)) else {
                    continue;
                };
                if unit.as_str() == "GB" {
                    self.bare_unit = BareUnit::Gb;
                }
                let b = to_bytes(v, unit.as_str());
                self.seen = true;
                match &c[1] {
                    "allocation" => self.alloc = max_opt(self.alloc, b),
                    "reserved" => self.reserved = max_opt(self.reserved, b),
                    _ => self.active = max_opt(self.active, b),
                }
            }
        }
        if line.starts_with("Step ") {
            if let Some(c) = STEP_LINE.captures(line) {
                self.feed_metrics(&c[2]);
            }
        }
        if line.contains("|Loss: ") && BAR.is_match(line) {
            self.seen = true;
        }
        if line.contains("checkpoint of size") && CKPT.is_match(line) {
            self.seen = true;
            self.checkpoint_saved = true;
        }
    }

    fn feed_metrics(&mut self, rest: &str) {
        let mut any = false;
        for kv in rest.split_whitespace() {
            let Some((k, v)) = kv.split_once(':') else {
                continue;
            };
            let Some(x) = num(v) else { continue };
            match k {
                "tokens_per_second_per_gpu" | "tokens_per_second" => {
                    push_sample(&mut self.tokens_per_sec, x);
                    any = true;
                }
                "peak_memory_alloc" => {
                    self.bare_alloc = fmax(self.bare_alloc, x);
                    any = true;
                }
                "peak_memory_reserved" => {
                    self.bare_reserved = fmax(self.bare_reserved, x);
                    any = true;
                }
                "peak_memory_active" => {
                    self.bare_active = fmax(self.bare_active, x);
                    any = true;
                }
                "loss" | "lr" => any = true,
                _ => {}
            }
        }
        self.seen |= any;
    }

    /// Writes what was found; returns whether the log shows the end of an
    /// epoch (a checkpoint was saved).
    pub fn finish(self, out: &mut ParsedLog) -> bool {
        if !self.seen {
            return false;
        }
        out.formats.push(LogFormat::Torchtune);
        let unit = match self.bare_unit {
            BareUnit::Gib => "GiB",
            BareUnit::Gb => "GB",
        };
        let bare = |v: Option<f64>| v.and_then(|x| to_bytes(x, unit));
        out.peak_allocated_bytes = max_opt(
            out.peak_allocated_bytes,
            max_opt(self.alloc, bare(self.bare_alloc)),
        );
        out.peak_reserved_bytes = max_opt(
            out.peak_reserved_bytes,
            max_opt(self.reserved, bare(self.bare_reserved)),
        );
        out.peak_active_bytes = max_opt(
            out.peak_active_bytes,
            max_opt(self.active, bare(self.bare_active)),
        );
        if let Some(t) = median(&self.tokens_per_sec) {
            out.tokens_per_sec = Some(t);
        }
        self.checkpoint_saved
    }
}

#[cfg(test)]
mod tests {
    use super::super::parse_str;
    use super::*;
    use crate::units::{GB, GIB};

    #[test]
    fn init_memory_stats_in_gib_are_read_as_binary_units() {
        let p = parse_str(
            "INFO:torchtune.utils._logging:Memory stats after model init:\n\tGPU peak memory allocation: 16.50 GiB\n\tGPU peak memory reserved: 16.64 GiB\n\tGPU peak memory active: 16.50 GiB\n",
        )
        .unwrap();
        assert_eq!(p.formats, vec![LogFormat::Torchtune]);
        assert_eq!(
            p.peak_reserved_bytes,
            Some((16.64 * GIB as f64).round() as u64)
        );
        assert_eq!(
            p.peak_allocated_bytes,
            Some((16.50 * GIB as f64).round() as u64)
        );
    }

    #[test]
    fn old_torchtune_gb_stats_make_bare_metric_values_decimal() {
        let p = parse_str(
            "Memory stats after model init:\n\tGPU peak memory allocation: 10.00 GB\nStep 1 | loss:1.0 peak_memory_reserved:20.0 \n",
        )
        .unwrap();
        assert_eq!(p.peak_reserved_bytes, Some(20 * GB));
    }

    #[test]
    fn metric_lines_give_the_max_peak_and_median_tokens_per_second() {
        let p = parse_str(
            "Step 1 | loss:2.0 lr:2e-05 tokens_per_second_per_gpu:100.0 peak_memory_active:10.0 peak_memory_alloc:10.0 peak_memory_reserved:11.0 \n\
             Step 2 | loss:1.9 lr:2e-05 tokens_per_second_per_gpu:3000.0 peak_memory_active:12.0 peak_memory_alloc:12.0 peak_memory_reserved:13.0 \n\
             Step 3 | loss:1.8 lr:2e-05 tokens_per_second_per_gpu:3100.0 peak_memory_active:12.0 peak_memory_alloc:12.0 peak_memory_reserved:13.0 \n",
        )
        .unwrap();
        assert_eq!(p.peak_reserved_bytes, Some(13 * GIB));
        assert_eq!(p.tokens_per_sec, Some(3000.0));
    }

    #[test]
    fn a_saved_checkpoint_marks_completion() {
        let p = parse_str(
            "1|10|Loss: 1.5: 100%|██████████| 10/10\nINFO:torchtune.utils._logging:Model checkpoint of size 4.98 GiB saved to /tmp/out/epoch_0/model-00001-of-00004.safetensors\n",
        )
        .unwrap();
        assert_eq!(p.success(), Some(true));
    }
}
