//! Which settings a run really ran, and how sure gpufit is of it.
//!
//! gpufit injects settings, but a script may ignore them (a hard-coded
//! `--per_device_train_batch_size 8`, a YAML the job reads instead). A run is
//! evidence only for the settings it ran, so every recorder passes what it
//! knows through [`confirm`]:
//! - the job's own result record (the Python package's callbacks and
//!   `gpufit.track`, [`crate::result_record`]) — the strongest word;
//! - else what the framework printed ([`crate::logs::stated`]: the HF
//!   Trainer's training block, torchtune's config echo, Lightning's AMP line)
//!   when it names the micro batch;
//! - else filled placeholders: gpufit wrote the value into the command line
//!   itself (`{micro_batch_size}` in the args, or `find-max-batch`'s command
//!   template), so the job runs it;
//! - else nothing confirms the settings: the run is stored as
//!   [`Confirmation::Unconfirmed`], and the learner uses its peak only as a
//!   floor (never to extrapolate) and its success never as proof that the
//!   injected micro batch fits ([`crate::run::RunRecord::settings_unconfirmed`]).
//!
//! Settings a job states that differ from the injected ones replace them in
//! the record, which is marked [`Confirmation::RanOther`].

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::result_record::StatedSettings;
use crate::settings::EngineeringSettings;

/// The environment variable gpufit adds to a container whose command line
/// it wrote the micro batch into (a `{micro_batch_size}` placeholder): the
/// recorder reads it from the pod to know the job ran the injected batch.
pub const MICRO_BATCH_IN_COMMAND_ENV: &str = "GPUFIT_MICRO_BATCH_IN_COMMAND";

/// How a run's recorded settings are known.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Confirmation {
    /// The job ran the recorded settings: it said so, gpufit filled them
    /// into its command line, or a person recorded what ran (`gpufit
    /// record`, an imported run log). The default: every record written
    /// before gpufit tracked confirmation came from a path that states
    /// what ran, except the controller's, which cannot be told apart now.
    #[default]
    Confirmed,
    /// The job stated other settings than gpufit injected; the record holds
    /// what it ran.
    RanOther,
    /// Nothing confirms that the job ran the injected settings.
    Unconfirmed,
}

impl Confirmation {
    /// The wire / database spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Confirmation::Confirmed => "confirmed",
            Confirmation::RanOther => "ran_other",
            Confirmation::Unconfirmed => "unconfirmed",
        }
    }

    /// Whether this is the default ([`Confirmation::Confirmed`]), which
    /// JSON leaves out.
    pub fn is_default(&self) -> bool {
        *self == Confirmation::Confirmed
    }

    /// Whether the recorded settings are the ones the job ran.
    pub fn is_confirmed(self) -> bool {
        self != Confirmation::Unconfirmed
    }
}

impl std::str::FromStr for Confirmation {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "confirmed" => Ok(Confirmation::Confirmed),
            "ran_other" => Ok(Confirmation::RanOther),
            "unconfirmed" => Ok(Confirmation::Unconfirmed),
            other => Err(format!(
                "unknown settings confirmation `{other}`: use confirmed, ran_other or unconfirmed"
            )),
        }
    }
}

/// What a recorder knows about the settings a finished job ran.
#[derive(Debug, Clone, Default)]
pub struct Evidence<'a> {
    /// The job's own result record's `ran` settings.
    pub record: Option<&'a StatedSettings>,
    /// Settings its log or termination message stated.
    pub stated: Option<&'a StatedSettings>,
    /// gpufit substituted the micro batch into the job's command line.
    pub placeholders_filled: bool,
}

/// The settings to record, how they are known, and what differed from the
/// injected ones (`(field, injected, ran)`).
#[derive(Debug, Clone, PartialEq)]
pub struct Confirmed {
    pub settings: EngineeringSettings,
    pub confirmation: Confirmation,
    pub differences: Vec<(&'static str, String, String)>,
}

/// The settings a run ran, from the settings gpufit injected and the
/// evidence: the job's record wins over its log, its log over the injected
/// settings. Only a statement that names the micro batch (or filled
/// placeholders) confirms; a statement of other fields alone still replaces
/// those fields.
pub fn confirm(injected: &EngineeringSettings, ev: &Evidence<'_>) -> Confirmed {
    let mut settings = injected.clone();
    let mut confirmed_by_statement = false;
    // The log first, then the record over it: the record is the job's own
    // account and wins where both speak.
    for stated in [ev.stated, ev.record].into_iter().flatten() {
        overlay(&mut settings, stated);
        confirmed_by_statement |= stated.micro_batch_size.is_some();
    }
    let differences = diff(injected, &settings);
    let confirmation = if !differences.is_empty() && confirmed_by_statement {
        Confirmation::RanOther
    } else if confirmed_by_statement || ev.placeholders_filled {
        Confirmation::Confirmed
    } else {
        Confirmation::Unconfirmed
    };
    Confirmed {
        settings,
        confirmation,
        differences,
    }
}

/// `s` with every field `st` states replaced (a 0 batch or accumulation is
/// no statement).
pub fn overlay(s: &mut EngineeringSettings, st: &StatedSettings) {
    if let Some(m) = st.micro_batch_size.filter(|&m| m > 0) {
        s.micro_batch_size = m;
    }
    if let Some(a) = st.gradient_accumulation_steps.filter(|&a| a > 0) {
        s.gradient_accumulation_steps = a;
    }
    if let Some(d) = st.dtype {
        s.dtype = d;
    }
    if let Some(c) = st.activation_checkpointing {
        s.activation_checkpointing = c;
    }
    if let Some(o) = st.activation_offloading {
        s.activation_offloading = o;
    }
    if let Some(c) = st.compile {
        s.compile = c;
    }
    if let Some(w) = st.num_workers {
        s.dataloader.num_workers = w;
    }
}

fn diff(a: &EngineeringSettings, b: &EngineeringSettings) -> Vec<(&'static str, String, String)> {
    StatedSettings::from(a).differences(&StatedSettings::from(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::Dtype;

    fn injected(m: u32) -> EngineeringSettings {
        EngineeringSettings {
            micro_batch_size: m,
            gradient_accumulation_steps: 8,
            ..EngineeringSettings::default()
        }
    }

    fn ran(m: u32) -> StatedSettings {
        StatedSettings {
            micro_batch_size: Some(m),
            ..StatedSettings::default()
        }
    }

    #[test]
    fn a_job_that_ran_another_micro_batch_is_recorded_with_what_it_ran_and_marked() {
        let c = confirm(
            &injected(4),
            &Evidence {
                record: Some(&ran(8)),
                ..Evidence::default()
            },
        );
        assert_eq!(c.settings.micro_batch_size, 8);
        assert_eq!(
            c.settings.gradient_accumulation_steps, 8,
            "unstated fields kept"
        );
        assert_eq!(c.confirmation, Confirmation::RanOther);
        assert_eq!(
            c.differences,
            vec![("micro_batch_size", "4".to_string(), "8".to_string())]
        );
    }

    #[test]
    fn the_jobs_record_wins_over_its_log_and_agreement_confirms() {
        let log = StatedSettings {
            micro_batch_size: Some(2),
            dtype: Some(Dtype::Fp16Mixed),
            ..StatedSettings::default()
        };
        let c = confirm(
            &injected(4),
            &Evidence {
                record: Some(&ran(4)),
                stated: Some(&log),
                placeholders_filled: false,
            },
        );
        assert_eq!(c.settings.micro_batch_size, 4);
        assert_eq!(
            c.settings.dtype,
            Dtype::Fp16Mixed,
            "the log's dtype, unstated by the record"
        );
        assert_eq!(c.confirmation, Confirmation::RanOther);
        let same = confirm(
            &injected(4),
            &Evidence {
                record: Some(&ran(4)),
                ..Evidence::default()
            },
        );
        assert_eq!(same.confirmation, Confirmation::Confirmed);
        assert!(same.differences.is_empty());
    }

    #[test]
    fn without_a_statement_only_filled_placeholders_confirm() {
        let none = confirm(&injected(4), &Evidence::default());
        assert_eq!(none.confirmation, Confirmation::Unconfirmed);
        assert_eq!(none.settings, injected(4));
        let filled = confirm(
            &injected(4),
            &Evidence {
                placeholders_filled: true,
                ..Evidence::default()
            },
        );
        assert_eq!(filled.confirmation, Confirmation::Confirmed);
        // A precision line alone does not confirm the micro batch.
        let amp = StatedSettings {
            dtype: Some(Dtype::Bf16Mixed),
            ..StatedSettings::default()
        };
        let c = confirm(
            &injected(4),
            &Evidence {
                stated: Some(&amp),
                ..Evidence::default()
            },
        );
        assert_eq!(c.confirmation, Confirmation::Unconfirmed);
        assert_eq!(c.settings.dtype, Dtype::Bf16Mixed);
    }

    #[test]
    fn the_spelling_round_trips() {
        for c in [
            Confirmation::Confirmed,
            Confirmation::RanOther,
            Confirmation::Unconfirmed,
        ] {
            assert_eq!(c.as_str().parse::<Confirmation>(), Ok(c));
            assert_eq!(
                serde_json::to_value(c).unwrap(),
                serde_json::json!(c.as_str())
            );
        }
        assert!("maybe".parse::<Confirmation>().is_err());
    }
}
