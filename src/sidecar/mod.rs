//! The node sidecar: reads GPUs (NVML, a declared inventory, or a simulated
//! backend), attributes processes to pods / Slurm jobs, keeps per-job peak
//! memory, and serves HTTP + Prometheus metrics (docs/design.md, "Measuring peaks"; docs/sidecar-api.md).
//!
//! | module          | what it owns |
//! |-----------------|--------------|
//! | [`source`]      | the [`GpuSource`] trait and the sample types |
//! | [`nvml`]        | the real backend (nvml-wrapper) |
//! | [`inventory`]   | GPUs declared in a YAML/TOML file |
//! | [`simulate`]    | deterministic synthetic GPUs and HTTP-registered processes |
//! | [`attribution`] | PID → pod / Slurm job (cgroup, environment, mapping dir) |
//! | [`tracker`]     | per-job current and peak memory, bounded |
//! | [`metrics`]     | the metric table and the Prometheus exposition |
//! | [`http`]        | the HTTP API (hyper); its module docs describe every body |
//!
//! Data flows one way: a sampler thread reads the source every interval,
//! attribution labels the processes, the tracker folds them in; HTTP
//! handlers and scrapes read the latest state.

pub mod attribution;
pub mod http;
pub mod inventory;
pub mod metrics;
pub mod nvml;
pub mod simulate;
pub mod source;
pub mod tracker;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use thiserror::Error;

pub use crate::wire::sidecar::{GpusResponse, Health, JobsResponse};
pub use attribution::{Attributor, JobKey};
pub use simulate::{SimJob, SimProcess, SimulateConfig, SimulatedSource};
pub use source::{
    Backend, GpuInfo, GpuSource, MigSlice, ProcessObservation, SliceRef, SourceSample,
};
pub use tracker::{JobView, PeakMethod, Tracker, TrackerConfig};

#[derive(Debug, Error)]
pub enum SidecarError {
    /// NVML is missing or failing; the message says what was tried and what to do.
    #[error("{0}")]
    Nvml(String),
    #[error("{0}")]
    Other(String),
    /// A bad flag, environment variable or inventory file.
    #[error("{0}")]
    Config(String),
    /// A bad HTTP request body or parameter.
    #[error("{0}")]
    BadRequest(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

// === configuration ===

/// Which GPU source to open, and its settings.
#[derive(Debug, Clone)]
pub struct BackendConfig {
    pub backend: Backend,
    /// Inventory file (`--backend inventory`).
    pub inventory: Option<PathBuf>,
    /// Path of libnvidia-ml (`--backend nvml`); None: the loader's search path.
    pub nvml_lib: Option<PathBuf>,
    /// Synthetic GPUs (`--backend simulate`).
    pub simulate: SimulateConfig,
}

impl BackendConfig {
    /// The NVML backend with default settings.
    pub fn nvml() -> Self {
        Self {
            backend: Backend::Nvml,
            inventory: None,
            nvml_lib: None,
            simulate: SimulateConfig {
                gpus: 8,
                model: simulate::DEFAULT_MODEL.to_string(),
                memory_bytes: None,
                node: node_name(),
                demo_jobs: 0,
                mig: Default::default(),
                mig_parent_refused: false,
            },
        }
    }
}

/// Everything `gpufit sidecar` needs.
#[derive(Debug, Clone)]
pub struct SidecarConfig {
    pub backend: BackendConfig,
    pub listen: SocketAddr,
    /// Sampling interval (default 100 ms: a training step's peak lasts about a step).
    pub interval: Duration,
    /// Node name used in labels and JSON.
    pub node: String,
    /// dcgm-exporter HPC mapping directory (`<dir>/<gpu index>` holds a Slurm job id).
    pub mapping_dir: Option<PathBuf>,
    /// Where the host's `/proc` is (`/proc`, or e.g. `/host/proc` in a container).
    pub proc_root: PathBuf,
    pub tracker: TrackerConfig,
    pub http: HttpConfig,
}

/// How the HTTP server treats its clients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpConfig {
    /// Connections held at once, lowered to the open-file limit less a
    /// reserve ([`crate::serve`]); past it the oldest idle one is closed (a
    /// new one is refused only when every held one is busy).
    pub max_connections: usize,
    /// A connection that has not sent a complete request head this long
    /// after it opened, or after its last answer, is closed.
    pub idle_timeout: Duration,
    /// Bearer token `POST /v1/jobs/{id}/log-peak` requires; `None`: the
    /// write is refused (403), as the controller does without its token.
    pub token: Option<String>,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            idle_timeout: Duration::from_secs(30),
            token: None,
        }
    }
}

impl HttpConfig {
    /// How [`crate::serve`] holds the sidecar's connections: this cap
    /// (lowered to the descriptor limit less a reserve) and idle timeout.
    pub fn serve_config(&self) -> crate::serve::ServeConfig {
        crate::serve::ServeConfig {
            name: "sidecar",
            max_connections: self.max_connections,
            idle_timeout: self.idle_timeout,
            ..crate::serve::ServeConfig::default()
        }
    }
}

/// The default sampling interval: never slower than 200 ms, so a training
/// step's peak is caught; PyTorch's caching allocator keeps reserved memory
/// at its peak for the rest of the step, so 100 ms sees it.
pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(100);

/// This machine's host name (`/proc/sys/kernel/hostname`), or `unknown`.
pub fn node_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".to_string())
}

/// A source, plus the simulate handle when the backend is simulate.
pub type OpenedSource = (Arc<dyn GpuSource>, Option<Arc<SimulatedSource>>);

/// Opens the configured source. For simulate, also returns the handle that
/// the HTTP API registers processes with.
pub fn open_source(cfg: &BackendConfig) -> Result<OpenedSource, SidecarError> {
    match cfg.backend {
        Backend::Nvml => Ok((
            Arc::new(nvml::NvmlSource::open(cfg.nvml_lib.clone())?),
            None,
        )),
        Backend::Inventory => {
            let path = cfg.inventory.as_ref().ok_or_else(|| {
                SidecarError::Config(
                    "--backend inventory needs --inventory FILE (YAML or TOML, see `gpufit sidecar --help`)".into(),
                )
            })?;
            Ok((Arc::new(inventory::InventorySource::from_file(path)?), None))
        }
        Backend::Simulate => {
            let s = Arc::new(SimulatedSource::new(&cfg.simulate)?);
            Ok((s.clone(), Some(s)))
        }
    }
}

/// What the configured source sees on this node now (`gpufit gpus --live`).
pub fn live_gpus(cfg: &BackendConfig) -> Result<Vec<GpuInfo>, SidecarError> {
    let (source, _) = open_source(cfg)?;
    Ok(source.sample().gpus)
}

/// The local GPU as NVML sees it (live values win over the catalog);
/// used by `gpufit suggest --gpu auto` and the Slurm TaskProlog's
/// fallback. A clear error when there is none. See [`local_gpu_noted`].
pub fn local_gpu() -> Result<crate::core::catalog::GpuSpec, SidecarError> {
    local_gpu_noted().map(|(g, _)| g)
}

/// [`local_gpu`], with a sentence saying which device was taken when it is
/// a MIG slice: the one `CUDA_VISIBLE_DEVICES` names (`MIG-<uuid>` or
/// `MIG-GPU-<card uuid>/<gi>/<ci>`), the smallest of several
/// ([`crate::slurm::plan::pick_job_device`], as the TaskProlog picks from
/// the sidecar's list). A card in MIG mode whose own memory NVML refuses
/// (an unprivileged job user) is no obstacle: its slices answer.
pub fn local_gpu_noted() -> Result<(crate::core::catalog::GpuSpec, Option<String>), SidecarError> {
    // The caller says what to do instead (name the GPU): the sidecar's own
    // flags (--nvml-lib, --backend) are not this command's.
    let source = nvml::NvmlSource::open_with_advice(None, "")?;
    let env: crate::slurm::plan::Env = std::env::vars()
        .filter(|(k, _)| k == "CUDA_VISIBLE_DEVICES")
        .collect();
    pick_local(
        &source.sample().gpus,
        &crate::slurm::plan::visible_devices(&env),
    )
}

/// The device of `gpus` (one sample) a job with `visible` (its
/// `CUDA_VISIBLE_DEVICES`) runs on, among the healthy ones.
pub fn pick_local(
    gpus: &[GpuInfo],
    visible: &[crate::slurm::plan::VisibleDevice],
) -> Result<(crate::core::catalog::GpuSpec, Option<String>), SidecarError> {
    // A card in MIG mode with no slice reads no memory: CUDA cannot run on it.
    let healthy: Vec<GpuInfo> = gpus
        .iter()
        .filter(|g| g.healthy && g.memory_total_bytes > 0)
        .cloned()
        .collect();
    let pick = crate::slurm::plan::pick_job_device(&healthy, visible, &[]).ok_or_else(|| {
        SidecarError::Nvml(
            "NVML works but reports no readable GPU on this node: check `nvidia-smi`, or name the GPU with --gpu".into(),
        )
    })?;
    Ok((gpu_spec_from_live(pick.device), pick.note))
}

/// The devices a job can run on: every GPU and MIG slice listed, less the
/// cards in MIG mode that list slices (CUDA sees a MIG-mode card only
/// through its slices), in the source's order.
pub fn usable_devices(gpus: &[GpuInfo]) -> impl Iterator<Item = &GpuInfo> {
    gpus.iter().filter(move |g| {
        g.mig.is_some() || !gpus.iter().any(|s| s.index == g.index && s.mig.is_some())
    })
}

/// A live GPU as a catalog-shaped spec (the one rule:
/// [`crate::core::catalog::GpuSpec::from_live`]).
pub fn gpu_spec_from_live(g: &GpuInfo) -> crate::core::catalog::GpuSpec {
    crate::core::catalog::GpuSpec::from_live(
        &g.name,
        g.memory_total_bytes,
        g.compute_capability.as_deref(),
    )
}

// === the running sidecar's state ===

/// What the sampler last saw, and the jobs it tracks.
struct Observations {
    gpus: Vec<GpuInfo>,
    tracker: Tracker,
    last_sample: Option<Instant>,
    sampled_at: Option<DateTime<Utc>>,
    processes: usize,
}

/// The sidecar's shared state: the source, the tracker and the metrics.
pub struct Sidecar {
    node: String,
    backend: Backend,
    interval: Duration,
    source: Arc<dyn GpuSource>,
    simulate: Option<Arc<SimulatedSource>>,
    attributor: Attributor,
    // Held across read-source → fold-in so samples are applied in order.
    sampling: Mutex<()>,
    state: Mutex<Observations>,
    metrics: Mutex<metrics::Metrics>,
    http: HttpConfig,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Sidecar {
    /// Opens the source and builds the state (no thread, no socket yet).
    pub fn new(cfg: &SidecarConfig) -> Result<Arc<Self>, SidecarError> {
        let (source, simulate) = open_source(&cfg.backend)?;
        Self::with_source(cfg, source, simulate)
    }

    /// Builds the state around a given source (tests hand in their own).
    pub fn with_source(
        cfg: &SidecarConfig,
        source: Arc<dyn GpuSource>,
        simulate: Option<Arc<SimulatedSource>>,
    ) -> Result<Arc<Self>, SidecarError> {
        let sc = Arc::new(Self {
            node: cfg.node.clone(),
            backend: source.backend(),
            interval: cfg.interval,
            source,
            simulate,
            attributor: Attributor::from_proc_root(cfg.proc_root.clone(), cfg.mapping_dir.clone()),
            sampling: Mutex::new(()),
            state: Mutex::new(Observations {
                gpus: Vec::new(),
                tracker: Tracker::new(cfg.tracker.clone()),
                last_sample: None,
                sampled_at: None,
                processes: 0,
            }),
            metrics: Mutex::new(metrics::Metrics::new()?),
            http: cfg.http.clone(),
        });
        sc.sample_now();
        Ok(sc)
    }

    /// The HTTP server's settings.
    pub fn http_config(&self) -> &HttpConfig {
        &self.http
    }

    /// The largest memory of the GPUs seen (0 when none): the bound on a
    /// peak a job's log may state.
    pub fn max_gpu_memory(&self) -> u64 {
        lock(&self.state)
            .gpus
            .iter()
            .map(|g| g.memory_total_bytes)
            .max()
            .unwrap_or(0)
    }

    /// The memory a log-stated peak of `key` is checked against, and what
    /// it is: the largest device the job was seen on (on a MIG node its
    /// slice, not the card: a peak above the slice cannot be the job's),
    /// else the node's largest usable device (a card in MIG mode counts
    /// through its slices).
    pub fn log_peak_limit(&self, key: &JobKey) -> (u64, String) {
        let st = lock(&self.state);
        let job = st.tracker.peek(&key.id(), &self.node);
        let device_of = |g: &crate::wire::sidecar::JobGpuView| {
            st.gpus.iter().find(|d| {
                d.index == g.gpu
                    && d.mig.as_ref().map(|m| m.device) == g.mig.as_ref().map(|m| m.device)
            })
        };
        let on_job = job
            .iter()
            .flat_map(|j| j.gpus.iter())
            .filter_map(device_of)
            .filter(|d| d.memory_total_bytes > 0)
            .max_by_key(|d| d.memory_total_bytes);
        if let Some(d) = on_job {
            let what = match &d.mig {
                Some(m) => format!(
                    "the memory of the job's MIG slice {} on GPU {}",
                    m.profile, d.index
                ),
                None => format!("the memory of the job's GPU {}", d.index),
            };
            return (d.memory_total_bytes, what);
        }
        let largest = usable_devices(&st.gpus)
            .map(|g| g.memory_total_bytes)
            .max()
            .unwrap_or(0);
        (largest, "this node's GPU memory".into())
    }

    /// The node name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The backend in use.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The simulate handle, when the backend is simulate.
    pub fn simulator(&self) -> Option<&Arc<SimulatedSource>> {
        self.simulate.as_ref()
    }

    /// Reads the source once and folds the sample in.
    pub fn sample_now(&self) {
        let _order = lock(&self.sampling);
        let mut sample = self.source.sample();
        self.attributor
            .attribute_all_on(&mut sample.processes, &sample.gpus);
        let now = Utc::now();
        let mut st = lock(&self.state);
        st.tracker.update(&sample.processes, now);
        st.processes = sample.processes.iter().filter(|p| p.running).count();
        st.gpus = sample.gpus;
        st.last_sample = Some(Instant::now());
        st.sampled_at = Some(now);
    }

    /// `/v1/gpus`.
    pub fn gpus(&self) -> GpusResponse {
        let st = lock(&self.state);
        GpusResponse {
            node: self.node.clone(),
            backend: self.backend,
            sampled_at: st.sampled_at,
            gpus: st.gpus.clone(),
        }
    }

    /// `/v1/jobs` (marks ended jobs read).
    pub fn jobs(&self) -> JobsResponse {
        let jobs = lock(&self.state).tracker.read_all(&self.node, Utc::now());
        JobsResponse {
            node: self.node.clone(),
            backend: self.backend,
            per_job_data: self.source.sees_processes(),
            jobs,
        }
    }

    /// `/v1/jobs/{id}` (marks it read once ended).
    pub fn job(&self, id: &str) -> Option<JobView> {
        lock(&self.state).tracker.read(id, &self.node, Utc::now())
    }

    /// A job by id without marking it read.
    pub fn job_peek(&self, id: &str) -> Option<JobView> {
        let st = lock(&self.state);
        st.tracker.peek(id, &self.node)
    }

    /// Whether a new process of job `id` keeps the running jobs within
    /// `--max-jobs` ([`Tracker::has_room_for`]).
    pub fn has_room_for(&self, id: &str) -> bool {
        lock(&self.state).tracker.has_room_for(id)
    }

    /// Records the peak stated by a job's own log.
    pub fn set_log_peak(&self, key: JobKey, peak_bytes: u64) -> JobView {
        let mut st = lock(&self.state);
        let mut v = st.tracker.set_log_peak(key, peak_bytes, Utc::now());
        v.node = self.node.clone();
        v
    }

    /// `/healthz`: stale when no sample for 10 intervals plus 5 s.
    pub fn health(&self) -> Health {
        let st = lock(&self.state);
        let age = st.last_sample.map(|t| t.elapsed());
        let stale_after = self.interval * 10 + Duration::from_secs(5);
        Health {
            status: if age.is_some_and(|a| a <= stale_after) {
                "ok"
            } else {
                "stale"
            }
            .into(),
            node: self.node.clone(),
            backend: self.backend,
            gpus: st.gpus.len(),
            unhealthy_gpus: st
                .gpus
                .iter()
                .filter(|g| !g.healthy)
                .map(|g| g.index)
                .collect(),
            tracked_jobs: st.tracker.len(),
            last_sample_age_seconds: age.map(|a| a.as_secs_f64()),
        }
    }

    /// `/metrics` text.
    pub fn render_metrics(&self) -> Result<String, SidecarError> {
        let (gpus, jobs, age) = {
            let st = lock(&self.state);
            (
                st.gpus.clone(),
                st.tracker.peek_all(&self.node),
                st.last_sample
                    .map_or(f64::NAN, |t| t.elapsed().as_secs_f64()),
            )
        };
        lock(&self.metrics).render(&self.node, &gpus, &jobs, age)
    }

    /// Starts the sampler thread; it stops when the returned guard is dropped.
    pub fn spawn_sampler(self: &Arc<Self>) -> Result<SamplerGuard, SidecarError> {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let me = Arc::clone(self);
        let handle = std::thread::Builder::new()
            .name("gpufit-sampler".into())
            .spawn(move || {
                let mut next = Instant::now();
                loop {
                    next += me.interval;
                    let wait = next.saturating_duration_since(Instant::now());
                    match rx.recv_timeout(wait) {
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                        _ => break,
                    }
                    me.sample_now();
                    // Fell behind (a slow NVML call): do not burst to catch up.
                    if next < Instant::now() {
                        next = Instant::now();
                    }
                }
            })
            .map_err(|e| SidecarError::Io {
                context: "cannot start the sampler thread".into(),
                source: e,
            })?;
        Ok(SamplerGuard {
            stop: Some(tx),
            handle: Some(handle),
        })
    }
}

/// Stops the sampler thread on drop.
pub struct SamplerGuard {
    stop: Option<std::sync::mpsc::Sender<()>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Drop for SamplerGuard {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// A sidecar serving on a socket (in-process; the CLI and tests use it).
pub struct RunningSidecar {
    /// The bound address (useful with port 0).
    pub addr: SocketAddr,
    pub sidecar: Arc<Sidecar>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
    _sampler: SamplerGuard,
}

impl RunningSidecar {
    /// Stops accepting connections and the sampler, and waits for the server
    /// to drain (requests in flight finish, idle connections close).
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let _ = (&mut self.task).await;
    }
}

/// Opens the source, binds the socket, starts the sampler and the server.
pub async fn start(cfg: &SidecarConfig) -> Result<RunningSidecar, SidecarError> {
    let sidecar = Sidecar::new(cfg)?;
    start_with(cfg.listen, sidecar).await
}

/// Binds and serves an already built sidecar.
pub async fn start_with(
    listen: SocketAddr,
    sidecar: Arc<Sidecar>,
) -> Result<RunningSidecar, SidecarError> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| SidecarError::Io {
            context: format!("cannot listen on {listen} (in use? pick another with --listen)"),
            source: e,
        })?;
    let addr = listener.local_addr().map_err(|e| SidecarError::Io {
        context: "cannot read the bound address".into(),
        source: e,
    })?;
    let sampler = sidecar.spawn_sampler()?;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let sc = Arc::clone(&sidecar);
    let serve_cfg = sidecar.http_config().serve_config();
    let task = tokio::spawn(async move {
        let handler = move |req| {
            let sc = Arc::clone(&sc);
            async move { http::handle(&sc, req).await }
        };
        crate::serve::serve(listener, &serve_cfg, None, handler, async {
            let _ = rx.await;
        })
        .await;
    });
    Ok(RunningSidecar {
        addr,
        sidecar,
        stop: Some(tx),
        task,
        _sampler: sampler,
    })
}

#[cfg(test)]
mod tests {

    /// The local fallback (suggest --gpu auto, the TaskProlog without a
    /// sidecar) plans for the slice `CUDA_VISIBLE_DEVICES` names, in both of
    /// Slurm's id forms, on a card whose own reading is refused.
    #[test]
    fn the_local_fallback_follows_the_mig_ids_in_cuda_visible_devices() {
        use crate::slurm::plan::{visible_devices, Env};
        let cfg = simulate::SimulateConfig {
            gpus: 1,
            model: "NVIDIA A100-SXM4-80GB".into(),
            memory_bytes: None,
            node: "n".into(),
            demo_jobs: 0,
            mig: simulate::parse_mig_layout("0:1g.10gb,3g.40gb,1g.10gb").expect("layout"),
            mig_parent_refused: true,
        };
        let gpus = SimulatedSource::new(&cfg).expect("simulate").sample().gpus;
        let big = &gpus[2];
        let m = big.mig.as_ref().expect("a slice");
        let card = m.parent_uuid.trim_start_matches("GPU-");
        let legacy = format!(
            "MIG-GPU-{card}/{}/{}",
            m.gpu_instance_id.expect("gi"),
            m.compute_instance_id.expect("ci")
        );
        for id in [big.uuid.clone(), legacy] {
            let env: Env = [("CUDA_VISIBLE_DEVICES".to_string(), id.clone())].into();
            let (g, note) = pick_local(&gpus, &visible_devices(&env)).expect("a device");
            assert_eq!(g.name, "NVIDIA A100-SXM4-80GB MIG 3g.40gb", "{id}");
            assert_eq!(g.memory_bytes, big.memory_total_bytes);
            assert!(note.is_some_and(|n| n.contains("3g.40gb")), "{id}");
        }
        // Nothing named: the smallest slice, never the refused card (0 bytes).
        let (g, _) = pick_local(&gpus, &[]).expect("a device");
        assert_eq!(g.name, "NVIDIA A100-SXM4-80GB MIG 1g.10gb");
    }
    use super::*;

    #[test]
    fn live_gpu_becomes_a_spec_with_precisions_from_compute_capability() {
        let g = GpuInfo {
            index: 0,
            uuid: "GPU-1".into(),
            name: "Some Ada Card".into(),
            memory_total_bytes: 24 << 30,
            memory_used_bytes: 0,
            memory_free_bytes: 24 << 30,
            compute_capability: Some("8.9".into()),
            utilization_ratio: None,
            mig_enabled: None,
            accounting_enabled: None,
            healthy: true,
            error: None,
            mig: None,
        };
        let s = gpu_spec_from_live(&g);
        assert_eq!((s.bf16, s.fp8, s.memory_bytes), (true, true, 24 << 30));
        let old = GpuInfo {
            compute_capability: Some("7.5".into()),
            ..g
        };
        let s = gpu_spec_from_live(&old);
        assert_eq!((s.bf16, s.fp8), (false, false));
    }

    /// Two GPUs, the second of which fails to read (as NVML reports a
    /// device that fell off the bus), with one process on the first.
    struct HalfBroken;

    impl GpuSource for HalfBroken {
        fn backend(&self) -> Backend {
            Backend::Nvml
        }
        fn sample(&self) -> SourceSample {
            let ok = GpuInfo {
                index: 0,
                uuid: "GPU-a".into(),
                name: "NVIDIA A100-SXM4-80GB".into(),
                memory_total_bytes: 80 << 30,
                memory_used_bytes: 5 << 30,
                memory_free_bytes: 75 << 30,
                compute_capability: Some("8.0".into()),
                utilization_ratio: Some(0.5),
                mig_enabled: Some(false),
                accounting_enabled: Some(false),
                healthy: true,
                error: None,
                mig: None,
            };
            let broken = GpuInfo {
                index: 1,
                uuid: "GPU-b".into(),
                healthy: false,
                error: Some("memory: GPU is lost".into()),
                ..ok.clone()
            };
            SourceSample {
                gpus: vec![ok, broken],
                processes: vec![ProcessObservation {
                    pid: 77,
                    gpu: 0,
                    mig: None,
                    used_bytes: 5 << 30,
                    max_bytes: None,
                    running: true,
                    job: Some(JobKey::Slurm {
                        slurm_job_id: "31".into(),
                    }),
                }],
            }
        }
    }

    fn config() -> SidecarConfig {
        SidecarConfig {
            backend: BackendConfig::nvml(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            interval: DEFAULT_INTERVAL,
            node: "n1".into(),
            mapping_dir: None,
            proc_root: PathBuf::from("/nonexistent"),
            tracker: TrackerConfig::default(),
            http: HttpConfig::default(),
        }
    }

    #[test]
    fn a_gpu_that_fails_to_read_is_unhealthy_and_the_others_keep_working() {
        let sc = Sidecar::with_source(&config(), Arc::new(HalfBroken), None).expect("sidecar");
        let h = sc.health();
        assert_eq!(h.status, "ok");
        assert_eq!(h.unhealthy_gpus, vec![1]);
        let text = sc.render_metrics().expect("metrics");
        assert!(text.contains(r#"gpufit_gpu_healthy{gpu="1",mig_device="",mig_profile="",model="NVIDIA A100-SXM4-80GB",node="n1",uuid="GPU-b"} 0"#), "{text}");
        assert!(text.contains(r#"gpufit_gpu_memory_used_bytes{gpu="0",mig_device="",mig_profile="",model="NVIDIA A100-SXM4-80GB",node="n1",uuid="GPU-a"} 5368709120"#), "{text}");
        assert!(
            !text.contains(r#"gpufit_gpu_memory_used_bytes{gpu="1""#),
            "{text}"
        );
        assert_eq!(sc.job("31").map(|j| j.peak_bytes), Some(5 << 30));
    }

    #[test]
    fn nvml_start_message_names_the_library_the_path_and_the_other_backends() {
        let msg = nvml::nvml_start_message("loading libnvidia-ml.so.1", &"not found");
        for want in [
            "libnvidia-ml.so.1",
            "LD_LIBRARY_PATH",
            "--nvml-lib",
            "--backend inventory",
            "--backend simulate",
            "nvidia-smi",
        ] {
            assert!(msg.contains(want), "missing {want}: {msg}");
        }
    }

    #[test]
    fn nvml_failure_on_this_machine_is_an_error_that_says_what_to_do() {
        // Machines of this project have no GPU and no libnvidia-ml; where one
        // does, local_gpu succeeds and there is nothing to check here.
        if let Err(e) = local_gpu() {
            let msg = e.to_string();
            assert!(msg.contains("libnvidia-ml.so.1"), "{msg}");
            assert!(msg.contains("nvidia-smi"), "{msg}");
            // `suggest --gpu auto` has no such flags.
            for flag in ["--backend", "--nvml-lib", "--inventory"] {
                assert!(!msg.contains(flag), "{flag} in {msg}");
            }
        }
    }
}
