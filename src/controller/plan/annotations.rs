//! The input annotations (the table in `super::super::webhook`): which are
//! ours, and what they say. Pure: strings in, a workload spec or a denial out.

use std::collections::BTreeMap;

use std::str::FromStr;

use crate::core::advisor::Strategy;
use crate::core::request::{ArchNumbers, ModelRequest, WorkloadRequest};
use crate::core::settings::Pins;
use crate::core::workload::{
    Attention, FieldNames, Framework, LoraTarget, Method, Optimizer, Sharding, Workload,
    WorkloadError, WorkloadField,
};

use super::super::crd::Mode;
use super::super::keys::{ANN_APPLIED, ANN_REASON, ANN_RECOMMENDATION};

/// The input annotations, without the `gpufit.io/` prefix.
pub(crate) use super::super::keys::INPUT_KEYS;

/// A bad annotation: denied with this message.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Denied(pub(crate) String);

pub(crate) fn denied(key: &str, msg: impl std::fmt::Display) -> Denied {
    Denied(format!("gpufit: annotation {key}: {msg}"))
}

/// The annotations' names for the workload's fields: `gpufit.io/seq-len`;
/// a number of `gpufit.io/architecture` by its key there.
pub struct AnnotationNames;

impl FieldNames for AnnotationNames {
    fn name(&self, field: WorkloadField) -> String {
        match field.domain_name().strip_prefix("architecture.") {
            Some(key) => format!("gpufit.io/architecture: {key}"),
            None => format!("gpufit.io/{}", field.domain_name().replace('_', "-")),
        }
    }
}

/// A workload the core refused, denied naming the annotation at fault.
pub(crate) fn denied_workload(e: &WorkloadError) -> Denied {
    Denied(format!("gpufit: {}", e.render(&AnnotationNames)))
}

/// The `gpufit.io/` input annotations (prefix removed), or None when the
/// object does not opt in or was already handled (a reinvocation, or a Job
/// the reconciler created). Unknown keys and inputs without a model are
/// refused: a typo must not silently turn gpufit off.
pub(crate) fn input_annotations(
    anns: &BTreeMap<String, String>,
) -> Result<Option<BTreeMap<&str, &str>>, Denied> {
    let ours: BTreeMap<&str, &str> = anns
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("gpufit.io/").map(|k| (k, v.as_str())))
        .collect();
    // Already handled (reinvocation, or a Job the reconciler created).
    if ours.contains_key(ANN_APPLIED.trim_start_matches("gpufit.io/"))
        || ours.contains_key(ANN_RECOMMENDATION.trim_start_matches("gpufit.io/"))
    {
        return Ok(None);
    }
    let inputs: BTreeMap<&str, &str> = ours
        .iter()
        .filter(|(k, _)| **k != ANN_REASON.trim_start_matches("gpufit.io/"))
        .map(|(k, v)| (*k, *v))
        .collect();
    if inputs.is_empty() {
        return Ok(None);
    }
    for k in inputs.keys() {
        if !INPUT_KEYS.contains(k) {
            return Err(denied(
                &format!("gpufit.io/{k}"),
                format!(
                    "unknown; known annotations are {}",
                    INPUT_KEYS.map(|k| format!("gpufit.io/{k}")).join(", ")
                ),
            ));
        }
    }
    if !inputs.contains_key("model") && !inputs.contains_key("architecture") {
        return Err(denied(
            "gpufit.io/model",
            "missing: other gpufit.io annotations are set, so name the model (e.g. meta-llama/Llama-3.1-8B, or its numbers in gpufit.io/architecture) to opt in, or remove them",
        ));
    }

    Ok(Some(inputs))
}

/// What the annotations say: workload request, strategy, mode, pins, GPU name.
pub(crate) type Parsed = (
    WorkloadRequest,
    Strategy,
    Option<Mode>,
    Pins,
    Option<String>,
);

/// Reads the input annotations (keys without the `gpufit.io/` prefix) into
/// a workload request (resolved by the core's one resolver, like every
/// other path), strategy, mode, pins and GPU name. Every value is parsed by
/// its type's `FromStr`: the aliases the command line and the Slurm hooks
/// accept. `default_gpus` is the object's own GPU count, used when
/// `gpufit.io/gpus` is not given.
pub(crate) fn parse_annotations(
    a: &BTreeMap<&str, &str>,
    default_gpus: u32,
) -> Result<Parsed, Denied> {
    fn parsed<T: FromStr>(a: &BTreeMap<&str, &str>, key: &str) -> Result<Option<T>, Denied>
    where
        T::Err: std::fmt::Display,
    {
        a.get(key)
            .map(|v| {
                v.trim()
                    .parse::<T>()
                    .map_err(|e| denied(&format!("gpufit.io/{key}"), e))
            })
            .transpose()
    }
    fn num(a: &BTreeMap<&str, &str>, key: &str) -> Result<Option<u32>, Denied> {
        a.get(key)
            .map(|v| {
                v.trim().parse::<u32>().map_err(|_| {
                    denied(
                        &format!("gpufit.io/{key}"),
                        format!("`{v}` is not a whole number"),
                    )
                })
            })
            .transpose()
    }
    let lora_targets = a
        .get("lora-targets")
        .map(|v| LoraTarget::parse_list(v).map_err(|e| denied("gpufit.io/lora-targets", e)))
        .transpose()?;
    let architecture = a
        .get("architecture")
        .map(|v| parse_architecture(v))
        .transpose()?;
    let model = ModelRequest::one_of(a.get("model").map(|s| s.trim().to_string()), architecture)
        .map_err(|e| denied_workload(&e))?;
    let request = WorkloadRequest {
        model,
        method: parsed::<Method>(a, "method")?,
        lora_rank: num(a, "lora-rank")?,
        lora_targets,
        seq_len: num(a, "seq-len")?,
        optimizer: parsed::<Optimizer>(a, "optimizer")?,
        global_batch: num(a, "global-batch")?,
        gpus: Some(num(a, "gpus")?.unwrap_or(default_gpus)),
        sharding: parsed::<Sharding>(a, "sharding")?,
        framework: parsed::<Framework>(a, "framework")?,
        attention: parsed::<Attention>(a, "attention")?,
    };
    let strategy = parsed::<Strategy>(a, "strategy")?.unwrap_or(Strategy::Balanced);
    let mode = parsed::<Mode>(a, "mode")?;
    let pins = match a.get("pins") {
        Some(v) => parse_pins(v)?,
        None => Pins::default(),
    };
    let gpu = a.get("gpu").map(|s| s.trim().to_string());
    if gpu.as_deref() == Some("") {
        return Err(denied("gpufit.io/gpu", "is empty"));
    }
    Ok((request, strategy, mode, pins, gpu))
}

/// The workload the annotations describe, resolved by the core's one
/// resolver; a denial names the annotation at fault.
pub fn workload_from_annotations(
    annotations: &BTreeMap<String, String>,
    default_gpus: u32,
) -> Result<Option<Workload>, String> {
    let Some(inputs) = input_annotations(annotations).map_err(|d| d.0)? else {
        return Ok(None);
    };
    let (request, ..) = parse_annotations(&inputs, default_gpus).map_err(|d| d.0)?;
    request
        .resolve()
        .map(Some)
        .map_err(|e| denied_workload(&e).0)
}

/// `name=tiny-gpt,params=124000000,hidden_size=768,layers=12,heads=12,vocab_size=50257`
/// (and `kv_heads`, `intermediate_size`, `tied_embeddings`, `max_seq_len`):
/// the model by its numbers, the keys of a JSON request's `architecture`.
/// Only the syntax is read here; the core's resolver checks the numbers.
pub(crate) fn parse_architecture(s: &str) -> Result<ArchNumbers, Denied> {
    let key = "gpufit.io/architecture";
    let mut n = ArchNumbers::default();
    for (k, v) in key_values(key, s)? {
        match k {
            "name" => n.name = Some(v.to_string()),
            "params" => n.params = Some(whole(key, k, v)?),
            "hidden_size" => n.hidden_size = Some(whole(key, k, v)?),
            "layers" => n.layers = Some(whole(key, k, v)?),
            "heads" => n.heads = Some(whole(key, k, v)?),
            "kv_heads" => n.kv_heads = Some(whole(key, k, v)?),
            "intermediate_size" => n.intermediate_size = Some(whole(key, k, v)?),
            "vocab_size" => n.vocab_size = Some(whole(key, k, v)?),
            "max_seq_len" => n.max_seq_len = Some(whole(key, k, v)?),
            "tied_embeddings" => n.tied_embeddings = Some(boolean(key, k, v)?),
            other => {
                return Err(denied(
                    key,
                    format!("`{other}` is not an architecture number: use name, params, hidden_size, layers, heads, kv_heads, intermediate_size, vocab_size, tied_embeddings or max_seq_len"),
                ))
            }
        }
    }
    Ok(n)
}

/// `micro_batch_size=4,dtype=bf16,activation_checkpointing=true,…`: the
/// core's one pin parser ([`crate::core::settings::parse_pins`]).
pub(crate) fn parse_pins(s: &str) -> Result<Pins, Denied> {
    let key = "gpufit.io/pins";
    crate::core::settings::parse_pins(key_values(key, s)?).map_err(|e| denied(key, e.to_string()))
}

/// The `name=value` pairs of a comma list (annotation `key`); a name given
/// twice is denied (which one was meant is unknown).
fn key_values<'a>(key: &str, s: &'a str) -> Result<Vec<(&'a str, &'a str)>, Denied> {
    let pairs: Vec<(&str, &str)> = s
        .split(',')
        .map(str::trim)
        .filter(|i| !i.is_empty())
        .map(|item| {
            item.split_once('=')
                .map(|(k, v)| (k.trim(), v.trim()))
                .ok_or_else(|| denied(key, format!("`{item}` is not name=value")))
        })
        .collect::<Result<_, _>>()?;
    for (i, (k, _)) in pairs.iter().enumerate() {
        if pairs[..i].iter().any(|(seen, _)| seen == k) {
            return Err(denied(key, format!("`{k}` is given twice")));
        }
    }
    Ok(pairs)
}

/// A whole number `v` of pair `k` in annotation `key`.
fn whole<T: FromStr>(key: &str, k: &str, v: &str) -> Result<T, Denied> {
    v.parse()
        .map_err(|_| denied(key, format!("{k}: `{v}` is not a whole number")))
}

/// A switch `v` of pair `k` in annotation `key`.
fn boolean(key: &str, k: &str, v: &str) -> Result<bool, Denied> {
    crate::core::settings::parse_switch(v).map_err(|e| denied(key, format!("{k}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_annotation_parses_every_engineering_field_and_rejects_others() {
        let p = parse_pins("micro_batch_size=2, dtype=bf16, activation_checkpointing=on, compile=false, num_workers=8")
            .expect("valid pins");
        assert_eq!(p.micro_batch_size, Some(2));
        assert_eq!(p.activation_checkpointing, Some(true));
        assert_eq!(p.compile, Some(false));
        assert_eq!(p.num_workers, Some(8));
        let e = parse_pins("learning_rate=3e-4").expect_err("scientific field");
        assert!(e.0.contains("not an engineering setting"), "{}", e.0);
        assert!(parse_pins("micro_batch_size").is_err());
        let e = parse_pins("micro_batch_size=2,micro_batch_size=8").expect_err("duplicate");
        assert!(
            e.0.contains("gpufit.io/pins") && e.0.contains("given twice"),
            "{}",
            e.0
        );
    }

    #[test]
    fn only_our_input_annotations_opt_in() {
        let anns = |kv: &[(&str, &str)]| -> BTreeMap<String, String> {
            kv.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let none = anns(&[("other.io/x", "1")]);
        assert_eq!(input_annotations(&none), Ok(None));
        let done = anns(&[("gpufit.io/model", "m"), (ANN_APPLIED, "{}")]);
        assert_eq!(input_annotations(&done), Ok(None));
        let typo = anns(&[("gpufit.io/modle", "m")]);
        assert!(input_annotations(&typo).is_err());
        let no_model = anns(&[("gpufit.io/seq-len", "2048")]);
        assert!(input_annotations(&no_model).is_err());
        let ok = anns(&[("gpufit.io/model", "m"), ("gpufit.io/seq-len", "2048")]);
        assert_eq!(input_annotations(&ok).unwrap().unwrap().len(), 2);
    }
}
