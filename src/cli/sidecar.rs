//! `gpufit sidecar`: the node sidecar (docs/design.md, "Measuring peaks"). Flags here; the work is in
//! [`crate::sidecar`].

use crate::cli::common::TextRows;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use super::common::shutdown_signal;
use super::Global;
use crate::sidecar::{
    Backend, BackendConfig, HttpConfig, SidecarConfig, SimulateConfig, TrackerConfig,
    DEFAULT_INTERVAL,
};

/// Which GPU source to read, shared by `gpufit sidecar` and `gpufit gpus --live`.
#[derive(Debug, Clone, clap::Args)]
pub struct BackendArgs {
    /// GPU source: nvml (the real one), inventory (GPUs declared in a file), simulate (synthetic GPUs).
    #[arg(long, value_enum, default_value_t = Backend::Nvml, env = "GPUFIT_SIDECAR_BACKEND")]
    pub backend: Backend,
    /// Inventory file (YAML or TOML) for `--backend inventory`: `gpus: [{name, count, memory_gib}]`.
    #[arg(long, env = "GPUFIT_SIDECAR_INVENTORY")]
    pub inventory: Option<PathBuf>,
    /// Path of libnvidia-ml.so.1 when the loader does not find it.
    #[arg(long, env = "GPUFIT_SIDECAR_NVML_LIB")]
    pub nvml_lib: Option<PathBuf>,
    /// Number of synthetic GPUs for `--backend simulate`.
    #[arg(long, default_value_t = 8, env = "GPUFIT_SIDECAR_SIMULATE_GPUS")]
    pub simulate_gpus: u32,
    /// Model of the synthetic GPUs (a catalog name as nvidia-smi prints it).
    #[arg(long, default_value = crate::sidecar::simulate::DEFAULT_MODEL, env = "GPUFIT_SIDECAR_SIMULATE_MODEL")]
    pub simulate_model: String,
    /// Memory of each synthetic GPU in GiB, overriding the catalog (needed for a model not in it).
    #[arg(long, env = "GPUFIT_SIDECAR_SIMULATE_MEMORY_GIB")]
    pub simulate_memory_gib: Option<f64>,
    /// Synthetic demo jobs for `--backend simulate` whose memory rises, peaks and falls every minute.
    #[arg(long, default_value_t = 0, env = "GPUFIT_SIDECAR_SIMULATE_DEMO_JOBS")]
    pub simulate_demo_jobs: u32,
    /// GPUs in MIG mode for `--backend simulate` and their slices, `GPU:PROFILE,PROFILE…;GPU:…`
    /// (e.g. `0:1g.10gb,1g.10gb,3g.40gb`): profiles of --simulate-model, each slice its own device.
    #[arg(long, env = "GPUFIT_SIDECAR_SIMULATE_MIG")]
    pub simulate_mig: Option<String>,
    /// With --simulate-mig: the cards in MIG mode refuse their own memory reading (NVML's
    /// NoPermission, as without MIG monitoring privileges) while their slices answer, and
    /// per-process figures on the slices are unavailable.
    #[arg(long, env = "GPUFIT_SIDECAR_SIMULATE_MIG_PARENT_REFUSED")]
    pub simulate_mig_parent_refused: bool,
}

impl BackendArgs {
    /// The backend configuration; `node` seeds the synthetic UUIDs.
    pub fn to_config(&self, node: &str) -> crate::Result<BackendConfig> {
        let memory_bytes = match self.simulate_memory_gib {
            Some(g) if g.is_finite() && g > 0.0 => Some(crate::core::units::gib(g)),
            Some(g) => {
                return Err(crate::Error::Usage(format!(
                    "--simulate-memory-gib {g} must be a positive number of GiB"
                )))
            }
            None => None,
        };
        let mig = match &self.simulate_mig {
            Some(text) => crate::sidecar::simulate::parse_mig_layout(text)
                .map_err(|e| crate::Error::Usage(format!("--simulate-mig: {e}")))?,
            None => Default::default(),
        };
        Ok(BackendConfig {
            backend: self.backend,
            inventory: self.inventory.clone(),
            nvml_lib: self.nvml_lib.clone(),
            simulate: SimulateConfig {
                gpus: self.simulate_gpus,
                model: self.simulate_model.clone(),
                memory_bytes,
                node: node.to_string(),
                demo_jobs: self.simulate_demo_jobs,
                mig,
                mig_parent_refused: self.simulate_mig_parent_refused,
            },
        })
    }
}

/// `gpufit sidecar --backend nvml|inventory|simulate --listen ADDR:PORT …`
#[derive(Debug, clap::Args)]
pub struct SidecarArgs {
    #[command(flatten)]
    pub source: BackendArgs,
    /// Address and port to serve HTTP on.
    #[arg(long, default_value = "0.0.0.0:9445", env = "GPUFIT_SIDECAR_LISTEN")]
    pub listen: SocketAddr,
    /// Sampling interval (e.g. `100ms`, `1s`); at most 200ms catches a training step's peak.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "100ms", env = "GPUFIT_SIDECAR_INTERVAL")]
    pub interval: Duration,
    /// Node name for labels and JSON (default: the host name; in Kubernetes set it from spec.nodeName).
    #[arg(long, env = "GPUFIT_NODE_NAME")]
    pub node: Option<String>,
    /// dcgm-exporter HPC mapping directory: a file per GPU index holding the Slurm job id that owns it.
    #[arg(long, env = "GPUFIT_MAPPING_DIR")]
    pub mapping_dir: Option<PathBuf>,
    /// Where the host's /proc is mounted (for cgroup-based job attribution).
    #[arg(long, default_value = "/proc", env = "GPUFIT_SIDECAR_PROC_ROOT")]
    pub proc_root: PathBuf,
    /// Most jobs kept in memory (ended ones are evicted first).
    #[arg(long, default_value_t = 1024, env = "GPUFIT_SIDECAR_MAX_JOBS")]
    pub max_jobs: usize,
    /// How long an ended job is kept after it was first read through the API.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5m", env = "GPUFIT_SIDECAR_JOB_RETENTION")]
    pub job_retention: Duration,
    /// Most HTTP connections held at once; past it the oldest idle one is closed.
    #[arg(long, default_value_t = 1024, env = "GPUFIT_SIDECAR_MAX_CONNECTIONS")]
    pub max_connections: usize,
    /// A connection that sends no complete request head this long (after it
    /// opened, or after its last answer) is closed.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "30s", env = "GPUFIT_SIDECAR_IDLE_TIMEOUT")]
    pub idle_timeout: Duration,
    /// File holding the bearer token `POST /v1/jobs/{id}/log-peak` requires
    /// (the controller's token file; without it that write is refused).
    #[arg(long, env = "GPUFIT_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
}

/// Shortest interval accepted: below it NVML calls would dominate the sidecar's CPU.
const MIN_INTERVAL: Duration = Duration::from_millis(10);

pub fn run(_g: &Global, args: SidecarArgs) -> crate::Result<ExitCode> {
    if args.interval < MIN_INTERVAL || args.interval > Duration::from_secs(60) {
        return Err(crate::Error::Usage(format!(
            "--interval {} is out of range: give 10ms to 60s (default {})",
            humantime::format_duration(args.interval),
            humantime::format_duration(DEFAULT_INTERVAL)
        )));
    }
    if args.interval > Duration::from_millis(200) {
        tracing::warn!(
            interval = %humantime::format_duration(args.interval),
            "sampling slower than 200ms can miss a training step's peak (NVML accounting mode, if on, stays exact)"
        );
    }
    if args.max_jobs == 0 {
        return Err(crate::Error::Usage("--max-jobs must be at least 1".into()));
    }
    if args.source.simulate_demo_jobs as usize > args.max_jobs {
        return Err(crate::Error::Usage(format!(
            "--simulate-demo-jobs {} is more than --max-jobs {}: the sidecar holds at most --max-jobs running jobs",
            args.source.simulate_demo_jobs, args.max_jobs
        )));
    }
    if args.max_connections == 0 {
        return Err(crate::Error::Usage(
            "--max-connections must be at least 1".into(),
        ));
    }
    if args.idle_timeout < Duration::from_millis(100) {
        return Err(crate::Error::Usage(format!(
            "--idle-timeout {} is too short: give at least 100ms (default 30s)",
            humantime::format_duration(args.idle_timeout)
        )));
    }
    let token = match &args.token_file {
        Some(p) => Some(
            crate::controller::api::read_token_file(p)
                .map_err(|e| crate::Error::Usage(e.to_string()))?,
        ),
        None => None,
    };
    let node = args
        .node
        .clone()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(crate::sidecar::node_name);
    let cfg = SidecarConfig {
        backend: args.source.to_config(&node)?,
        listen: args.listen,
        interval: args.interval,
        node,
        mapping_dir: args.mapping_dir,
        proc_root: args.proc_root,
        tracker: TrackerConfig {
            max_jobs: args.max_jobs,
            retention_after_read: args.job_retention,
            ..TrackerConfig::default()
        },
        http: HttpConfig {
            max_connections: args.max_connections,
            idle_timeout: args.idle_timeout,
            token,
        },
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        // A node agent: two workers serve a scrape and the API with room to spare.
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| crate::Error::Io {
            context: "cannot start the async runtime".into(),
            source: e,
        })?;
    rt.block_on(async move {
        let running = crate::sidecar::start(&cfg).await?;
        let sc = &running.sidecar;
        eprintln!(
            "gpufit sidecar: backend {}, node {}, {} GPU(s), sampling every {}, listening on http://{}",
            sc.backend(),
            sc.node(),
            sc.gpus().gpus.len(),
            humantime::format_duration(cfg.interval),
            running.addr
        );
        shutdown_signal().await;
        tracing::info!("shutting down");
        running.stop().await;
        Ok::<_, crate::Error>(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// `gpufit gpus --live`: what the sidecar's source sees on this node now.
/// `name` keeps only GPUs whose name contains it (case-insensitive).
pub fn print_live(g: &Global, source: &BackendArgs, name: Option<&str>) -> crate::Result<ExitCode> {
    let node = crate::sidecar::node_name();
    let mut gpus = crate::sidecar::live_gpus(&source.to_config(&node)?)?;
    if let Some(n) = name {
        let n = n.to_lowercase();
        gpus.retain(|gpu| gpu.name.to_lowercase().contains(&n));
    }
    if g.output == super::OutputFormat::Json {
        super::print_json(&gpus)?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::UTF8_BORDERS_ONLY);
    t.set_header([
        "GPU",
        "Name",
        "Memory total",
        "Used",
        "Free",
        "CC",
        "Util",
        "MIG",
        "Health",
        "UUID",
    ]);
    for gpu in &gpus {
        let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
        t.add_text_row([
            gpu.index.to_string(),
            gpu.name.clone(),
            crate::core::units::fmt_gib(gpu.memory_total_bytes),
            crate::core::units::fmt_gib(gpu.memory_used_bytes),
            crate::core::units::fmt_gib(gpu.memory_free_bytes),
            opt(gpu.compute_capability.clone()),
            opt(gpu.utilization_ratio.map(|u| format!("{:.0}%", u * 100.0))),
            match &gpu.mig {
                // A slice: its place on the card and, when known, its GPU instance.
                Some(m) => match m.gpu_instance_id {
                    Some(gi) => format!("slice {} (GI {gi})", m.device),
                    None => format!("slice {}", m.device),
                },
                None => opt(gpu
                    .mig_enabled
                    .map(|m| if m { "on" } else { "off" }.to_string())),
            },
            match (&gpu.error, gpu.healthy) {
                (Some(e), false) => format!("unhealthy: {e}"),
                // A MIG-mode card whose own reading NVML refused.
                (Some(e), true) => format!("ok ({e})"),
                (None, _) => "ok".into(),
            },
            gpu.uuid.clone(),
        ]);
    }
    println!("{t}");
    if gpus.is_empty() {
        eprintln!("no GPU seen by the {} backend on {node}", source.backend);
    }
    Ok(ExitCode::SUCCESS)
}
