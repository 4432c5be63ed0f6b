//! The narrow, streaming query behind `gpufit report`
//! ([`super::HistoryStore::report_rows`]).
//!
//! It reads only the columns the report aggregates, and hands each
//! row to the caller as a [`ReportRow`] borrowing the driver's buffers, so a
//! million-run history is aggregated in one pass without building a
//! `RunRecord` (or a `String`) per run. Rows before the window are read only
//! when they are successful with a throughput: they set the best known
//! throughput of their key.

use postgres::fallible_iterator::FallibleIterator;

use super::schema::{self, u, u32_of};
use super::HistoryError;
use crate::core::report::ReportRow;
use crate::core::run::FailureReason;
use crate::core::workload::Method;

/// The callback every store streams rows into.
pub type RowSink<'f> = dyn FnMut(&ReportRow<'_>) -> Result<(), HistoryError> + 'f;

/// A multi-node job's partial record (a node has not reported, or reported
/// without a peak: [`crate::core::run::NodeReports::partial`]) reads with
/// no peak: its peak is only a lower bound of the job's, so it is left out
/// of the prediction error and the unused memory (counted as unmeasured).
const COLUMNS: &str = "timestamp_us, gpu_model, model, method, seq_len, gpus, success, \
    failure_reason, \
    CASE WHEN nodes_reported < nodes_expected OR nodes_without_peak IS NOT NULL \
    THEN NULL ELSE peak_memory_bytes END, \
    predicted_peak_bytes, tokens_per_sec, duration_sec, source, job_id, \
    settings_confirmation <> 'unconfirmed'";

/// The run's path from its stored source and job id.
fn path(source: &str, job_id: Option<&str>) -> &'static str {
    schema::parse_source(source)
        .map(|s| crate::core::run::run_path(s, job_id))
        .unwrap_or("import")
}

/// Spellings seen per run are few (`lora`, `OOM`): parse without allocating.
fn method(s: &str) -> Option<Method> {
    match s {
        "full" => Some(Method::Full),
        "lora" => Some(Method::Lora),
        "qlora" => Some(Method::Qlora),
        other => schema::parse_method(other),
    }
}

fn is_oom(success: bool, failure: Option<&str>) -> bool {
    !success
        && match failure {
            Some("OOM") => true,
            Some(f) => schema::parse_failure(f) == Some(FailureReason::Oom),
            None => false,
        }
}

fn bad_method(url: &str, m: &str) -> HistoryError {
    HistoryError::Store {
        url: url.to_string(),
        message: format!("reading a run for the report: unknown method `{m}`"),
    }
}

/// SQLite: one statement, stepped row by row.
pub(crate) fn sqlite_rows(
    conn: &rusqlite::Connection,
    url: &str,
    since_us: Option<i64>,
    f: &mut RowSink<'_>,
    err: &dyn Fn(rusqlite::Error) -> HistoryError,
) -> Result<u64, HistoryError> {
    let sql = format!(
        "SELECT {COLUMNS} FROM runs WHERE ?1 IS NULL OR timestamp_us >= ?1 \
         OR (success <> 0 AND tokens_per_sec IS NOT NULL)"
    );
    let mut stmt = conn.prepare(&sql).map_err(err)?;
    let mut rows = stmt.query([since_us]).map_err(err)?;
    let mut n = 0;
    while let Some(row) = rows.next().map_err(err)? {
        let text = |i: usize| -> Result<&str, HistoryError> {
            row.get_ref(i)
                .and_then(|v| v.as_str().map_err(rusqlite::Error::from))
                .map_err(err)
        };
        let m = text(3)?;
        let success: bool = row.get(6).map_err(err)?;
        let failure = row
            .get_ref(7)
            .and_then(|v| v.as_str_or_null().map_err(rusqlite::Error::from))
            .map_err(err)?;
        let r = ReportRow {
            timestamp_us: row.get(0).map_err(err)?,
            gpu_model: text(1)?,
            model: text(2)?,
            method: method(m).ok_or_else(|| bad_method(url, m))?,
            seq_len: u32_of(row.get(4).map_err(err)?),
            gpus: u32_of(row.get(5).map_err(err)?),
            success,
            oom: is_oom(success, failure),
            peak_memory_bytes: row.get::<_, Option<i64>>(8).map_err(err)?.map(u),
            predicted_peak_bytes: row.get::<_, Option<i64>>(9).map_err(err)?.map(u),
            tokens_per_sec: row.get(10).map_err(err)?,
            duration_sec: row.get(11).map_err(err)?,
            path: path(
                text(12)?,
                row.get_ref(13)
                    .and_then(|v| v.as_str_or_null().map_err(rusqlite::Error::from))
                    .map_err(err)?,
            ),
            confirmed: row.get(14).map_err(err)?,
        };
        f(&r)?;
        n += 1;
    }
    Ok(n)
}

/// PostgreSQL: `query_raw` streams the rows instead of collecting them.
pub(crate) fn postgres_rows(
    client: &mut postgres::Client,
    url: &str,
    since_us: Option<i64>,
    f: &mut RowSink<'_>,
    err: &dyn Fn(postgres::Error) -> HistoryError,
) -> Result<u64, HistoryError> {
    let sql = format!(
        "SELECT {COLUMNS} FROM runs WHERE $1::BIGINT IS NULL OR timestamp_us >= $1 \
         OR (success AND tokens_per_sec IS NOT NULL)"
    );
    let mut rows = client.query_raw(sql.as_str(), [since_us]).map_err(err)?;
    let mut n = 0;
    while let Some(row) = rows.next().map_err(err)? {
        let m: &str = row.try_get(3).map_err(err)?;
        let success: bool = row.try_get(6).map_err(err)?;
        let failure: Option<&str> = row.try_get(7).map_err(err)?;
        let r = ReportRow {
            timestamp_us: row.try_get(0).map_err(err)?,
            gpu_model: row.try_get(1).map_err(err)?,
            model: row.try_get(2).map_err(err)?,
            method: method(m).ok_or_else(|| bad_method(url, m))?,
            seq_len: u32_of(row.try_get(4).map_err(err)?),
            gpus: u32_of(row.try_get(5).map_err(err)?),
            success,
            oom: is_oom(success, failure),
            peak_memory_bytes: row.try_get::<_, Option<i64>>(8).map_err(err)?.map(u),
            predicted_peak_bytes: row.try_get::<_, Option<i64>>(9).map_err(err)?.map(u),
            tokens_per_sec: row.try_get(10).map_err(err)?,
            duration_sec: row.try_get(11).map_err(err)?,
            path: path(row.try_get(12).map_err(err)?, row.try_get(13).map_err(err)?),
            confirmed: row.try_get(14).map_err(err)?,
        };
        f(&r)?;
        n += 1;
    }
    Ok(n)
}

/// Any store: through `for_each` (whole records), with the same filter.
pub fn via_for_each<S: super::HistoryStore + ?Sized>(
    store: &S,
    since_us: Option<i64>,
    f: &mut RowSink<'_>,
) -> Result<u64, HistoryError> {
    let mut n = 0;
    store.for_each(&mut |r| {
        let row = ReportRow::of(&r);
        let in_window = since_us.is_none_or(|s| row.timestamp_us >= s);
        if in_window || (row.success && row.tokens_per_sec.is_some()) {
            n += 1;
            f(&row)?;
        }
        Ok(())
    })?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_failure_spelling_the_store_accepts_counts_as_oom() {
        assert!(is_oom(false, Some("OOM")));
        assert!(is_oom(false, Some("out_of_memory")));
        assert!(!is_oom(false, Some("other_error")));
        assert!(!is_oom(false, None));
        // A success with a stale reason is not an OOM (as RunRecord::is_oom).
        assert!(!is_oom(true, Some("OOM")));
    }

    #[test]
    fn methods_parse_like_the_store_does() {
        for m in [Method::Full, Method::Lora, Method::Qlora] {
            assert_eq!(method(m.as_str()), Some(m));
        }
        assert_eq!(method("nonsense"), None);
    }
}
