//! The inventory backend: GPUs declared by hand in a YAML or TOML file, for
//! nodes where NVML is not available. It knows no processes, so it gives
//! no per-job data; memory is reported as all free.
//!
//! ```yaml
//! gpus:
//!   - name: NVIDIA A100-SXM4-80GB   # resolved through the catalog
//!     count: 4                      # default 1
//!   - name: Some Custom Card        # not in the catalog: give memory
//!     memory_gib: 24                # or memory_bytes
//!     compute_capability: "8.6"
//! ```
//! The same in TOML is `[[gpus]]` tables.

use std::path::Path;

use serde::Deserialize;

use super::source::{Backend, GpuInfo, GpuSource, SourceSample};
use super::SidecarError;
use crate::core::catalog::lookup_gpu;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct InventoryFile {
    gpus: Vec<InventoryGpu>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct InventoryGpu {
    name: String,
    #[serde(default)]
    count: Option<u32>,
    #[serde(default)]
    memory_bytes: Option<u64>,
    #[serde(default)]
    memory_gib: Option<f64>,
    #[serde(default)]
    compute_capability: Option<String>,
    #[serde(default)]
    uuid: Option<String>,
}

/// GPUs declared in a file.
#[derive(Debug, Clone)]
pub struct InventorySource {
    gpus: Vec<GpuInfo>,
}

impl InventorySource {
    /// Reads and resolves a YAML (`.yaml`/`.yml`) or TOML (`.toml`) file;
    /// other extensions are tried as YAML then TOML.
    pub fn from_file(path: &Path) -> Result<Self, SidecarError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            SidecarError::Config(format!(
                "cannot read inventory file {}: {e}",
                path.display()
            ))
        })?;
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        Self::parse(&text, ext)
            .map_err(|e| SidecarError::Config(format!("inventory file {}: {e}", path.display())))
    }

    /// Parses inventory text; `ext` picks the format (`toml`, else YAML first).
    pub fn parse(text: &str, ext: &str) -> Result<Self, String> {
        let file: InventoryFile = if ext.eq_ignore_ascii_case("toml") {
            toml::from_str(text).map_err(|e| e.to_string())?
        } else {
            match serde_yaml::from_str(text) {
                Ok(f) => f,
                Err(yaml_err) => toml::from_str(text)
                    .map_err(|_| format!("not valid YAML ({yaml_err}) nor TOML"))?,
            }
        };
        if file.gpus.is_empty() {
            return Err("`gpus` is empty: declare at least one GPU".into());
        }
        let mut gpus = Vec::new();
        for (n, g) in file.gpus.iter().enumerate() {
            let count = g.count.unwrap_or(1);
            if count == 0 || count > 64 {
                return Err(format!(
                    "gpus[{n}] `{}`: count {count} must be 1 to 64",
                    g.name
                ));
            }
            let memory_override = match (g.memory_bytes, g.memory_gib) {
                (Some(b), None) => Some(b),
                (None, Some(gib)) if gib.is_finite() && gib > 0.0 => {
                    Some(crate::core::units::gib(gib))
                }
                (None, Some(gib)) => {
                    return Err(format!(
                        "gpus[{n}] `{}`: memory_gib {gib} must be > 0",
                        g.name
                    ))
                }
                (Some(_), Some(_)) => {
                    return Err(format!(
                        "gpus[{n}] `{}`: give memory_bytes or memory_gib, not both",
                        g.name
                    ))
                }
                (None, None) => None,
            };
            let (name, total, cc) = match (lookup_gpu(&g.name), memory_override) {
                (Ok(spec), m) => (
                    spec.name,
                    m.unwrap_or(spec.memory_bytes),
                    g.compute_capability
                        .clone()
                        .or(Some(spec.compute_capability)),
                ),
                (Err(_), Some(m)) => (g.name.clone(), m, g.compute_capability.clone()),
                (Err(e), None) => {
                    return Err(format!(
                        "gpus[{n}]: {e}; or declare its memory with memory_gib / memory_bytes"
                    ))
                }
            };
            for _ in 0..count {
                let index = gpus.len() as u32;
                if index >= 256 {
                    return Err("more than 256 GPUs declared".into());
                }
                gpus.push(GpuInfo {
                    index,
                    uuid: match (&g.uuid, count) {
                        (Some(u), 1) => u.clone(),
                        _ => format!("inventory-{index}"),
                    },
                    name: name.clone(),
                    memory_total_bytes: total,
                    memory_used_bytes: 0,
                    memory_free_bytes: total,
                    compute_capability: cc.clone().filter(|c| !c.is_empty()),
                    utilization_ratio: None,
                    mig_enabled: None,
                    accounting_enabled: None,
                    healthy: true,
                    error: None,
                    mig: None,
                });
            }
        }
        Ok(Self { gpus })
    }
}

impl GpuSource for InventorySource {
    fn backend(&self) -> Backend {
        Backend::Inventory
    }

    fn sample(&self) -> SourceSample {
        SourceSample {
            gpus: self.gpus.clone(),
            processes: Vec::new(),
        }
    }

    fn sees_processes(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_and_toml_inventories_declare_the_same_gpus() {
        let yaml = "gpus:\n  - name: Custom Card\n    count: 2\n    memory_gib: 24\n    compute_capability: \"8.6\"\n";
        let toml = "[[gpus]]\nname = \"Custom Card\"\ncount = 2\nmemory_gib = 24\ncompute_capability = \"8.6\"\n";
        let a = InventorySource::parse(yaml, "yaml").expect("valid yaml");
        let b = InventorySource::parse(toml, "toml").expect("valid toml");
        assert_eq!(a.gpus, b.gpus);
        assert_eq!(a.gpus.len(), 2);
        assert_eq!(a.gpus[1].index, 1);
        assert_eq!(a.gpus[0].memory_total_bytes, 24 << 30);
        assert_eq!(a.gpus[0].compute_capability.as_deref(), Some("8.6"));
        assert!(a.sample().processes.is_empty());
    }

    #[test]
    fn catalog_gpu_takes_its_memory_from_the_catalog_unless_overridden() {
        let spec = lookup_gpu("NVIDIA A100-SXM4-80GB").expect("A100 80GB is in the catalog");
        let inv = InventorySource::parse(
            "gpus:\n  - name: NVIDIA A100-SXM4-80GB\n    count: 2\n",
            "yaml",
        )
        .expect("valid inventory");
        assert_eq!(inv.gpus[1].memory_total_bytes, spec.memory_bytes);
        assert_eq!(
            inv.gpus[1].compute_capability.as_deref(),
            Some(spec.compute_capability.as_str())
        );
        let inv = InventorySource::parse(
            "gpus:\n  - name: NVIDIA A100-SXM4-80GB\n    memory_bytes: 1000\n",
            "yaml",
        )
        .expect("valid inventory");
        assert_eq!(inv.gpus[0].memory_total_bytes, 1000);
    }

    #[test]
    fn inventory_gpu_unknown_to_the_catalog_needs_its_memory() {
        let err =
            InventorySource::parse("gpus:\n  - name: Mystery GPU\n", "yaml").expect_err("refused");
        assert!(err.contains("memory_gib"), "{err}");
    }

    #[test]
    fn malformed_inventories_are_clear_errors() {
        for (text, ext, want) in [
            ("gpus: []\n", "yaml", "empty"),
            (
                "gpus:\n  - name: X\n    count: 0\n    memory_gib: 1\n",
                "yaml",
                "count",
            ),
            (
                "gpus:\n  - name: X\n    memory_gib: -1\n",
                "yaml",
                "memory_gib",
            ),
            (
                "gpus:\n  - name: X\n    memory_gib: 1\n    memory_bytes: 1\n",
                "yaml",
                "not both",
            ),
            ("gpus:\n  - nam: X\n", "yaml", "YAML"),
            ("[[gpus]\n", "toml", ""),
        ] {
            let err = InventorySource::parse(text, ext).expect_err("refused");
            assert!(err.contains(want), "{text}: {err}");
        }
    }
}
