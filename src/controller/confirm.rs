//! What a finished workload's pods say about the settings they really ran
//! (`crate::core::confirm` decides with it): the job's result record in a
//! container's termination message (the Python package's callbacks and
//! `gpufit.track` write it to `/dev/termination-log`), else the settings its
//! termination message (or, with `FallbackToLogsOnError`, its log's tail)
//! states, and whether gpufit wrote the micro batch into its command line.

use k8s_openapi::api::core::v1::Pod;

use crate::core::confirm::{confirm, Confirmed, Evidence, MICRO_BATCH_IN_COMMAND_ENV};
use crate::core::result_record::{ResultRecord, StatedSettings};
use crate::core::settings::EngineeringSettings;

/// The evidence gathered from a workload's pods.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PodEvidence {
    /// The first valid result record found.
    pub record: Option<ResultRecord>,
    /// The first termination message that states settings.
    pub stated: Option<StatedSettings>,
    /// A container ran with the micro batch written into its command.
    pub placeholders_filled: bool,
}

impl PodEvidence {
    /// Reads every container's termination message (now and last state)
    /// and environment of `pods`.
    pub fn of(pods: &[Pod]) -> PodEvidence {
        let mut ev = PodEvidence::default();
        for p in pods {
            if let Some(spec) = &p.spec {
                ev.placeholders_filled |= spec.containers.iter().any(|c| {
                    c.env.iter().flatten().any(|e| {
                        e.name == MICRO_BATCH_IN_COMMAND_ENV && e.value.as_deref() == Some("true")
                    })
                });
            }
        }
        for msg in crate::controller::reconcile::terminated_states(pods)
            .filter_map(|t| t.message.as_deref())
        {
            ev.read_message(msg);
        }
        ev
    }

    /// One termination message: a whole result record, else a log whose
    /// lines state settings. A record that does not parse is ignored with a
    /// log line (a half-understood record must not teach the history).
    fn read_message(&mut self, msg: &str) {
        let t = msg.trim();
        if t.starts_with('{') && t.contains("\"schema_version\"") {
            match ResultRecord::parse(t) {
                Ok(r) => {
                    if self.record.is_none() {
                        self.record = Some(r);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "a termination message's result record is ignored")
                }
            }
            return;
        }
        if self.stated.is_none() {
            if let Ok(p) = crate::core::logs::parse_str(msg) {
                self.stated = p.stated;
            }
        }
    }

    /// The settings to record for a run gpufit injected `injected` into.
    pub fn confirm(&self, injected: &EngineeringSettings) -> Confirmed {
        confirm(
            injected,
            &Evidence {
                record: self.record.as_ref().map(|r| &r.ran),
                stated: self.stated.as_ref(),
                placeholders_filled: self.placeholders_filled,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::confirm::Confirmation;
    use serde_json::json;

    fn pod(env: serde_json::Value, message: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "train", "image": "x", "env": env}]},
            "status": {"containerStatuses": [{
                "name": "train", "image": "x", "imageID": "", "ready": false, "restartCount": 0,
                "state": {"terminated": {"exitCode": 0, "message": message}}
            }]}
        }))
        .expect("a pod")
    }

    fn injected() -> EngineeringSettings {
        EngineeringSettings {
            micro_batch_size: 4,
            gradient_accumulation_steps: 8,
            ..EngineeringSettings::default()
        }
    }

    #[test]
    fn a_result_record_that_ran_8_where_4_was_injected_is_recorded_at_8() {
        let record = json!({
            "schema_version": 1, "source": "hf", "world_size": 1,
            "injected": {"micro_batch_size": 4},
            "ran": {"micro_batch_size": 8, "gradient_accumulation_steps": 4},
            "peaks": [], "steps": 10, "outcome": "completed"
        })
        .to_string();
        let ev = PodEvidence::of(&[pod(json!([]), &record)]);
        let c = ev.confirm(&injected());
        assert_eq!(c.settings.micro_batch_size, 8);
        assert_eq!(c.settings.gradient_accumulation_steps, 4);
        assert_eq!(c.confirmation, Confirmation::RanOther);
    }

    #[test]
    fn a_log_tail_that_states_the_injected_batch_confirms_and_silence_does_not() {
        let log = "  Instantaneous batch size per device = 4\n  Gradient Accumulation steps = 8\n";
        let ev = PodEvidence::of(&[pod(json!([]), log)]);
        assert_eq!(
            ev.confirm(&injected()).confirmation,
            Confirmation::Confirmed
        );
        let silent = PodEvidence::of(&[pod(json!([]), "")]);
        assert_eq!(
            silent.confirm(&injected()).confirmation,
            Confirmation::Unconfirmed
        );
        let filled = PodEvidence::of(&[pod(
            json!([{"name": MICRO_BATCH_IN_COMMAND_ENV, "value": "true"}]),
            "",
        )]);
        assert_eq!(
            filled.confirm(&injected()).confirmation,
            Confirmation::Confirmed
        );
    }

    #[test]
    fn a_malformed_or_newer_record_is_ignored_not_trusted() {
        for bad in [
            r#"{"schema_version": 99, "ran": {"micro_batch_size": 64}}"#,
            r#"{"schema_version": 1, "ran": {"micro_batch_size": 0}}"#,
        ] {
            let ev = PodEvidence::of(&[pod(json!([]), bad)]);
            assert_eq!(ev.record, None, "{bad}");
            assert_eq!(ev.confirm(&injected()).settings.micro_batch_size, 4);
        }
    }
}
