//! The embedded default store: one SQLite file (rusqlite, bundled).
//!
//! - WAL journal, `synchronous=NORMAL`: readers never block the writer and a
//!   crash loses at most the last transaction, never an older record.
//! - A busy timeout (default 5 s): two gpufit processes writing at once wait
//!   for each other; past the timeout the caller gets
//!   [`HistoryError::Locked`] and nothing is written.
//! - A file that is not SQLite, or is damaged, gives
//!   [`HistoryError::Corrupt`]; gpufit never rewrites or deletes it.
//! - Schema migrations are numbered; `PRAGMA user_version` holds the last
//!   one applied, and a file from a newer gpufit is refused, not downgraded.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use rusqlite::types::ToSqlOutput;
use rusqlite::{Connection, ErrorCode, OpenFlags, Row, TransactionBehavior};

use super::schema::{self, i, u, u32_of};
use super::{HistoryError, HistoryStore, ListFilter};
use crate::core::run::{merge_node_report, KeyedRun, NodeReportOutcome, RunRecord, RunResult};
use crate::core::settings::{DataLoaderSettings, EngineeringSettings};
use crate::core::similarity::HistoryQuery;

/// Migrations, in order; migration k (1-based) brings the file to version k.
fn migrations() -> Vec<String> {
    vec![
        schema::create_runs("INTEGER", "INTEGER", "REAL", "INTEGER PRIMARY KEY"),
        schema::ADD_RUN_KEY.to_string(),
        schema::add_node_counts("INTEGER"),
        schema::add_host_oom("INTEGER", "0"),
        schema::ADD_NODES_WITHOUT_PEAK.to_string(),
        schema::ADD_SETTINGS_CONFIRMATION.to_string(),
    ]
}

/// Schema version this build writes.
pub fn schema_version() -> i64 {
    migrations().len() as i64
}

/// Options for opening a SQLite store. The defaults read nothing from the
/// environment: the command line and the Slurm hooks read
/// [`BUSY_TIMEOUT_ENV`] at their edge and pass the value in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SqliteOptions {
    /// How long a write waits for another process's lock.
    pub busy_timeout: Duration,
}

/// The environment variable that sets the busy timeout, in milliseconds.
pub const BUSY_TIMEOUT_ENV: &str = "GPUFIT_HISTORY_BUSY_TIMEOUT_MS";

/// The busy timeout when none is given: 5 s.
pub const DEFAULT_BUSY_TIMEOUT_MS: u64 = 5_000;

impl Default for SqliteOptions {
    fn default() -> Self {
        SqliteOptions {
            busy_timeout: Duration::from_millis(DEFAULT_BUSY_TIMEOUT_MS),
        }
    }
}

/// SQLite-backed history.
pub struct SqliteStore {
    conn: Mutex<Connection>,
    url: String,
    busy_timeout: Duration,
    /// Opened read-only: this user cannot write the file or its directory
    /// (a shared history on a cluster file system). Reads work; writes are
    /// refused with a clear message.
    read_only: bool,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("url", &self.url)
            .finish()
    }
}

impl SqliteStore {
    /// Opens (creating when missing) the file at `path` with default options.
    pub fn open(path: &Path) -> Result<Self, HistoryError> {
        Self::open_with(path, SqliteOptions::default())
    }

    /// Opens (creating when missing) the file at `path`; an existing file
    /// this user may read but not write (or whose directory it cannot write,
    /// which WAL mode needs) is opened read-only.
    pub fn open_with(path: &Path, opts: SqliteOptions) -> Result<Self, HistoryError> {
        match Self::open_read_write(path, opts) {
            Ok(s) => Ok(s),
            Err(e) if path.is_file() && is_access_error(&e) => Self::open_read_only(path, opts)
                .map_err(|ro| {
                    tracing::debug!(error = %ro, "read-only open failed too");
                    e
                }),
            Err(e) => Err(e),
        }
    }

    /// Whether this store was opened read-only.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    fn open_read_only(path: &Path, opts: SqliteOptions) -> Result<Self, HistoryError> {
        let url = format!("sqlite:{}", path.display());
        let flags = OpenFlags::SQLITE_OPEN_READ_ONLY
            | OpenFlags::SQLITE_OPEN_NO_MUTEX
            | OpenFlags::SQLITE_OPEN_URI;
        let probe = |conn: &Connection| -> Result<i64, rusqlite::Error> {
            conn.busy_timeout(opts.busy_timeout)?;
            let v: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
            conn.query_row("SELECT COUNT(*) FROM runs WHERE id < 0", [], |r| {
                r.get::<_, i64>(0)
            })?;
            Ok(v)
        };
        let plain =
            Connection::open_with_flags(path, flags).and_then(|c| probe(&c).map(|v| (c, v)));
        let (conn, version) = match plain {
            Ok(cv) => cv,
            // A WAL database whose directory this user cannot write has no
            // shared-memory file to map: read the file as it stands (what
            // the writer last checkpointed; gpufit checkpoints on close).
            Err(_) => {
                let uri = format!("file:{}?immutable=1", uri_path(path));
                let c = Connection::open_with_flags(&uri, flags)
                    .map_err(|e| map_err(&url, opts.busy_timeout, e))?;
                let v = probe(&c).map_err(|e| map_err(&url, opts.busy_timeout, e))?;
                (c, v)
            }
        };
        let supported = schema_version();
        if version > supported {
            return Err(HistoryError::SchemaTooNew {
                url,
                found: version,
                supported,
            });
        }
        if version < supported {
            return Err(HistoryError::Store {
                url,
                message: format!(
                    "read-only for this user, and written by an older gpufit (schema {version}, this one needs {supported}): open it once as a user who can write it"
                ),
            });
        }
        tracing::info!(%url, "history opened read-only: this user cannot write it");
        Ok(SqliteStore {
            conn: Mutex::new(conn),
            url,
            busy_timeout: opts.busy_timeout,
            read_only: true,
        })
    }

    fn refuse_write(&self) -> Result<(), HistoryError> {
        if self.read_only {
            return Err(HistoryError::Store {
                url: self.url.clone(),
                message: "opened read-only (this user cannot write the file or its directory): recording needs write access, e.g. record through the controller (`--history` of the Slurm hooks pointing at it) or as the history's owner".into(),
            });
        }
        Ok(())
    }

    fn open_read_write(path: &Path, opts: SqliteOptions) -> Result<Self, HistoryError> {
        let url = format!("sqlite:{}", path.display());
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| HistoryError::Store {
                url: url.clone(),
                message: format!("cannot create directory {}: {e}", dir.display()),
            })?;
        }
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE
                | OpenFlags::SQLITE_OPEN_CREATE
                | OpenFlags::SQLITE_OPEN_NO_MUTEX
                | OpenFlags::SQLITE_OPEN_URI,
        )
        .map_err(|e| map_err(&url, opts.busy_timeout, e))?;
        let store = SqliteStore {
            conn: Mutex::new(conn),
            url,
            busy_timeout: opts.busy_timeout,
            read_only: false,
        };
        store.init()?;
        // SQLite opens a file it may not write read-only without saying so,
        // and a WAL file whose directory is read-only fails at the first
        // read: find out now, so the caller can open it read-only properly.
        let readonly = store.lock().is_readonly(rusqlite::MAIN_DB).unwrap_or(false);
        let probe = store
            .lock()
            .query_row("SELECT COUNT(*) FROM runs WHERE id < 0", [], |r| {
                r.get::<_, i64>(0)
            })
            .map_err(|e| store.err(e));
        if readonly {
            return Err(HistoryError::Store {
                url: store.url.clone(),
                message: "the file is read-only for this user".into(),
            });
        }
        probe?;
        Ok(store)
    }

    /// The file path.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(self.url.trim_start_matches("sqlite:"))
    }

    fn err(&self, e: rusqlite::Error) -> HistoryError {
        map_err(&self.url, self.busy_timeout, e)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Connection> {
        // A panic while holding the lock cannot leave the connection in a
        // half-written state (SQLite rolls back), so a poisoned lock is safe.
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn init(&self) -> Result<(), HistoryError> {
        let mut conn = self.lock();
        conn.busy_timeout(self.busy_timeout)
            .map_err(|e| self.err(e))?;
        // Reading the header first: a non-SQLite file fails here, untouched.
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(|e| self.err(e))?;
        let supported = schema_version();
        if version > supported {
            return Err(HistoryError::SchemaTooNew {
                url: self.url.clone(),
                found: version,
                supported,
            });
        }
        if version == 0 {
            // Only a file with no pages yet takes it (SQLite ignores it
            // otherwise): existing histories keep theirs.
            conn.pragma_update(None, "page_size", NEW_DB_PAGE_SIZE)
                .map_err(|e| self.err(e))?;
        }
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(|e| self.err(e))?;
        conn.pragma_update(None, "synchronous", "NORMAL")
            .map_err(|e| self.err(e))?;
        // 64 MiB page cache: large imports build the index in memory.
        conn.pragma_update(None, "cache_size", -65536)
            .map_err(|e| self.err(e))?;
        if version < supported {
            // IMMEDIATE: two processes opening a fresh file migrate one after
            // the other; the second sees the new version and does nothing.
            let tx = conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(|e| self.err(e))?;
            let current: i64 = tx
                .query_row("PRAGMA user_version", [], |r| r.get(0))
                .map_err(|e| self.err(e))?;
            for (k, sql) in migrations().iter().enumerate() {
                let to = k as i64 + 1;
                if to <= current {
                    continue;
                }
                tx.execute_batch(sql).map_err(|e| self.err(e))?;
                tx.pragma_update(None, "user_version", to)
                    .map_err(|e| self.err(e))?;
            }
            tx.commit().map_err(|e| self.err(e))?;
        }
        Ok(())
    }

    /// Runs `PRAGMA quick_check` (reads the whole file): Ok when intact.
    pub fn check(&self) -> Result<(), HistoryError> {
        let conn = self.lock();
        let res: String = conn
            .query_row("PRAGMA quick_check", [], |r| r.get(0))
            .map_err(|e| self.err(e))?;
        if res == "ok" {
            Ok(())
        } else {
            Err(HistoryError::Corrupt {
                url: self.url.clone(),
                message: res,
            })
        }
    }
}

/// An open or migration that failed because this user may not write.
fn is_access_error(e: &HistoryError) -> bool {
    match e {
        HistoryError::Store { message, .. } => {
            let m = message.to_ascii_lowercase();
            m.contains("readonly")
                || m.contains("read-only")
                || m.contains("unable to open")
                || m.contains("permission denied")
                || m.contains("cannot create directory")
        }
        _ => false,
    }
}

/// A path for a `file:` URI (`%`, `?` and `#` escaped).
fn uri_path(p: &Path) -> String {
    p.display()
        .to_string()
        .replace('%', "%25")
        .replace('?', "%3f")
        .replace('#', "%23")
}

fn map_err(url: &str, busy: Duration, e: rusqlite::Error) -> HistoryError {
    if let rusqlite::Error::SqliteFailure(f, msg) = &e {
        match f.code {
            ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked => {
                return HistoryError::Locked {
                    url: url.to_string(),
                    waited_ms: busy.as_millis() as u64,
                }
            }
            ErrorCode::NotADatabase | ErrorCode::DatabaseCorrupt => {
                return HistoryError::Corrupt {
                    url: url.to_string(),
                    message: msg.clone().unwrap_or_else(|| f.to_string()),
                }
            }
            ErrorCode::ReadOnly | ErrorCode::CannotOpen | ErrorCode::PermissionDenied => {
                return HistoryError::Store {
                    url: url.to_string(),
                    message: format!(
                        "{e}: check that the file and its directory are writable by this user"
                    ),
                }
            }
            _ => {}
        }
    }
    HistoryError::Store {
        url: url.to_string(),
        message: e.to_string(),
    }
}

/// The row's values with the run's identity last (the upsert's key),
/// borrowed from the record: binding them copies nothing on the Rust side
/// (a 1 M-line import made 10 strings per row before). Bound through
/// `params_from_iter`: rusqlite implements `Params` for arrays of at most 32.
fn keyed_params<'a>(r: &'a RunRecord, key: &'a str) -> [ToSqlOutput<'a>; 35] {
    use rusqlite::types::ValueRef::{Integer, Null, Real, Text};
    let v = ToSqlOutput::Borrowed;
    let opt_i = |x: Option<u64>| v(x.map_or(Null, |n| Integer(i(n))));
    let opt_f = |x: Option<f64>| v(x.filter(|f| f.is_finite()).map_or(Null, Real));
    let opt_t = |x: &'a Option<String>| v(x.as_deref().map_or(Null, |t| Text(t.as_bytes())));
    let text = |t: &'a str| v(Text(t.as_bytes()));
    let int = |n: i64| v(Integer(n));
    let b = |x: bool| int(x as i64);
    let s = &r.settings;
    [
        int(schema::ts_to_us(r.timestamp)),
        opt_t(&r.cluster),
        opt_t(&r.node),
        text(schema::source_str(r.source)),
        opt_t(&r.job_id),
        text(&r.model),
        text(r.method.as_str()),
        text(&r.gpu_model),
        int(r.seq_len as i64),
        opt_i(r.lora_rank.map(u64::from)),
        int(r.gpus as i64),
        opt_i(r.global_batch.map(u64::from)),
        int(s.micro_batch_size as i64),
        int(s.gradient_accumulation_steps as i64),
        text(s.dtype.as_str()),
        b(s.activation_checkpointing),
        b(s.activation_offloading),
        b(s.compile),
        int(s.dataloader.num_workers as i64),
        b(s.dataloader.pin_memory),
        b(s.dataloader.persistent_workers),
        int(s.dataloader.prefetch_factor as i64),
        b(r.result.success()),
        v(r.result
            .failure_reason()
            .map_or(Null, |f| Text(schema::failure_str(f).as_bytes()))),
        opt_i(r.result.peak_memory_bytes),
        opt_f(r.result.samples_per_sec),
        opt_f(r.result.tokens_per_sec),
        opt_f(r.result.duration_sec),
        opt_i(r.predicted_peak_bytes),
        opt_i(r.nodes.as_ref().map(|n| u64::from(n.reported))),
        opt_i(r.nodes.as_ref().map(|n| u64::from(n.expected))),
        b(r.result.host_oom()),
        match schema::without_peak_str(r.nodes.as_ref()) {
            Some(t) => ToSqlOutput::Owned(rusqlite::types::Value::Text(t)),
            None => v(Null),
        },
        text(r.confirmation.as_str()),
        text(key),
    ]
}

fn bad(col: usize, what: &str, v: &str) -> rusqlite::Error {
    rusqlite::Error::FromSqlConversionFailure(
        col,
        rusqlite::types::Type::Text,
        format!("unknown {what} `{v}`").into(),
    )
}

fn from_row(row: &Row<'_>) -> rusqlite::Result<RunRecord> {
    let source: String = row.get(4)?;
    let method: String = row.get(7)?;
    let dtype: String = row.get(15)?;
    let failure: Option<String> = row.get(24)?;
    let opt_u =
        |i: usize| -> rusqlite::Result<Option<u64>> { Ok(row.get::<_, Option<i64>>(i)?.map(u)) };
    Ok(RunRecord {
        id: Some(row.get(0)?),
        timestamp: schema::us_to_ts(row.get(1)?),
        cluster: row.get(2)?,
        node: row.get(3)?,
        source: schema::parse_source(&source).ok_or_else(|| bad(4, "source", &source))?,
        job_id: row.get(5)?,
        model: row.get(6)?,
        method: schema::parse_method(&method).ok_or_else(|| bad(7, "method", &method))?,
        gpu_model: row.get(8)?,
        seq_len: u32_of(row.get(9)?),
        lora_rank: row.get::<_, Option<i64>>(10)?.map(u32_of),
        gpus: u32_of(row.get(11)?),
        global_batch: row.get::<_, Option<i64>>(12)?.map(u32_of),
        settings: EngineeringSettings {
            micro_batch_size: u32_of(row.get(13)?),
            gradient_accumulation_steps: u32_of(row.get(14)?),
            dtype: schema::parse_dtype(&dtype).ok_or_else(|| bad(15, "dtype", &dtype))?,
            activation_checkpointing: row.get(16)?,
            activation_offloading: row.get(17)?,
            compile: row.get(18)?,
            dataloader: DataLoaderSettings {
                num_workers: u32_of(row.get(19)?),
                pin_memory: row.get(20)?,
                persistent_workers: row.get(21)?,
                prefetch_factor: u32_of(row.get(22)?),
            },
        },
        result: RunResult {
            outcome: schema::outcome(
                row.get(23)?,
                match failure {
                    Some(f) => Some(
                        schema::parse_failure(&f).ok_or_else(|| bad(24, "failure_reason", &f))?,
                    ),
                    None => None,
                },
                row.get(32)?,
            ),
            peak_memory_bytes: opt_u(25)?,
            samples_per_sec: row.get(26)?,
            tokens_per_sec: row.get(27)?,
            duration_sec: row.get(28)?,
        },
        predicted_peak_bytes: opt_u(29)?,
        nodes: schema::node_reports(
            row.get(30)?,
            row.get(31)?,
            row.get::<_, Option<String>>(33)?.as_deref(),
        ),
        confirmation: {
            let c: String = row.get(34)?;
            c.parse()
                .map_err(|_| bad(34, "settings_confirmation", &c))?
        },
    })
}

/// The keyed upsert with SQLite's numbered placeholders.
fn upsert_sql() -> String {
    schema::upsert(|k| format!("?{k}"))
}

fn insert_sql() -> String {
    format!("{} RETURNING id", upsert_sql())
}

/// Page size of a new history file: 8 KiB pages make a 1 M-line import
/// 7 % faster than SQLite's default 4 KiB (median of three 1 M-line
/// imports, `cargo bench --bench history_speed`: 15.55 against 16.78 s),
/// with `similar()` unchanged within 4 % (0.64 against 0.62 ms p50).
const NEW_DB_PAGE_SIZE: i64 = 8192;

impl HistoryStore for SqliteStore {
    fn record(&self, run: &RunRecord) -> Result<i64, HistoryError> {
        self.refuse_write()?;
        let run = run.clone().keyed()?;
        let conn = self.lock();
        let mut stmt = conn
            .prepare_cached(&insert_sql())
            .map_err(|e| self.err(e))?;
        match stmt.query_row(
            rusqlite::params_from_iter(keyed_params(run.run(), run.key())),
            |row| row.get(0),
        ) {
            Ok(id) => Ok(id),
            // Held back by the replace guard: say why.
            Err(rusqlite::Error::QueryReturnedNoRows) => {
                let mut sel = conn
                    .prepare_cached(&schema::select_by_key("?1"))
                    .map_err(|e| self.err(e))?;
                let mut rows = sel.query([run.key()]).map_err(|e| self.err(e))?;
                let stored = match rows.next().map_err(|e| self.err(e))? {
                    Some(row) => Some(from_row(row).map_err(|e| self.err(e))?),
                    None => None,
                };
                Err(super::refused_replace(
                    &self.url,
                    stored.as_ref(),
                    run.run(),
                ))
            }
            Err(e) => Err(self.err(e)),
        }
    }

    fn record_batch_keyed(
        &self,
        runs: &mut dyn Iterator<Item = Result<KeyedRun, HistoryError>>,
    ) -> Result<u64, HistoryError> {
        self.refuse_write()?;
        let mut conn = self.lock();
        // A large import inserts into the similarity index in random key
        // order: a 256 MiB page cache (only touched pages are allocated)
        // keeps the index in memory instead of re-reading it per row.
        conn.pragma_update(None, "cache_size", -262_144)
            .map_err(|e| self.err(e))?;
        let res = self.insert_all(&mut conn, runs);
        let _ = conn.pragma_update(None, "cache_size", -65_536);
        res
    }

    /// One `BEGIN IMMEDIATE` transaction: the write lock is taken before
    /// the job's record is read (by its key, through the unique index), so
    /// Epilogs of several nodes writing at once, in several processes,
    /// merge one after the other and none is lost.
    fn record_node_report_outcome(
        &self,
        report: &RunRecord,
    ) -> Result<NodeReportOutcome, HistoryError> {
        self.refuse_write()?;
        let report = report.clone().keyed()?;
        let mut conn = self.lock();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| self.err(e))?;
        let so_far = {
            let mut stmt = tx
                .prepare_cached(&schema::select_by_key("?1"))
                .map_err(|e| self.err(e))?;
            let mut rows = stmt.query([report.key()]).map_err(|e| self.err(e))?;
            match rows.next().map_err(|e| self.err(e))? {
                Some(row) => Some(from_row(row).map_err(|e| self.err(e))?),
                None => None,
            }
        };
        let merged = merge_node_report(so_far.as_ref(), report.run())?;
        let id = match &merged {
            Some(merged) => {
                let mut stmt = tx.prepare_cached(&insert_sql()).map_err(|e| self.err(e))?;
                stmt.query_row(
                    rusqlite::params_from_iter(keyed_params(merged, report.key())),
                    |row| row.get(0),
                )
                .map_err(|e| self.err(e))?
            }
            // Already counted: nothing to write.
            None => so_far.as_ref().and_then(|r| r.id).unwrap_or_default(),
        };
        tx.commit().map_err(|e| self.err(e))?;
        Ok(NodeReportOutcome::of(so_far.as_ref(), merged, id))
    }

    fn similar(&self, q: &HistoryQuery) -> Result<Vec<RunRecord>, HistoryError> {
        self.similar_impl(q)
    }

    fn find(&self, identity: &str) -> Result<Option<RunRecord>, HistoryError> {
        let conn = self.lock();
        let mut sel = conn
            .prepare_cached(&schema::select_by_key("?1"))
            .map_err(|e| self.err(e))?;
        let mut rows = sel.query([identity]).map_err(|e| self.err(e))?;
        match rows.next().map_err(|e| self.err(e))? {
            Some(row) => Ok(Some(from_row(row).map_err(|e| self.err(e))?)),
            None => Ok(None),
        }
    }

    fn list(&self, f: &ListFilter) -> Result<Vec<RunRecord>, HistoryError> {
        self.list_impl(f)
    }

    fn set_peak(&self, id: i64, peak: u64) -> Result<(), HistoryError> {
        self.refuse_write()?;
        self.set_peak_impl(id, peak)
    }

    fn count(&self) -> Result<u64, HistoryError> {
        self.count_impl()
    }

    fn for_each(
        &self,
        f: &mut dyn FnMut(RunRecord) -> Result<(), HistoryError>,
    ) -> Result<u64, HistoryError> {
        self.for_each_impl(f)
    }

    fn report_rows(
        &self,
        since_us: Option<i64>,
        f: &mut super::report_query::RowSink<'_>,
    ) -> Result<u64, HistoryError> {
        super::report_query::sqlite_rows(&self.lock(), &self.url, since_us, f, &|e| self.err(e))
    }

    fn url(&self) -> String {
        self.url.clone()
    }
}

impl SqliteStore {
    fn insert_all(
        &self,
        conn: &mut Connection,
        runs: &mut dyn Iterator<Item = Result<KeyedRun, HistoryError>>,
    ) -> Result<u64, HistoryError> {
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| self.err(e))?;
        let mut n = 0u64;
        {
            // No `RETURNING id` here: a batch needs no ids, and SQLite's
            // RETURNING on an upsert cost 17 of 41 s importing 1 M lines
            // (`cargo bench --bench history_speed`: 41 s → 24 s without it).
            let mut stmt = tx.prepare_cached(&upsert_sql()).map_err(|e| self.err(e))?;
            for r in runs {
                // On any error the transaction is dropped, i.e. rolled back:
                // the batch is all or nothing, existing rows are untouched.
                let r = r?;
                stmt.execute(rusqlite::params_from_iter(keyed_params(r.run(), r.key())))
                    .map_err(|e| self.err(e))?;
                n += 1;
            }
        }
        tx.commit().map_err(|e| self.err(e))?;
        Ok(n)
    }

    fn similar_impl(&self, q: &HistoryQuery) -> Result<Vec<RunRecord>, HistoryError> {
        let conn = self.lock();
        let sql = format!(
            "{} WHERE model = ?1 AND method = ?2 AND gpu_model = ?3 AND seq_len BETWEEN ?4 AND ?5",
            schema::select_all()
        );
        let mut stmt = conn.prepare_cached(&sql).map_err(|e| self.err(e))?;
        let rows = stmt
            .query_map(
                rusqlite::params![
                    q.model,
                    q.method.as_str(),
                    q.gpu_model,
                    q.seq_len_min as i64,
                    q.seq_len_max as i64
                ],
                from_row,
            )
            .map_err(|e| self.err(e))?;
        rows.collect::<Result<Vec<_>, _>>().map_err(|e| self.err(e))
    }

    fn list_impl(&self, f: &ListFilter) -> Result<Vec<RunRecord>, HistoryError> {
        let conn = self.lock();
        let limit = f.limit.map_or(-1, |l| l.min(i64::MAX as usize) as i64);
        let sql = format!(
            "{} WHERE (?1 IS NULL OR model = ?1) AND (?2 IS NULL OR gpu_model = ?2) ORDER BY timestamp_us DESC, id DESC LIMIT ?3",
            schema::select_all()
        );
        let mut stmt = conn.prepare_cached(&sql).map_err(|e| self.err(e))?;
        let rows = stmt
            .query_map(rusqlite::params![f.model, f.gpu_model, limit], from_row)
            .map_err(|e| self.err(e))?;
        rows.collect::<Result<Vec<_>, _>>().map_err(|e| self.err(e))
    }

    fn set_peak_impl(&self, id: i64, peak: u64) -> Result<(), HistoryError> {
        let conn = self.lock();
        // The record with its peak must pass the door like any other write.
        let stored = {
            let mut sel = conn
                .prepare_cached(&format!("{} WHERE id = ?1", schema::select_all()))
                .map_err(|e| self.err(e))?;
            let mut rows = sel.query([id]).map_err(|e| self.err(e))?;
            match rows.next().map_err(|e| self.err(e))? {
                Some(row) => Some(from_row(row).map_err(|e| self.err(e))?),
                None => None,
            }
        };
        if let Some(mut r) = stored {
            r.result.peak_memory_bytes = Some(peak);
            r.validated(None)?;
        }
        let n = conn
            .execute(
                "UPDATE runs SET peak_memory_bytes = ?1 WHERE id = ?2",
                rusqlite::params![i(peak), id],
            )
            .map_err(|e| self.err(e))?;
        if n == 0 {
            return Err(HistoryError::NoSuchRun {
                url: self.url.clone(),
                id,
            });
        }
        Ok(())
    }

    fn count_impl(&self) -> Result<u64, HistoryError> {
        let conn = self.lock();
        let n: i64 = conn
            .query_row("SELECT COUNT(*) FROM runs", [], |r| r.get(0))
            .map_err(|e| self.err(e))?;
        Ok(u(n))
    }

    fn for_each_impl(
        &self,
        f: &mut dyn FnMut(RunRecord) -> Result<(), HistoryError>,
    ) -> Result<u64, HistoryError> {
        let conn = self.lock();
        let sql = format!("{} ORDER BY timestamp_us, id", schema::select_all());
        let mut stmt = conn.prepare(&sql).map_err(|e| self.err(e))?;
        let mut rows = stmt.query([]).map_err(|e| self.err(e))?;
        let mut n = 0;
        while let Some(row) = rows.next().map_err(|e| self.err(e))? {
            f(from_row(row).map_err(|e| self.err(e))?)?;
            n += 1;
        }
        Ok(n)
    }
}
