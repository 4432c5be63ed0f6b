//! `gpufit suggest`: engineering settings for a workload on a GPU, from the
//! memory model and the run history.

use crate::cli::common::TextRows;
use std::process::ExitCode;
use std::sync::Arc;

use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};

use super::common::{OnOff, WorkloadArgs};
use super::history::StoreArgs;
use super::{print_json, Global, OutputFormat};
use crate::core::advisor::{Strategy, StrategyTargets, Suggestion};
use crate::core::catalog::{lookup_gpu, GpuSpec};
use crate::core::run::RunRecord;
use crate::core::settings::{Dtype, Pins};
use crate::core::units::{fmt_gib, gib};
use crate::core::workload::Workload;
use crate::history::HistoryStore;
use crate::service::{Ask, Pipeline};

/// Which GPU: a catalog name, or `auto` for the local one.
#[derive(Debug, Clone, clap::Args)]
pub struct GpuArgs {
    /// GPU model as nvidia-smi prints it (`NVIDIA A100-SXM4-80GB`, `NVIDIA H100
    /// 80GB HBM3`, `NVIDIA L40S` …), or `auto` to read the local GPU through NVML.
    #[arg(long, env = "GPUFIT_GPU")]
    pub gpu: Option<String>,
    /// GPU memory in GiB: overrides the catalog, or describes a GPU that is
    /// not in it (then assumed bf16-capable; pin --dtype otherwise).
    #[arg(long, env = "GPUFIT_GPU_MEMORY")]
    pub gpu_memory: Option<f64>,
}

impl GpuArgs {
    /// Resolves the GPU: NVML for `auto`, else the catalog; `--gpu-memory` wins.
    pub fn resolve(&self) -> crate::Result<GpuSpec> {
        let name = self.gpu.as_deref().map(str::trim).unwrap_or_default();
        if name.is_empty() {
            return Err(crate::Error::Usage(
                "which GPU? pass --gpu NAME (e.g. --gpu \"NVIDIA A100-SXM4-80GB\"; `gpufit gpus` lists them) or --gpu auto".into(),
            ));
        }
        let mut spec = if name.eq_ignore_ascii_case("auto") {
            crate::sidecar::local_gpu().map_err(|e| {
                crate::Error::Usage(format!(
                    "--gpu auto needs a local NVIDIA GPU and its driver (NVML): {e}. Name the GPU instead, e.g. --gpu \"NVIDIA A100-SXM4-80GB\""
                ))
            })?
        } else {
            match (lookup_gpu(name), self.gpu_memory) {
                (Ok(s), _) => s,
                (Err(_), Some(_)) => GpuSpec {
                    name: name.to_string(),
                    memory_bytes: 0,
                    compute_capability: "unknown".into(),
                    bf16: true,
                    fp8: false,
                    bf16_tflops: 0.0,
                    fp32_tflops: 0.0,
                    memory_bandwidth_gbs: 0.0,
                },
                (Err(e), None) => return Err(e.into()),
            }
        };
        if let Some(g) = self.gpu_memory {
            if !(g.is_finite() && g > 0.0) {
                return Err(crate::Error::Usage(format!(
                    "--gpu-memory must be a positive number of GiB (got {g}), e.g. --gpu-memory 80"
                )));
            }
            spec.memory_bytes = gib(g);
        }
        Ok(spec)
    }
}

/// Engineering settings the user fixes; gpufit keeps them and only warns.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct PinArgs {
    /// Pin the micro batch size (per GPU).
    #[arg(long, env = "GPUFIT_MICRO_BATCH_SIZE")]
    pub micro_batch: Option<u32>,
    /// Pin gradient accumulation steps.
    #[arg(long)]
    pub grad_accum: Option<u32>,
    /// Pin the precision: fp32, bf16, fp16, bf16-mixed, fp16-mixed.
    #[arg(long, env = "GPUFIT_DTYPE")]
    pub dtype: Option<Dtype>,
    /// Pin activation checkpointing.
    #[arg(long, value_enum)]
    pub checkpointing: Option<OnOff>,
    /// Pin activation offloading to CPU memory.
    #[arg(long, value_enum)]
    pub offloading: Option<OnOff>,
    /// Pin torch.compile.
    #[arg(long, value_enum)]
    pub compile: Option<OnOff>,
    /// Pin data-loader workers.
    #[arg(long)]
    pub num_workers: Option<u32>,
    /// Pure bf16 weights (no fp32 master copy) for full fine-tunes in
    /// frameworks whose default keeps fp32 master weights (hf, lightning):
    /// `auto` offers them only when nothing else meets the target.
    #[arg(long, value_enum, default_value = "auto")]
    pub pure_bf16: PureBf16,
}

/// `--pure-bf16`: allow, forbid, or leave to the advisor.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum PureBf16 {
    #[default]
    Auto,
    Allow,
    Forbid,
}

impl PinArgs {
    pub fn to_pins(&self) -> Pins {
        Pins {
            micro_batch_size: self.micro_batch,
            gradient_accumulation_steps: self.grad_accum,
            dtype: self.dtype,
            activation_checkpointing: self.checkpointing.map(OnOff::as_bool),
            activation_offloading: self.offloading.map(OnOff::as_bool),
            compile: self.compile.map(OnOff::as_bool),
            num_workers: self.num_workers,
            pure_bf16: match self.pure_bf16 {
                PureBf16::Auto => None,
                PureBf16::Allow => Some(true),
                PureBf16::Forbid => Some(false),
            },
        }
    }
}

/// Everything the advisor needs from the command line (shared by
/// `suggest`, `plan`, `apply` and `find-max-batch`).
#[derive(Debug, Clone, clap::Args)]
pub struct AdviceArgs {
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub gpu: GpuArgs,
    #[command(flatten)]
    pub pins: PinArgs,
    #[command(flatten)]
    pub store: StoreArgs,
    /// Ignore the run history (memory model only).
    #[arg(long)]
    pub no_history: bool,
    /// Target fraction of GPU memory for conservative.
    #[arg(long, default_value_t = StrategyTargets::default().conservative, env = "GPUFIT_TARGET_CONSERVATIVE")]
    pub target_conservative: f64,
    /// Target fraction of GPU memory for balanced.
    #[arg(long, default_value_t = StrategyTargets::default().balanced, env = "GPUFIT_TARGET_BALANCED")]
    pub target_balanced: f64,
    /// Target fraction of GPU memory for aggressive.
    #[arg(long, default_value_t = StrategyTargets::default().aggressive, env = "GPUFIT_TARGET_AGGRESSIVE")]
    pub target_aggressive: f64,
    /// CPU cores the job has per GPU, for its data-loader workers (e.g. for a
    /// job that will run on another machine); default: this host's CPUs ÷ --gpus.
    #[arg(long, env = "GPUFIT_CPUS_PER_GPU")]
    pub cpus_per_gpu: Option<u32>,
}

/// What the advisor was given, resolved from flags, catalog and history.
pub struct Resolved {
    pub workload: Workload,
    pub gpu: GpuSpec,
    pub pins: Pins,
    pub targets: StrategyTargets,
    pub history: Arc<Vec<RunRecord>>,
    /// Problems with the history store that did not stop the suggestion.
    pub notes: Vec<String>,
    /// CPU cores per GPU for the data loader, and where the figure came from.
    pub cpus: Option<Cpus>,
}

/// The CPU cores per GPU the data-loader advice is sized for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cpus {
    /// Stated with `--cpus-per-gpu`.
    Stated(u32),
    /// This host's cores over the job's GPUs (at most 8 on one node).
    Host { cpus: u32, gpus: u32 },
}

impl Cpus {
    /// Cores per GPU.
    pub fn per_gpu(self) -> u32 {
        match self {
            Cpus::Stated(c) => c,
            // More than 8 GPUs are not on one node; spread over at most 8.
            Cpus::Host { cpus, gpus } => (cpus / gpus.clamp(1, 8)).max(1),
        }
    }

    /// The sentence the reasoning gets: how many workers, from what.
    fn sentence(self, workers: u32) -> String {
        match self {
            Cpus::Stated(c) => format!(
                "Data loader: {workers} worker{} for the {c} CPU core{} per GPU stated with --cpus-per-gpu.",
                plural(workers),
                plural(c)
            ),
            Cpus::Host { cpus, gpus } => format!(
                "Data loader: {workers} worker{} for this host's {cpus} CPU cores over {} GPU{} (no --cpus-per-gpu given; pass it for a job that runs on another machine).",
                plural(workers),
                gpus.clamp(1, 8),
                plural(gpus.clamp(1, 8))
            ),
        }
    }
}

fn plural(n: u32) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

impl AdviceArgs {
    /// Resolves workload, GPU, pins and history.
    pub fn resolve(&self) -> crate::Result<Resolved> {
        let workload = self.workload.resolve()?;
        let gpu = self.gpu.resolve()?;
        let targets = StrategyTargets {
            conservative: self.target_conservative,
            balanced: self.target_balanced,
            aggressive: self.target_aggressive,
        };
        targets.validate()?;
        let cpus = match self.cpus_per_gpu {
            Some(c) if (1..=MAX_CPUS_PER_GPU).contains(&c) => Some(Cpus::Stated(c)),
            Some(c) => {
                return Err(crate::Error::Usage(format!(
                    "--cpus-per-gpu {c} is out of range: give 1 to {MAX_CPUS_PER_GPU} (the cores each GPU's process and its data loader have)"
                )))
            }
            None => host_cpus(workload.gpus),
        };
        let mut notes = Vec::new();
        let history = if self.no_history {
            Arc::default()
        } else {
            let similar = |store: Box<dyn HistoryStore>| {
                Pipeline::similar_runs(store.as_ref(), &workload, &gpu)
            };
            match self.store.given() {
                // An explicitly named store must work.
                Some(url) => similar(self.store.open_url(url)?)?,
                // The default store is a convenience: advice without it
                // is still advice, so say so instead of failing.
                None => {
                    let url = crate::history::default_url();
                    match self.store.open_url(&url).and_then(|s| Ok(similar(s)?)) {
                        Ok(h) => h,
                        Err(e) => {
                            tracing::warn!(%url, error = %e, "history unavailable");
                            notes.push(format!(
                                "history store {url} unavailable ({e}): advice from the memory model only"
                            ));
                            Arc::default()
                        }
                    }
                }
            }
        };
        Ok(Resolved {
            workload,
            gpu,
            pins: self.pins.to_pins(),
            targets,
            history,
            notes,
            cpus,
        })
    }
}

/// Most `--cpus-per-gpu` accepted: more than any node has per GPU.
const MAX_CPUS_PER_GPU: u32 = 1024;

/// This machine's CPU cores over `gpus` data-parallel GPUs.
pub fn host_cpus(gpus: u32) -> Option<Cpus> {
    let cpus = std::thread::available_parallelism().ok()?.get();
    Some(Cpus::Host {
        cpus: u32::try_from(cpus).unwrap_or(u32::MAX),
        gpus,
    })
}

impl Resolved {
    /// One strategy's suggestion, through the one pipeline.
    pub fn suggest(&self, strategy: Strategy) -> crate::Result<Suggestion> {
        let ask = Ask {
            workload: &self.workload,
            gpu: &self.gpu,
            strategy,
            pins: &self.pins,
        };
        let mut s = Pipeline::new(self.targets)
            .with_cpus_per_gpu(self.cpus.map(Cpus::per_gpu))
            .advise(&ask, &self.history)?;
        if let (Some(cpus), None) = (self.cpus, self.pins.num_workers) {
            s.reasoning = format!(
                "{} {}",
                s.reasoning,
                cpus.sentence(s.settings.dataloader.num_workers)
            );
        }
        s.warnings.extend(self.notes.iter().cloned());
        Ok(s)
    }
}

#[derive(Debug, clap::Args)]
pub struct SuggestArgs {
    #[command(flatten)]
    pub advice: AdviceArgs,
    /// conservative, balanced or aggressive (alias extreme).
    #[arg(long, default_value = "balanced", env = "GPUFIT_STRATEGY")]
    pub strategy: Strategy,
}

pub fn run(g: &Global, args: SuggestArgs) -> crate::Result<ExitCode> {
    let r = args.advice.resolve()?;
    let s = r.suggest(args.strategy)?;
    match g.output {
        OutputFormat::Json => print_json(&s)?,
        OutputFormat::Table => print_table(&r.workload, r.targets.for_strategy(s.strategy), &s),
    }
    Ok(ExitCode::SUCCESS)
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// The suggestion for a person.
pub fn print_table(w: &Workload, target: f64, s: &Suggestion) {
    let e = &s.settings;
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(vec![
        format!("{} on {}", w.model.name, s.gpu),
        s.strategy.to_string(),
    ]);
    let dl = &e.dataloader;
    for (k, v) in [
        ("micro_batch_size", e.micro_batch_size.to_string()),
        (
            "gradient_accumulation_steps",
            e.gradient_accumulation_steps.to_string(),
        ),
        ("effective batch", s.effective_batch(w.gpus).to_string()),
        ("dtype", e.dtype.to_string()),
        (
            "activation_checkpointing",
            yes_no(e.activation_checkpointing).into(),
        ),
        (
            "activation_offloading",
            yes_no(e.activation_offloading).into(),
        ),
        ("compile", yes_no(e.compile).into()),
        (
            "data loader",
            format!(
                "{} workers, pin_memory {}, persistent {}, prefetch {}",
                dl.num_workers,
                yes_no(dl.pin_memory),
                yes_no(dl.persistent_workers),
                dl.prefetch_factor
            ),
        ),
        (
            "predicted peak",
            format!(
                "{} ({:.0} % of GPU, target {:.0} %)",
                fmt_gib(s.predicted_peak_bytes),
                s.memory_fraction * 100.0,
                target * 100.0
            ),
        ),
        ("throughput", fmt_tokens_per_sec(s)),
        ("confidence", format!("{:.2}", s.confidence)),
        ("source", s.source.as_str().into()),
    ] {
        t.add_text_row(vec![k.to_string(), v]);
    }
    println!("{t}");
    println!("{}", s.reasoning);
    for w in &s.warnings {
        println!("warning: {w}");
    }
}

/// "12,300 tokens/s measured (predicted 12,100)" or "12,100 tokens/s predicted".
pub fn fmt_tokens_per_sec(s: &Suggestion) -> String {
    let k = |x: f64| format!("{:.0}", x);
    match s.measured_tokens_per_sec {
        Some(m) => format!(
            "{} tokens/s measured (predicted {})",
            k(m),
            k(s.predicted_tokens_per_sec)
        ),
        None => format!("{} tokens/s predicted", k(s.predicted_tokens_per_sec)),
    }
}
