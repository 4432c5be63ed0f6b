//! `gpufit controller`: the Kubernetes controller (TrainingJob reconciler,
//! admission webhook, leader election, metrics) plus the HTTP API the Slurm
//! hooks use; `--no-kubernetes` serves only that API.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use super::common::shutdown_signal;
use super::history::StoreArgs;
use super::Global;
use crate::controller::api::{self, ApiConfig};
use crate::controller::crd::Mode;
use crate::controller::kueue::Unlabelled;
use crate::controller::leader::LeaderConfig;
use crate::controller::prom::DEFAULT_PEAK_QUERY;
use crate::controller::run::{self, ControllerConfig};
use crate::controller::webhook::WebhookConfig;
use crate::core::advisor::StrategyTargets;

/// `Inject` or `Recommend` on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ModeArg {
    /// Write the settings into Jobs (default).
    #[value(name = "Inject", alias = "inject")]
    Inject,
    /// Only annotate and report in status.
    #[value(name = "Recommend", alias = "recommend")]
    Recommend,
}

#[derive(Debug, clap::Args)]
pub struct ControllerArgs {
    /// Address of the HTTP endpoints: Slurm API (POST /v1/suggest, /v1/runs), /metrics, /healthz, /readyz.
    #[arg(long, default_value = "0.0.0.0:8080", env = "GPUFIT_LISTEN")]
    pub listen: SocketAddr,
    #[command(flatten)]
    pub store: StoreArgs,
    /// File holding the bearer token required for writes (POST /v1/runs).
    #[arg(long, env = "GPUFIT_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Serve only the HTTP API (for Slurm sites): no Kubernetes connection.
    #[arg(long, env = "GPUFIT_NO_KUBERNETES")]
    pub no_kubernetes: bool,
    /// Default mode where neither the TrainingJob nor its namespace's
    /// `gpufit.io/mode` label says: Inject or Recommend.
    #[arg(long, value_enum, default_value = "Inject", env = "GPUFIT_MODE")]
    pub mode: ModeArg,
    /// Address of the HTTPS admission webhook (POST /mutate); served only
    /// with --tls-cert and --tls-key.
    #[arg(long, default_value = "0.0.0.0:8443", env = "GPUFIT_WEBHOOK_LISTEN")]
    pub webhook_listen: SocketAddr,
    /// PEM certificate (chain) of the webhook.
    #[arg(long, env = "GPUFIT_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of the webhook.
    #[arg(long, env = "GPUFIT_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Prometheus base URL for peak GPU memory of finished Jobs (e.g. http://prometheus:9090).
    #[arg(long, env = "GPUFIT_PROMETHEUS_URL")]
    pub prometheus_url: Option<String>,
    /// PromQL template for a Job's peak GPU memory in bytes; placeholders
    /// {namespace}, {pods}, {job}, {range}. For dcgm-exporter use
    /// `max(max_over_time(DCGM_FI_DEV_FB_USED{namespace="{namespace}",pod=~"{pods}"}[{range}])) * 1048576`.
    #[arg(long, default_value = DEFAULT_PEAK_QUERY, env = "GPUFIT_PROM_QUERY")]
    pub prom_query: String,
    /// Timeout of each Prometheus or sidecar request.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration, env = "GPUFIT_PROM_TIMEOUT")]
    pub prom_timeout: Duration,
    /// Node sidecar URL template, the fallback for peaks ({host_ip}, {node}), e.g. http://{host_ip}:9445.
    #[arg(long, env = "GPUFIT_SIDECAR_URL")]
    pub sidecar_url: Option<String>,
    /// Watch TrainingJobs in this namespace only (default: all).
    #[arg(long, env = "GPUFIT_WATCH_NAMESPACE")]
    pub watch_namespace: Option<String>,
    /// Answer Kueue AdmissionChecks whose controllerName is gpufit.io/advisor
    /// (Kueue's API must be installed): jobs queued in Kueue get the settings
    /// of the flavor and counts they are admitted with.
    #[arg(long, env = "GPUFIT_KUEUE")]
    pub kueue: bool,
    /// Kueue manages jobs without a `kueue.x-k8s.io/queue-name` label too
    /// (set when Kueue's configuration has `manageJobsWithoutQueueName:
    /// true`): the webhook configures such jobs at admission, in the
    /// namespaces --kueue-managed-jobs-namespace-selector matches. A
    /// namespace's `gpufit.io/kueue` label (`managed`, `unmanaged`)
    /// overrides both.
    #[arg(
        long,
        env = "GPUFIT_KUEUE_MANAGE_JOBS_WITHOUT_QUEUE_NAME",
        requires = "kueue"
    )]
    pub kueue_manage_jobs_without_queue_name: bool,
    /// Kueue's `managedJobsNamespaceSelector`, copied from its
    /// configuration: a LabelSelector in JSON or YAML on the namespaces'
    /// labels (default: Kueue's default, every namespace but kube-system
    /// and kueue-system).
    #[arg(
        long,
        default_value = crate::controller::kueue::DEFAULT_NAMESPACE_SELECTOR,
        env = "GPUFIT_KUEUE_MANAGED_JOBS_NAMESPACE_SELECTOR"
    )]
    pub kueue_managed_jobs_namespace_selector: String,
    /// Kueue's enabled integrations, copied from its configuration's
    /// `integrations.frameworks` (comma list, e.g.
    /// `batch/job,jobset.x-k8s.io/jobset,kubeflow.org/pytorchjob`; default:
    /// Kueue's default configuration, in which the PyTorchJob integration
    /// is off). A job whose integration is off is not queued by Kueue, so
    /// gpufit configures it at creation.
    #[arg(
        long,
        env = "GPUFIT_KUEUE_INTEGRATIONS",
        value_delimiter = ',',
        requires = "kueue"
    )]
    pub kueue_integrations: Option<Vec<String>>,
    /// Name of the leader-election Lease.
    #[arg(long, default_value = "gpufit-controller", env = "GPUFIT_LEASE_NAME")]
    pub lease_name: String,
    /// Namespace of the Lease (default: the controller's own, POD_NAMESPACE
    /// from the downward API, else `default`).
    #[arg(long, env = "GPUFIT_NAMESPACE")]
    pub namespace: Option<String>,
    /// This replica's identity in the Lease (default: POD_NAME, then the host name).
    #[arg(long, env = "GPUFIT_IDENTITY")]
    pub identity: Option<String>,
    /// Lease duration: another replica takes over this long after the last renewal.
    #[arg(long, default_value = "15s", value_parser = humantime::parse_duration, env = "GPUFIT_LEASE_DURATION")]
    pub lease_duration: Duration,
    /// Run without leader election (exactly one replica!).
    #[arg(long, env = "GPUFIT_NO_LEADER_ELECTION")]
    pub no_leader_election: bool,
    /// Cluster name recorded with every run in the history.
    #[arg(long, env = "GPUFIT_CLUSTER")]
    pub cluster: Option<String>,
}

pub fn run(_g: &Global, args: ControllerArgs) -> crate::Result<ExitCode> {
    let history_url = args.store.url();
    // A missing or empty token file is the operator's input to fix (exit 2).
    if let Some(p) = &args.token_file {
        api::read_token_file(p).map_err(|e| crate::Error::Usage(e.to_string()))?;
    }
    let rt = tokio::runtime::Runtime::new().map_err(|e| crate::Error::Io {
        context: "cannot start the async runtime".into(),
        source: e,
    })?;
    let api_cfg = ApiConfig {
        listen: args.listen,
        history_url,
        history_sqlite: args.store.sqlite(),
        token_file: args.token_file.clone(),
    };
    if args.no_kubernetes {
        rt.block_on(serve_slurm_api(api_cfg))?;
        return Ok(ExitCode::SUCCESS);
    }
    if args.lease_duration < Duration::from_secs(3) {
        return Err(crate::Error::Usage(
            "--lease-duration must be at least 3s (the Lease is renewed every third of it)".into(),
        ));
    }
    let cfg = kubernetes_config(args, api_cfg)?;
    rt.block_on(run::run(cfg, shutdown_signal()))?;
    Ok(ExitCode::SUCCESS)
}

/// `--no-kubernetes`: the Slurm HTTP API alone, until a signal. A Slurm
/// site scrapes and probes the controller too: /metrics, /healthz and
/// /readyz on the API's port, as in Kubernetes mode.
async fn serve_slurm_api(api_cfg: ApiConfig) -> Result<(), crate::controller::ControllerError> {
    let cfg = api_cfg.clone();
    let state = tokio::task::spawn_blocking(move || api::ApiState::from_config(&cfg))
        .await
        .map_err(|e| {
            crate::controller::ControllerError::Other(format!("cannot open the history: {e}"))
        })??;
    let metrics = crate::controller::metrics::Metrics::new();
    let health = std::sync::Arc::new(crate::controller::metrics::Health::default());
    health
        .ready
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let listener = crate::controller::metrics::bind(api_cfg.listen).await?;
    let routes = crate::controller::metrics::Routes {
        metrics: metrics.clone(),
        health,
        api: Some(std::sync::Arc::new(state.with_metrics(metrics))),
    };
    routes.serve(listener, shutdown_signal()).await;
    Ok(())
}

/// The Kubernetes-mode configuration from the flags.
fn kubernetes_config(args: ControllerArgs, api_cfg: ApiConfig) -> crate::Result<ControllerConfig> {
    // A selector that does not parse is the operator's input to fix (exit 2).
    let mut kueue_unlabelled = Unlabelled::managing(&args.kueue_managed_jobs_namespace_selector)
        .map_err(|e| {
            crate::Error::Usage(format!("--kueue-managed-jobs-namespace-selector: {e}"))
        })?;
    kueue_unlabelled.manage = args.kueue_manage_jobs_without_queue_name;
    // Kueue's checks are on Workloads of every namespace: a controller that
    // watches one namespace would leave the others' quota held forever.
    if args.kueue && args.watch_namespace.is_some() {
        return Err(crate::Error::Usage(
            "--kueue answers gpufit's admission checks on Workloads in every namespace and cannot run with --watch-namespace (a check in another namespace would never be answered and Kueue would hold its quota); drop one of them".into(),
        ));
    }
    let kueue_frameworks = args.kueue_integrations.clone().map(|v| {
        v.into_iter()
            .map(|f| f.trim().to_string())
            .filter(|f| !f.is_empty())
            .collect()
    });
    let webhook = match (args.tls_cert, args.tls_key) {
        (Some(cert), Some(key)) => Some(WebhookConfig {
            listen: args.webhook_listen,
            cert,
            key,
        }),
        _ => None,
    };
    let leader = (!args.no_leader_election).then(|| LeaderConfig {
        lease_name: args.lease_name.clone(),
        namespace: args
            .namespace
            .clone()
            .or_else(|| std::env::var("POD_NAMESPACE").ok())
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| "default".into()),
        identity: args.identity.clone().unwrap_or_else(run::default_identity),
        lease_duration: args.lease_duration,
        renew_every: args.lease_duration / 3,
    });
    Ok(ControllerConfig {
        api: api_cfg,
        webhook,
        mode: match args.mode {
            ModeArg::Inject => Mode::Inject,
            ModeArg::Recommend => Mode::Recommend,
        },
        prometheus_url: args.prometheus_url,
        prom_query: args.prom_query,
        prom_timeout: args.prom_timeout,
        sidecar_url: args.sidecar_url,
        watch_namespace: args.watch_namespace,
        kueue: args.kueue,
        kueue_unlabelled,
        kueue_frameworks,
        leader,
        cluster: args.cluster,
        targets: StrategyTargets::default(),
    })
}
