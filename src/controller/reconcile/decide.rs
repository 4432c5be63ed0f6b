//! Step 4, decide: what to do next, from the status and the spec alone.
//! Pure — no I/O — so every rule is tested here.

use crate::controller::crd::{AttemptOutcome, Mode, Phase, TrainingJobStatus};
use crate::controller::validate::Validated;

/// What the reconcile does after observing.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Next {
    /// An attempt is running: nothing to start.
    Wait,
    /// Start an attempt (the first, an OOM retry, or after a spec change).
    Start,
    /// No attempt to start: the phase, the condition reason and message.
    Settle(Phase, &'static str, String),
}

/// What to do next, from the attempts alone (pure).
pub(super) fn decide(st: &TrainingJobStatus, v: &Validated, generation: Option<i64>) -> Next {
    let Some(last) = st.attempts.last() else {
        return Next::Start;
    };
    if last.outcome == AttemptOutcome::Running {
        return Next::Wait;
    }
    // A spec change after the last attempt ended starts a new attempt.
    if last.generation != generation && st.phase != Some(Phase::Invalid) && generation.is_some() {
        return Next::Start;
    }
    if st.phase == Some(Phase::Invalid) {
        return Next::Start;
    }
    match last.outcome {
        AttemptOutcome::Succeeded => Next::Settle(
            Phase::Succeeded,
            "Succeeded",
            format!("Job {} completed", last.job_name),
        ),
        AttemptOutcome::Oom if last.mode == Some(Mode::Recommend) => Next::Settle(
            Phase::Failed,
            "OutOfMemory",
            format!(
                "Job {} ran out of GPU memory with its own settings (Recommend mode); gpufit recommended micro batch {}: apply it, or switch to mode Inject",
                last.job_name, last.settings.micro_batch_size
            ),
        ),
        AttemptOutcome::Oom => {
            let ooms = st
                .attempts
                .iter()
                .filter(|a| a.generation == generation && a.outcome == AttemptOutcome::Oom)
                .count() as u32;
            if ooms <= v.oom_retry_limit {
                Next::Start
            } else {
                Next::Settle(
                    Phase::Failed,
                    "OOMRetriesExhausted",
                    format!(
                        "{ooms} attempts ran out of GPU memory (limit {} retries): pin a smaller microBatchSize, turn on activationCheckpointing, or use more GPUs",
                        v.oom_retry_limit
                    ),
                )
            }
        }
        AttemptOutcome::Failed => Next::Settle(
            Phase::Failed,
            "JobFailed",
            last.message
                .clone()
                .unwrap_or_else(|| "the Job failed".into()),
        ),
        AttemptOutcome::Deleted => Next::Settle(
            Phase::Failed,
            "JobDeleted",
            format!(
                "Job {} was deleted before it finished; edit the TrainingJob to start again",
                last.job_name
            ),
        ),
        AttemptOutcome::Running => Next::Wait,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::crd::{Attempt, SettingsStatus};
    use crate::core::advisor::Strategy;
    use crate::core::request::{ModelRequest, WorkloadRequest};
    use crate::core::settings::Pins;

    fn validated(oom_retry_limit: u32) -> Validated {
        let workload = WorkloadRequest {
            model: Some(ModelRequest::Catalog("llama-3.1-8b".into())),
            seq_len: Some(2048),
            ..Default::default()
        }
        .resolve()
        .expect("a catalog workload");
        Validated {
            workload,
            pins: Pins::default(),
            strategy: Strategy::Balanced,
            mode: Mode::Inject,
            oom_retry_limit,
            gpu: None,
        }
    }

    fn attempt(index: u32, outcome: AttemptOutcome, generation: i64, mode: Mode) -> Attempt {
        Attempt {
            outcome,
            ..Attempt::started(
                index,
                format!("tj-{index}"),
                SettingsStatus {
                    micro_batch_size: 4,
                    ..Default::default()
                },
                Some(generation),
                mode,
            )
        }
    }

    fn status(attempts: Vec<Attempt>, phase: Option<Phase>) -> TrainingJobStatus {
        TrainingJobStatus {
            attempts,
            phase,
            ..Default::default()
        }
    }

    #[test]
    fn no_attempt_starts_one_and_a_running_one_waits() {
        let v = validated(2);
        assert_eq!(decide(&status(vec![], None), &v, Some(1)), Next::Start);
        let running = status(
            vec![attempt(1, AttemptOutcome::Running, 1, Mode::Inject)],
            None,
        );
        assert_eq!(decide(&running, &v, Some(1)), Next::Wait);
        // Even after a spec change: the running attempt finishes first.
        assert_eq!(decide(&running, &v, Some(2)), Next::Wait);
    }

    #[test]
    fn success_settles_and_a_spec_change_starts_again() {
        let v = validated(2);
        let done = status(
            vec![attempt(1, AttemptOutcome::Succeeded, 1, Mode::Inject)],
            Some(Phase::Succeeded),
        );
        assert!(matches!(
            decide(&done, &v, Some(1)),
            Next::Settle(Phase::Succeeded, "Succeeded", _)
        ));
        assert_eq!(decide(&done, &v, Some(2)), Next::Start);
    }

    #[test]
    fn ooms_are_retried_up_to_the_limit_of_this_generation() {
        let v = validated(2);
        let ooms = |n: u32, generation: i64| {
            (1..=n)
                .map(|i| attempt(i, AttemptOutcome::Oom, generation, Mode::Inject))
                .collect::<Vec<_>>()
        };
        assert_eq!(decide(&status(ooms(1, 1), None), &v, Some(1)), Next::Start);
        assert_eq!(decide(&status(ooms(2, 1), None), &v, Some(1)), Next::Start);
        match decide(&status(ooms(3, 1), None), &v, Some(1)) {
            Next::Settle(Phase::Failed, "OOMRetriesExhausted", msg) => {
                assert!(msg.contains("3 attempts"), "{msg}")
            }
            other => panic!("{other:?}"),
        }
        // OOMs of an older generation do not count against this one: the
        // spec changed, so a new attempt starts.
        assert_eq!(decide(&status(ooms(3, 1), None), &v, Some(2)), Next::Start);
    }

    #[test]
    fn an_oom_in_recommend_mode_is_not_retried() {
        let v = validated(2);
        let st = status(
            vec![attempt(1, AttemptOutcome::Oom, 1, Mode::Recommend)],
            None,
        );
        match decide(&st, &v, Some(1)) {
            Next::Settle(Phase::Failed, "OutOfMemory", msg) => {
                assert!(msg.contains("recommended micro batch 4"), "{msg}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn failures_and_deletions_settle_failed_and_invalid_starts_again() {
        let v = validated(2);
        let mut failed = attempt(1, AttemptOutcome::Failed, 1, Mode::Inject);
        failed.message = Some("exit code 1".into());
        assert_eq!(
            decide(&status(vec![failed], None), &v, Some(1)),
            Next::Settle(Phase::Failed, "JobFailed", "exit code 1".into())
        );
        let deleted = status(
            vec![attempt(1, AttemptOutcome::Deleted, 1, Mode::Inject)],
            None,
        );
        assert!(matches!(
            decide(&deleted, &v, Some(1)),
            Next::Settle(Phase::Failed, "JobDeleted", _)
        ));
        // An Invalid phase (nothing fitted) is tried again on each pass.
        let invalid = status(
            vec![attempt(1, AttemptOutcome::Succeeded, 1, Mode::Inject)],
            Some(Phase::Invalid),
        );
        assert_eq!(decide(&invalid, &v, Some(1)), Next::Start);
    }
}
