//! Mutating admission webhook (HTTPS, `POST /mutate`) for teams that do not
//! want a new resource: a `batch/v1` Job, a Kubeflow `PyTorchJob`, a `JobSet`
//! or a Kubeflow Trainer `TrainJob` that opts in with the `gpufit.io/model`
//! (or `gpufit.io/architecture`) annotation gets the same injection as a
//! TrainingJob's Job ([`super::inject`]), in every training pod template
//! (every rank; where per kind: `shape`).
//!
//! - Objects without `gpufit.io/…` input annotations are allowed untouched.
//! - An object queued in Kueue (`kueue.x-k8s.io/queue-name`, or none in a
//!   namespace declared Kueue-managed: [`super::kueue::Unlabelled`]) gets
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
use std::time::Instant;

use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::runtime::reflector::Store;

use crate::core::advisor::StrategyTargets;
use crate::core::run::RunRecord;
use crate::core::similarity::HistoryQuery;
use crate::history::HistoryStore;

use super::crd::Mode;
use super::metrics::Metrics;

mod admission;
mod annotations;
mod server;
mod shape;

pub use admission::review;
pub use annotations::{inputs_for_admission, workload_from_annotations, AdmissionInputs};
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
    /// does not run the same history query for each.
    pub cache: HistoryCache,
    /// Which jobs without a `kueue.x-k8s.io/queue-name` label Kueue manages
    /// (`--kueue-manage-jobs-without-queue-name`, the namespace's
    /// `gpufit.io/kueue` label): they are configured at admission too.
    pub kueue_unlabelled: super::kueue::Unlabelled,
}

/// Similar-run lists by query, kept for [`HistoryCache::TTL`]. The history
/// changes when jobs finish (minutes), so a suggestion made from a view a few
/// seconds old is as good; the size is bounded (cleared when full).
#[derive(Debug, Default)]
pub struct HistoryCache {
    entries: std::sync::Mutex<std::collections::HashMap<HistoryQuery, CachedRuns>>,
}

/// When a similar-run list was read, and the list.
type CachedRuns = (Instant, Arc<Vec<RunRecord>>);

impl HistoryCache {
    /// How long an answer is reused.
    pub const TTL: std::time::Duration = std::time::Duration::from_secs(10);
    /// Most queries held.
    const MAX: usize = 4096;

    /// The cached answer, or the store's (then cached).
    pub fn similar(
        &self,
        store: &dyn HistoryStore,
        q: &HistoryQuery,
    ) -> Result<Arc<Vec<RunRecord>>, crate::history::HistoryError> {
        if let Ok(m) = self.entries.lock() {
            if let Some((at, runs)) = m.get(q) {
                if at.elapsed() < Self::TTL {
                    return Ok(runs.clone());
                }
            }
        }
        let runs = Arc::new(store.similar(q)?);
        if let Ok(mut m) = self.entries.lock() {
            if m.len() >= Self::MAX {
                m.clear();
            }
            m.insert(q.clone(), (Instant::now(), runs.clone()));
        }
        Ok(runs)
    }
}

/// Where and with which certificate the webhook listens.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    pub listen: SocketAddr,
    pub cert: PathBuf,
    pub key: PathBuf,
}
