//! "Similar" runs (docs/design.md, "Contracts", hard rules): same model, same method, same GPU model, same
//! dtype and checkpointing, sequence length within 10 %. This is the one
//! place that decides it, so it can be tightened later.

use serde::{Deserialize, Serialize};

use crate::run::RunRecord;
use crate::settings::Dtype;
use crate::workload::Method;

/// Relative sequence-length tolerance for similar runs.
pub const SEQ_LEN_TOLERANCE: f64 = 0.10;

/// What a history store is asked for: every run of this model, method and
/// GPU model whose sequence length is in `[seq_len_min, seq_len_max]`.
/// dtype and checkpointing are filtered afterwards by [`matches_settings`],
/// so one query serves every candidate setting.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HistoryQuery {
    pub model: String,
    pub method: Method,
    pub gpu_model: String,
    pub seq_len_min: u32,
    pub seq_len_max: u32,
}

impl HistoryQuery {
    pub fn new(model: &str, method: Method, gpu_model: &str, seq_len: u32) -> Self {
        let lo = (seq_len as f64 * (1.0 - SEQ_LEN_TOLERANCE)).ceil() as u32;
        let hi = (seq_len as f64 * (1.0 + SEQ_LEN_TOLERANCE)).floor() as u32;
        HistoryQuery {
            model: model.to_string(),
            method,
            gpu_model: gpu_model.to_string(),
            seq_len_min: lo,
            seq_len_max: hi,
        }
    }

    /// Whether a record falls under this query (model, method, GPU, seq range).
    pub fn matches(&self, r: &RunRecord) -> bool {
        r.model == self.model
            && r.method == self.method
            && r.gpu_model == self.gpu_model
            && r.seq_len >= self.seq_len_min
            && r.seq_len <= self.seq_len_max
    }
}

/// The settings part of similarity: same dtype and same checkpointing.
pub fn matches_settings(r: &RunRecord, dtype: Dtype, activation_checkpointing: bool) -> bool {
    r.settings.dtype == dtype && r.settings.activation_checkpointing == activation_checkpointing
}
