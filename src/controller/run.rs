//! `gpufit controller` in Kubernetes mode: wires the reflectors (nodes,
//! namespaces), the leader-gated TrainingJob controller, the webhook (every
//! replica), the Slurm HTTP API, and `/metrics` `/healthz` `/readyz`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::api::Api;
use kube::runtime::controller::Controller;
use kube::runtime::{reflector, watcher, WatchStreamExt};
use kube::Client;
use tokio::sync::watch;

use super::api::{self, ApiConfig, ApiState};
use super::crd::{Mode, TrainingJob};
use super::leader::{self, LeaderConfig};
use super::metrics::{self, Health, Metrics};
use super::prom::PromClient;
use super::reconcile::{self, Context, PromThenSidecar};
use super::sidecar_client::SidecarClient;
use super::webhook::{self, WebhookConfig, WebhookState};
use super::ControllerError;
use crate::core::advisor::StrategyTargets;

/// Everything `gpufit controller` is configured with (flags and environment).
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// Slurm HTTP API.
    pub api: ApiConfig,
    /// The admission webhook; `None` when no certificate is configured.
    pub webhook: Option<WebhookConfig>,
    /// Default mode (namespace labels and TrainingJob settings override it).
    pub mode: Mode,
    pub prometheus_url: Option<String>,
    pub prom_query: String,
    pub prom_timeout: Duration,
    /// Sidecar base URL template, e.g. `http://{host_ip}:9400`.
    pub sidecar_url: Option<String>,
    /// Namespace to watch TrainingJobs in; `None`: all namespaces.
    pub watch_namespace: Option<String>,
    /// Answer gpufit's Kueue AdmissionChecks (`--kueue`).
    pub kueue: bool,
    /// Jobs without a queue label that Kueue manages
    /// (`--kueue-manage-jobs-without-queue-name`).
    pub kueue_unlabelled: super::kueue::Unlabelled,
    /// Kueue's enabled integrations (`--kueue-integrations`; None: Kueue's
    /// default configuration's).
    pub kueue_frameworks: Option<std::collections::BTreeSet<String>>,
    pub leader: Option<LeaderConfig>,
    pub cluster: Option<String>,
    pub targets: StrategyTargets,
}

/// The identity of this replica: `POD_NAME`, else the host name, else a random id.
pub fn default_identity() -> String {
    std::env::var("POD_NAME")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| format!("gpufit-{:08x}", rand::random::<u32>()))
}

/// Runs until `shutdown` resolves.
pub async fn run(
    cfg: ControllerConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ControllerError> {
    let stop = Stop::new(shutdown);
    let history = open_history(cfg.api.history_url.clone(), cfg.api.history_sqlite).await?;
    let client = Client::try_default().await.map_err(|e| {
        ControllerError::Other(format!(
            "cannot connect to Kubernetes ({e}): run in a cluster, set KUBECONFIG, or pass --no-kubernetes for the Slurm API alone"
        ))
    })?;

    // Reflectors: nodes (GPU Feature Discovery labels) and namespaces (mode label).
    let nodes = reflect(Api::<Node>::all(client.clone()), "node");
    let namespaces = reflect(Api::<Namespace>::all(client.clone()), "namespace");

    let metrics = Metrics::new();
    let health = Arc::new(Health::default());
    serve_api(&cfg, &history, &metrics, &health, &stop).await?;
    // Kueue: the version it serves (discovery), its LocalQueues.
    let kueue_version = if cfg.kueue {
        let v = reconcile::kueue::discover_version(&client).await?;
        tracing::info!(version = v, "speaking Kueue's API kueue.x-k8s.io/{v}");
        Some(v)
    } else {
        None
    };
    let kueue = super::kueue::KueueConfig {
        enabled: cfg.kueue,
        unlabelled: cfg.kueue_unlabelled.clone(),
        frameworks: cfg.kueue_frameworks.clone(),
        local_queues: kueue_version.map(|v| {
            reflect_dynamic(
                Api::all_with(client.clone(), &reconcile::kueue::local_queues(v)),
                reconcile::kueue::local_queues(v),
                "Kueue LocalQueue",
            )
        }),
    };
    let history_cache: Arc<webhook::HistoryCache> = Arc::default();
    if let Some(wcfg) = cfg.webhook.clone() {
        let state = Arc::new(WebhookState {
            history: history.clone(),
            nodes: nodes.clone(),
            namespaces: namespaces.clone(),
            metrics: metrics.clone(),
            targets: cfg.targets,
            default_mode: cfg.mode,
            cache: history_cache.clone(),
            kueue,
        });
        serve_webhook(&wcfg, state, &stop).await?;
    }

    // The caches fill only once the API server answers (and RBAC allows
    // the watches): until then a SIGTERM must still stop the pod within its
    // grace period.
    let caches = async {
        let _ = nodes.wait_until_ready().await;
        let _ = namespaces.wait_until_ready().await;
    };
    tokio::select! {
        _ = stop.stopped() => {
            tracing::info!("stopped while waiting for the Kubernetes caches");
            return Ok(());
        }
        _ = caches => {}
    }
    health.ready.store(true, Ordering::Relaxed);

    let peaks = Arc::new(PromThenSidecar {
        prom: cfg
            .prometheus_url
            .as_deref()
            .map(|u| PromClient::new(u, cfg.prom_timeout)),
        query_template: cfg.prom_query.clone(),
        sidecar: cfg
            .sidecar_url
            .as_deref()
            .map(|u| SidecarClient::new(u, cfg.prom_timeout)),
    });
    let mut ctx = Context::new(client.clone(), history, nodes, namespaces, peaks, metrics);
    ctx.targets = cfg.targets;
    ctx.default_mode = cfg.mode;
    ctx.cluster = cfg.cluster.clone();
    ctx.history_cache = history_cache;
    let (lead_tx, lead_rx) = watch::channel(cfg.leader.is_none());
    ctx.leading = lead_rx;
    reconcile_while_leading(&cfg, client, Arc::new(ctx), kueue_version, lead_tx, &stop).await;
    Ok(())
}

/// Resolves, for any number of waiters, once `shutdown` has.
#[derive(Clone)]
struct Stop(watch::Receiver<bool>);

impl Stop {
    fn new(shutdown: impl std::future::Future<Output = ()> + Send + 'static) -> Self {
        let (stop_tx, stop_rx) = watch::channel(false);
        tokio::spawn(async move {
            shutdown.await;
            let _ = stop_tx.send(true);
        });
        Stop(stop_rx)
    }

    fn stopped(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.0.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    }
}

/// The history store, opened off the async threads.
async fn open_history(
    url: String,
    sqlite: crate::history::sqlite::SqliteOptions,
) -> Result<Arc<dyn crate::history::HistoryStore>, ControllerError> {
    let history = tokio::task::spawn_blocking(move || crate::history::open_with(&url, sqlite))
        .await
        .map_err(|e| ControllerError::Other(format!("history task failed: {e}")))??;
    Ok(Arc::from(history))
}

/// A cache of every `K`, kept by a watch that retries (with backoff) on
/// its own task; `what` names it in the warning.
fn reflect<K>(api: Api<K>, what: &'static str) -> reflector::Store<K>
where
    K: kube::Resource
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let (store, writer) = reflector::store::<K>();
    let stream = reflector(writer, watcher(api, watcher::Config::default()))
        .default_backoff()
        .touched_objects()
        .for_each(move |r| {
            if let Err(e) = r {
                tracing::warn!(error = %e, "{what} watch failed; retrying");
            }
            futures::future::ready(())
        });
    tokio::spawn(stream);
    store
}

/// [`reflect`] for a dynamic resource.
fn reflect_dynamic(
    api: Api<kube::api::DynamicObject>,
    ar: kube::api::ApiResource,
    what: &'static str,
) -> reflector::Store<kube::api::DynamicObject> {
    let writer = reflector::store::Writer::new(ar);
    let store = writer.as_reader();
    let stream = reflector(writer, watcher(api, watcher::Config::default()))
        .default_backoff()
        .touched_objects()
        .for_each(move |r| {
            if let Err(e) = r {
                tracing::warn!(error = %e, "{what} watch failed; retrying");
            }
            futures::future::ready(())
        });
    tokio::spawn(stream);
    store
}

/// `/metrics`, `/healthz`, `/readyz` and the Slurm HTTP API, which shares
/// the history store and the port. Bound now, so that a taken port fails the start.
async fn serve_api(
    cfg: &ControllerConfig,
    history: &Arc<dyn crate::history::HistoryStore>,
    metrics: &Metrics,
    health: &Arc<Health>,
    stop: &Stop,
) -> Result<(), ControllerError> {
    let token = match &cfg.api.token_file {
        Some(p) => Some(api::read_token_file(p)?),
        None => {
            tracing::warn!("no --token-file: POST /v1/runs is refused");
            None
        }
    };
    let api_state = Arc::new(ApiState::new(history.clone(), token).with_metrics(metrics.clone()));
    let routes = metrics::Routes {
        metrics: metrics.clone(),
        health: health.clone(),
        api: Some(api_state),
    };
    let listener = metrics::bind(cfg.api.listen).await?;
    tokio::spawn(routes.serve(listener, stop.stopped()));
    Ok(())
}

/// The admission webhook, on every replica.
async fn serve_webhook(
    wcfg: &WebhookConfig,
    state: Arc<WebhookState>,
    stop: &Stop,
) -> Result<(), ControllerError> {
    // Bind now so a bad certificate fails the start, not silently later.
    let server = webhook::WebhookServer::bind(wcfg).await?;
    tracing::info!(listen = %wcfg.listen, path = webhook::PATH, "serving the admission webhook");
    let s = stop.stopped();
    tokio::spawn(async move {
        if let Err(e) = server.serve(state, s).await {
            tracing::error!(error = %e, "webhook stopped");
        }
    });
    Ok(())
}

/// Reconciles TrainingJobs while this replica leads (always, without a
/// Lease: one replica), until stopped.
async fn reconcile_while_leading(
    cfg: &ControllerConfig,
    client: Client,
    ctx: Arc<Context>,
    kueue_version: Option<&'static str>,
    lead_tx: watch::Sender<bool>,
    stop: &Stop,
) {
    let mut lead_rx = ctx.leading.clone();
    if let Some(lcfg) = cfg.leader.clone() {
        let (c, s) = (client.clone(), stop.stopped());
        tokio::spawn(leader::run(c, lcfg, lead_tx, s));
    }

    let (tjs, jobs): (Api<TrainingJob>, Api<Job>) = match &cfg.watch_namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        ),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    };
    let mut stopping = stop.stopped().boxed().shared();
    loop {
        tokio::select! {
            _ = stopping.clone() => return,
            r = lead_rx.wait_for(|l| *l) => {
                if r.is_err() { return; }
            }
        }
        tracing::info!("leading: reconciling TrainingJobs and recording webhook-configured runs");
        let controller = Controller::new(tjs.clone(), watcher::Config::default())
            .owns(
                jobs.clone(),
                watcher::Config::default().labels(super::build::LABEL_TRAINING_JOB),
            )
            .run(reconcile::reconcile, reconcile::error_policy, ctx.clone())
            .for_each(|r| {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "reconcile stream");
                }
                futures::future::ready(())
            });
        // Jobs and PyTorchJobs the webhook configured: their runs too.
        let workloads = reconcile::workloads::run_workload_controllers(
            client.clone(),
            ctx.clone(),
            cfg.watch_namespace.clone(),
        );
        // Kueue: gpufit's AdmissionChecks, when enabled.
        let kueue = async {
            if let Some(v) = kueue_version {
                reconcile::kueue::run_kueue_controllers(client.clone(), ctx.clone(), v).await
            }
        };
        let controller = futures::future::join3(controller, workloads, kueue);
        tokio::select! {
            _ = &mut stopping => return,
            _ = controller => {
                tracing::warn!("controller stream ended; restarting");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            _ = lead_rx.wait_for(|l| !*l) => {
                tracing::warn!("lost leadership: stopped reconciling");
            }
        }
    }
}
