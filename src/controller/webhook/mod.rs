//! Mutating admission webhook (HTTPS, `POST /mutate`) for teams that do not
//! want a new resource: a `batch/v1` Job, a Kubeflow `PyTorchJob`, a `JobSet`
//! or a Kubeflow Trainer `TrainJob` that opts in with the `gpufit.io/model`
//! (or `gpufit.io/architecture`) annotation gets the same injection as a
//! TrainingJob's Job ([`super::inject`]), in every training pod template
//! (every rank; where per kind: `shape`).
//!
//! - Objects without `gpufit.io/…` input annotations are allowed untouched.
//! - An object queued in Kueue (decided as Kueue decides:
//!   [`super::kueue::KueueConfig::queue_for`]) gets
//!   its settings when Kueue admits it on a flavor: now, each setting
//!   becomes a downward-API reference to a pod annotation that gpufit's
//!   AdmissionCheck sets then (`super::reconcile::kueue`); no GPU is
//!   resolved here.
//! - A bad annotation (unknown key, unparsable value, contradictory fields)
//!   is denied with a message that names it — never silently ignored.
//! - When gpufit cannot help (GPU unknown, history store down, nothing fits,
//!   a kind or shape it cannot configure), the object is allowed untouched
//!   with a warning: gpufit never blocks a
//!   submission for its own problems (and the chart's `failurePolicy: Ignore`
//!   covers gpufit being down).
//!
//! - A Pod labelled `gpufit.io/deferred` (a queued job's) that lacks a
//!   setting annotation — it started without gpufit's admission answer —
//!   gets its template's fallback settings, so no container reads "".
//! - Kinds other than those of [`super::kinds`] (and Pods) are never changed.
//!
//! Annotations (on the Job / PyTorchJob / JobSet / TrainJob itself):
//!
//! | annotation                 | meaning                                         |
//! |----------------------------|-------------------------------------------------|
//! | `gpufit.io/model`          | catalog model id (opts in; this or the next)    |
//! | `gpufit.io/architecture`   | the model by numbers: `name=…,params=…,hidden_size=…,layers=…,heads=…,vocab_size=…` (and `kv_heads`, `intermediate_size`, `tied_embeddings`, `max_seq_len`) |
//! | `gpufit.io/seq-len`        | sequence length (required)                      |
//! | `gpufit.io/method`         | full, lora, qlora                               |
//! | `gpufit.io/lora-rank`      | LoRA rank                                       |
//! | `gpufit.io/lora-targets`   | comma list: q,k,v,o,gate,up,down,lm_head        |
//! | `gpufit.io/optimizer`      | adamw, adamw8bit, sgd, adafactor                |
//! | `gpufit.io/global-batch`   | global batch (kept exactly)                     |
//! | `gpufit.io/gpus`           | data-parallel GPUs (default: from the object)   |
//! | `gpufit.io/sharding`       | none, zero1, zero2, zero3, fsdp                 |
//! | `gpufit.io/framework`      | generic, hf, torchtune, litgpt, lightning       |
//! | `gpufit.io/attention`      | sdpa, eager                                     |
//! | `gpufit.io/strategy`       | conservative, balanced, aggressive              |
//! | `gpufit.io/gpu`            | GPU model (when nodes carry no GFD labels)      |
//! | `gpufit.io/mode`           | Inject (default) or Recommend                   |
//! | `gpufit.io/pins`           | `micro_batch_size=4,dtype=bf16,…`               |
//! | `gpufit.io/gpu-sharing`    | share (default), whole: a time-sliced GPU       |

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::runtime::reflector::Store;

use crate::core::advisor::StrategyTargets;
use crate::history::HistoryStore;

use super::crd::Mode;
use super::metrics::Metrics;

mod admission;
mod server;

pub use super::plan::{workload_from_annotations, HistoryCache};
pub use admission::review;
pub use server::{review_json, tls_config, WebhookServer};

/// The path the webhook answers on.
pub const PATH: &str = "/mutate";
/// What the webhook needs to decide.
pub struct WebhookState {
    pub history: Arc<dyn HistoryStore>,
    /// Nodes (GPU Feature Discovery labels).
    pub nodes: Store<Node>,
    /// Namespaces (the `gpufit.io/mode` label).
    pub namespaces: Store<Namespace>,
    pub metrics: Metrics,
    pub targets: StrategyTargets,
    /// Mode when neither the annotation nor the namespace's label says.
    pub default_mode: Mode,
    /// Recent history answers, so a burst of submissions of one workload
    /// does not run the same history query for each; shared with the run
    /// recorders, which clear a workload's entries when they record a run.
    pub cache: Arc<HistoryCache>,
    /// The cluster's Kueue as gpufit knows it: which jobs it queues
    /// (label, LocalQueueDefaulting, `manageJobsWithoutQueueName`, the
    /// enabled integrations): those are configured at admission.
    pub kueue: super::kueue::KueueConfig,
}

/// Where and with which certificate the webhook listens.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    pub listen: SocketAddr,
    pub cert: PathBuf,
    pub key: PathBuf,
}
