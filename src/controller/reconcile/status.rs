//! Step 6, update status: conditions, phase and Events for what the other
//! steps found, and the one merge patch that writes it.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::ResourceExt;
use serde_json::json;

use crate::controller::crd::{Phase, TrainingJob, TrainingJobStatus};
use crate::controller::validate::{Validated, ValidationError};
use crate::controller::ControllerError;

use super::context::Context;
use super::record::RecordError;
use super::start::StartError;

/// The status could not be written.
#[derive(Debug, thiserror::Error)]
pub(super) enum StatusError {
    #[error(transparent)]
    Kube(#[from] kube::Error),
}

impl From<StatusError> for ControllerError {
    fn from(e: StatusError) -> Self {
        match e {
            StatusError::Kube(k) => ControllerError::Kube(k),
        }
    }
}

/// An invalid spec: phase Invalid, the conditions, one Event (only when
/// something changed), then wait for a spec change instead of retrying.
pub(super) async fn invalid_spec(
    ctx: &Context,
    tj: &TrainingJob,
    api: &Api<TrainingJob>,
    old: &TrainingJobStatus,
    mut st: TrainingJobStatus,
    e: &ValidationError,
) -> Result<Action, StatusError> {
    let generation = tj.metadata.generation;
    st.phase = Some(Phase::Invalid);
    set_condition(
        &mut st,
        "Invalid",
        true,
        "InvalidSpec",
        &e.to_string(),
        generation,
    );
    set_condition(
        &mut st,
        "Ready",
        false,
        "InvalidSpec",
        &e.to_string(),
        generation,
    );
    if st != *old {
        patch_status(api, &tj.name_any(), &st).await?;
        ctx.event(tj, EventType::Warning, "InvalidSpec", e.to_string())
            .await;
    }
    Ok(Action::await_change())
}

/// A valid spec clears a standing Invalid condition and sets the mode.
pub(super) fn mark_valid(st: &mut TrainingJobStatus, v: &Validated, generation: Option<i64>) {
    if has_condition(st, "Invalid") {
        set_condition(
            st,
            "Invalid",
            false,
            "Valid",
            "the spec is valid",
            generation,
        );
    }
    st.mode = Some(v.mode);
}

/// The HistoryUnavailable condition after recording.
pub(super) fn history_condition(
    st: &mut TrainingJobStatus,
    recorded: &Result<(), RecordError>,
    generation: Option<i64>,
) {
    match recorded {
        Ok(()) => {
            if has_condition(st, "HistoryUnavailable") {
                set_condition(
                    st,
                    "HistoryUnavailable",
                    false,
                    "Recorded",
                    "every run is recorded",
                    generation,
                );
            }
        }
        Err(e) => set_condition(
            st,
            "HistoryUnavailable",
            true,
            "HistoryStoreError",
            &format!("{e}; the run is kept in status and recorded when the store is back"),
            generation,
        ),
    }
}

/// No attempt to start: the final (or waiting) phase, with an Event when
/// the phase changes.
pub(super) async fn settle(
    ctx: &Context,
    tj: &TrainingJob,
    st: &mut TrainingJobStatus,
    (phase, reason, message): (Phase, &'static str, String),
) {
    let generation = tj.metadata.generation;
    if st.phase != Some(phase) {
        let ty = if phase == Phase::Succeeded {
            EventType::Normal
        } else {
            EventType::Warning
        };
        ctx.event(tj, ty, reason, message.clone()).await;
    }
    st.phase = Some(phase);
    set_condition(
        st,
        "Ready",
        phase == Phase::Succeeded,
        reason,
        &message,
        generation,
    );
}

/// An attempt that could not start: Invalid (nothing fits, or the spec
/// contradicts itself) or a transient failure, returned to be retried
/// with backoff once the status is written.
pub(super) async fn start_failed(
    ctx: &Context,
    tj: &TrainingJob,
    st: &mut TrainingJobStatus,
    e: StartError,
) -> Option<ControllerError> {
    let generation = tj.metadata.generation;
    match e {
        StartError::Invalid(msg) => {
            st.phase = Some(Phase::Invalid);
            set_condition(st, "Invalid", true, "DoesNotFit", &msg, generation);
            set_condition(st, "Ready", false, "DoesNotFit", &msg, generation);
            ctx.event(tj, EventType::Warning, "DoesNotFit", msg).await;
            None
        }
        StartError::InvalidSpec(msg) => {
            st.phase = Some(Phase::Invalid);
            set_condition(st, "Invalid", true, "InvalidSpec", &msg, generation);
            set_condition(st, "Ready", false, "InvalidSpec", &msg, generation);
            ctx.event(tj, EventType::Warning, "InvalidSpec", msg).await;
            None
        }
        StartError::Retry(reason, e) => {
            set_condition(st, "Ready", false, reason, &e.to_string(), generation);
            if st.phase.is_none() {
                st.phase = Some(Phase::Pending);
            }
            ctx.event(tj, EventType::Warning, reason, e.to_string())
                .await;
            Some(e)
        }
    }
}

/// When to look again: the earliest requeue a step asked for; else wait
/// for a change once the phase is final, else every 5 minutes.
pub(super) fn next_action(requeue: Option<Duration>, st: &TrainingJobStatus) -> Action {
    match requeue {
        Some(d) => Action::requeue(d),
        None if st.phase.is_some_and(Phase::is_final) => Action::await_change(),
        None => Action::requeue(Duration::from_secs(300)),
    }
}

/// Writes the status with one merge patch.
pub(super) async fn patch_status(
    api: &Api<TrainingJob>,
    name: &str,
    st: &TrainingJobStatus,
) -> Result<(), StatusError> {
    let patch = json!({ "status": st });
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

pub(super) fn has_condition(st: &TrainingJobStatus, type_: &str) -> bool {
    st.conditions
        .iter()
        .any(|c| c.type_ == type_ && c.status == "True")
}

/// Sets a condition, keeping `lastTransitionTime` when the status is unchanged.
pub(super) fn set_condition(
    st: &mut TrainingJobStatus,
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
) {
    let status = if status { "True" } else { "False" }.to_string();
    let message = truncate(message, 1000);
    if let Some(c) = st.conditions.iter_mut().find(|c| c.type_ == type_) {
        if c.status != status {
            c.last_transition_time = Time(Timestamp::now());
        }
        c.status = status;
        c.reason = reason.to_string();
        c.message = message;
        c.observed_generation = generation;
        return;
    }
    st.conditions.push(Condition {
        type_: type_.to_string(),
        status,
        reason: reason.to_string(),
        message,
        observed_generation: generation,
        last_transition_time: Time(Timestamp::now()),
    });
}

pub(super) fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}
