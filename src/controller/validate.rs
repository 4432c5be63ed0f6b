//! Validate: a TrainingJob spec (or a webhook's annotations, turned into the
//! same spec types) → a checked workload, pins, strategy and mode. Pure: no
//! I/O, so every rule has a test over a YAML fixture.

use k8s_openapi::api::core::v1::PodTemplateSpec;

use crate::core::advisor::Strategy;
use crate::core::request::{ModelRequest, Naming, WorkloadRequest};
use crate::core::settings::Pins;
use crate::core::workload::{ArchKind, ModelArch, Workload};

use super::crd::{Mode, TrainingJobSpec, WorkloadSpec};
use super::inject::PLACEHOLDERS;

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
/// (docs/design.md, "Workload resolution"). `at` prefixes field names.
pub fn request_from_spec(w: &WorkloadSpec, at: &str) -> Result<WorkloadRequest, ValidationError> {
    let model = match (&w.model, &w.architecture) {
        (Some(_), Some(_)) => {
            return Err(ValidationError::new(
                format!("{at}.model"),
                "both `model` and `architecture` are set: give one of them",
            ))
        }
        (Some(name), None) => Some(ModelRequest::Catalog(name.clone())),
        (None, Some(a)) => Some(ModelRequest::Arch {
            arch: arch_from_numbers(a, at)?,
            implied_method: None,
        }),
        (None, None) => None,
    };
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
    request_from_spec(w, at)?.resolve().map_err(|e| {
        let (field, message) = e.parts(Naming::Spec(at));
        ValidationError::new(field, message)
    })
}

fn arch_from_numbers(
    a: &super::crd::ArchitectureSpec,
    at: &str,
) -> Result<ModelArch, ValidationError> {
    let field = |f: &str| format!("{at}.architecture.{f}");
    if a.name.trim().is_empty() {
        return Err(ValidationError::new(
            field("name"),
            "missing: name the model so similar runs can be found in the history",
        ));
    }
    for (name, v) in [
        ("params", a.params),
        ("hiddenSize", a.hidden_size as u64),
        ("layers", a.layers as u64),
        ("heads", a.heads as u64),
        ("vocabSize", a.vocab_size as u64),
    ] {
        if v == 0 {
            return Err(ValidationError::new(
                field(name),
                "must be a positive number",
            ));
        }
    }
    let kv = a.kv_heads.unwrap_or(a.heads);
    if kv == 0 || kv > a.heads || !a.heads.is_multiple_of(kv) {
        return Err(ValidationError::new(
            field("kvHeads"),
            format!(
                "{kv} key/value heads do not divide {} attention heads",
                a.heads
            ),
        ));
    }
    if !a.hidden_size.is_multiple_of(a.heads) {
        return Err(ValidationError::new(
            field("heads"),
            format!(
                "hidden size {} is not divisible by {} heads",
                a.hidden_size, a.heads
            ),
        ));
    }
    Ok(ModelArch {
        name: a.name.trim().to_string(),
        kind: ArchKind::DecoderOnly,
        params: a.params,
        hidden_size: a.hidden_size,
        num_layers: a.layers,
        num_attention_heads: a.heads,
        num_kv_heads: kv,
        head_dim: a.hidden_size / a.heads,
        // The GPT-style default of a 4× MLP when the config does not say.
        intermediate_size: a.intermediate_size.unwrap_or(4 * a.hidden_size),
        vocab_size: a.vocab_size,
        tied_embeddings: a.tied_embeddings,
        // A given intermediate size is taken to be a gated (SwiGLU) MLP, as in
        // every Llama-family config; without it, the plain GPT MLP.
        gated_mlp: a.intermediate_size.is_some(),
        num_experts: 1,
        experts_per_token: 1,
        max_position_embeddings: a.max_seq_len.unwrap_or(0),
        quirks: Default::default(),
    })
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
                if let Some(p) = PLACEHOLDERS
                    .iter()
                    .find(|p| w.contains(&format!("{{{p}}}")))
                {
                    return Err(ValidationError::new(
                        format!("spec.template.spec.containers[{}].args", c.name),
                        format!("contains {{{p}}}, which Recommend mode leaves unfilled: use mode Inject or write the value"),
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
