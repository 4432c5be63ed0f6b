//! The GPU a job will get, from the labels NVIDIA GPU Feature Discovery
//! puts on nodes (`nvidia.com/gpu.product`, `nvidia.com/gpu.memory`,
//! `nvidia.com/gpu.count`), restricted to the nodes the pod template's node
//! selector and required node affinity allow. Pure: nodes are handed in.
//!
//! MIG, as GPU Feature Discovery labels it (NVIDIA/k8s-device-plugin,
//! `internal/lm/mig-strategy.go` and `internal/lm/resource.go`):
//! - `single`: `nvidia.com/gpu.product` names the slice
//!   (`NVIDIA-A100-SXM4-40GB-MIG-1g.5gb`: the card's name, `MIG`, the
//!   profile, spaces as dashes) and `nvidia.com/gpu.memory` is the slice's
//!   MiB; pods ask for `nvidia.com/gpu`. The catalog resolves the product.
//! - `mixed`: `nvidia.com/gpu.product` stays the card's, and each profile
//!   offered gets `nvidia.com/mig-<profile>.product` (the same
//!   `<card>-MIG-<profile>` spelling), `.count`, `.replicas`, `.memory`
//!   (MiB) and more; pods ask for `nvidia.com/mig-<profile>`. The
//!   profile's own `.product` label is read (else the card's product plus
//!   the profile). GFD writes a `+me` profile with a dot (`1g.10gb.me`).
//!
//! Shared GPUs (NVIDIA/k8s-device-plugin v0.20.0, `api/config/v1`,
//! `internal/lm/resource.go`): GFD labels each resource's
//! `.sharing-strategy` (`none`, `time-slicing`, `mps`) and `.replicas`
//! (`nvidia.com/gpu.replicas`, `nvidia.com/mig-<profile>.replicas`).
//! - **MPS**: the plugin's MPS control daemon caps every client's device
//!   memory at the card's ÷ replicas (`cmd/mps-control-daemon/mps/daemon.go`,
//!   `set_default_device_pinned_mem_limit`), so a job is always planned for
//!   that share; `gpufit.io/gpu-sharing=whole` is refused with a warning
//!   ([`Planned::warnings`]) — the cap holds whatever the job's neighbours do.
//! - **Time-slicing**: nothing isolates memory; gpufit plans for the card's
//!   memory ÷ replicas unless told the job has the card to itself
//!   ([`Sharing::Whole`]).
//! - **Renamed resources**: with `renameByDefault: true` the shared
//!   resources are `nvidia.com/gpu.shared` and `nvidia.com/mig-<profile>.shared`
//!   (`DefaultSharedResourceNameSuffix`) and the product label keeps its
//!   plain name; only without renaming does GFD append `-SHARED` to the
//!   product. The labels stay under the resource's own name
//!   (`nvidia.com/gpu.*`, `nvidia.com/mig-<profile>.*`) either way.
//!
//! Memory: the catalog's figure, or GFD's `.memory` label (MiB) when that
//! is lower (plan for the smaller); a card the catalog lacks is planned
//! from the label, with bf16/fp8 from `nvidia.com/gpu.compute.major/minor`.
//! A `…-MIG-INVALID` product (GFD's mark of a MIG layout that
//! `mig-strategy=single` cannot serve) is named as such.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, NodeSelectorRequirement, PodSpec};

use crate::core::catalog::{lookup_gpu, lookup_mig, GpuSpec};
use crate::core::units::MIB;

/// GFD label with the product name, e.g. `NVIDIA-A100-SXM4-80GB`.
pub const LABEL_PRODUCT: &str = "nvidia.com/gpu.product";
/// GFD label with the memory per GPU in MiB, e.g. `81920`.
pub const LABEL_MEMORY: &str = "nvidia.com/gpu.memory";
/// GFD label with the number of GPUs on the node.
pub const LABEL_COUNT: &str = "nvidia.com/gpu.count";
/// GFD label with the pods each GPU is shared by (time-slicing / MPS).
pub const LABEL_REPLICAS: &str = "nvidia.com/gpu.replicas";
/// GFD label with how each GPU is shared: `none`, `time-slicing` or `mps`.
pub const LABEL_SHARING_STRATEGY: &str = "nvidia.com/gpu.sharing-strategy";
/// GFD labels with the GPUs' CUDA compute capability.
pub const LABEL_COMPUTE_MAJOR: &str = "nvidia.com/gpu.compute.major";
pub const LABEL_COMPUTE_MINOR: &str = "nvidia.com/gpu.compute.minor";
/// The suffix GFD appends to a shared resource's product label when the
/// resource is *not* renamed (`resource.go`, `getProductName`).
pub const SHARED_SUFFIX: &str = "-SHARED";
/// The suffix of a renamed shared resource (`renameByDefault: true`:
/// `nvidia.com/gpu.shared`, `nvidia.com/mig-1g.10gb.shared`).
pub const SHARED_RESOURCE_SUFFIX: &str = ".shared";
/// The product suffix GFD writes for a MIG layout `mig-strategy=single`
/// cannot serve (`mig-strategy.go`, `newInvalidMigStrategyLabeler`).
pub const MIG_INVALID_SUFFIX: &str = "-MIG-INVALID";
/// Resource name prefix of a MIG slice under the `mixed` strategy
/// (`nvidia.com/mig-1g.5gb`).
pub const MIG_RESOURCE_PREFIX: &str = "nvidia.com/mig-";
/// The resource name of a whole (or `single`-strategy MIG, or shared) GPU.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// The renamed shared GPU resource (`renameByDefault: true`).
pub const GPU_SHARED_RESOURCE: &str = "nvidia.com/gpu.shared";
/// Namespace label, or workload annotation, saying how to plan for a
/// shared GPU: `share` (default: the card's memory ÷ replicas) or `whole`.
pub const SHARING_KEY: &str = "gpufit.io/gpu-sharing";

/// How to plan for a GPU shared by several pods (time-slicing; under MPS
/// the share is enforced and `Whole` is refused).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Sharing {
    /// The card's memory ÷ `nvidia.com/gpu.replicas`: the neighbours may
    /// use the rest.
    #[default]
    Share,
    /// The whole card: the job is known to run alone on it.
    Whole,
}

impl std::str::FromStr for Sharing {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "share" | "shared" => Ok(Sharing::Share),
            "whole" | "exclusive" => Ok(Sharing::Whole),
            other => Err(format!(
                "`{other}` is not a GPU sharing plan: use share (plan for the card's memory ÷ nvidia.com/gpu.replicas) or whole"
            )),
        }
    }
}

/// The sharing plan a workload's `gpufit.io/gpu-sharing` annotation, else
/// its namespace's label of that name, asks for (default: share). The
/// error names the one at fault.
pub fn sharing_of(
    annotations: Option<&BTreeMap<String, String>>,
    namespace: Option<(&str, &BTreeMap<String, String>)>,
) -> Result<Sharing, String> {
    if let Some(v) = annotations.and_then(|a| a.get(SHARING_KEY)) {
        return v
            .parse()
            .map_err(|e| format!("annotation {SHARING_KEY}: {e}"));
    }
    match namespace.and_then(|(ns, l)| l.get(SHARING_KEY).map(|v| (ns, v))) {
        Some((ns, v)) => v
            .parse()
            .map_err(|e| format!("namespace {ns} label {SHARING_KEY}: {e}")),
        None => Ok(Sharing::default()),
    }
}

/// The GPUs a pod asks for: whole GPUs (`nvidia.com/gpu`) or MIG slices
/// (`nvidia.com/mig-<profile>`, counted as GPUs of that slice), summed over
/// its containers' limits (requests where a container has no limit).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodGpus {
    pub count: u32,
    /// The MIG profile asked for (`1g.5gb`), when the pod asks for slices
    /// (a renamed `nvidia.com/mig-1g.5gb.shared` gives `1g.5gb`: GFD
    /// labels it under the profile's own name).
    pub mig_profile: Option<String>,
    /// The pod asks for a renamed shared resource (`nvidia.com/gpu.shared`,
    /// `nvidia.com/mig-<profile>.shared`): the GPU is shared.
    pub shared: bool,
    /// The first GPU resource name the pod asks for, as written.
    pub resource: Option<String>,
}

/// The GPUs in one pod's containers' resources, as JSON (`resources`
/// objects of a pod spec in any object the webhook sees).
pub fn pod_gpus_json(pod_spec: &serde_json::Value) -> PodGpus {
    let mut out = PodGpus::default();
    let containers = pod_spec
        .get("containers")
        .and_then(serde_json::Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    for c in containers {
        let res = c.get("resources");
        let amounts = res
            .and_then(|r| r.get("limits"))
            .and_then(serde_json::Value::as_object)
            .filter(|l| l.keys().any(|k| is_gpu_resource(k)))
            .or_else(|| {
                res.and_then(|r| r.get("requests"))
                    .and_then(serde_json::Value::as_object)
            });
        for (k, v) in amounts.into_iter().flatten() {
            if !is_gpu_resource(k) {
                continue;
            }
            let n = match v {
                serde_json::Value::String(s) => s.trim().parse::<u32>().ok(),
                serde_json::Value::Number(n) => n.as_u64().map(|n| n as u32),
                _ => None,
            }
            .unwrap_or(0);
            out.count = out.count.saturating_add(n);
            out.resource.get_or_insert_with(|| k.clone());
            let (base, renamed) = match k.strip_suffix(SHARED_RESOURCE_SUFFIX) {
                Some(b) => (b, true),
                None => (k.as_str(), false),
            };
            out.shared |= renamed;
            if let Some(p) = base.strip_prefix(MIG_RESOURCE_PREFIX) {
                out.mig_profile.get_or_insert_with(|| p.to_string());
            }
        }
    }
    out
}

/// The GPUs a typed pod spec asks for (see [`pod_gpus_json`]).
pub fn pod_gpus(pod: &PodSpec) -> PodGpus {
    serde_json::to_value(pod)
        .map(|v| pod_gpus_json(&v))
        .unwrap_or_default()
}

/// CPU cores per GPU of a pod (JSON pod spec), for the data loader: the
/// containers' CPU limits (the cores they can use), else their requests,
/// over the pod's GPUs, rounded down. None when the pod states no CPUs or
/// no GPUs: the pod's own figures, never the controller's host.
pub fn cpus_per_gpu_json(pod_spec: &serde_json::Value) -> Option<u32> {
    let gpus = pod_gpus_json(pod_spec).count;
    if gpus == 0 {
        return None;
    }
    let containers = pod_spec.get("containers")?.as_array()?;
    let cores = |which: &str| -> Option<f64> {
        let each: Vec<f64> = containers
            .iter()
            .filter_map(|c| c.pointer(&format!("/resources/{which}/cpu")))
            .filter_map(cpu_cores)
            .collect();
        (!each.is_empty()).then(|| each.iter().sum())
    };
    let total = cores("limits").or_else(|| cores("requests"))?;
    Some((total / f64::from(gpus)).floor() as u32)
}

/// CPU cores per GPU of a typed pod spec (see [`cpus_per_gpu_json`]).
pub fn cpus_per_gpu(pod: &PodSpec) -> Option<u32> {
    serde_json::to_value(pod)
        .ok()
        .and_then(|v| cpus_per_gpu_json(&v))
}

/// A Kubernetes CPU quantity in cores: `2`, `1.5`, `500m` (or a number).
fn cpu_cores(v: &serde_json::Value) -> Option<f64> {
    let n = match v {
        serde_json::Value::Number(n) => n.as_f64()?,
        serde_json::Value::String(s) => {
            let s = s.trim();
            match s.strip_suffix('m') {
                Some(milli) => milli.parse::<f64>().ok()? / 1000.0,
                None => s.parse::<f64>().ok()?,
            }
        }
        _ => return None,
    };
    (n.is_finite() && n >= 0.0).then_some(n)
}

/// `nvidia.com/gpu`, `nvidia.com/mig-<profile>`, and their renamed shared
/// forms (`.shared`).
pub fn is_gpu_resource(k: &str) -> bool {
    let base = k.strip_suffix(SHARED_RESOURCE_SUFFIX).unwrap_or(k);
    base == GPU_RESOURCE
        || (base.starts_with(MIG_RESOURCE_PREFIX) && base.len() > MIG_RESOURCE_PREFIX.len())
}

/// Why the GPU could not be determined; the message says what to do.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GpuError {
    #[error("no node matching the pod template's node selector carries the `nvidia.com/gpu.product` label (is NVIDIA GPU Feature Discovery installed?): set spec.gpu to the GPU model")]
    NoGpuNodes,
    #[error("the matching nodes have different GPUs ({0}): narrow the node selector (e.g. nvidia.com/gpu.product) or set spec.gpu")]
    Mixed(String),
    #[error("GPU `{product}` is not in gpufit's catalog and its node has no usable nvidia.com/gpu.memory label: set spec.gpu to a catalog GPU (`gpufit gpus` lists them)")]
    Unknown { product: String },
    #[error("no node matching the pod template's node selector offers nvidia.com/mig-{0}: check the MIG profile the pod asks for")]
    NoMigNodes(String),
    #[error("GPU `{0}` is shared (time-slicing) but its node has no usable nvidia.com/gpu.replicas label, so its share of memory is unknown: set gpufit.io/gpu-sharing=whole if the job has the card to itself, or name the GPU")]
    SharedWithoutReplicas(String),
    #[error("GPU Feature Discovery labels this node's GPU `{0}`: a MIG misconfiguration that mig-strategy=single cannot serve (a MIG-enabled card without MIG devices, more than one MIG profile on the node, or MIG and non-MIG cards together; GFD offers no GPU then): fix the node's MIG layout (nvidia-smi mig -lgi; mig-parted) or run GFD with mig-strategy=mixed")]
    MigInvalid(String),
    #[error("{0}")]
    Catalog(String),
}

/// Resolves a GPU by name (spec.gpu, webhook annotation): catalog lookup.
pub fn resolve_named(name: &str) -> Result<GpuSpec, GpuError> {
    lookup_gpu(name).map_err(|e| GpuError::Catalog(e.to_string()))
}

/// The GPU of the nodes that `pod` may be scheduled on, a shared GPU
/// planned for its share (see [`resolve_from_nodes_with`]).
pub fn resolve_from_nodes<'a>(
    nodes: impl IntoIterator<Item = &'a Node>,
    pod: Option<&PodSpec>,
) -> Result<GpuSpec, GpuError> {
    resolve_from_nodes_with(nodes, pod, Sharing::default())
}

/// How a GPU is shared, from GFD's `.sharing-strategy` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharingStrategy {
    /// `none` (or no label).
    None,
    /// `time-slicing`: nothing isolates memory.
    TimeSlicing,
    /// `mps`: the MPS daemon caps each client at the card ÷ replicas.
    Mps,
}

impl SharingStrategy {
    /// GFD's label value; an unknown value reads as time-slicing (memory
    /// not known to be isolated).
    pub fn from_label(v: Option<&str>) -> Self {
        match v.map(str::trim) {
            Some("mps") => SharingStrategy::Mps,
            Some("time-slicing") => SharingStrategy::TimeSlicing,
            None | Some("") | Some("none") => SharingStrategy::None,
            Some(_) => SharingStrategy::TimeSlicing,
        }
    }
}

/// What one matching node says about its GPU.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    product: String,
    memory_mib: Option<u64>,
    replicas: Option<u32>,
    strategy: SharingStrategy,
    /// `nvidia.com/gpu.compute.major.minor`, when labelled.
    compute_capability: Option<String>,
}

/// The GPU a job is planned for, and what the planner must say about it.
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    pub gpu: GpuSpec,
    /// Warnings for the user (e.g. `whole` refused on an MPS node).
    pub warnings: Vec<String>,
}

/// The GPU of the nodes that `pod` may be scheduled on: the MIG slice it
/// asks for, and for a shared GPU the memory `sharing` says (MPS: always
/// its share). Warnings are logged; [`plan_from_nodes`] returns them.
pub fn resolve_from_nodes_with<'a>(
    nodes: impl IntoIterator<Item = &'a Node>,
    pod: Option<&PodSpec>,
    sharing: Sharing,
) -> Result<GpuSpec, GpuError> {
    plan_from_nodes(nodes, pod, sharing).map(|p| {
        for w in &p.warnings {
            tracing::warn!(gpu = %p.gpu.name, "{w}");
        }
        p.gpu
    })
}

/// [`resolve_from_nodes_with`], with the warnings for the user.
pub fn plan_from_nodes<'a>(
    nodes: impl IntoIterator<Item = &'a Node>,
    pod: Option<&PodSpec>,
    sharing: Sharing,
) -> Result<Planned, GpuError> {
    let asks = pod.map(pod_gpus).unwrap_or_default();
    let mig = asks.mig_profile.clone();
    let mut found: Vec<Seen> = Vec::new();
    for n in nodes {
        let empty = BTreeMap::new();
        let labels = n.metadata.labels.as_ref().unwrap_or(&empty);
        let Some(product) = labels.get(LABEL_PRODUCT) else {
            continue;
        };
        if !node_matches(n, pod) {
            continue;
        }
        let number = |key: &str| labels.get(key).and_then(|m| m.trim().parse::<u64>().ok());
        let replicas = |key: &str| number(key).map(|r| r.min(u32::MAX as u64) as u32);
        let compute_capability = number(LABEL_COMPUTE_MAJOR)
            .zip(number(LABEL_COMPUTE_MINOR))
            .filter(|(major, _)| *major > 0)
            .map(|(major, minor)| format!("{major}.{minor}"));
        let seen = match &mig {
            // `mixed` strategy: GFD labels each profile the node offers
            // (`nvidia.com/mig-1g.5gb.count`, `.product`, `.replicas`,
            // `.sharing-strategy`, `.memory` in MiB), under the profile's
            // own name even when the resource is renamed `….shared`.
            Some(p) => {
                let label = |suffix: &str| format!("{MIG_RESOURCE_PREFIX}{p}.{suffix}");
                let allocatable = |name: &str| {
                    n.status
                        .as_ref()
                        .and_then(|s| s.allocatable.as_ref())
                        .is_some_and(|a| a.contains_key(name))
                };
                let offered = number(&label("count")).is_some_and(|c| c > 0)
                    || allocatable(&format!("{MIG_RESOURCE_PREFIX}{p}"))
                    || allocatable(&format!("{MIG_RESOURCE_PREFIX}{p}{SHARED_RESOURCE_SUFFIX}"));
                if !offered {
                    continue;
                }
                Seen {
                    product: labels.get(&label("product")).cloned().unwrap_or_else(|| {
                        format!("{}-MIG-{p}", product.trim_end_matches(SHARED_SUFFIX))
                    }),
                    memory_mib: number(&label("memory")),
                    // A shared MIG resource: GFD's replicas for it.
                    replicas: replicas(&label("replicas")),
                    strategy: SharingStrategy::from_label(
                        labels.get(&label("sharing-strategy")).map(String::as_str),
                    ),
                    compute_capability,
                }
            }
            None => Seen {
                product: product.clone(),
                memory_mib: number(LABEL_MEMORY),
                replicas: replicas(LABEL_REPLICAS),
                strategy: SharingStrategy::from_label(
                    labels.get(LABEL_SHARING_STRATEGY).map(String::as_str),
                ),
                compute_capability,
            },
        };
        let seen = Seen {
            memory_mib: seen.memory_mib.filter(|m| *m > 0),
            ..seen
        };
        if !found.iter().any(|f| f.product == seen.product) {
            found.push(seen);
        }
    }
    match found.as_slice() {
        [] => Err(match mig {
            Some(p) => GpuError::NoMigNodes(p),
            None => GpuError::NoGpuNodes,
        }),
        [seen] => {
            if seen.product.ends_with(MIG_INVALID_SUFFIX) {
                return Err(GpuError::MigInvalid(seen.product.clone()));
            }
            let card = from_label(
                seen.product.trim_end_matches(SHARED_SUFFIX),
                seen.memory_mib,
                seen.compute_capability.as_deref(),
            )?;
            shared(card, seen, sharing, asks.shared)
        }
        many => Err(GpuError::Mixed(
            many.iter()
                .map(|f| f.product.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        )),
    }
}

/// A GPU shared by `replicas` pods, planned for as `sharing` says (MPS:
/// always its share): its memory ÷ replicas, rounded down to whole MiB as
/// the MPS daemon's limit is, named so that the suggestion's reasoning
/// says so (and its runs are kept apart from the whole card's in the
/// history). `renamed`: the pod asks for a `….shared` resource.
fn shared(
    card: GpuSpec,
    seen: &Seen,
    sharing: Sharing,
    renamed: bool,
) -> Result<Planned, GpuError> {
    let suffixed = seen.product.ends_with(SHARED_SUFFIX);
    let replicas = seen.replicas.filter(|r| *r > 1);
    let mps = seen.strategy == SharingStrategy::Mps && replicas.is_some();
    let plain = |gpu| Planned {
        gpu,
        warnings: Vec::new(),
    };
    if !mps && (sharing == Sharing::Whole || (!suffixed && !renamed && replicas.is_none())) {
        return Ok(plain(card));
    }
    let Some(r) = replicas else {
        return Err(GpuError::SharedWithoutReplicas(seen.product.clone()));
    };
    let mut warnings = Vec::new();
    let how = if mps {
        if sharing == Sharing::Whole {
            warnings.push(format!(
                "{SHARING_KEY}=whole ignored for {}: its node shares it through MPS ({LABEL_SHARING_STRATEGY}=mps, {r} replicas), and the device plugin's MPS daemon caps each pod's GPU memory at the card's ÷ {r} (set_default_device_pinned_mem_limit), whatever its neighbours use: planned for 1/{r} of its memory",
                card.name
            ));
        }
        "MPS-shared"
    } else {
        "time-shared"
    };
    Ok(Planned {
        gpu: GpuSpec {
            name: format!(
                "{} ({how} by {r}: planned for 1/{r} of its memory)",
                card.name
            ),
            memory_bytes: card.memory_bytes / u64::from(r) / MIB * MIB,
            ..card
        },
        warnings,
    })
}

/// GFD writes the product with spaces as dashes (`NVIDIA-A100-SXM4-80GB`,
/// `NVIDIA-H100-80GB-HBM3`, `Tesla-T4`). The catalog lookup is
/// punctuation-tolerant; the dashed name is tried first, then with spaces.
/// Where GFD's memory label is lower than the catalog's figure, the label
/// wins (plan for the smaller). When the catalog does not know it, the
/// memory label (MiB) still gives a usable GPU, with bf16/fp8 from the
/// compute-capability labels (none claimed without them).
fn from_label(
    product: &str,
    memory_mib: Option<u64>,
    compute_capability: Option<&str>,
) -> Result<GpuSpec, GpuError> {
    let catalog = lookup_gpu(product)
        .or_else(|_| lookup_gpu(&product.replace('-', " ")))
        // A MIG product of a card the catalog knows by another spelling.
        .or_else(|e| match product.rsplit_once("-MIG-") {
            Some((card, profile)) => lookup_mig(card, profile),
            None => Err(e),
        });
    if let Ok(mut g) = catalog {
        if let Some(mib) = memory_mib.filter(|m| m.saturating_mul(MIB) < g.memory_bytes) {
            g.memory_bytes = mib * MIB;
        }
        return Ok(g);
    }
    let Some(mib) = memory_mib else {
        return Err(GpuError::Unknown {
            product: product.to_string(),
        });
    };
    Ok(GpuSpec::from_live(
        &product.replace('-', " "),
        mib * MIB,
        compute_capability,
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
