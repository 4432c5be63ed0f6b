//! `gpufit parse-log FILE`: what a training log says about its run.

use crate::cli::common::TextRows;
use std::io::BufReader;
use std::path::PathBuf;
use std::process::ExitCode;

use comfy_table::Table;
use serde::Serialize;

use super::{Global, OutputFormat};
use crate::core::logs::{self, LogOutcome, ParsedLog};
use crate::core::units::fmt_gib;

#[derive(Debug, clap::Args)]
pub struct ParseLogArgs {
    /// Training log (torchtune, Hugging Face Trainer, Lightning, a CUDA OOM
    /// traceback, or plain `Peak memory:` lines); `-` reads standard input.
    pub file: PathBuf,
}

/// JSON output: the parsed log plus the single peak figure gpufit records.
#[derive(Serialize)]
struct Output<'a> {
    file: String,
    /// The peak gpufit records (reserved, else used, else allocated, else active).
    peak_memory_bytes: Option<u64>,
    success: Option<bool>,
    /// `"OOM"`, `"other_error"` or null: the `result.failure_reason` of the
    /// `run_logs.jsonl` layout.
    failure_reason: Option<crate::core::run::FailureReason>,
    #[serde(flatten)]
    parsed: &'a ParsedLog,
}

/// Reads and parses a log file (or stdin for `-`), streaming it.
pub fn parse_file(path: &std::path::Path) -> crate::Result<ParsedLog> {
    if path.as_os_str() == "-" {
        let stdin = std::io::stdin();
        return Ok(logs::parse_reader(stdin.lock())?);
    }
    let f = std::fs::File::open(path).map_err(|e| crate::Error::Io {
        context: format!("cannot open log {}", path.display()),
        source: e,
    })?;
    Ok(logs::parse_reader(BufReader::with_capacity(1 << 16, f))?)
}

/// Runs `gpufit parse-log`.
pub fn run(g: &Global, args: ParseLogArgs) -> crate::Result<ExitCode> {
    let p = parse_file(&args.file)?;
    match g.output {
        OutputFormat::Json => super::print_json(&Output {
            file: args.file.display().to_string(),
            peak_memory_bytes: p.peak_memory_bytes(),
            success: p.success(),
            failure_reason: match p.outcome {
                Some(LogOutcome::OutOfMemory) => Some(crate::core::run::FailureReason::Oom),
                Some(LogOutcome::Failed) => Some(crate::core::run::FailureReason::OtherError),
                _ => None,
            },
            parsed: &p,
        })?,
        OutputFormat::Table => print_table(&args.file.display().to_string(), &p),
    }
    Ok(ExitCode::SUCCESS)
}

/// The settings the log states, as one line: what a recorder will store
/// instead of the injected ones.
fn stated_row(
    s: &crate::core::logs::stated::StatedSettings,
    stated_by: &[crate::core::logs::stated::StatedBy],
) -> String {
    let mut parts = Vec::new();
    if let Some(m) = s.micro_batch_size {
        parts.push(format!("micro batch {m}"));
    }
    if let Some(a) = s.gradient_accumulation_steps {
        parts.push(format!("accumulation {a}"));
    }
    if let Some(d) = s.dtype {
        parts.push(d.as_str().to_string());
    }
    let on_off = |b: bool| if b { "on" } else { "off" };
    if let Some(c) = s.activation_checkpointing {
        parts.push(format!("checkpointing {}", on_off(c)));
    }
    if let Some(o) = s.activation_offloading {
        parts.push(format!("offloading {}", on_off(o)));
    }
    if let Some(c) = s.compile {
        parts.push(format!("compile {}", on_off(c)));
    }
    let by: Vec<String> = stated_by
        .iter()
        .map(|b| {
            serde_json::to_value(b)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default()
        })
        .collect();
    format!("{} (stated by {})", parts.join(", "), by.join(", "))
}

fn print_table(file: &str, p: &ParsedLog) {
    let mut t = Table::new();
    t.load_preset(comfy_table::presets::NOTHING);
    let formats: Vec<&str> = p.formats.iter().map(|f| f.as_str()).collect();
    let outcome = match p.outcome {
        Some(LogOutcome::Completed) => "completed",
        Some(LogOutcome::OutOfMemory) => "CUDA out of memory",
        Some(LogOutcome::Failed) => "failed",
        Some(LogOutcome::Unknown) | None => "unknown (no end-of-training line)",
    };
    let mem = |b: Option<u64>| b.map(|b| format!("{} ({b} bytes)", fmt_gib(b)));
    let rows: Vec<(&str, Option<String>)> = vec![
        ("log", Some(file.to_string())),
        ("recognised", Some(formats.join(", "))),
        ("outcome", Some(outcome.to_string())),
        ("peak memory (recorded)", mem(p.peak_memory_bytes())),
        ("peak reserved", mem(p.peak_reserved_bytes)),
        ("peak allocated", mem(p.peak_allocated_bytes)),
        ("peak active", mem(p.peak_active_bytes)),
        ("peak used", mem(p.peak_used_bytes)),
        ("GPU total memory", mem(p.gpu_total_bytes)),
        ("tokens/s", p.tokens_per_sec.map(|v| format!("{v:.1}"))),
        ("samples/s", p.samples_per_sec.map(|v| format!("{v:.3}"))),
        ("steps/s", p.steps_per_sec.map(|v| format!("{v:.3}"))),
        ("duration", p.duration_sec.map(|v| format!("{v:.1} s"))),
        (
            "OOM tried to allocate",
            p.oom.as_ref().and_then(|o| mem(o.tried_to_allocate_bytes)),
        ),
        ("error", p.error_message.clone()),
        (
            "stated settings",
            p.stated.as_ref().map(|s| stated_row(s, &p.stated_by)),
        ),
    ];
    for (k, v) in rows {
        if let Some(v) = v {
            t.add_text_row(vec![k.to_string(), v]);
        }
    }
    println!("{t}");
    if p.long_lines > 0 || p.binary_lines > 0 {
        eprintln!(
            "note: {} over-long line(s) cut, {} line(s) not valid text",
            p.long_lines, p.binary_lines
        );
    }
}
