//! `gpufit history import FILE | export | list`.

use crate::cli::common::TextRows;
use std::io::{BufReader, BufWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use comfy_table::Table;
use serde::Serialize;

use super::{Global, OutputFormat};
use crate::core::run::RunRecord;
use crate::core::units::fmt_gib;
use crate::history::jsonl::{self, ImportOptions, ImportStats, PeakUnit, ThreadedReader};
use crate::history::sqlite::{SqliteOptions, BUSY_TIMEOUT_ENV, DEFAULT_BUSY_TIMEOUT_MS};
use crate::history::{self, HistoryError, HistoryStore, ListFilter};

/// `--history`, declared once for every command that reads or writes the
/// history (flattened in); the environment is read here, at the edge.
#[derive(Debug, Clone, clap::Args)]
pub struct StoreArgs {
    /// History store: `sqlite:PATH` or `postgres://…`; default: the per-user SQLite file.
    #[arg(long, env = "GPUFIT_HISTORY", global = true, value_name = "URL")]
    pub history: Option<String>,
    /// How long a SQLite write waits for another process's lock, in ms.
    #[arg(
        long,
        env = BUSY_TIMEOUT_ENV,
        default_value_t = DEFAULT_BUSY_TIMEOUT_MS,
        global = true,
        hide = true
    )]
    pub history_busy_timeout_ms: u64,
}

impl StoreArgs {
    /// The store named by `--history` / `GPUFIT_HISTORY` (blank: none).
    pub fn given(&self) -> Option<&str> {
        self.history.as_deref().filter(|h| !h.trim().is_empty())
    }

    /// The store's URL: as given, else the per-user SQLite file.
    pub fn url(&self) -> String {
        self.given()
            .map_or_else(history::default_url, str::to_string)
    }

    /// The SQLite options given.
    pub fn sqlite(&self) -> SqliteOptions {
        SqliteOptions {
            busy_timeout: Duration::from_millis(self.history_busy_timeout_ms),
        }
    }

    /// Opens the store named by `--history` / `GPUFIT_HISTORY`, else the
    /// per-user SQLite file.
    pub fn open(&self) -> crate::Result<Box<dyn HistoryStore>> {
        self.open_url(&self.url())
    }

    /// Opens `url` with the options given.
    pub fn open_url(&self, url: &str) -> crate::Result<Box<dyn HistoryStore>> {
        Ok(history::open_with(url, self.sqlite())?)
    }
}

#[derive(Debug, clap::Args)]
pub struct HistoryArgs {
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(subcommand)]
    pub command: HistoryCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum HistoryCommand {
    /// Import runs from a JSON Lines file in the `run_logs.jsonl` layout
    /// (malformed lines are skipped and counted; the import is all or nothing).
    Import {
        /// The `.jsonl` file (`-` for standard input).
        file: PathBuf,
        /// Unit of `peak_memory_gb` in the file: gb (10^9 bytes) or gib (2^30).
        #[arg(long, value_enum, default_value_t = PeakUnit::Gb)]
        peak_unit: PeakUnit,
        /// Cluster name stamped on imported runs.
        #[arg(long)]
        cluster: Option<String>,
    },
    /// Export every run as `run_logs.jsonl` lines (oldest first).
    Export {
        /// Write to this file instead of standard output.
        #[arg(long)]
        output_file: Option<PathBuf>,
        /// Only runs of this model id.
        #[arg(long)]
        model: Option<String>,
        /// Only runs on this GPU model.
        #[arg(long)]
        gpu: Option<String>,
    },
    /// List recorded runs, newest first.
    List {
        /// Only runs of this model id.
        #[arg(long)]
        model: Option<String>,
        /// Only runs on this GPU model (catalog names are canonicalised).
        #[arg(long)]
        gpu: Option<String>,
        /// At most this many runs.
        #[arg(long, default_value_t = 20)]
        limit: usize,
    },
}

/// A GPU name as the history stores it: the catalog's NVML spelling when
/// the catalog knows it, else as given.
pub fn canonical_gpu(name: &str) -> String {
    crate::core::catalog::lookup_gpu(name)
        .map(|g| g.name)
        .unwrap_or_else(|_| name.trim().to_string())
}

/// Runs `gpufit history …`.
pub fn run(g: &Global, args: HistoryArgs) -> crate::Result<ExitCode> {
    let store = args.store.open()?;
    match args.command {
        HistoryCommand::Import {
            file,
            peak_unit,
            cluster,
        } => import(
            g,
            store.as_ref(),
            &file,
            ImportOptions { peak_unit, cluster },
        ),
        HistoryCommand::Export {
            output_file,
            model,
            gpu,
        } => export(
            store.as_ref(),
            output_file,
            model,
            gpu.as_deref().map(canonical_gpu),
        ),
        HistoryCommand::List { model, gpu, limit } => {
            let runs = store.list(&ListFilter {
                model,
                gpu_model: gpu.as_deref().map(canonical_gpu),
                limit: Some(limit),
            })?;
            match g.output {
                OutputFormat::Json => super::print_json(&runs)?,
                OutputFormat::Table => print_runs(&store.url(), &runs),
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

#[derive(Serialize)]
struct ImportOutput<'a> {
    store: String,
    file: String,
    #[serde(flatten)]
    stats: &'a ImportStats,
    total_in_store: u64,
}

fn import(
    g: &Global,
    store: &dyn HistoryStore,
    file: &std::path::Path,
    opts: ImportOptions,
) -> crate::Result<ExitCode> {
    let name = file.display().to_string();
    // Parsing runs on its own thread beside the inserts (ThreadedReader).
    let stats = if file.as_os_str() == "-" {
        let stdin = BufReader::with_capacity(1 << 20, std::io::stdin());
        let mut rd = ThreadedReader::spawn(stdin, "stdin", opts)?;
        store.record_batch_keyed(&mut rd)?;
        rd.finish()
    } else {
        let f = std::fs::File::open(file).map_err(|e| crate::Error::Io {
            context: format!("cannot open {name}"),
            source: e,
        })?;
        let mut rd = ThreadedReader::spawn(BufReader::with_capacity(1 << 20, f), &name, opts)?;
        store.record_batch_keyed(&mut rd)?;
        rd.finish()
    };
    let total = store.count()?;
    match g.output {
        OutputFormat::Json => super::print_json(&ImportOutput {
            store: store.url(),
            file: name,
            stats: &stats,
            total_in_store: total,
        })?,
        OutputFormat::Table => {
            println!(
                "imported {} run(s) from {name} into {} ({} in the store); skipped {} of {} line(s)",
                stats.imported,
                store.url(),
                total,
                stats.skipped,
                stats.lines
            );
            for (reason, n) in &stats.skipped_by_reason {
                println!("  skipped {n}: {reason}");
            }
            for (line, reason) in &stats.examples {
                println!("  e.g. line {line}: {reason}");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn export(
    store: &dyn HistoryStore,
    output_file: Option<PathBuf>,
    model: Option<String>,
    gpu: Option<String>,
) -> crate::Result<ExitCode> {
    let (mut w, target): (Box<dyn Write>, String) = match &output_file {
        Some(p) => {
            let f = std::fs::File::create(p).map_err(|e| crate::Error::Io {
                context: format!("cannot create {}", p.display()),
                source: e,
            })?;
            (Box::new(BufWriter::new(f)), p.display().to_string())
        }
        None => (
            Box::new(BufWriter::new(std::io::stdout().lock())),
            "stdout".into(),
        ),
    };
    let io_err = |e: std::io::Error| HistoryError::Io {
        path: target.clone(),
        message: format!("write failed: {e}"),
    };
    let mut written = 0u64;
    store.for_each(&mut |r| {
        if model.as_ref().is_some_and(|m| *m != r.model)
            || gpu.as_ref().is_some_and(|g| *g != r.gpu_model)
        {
            return Ok(());
        }
        written += 1;
        jsonl::write_record(&mut w, &r).map_err(io_err)
    })?;
    w.flush().map_err(io_err)?;
    if output_file.is_some() {
        eprintln!("exported {written} run(s) to {target}");
    }
    Ok(ExitCode::SUCCESS)
}

fn outcome(r: &RunRecord) -> &'static str {
    if r.result.success() {
        "ok"
    } else if r.is_oom() {
        "OOM"
    } else {
        "error"
    }
}

/// The peak, and for a multi-node job how many of its nodes it covers:
/// `61.20 GiB (2/2 nodes)`; `58.00 GiB (1/2 nodes, partial)` when a node
/// has not reported (the peak is then the largest of those that did);
/// `58.00 GiB (2/2 nodes, peak of 1: n2 without peak, partial)` when a node
/// reported without its peak. A partial peak is only a lower bound.
fn peak_cell(r: &RunRecord) -> String {
    let peak = r
        .result
        .peak_memory_bytes
        .map_or_else(|| "-".into(), fmt_gib);
    match &r.nodes {
        Some(n) if !n.without_peak.is_empty() => format!(
            "{peak} ({}/{} nodes, peak of {}: {} without peak, partial)",
            n.reported,
            n.expected,
            n.peaks(),
            n.without_peak.join(",")
        ),
        Some(n) if n.partial() => format!("{peak} ({}/{} nodes, partial)", n.reported, n.expected),
        Some(n) if n.expected > 1 => format!("{peak} ({}/{} nodes)", n.reported, n.expected),
        _ => peak,
    }
}

fn print_runs(url: &str, runs: &[RunRecord]) {
    if runs.is_empty() {
        println!("no runs in {url}");
        return;
    }
    let mut t = Table::new();
    t.load_preset(comfy_table::presets::UTF8_BORDERS_ONLY);
    t.set_header(vec![
        "id",
        "when (UTC)",
        "model",
        "method",
        "GPU",
        "seq",
        "micro",
        "accum",
        "dtype",
        "ckpt",
        "compile",
        "result",
        "peak",
        "samples/s",
    ]);
    for r in runs {
        let s = &r.settings;
        t.add_text_row(vec![
            r.id.map_or_else(String::new, |i| i.to_string()),
            r.timestamp.format("%Y-%m-%d %H:%M").to_string(),
            r.model.clone(),
            r.method.to_string(),
            r.gpu_model.clone(),
            r.seq_len.to_string(),
            s.micro_batch_size.to_string(),
            s.gradient_accumulation_steps.to_string(),
            s.dtype.to_string(),
            if s.activation_checkpointing {
                "on"
            } else {
                "off"
            }
            .into(),
            if s.compile { "on" } else { "off" }.into(),
            outcome(r).into(),
            peak_cell(r),
            r.result
                .samples_per_sec
                .map_or_else(|| "-".into(), |v| format!("{v:.2}")),
        ]);
    }
    println!("{t}");
}
