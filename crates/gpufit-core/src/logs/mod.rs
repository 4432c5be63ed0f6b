//! Log parsers: a training log → a run result (docs/design.md, "Log parsing"). Pure: text in,
//! result out; any input gives a result or a clear error, never a panic.
//!
//! One module per format, each a small line-by-line state machine:
//! [`torchtune`] (memory-stats and `Step N | key:value` metric lines),
//! [`hf`] (Hugging Face Trainer's `{'train_runtime': …}` dict lines),
//! [`lightning`] (progress bars and the `` `Trainer.fit` stopped`` line),
//! [`oom`] (PyTorch's CUDA out-of-memory message, both the current and the
//! pre-2.1 wording) and [`plain`] (lines that home-grown scripts print).
//!
//! Input is streamed line by line ([`parse_reader`]): memory stays bounded
//! for logs of any size, lines longer than [`MAX_LINE_BYTES`] are cut, and
//! invalid UTF-8 is replaced rather than rejected. Both `\n` and `\r` end a
//! line, because tqdm progress bars rewrite themselves with `\r`.
//!
//! Units: every memory figure is kept in bytes. A log's own unit decides the
//! factor: `GiB`/`MiB` are powers of two, `GB`/`MB` powers of ten.

pub mod hf;
pub mod lightning;
pub mod oom;
pub mod plain;
pub mod stated;
pub mod torchtune;

use std::io::BufRead;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::run::{RunOutcome, RunResult};
use crate::units::{GB, GIB, KIB, MB, MIB};

#[derive(Debug, Error, Clone, PartialEq)]
pub enum LogParseError {
    #[error("no training result found in the log: {0}")]
    NothingFound(String),
    /// The log could not be read (I/O error while streaming it).
    #[error("cannot read the log: {0}")]
    Read(String),
}

/// Lines longer than this are cut (the rest of the line is skipped and
/// counted). Real metric lines are well under 1 KiB; 64 KiB keeps a
/// newline-free binary blob from growing memory without bound.
pub const MAX_LINE_BYTES: usize = 64 * 1024;

/// Which parser recognised something in the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    Torchtune,
    HfTrainer,
    Lightning,
    CudaOom,
    Plain,
}

impl LogFormat {
    /// The name used in JSON output and tables.
    pub fn as_str(self) -> &'static str {
        match self {
            LogFormat::Torchtune => "torchtune",
            LogFormat::HfTrainer => "hf_trainer",
            LogFormat::Lightning => "lightning",
            LogFormat::CudaOom => "cuda_oom",
            LogFormat::Plain => "plain",
        }
    }
}

/// How the run ended, as far as the log tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogOutcome {
    /// An explicit end-of-training line (HF `train_runtime`, Lightning
    /// `Trainer.fit` stopped, torchtune checkpoint saved, "Training completed").
    Completed,
    /// PyTorch's CUDA out-of-memory error.
    OutOfMemory,
    /// A Python traceback or launcher failure without an OOM message.
    Failed,
    /// Metrics were found but no end marker (still running, or killed).
    Unknown,
}

/// Details of a CUDA out-of-memory message. All sizes in bytes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OomInfo {
    /// `Tried to allocate X`.
    pub tried_to_allocate_bytes: Option<u64>,
    /// The GPU's total capacity as PyTorch states it.
    pub gpu_total_bytes: Option<u64>,
    /// Free memory on the GPU when it failed.
    pub gpu_free_bytes: Option<u64>,
    /// `this process has X memory in use` (includes non-PyTorch memory).
    pub process_in_use_bytes: Option<u64>,
    /// Allocated by PyTorch's caching allocator.
    pub allocated_bytes: Option<u64>,
    /// Reserved by PyTorch's caching allocator (allocated + cached).
    pub reserved_bytes: Option<u64>,
    /// GPU index named in the message.
    pub gpu_index: Option<u32>,
    /// The message line itself (cut to 400 characters).
    pub message: String,
}

/// What a training log says about its run. Memory figures in bytes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ParsedLog {
    /// Parsers that recognised at least one line, in a stable order.
    pub formats: Vec<LogFormat>,
    /// Peak memory allocated by tensors (`torch.cuda.max_memory_allocated`).
    pub peak_allocated_bytes: Option<u64>,
    /// Peak memory reserved by the caching allocator.
    pub peak_reserved_bytes: Option<u64>,
    /// Peak active memory (allocated blocks in use).
    pub peak_active_bytes: Option<u64>,
    /// Peak "used" GPU memory as a script printed it (nvidia-smi-like or
    /// unspecified `Peak memory:`).
    pub peak_used_bytes: Option<u64>,
    /// Tokens per second (torchtune: per GPU).
    pub tokens_per_sec: Option<f64>,
    pub samples_per_sec: Option<f64>,
    /// Optimizer/iteration steps per second (progress bars, HF).
    pub steps_per_sec: Option<f64>,
    /// Wall time of training in seconds.
    pub duration_sec: Option<f64>,
    pub outcome: Option<LogOutcome>,
    pub oom: Option<OomInfo>,
    /// The GPU's total memory, from an OOM message or a `Used X / Y` line.
    pub gpu_total_bytes: Option<u64>,
    /// The last error line seen (e.g. `RuntimeError: …`), cut to 400 characters.
    pub error_message: Option<String>,
    /// Lines read.
    pub lines: u64,
    /// Lines longer than [`MAX_LINE_BYTES`], cut.
    pub long_lines: u64,
    /// Lines that were not valid UTF-8 or held NUL bytes.
    pub binary_lines: u64,
    /// The engineering settings the log states the job ran with (HF
    /// Trainer's training block, torchtune's config echo, Lightning's
    /// precision line); None when it states none. A run is evidence only
    /// for the settings it really ran, so these win over what was injected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stated: Option<stated::StatedSettings>,
    /// Which framework statements `stated` came from, sorted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stated_by: Vec<stated::StatedBy>,
}

impl ParsedLog {
    /// The best single peak-memory figure for the history: the allocator's
    /// reserved peak (what the GPU really had to hold for PyTorch), else a
    /// script's "used"/"peak" figure, else allocated, else active.
    pub fn peak_memory_bytes(&self) -> Option<u64> {
        self.peak_reserved_bytes
            .or(self.peak_used_bytes)
            .or(self.peak_allocated_bytes)
            .or(self.peak_active_bytes)
    }

    /// Whether the run succeeded: `Some(true)` for an explicit completion,
    /// `Some(false)` for OOM or another failure, `None` when the log does
    /// not say.
    pub fn success(&self) -> Option<bool> {
        match self.outcome? {
            LogOutcome::Completed => Some(true),
            LogOutcome::OutOfMemory | LogOutcome::Failed => Some(false),
            LogOutcome::Unknown => None,
        }
    }

    /// The log as a run result. `assume_success` decides a log without an
    /// end marker (metrics were printed, so the steps ran).
    pub fn to_run_result(&self, assume_success: bool) -> RunResult {
        let success = self.success().unwrap_or(assume_success);
        let oom = self.outcome == Some(LogOutcome::OutOfMemory);
        RunResult {
            outcome: RunOutcome::of(success, oom, false),
            peak_memory_bytes: self.peak_memory_bytes(),
            samples_per_sec: self.samples_per_sec,
            tokens_per_sec: self.tokens_per_sec,
            duration_sec: self.duration_sec,
        }
    }

    fn found_anything(&self) -> bool {
        !self.formats.is_empty() || self.outcome.is_some() || self.stated.is_some()
    }
}

// === units ===

/// Bytes for `value` in `unit` (`GiB`, `GB`, `MiB`, `MB`, `KiB`, `KB`,
/// `bytes`, case-insensitive; `G`/`M` alone count as decimal). None for an
/// unknown unit or a value that is negative, not finite, or above 2^60.
pub fn to_bytes(value: f64, unit: &str) -> Option<u64> {
    let factor = match unit.trim().to_ascii_lowercase().as_str() {
        "gib" => GIB as f64,
        "gb" | "g" => GB as f64,
        "mib" => MIB as f64,
        "mb" | "m" => MB as f64,
        "kib" => KIB as f64,
        "kb" | "k" => 1000.0,
        "b" | "bytes" | "byte" => 1.0,
        "tib" => (GIB * 1024) as f64,
        "tb" => 1e12,
        _ => return None,
    };
    let b = value * factor;
    // 2^60 bytes (an exbibyte) is far above any GPU; anything larger is garbage.
    if !b.is_finite() || b < 0.0 || b > (1u64 << 60) as f64 {
        return None;
    }
    Some(b.round() as u64)
}

/// Parses a finite, non-negative float.
pub(crate) fn num(s: &str) -> Option<f64> {
    let v: f64 = s.trim().parse().ok()?;
    (v.is_finite() && v >= 0.0).then_some(v)
}

pub(crate) fn max_opt(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.max(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

/// Median of positive finite values (robust to the slow first steps of a
/// run, e.g. compile warm-up).
pub(crate) fn median(v: &[f64]) -> Option<f64> {
    let mut xs: Vec<f64> = v
        .iter()
        .copied()
        .filter(|x| x.is_finite() && *x > 0.0)
        .collect();
    if xs.is_empty() {
        return None;
    }
    xs.sort_by(|a, b| a.total_cmp(b));
    let n = xs.len();
    Some(if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    })
}

/// Keeps at most this many per-step values for medians: bounded memory on
/// logs with millions of steps (the median of the first 100 000 is plenty).
pub(crate) const MAX_SAMPLES: usize = 100_000;

pub(crate) fn push_sample(v: &mut Vec<f64>, x: f64) {
    if v.len() < MAX_SAMPLES {
        v.push(x);
    }
}

fn cut(s: &str, n: usize) -> String {
    if s.len() <= n {
        return s.to_string();
    }
    let mut end = n;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

// === the line-by-line parser ===

/// Streaming parser: feed it lines, then [`LogParser::finish`].
#[derive(Debug, Default)]
pub struct LogParser {
    tt: torchtune::TorchtuneParser,
    hf: hf::HfParser,
    pl: lightning::LightningParser,
    oom: oom::OomParser,
    plain: plain::PlainParser,
    stated: stated::StatedParser,
    failure_seen: bool,
    error_message: Option<String>,
    lines: u64,
    long_lines: u64,
    binary_lines: u64,
}

impl LogParser {
    /// A parser that has seen nothing yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds one line (without its terminator).
    pub fn feed_line(&mut self, line: &str) {
        self.lines += 1;
        let line = line.trim_end();
        if line.is_empty() {
            return;
        }
        // Every parser sees every line: a torchtune run can end in a CUDA OOM,
        // and a home-grown script can print through Lightning.
        self.tt.feed(line);
        self.hf.feed(line);
        self.pl.feed(line);
        self.oom.feed(line);
        self.plain.feed(line);
        self.stated.feed(line);
        let t = line.trim_start();
        if t.starts_with("Traceback (most recent call last)")
            || t.contains("ChildFailedError")
            || t.starts_with("Killed")
        {
            self.failure_seen = true;
        }
        if is_error_line(t) {
            self.failure_seen = true;
            self.error_message = Some(cut(t, 400));
        }
    }

    fn feed_bytes(&mut self, bytes: &[u8], too_long: bool) {
        if too_long {
            self.long_lines += 1;
        }
        match std::str::from_utf8(bytes) {
            Ok(s) if !s.contains('\0') => self.feed_line(s),
            _ => {
                self.binary_lines += 1;
                let s = String::from_utf8_lossy(bytes).replace('\0', "");
                self.feed_line(&s);
            }
        }
    }

    /// Combines what every parser found.
    pub fn finish(self) -> Result<ParsedLog, LogParseError> {
        let mut out = ParsedLog {
            lines: self.lines,
            long_lines: self.long_lines,
            binary_lines: self.binary_lines,
            error_message: self.error_message,
            ..ParsedLog::default()
        };
        let mut completed = false;
        completed |= self.tt.finish(&mut out);
        completed |= self.hf.finish(&mut out);
        completed |= self.pl.finish(&mut out);
        completed |= self.plain.finish(&mut out);
        let oom = self.oom.finish(&mut out);
        if let Some((stated, by)) = self.stated.finish() {
            out.stated = Some(stated);
            out.stated_by = by;
        }
        out.formats.sort();
        out.formats.dedup();
        out.outcome = if oom {
            Some(LogOutcome::OutOfMemory)
        } else if completed {
            Some(LogOutcome::Completed)
        } else if self.failure_seen {
            Some(LogOutcome::Failed)
        } else if !out.formats.is_empty() {
            Some(LogOutcome::Unknown)
        } else {
            None
        };
        if !out.found_anything() {
            let what = if out.lines == 0 {
                "the log is empty".to_string()
            } else if out.binary_lines * 2 > out.lines {
                format!(
                    "{} of {} lines are not text: is this a training log?",
                    out.binary_lines, out.lines
                )
            } else {
                format!(
                    "{} lines read, none from torchtune, Hugging Face Trainer, Lightning, a CUDA out-of-memory error, or plain `Peak memory:`/`Throughput:` lines; pass the result with --peak-gb/--success instead",
                    out.lines
                )
            };
            return Err(LogParseError::NothingFound(what));
        }
        Ok(out)
    }
}

/// A Python exception line such as `RuntimeError: …` or
/// `torch.OutOfMemoryError: …` (the exception type ends in `Error` or
/// `Exception`, dotted module path allowed).
fn is_error_line(t: &str) -> bool {
    let Some((head, _)) = t.split_once(": ") else {
        return false;
    };
    if head.is_empty() || head.len() > 80 || head.contains(' ') {
        return false;
    }
    let last = head.rsplit('.').next().unwrap_or(head);
    (last.ends_with("Error") || last.ends_with("Exception"))
        && last.chars().next().is_some_and(|c| c.is_ascii_uppercase())
}

/// Parses a whole log held in memory.
pub fn parse_str(text: &str) -> Result<ParsedLog, LogParseError> {
    parse_reader(text.as_bytes())
}

/// Parses a log from any reader, streaming it line by line with bounded
/// memory: lines are split on `\n` and `\r`, cut at [`MAX_LINE_BYTES`].
pub fn parse_reader<R: BufRead>(mut r: R) -> Result<ParsedLog, LogParseError> {
    let mut p = LogParser::new();
    let mut line: Vec<u8> = Vec::with_capacity(256);
    let mut too_long = false;
    loop {
        let buf = match r.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(LogParseError::Read(e.to_string())),
        };
        if buf.is_empty() {
            break;
        }
        let (take, ended) = match buf.iter().position(|&b| b == b'\n' || b == b'\r') {
            Some(i) => (i, true),
            None => (buf.len(), false),
        };
        let room = MAX_LINE_BYTES.saturating_sub(line.len());
        if take > room {
            too_long = true;
        }
        line.extend_from_slice(&buf[..take.min(room)]);
        let consumed = if ended { take + 1 } else { take };
        r.consume(consumed);
        if ended {
            p.feed_bytes(&line, too_long);
            line.clear();
            too_long = false;
        }
    }
    if !line.is_empty() || too_long {
        p.feed_bytes(&line, too_long);
    }
    p.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gib_and_gb_give_different_bytes() {
        assert_eq!(to_bytes(1.0, "GiB"), Some(1 << 30));
        assert_eq!(to_bytes(1.0, "GB"), Some(1_000_000_000));
        assert_eq!(to_bytes(2.5, "MiB"), Some(2_621_440));
        assert_eq!(to_bytes(-1.0, "GB"), None);
        assert_eq!(to_bytes(1.0, "parsecs"), None);
        assert_eq!(to_bytes(f64::INFINITY, "GB"), None);
    }

    #[test]
    fn empty_input_is_a_clear_error() {
        let e = parse_str("").unwrap_err();
        assert!(e.to_string().contains("empty"), "{e}");
    }

    #[test]
    fn unrelated_text_says_what_was_expected() {
        let e = parse_str("hello\nworld\n").unwrap_err();
        assert!(e.to_string().contains("2 lines read"), "{e}");
    }

    #[test]
    fn binary_input_is_reported_as_not_text() {
        let bytes: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 256) as u8).collect();
        let e = parse_reader(&bytes[..]).unwrap_err();
        assert!(e.to_string().contains("not text"), "{e}");
    }

    #[test]
    fn a_huge_line_without_newline_is_cut_not_buffered() {
        let mut big = vec![b'x'; MAX_LINE_BYTES * 4];
        big.extend_from_slice(b"\nPeak memory: 45.2 GB\n");
        let p = parse_reader(&big[..]).unwrap();
        assert_eq!(p.long_lines, 1);
        assert_eq!(p.peak_used_bytes, Some(45_200_000_000));
    }

    #[test]
    fn carriage_returns_split_progress_bar_updates() {
        let text = "Peak memory: 1.0 GB\rThroughput: 3.5 samples/sec\r\n";
        let p = parse_str(text).unwrap();
        assert_eq!(p.samples_per_sec, Some(3.5));
        assert_eq!(p.lines, 3);
    }

    #[test]
    fn a_traceback_without_oom_is_a_failure() {
        let text = "Throughput: 10 samples/sec\nTraceback (most recent call last):\n  File \"train.py\", line 3\nValueError: bad shape\n";
        let p = parse_str(text).unwrap();
        assert_eq!(p.outcome, Some(LogOutcome::Failed));
        assert_eq!(p.error_message.as_deref(), Some("ValueError: bad shape"));
        let r = p.to_run_result(true);
        assert!(!r.success());
        assert_eq!(
            r.failure_reason(),
            Some(crate::run::FailureReason::OtherError)
        );
    }

    #[test]
    fn reserved_peak_is_preferred_over_allocated() {
        let p = ParsedLog {
            peak_allocated_bytes: Some(10),
            peak_reserved_bytes: Some(12),
            peak_used_bytes: Some(11),
            ..ParsedLog::default()
        };
        assert_eq!(p.peak_memory_bytes(), Some(12));
    }

    #[test]
    fn median_ignores_non_positive_values() {
        assert_eq!(median(&[0.0, 3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[4.0, 2.0]), Some(3.0));
    }
}

#[cfg(test)]
mod fixtures {
    //! Real-format log excerpts under `tests/fixtures/logs/`.
    use super::*;
    use crate::units::{GB, GIB};

    fn gib(x: f64) -> u64 {
        (x * GIB as f64).round() as u64
    }

    #[test]
    fn torchtune_lora_log_gives_reserved_peak_tokens_and_completion() {
        let p = parse_str(include_str!(
            "../../../../tests/fixtures/logs/torchtune_lora_single_device.log"
        ))
        .unwrap();
        assert_eq!(p.formats, vec![LogFormat::Torchtune]);
        assert_eq!(p.peak_reserved_bytes, Some(gib(23.154296875)));
        assert_eq!(p.peak_allocated_bytes, Some(gib(21.41229820251465)));
        assert_eq!(p.tokens_per_sec, Some(2843.9833984375));
        assert_eq!(p.outcome, Some(LogOutcome::Completed));
        assert_eq!(p.peak_memory_bytes(), p.peak_reserved_bytes);
    }

    #[test]
    fn torchtune_oom_log_is_an_oom_with_the_gpu_capacity() {
        let p = parse_str(include_str!(
            "../../../../tests/fixtures/logs/torchtune_full_oom.log"
        ))
        .unwrap();
        assert_eq!(p.formats, vec![LogFormat::Torchtune, LogFormat::CudaOom]);
        assert_eq!(p.outcome, Some(LogOutcome::OutOfMemory));
        assert_eq!(p.gpu_total_bytes, Some(gib(79.10)));
        assert_eq!(
            p.oom.as_ref().and_then(|o| o.tried_to_allocate_bytes),
            Some(gib(15.66))
        );
        assert!(p
            .error_message
            .as_deref()
            .unwrap_or("")
            .starts_with("torch.OutOfMemoryError"));
    }

    #[test]
    fn hf_trainer_log_gives_runtime_and_samples_per_second() {
        let p = parse_str(include_str!(
            "../../../../tests/fixtures/logs/hf_trainer.log"
        ))
        .unwrap();
        assert_eq!(p.formats, vec![LogFormat::HfTrainer]);
        assert!((p.duration_sec.unwrap() - 3635.56).abs() < 0.01);
        assert_eq!(p.samples_per_sec, Some(5.507));
        assert_eq!(p.steps_per_sec, Some(0.172));
        assert_eq!(p.outcome, Some(LogOutcome::Completed));
    }

    #[test]
    fn lightning_log_gives_iteration_rate_and_fit_stopped() {
        let p = parse_str(include_str!(
            "../../../../tests/fixtures/logs/lightning_tqdm.log"
        ))
        .unwrap();
        assert_eq!(p.formats, vec![LogFormat::Lightning]);
        assert!((p.steps_per_sec.unwrap() - 6.33).abs() < 1e-9);
        assert_eq!(p.duration_sec, Some(158.0 + 157.0));
        assert_eq!(p.outcome, Some(LogOutcome::Completed));
    }

    #[test]
    fn pre_2_1_pytorch_oom_log_gives_total_capacity() {
        let p = parse_str(include_str!(
            "../../../../tests/fixtures/logs/cuda_oom_old.log"
        ))
        .unwrap();
        assert_eq!(p.outcome, Some(LogOutcome::OutOfMemory));
        assert_eq!(p.gpu_total_bytes, Some(gib(39.39)));
        assert_eq!(
            p.oom.as_ref().and_then(|o| o.reserved_bytes),
            Some(gib(37.46))
        );
    }

    #[test]
    fn plain_script_log_uses_decimal_gigabytes() {
        let p = parse_str(include_str!(
            "../../../../tests/fixtures/logs/plain_script.log"
        ))
        .unwrap();
        assert_eq!(p.formats, vec![LogFormat::Plain]);
        assert_eq!(p.peak_memory_bytes(), Some(45_200_000_000));
        assert_eq!(p.gpu_total_bytes, Some(80 * GB));
        assert_eq!(p.samples_per_sec, Some(12.5));
        assert_eq!(p.duration_sec, Some(3600.0));
        assert_eq!(p.success(), Some(true));
    }
}

#[cfg(test)]
mod proptests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
            let _ = parse_reader(&bytes[..]);
        }

        #[test]
        fn arbitrary_text_lines_never_panic(lines in proptest::collection::vec(".{0,200}", 0..40)) {
            let _ = parse_str(&lines.join("\n"));
        }

        #[test]
        fn mutated_real_lines_never_panic(
            idx in 0usize..6,
            cut_at in 0usize..400,
            junk in ".{0,20}",
        ) {
            let lines = [
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.06 GiB is free.",
                "Step 10 | loss:1.2 lr:2e-05 tokens_per_second_per_gpu:2890.1 peak_memory_active:18.2 peak_memory_alloc:18.2 peak_memory_reserved:19.9 ",
                "{'train_runtime': 1234.5678, 'train_samples_per_second': 12.96, 'train_steps_per_second': 1.62}",
                "Epoch 0: 100%|██████████| 500/500 [01:40<00:00,  5.00it/s, v_num=0]",
                "GPU Memory: Used 45.2GB / 80.0GB",
                "\tGPU peak memory reserved: 16.64 GiB",
            ];
            let l = lines[idx];
            let mut end = cut_at.min(l.len());
            while !l.is_char_boundary(end) { end -= 1; }
            let text = format!("{}{}\n{}", &l[..end], junk, l);
            let p = parse_str(&text);
            prop_assert!(p.is_ok(), "the intact copy of the line must still be recognised");
        }

        #[test]
        fn plain_peak_in_gb_round_trips_to_bytes(tenths in 1u64..2_000_000) {
            let gb = tenths as f64 / 10.0;
            let p = parse_str(&format!("Peak memory: {gb:.1} GB\n")).unwrap();
            prop_assert_eq!(p.peak_used_bytes, Some(tenths * 100_000_000));
        }

        #[test]
        fn oom_total_capacity_round_trips_in_gib(hundredths in 1u64..100_000) {
            let gib = hundredths as f64 / 100.0;
            let line = format!("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of {gib:.2} GiB of which 0.50 GiB is free.");
            let p = parse_str(&line).unwrap();
            let want = (gib * (1u64 << 30) as f64).round() as u64;
            prop_assert_eq!(p.gpu_total_bytes, Some(want));
            prop_assert_eq!(p.outcome, Some(LogOutcome::OutOfMemory));
        }

        #[test]
        fn line_terminators_do_not_change_what_is_found(use_cr in proptest::collection::vec(any::<bool>(), 4)) {
            let lines = [
                "Peak memory: 10.0 GB",
                "Throughput: 5.0 samples/sec",
                "noise",
                "Training completed in 10.0 seconds",
            ];
            let mut text = String::new();
            for (l, cr) in lines.iter().zip(&use_cr) {
                text.push_str(l);
                text.push_str(if *cr { "\r\n" } else { "\n" });
            }
            let p = parse_str(&text).unwrap();
            prop_assert_eq!(p.peak_used_bytes, Some(10_000_000_000));
            prop_assert_eq!(p.samples_per_sec, Some(5.0));
            prop_assert_eq!(p.duration_sec, Some(10.0));
        }
    }
}
