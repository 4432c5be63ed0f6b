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
    let cli = Cli::parse();
    init_tracing(&cli.global.log);
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                eprintln!("  caused by: {s}");
                src = s.source();
            }
            ExitCode::from(e.exit_code())
        }
    }
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
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
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
