//! What every reconcile shares: the Kubernetes client, the history store,
//! the node and namespace caches, the peak readers, metrics and events.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::Store;
use kube::{Client, Resource, ResourceExt};
use tokio::sync::watch;

use crate::controller::crd::{Mode, TrainingJob};
use crate::controller::metrics::Metrics;
use crate::controller::prom::{render_query, PromClient};
use crate::controller::sidecar_client::SidecarClient;
use crate::core::advisor::StrategyTargets;
use crate::history::HistoryStore;

use super::status::truncate;
use super::{MANAGER, PEAK_RETRY};

// === Peak readers ===

/// A pod of a finished Job, as the peak readers need it.
#[derive(Debug, Clone, PartialEq)]
pub struct PodRef {
    pub name: String,
    pub node: Option<String>,
    pub host_ip: Option<String>,
}

/// What to measure: a finished Job's pods over its run time.
#[derive(Debug, Clone, PartialEq)]
pub struct PeakQuery {
    pub namespace: String,
    pub job: String,
    /// Pods of the Job; empty when they are gone (then the Job's pod-name
    /// prefix is used).
    pub pods: Vec<PodRef>,
    /// Unix seconds.
    pub start: Option<f64>,
    /// Unix seconds.
    pub end: Option<f64>,
}

/// A measured peak and where it came from (`prometheus`, `sidecar`).
#[derive(Debug, Clone, PartialEq)]
pub struct MeasuredPeak {
    pub bytes: u64,
    pub source: String,
}

/// Reads the peak GPU memory of a finished Job. Blocking (called from
/// `spawn_blocking`). `Ok(None)`: every source answered but none knows it.
pub trait PeakReader: Send + Sync {
    fn job_peak(&self, q: &PeakQuery) -> Result<Option<MeasuredPeak>, String>;
}

/// Prometheus first (a configurable PromQL template), then the node sidecar.
pub struct PromThenSidecar {
    pub prom: Option<PromClient>,
    pub query_template: String,
    pub sidecar: Option<SidecarClient>,
}

impl PeakReader for PromThenSidecar {
    fn job_peak(&self, q: &PeakQuery) -> Result<Option<MeasuredPeak>, String> {
        let mut errors = Vec::new();
        if let Some(prom) = &self.prom {
            let pods: Vec<String> = if q.pods.is_empty() {
                // Pods of Job `x` are named `x-<suffix>`; the regex is built
                // from the escaped prefix below.
                vec![]
            } else {
                q.pods.iter().map(|p| p.name.clone()).collect()
            };
            let range = match (q.start, q.end) {
                (Some(s), Some(e)) if e > s => Duration::from_secs_f64(e - s + 60.0),
                _ => Duration::from_secs(3600),
            };
            let mut promql = render_query(&self.query_template, &q.namespace, &q.job, &pods, range);
            if pods.is_empty() {
                let prefix =
                    crate::controller::prom::regex_alternation(std::slice::from_ref(&q.job));
                promql = promql.replace("pod=~\"\"", &format!("pod=~\"{prefix}-.*\""));
            }
            match prom.query_max(&promql, q.end.map(|e| e + 30.0)) {
                Ok(Some(v)) if v > 0.0 => {
                    return Ok(Some(MeasuredPeak {
                        bytes: v.round() as u64,
                        source: "prometheus".into(),
                    }))
                }
                Ok(_) => {}
                Err(e) => errors.push(e.to_string()),
            }
        }
        if let Some(sc) = &self.sidecar {
            let mut best: Option<u64> = None;
            for p in &q.pods {
                let (Some(ip), node) = (&p.host_ip, p.node.as_deref().unwrap_or("")) else {
                    continue;
                };
                match sc.pod_peak(ip, node, &q.namespace, &p.name) {
                    Ok(Some(b)) => best = Some(best.map_or(b, |m| m.max(b))),
                    Ok(None) => {}
                    Err(e) => errors.push(e),
                }
            }
            if let Some(bytes) = best {
                return Ok(Some(MeasuredPeak {
                    bytes,
                    source: "sidecar".into(),
                }));
            }
        }
        if errors.is_empty() {
            Ok(None)
        } else {
            Err(errors.join("; "))
        }
    }
}

// === Context ===

/// Everything a reconcile needs, shared by all reconciles.
pub struct Context {
    pub client: Client,
    pub history: Arc<dyn HistoryStore>,
    /// Nodes (GPU Feature Discovery labels), from a reflector.
    pub nodes: Store<Node>,
    /// Namespaces (the `gpufit.io/mode` label), from a reflector.
    pub namespaces: Store<Namespace>,
    pub peaks: Arc<dyn PeakReader>,
    pub metrics: Metrics,
    pub recorder: Recorder,
    pub targets: StrategyTargets,
    /// Mode when neither the spec, the TrainingJob's annotation nor the
    /// namespace's label says.
    pub default_mode: Mode,
    /// Cluster name recorded with each run.
    pub cluster: Option<String>,
    /// Wait before the second lookup of a peak that was not there yet (a
    /// Prometheus scrape or remote-write lag); doubled for each later one.
    /// Time, not reconciles, paces the lookups: the status patch of a
    /// failed lookup triggers a reconcile at once, which must not spend the
    /// next lookup.
    pub peak_retry: Duration,
    /// Whether this replica leads (the Lease's holder, published by
    /// [`crate::controller::leader::run`]); always true without a Lease.
    /// Checked again right before anything is written, so a replica that
    /// lost the Lease mid-reconcile records nothing.
    pub leading: watch::Receiver<bool>,
    /// The webhook's history cache (shared): a run recorded here clears
    /// its workload's entries, so the next admission sees the run.
    pub history_cache: Arc<crate::controller::plan::HistoryCache>,
    /// Consecutive failures per TrainingJob, for the error backoff.
    failures: Mutex<HashMap<String, u32>>,
}

impl Context {
    pub fn new(
        client: Client,
        history: Arc<dyn HistoryStore>,
        nodes: Store<Node>,
        namespaces: Store<Namespace>,
        peaks: Arc<dyn PeakReader>,
        metrics: Metrics,
    ) -> Self {
        let reporter = Reporter {
            controller: MANAGER.into(),
            instance: std::env::var("POD_NAME").ok(),
        };
        Context {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            history,
            nodes,
            namespaces,
            peaks,
            metrics,
            targets: StrategyTargets::default(),
            default_mode: Mode::Inject,
            cluster: None,
            peak_retry: PEAK_RETRY,
            // One replica, no Lease: it leads (the receiver keeps the value
            // after the sender is gone).
            leading: watch::channel(true).1,
            history_cache: Arc::default(),
            failures: Mutex::new(HashMap::new()),
        }
    }

    /// Whether this replica may reconcile and record now.
    pub fn is_leading(&self) -> bool {
        *self.leading.borrow()
    }

    pub(super) fn reset_failures(&self, key: &str) {
        if let Ok(mut f) = self.failures.lock() {
            f.remove(key);
        }
    }

    /// Exponential backoff per object: 5 s, 10 s, 20 s … capped at 5 min,
    /// so a broken dependency never turns into a hot loop.
    pub fn next_backoff(&self, key: &str) -> Duration {
        let n = match self.failures.lock() {
            Ok(mut f) => {
                let n = f.entry(key.to_string()).or_insert(0);
                *n = n.saturating_add(1);
                *n
            }
            Err(_) => 1,
        };
        let secs = 5u64.saturating_mul(1u64 << (n - 1).min(6));
        Duration::from_secs(secs.min(300))
    }

    pub(super) async fn event(
        &self,
        tj: &TrainingJob,
        type_: EventType,
        reason: &str,
        note: String,
    ) {
        let ev = Event {
            type_,
            reason: reason.into(),
            note: Some(truncate(&note, 1000)),
            action: "Reconcile".into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &tj.object_ref(&())).await {
            tracing::warn!(error = %e, reason, "cannot publish event");
        }
    }
}

/// The TrainingJob's `namespace/name`, the key of its failure count.
pub(super) fn key(tj: &TrainingJob) -> String {
    format!("{}/{}", tj.namespace().unwrap_or_default(), tj.name_any())
}
