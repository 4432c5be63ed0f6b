//! Run-history stores behind one trait: SQLite (embedded default),
//! PostgreSQL (shared fleet store), JSON Lines import/export.
//!
//! Every store keeps the same table (`runs`, one row per [`RunRecord`],
//! schema in [`schema`]) with an index on the similarity key
//! `(model, method, gpu_model, seq_len)`, so [`HistoryStore::similar`] is an
//! index range scan. Schemas are versioned and migrated forward on open.

pub mod jsonl;
pub mod postgres;
pub mod report_query;
pub mod schema;
pub mod sqlite;

use thiserror::Error;

use crate::core::run::{KeyedRun, RunRecord};
use crate::core::similarity::HistoryQuery;

#[derive(Debug, Error)]
pub enum HistoryError {
    #[error("history store `{url}`: {message}")]
    Store { url: String, message: String },
    #[error("unsupported history URL `{0}`: use sqlite:PATH (or a path ending in .db) or postgres://…; JSON Lines files go through `gpufit history import`")]
    BadUrl(String),
    /// Another process holds the write lock longer than the busy timeout.
    #[error("history store `{url}` is locked by another process (waited {waited_ms} ms): retry when the other gpufit or sqlite3 session has finished; nothing was written")]
    Locked { url: String, waited_ms: u64 },
    /// The file is not a SQLite database, or is damaged. It is left untouched.
    #[error("history store `{url}` is not a readable gpufit history ({message}); the file was left untouched: move it away, or point --history / GPUFIT_HISTORY at another path")]
    Corrupt { url: String, message: String },
    /// The store was written by a newer gpufit.
    #[error("history store `{url}` has schema version {found}, newer than this gpufit supports ({supported}): upgrade gpufit")]
    SchemaTooNew {
        url: String,
        found: i64,
        supported: i64,
    },
    /// Reading or writing a file (JSON Lines import/export) failed.
    #[error("{path}: {message}")]
    Io { path: String, message: String },
    /// No run with this id.
    #[error("history store `{url}` has no run with id {id}")]
    NoSuchRun { url: String, id: i64 },
    /// The record fails validation ([`RunRecord::validated`]); nothing
    /// was written.
    #[error("run refused, nothing was written: {0}")]
    Invalid(#[from] crate::core::run::RecordError),
}

/// Why a store's upsert wrote nothing ([`schema::REPLACE_GUARD`]): the
/// core's reason for `stored` not to be replaced by `new`.
pub(crate) fn refused_replace(
    url: &str,
    stored: Option<&RunRecord>,
    new: &RunRecord,
) -> HistoryError {
    match stored.map(|s| crate::core::run_check::check_replace(s, new)) {
        Some(Err(e)) => HistoryError::Invalid(e),
        _ => HistoryError::Store {
            url: url.to_string(),
            message: "the run was neither inserted nor updated".into(),
        },
    }
}

/// Filter for `list`.
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    pub model: Option<String>,
    pub gpu_model: Option<String>,
    pub limit: Option<usize>,
}

/// One interface over every store. Synchronous: async callers use
/// `tokio::task::spawn_blocking` (the PostgreSQL store runs its own small
/// runtime and must not be called from a tokio worker thread directly).
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

    /// The stored run of this identity ([`RunRecord::identity`]), if any.
    /// The default scans every run; the SQL stores read the unique index.
    fn find(&self, identity: &str) -> Result<Option<RunRecord>, HistoryError> {
        let mut found = None;
        self.for_each(&mut |r| {
            if r.identity() == identity {
                found = Some(r);
            }
            Ok(())
        })?;
        Ok(found)
    }

    /// Stores many runs atomically: all of them, or (on the first error,
    /// from the iterator or the store) none. Returns how many were stored.
    /// Stores override this with one transaction and a prepared statement.
    fn record_batch(
        &self,
        runs: &mut dyn Iterator<Item = Result<RunRecord, HistoryError>>,
    ) -> Result<u64, HistoryError> {
        let mut keyed = runs.map(|r| r.and_then(|r| Ok(r.keyed()?)));
        self.record_batch_keyed(&mut keyed)
    }

    /// [`HistoryStore::record_batch`] of records already validated and
    /// keyed ([`RunRecord::keyed`], e.g. on an import's reader thread).
    fn record_batch_keyed(
        &self,
        runs: &mut dyn Iterator<Item = Result<KeyedRun, HistoryError>>,
    ) -> Result<u64, HistoryError> {
        let mut n = 0;
        for r in runs {
            self.record(r?.run())?;
            n += 1;
        }
        Ok(n)
    }

    /// Every run, oldest first, streamed to `f` (for export). The default
    /// goes through `list`; stores override it to stream without holding
    /// every record in memory.
    fn for_each(
        &self,
        f: &mut dyn FnMut(RunRecord) -> Result<(), HistoryError>,
    ) -> Result<u64, HistoryError> {
        let mut all = self.list(&ListFilter::default())?;
        all.reverse();
        let n = all.len() as u64;
        for r in all {
            f(r)?;
        }
        Ok(n)
    }

    /// Records one node's report of a multi-node job into the job's one
    /// record ([`merge_node_report`]): the first report creates it (partial,
    /// 1 of N), later ones raise the peak and the count, a repeated node
    /// changes nothing, a report past the window is refused
    /// ([`HistoryError::Invalid`]). Returns the record's id.
    ///
    /// The SQLite and PostgreSQL stores override this with one transaction
    /// keyed by the run's identity (its unique index), so Epilogs of
    /// several nodes writing at once, from several processes or hosts,
    /// make one record. This default, for other stores, reads the record
    /// back by a scan and is not atomic: its caller must serialise reports.
    ///
    /// [`merge_node_report`]: crate::core::run::merge_node_report
    fn record_node_report(&self, report: &RunRecord) -> Result<i64, HistoryError> {
        self.record_node_report_outcome(report).map(|o| o.id)
    }

    /// [`HistoryStore::record_node_report`], saying what the report did
    /// ([`NodeReportOutcome`]): the controller counts a multi-node job in
    /// its metrics once, from this, and a repeated report never. Stores
    /// override this one (the other calls it).
    ///
    /// [`NodeReportOutcome`]: crate::core::run::NodeReportOutcome
    fn record_node_report_outcome(
        &self,
        report: &RunRecord,
    ) -> Result<crate::core::run::NodeReportOutcome, HistoryError> {
        let report = report.clone().validated(None)?;
        let identity = report.identity();
        let mut so_far: Option<RunRecord> = None;
        self.for_each(&mut |r| {
            if r.identity() == identity {
                so_far = Some(r);
            }
            Ok(())
        })?;
        let merged = crate::core::run::merge_node_report(so_far.as_ref(), &report)?;
        let id = match &merged {
            Some(m) => self.record(m)?,
            None => so_far
                .as_ref()
                .and_then(|r| r.id)
                .ok_or_else(|| HistoryError::Store {
                    url: self.url(),
                    message: "the job's record has no id".into(),
                })?,
        };
        Ok(crate::core::run::NodeReportOutcome::of(
            so_far.as_ref(),
            merged,
            id,
        ))
    }

    /// The rows `gpufit report` aggregates: runs at or after `since_us`
    /// (all when None), plus older successful runs with a throughput (they
    /// set the best known). Stores override this with a narrow streaming
    /// query ([`report_query`]); the default goes through `for_each`.
    fn report_rows(
        &self,
        since_us: Option<i64>,
        f: &mut report_query::RowSink<'_>,
    ) -> Result<u64, HistoryError> {
        report_query::via_for_each(self, since_us, f)
    }

    /// The URL the store was opened with, for messages (passwords hidden).
    fn url(&self) -> String {
        "history".to_string()
    }
}

/// The default store: a SQLite file at the per-user data path (`dirs::data_dir()/gpufit/history.db`, e.g.
/// `~/.local/share/gpufit/history.db` on Linux).
pub fn default_url() -> String {
    match dirs::data_dir() {
        Some(d) => format!("sqlite:{}", d.join("gpufit").join("history.db").display()),
        None => "sqlite:history.db".to_string(),
    }
}

/// What a history URL names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    Sqlite(std::path::PathBuf),
    Postgres(String),
}

/// Parses a history URL: `sqlite:PATH`, `sqlite://PATH`, a path ending in
/// `.db`/`.sqlite`/`.sqlite3`, or `postgres://…`/`postgresql://…`.
pub fn parse_url(url: &str) -> Result<StoreUrl, HistoryError> {
    let u = url.trim();
    if let Some(rest) = u
        .strip_prefix("sqlite://")
        .or_else(|| u.strip_prefix("sqlite:"))
    {
        if rest.is_empty() {
            return Err(HistoryError::BadUrl(url.to_string()));
        }
        return Ok(StoreUrl::Sqlite(rest.into()));
    }
    if u.starts_with("postgres://") || u.starts_with("postgresql://") {
        return Ok(StoreUrl::Postgres(u.to_string()));
    }
    let lower = u.to_ascii_lowercase();
    if [".db", ".sqlite", ".sqlite3"]
        .iter()
        .any(|e| lower.ends_with(e))
    {
        return Ok(StoreUrl::Sqlite(u.into()));
    }
    Err(HistoryError::BadUrl(url.to_string()))
}

/// Opens a store by URL: `sqlite:PATH` (or a `.db` path), `postgres://…`.
/// The SQLite file and its directory are created when missing.
pub fn open(url: &str) -> Result<Box<dyn HistoryStore>, HistoryError> {
    open_with(url, sqlite::SqliteOptions::default())
}

/// [`open`] with the SQLite options the caller read at its edge.
pub fn open_with(
    url: &str,
    sqlite: sqlite::SqliteOptions,
) -> Result<Box<dyn HistoryStore>, HistoryError> {
    match parse_url(url)? {
        StoreUrl::Sqlite(path) => Ok(Box::new(sqlite::SqliteStore::open_with(&path, sqlite)?)),
        StoreUrl::Postgres(conn) => Ok(Box::new(self::postgres::PostgresStore::connect(&conn)?)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlite_urls_and_db_paths_parse_to_a_path() {
        assert_eq!(
            parse_url("sqlite:/tmp/h.db").unwrap(),
            StoreUrl::Sqlite("/tmp/h.db".into())
        );
        assert_eq!(
            parse_url("sqlite:///tmp/h").unwrap(),
            StoreUrl::Sqlite("/tmp/h".into())
        );
        assert_eq!(
            parse_url("runs.sqlite3").unwrap(),
            StoreUrl::Sqlite("runs.sqlite3".into())
        );
    }

    #[test]
    fn postgres_urls_are_kept_whole() {
        let u = "postgresql://gpufit@127.0.0.1:5432/fleet";
        assert_eq!(parse_url(u).unwrap(), StoreUrl::Postgres(u.into()));
    }

    #[test]
    fn an_unknown_scheme_says_which_are_supported() {
        let e = parse_url("mysql://x").unwrap_err().to_string();
        assert!(
            e.contains("sqlite:PATH") && e.contains("postgres://"),
            "{e}"
        );
        assert!(parse_url("sqlite:").is_err());
    }
}
