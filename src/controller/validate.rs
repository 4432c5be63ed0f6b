//! Validate: a TrainingJob spec (or a webhook's annotations, turned into the
//! same spec types) → a checked workload, pins, strategy and mode. Pure: no
//! I/O, so every rule has a test over a YAML fixture.

use k8s_openapi::api::core::v1::PodTemplateSpec;

use crate::core::advisor::Strategy;
use crate::core::request::{ArchNumbers, ModelRequest, WorkloadRequest};
use crate::core::settings::Pins;
use crate::core::workload::{FieldNames, Workload, WorkloadError, WorkloadField};

use super::crd::{ArchitectureSpec, Mode, TrainingJobSpec, WorkloadSpec};
use crate::core::settings::SETTING_VARS;

/// Default number of out-of-memory retries.
pub const DEFAULT_OOM_RETRY_LIMIT: u32 = 2;

/// What is wrong with a spec; the message says which field and how to fix it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ValidationError {
    /// The spec path (`spec.workload.model`) or annotation that is wrong.
    pub field: String,
    /// What is wrong and what to do.
    pub message: String,
}

impl ValidationError {
    fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        ValidationError {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// A spec that passed validation.
#[derive(Debug, Clone, PartialEq)]
pub struct Validated {
    pub workload: Workload,
    pub pins: Pins,
    pub strategy: Strategy,
    pub mode: Mode,
    pub oom_retry_limit: u32,
    /// GPU model named in the spec (overrides node labels).
    pub gpu: Option<String>,
}

/// Validates a TrainingJob spec. `mode_default` is what the TrainingJob's
/// annotation or its namespace's label says when `spec.mode` is unset.
pub fn validate(
    spec: &TrainingJobSpec,
    mode_default: Option<Mode>,
) -> Result<Validated, ValidationError> {
    let workload = workload_from_spec(&spec.workload, "spec.workload")?;
    let pins: Pins = spec.pins.as_ref().map(Pins::from).unwrap_or_default();
    check_pins(&pins, &workload, "spec.pins")?;
    let mode = spec.mode.or(mode_default).unwrap_or_default();
    check_template(&spec.template, mode)?;
    if let Some(g) = &spec.gpu {
        if g.trim().is_empty() {
            return Err(ValidationError::new(
                "spec.gpu",
                "is empty: name the GPU model as nvidia-smi prints it, or leave it out",
            ));
        }
    }
    Ok(Validated {
        workload,
        pins,
        strategy: spec.strategy.unwrap_or(Strategy::Balanced),
        mode,
        oom_retry_limit: spec.oom_retry_limit.unwrap_or(DEFAULT_OOM_RETRY_LIMIT),
        gpu: spec.gpu.clone(),
    })
}

/// The spec as a workload request for the core's one resolver
/// (docs/design.md, "Workload resolution"), which checks the architecture
/// numbers as on every path. `at` prefixes field names.
pub fn request_from_spec(w: &WorkloadSpec, at: &str) -> Result<WorkloadRequest, ValidationError> {
    let model = ModelRequest::one_of(w.model.clone(), w.architecture.as_ref().map(numbers))
        .map_err(|e| resolve_error(&e, at))?;
    Ok(WorkloadRequest {
        model,
        method: w.method,
        lora_rank: w.lora_rank,
        lora_targets: w.lora_targets.clone(),
        seq_len: Some(w.seq_len),
        optimizer: w.optimizer,
        global_batch: w.global_batch,
        gpus: w.gpus,
        sharding: w.sharding,
        framework: w.framework,
        attention: w.attention,
    })
}

/// The workload part of a spec, resolved and checked; the error names the
/// spec field (`{at}.loraRank`).
pub fn workload_from_spec(w: &WorkloadSpec, at: &str) -> Result<Workload, ValidationError> {
    request_from_spec(w, at)?
        .resolve()
        .map_err(|e| resolve_error(&e, at))
}

fn resolve_error(e: &WorkloadError, at: &str) -> ValidationError {
    let (field, message) = e.parts(&SpecNames(at));
    ValidationError::new(field, message)
}

/// The CRD's names for the workload's fields: spec paths under a prefix
/// (`spec.workload.loraRank`, `spec.workload.architecture.kvHeads`).
pub struct SpecNames<'a>(pub &'a str);

impl FieldNames for SpecNames<'_> {
    fn name(&self, field: WorkloadField) -> String {
        let mut path = format!("{}.", self.0);
        let mut upper = false;
        for c in field.domain_name().chars() {
            if c == '_' {
                upper = true;
            } else {
                path.push(if upper { c.to_ascii_uppercase() } else { c });
                upper = false;
            }
        }
        path
    }
}

/// The CRD's `architecture` as the core's numbers (its required numbers
/// are plain integers there: 0 is what an unset one reads as).
fn numbers(a: &ArchitectureSpec) -> ArchNumbers {
    ArchNumbers {
        name: Some(a.name.clone()),
        params: Some(a.params),
        hidden_size: Some(a.hidden_size),
        layers: Some(a.layers),
        heads: Some(a.heads),
        kv_heads: a.kv_heads,
        intermediate_size: a.intermediate_size,
        vocab_size: Some(a.vocab_size),
        tied_embeddings: Some(a.tied_embeddings),
        max_seq_len: a.max_seq_len,
    }
}

/// Pins must be positive and agree with the global batch (m × a × W = G).
pub fn check_pins(pins: &Pins, w: &Workload, at: &str) -> Result<(), ValidationError> {
    if pins.micro_batch_size == Some(0) {
        return Err(ValidationError::new(
            format!("{at}.microBatchSize"),
            "must be at least 1",
        ));
    }
    if pins.gradient_accumulation_steps == Some(0) {
        return Err(ValidationError::new(
            format!("{at}.gradientAccumulationSteps"),
            "must be at least 1",
        ));
    }
    if let Some(g) = w.global_batch {
        let per_step = g / w.gpus.max(1);
        if let Some(m) = pins.micro_batch_size {
            if !per_step.is_multiple_of(m) {
                return Err(ValidationError::new(
                    format!("{at}.microBatchSize"),
                    format!(
                        "{m} does not divide the {per_step} samples per GPU of global batch {g} on {} GPUs: pin a divisor or drop the pin",
                        w.gpus
                    ),
                ));
            }
        }
        if let Some(a) = pins.gradient_accumulation_steps {
            if !per_step.is_multiple_of(a) {
                return Err(ValidationError::new(
                    format!("{at}.gradientAccumulationSteps"),
                    format!(
                        "{a} does not divide the {per_step} samples per GPU of global batch {g}"
                    ),
                ));
            }
            if let Some(m) = pins.micro_batch_size {
                if m * a != per_step {
                    return Err(ValidationError::new(
                        format!("{at}.gradientAccumulationSteps"),
                        format!(
                            "micro batch {m} × accumulation {a} × {} GPUs = {} contradicts global batch {g}: pin one of them",
                            w.gpus,
                            m * a * w.gpus
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// The pod template must have a container, a restart policy a Job accepts,
/// and, in Recommend mode, no placeholders (nothing would fill them).
fn check_template(t: &PodTemplateSpec, mode: Mode) -> Result<(), ValidationError> {
    let Some(pod) = &t.spec else {
        return Err(ValidationError::new(
            "spec.template.spec",
            "missing: give the pod spec with the training container",
        ));
    };
    if pod.containers.is_empty() {
        return Err(ValidationError::new(
            "spec.template.spec.containers",
            "is empty: give the training container",
        ));
    }
    if let Some(rp) = &pod.restart_policy {
        if rp != "Never" && rp != "OnFailure" {
            return Err(ValidationError::new(
                "spec.template.spec.restartPolicy",
                format!("`{rp}` is not allowed in a Job: use Never (recommended) or OnFailure"),
            ));
        }
    }
    if mode == Mode::Recommend {
        for c in &pod.containers {
            let words = c.command.iter().flatten().chain(c.args.iter().flatten());
            for w in words {
                if let Some(p) = SETTING_VARS
                    .iter()
                    .map(|v| v.placeholder_text())
                    .find(|p| w.contains(p))
                {
                    return Err(ValidationError::new(
                        format!("spec.template.spec.containers[{}].args", c.name),
                        format!("contains {p}, which Recommend mode leaves unfilled: use mode Inject or write the value"),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Parses a mode from an annotation or label value.
pub fn parse_mode(v: &str, field: &str) -> Result<Mode, ValidationError> {
    v.parse()
        .map_err(|e: String| ValidationError::new(field, e))
}
