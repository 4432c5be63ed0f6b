//! The controller: the Kubernetes `TrainingJob` reconciler, the admission
//! webhook, leader election, and the HTTP API the Slurm hooks use.
//!
//! | module        | what it owns                                                  |
//! |---------------|---------------------------------------------------------------|
//! | [`crd`]       | the `TrainingJob` resource (spec, status, printer columns)    |
//! | [`validate`]  | pure: spec → validated workload, pins, mode                   |
//! | [`gpu`]       | pure: node labels (GPU Feature Discovery) → GPU model          |
//! | [`build`]     | pure: suggestion → desired `batch/v1` Job                      |
//! | [`inject`]    | the one injection code path (reconciler and webhook)          |
//! | [`keys`]      | every `gpufit.io/*` annotation and label key                   |
//! | [`kinds`]     | one description per training kind (Job, PyTorchJob, JobSet, TrainJob) |
//! | [`plan`]      | the admission plan: annotations → checked workload → suggestion |
//! | [`kueue`]     | pure: a Kueue Workload's admission → gpufit's check answer    |
//! | [`reconcile`] | the pipeline: dereference → validate → build → apply → status |
//! | [`prom`]      | Prometheus HTTP API client (peak GPU memory of a finished job)|
//! | [`webhook`]   | mutating admission webhook over HTTPS                         |
//! | [`leader`]    | `coordination.k8s.io/v1` Lease leader election                |
//! | [`metrics`]   | the controller's own metrics, `/metrics`, `/healthz`, `/readyz`|
//! | [`api`]       | the HTTP API the Slurm hooks use                              |

pub mod api;
pub mod build;
pub mod confirm;
pub mod crd;
pub mod gpu;
pub mod inject;
pub mod keys;
pub mod kinds;
pub mod kueue;
pub mod leader;
pub mod metrics;
pub mod plan;
pub mod prom;
pub mod reconcile;
pub mod run;
pub mod sidecar_client;
pub mod validate;
pub mod webhook;

use thiserror::Error;

/// Everything that can go wrong in the controller. Each pipeline step has its
/// own variant so errors stay low-cardinality in metrics ([`Self::metric_label`]).
#[derive(Debug, Error)]
pub enum ControllerError {
    #[error("{0}")]
    Other(String),
    /// The bearer token file cannot be used.
    #[error("{0}")]
    Token(#[from] crate::service::TokenFileError),
    /// The TrainingJob spec (or a webhook annotation) is wrong: fixed by editing it.
    #[error("invalid spec: {0}")]
    Invalid(String),
    /// The GPU the job gets cannot be determined.
    #[error("GPU: {0}")]
    Gpu(String),
    /// The advisor could not suggest settings.
    #[error("advisor: {0}")]
    Advisor(#[from] crate::core::advisor::AdvisorError),
    /// The history store failed (down, unreachable, corrupt).
    #[error("history store: {0}")]
    History(#[from] crate::history::HistoryError),
    /// A Kubernetes API call failed.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// Prometheus could not be queried.
    #[error("Prometheus: {0}")]
    Prometheus(String),
    /// The node sidecar could not be queried.
    #[error("sidecar: {0}")]
    Sidecar(String),
    /// A JSON (de)serialization failed.
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// TLS setup for the webhook failed (certificate or key).
    #[error("TLS: {0}")]
    Tls(String),
    /// Binding or serving a socket failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl ControllerError {
    /// A short, static, low-cardinality label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            // A token file problem was an `Other` before it had a type: same label.
            ControllerError::Other(_) | ControllerError::Token(_) => "other",
            ControllerError::Invalid(_) => "invalid_spec",
            ControllerError::Gpu(_) => "gpu",
            ControllerError::Advisor(_) => "advisor",
            ControllerError::History(_) => "history",
            ControllerError::Kube(_) => "kube",
            ControllerError::Prometheus(_) => "prometheus",
            ControllerError::Sidecar(_) => "sidecar",
            ControllerError::Json(_) => "json",
            ControllerError::Tls(_) => "tls",
            ControllerError::Io { .. } => "io",
        }
    }
}
