//! Prometheus metrics. The list is data — one table of name, type, help and
//! labels — and values are filled from the latest sample at scrape time, so
//! series of GPUs and jobs that are gone disappear with them.
//!
//! Label values are bounded: GPU index/UUID/model/node are fixed per node;
//! job labels name pods and Slurm jobs, whose number is capped by the
//! tracker's `max_jobs`. Process ids are never labels.
//!
//! MIG: a slice is a series of its own, told apart from its card and its
//! siblings by `mig_device` (its place on the card, 0 to 6) and named by
//! `mig_profile` (`1g.10gb`; one of a card's few profiles); both are empty
//! for a whole GPU. That is at most 7 more series per card and per job, and
//! `uuid` is the slice's own `MIG-…` UUID. A card in MIG mode exports only
//! `gpufit_gpu_healthy` itself: its memory is its slices', so a sum over a
//! node's series counts it once.

use prometheus::{Encoder, GaugeVec, Opts, Registry, TextEncoder};

use super::source::GpuInfo;
use super::tracker::JobView;
use super::SidecarError;

/// Metric type (all current ones are gauges: each is a reading, not a count).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Gauge,
}

/// One exported metric.
#[derive(Debug, Clone, Copy)]
pub struct MetricDef {
    pub name: &'static str,
    pub kind: MetricKind,
    pub help: &'static str,
    pub labels: &'static [&'static str],
}

/// Labels of per-GPU series.
pub const GPU_LABELS: &[&str] = &["gpu", "mig_device", "mig_profile", "uuid", "model", "node"];
/// Labels of per-job series (docs/design.md, "Measuring peaks"): the job by pod or Slurm id, plus GPU
/// (and MIG slice), node and how the value was measured.
pub const JOB_LABELS: &[&str] = &[
    "namespace",
    "pod",
    "slurm_job_id",
    "gpu",
    "mig_device",
    "mig_profile",
    "node",
    "method",
];

/// Every metric the sidecar exports.
pub const METRICS: &[MetricDef] = &[
    MetricDef {
        name: "gpufit_gpu_memory_total_bytes",
        kind: MetricKind::Gauge,
        help: "Total GPU memory in bytes, as NVML reports it.",
        labels: GPU_LABELS,
    },
    MetricDef {
        name: "gpufit_gpu_memory_used_bytes",
        kind: MetricKind::Gauge,
        help: "GPU memory in use in bytes, all processes and the driver's reservation.",
        labels: GPU_LABELS,
    },
    MetricDef {
        name: "gpufit_gpu_utilization_ratio",
        kind: MetricKind::Gauge,
        help: "Fraction (0-1) of the last sample period during which a kernel ran on the GPU.",
        labels: GPU_LABELS,
    },
    MetricDef {
        name: "gpufit_gpu_healthy",
        kind: MetricKind::Gauge,
        help: "1 when the GPU was read at the last sample, 0 when reading it failed.",
        labels: GPU_LABELS,
    },
    MetricDef {
        name: "gpufit_job_gpu_memory_bytes",
        kind: MetricKind::Gauge,
        help: "GPU memory a job's processes hold on one GPU now, in bytes (0 once the job ended).",
        labels: JOB_LABELS,
    },
    MetricDef {
        name: "gpufit_job_gpu_memory_peak_bytes",
        kind: MetricKind::Gauge,
        help: "Peak GPU memory of a job on one GPU in bytes; `method` says how it was measured (sampled, nvml_accounting, log).",
        labels: JOB_LABELS,
    },
    MetricDef {
        name: "gpufit_sidecar_tracked_jobs",
        kind: MetricKind::Gauge,
        help: "Jobs the sidecar holds (running, and ended ones not yet evicted).",
        labels: &["node"],
    },
    MetricDef {
        name: "gpufit_sidecar_last_sample_age_seconds",
        kind: MetricKind::Gauge,
        help: "Seconds since the GPUs were last sampled.",
        labels: &["node"],
    },
];

/// The registry and one vector per table row.
pub struct Metrics {
    registry: Registry,
    vecs: Vec<GaugeVec>,
}

fn idx(name: &str) -> usize {
    METRICS
        .iter()
        .position(|m| m.name == name)
        .unwrap_or(usize::MAX)
}

impl Metrics {
    /// Registers every metric of [`METRICS`].
    pub fn new() -> Result<Self, SidecarError> {
        let registry = Registry::new();
        let mut vecs = Vec::with_capacity(METRICS.len());
        for m in METRICS {
            let MetricKind::Gauge = m.kind;
            let v = GaugeVec::new(Opts::new(m.name, m.help), m.labels)
                .map_err(|e| SidecarError::Other(format!("metric {}: {e}", m.name)))?;
            registry
                .register(Box::new(v.clone()))
                .map_err(|e| SidecarError::Other(format!("metric {}: {e}", m.name)))?;
            vecs.push(v);
        }
        Ok(Self { registry, vecs })
    }

    fn set(&self, name: &str, labels: &[&str], value: f64) {
        if let Some(v) = self.vecs.get(idx(name)) {
            if let Ok(g) = v.get_metric_with_label_values(labels) {
                g.set(value);
            }
        }
    }

    /// Fills every series from the latest sample and renders the text format.
    pub fn render(
        &self,
        node: &str,
        gpus: &[GpuInfo],
        jobs: &[JobView],
        last_sample_age_secs: f64,
    ) -> Result<String, SidecarError> {
        for v in &self.vecs {
            v.reset();
        }
        for g in gpus {
            let index = g.index.to_string();
            let (device, profile) = slice_labels(g.mig.as_ref().map(|m| (m.device, &m.profile)));
            let l = [
                index.as_str(),
                device.as_str(),
                profile,
                g.uuid.as_str(),
                g.name.as_str(),
                node,
            ];
            self.set("gpufit_gpu_healthy", &l, if g.healthy { 1.0 } else { 0.0 });
            // A card in MIG mode: its slices carry its memory.
            let has_slices =
                g.mig.is_none() && gpus.iter().any(|s| s.index == g.index && s.mig.is_some());
            if !g.healthy || has_slices {
                continue;
            }
            self.set(
                "gpufit_gpu_memory_total_bytes",
                &l,
                g.memory_total_bytes as f64,
            );
            self.set(
                "gpufit_gpu_memory_used_bytes",
                &l,
                g.memory_used_bytes as f64,
            );
            if let Some(u) = g.utilization_ratio {
                self.set("gpufit_gpu_utilization_ratio", &l, u);
            }
        }
        for j in jobs {
            let ns = j.namespace.as_deref().unwrap_or("");
            // A pod known only by UID: the UID stands in for the name.
            let pod = j.pod.as_deref().or(j.pod_uid.as_deref()).unwrap_or("");
            let slurm = j.slurm_job_id.as_deref().unwrap_or("");
            for g in &j.gpus {
                let gpu = g.gpu.to_string();
                let (device, profile) =
                    slice_labels(g.mig.as_ref().map(|m| (m.device, &m.profile)));
                let measured = g.method.as_str();
                let l = [ns, pod, slurm, &gpu, &device, profile, node, measured];
                self.set("gpufit_job_gpu_memory_bytes", &l, g.current_bytes as f64);
                // 0: no figure of the job on it yet (NVML gave none): no
                // peak series, so no query reads it as a 0-byte peak.
                if g.peak_bytes > 0 {
                    self.set("gpufit_job_gpu_memory_peak_bytes", &l, g.peak_bytes as f64);
                }
            }
            if j.method == super::tracker::PeakMethod::Log {
                // The log states one per-GPU peak for the whole job.
                self.set(
                    "gpufit_job_gpu_memory_peak_bytes",
                    &[ns, pod, slurm, "", "", "", node, "log"],
                    j.peak_bytes as f64,
                );
            }
        }
        self.set("gpufit_sidecar_tracked_jobs", &[node], jobs.len() as f64);
        self.set(
            "gpufit_sidecar_last_sample_age_seconds",
            &[node],
            last_sample_age_secs,
        );
        let mut buf = Vec::with_capacity(4096);
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .map_err(|e| SidecarError::Other(format!("encoding metrics: {e}")))?;
        String::from_utf8(buf).map_err(|e| SidecarError::Other(format!("encoding metrics: {e}")))
    }
}

/// The `mig_device` and `mig_profile` label values: empty for a whole GPU.
fn slice_labels(mig: Option<(u32, &String)>) -> (String, &str) {
    match mig {
        Some((device, profile)) => (device.to_string(), profile.as_str()),
        None => (String::new(), ""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_has_help_a_gpufit_name_and_is_registered_once() {
        let mut names: Vec<&str> = METRICS.iter().map(|m| m.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), METRICS.len());
        for m in METRICS {
            assert!(m.name.starts_with("gpufit_"), "{}", m.name);
            assert!(m.help.len() > 10, "{} needs help", m.name);
            assert!(!m.labels.contains(&"pid"), "{} must not label PIDs", m.name);
        }
        assert!(Metrics::new().is_ok());
    }

    #[test]
    fn rendered_metrics_carry_help_and_gpu_labels() {
        let m = Metrics::new().expect("metrics");
        let gpu = GpuInfo {
            index: 3,
            uuid: "GPU-x".into(),
            name: "NVIDIA A100-SXM4-80GB".into(),
            memory_total_bytes: 100,
            memory_used_bytes: 40,
            memory_free_bytes: 60,
            compute_capability: Some("8.0".into()),
            utilization_ratio: Some(0.5),
            mig_enabled: Some(false),
            accounting_enabled: Some(false),
            healthy: true,
            error: None,
            mig: None,
        };
        let text = m.render("node-1", &[gpu], &[], 0.1).expect("render");
        assert!(text.contains("# HELP gpufit_gpu_memory_total_bytes Total GPU memory"));
        assert!(text.contains(
            r#"gpufit_gpu_memory_used_bytes{gpu="3",mig_device="",mig_profile="",model="NVIDIA A100-SXM4-80GB",node="node-1",uuid="GPU-x"} 40"#
        ), "{text}");
        assert!(text.contains(r#"gpufit_gpu_utilization_ratio{gpu="3",mig_device="",mig_profile="",model="NVIDIA A100-SXM4-80GB",node="node-1",uuid="GPU-x"} 0.5"#));
    }
}
