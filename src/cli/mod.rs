//! The `gpufit` command line. Clap types live in each command's module;
//! this file wires the subcommands, global flags, logging and exit codes.

use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

pub mod apply;
pub mod common;
pub mod controller;
pub mod crd;
pub mod estimate;
pub mod find_max_batch;
pub mod gpus;
pub mod history;
pub mod models;
pub mod parse_log;
pub mod plan;
pub mod profile;
pub mod record;
pub mod report;
pub mod sidecar;
pub mod slurm;
pub mod suggest;

/// Output format for every command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum OutputFormat {
    /// Aligned tables for a person.
    #[default]
    Table,
    /// JSON for machines.
    Json,
}

/// Flags every subcommand accepts.
#[derive(Debug, Clone, clap::Args)]
pub struct Global {
    /// Output format.
    #[arg(long, short = 'o', global = true, value_enum, default_value_t = OutputFormat::Table, env = "GPUFIT_OUTPUT")]
    pub output: OutputFormat,
    /// Log level filter (tracing `EnvFilter` syntax), e.g. `debug` or `gpufit=trace`.
    #[arg(
        long = "log-level",
        global = true,
        default_value = "warn",
        env = "GPUFIT_LOG"
    )]
    pub log: String,
}

/// gpufit — fills your GPU without running out of memory, and learns from every run.
#[derive(Debug, Parser)]
#[command(name = "gpufit", version, about, long_about = None)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

// `controller` has many flags; the enum is built once per process, so its size does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Predict the peak GPU memory of a training step, with a breakdown.
    Estimate(estimate::EstimateArgs),
    /// Suggest engineering settings for a workload on a GPU.
    Suggest(suggest::SuggestArgs),
    /// The three strategies side by side, with data-loader advice.
    Plan(plan::PlanArgs),
    /// Binary-search the largest micro batch that really runs.
    FindMaxBatch(find_max_batch::FindMaxBatchArgs),
    /// Run history: import, export, list.
    History(history::HistoryArgs),
    /// Record one run's settings and result.
    Record(record::RecordArgs),
    /// Fleet report: OOMs, unused GPU memory, prediction error, throughput (table, JSON, HTML).
    Report(report::ReportArgs),
    /// Parse a training log into a run result.
    ParseLog(parse_log::ParseLogArgs),
    /// GPU catalog, or the GPUs on this node (--live).
    Gpus(gpus::GpusArgs),
    /// Model catalog.
    Models(models::ModelsArgs),
    /// This machine: CPU, RAM, disk, GPUs.
    Profile(profile::ProfileArgs),
    /// Write suggested settings into a torchtune / Hugging Face / Lightning YAML config.
    Apply(apply::ApplyArgs),
    /// Node sidecar: GPU inventory, per-job peak memory, HTTP API, metrics.
    Sidecar(sidecar::SidecarArgs),
    /// Kubernetes controller, admission webhook and the Slurm HTTP API.
    Controller(controller::ControllerArgs),
    /// Slurm hooks.
    Slurm(slurm::SlurmArgs),
    /// Print the TrainingJob CustomResourceDefinition YAML.
    Crd(crd::CrdArgs),
}

/// Entry point used by `main.rs`.
pub fn main() -> ExitCode {
    quiet_broken_pipe();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return parse_error(e),
    };
    init_tracing(&cli.global.log);
    let json = cli.global.output == OutputFormat::Json;
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            let code = e.exit_code();
            let mut causes = Vec::new();
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                causes.push(s.to_string());
                src = s.source();
            }
            print_error(json, &e.to_string(), &causes, code);
            ExitCode::from(code)
        }
    }
}

/// An error on stderr: `error: …` lines for a person, one JSON object
/// (`{"error", "exit_code", "causes"}`) with `-o json`, so a script that
/// asked for JSON never has to parse prose.
fn print_error(json: bool, message: &str, causes: &[String], code: u8) {
    if json {
        let v = serde_json::json!({"error": message, "exit_code": code, "causes": causes});
        eprintln!("{v}");
    } else {
        eprintln!("error: {message}");
        for c in causes {
            eprintln!("  caused by: {c}");
        }
    }
}

/// A command line clap refuses: its own report, or JSON when `-o json` /
/// `--output json` / `GPUFIT_OUTPUT=json` asked for it. Help and version
/// are printed as usual.
fn parse_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) || !json_requested(std::env::args().skip(1))
    {
        e.exit();
    }
    // The rendered report: its first line says what is wrong, the rest
    // (the offending value, the usage) goes along as causes.
    let lines: Vec<String> = e
        .render()
        .to_string()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| l.trim_start_matches("error: ").to_string())
        .collect();
    match lines.split_first() {
        Some((message, rest)) => print_error(true, message, rest, 2),
        None => print_error(true, "invalid command line", &[], 2),
    }
    ExitCode::from(2)
}

/// Whether the raw arguments (or `GPUFIT_OUTPUT`) ask for JSON output.
fn json_requested(args: impl Iterator<Item = String>) -> bool {
    let args: Vec<String> = args.collect();
    let from_args = args.iter().enumerate().find_map(|(i, a)| {
        if a == "-o" || a == "--output" {
            args.get(i + 1).map(|v| v == "json")
        } else {
            a.strip_prefix("--output=")
                .or_else(|| a.strip_prefix("-o="))
                .or_else(|| a.strip_prefix("-o").filter(|v| !v.is_empty()))
                .map(|v| v == "json")
        }
    });
    from_args.unwrap_or_else(|| std::env::var("GPUFIT_OUTPUT").is_ok_and(|v| v == "json"))
}

/// `gpufit models | head` closes stdout early; `println!` then panics with
/// "failed printing to stdout: Broken pipe". Exit quietly as Unix tools do
/// (128 + SIGPIPE) instead of printing a panic; every other panic keeps the
/// default report.
fn quiet_broken_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.contains("Broken pipe") {
            std::process::exit(141);
        }
        default(info);
    }));
}

fn init_tracing(filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Logs go to stderr: stdout carries the command's output (and, for the
    // Slurm TaskProlog, nothing but `export` lines).
    // Colour codes only for a person at a terminal: in a Slurm log, a
    // journal or a pipe they are noise.
    use std::io::IsTerminal;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

/// Dispatches a parsed command line.
pub fn run(cli: Cli) -> crate::Result<ExitCode> {
    let g = &cli.global;
    match cli.command {
        Command::Estimate(a) => estimate::run(g, a),
        Command::Suggest(a) => suggest::run(g, a),
        Command::Plan(a) => plan::run(g, a),
        Command::FindMaxBatch(a) => find_max_batch::run(g, a),
        Command::History(a) => history::run(g, a),
        Command::Record(a) => record::run(g, a),
        Command::Report(a) => report::run(g, a),
        Command::ParseLog(a) => parse_log::run(g, a),
        Command::Gpus(a) => gpus::run(g, a),
        Command::Models(a) => models::run(g, a),
        Command::Profile(a) => profile::run(g, a),
        Command::Apply(a) => apply::run(g, a),
        Command::Sidecar(a) => sidecar::run(g, a),
        Command::Controller(a) => controller::run(g, a),
        Command::Slurm(a) => slurm::run(g, a),
        Command::Crd(a) => crd::run(g, a),
    }
}

/// Prints a value as pretty JSON on stdout.
pub fn print_json<T: serde::Serialize>(v: &T) -> crate::Result<()> {
    let s = serde_json::to_string_pretty(v)
        .map_err(|e| crate::Error::Usage(format!("cannot serialize output: {e}")))?;
    println!("{s}");
    Ok(())
}
