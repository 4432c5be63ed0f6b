//! Step 3, record: every finished attempt the history does not have yet
//! becomes a run record (`RunRecord::new`). A store that is down keeps the
//! run in status; it is recorded on a later pass.

use crate::controller::crd::{Attempt, AttemptOutcome, Mode, TrainingJobStatus};
use crate::controller::metrics::RunOutcome;
use crate::controller::validate::Validated;
use crate::controller::ControllerError;
use crate::core::run::{RunKey, RunOrigin, RunPath, RunRecord, RunResult, RunSource};
use crate::history::HistoryError;

use super::context::Context;
use super::observe::unix;

/// A run could not be recorded.
#[derive(Debug, thiserror::Error)]
pub(super) enum RecordError {
    #[error("history store: {0}")]
    History(#[from] HistoryError),
    /// The blocking write did not finish.
    #[error("history task failed: {0}")]
    Task(String),
}

impl From<RecordError> for ControllerError {
    fn from(e: RecordError) -> Self {
        match e {
            RecordError::History(h) => ControllerError::History(h),
            RecordError::Task(t) => ControllerError::Other(format!("history task failed: {t}")),
        }
    }
}

/// An attempt that ended with a result worth recording.
pub(super) fn finished(o: AttemptOutcome) -> bool {
    matches!(
        o,
        AttemptOutcome::Succeeded | AttemptOutcome::Oom | AttemptOutcome::Failed
    )
}

/// The run record of a finished attempt.
pub fn run_record(
    v: &Validated,
    gpu: &str,
    cluster: Option<&str>,
    ns: &str,
    a: &Attempt,
) -> Option<RunRecord> {
    // The settings the Job stated it ran win over the injected ones.
    let settings = match &a.ran_settings {
        Some(ran) => ran.to_settings()?,
        None => a.settings.to_settings()?,
    };
    let w = &v.workload;
    let duration = match (
        unix(a.started_at.as_deref()),
        unix(a.finished_at.as_deref()),
    ) {
        (Some(s), Some(e)) if e >= s => Some(e - s),
        _ => None,
    };
    let origin = RunOrigin::new(RunSource::Kubernetes, chrono::Utc::now())
        .cluster(cluster.map(str::to_string))
        .node(a.node.clone())
        // The run's identity in the history: a replayed reconcile updates
        // the row instead of adding one.
        .job_id(Some(match &a.job_uid {
            Some(uid) => format!("{ns}/{}/{uid}", a.job_name),
            None => format!("{ns}/{}", a.job_name),
        }));
    let record = RunRecord::new(
        origin,
        RunKey::of(w, gpu),
        settings,
        RunResult {
            // Only finished attempts are recorded: Succeeded, Oom or Failed.
            outcome: crate::core::run::RunOutcome::of(
                a.outcome == AttemptOutcome::Succeeded,
                a.outcome == AttemptOutcome::Oom,
                a.host_oom,
            ),
            peak_memory_bytes: a.measured_peak_bytes,
            samples_per_sec: a.tokens_per_sec.map(|t| t / w.seq_len.max(1) as f64),
            tokens_per_sec: a.tokens_per_sec,
            duration_sec: duration,
        },
    )
    // The prediction was for the injected settings: none for others.
    .with_prediction(a.predicted_peak_bytes.filter(|_| a.ran_settings.is_none()))
    // An attempt from before confirmation was tracked says nothing: as then.
    .with_confirmation(a.confirmation.unwrap_or_default());
    Some(record)
}

pub(super) async fn record_runs(
    ctx: &Context,
    ns: &str,
    v: &Validated,
    st: &mut TrainingJobStatus,
) -> Result<(), RecordError> {
    let gpu = st.gpu.clone().unwrap_or_default();
    for a in st.attempts.iter_mut() {
        if !finished(a.outcome) || a.run_id.is_some() || a.mode == Some(Mode::Recommend) {
            continue;
        }
        let Some(rec) = run_record(v, &gpu, ctx.cluster.as_deref(), ns, a) else {
            tracing::warn!(job = %a.job_name, "attempt settings cannot be read back; not recorded");
            continue;
        };
        let store = ctx.history.clone();
        let metrics = ctx.metrics.clone();
        // The next suggestion for this workload must see this run.
        let (model, method) = (rec.model.clone(), rec.method);
        let id = tokio::task::spawn_blocking(move || {
            let id = store.record(&rec)?;
            metrics.observe_throughput(store.as_ref(), &rec);
            Ok::<_, crate::history::HistoryError>(id)
        })
        .await
        .map_err(|e| RecordError::Task(e.to_string()))??;
        a.run_id = Some(id);
        ctx.history_cache.forget(&model, method);
        let outcome = match a.outcome {
            AttemptOutcome::Succeeded => RunOutcome::Success,
            AttemptOutcome::Oom => RunOutcome::Oom,
            _ => RunOutcome::OtherError,
        };
        ctx.metrics.count_run(RunPath::TrainingJob, &gpu, outcome);
    }
    Ok(())
}
