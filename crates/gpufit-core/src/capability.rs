//! The compute-capability → precision rule, written once: bf16 from compute
//! capability 8.0 (Ampere), fp8 from 8.9 (Ada, Hopper) — docs/design.md,
//! "Domain". Every path that meets a GPU the catalog does not describe
//! exactly (a live NVML reading in the sidecar, the Slurm TaskProlog's GPU
//! report, a node label on Kubernetes) builds its [`GpuSpec`] through
//! [`GpuSpec::from_live`], so the same card gets the same dtypes everywhere.
//!
//! (The catalog's own rows in `catalog/gpus.rs` derive their flags with a
//! `const fn` of the same rule; a test here checks that they agree.)

use std::fmt;
use std::str::FromStr;

use crate::catalog::{lookup_gpu, GpuSpec};

/// An NVIDIA compute capability, `major.minor` ("8.0", "8.9", "10.0").
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ComputeCapability {
    pub major: u32,
    pub minor: u32,
}

/// A compute capability that is not `major.minor` (an AMD gfx arch, "",
/// "unknown").
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("compute capability {0:?} is not MAJOR.MINOR (e.g. \"8.0\")")]
pub struct BadComputeCapability(pub String);

impl FromStr for ComputeCapability {
    type Err = BadComputeCapability;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadComputeCapability(s.to_string());
        let (major, minor) = s.trim().split_once('.').ok_or_else(bad)?;
        Ok(Self {
            major: major.trim().parse().map_err(|_| bad())?,
            minor: minor.trim().parse().map_err(|_| bad())?,
        })
    }
}

impl fmt::Display for ComputeCapability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

impl ComputeCapability {
    /// bf16 tensor cores arrived with Ampere (8.0).
    pub fn bf16(self) -> bool {
        self >= Self { major: 8, minor: 0 }
    }

    /// fp8 tensor cores arrived with Ada (8.9) and Hopper (9.0).
    pub fn fp8(self) -> bool {
        self >= Self { major: 8, minor: 9 }
    }
}

impl GpuSpec {
    /// A GPU as it was read live (NVML, a job's GPU report, a node label):
    /// the live name, memory and compute capability win; the catalog adds
    /// what a live reading lacks (the compute capability when none was read,
    /// the throughput used for ranking). bf16/fp8 follow the compute
    /// capability; a card whose capability is not `major.minor` (AMD) keeps
    /// the catalog's flags, and an unknown card without a capability claims
    /// neither, so nothing is suggested that the card may not run.
    pub fn from_live(name: &str, memory_bytes: u64, compute_capability: Option<&str>) -> GpuSpec {
        let catalog = lookup_gpu(name).ok();
        let cc = compute_capability
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .map(str::to_string)
            .or_else(|| catalog.as_ref().map(|c| c.compute_capability.clone()))
            .unwrap_or_default();
        let (bf16, fp8) = match cc.parse::<ComputeCapability>() {
            Ok(v) => (v.bf16(), v.fp8()),
            Err(_) => catalog.as_ref().map_or((false, false), |c| (c.bf16, c.fp8)),
        };
        GpuSpec {
            name: name.to_string(),
            memory_bytes,
            compute_capability: cc,
            bf16,
            fp8,
            bf16_tflops: catalog.as_ref().map_or(0.0, |c| c.bf16_tflops),
            fp32_tflops: catalog.as_ref().map_or(0.0, |c| c.fp32_tflops),
            memory_bandwidth_gbs: catalog.map_or(0.0, |c| c.memory_bandwidth_gbs),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::all_gpus;

    #[test]
    fn the_rule() {
        let cc = |s: &str| s.parse::<ComputeCapability>().unwrap();
        assert!(!cc("7.5").bf16());
        assert!(cc("8.0").bf16() && !cc("8.0").fp8());
        assert!(cc("8.6").bf16() && !cc("8.6").fp8());
        assert!(cc("8.9").fp8());
        assert!(cc("9.0").fp8() && cc("10.0").fp8() && cc("12.0").fp8());
        assert!("gfx90a".parse::<ComputeCapability>().is_err());
        assert!("".parse::<ComputeCapability>().is_err());
        assert!("8".parse::<ComputeCapability>().is_err());
    }

    #[test]
    fn the_catalog_agrees_with_the_rule() {
        for g in all_gpus() {
            if let Ok(v) = g.compute_capability.parse::<ComputeCapability>() {
                assert_eq!((g.bf16, g.fp8), (v.bf16(), v.fp8()), "{}", g.name);
            }
            // A live reading of a catalog card is the catalog card.
            let live = GpuSpec::from_live(&g.name, g.memory_bytes, Some(&g.compute_capability));
            assert_eq!(live, g, "{}", g.name);
        }
    }

    #[test]
    fn an_unknown_card_follows_its_capability_or_claims_nothing() {
        let s = GpuSpec::from_live("Some Ada Card", 24 << 30, Some("8.9"));
        assert_eq!((s.bf16, s.fp8, s.memory_bytes), (true, true, 24 << 30));
        let s = GpuSpec::from_live("Some Turing Card", 16 << 30, Some("7.5"));
        assert_eq!((s.bf16, s.fp8), (false, false));
        let s = GpuSpec::from_live("Some Card", 16 << 30, None);
        assert_eq!(
            (s.bf16, s.fp8, s.compute_capability.as_str()),
            (false, false, "")
        );
    }
}
