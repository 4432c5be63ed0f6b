//! Step 2, read peaks: the peak GPU memory of finished attempts, looked up
//! once when the Job finishes and again, paced by time, while it is unknown
//! (a scrape or remote-write lag); the prediction error follows.

use std::time::Duration;

use kube::runtime::events::EventType;

use crate::controller::crd::{Attempt, TrainingJob, TrainingJobStatus};

use super::context::{Context, MeasuredPeak, PeakQuery};
use super::observe::unix;
use super::record::finished;
use super::MAX_PEAK_LOOKUPS;

/// A peak could not be read.
#[derive(Debug, thiserror::Error)]
pub(super) enum PeakError {
    /// Every reader failed (their messages, joined).
    #[error("{0}")]
    Reader(String),
    /// The blocking lookup did not finish.
    #[error("peak lookup panicked: {0}")]
    Task(String),
}

/// One lookup through the context's readers (blocking, off the runtime).
pub(super) async fn read_peak(
    ctx: &Context,
    q: PeakQuery,
) -> Result<Option<MeasuredPeak>, PeakError> {
    let reader = ctx.peaks.clone();
    tokio::task::spawn_blocking(move || reader.job_peak(&q))
        .await
        .map_err(|e| PeakError::Task(e.to_string()))?
        .map_err(PeakError::Reader)
}

/// Looks up peaks still unknown; when some are pending, how long to wait
/// before the next lookup is due.
pub(super) async fn fill_pending(
    ctx: &Context,
    ns: &str,
    st: &mut TrainingJobStatus,
    just_finished: Option<usize>,
) -> Option<Duration> {
    if !fill_pending_peaks(ctx, ns, st, just_finished).await {
        return None;
    }
    let next = st
        .attempts
        .iter()
        .filter_map(|a| peak_due(a, ctx.peak_retry))
        .min()
        .and_then(|due| (due - chrono::Utc::now()).to_std().ok())
        .unwrap_or(ctx.peak_retry)
        .max(Duration::from_millis(100));
    Some(next)
}

/// When the next lookup of a pending peak is due.
pub(super) fn peak_due(a: &Attempt, retry: Duration) -> Option<chrono::DateTime<chrono::Utc>> {
    let last = chrono::DateTime::parse_from_rfc3339(a.last_peak_lookup.as_deref()?).ok()?;
    let factor = 1u32 << a.peak_lookups.saturating_sub(1).min(10);
    let wait = chrono::Duration::from_std(retry * factor).ok()?;
    Some(last.with_timezone(&chrono::Utc) + wait)
}

/// Looks the peak up once; on success fills measured peak and prediction error.
pub(super) async fn lookup_peak(
    ctx: &Context,
    tj: &TrainingJob,
    a: &mut Attempt,
    q: PeakQuery,
) -> bool {
    match read_peak(ctx, q).await {
        Ok(Some(p)) => {
            a.measured_peak_bytes = Some(p.bytes);
            a.peak_source = Some(p.source);
            if let Some(pred) = a.predicted_peak_bytes {
                if p.bytes > 0 {
                    let err = (pred as f64 - p.bytes as f64) / p.bytes as f64;
                    a.prediction_error = Some((err * 1000.0).round() / 1000.0);
                    let gpu = tj
                        .status
                        .as_ref()
                        .and_then(|s| s.gpu.clone())
                        .unwrap_or_default();
                    ctx.metrics.observe_prediction_error(&gpu, err);
                }
            }
            true
        }
        Ok(None) => {
            a.peak_lookups += 1;
            a.last_peak_lookup = Some(chrono::Utc::now().to_rfc3339());
            false
        }
        Err(e) => {
            a.peak_lookups += 1;
            a.last_peak_lookup = Some(chrono::Utc::now().to_rfc3339());
            ctx.event(
                tj,
                EventType::Warning,
                "PeakUnavailable",
                format!("cannot read the peak GPU memory of Job {}: {e}; the run is recorded with peak unknown and filled in later", a.job_name),
            )
            .await;
            false
        }
    }
}

/// Retries the peak of recorded runs whose peak was unknown; `true` when
/// some are still pending (so the caller requeues).
async fn fill_pending_peaks(
    ctx: &Context,
    ns: &str,
    st: &mut TrainingJobStatus,
    just_finished: Option<usize>,
) -> bool {
    let mut pending = false;
    let gpu = st.gpu.clone().unwrap_or_default();
    for (i, a) in st.attempts.iter_mut().enumerate() {
        if Some(i) == just_finished {
            // Looked up a moment ago in `finish_attempt`.
            continue;
        }
        let waiting = finished(a.outcome)
            && a.measured_peak_bytes.is_none()
            && a.peak_lookups > 0
            && a.peak_lookups < MAX_PEAK_LOOKUPS;
        let Some(id) = a.run_id.filter(|_| waiting) else {
            continue;
        };
        if peak_due(a, ctx.peak_retry).is_some_and(|due| chrono::Utc::now() < due) {
            // Not yet: an early reconcile (our own status patch, a Job
            // event) must not spend a lookup.
            pending = true;
            continue;
        }
        let q = PeakQuery {
            namespace: ns.to_string(),
            job: a.job_name.clone(),
            pods: vec![],
            start: unix(a.started_at.as_deref()),
            end: unix(a.finished_at.as_deref()),
        };
        match read_peak(ctx, q).await {
            Ok(Some(p)) => {
                let store = ctx.history.clone();
                let bytes = p.bytes;
                let stored = tokio::task::spawn_blocking(move || store.set_peak(id, bytes)).await;
                if matches!(stored, Ok(Ok(()))) {
                    a.measured_peak_bytes = Some(p.bytes);
                    a.peak_source = Some(p.source);
                    if let Some(pred) = a.predicted_peak_bytes.filter(|_| p.bytes > 0) {
                        let err = (pred as f64 - p.bytes as f64) / p.bytes as f64;
                        a.prediction_error = Some((err * 1000.0).round() / 1000.0);
                        ctx.metrics.observe_prediction_error(&gpu, err);
                    }
                } else {
                    pending = true;
                }
            }
            _ => {
                a.peak_lookups += 1;
                a.last_peak_lookup = Some(chrono::Utc::now().to_rfc3339());
                pending |= a.peak_lookups < MAX_PEAK_LOOKUPS;
            }
        }
    }
    // A run recorded in this pass whose first lookup failed also waits.
    pending
        || st.attempts.iter().any(|a| {
            finished(a.outcome)
                && a.run_id.is_some()
                && a.measured_peak_bytes.is_none()
                && a.peak_lookups > 0
                && a.peak_lookups < MAX_PEAK_LOOKUPS
        })
}
