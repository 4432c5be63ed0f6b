//! Reconcile a `TrainingJob` as a pipeline of steps, one file each, driven
//! by [`reconcile`]:
//!
//! 1. [`observe`] — the spec (mode, validation: [`super::validate`]) and the
//!    in-flight attempt (running, finished: outcome and first peak lookup,
//!    or deleted);
//! 2. [`record`] — every finished attempt the history does not have yet;
//! 3. [`peaks`] — peaks still unknown, looked up again paced by time;
//! 4. [`decide`] — pure: wait, start an attempt, or settle the phase;
//! 5. [`start`] — resolve the GPU, ask the advisor, build and create the Job;
//! 6. [`status`] — conditions, phase, Events and the one merge patch.
//!
//! Each step has its own error type; the driver turns them into
//! [`ControllerError`] for the controller's backoff.
//!
//! When a Job finishes, its peak GPU memory is read (Prometheus, then the
//! node sidecar), a CUDA out-of-memory failure is told from other failures,
//! the run is recorded in the history, and an OOM is retried with the
//! advisor's next suggestion (which now knows the OOM) up to the retry limit.
//!
//! Nothing is lost on the way: the outcome goes into status first; a run the
//! history store could not take is recorded on a later pass (status keeps it),
//! and a run whose peak is not yet known is recorded with `peak unknown` and
//! filled in later.

use std::sync::Arc;
use std::time::Duration;

use kube::api::Api;
use kube::runtime::controller::Action;
use kube::ResourceExt;

use super::crd::TrainingJob;
use super::ControllerError;

mod context;
mod decide;
pub mod kueue;
mod observe;
pub(crate) use observe::terminated_states;
mod peaks;
mod record;
mod start;
mod status;
pub mod workloads;

pub use context::{Context, MeasuredPeak, PeakQuery, PeakReader, PodRef, PromThenSidecar};
pub use observe::{classify_failure, classify_pods, reported_tokens_per_sec};
pub use record::run_record;

use context::key;
use decide::Next;
use observe::Observed;

/// Annotation (TrainingJob) or label (Namespace) that sets the mode.
pub use super::keys::MODE_KEY;
/// Field manager name for status patches.
pub const MANAGER: &str = "gpufit-controller";
/// How often the peak of a finished attempt is looked up before giving up
/// (the run stays recorded with peak unknown).
pub const MAX_PEAK_LOOKUPS: u32 = 5;

/// Default [`Context::peak_retry`]: 30 s, then 60, 120, 240 — a peak that
/// reaches Prometheus within about 7 minutes of the Job's end is filled in.
pub const PEAK_RETRY: Duration = Duration::from_secs(30);

// === Entry points ===

/// Reconciles one TrainingJob (the `Controller::run` reconciler).
pub async fn reconcile(tj: Arc<TrainingJob>, ctx: Arc<Context>) -> Result<Action, ControllerError> {
    // A replica that lost the Lease writes nothing; the new leader's
    // controller lists every object afresh.
    if !ctx.is_leading() {
        return Ok(Action::await_change());
    }
    let _timer = ctx.metrics.reconcile_timer();
    let r = reconcile_inner(&tj, &ctx).await;
    match &r {
        Ok(_) => {
            ctx.metrics.reconciles.with_label_values(&["ok"]).inc();
            ctx.reset_failures(&key(&tj));
        }
        Err(e) => ctx.metrics.record_error(e),
    }
    r
}

/// Bounded retry with backoff; never a crash.
pub fn error_policy(tj: Arc<TrainingJob>, err: &ControllerError, ctx: Arc<Context>) -> Action {
    let wait = ctx.next_backoff(&key(&tj));
    tracing::warn!(trainingjob = %key(&tj), error = %err, retry_in = ?wait, "reconcile failed");
    Action::requeue(wait)
}

// === The driver ===

async fn reconcile_inner(tj: &TrainingJob, ctx: &Context) -> Result<Action, ControllerError> {
    if tj.metadata.deletion_timestamp.is_some() {
        // The Jobs are owned: Kubernetes' garbage collector removes them.
        return Ok(Action::await_change());
    }
    let ns = tj
        .namespace()
        .ok_or_else(|| ControllerError::Invalid("TrainingJob without a namespace".into()))?;
    let tjs: Api<TrainingJob> = Api::namespaced(ctx.client.clone(), &ns);
    let generation = tj.metadata.generation;
    let old = tj.status.clone().unwrap_or_default();
    let mut st = old.clone();
    st.observed_generation = generation;

    // 1. observe: the spec, then the in-flight attempt.
    let v = match observe::validated(tj, ctx) {
        Ok(v) => v,
        Err(e) => return Ok(status::invalid_spec(ctx, tj, &tjs, &old, st, &e).await?),
    };
    status::mark_valid(&mut st, &v, generation);
    let (mut requeue, just_finished) = match observe::in_flight(ctx, tj, &ns, &mut st).await? {
        // A stale cached copy (see `Observed::Stale`): look again shortly.
        Observed::Stale => return Ok(Action::requeue(Duration::from_secs(1))),
        Observed::Seen {
            requeue,
            just_finished,
        } => (requeue, just_finished),
    };
    // 2. record every finished attempt; 3. peaks still unknown.
    let recorded = record::record_runs(ctx, &ns, &v, &mut st).await;
    status::history_condition(&mut st, &recorded, generation);
    if let Some(next) = peaks::fill_pending(ctx, &ns, &mut st, just_finished).await {
        requeue = Some(requeue.map_or(next, |r| r.min(next)));
    }
    // 4. decide; 5. start an attempt, or settle the phase.
    let mut create_error = None;
    match decide::decide(&st, &v, generation) {
        Next::Wait => {}
        Next::Settle(phase, reason, msg) => {
            status::settle(ctx, tj, &mut st, (phase, reason, msg)).await
        }
        Next::Start => match start::start_attempt(ctx, tj, &ns, &v, &mut st, generation).await {
            Ok(()) => requeue = Some(Duration::from_secs(300)),
            Err(e) => create_error = status::start_failed(ctx, tj, &mut st, e).await,
        },
    }
    // 6. write the status once; then report what must be retried.
    if st != old {
        status::patch_status(&tjs, &tj.name_any(), &st).await?;
    }
    recorded?;
    if let Some(e) = create_error {
        return Err(e);
    }
    Ok(status::next_action(requeue, &st))
}
