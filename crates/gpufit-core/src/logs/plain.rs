//! Plain lines that home-grown training scripts print:
//! `GPU Memory: Used 45.2GB / 80.0GB`, `Peak memory: 45.2 GB`,
//! `Throughput: 12.5 samples/sec`, `Training completed in 3600.0 seconds`.
//! The unit printed decides the factor: `GB` is 10^9 bytes, `GiB` 2^30.

use std::sync::LazyLock;

use regex::Regex;

use super::{max_opt, median, num, push_sample, to_bytes, LogFormat, ParsedLog};

const UNIT: &str = r"(GiB|GB|MiB|MB|TiB|TB|G|M)\b";

static USED: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(&format!(
        r"(?i)GPU Mem(?:ory)?:?\s*Used:?\s*([0-9]+(?:\.[0-9]+)?)\s*{UNIT}\s*(?:/|of)\s*([0-9]+(?:\.[0-9]+)?)\s*{UNIT}"
    ))
    .expect("static regex")
});
static PEAK: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(&format!(
        r"(?i)\b(?:max(?:imum)?|peak) (?:GPU )?mem(?:ory)?(?: usage| used| allocated)?\s*[:=]\s*([0-9]+(?:\.[0-9]+)?)\s*{UNIT}"
    ))
    .expect("static regex")
});
static THROUGHPUT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)\bThroughput\s*[:=]\s*([0-9]+(?:\.[0-9]+)?(?:e[-+]?[0-9]+)?)\s*(samples|sample|tokens|token|seqs|sequences|it|steps)\s*(?:/|per )\s*(?:s|sec|second)\b")
        .expect("static regex")
});
static COMPLETED: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)\bTraining (?:completed|finished|done) in\s*([0-9]+(?:\.[0-9]+)?)\s*(s|sec|secs|seconds|min|mins|minutes|h|hours)\b")
        .expect("static regex")
});

/// The framework-neutral (plain text) log parser: what it has read of a log so far.
#[derive(Debug, Default)]
pub struct PlainParser {
    seen: bool,
    completed: bool,
    used: Option<u64>,
    total: Option<u64>,
    peak: Option<u64>,
    samples: Vec<f64>,
    tokens: Vec<f64>,
    steps: Vec<f64>,
    duration: Option<f64>,
}

fn unit_bytes(v: &str, unit: &str) -> Option<u64> {
    to_bytes(num(v)?, unit)
}

impl PlainParser {
    /// Feeds one line (terminator removed, trailing space trimmed).
    pub fn feed(&mut self, line: &str) {
        let lower_has = |needle: &str| {
            line.as_bytes()
                .windows(needle.len())
                .any(|w| w.eq_ignore_ascii_case(needle.as_bytes()))
        };
        if lower_has("mem") {
            if let Some(c) = USED.captures(line) {
                let used = unit_bytes(&c[1], &c[2]);
                let total = unit_bytes(&c[3], &c[4]);
                if used.is_some() {
                    self.seen = true;
                    self.used = max_opt(self.used, used);
                    self.total = total.or(self.total);
                }
            } else if let Some(c) = PEAK.captures(line) {
                if let Some(b) = unit_bytes(&c[1], &c[2]) {
                    self.seen = true;
                    self.peak = max_opt(self.peak, Some(b));
                }
            }
        }
        if lower_has("throughput") {
            if let Some(c) = THROUGHPUT.captures(line) {
                if let Some(v) = num(&c[1]) {
                    self.seen = true;
                    match c[2].to_ascii_lowercase().as_str() {
                        "tokens" | "token" => push_sample(&mut self.tokens, v),
                        "it" | "steps" => push_sample(&mut self.steps, v),
                        _ => push_sample(&mut self.samples, v),
                    }
                }
            }
        }
        if lower_has("training ") {
            if let Some(c) = COMPLETED.captures(line) {
                if let Some(v) = num(&c[1]) {
                    let factor = match c[2].to_ascii_lowercase().as_str() {
                        "min" | "mins" | "minutes" => 60.0,
                        "h" | "hours" => 3600.0,
                        _ => 1.0,
                    };
                    self.seen = true;
                    self.completed = true;
                    self.duration = Some(v * factor);
                }
            }
        }
    }

    /// Writes what was found; returns whether a "Training completed" line was seen.
    pub fn finish(self, out: &mut ParsedLog) -> bool {
        if !self.seen {
            return false;
        }
        out.formats.push(LogFormat::Plain);
        out.peak_used_bytes = max_opt(out.peak_used_bytes, max_opt(self.used, self.peak));
        if out.gpu_total_bytes.is_none() {
            out.gpu_total_bytes = self.total;
        }
        out.samples_per_sec = out.samples_per_sec.or(median(&self.samples));
        out.tokens_per_sec = out.tokens_per_sec.or(median(&self.tokens));
        out.steps_per_sec = out.steps_per_sec.or(median(&self.steps));
        out.duration_sec = out.duration_sec.or(self.duration);
        self.completed
    }
}

#[cfg(test)]
mod tests {
    use super::super::{parse_str, LogOutcome};
    use super::*;
    use crate::units::GB;

    #[test]
    fn the_four_plain_lines_are_read_in_decimal_gb() {
        let p = parse_str(
            "GPU Memory: Used 45.2GB / 80.0GB\nPeak memory: 44.0 GB\nThroughput: 12.5 samples/sec\nTraining completed in 3600.0 seconds\n",
        )
        .unwrap();
        assert_eq!(p.formats, vec![LogFormat::Plain]);
        assert_eq!(p.peak_used_bytes, Some(45_200_000_000));
        assert_eq!(p.gpu_total_bytes, Some(80 * GB));
        assert_eq!(p.samples_per_sec, Some(12.5));
        assert_eq!(p.duration_sec, Some(3600.0));
        assert_eq!(p.outcome, Some(LogOutcome::Completed));
        assert_eq!(p.peak_memory_bytes(), Some(45_200_000_000));
    }

    #[test]
    fn gib_in_a_plain_line_is_binary() {
        let p = parse_str("Peak memory: 2.0 GiB\n").unwrap();
        assert_eq!(p.peak_used_bytes, Some(2 << 30));
    }

    #[test]
    fn minutes_are_converted_to_seconds() {
        let p = parse_str("Training finished in 2.5 minutes\n").unwrap();
        assert_eq!(p.duration_sec, Some(150.0));
    }

    #[test]
    fn tokens_throughput_is_kept_apart_from_samples() {
        let p = parse_str("Throughput: 2500 tokens/sec\n").unwrap();
        assert_eq!(p.tokens_per_sec, Some(2500.0));
        assert_eq!(p.samples_per_sec, None);
    }
}
