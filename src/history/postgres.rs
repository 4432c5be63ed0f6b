//! The shared fleet store: PostgreSQL, so several controller replicas,
//! clusters and Slurm sites learn from one history.
//!
//! Same `runs` table and similarity index as SQLite (see [`super::schema`]),
//! integers as `BIGINT`. Migrations run inside a transaction holding a
//! PostgreSQL advisory lock, so replicas starting together migrate once; the
//! version lives in table `gpufit_schema`.
//!
//! This uses the synchronous `postgres` crate, which drives its own
//! single-threaded tokio runtime: call it from plain threads or from
//! `tokio::task::spawn_blocking`, never directly on a tokio worker thread
//! (tokio refuses to start a runtime inside a runtime).

use std::str::FromStr;
use std::sync::Mutex;
use std::time::Duration;

use postgres::binary_copy::BinaryCopyInWriter;
use postgres::types::{ToSql, Type};
use postgres::{Client, NoTls, Row};

use super::schema::{self, i, u, u32_of};
use super::{HistoryError, HistoryStore, ListFilter};
use crate::core::run::{merge_node_report, KeyedRun, NodeReportOutcome, RunRecord, RunResult};
use crate::core::settings::{DataLoaderSettings, EngineeringSettings};
use crate::core::similarity::HistoryQuery;

/// Key for `pg_advisory_xact_lock` while migrating ("gpufit" in ASCII).
const MIGRATION_LOCK: i64 = 0x6770_7566_6974;

fn migrations() -> Vec<String> {
    vec![
        schema::create_runs(
            "BIGINT",
            "BOOLEAN",
            "DOUBLE PRECISION",
            "BIGSERIAL PRIMARY KEY",
        ),
        schema::ADD_RUN_KEY.to_string(),
        schema::add_node_counts("BIGINT"),
        schema::add_host_oom("BOOLEAN", "FALSE"),
        schema::ADD_NODES_WITHOUT_PEAK.to_string(),
        schema::ADD_SETTINGS_CONFIRMATION.to_string(),
    ]
}

/// PostgreSQL-backed history.
pub struct PostgresStore {
    client: Mutex<Client>,
    url: String,
    /// Kept to reconnect after the server restarted or dropped us.
    cfg: postgres::Config,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("url", &self.url)
            .finish()
    }
}

/// The URL without its password, for messages.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.split_once(':') {
                Some((user, _)) => format!("{}{}:***{}", &url[..s + 3], user, &url[at..]),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

impl PostgresStore {
    /// Connects (10 s connect timeout unless the URL sets one) and migrates.
    pub fn connect(url: &str) -> Result<Self, HistoryError> {
        let shown = redact(url);
        let mut cfg = postgres::Config::from_str(url).map_err(|e| HistoryError::Store {
            url: shown.clone(),
            message: format!("invalid PostgreSQL URL: {e}"),
        })?;
        if cfg.get_connect_timeout().is_none() {
            cfg.connect_timeout(Duration::from_secs(10));
        }
        let client = cfg.connect(NoTls).map_err(|e| HistoryError::Store {
            url: shown.clone(),
            message: format!(
                "cannot connect: {e}; check that the server is running and the URL's host, port, user and database are right"
            ),
        })?;
        let store = PostgresStore {
            client: Mutex::new(client),
            url: shown,
            cfg,
        };
        store.migrate()?;
        Ok(store)
    }

    fn err(&self, e: postgres::Error) -> HistoryError {
        let message = match e.as_db_error() {
            Some(db) => format!("{}: {}", db.code().code(), db.message()),
            None => e.to_string(),
        };
        HistoryError::Store {
            url: self.url.clone(),
            message,
        }
    }

    /// The connection, re-established first if the server closed it (a
    /// restart, a failover, an idle timeout): the caller's query then runs
    /// on the new connection; if the server is still down it fails with a
    /// clear error and the next call tries again — gpufit never needs a
    /// restart to recover.
    fn lock(&self) -> std::sync::MutexGuard<'_, Client> {
        let mut guard = self.client.lock().unwrap_or_else(|p| p.into_inner());
        if guard.is_closed() {
            match self.cfg.connect(NoTls) {
                Ok(c) => {
                    tracing::info!(url = %self.url, "reconnected to the PostgreSQL history");
                    *guard = c;
                }
                Err(e) => {
                    tracing::warn!(url = %self.url, error = %e, "PostgreSQL history still unreachable")
                }
            }
        }
        guard
    }

    fn migrate(&self) -> Result<(), HistoryError> {
        let mut c = self.lock();
        let mut tx = c.transaction().map_err(|e| self.err(e))?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
            .map_err(|e| self.err(e))?;
        tx.batch_execute("CREATE TABLE IF NOT EXISTS gpufit_schema (version BIGINT NOT NULL)")
            .map_err(|e| self.err(e))?;
        let current: i64 = tx
            .query_opt("SELECT version FROM gpufit_schema", &[])
            .map_err(|e| self.err(e))?
            .map(|r| r.get(0))
            .unwrap_or(0);
        let all = migrations();
        let supported = all.len() as i64;
        if current > supported {
            return Err(HistoryError::SchemaTooNew {
                url: self.url.clone(),
                found: current,
                supported,
            });
        }
        for (k, sql) in all.iter().enumerate() {
            let to = k as i64 + 1;
            if to > current {
                tx.batch_execute(sql).map_err(|e| self.err(e))?;
            }
        }
        if current < supported {
            tx.execute("DELETE FROM gpufit_schema", &[])
                .map_err(|e| self.err(e))?;
            tx.execute(
                "INSERT INTO gpufit_schema (version) VALUES ($1)",
                &[&supported],
            )
            .map_err(|e| self.err(e))?;
        }
        tx.commit().map_err(|e| self.err(e))
    }
}

/// Owned parameter values for one insert.
struct Params {
    ints: [Option<i64>; 13],
    texts: [Option<String>; 11],
    bools: [bool; 7],
    floats: [Option<f64>; 3],
}

fn to_params(r: &RunRecord) -> Params {
    let s = &r.settings;
    Params {
        ints: [
            Some(schema::ts_to_us(r.timestamp)),
            Some(r.seq_len as i64),
            r.lora_rank.map(i64::from),
            Some(r.gpus as i64),
            r.global_batch.map(i64::from),
            Some(s.micro_batch_size as i64),
            Some(s.gradient_accumulation_steps as i64),
            Some(s.dataloader.num_workers as i64),
            Some(s.dataloader.prefetch_factor as i64),
            r.result.peak_memory_bytes.map(i),
            r.predicted_peak_bytes.map(i),
            r.nodes.as_ref().map(|n| i64::from(n.reported)),
            r.nodes.as_ref().map(|n| i64::from(n.expected)),
        ],
        texts: [
            r.cluster.clone(),
            r.node.clone(),
            Some(schema::source_str(r.source).into()),
            r.job_id.clone(),
            Some(r.model.clone()),
            Some(r.method.as_str().into()),
            Some(r.gpu_model.clone()),
            Some(s.dtype.as_str().into()),
            r.result
                .failure_reason()
                .map(|f| schema::failure_str(f).into()),
            schema::without_peak_str(r.nodes.as_ref()),
            Some(r.confirmation.as_str().into()),
        ],
        bools: [
            s.activation_checkpointing,
            s.activation_offloading,
            s.compile,
            s.dataloader.pin_memory,
            s.dataloader.persistent_workers,
            r.result.success(),
            r.result.host_oom(),
        ],
        floats: [
            r.result.samples_per_sec.filter(|v| v.is_finite()),
            r.result.tokens_per_sec.filter(|v| v.is_finite()),
            r.result.duration_sec.filter(|v| v.is_finite()),
        ],
    }
}

/// Column types in [`schema::COLUMNS`] order (for binary COPY).
fn column_types() -> Vec<Type> {
    use Type as T;
    vec![
        T::INT8,
        T::TEXT,
        T::TEXT,
        T::TEXT,
        T::TEXT,
        T::TEXT,
        T::TEXT,
        T::TEXT,
        T::INT8,
        T::INT8,
        T::INT8,
        T::INT8,
        T::INT8,
        T::INT8,
        T::TEXT,
        T::BOOL,
        T::BOOL,
        T::BOOL,
        T::INT8,
        T::BOOL,
        T::BOOL,
        T::INT8,
        T::BOOL,
        T::TEXT,
        T::INT8,
        T::FLOAT8,
        T::FLOAT8,
        T::FLOAT8,
        T::INT8,
        T::INT8,
        T::INT8,
        T::BOOL,
        T::TEXT,
        T::TEXT,
    ]
}

impl Params {
    /// References in [`schema::COLUMNS`] order.
    fn refs(&self) -> Vec<&(dyn ToSql + Sync)> {
        let (n, t, b, f) = (&self.ints, &self.texts, &self.bools, &self.floats);
        vec![
            &n[0], &t[0], &t[1], &t[2], &t[3], &t[4], &t[5], &t[6], &n[1], &n[2], &n[3], &n[4],
            &n[5], &n[6], &t[7], &b[0], &b[1], &b[2], &n[7], &b[3], &b[4], &n[8], &b[5], &t[8],
            &n[9], &f[0], &f[1], &f[2], &n[10], &n[11], &n[12], &b[6], &t[9], &t[10],
        ]
    }
}

fn from_row(url: &str, row: &Row) -> Result<RunRecord, HistoryError> {
    let e = |m: String| HistoryError::Store {
        url: url.to_string(),
        message: m,
    };
    let g = |m: postgres::Error| e(format!("reading a run: {m}"));
    let source: String = row.try_get(4).map_err(g)?;
    let method: String = row.try_get(7).map_err(g)?;
    let dtype: String = row.try_get(15).map_err(g)?;
    let failure: Option<String> = row.try_get(24).map_err(g)?;
    let opt_u = |k: usize| -> Result<Option<u64>, HistoryError> {
        Ok(row.try_get::<_, Option<i64>>(k).map_err(g)?.map(u))
    };
    Ok(RunRecord {
        id: Some(row.try_get(0).map_err(g)?),
        timestamp: schema::us_to_ts(row.try_get(1).map_err(g)?),
        cluster: row.try_get(2).map_err(g)?,
        node: row.try_get(3).map_err(g)?,
        source: schema::parse_source(&source)
            .ok_or_else(|| e(format!("unknown source `{source}`")))?,
        job_id: row.try_get(5).map_err(g)?,
        model: row.try_get(6).map_err(g)?,
        method: schema::parse_method(&method)
            .ok_or_else(|| e(format!("unknown method `{method}`")))?,
        gpu_model: row.try_get(8).map_err(g)?,
        seq_len: u32_of(row.try_get(9).map_err(g)?),
        lora_rank: row.try_get::<_, Option<i64>>(10).map_err(g)?.map(u32_of),
        gpus: u32_of(row.try_get(11).map_err(g)?),
        global_batch: row.try_get::<_, Option<i64>>(12).map_err(g)?.map(u32_of),
        settings: EngineeringSettings {
            micro_batch_size: u32_of(row.try_get(13).map_err(g)?),
            gradient_accumulation_steps: u32_of(row.try_get(14).map_err(g)?),
            dtype: schema::parse_dtype(&dtype)
                .ok_or_else(|| e(format!("unknown dtype `{dtype}`")))?,
            activation_checkpointing: row.try_get(16).map_err(g)?,
            activation_offloading: row.try_get(17).map_err(g)?,
            compile: row.try_get(18).map_err(g)?,
            dataloader: DataLoaderSettings {
                num_workers: u32_of(row.try_get(19).map_err(g)?),
                pin_memory: row.try_get(20).map_err(g)?,
                persistent_workers: row.try_get(21).map_err(g)?,
                prefetch_factor: u32_of(row.try_get(22).map_err(g)?),
            },
        },
        result: RunResult {
            outcome: schema::outcome(
                row.try_get(23).map_err(g)?,
                match failure {
                    Some(f) => Some(
                        schema::parse_failure(&f)
                            .ok_or_else(|| e(format!("unknown failure_reason `{f}`")))?,
                    ),
                    None => None,
                },
                row.try_get(32).map_err(g)?,
            ),
            peak_memory_bytes: opt_u(25)?,
            samples_per_sec: row.try_get(26).map_err(g)?,
            tokens_per_sec: row.try_get(27).map_err(g)?,
            duration_sec: row.try_get(28).map_err(g)?,
        },
        predicted_peak_bytes: opt_u(29)?,
        nodes: schema::node_reports(
            row.try_get(30).map_err(g)?,
            row.try_get(31).map_err(g)?,
            row.try_get::<_, Option<String>>(33).map_err(g)?.as_deref(),
        ),
        confirmation: {
            let c: String = row.try_get(34).map_err(g)?;
            c.parse()
                .map_err(|_| e(format!("unknown settings_confirmation `{c}`")))?
        },
    })
}

fn insert_sql() -> String {
    format!("{} RETURNING id", schema::upsert(|k| format!("${k}")))
}

impl HistoryStore for PostgresStore {
    fn record(&self, run: &RunRecord) -> Result<i64, HistoryError> {
        let run = run.clone().keyed()?;
        let mut c = self.lock();
        let p = to_params(run.run());
        let key = run.key();
        let mut refs = p.refs();
        refs.push(&key);
        match c
            .query_opt(insert_sql().as_str(), &refs)
            .map_err(|e| self.err(e))?
        {
            Some(row) => row.try_get(0).map_err(|e| self.err(e)),
            // Held back by the replace guard: say why.
            None => {
                let stored = c
                    .query_opt(schema::select_by_key("$1").as_str(), &[&key])
                    .map_err(|e| self.err(e))?
                    .map(|row| from_row(&self.url, &row))
                    .transpose()?;
                Err(super::refused_replace(
                    &self.url,
                    stored.as_ref(),
                    run.run(),
                ))
            }
        }
    }

    fn record_batch_keyed(
        &self,
        runs: &mut dyn Iterator<Item = Result<KeyedRun, HistoryError>>,
    ) -> Result<u64, HistoryError> {
        let mut c = self.lock();
        let mut tx = c.transaction().map_err(|e| self.err(e))?;
        // Binary COPY into a staging table (one stream instead of a round
        // trip per row), then one upsert keyed by each run's identity: a
        // re-imported run updates its row instead of adding one.
        tx.batch_execute(
            "CREATE TEMP TABLE runs_stage (LIKE runs INCLUDING DEFAULTS) ON COMMIT DROP",
        )
        .map_err(|e| self.err(e))?;
        let cols = schema::COLUMNS.join(", ");
        let sql = format!("COPY runs_stage ({cols}, run_key) FROM STDIN BINARY");
        let sink = tx.copy_in(sql.as_str()).map_err(|e| self.err(e))?;
        let mut types = column_types();
        types.push(Type::TEXT);
        let mut w = BinaryCopyInWriter::new(sink, &types);
        let mut n = 0;
        for r in runs {
            // On error, dropping the writer aborts the COPY and dropping
            // `tx` rolls the whole batch back.
            let r = r?;
            let p = to_params(r.run());
            let key = r.key();
            let mut refs = p.refs();
            refs.push(&key);
            w.write(&refs).map_err(|e| self.err(e))?;
            n += 1;
        }
        w.finish().map_err(|e| self.err(e))?;
        // The last of several copies of one run in a batch wins, as it
        // would row by row.
        tx.batch_execute(&format!(
            "INSERT INTO runs ({cols}, run_key)
             SELECT DISTINCT ON (run_key) {cols}, run_key FROM runs_stage ORDER BY run_key, id DESC
             ON CONFLICT (run_key) DO UPDATE SET {} WHERE {}",
            schema::update_set(),
            schema::REPLACE_GUARD
        ))
        .map_err(|e| self.err(e))?;
        tx.commit().map_err(|e| self.err(e))?;
        Ok(n)
    }

    /// One transaction: the job's record is read `FOR UPDATE` by its key
    /// (the unique index), so reports of several nodes, through several
    /// controller replicas or Epilogs, merge one after the other. With no
    /// record yet nothing can be locked: the first report is inserted with
    /// `ON CONFLICT DO NOTHING`, and when another node's first report won
    /// that race (the insert waits for it and then inserts nothing) this one
    /// is merged into it.
    fn record_node_report_outcome(
        &self,
        report: &RunRecord,
    ) -> Result<NodeReportOutcome, HistoryError> {
        let report = report.clone().keyed()?;
        let key = report.key();
        let mut c = self.lock();
        let mut tx = c.transaction().map_err(|e| self.err(e))?;
        let select = format!("{} FOR UPDATE", schema::select_by_key("$1"));
        let insert_new = format!("{} RETURNING id", schema::insert_new(|k| format!("${k}")));
        // Two rounds at most: a lost race to insert leaves a row to lock.
        for _ in 0..2 {
            let so_far = match tx
                .query_opt(select.as_str(), &[&key])
                .map_err(|e| self.err(e))?
            {
                Some(row) => Some(from_row(&self.url, &row)?),
                None => None,
            };
            let Some(merged) = merge_node_report(so_far.as_ref(), report.run())? else {
                // Already counted: nothing to write.
                tx.commit().map_err(|e| self.err(e))?;
                let id = so_far
                    .as_ref()
                    .and_then(|r| r.id)
                    .ok_or_else(|| HistoryError::Store {
                        url: self.url.clone(),
                        message: "the job's record has no id".into(),
                    })?;
                return Ok(NodeReportOutcome::of(so_far.as_ref(), None, id));
            };
            let p = to_params(&merged);
            let mut refs = p.refs();
            refs.push(&key);
            let sql = if so_far.is_some() {
                insert_sql()
            } else {
                insert_new.clone()
            };
            if let Some(row) = tx.query_opt(sql.as_str(), &refs).map_err(|e| self.err(e))? {
                let id: i64 = row.try_get(0).map_err(|e| self.err(e))?;
                tx.commit().map_err(|e| self.err(e))?;
                return Ok(NodeReportOutcome::of(so_far.as_ref(), Some(merged), id));
            }
        }
        Err(HistoryError::Store {
            url: self.url.clone(),
            message: format!("the record of `{key}` could be neither inserted nor locked"),
        })
    }

    fn similar(&self, q: &HistoryQuery) -> Result<Vec<RunRecord>, HistoryError> {
        let mut c = self.lock();
        let sql = format!(
            "{} WHERE model = $1 AND method = $2 AND gpu_model = $3 AND seq_len BETWEEN $4 AND $5",
            schema::select_all()
        );
        let rows = c
            .query(
                sql.as_str(),
                &[
                    &q.model,
                    &q.method.as_str(),
                    &q.gpu_model,
                    &(q.seq_len_min as i64),
                    &(q.seq_len_max as i64),
                ],
            )
            .map_err(|e| self.err(e))?;
        rows.iter().map(|r| from_row(&self.url, r)).collect()
    }

    fn list(&self, f: &ListFilter) -> Result<Vec<RunRecord>, HistoryError> {
        let mut c = self.lock();
        let limit: Option<i64> = f.limit.map(|l| l.min(i64::MAX as usize) as i64);
        let sql = format!(
            "{} WHERE ($1::TEXT IS NULL OR model = $1) AND ($2::TEXT IS NULL OR gpu_model = $2) ORDER BY timestamp_us DESC, id DESC LIMIT $3",
            schema::select_all()
        );
        let rows = c
            .query(sql.as_str(), &[&f.model, &f.gpu_model, &limit])
            .map_err(|e| self.err(e))?;
        rows.iter().map(|r| from_row(&self.url, r)).collect()
    }

    fn find(&self, identity: &str) -> Result<Option<RunRecord>, HistoryError> {
        let mut c = self.lock();
        c.query_opt(schema::select_by_key("$1").as_str(), &[&identity])
            .map_err(|e| self.err(e))?
            .map(|row| from_row(&self.url, &row))
            .transpose()
    }

    fn set_peak(&self, id: i64, peak: u64) -> Result<(), HistoryError> {
        let mut c = self.lock();
        // The record with its peak must pass the door like any other write.
        let sel = format!("{} WHERE id = $1", schema::select_all());
        if let Some(row) = c.query_opt(sel.as_str(), &[&id]).map_err(|e| self.err(e))? {
            let mut r = from_row(&self.url, &row)?;
            r.result.peak_memory_bytes = Some(peak);
            r.validated(None)?;
        }
        let n = c
            .execute(
                "UPDATE runs SET peak_memory_bytes = $1 WHERE id = $2",
                &[&i(peak), &id],
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

    fn count(&self) -> Result<u64, HistoryError> {
        let mut c = self.lock();
        let n: i64 = c
            .query_one("SELECT COUNT(*) FROM runs", &[])
            .map_err(|e| self.err(e))?
            .get(0);
        Ok(u(n))
    }

    fn for_each(
        &self,
        f: &mut dyn FnMut(RunRecord) -> Result<(), HistoryError>,
    ) -> Result<u64, HistoryError> {
        use postgres::fallible_iterator::FallibleIterator;
        let mut c = self.lock();
        let sql = format!("{} ORDER BY timestamp_us, id", schema::select_all());
        // query_raw streams rows instead of collecting the whole table.
        let mut rows = c
            .query_raw(sql.as_str(), std::iter::empty::<i64>())
            .map_err(|e| self.err(e))?;
        let mut n = 0;
        while let Some(row) = rows.next().map_err(|e| self.err(e))? {
            f(from_row(&self.url, &row)?)?;
            n += 1;
        }
        Ok(n)
    }

    fn report_rows(
        &self,
        since_us: Option<i64>,
        f: &mut super::report_query::RowSink<'_>,
    ) -> Result<u64, HistoryError> {
        super::report_query::postgres_rows(&mut self.lock(), &self.url, since_us, f, &|e| {
            self.err(e)
        })
    }

    fn url(&self) -> String {
        self.url.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_types_and_parameters_match_the_columns_one_to_one() {
        let r = crate::history::jsonl::parse_line(
            r#"{"config": {"model": "m", "max_seq_length": 8, "batch_size": 1}, "result": {"success": true}, "gpu_type": "g"}"#,
            &Default::default(),
            &mut Default::default(),
            chrono::Utc::now(),
        )
        .unwrap();
        assert_eq!(column_types().len(), schema::COLUMNS.len());
        assert_eq!(to_params(&r).refs().len(), schema::COLUMNS.len());
    }

    #[test]
    fn passwords_are_not_shown_in_messages() {
        assert_eq!(
            redact("postgres://gpufit:s3cret@db:5432/fleet"),
            "postgres://gpufit:***@db:5432/fleet"
        );
        assert_eq!(
            redact("postgres://gpufit@db/fleet"),
            "postgres://gpufit@db/fleet"
        );
    }
}
