//! The GPU a job will get, from the labels NVIDIA GPU Feature Discovery
//! puts on nodes (`nvidia.com/gpu.product`, `nvidia.com/gpu.memory`,
//! `nvidia.com/gpu.count`), restricted to the nodes the pod template's node
//! selector and required node affinity allow. Pure: nodes are handed in.

use k8s_openapi::api::core::v1::{Node, NodeSelectorRequirement, PodSpec};

use crate::core::catalog::{lookup_gpu, GpuSpec};
use crate::core::units::MIB;

/// GFD label with the product name, e.g. `NVIDIA-A100-SXM4-80GB`.
pub const LABEL_PRODUCT: &str = "nvidia.com/gpu.product";
/// GFD label with the memory per GPU in MiB, e.g. `81920`.
pub const LABEL_MEMORY: &str = "nvidia.com/gpu.memory";
/// GFD label with the number of GPUs on the node.
pub const LABEL_COUNT: &str = "nvidia.com/gpu.count";

/// Why the GPU could not be determined; the message says what to do.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GpuError {
    #[error("no node matching the pod template's node selector carries the `nvidia.com/gpu.product` label (is NVIDIA GPU Feature Discovery installed?): set spec.gpu to the GPU model")]
    NoGpuNodes,
    #[error("the matching nodes have different GPUs ({0}): narrow the node selector (e.g. nvidia.com/gpu.product) or set spec.gpu")]
    Mixed(String),
    #[error("GPU `{product}` is not in gpufit's catalog and its node has no usable nvidia.com/gpu.memory label: set spec.gpu to a catalog GPU (`gpufit gpus` lists them)")]
    Unknown { product: String },
    #[error("{0}")]
    Catalog(String),
}

/// Resolves a GPU by name (spec.gpu, webhook annotation): catalog lookup.
pub fn resolve_named(name: &str) -> Result<GpuSpec, GpuError> {
    lookup_gpu(name).map_err(|e| GpuError::Catalog(e.to_string()))
}

/// The GPU of the nodes that `pod` may be scheduled on.
pub fn resolve_from_nodes<'a>(
    nodes: impl IntoIterator<Item = &'a Node>,
    pod: Option<&PodSpec>,
) -> Result<GpuSpec, GpuError> {
    let mut found: Vec<(String, Option<u64>)> = Vec::new();
    for n in nodes {
        let labels = n.metadata.labels.as_ref();
        let Some(product) = labels.and_then(|l| l.get(LABEL_PRODUCT)) else {
            continue;
        };
        if !node_matches(n, pod) {
            continue;
        }
        let mem = labels
            .and_then(|l| l.get(LABEL_MEMORY))
            .and_then(|m| m.trim().parse::<u64>().ok())
            .filter(|m| *m > 0);
        if !found.iter().any(|(p, _)| p == product) {
            found.push((product.clone(), mem));
        }
    }
    match found.as_slice() {
        [] => Err(GpuError::NoGpuNodes),
        [(product, mem)] => from_label(product, *mem),
        many => Err(GpuError::Mixed(
            many.iter()
                .map(|(p, _)| p.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        )),
    }
}

/// GFD writes the product with spaces as dashes (`NVIDIA-A100-SXM4-80GB`,
/// `NVIDIA-H100-80GB-HBM3`, `Tesla-T4`). The catalog lookup is
/// punctuation-tolerant; the dashed name is tried first, then with spaces.
/// When the catalog does not know it, the memory label (MiB) still gives a
/// usable GPU, with conservative capabilities (no bf16 claimed).
fn from_label(product: &str, memory_mib: Option<u64>) -> Result<GpuSpec, GpuError> {
    if let Ok(g) = lookup_gpu(product) {
        return Ok(g);
    }
    if let Ok(g) = lookup_gpu(&product.replace('-', " ")) {
        return Ok(g);
    }
    let Some(mib) = memory_mib else {
        return Err(GpuError::Unknown {
            product: product.to_string(),
        });
    };
    // No compute capability on the label: the shared rule claims no bf16.
    Ok(GpuSpec::from_live(
        &product.replace('-', " "),
        mib * MIB,
        None,
    ))
}

/// Whether a node satisfies the pod's `nodeSelector` and the first
/// satisfiable term of its required node affinity (terms are ORed,
/// expressions within a term ANDed, as the scheduler does).
pub fn node_matches(node: &Node, pod: Option<&PodSpec>) -> bool {
    let Some(pod) = pod else { return true };
    let empty = Default::default();
    let labels = node.metadata.labels.as_ref().unwrap_or(&empty);
    if let Some(sel) = &pod.node_selector {
        if sel.iter().any(|(k, v)| labels.get(k) != Some(v)) {
            return false;
        }
    }
    let required = pod
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|na| {
            na.required_during_scheduling_ignored_during_execution
                .as_ref()
        });
    if let Some(req) = required {
        let terms = &req.node_selector_terms;
        if !terms.is_empty()
            && !terms.iter().any(|t| {
                t.match_expressions
                    .iter()
                    .flatten()
                    .all(|e| expression_matches(e, labels))
            })
        {
            return false;
        }
    }
    true
}

fn expression_matches(
    e: &NodeSelectorRequirement,
    labels: &std::collections::BTreeMap<String, String>,
) -> bool {
    let v = labels.get(&e.key);
    let values = e.values.as_deref().unwrap_or(&[]);
    match e.operator.as_str() {
        "In" => v.is_some_and(|v| values.contains(v)),
        "NotIn" => v.is_none_or(|v| !values.contains(v)),
        "Exists" => v.is_some(),
        "DoesNotExist" => v.is_none(),
        "Gt" | "Lt" => {
            let (Some(v), Some(bound)) = (
                v.and_then(|v| v.parse::<i64>().ok()),
                values.first().and_then(|b| b.parse::<i64>().ok()),
            ) else {
                return false;
            };
            if e.operator == "Gt" {
                v > bound
            } else {
                v < bound
            }
        }
        _ => false,
    }
}
