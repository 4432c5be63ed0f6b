//! GPU catalog. Memory is what NVML reports as the card's total
//! (e.g. 81920 MiB for an A100 80GB), not the marketing GB.
//!
//! Sources for `memory_mib`: the "Total" column of `nvidia-smi` (NVML's
//! `nvmlDeviceGetMemoryInfo().total`, shown in MiB) as printed on each card in
//! public logs and bug reports (PyTorch / vLLM / NVIDIA forum threads quoting
//! `nvidia-smi` output and PyTorch's OOM message "GPU 0 has a total capacity of
//! … GiB"). NVML reserves part of the physical memory for ECC / the driver, so
//! the totals are a little below the marketing size (H100 80GB: 81559 MiB).
//! For AMD Instinct cards the figure is `rocm-smi --showmeminfo vram` total.
//! Compute capability: NVIDIA's "CUDA GPUs" table
//! (<https://developer.nvidia.com/cuda-gpus>). `bf16_tflops`: dense (no
//! sparsity) bf16 tensor TFLOP/s from each datasheet (fp16 for T4/V100,
//! which have no bf16). `bandwidth_gbs`: the memory bandwidth on the same
//! datasheets (GB/s; H100 SXM 3.35 TB/s, H200 4.8 TB/s, A100 80GB SXM
//! 2,039 GB/s; AMD per GCD for the MI250X). `fp32_tflops`: the "FP32"
//! (CUDA-core, no tensor cores) line of the same datasheets (H100 SXM and
//! H200 66.9, A100 19.5, L40S 91.6 TFLOP/s; B200 75: HGX B200's 600 over
//! its eight GPUs; AMD: vector fp32, per GCD for the MI250X).

use std::collections::HashMap;
use std::sync::OnceLock;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::CatalogError;
use crate::units::MIB;

/// A GPU model (catalog entry, or live values read from NVML which win).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GpuSpec {
    /// Name as NVML / nvidia-smi print it, e.g. `NVIDIA A100-SXM4-80GB`.
    pub name: String,
    /// Total memory in bytes as NVML reports it.
    pub memory_bytes: u64,
    /// CUDA compute capability, e.g. "8.0" (AMD: gfx arch, e.g. "gfx90a").
    pub compute_capability: String,
    pub bf16: bool,
    pub fp8: bool,
    /// Dense bf16/fp16 tensor TFLOP/s (datasheet), for ranking candidates by speed.
    pub bf16_tflops: f64,
    /// Dense fp32 TFLOP/s without tensor cores (datasheet "FP32"): the rate
    /// of the fp32 matmuls PyTorch runs by default (TF32 off), which PEFT's
    /// QLoRA recipe without autocast leaves in the head and the attention
    /// (`core::throughput`). 0 when unknown.
    #[serde(default)]
    pub fp32_tflops: f64,
    /// Memory bandwidth in GB/s (datasheet): what the optimizer step, a
    /// pass of element-wise kernels over the model state, runs at. 0 when
    /// unknown (a GPU outside the catalog), which leaves that step's time
    /// out of the throughput model.
    #[serde(default)]
    pub memory_bandwidth_gbs: f64,
}

/// One catalog row. `cc` "x.y" for NVIDIA; AMD rows carry their gfx arch and
/// explicit precision flags.
struct Row {
    name: &'static str,
    memory_mib: u64,
    cc: &'static str,
    /// bf16 / fp8 support; for NVIDIA derived from `cc` (bf16 from 8.0, fp8
    /// from 8.9: `core::capability`, docs/design.md, "Domain") and checked by
    /// a test against that rule.
    bf16: bool,
    fp8: bool,
    tflops: f64,
    /// Dense fp32 TFLOP/s on the CUDA cores (datasheet).
    fp32_tflops: f64,
    /// Memory bandwidth in GB/s (datasheet).
    bandwidth_gbs: f64,
    /// Other spellings people and tools use (GPU Feature Discovery's
    /// `nvidia.com/gpu.product` label uses dashes: `NVIDIA-A100-SXM4-80GB`,
    /// which normalisation already covers).
    aliases: &'static [&'static str],
}

const fn nv(
    name: &'static str,
    memory_mib: u64,
    cc: &'static str,
    tflops: f64,
    fp32_tflops: f64,
    bandwidth_gbs: f64,
    aliases: &'static [&'static str],
) -> Row {
    // bf16 from compute capability 8.0, fp8 from 8.9 (the rule of
    // `core::capability`, restated here because a catalog row is built in a
    // `const fn`; a test keeps the two equal); compared as the (major,
    // minor) digits of the "x.y" string.
    let b = cc.as_bytes();
    let major = (b[0] - b'0') as u32 * if b.len() > 3 { 10 } else { 1 }
        + if b.len() > 3 { (b[1] - b'0') as u32 } else { 0 };
    let minor = (b[b.len() - 1] - b'0') as u32;
    let v = major * 10 + minor;
    Row {
        name,
        memory_mib,
        cc,
        bf16: v >= 80,
        fp8: v >= 89,
        tflops,
        fp32_tflops,
        bandwidth_gbs,
        aliases,
    }
}

/// The catalog. Memory in MiB exactly as NVML reports the total.
const ROWS: &[Row] = &[
    // Turing. nvidia-smi on a T4 prints 15360MiB.
    nv(
        "Tesla T4",
        15360,
        "7.5",
        65.0,
        8.1,
        320.0,
        &["t4", "nvidia t4"],
    ),
    // Volta. nvidia-smi: 16160MiB (16 GB) and 32768MiB (32 GB SXM2/PCIe).
    nv(
        "Tesla V100-SXM2-16GB",
        16160,
        "7.0",
        125.0,
        15.7,
        900.0,
        &["v100-16gb", "v100 16gb", "v100-sxm2-16gb"],
    ),
    nv(
        "Tesla V100-PCIE-16GB",
        16160,
        "7.0",
        112.0,
        14.0,
        900.0,
        &["v100-pcie-16gb", "v100 pcie 16gb"],
    ),
    nv(
        "Tesla V100-SXM2-32GB",
        32768,
        "7.0",
        125.0,
        15.7,
        900.0,
        &["v100-32gb", "v100 32gb", "v100-sxm2-32gb"],
    ),
    nv(
        "Tesla V100-PCIE-32GB",
        32768,
        "7.0",
        112.0,
        14.0,
        900.0,
        &["v100-pcie-32gb"],
    ),
    // Ampere. AWS g5 instances: `NVIDIA A10G`, 23028MiB.
    nv("NVIDIA A10G", 23028, "8.6", 70.0, 31.2, 600.0, &["a10g"]),
    // A100: 40960MiB / 81920MiB (NVIDIA A100 datasheet; nvidia-smi totals).
    nv(
        "NVIDIA A100-SXM4-40GB",
        40960,
        "8.0",
        312.0,
        19.5,
        1555.0,
        &["a100-40gb", "a100 40gb", "a100-sxm4-40gb", "a100-sxm-40gb"],
    ),
    nv(
        "NVIDIA A100-PCIE-40GB",
        40960,
        "8.0",
        312.0,
        19.5,
        1555.0,
        &["a100-pcie-40gb", "a100 pcie 40gb"],
    ),
    nv(
        "NVIDIA A100-SXM4-80GB",
        81920,
        "8.0",
        312.0,
        19.5,
        2039.0,
        &["a100-80gb", "a100 80gb", "a100-sxm4-80gb", "a100-sxm-80gb"],
    ),
    nv(
        "NVIDIA A100 80GB PCIe",
        81920,
        "8.0",
        312.0,
        19.5,
        1935.0,
        &["a100-pcie-80gb", "a100 80gb pcie", "a100-80gb-pcie"],
    ),
    nv(
        "NVIDIA GeForce RTX 3090",
        24576,
        "8.6",
        71.0,
        35.6,
        936.0,
        &["rtx 3090", "rtx3090", "3090"],
    ),
    nv(
        "NVIDIA RTX A6000",
        49140,
        "8.6",
        154.8,
        38.7,
        768.0,
        &["rtx a6000", "a6000"],
    ),
    // Ada Lovelace. `NVIDIA L4` 23034MiB, `NVIDIA L40S` 46068MiB.
    nv("NVIDIA L4", 23034, "8.9", 121.0, 30.3, 300.0, &["l4"]),
    nv("NVIDIA L40S", 46068, "8.9", 362.0, 91.6, 864.0, &["l40s"]),
    nv(
        "NVIDIA GeForce RTX 4090",
        24564,
        "8.9",
        165.2,
        82.6,
        1008.0,
        &["rtx 4090", "rtx4090", "4090"],
    ),
    nv(
        "NVIDIA RTX 6000 Ada Generation",
        49140,
        "8.9",
        364.2,
        91.1,
        960.0,
        &["rtx 6000 ada", "rtx6000 ada", "6000 ada"],
    ),
    // Hopper. 81559MiB for the 80 GB parts, 95830MiB for the 94 GB NVL,
    // 143771MiB for H200 (141 GB; nvidia-smi on a real one printed it:
    // bench/data/h200/logs/run1.txt), 97871MiB for GH200 (96 GB HBM3).
    nv(
        "NVIDIA H100 PCIe",
        81559,
        "9.0",
        756.0,
        51.2,
        2000.0,
        &["h100-pcie", "h100 pcie", "h100-pcie-80gb"],
    ),
    nv(
        "NVIDIA H100 80GB HBM3",
        81559,
        "9.0",
        989.0,
        66.9,
        3350.0,
        &[
            "h100-sxm",
            "h100 sxm",
            "h100-sxm5-80gb",
            "h100-80gb",
            "h100 80gb",
        ],
    ),
    nv(
        "NVIDIA H100 NVL",
        95830,
        "9.0",
        835.0,
        60.0,
        3900.0,
        &["h100-nvl", "h100 nvl"],
    ),
    nv(
        "NVIDIA H200",
        143771,
        "9.0",
        989.0,
        66.9,
        4800.0,
        &["h200", "h200-141gb", "h200 sxm"],
    ),
    nv(
        "NVIDIA GH200 480GB",
        97871,
        "9.0",
        989.0,
        66.9,
        4000.0,
        &["gh200", "gh200-96gb", "gh200 96gb"],
    ),
    // Blackwell. `NVIDIA B200` 183359MiB (180 GB HBM3e);
    // `NVIDIA GeForce RTX 5090` 32607MiB.
    nv(
        "NVIDIA B200",
        183359,
        "10.0",
        2250.0,
        75.0,
        8000.0,
        &["b200"],
    ),
    nv(
        "NVIDIA GeForce RTX 5090",
        32607,
        "12.0",
        209.5,
        104.8,
        1792.0,
        &["rtx 5090", "rtx5090", "5090"],
    ),
    // AMD Instinct: rocm-smi VRAM totals. MI250X: 64 GiB per GCD (each GCD is
    // one device to the runtime); MI300X: 192 GiB (196592 MiB reported).
    // bf16 on both (CDNA2/3); fp8 only on CDNA3 (MI300X).
    Row {
        name: "AMD Instinct MI250X",
        memory_mib: 65536,
        cc: "gfx90a",
        bf16: true,
        fp8: false,
        tflops: 191.5,
        // 47.9 TFLOP/s vector fp32 per OAM module of two GCDs
        fp32_tflops: 23.95,
        // 3.2 TB/s per OAM module of two GCDs
        bandwidth_gbs: 1638.4,
        aliases: &["mi250x", "mi250x/mi250"],
    },
    Row {
        name: "AMD Instinct MI300X",
        memory_mib: 196592,
        cc: "gfx942",
        bf16: true,
        fp8: true,
        tflops: 1307.4,
        fp32_tflops: 163.4,
        bandwidth_gbs: 5300.0,
        aliases: &["mi300x"],
    },
];

/// MIG (Multi-Instance GPU) profiles: `(profile, memory eighths, usable MiB)`.
///
/// Profiles and their "Fraction of Memory" (in eighths of the card) are the
/// tables of NVIDIA's Multi-Instance GPU User Guide, "Supported MIG
/// Profiles" (<https://docs.nvidia.com/datacenter/tesla/mig-user-guide/supported-mig-profiles.html>).
/// The usable memory is *not* the figure in the profile's name (a share of
/// the card's marketing size, e.g. "5gb"): it is the "Memory GiB" column of
/// `nvidia-smi mig -lgip` (what NVML and PyTorch then report as the slice's
/// total), a little below the name's figure read as GB and below the
/// card's total × eighths / 8. A100 40GB: 4.75 / 9.75 / 9.75 / 19.62 /
/// 19.62 / 39.38 GiB; H100 80GB: 9.75 / 19.62 / 19.62 / 39.50 / 39.50 /
/// 79.25 GiB (lgip output quoted in public MIG walkthroughs). The A100 80GB
/// is the same chip with twice the HBM per memory slice, so its figures are
/// twice the 40GB's (9.50 … 78.75 GiB). The H200's 1g.18gb slice reports
/// 16.00 GiB; its larger profiles are taken as that per eighth (32 / 64 /
/// 128 GiB), which is below their real totals: planning for slightly less
/// memory than the slice has costs a little headroom, never an OOM.
type MigProfile = (&'static str, u64, u64);

const MIG_A100_40GB: &[MigProfile] = &[
    ("1g.5gb", 1, 4864),
    ("1g.10gb", 2, 9984),
    ("2g.10gb", 2, 9984),
    ("3g.20gb", 4, 20096),
    ("4g.20gb", 4, 20096),
    ("7g.40gb", 8, 40320),
];
const MIG_A100_80GB: &[MigProfile] = &[
    ("1g.10gb", 1, 9728),
    ("1g.20gb", 2, 19968),
    ("2g.20gb", 2, 19968),
    ("3g.40gb", 4, 40192),
    ("4g.40gb", 4, 40192),
    ("7g.80gb", 8, 80640),
];
const MIG_H100_80GB: &[MigProfile] = &[
    ("1g.10gb", 1, 9984),
    ("1g.20gb", 2, 20096),
    ("2g.20gb", 2, 20096),
    ("3g.40gb", 4, 40448),
    ("4g.40gb", 4, 40448),
    ("7g.80gb", 8, 81152),
];
const MIG_H200: &[MigProfile] = &[
    ("1g.18gb", 1, 16384),
    ("1g.35gb", 2, 32768),
    ("2g.35gb", 2, 32768),
    ("3g.71gb", 4, 65536),
    ("4g.71gb", 4, 65536),
    ("7g.141gb", 8, 131072),
];

/// The catalog cards with MIG, by their NVML name, and their profiles.
const MIG_PARENTS: &[(&str, &[MigProfile])] = &[
    ("NVIDIA A100-SXM4-40GB", MIG_A100_40GB),
    ("NVIDIA A100-PCIE-40GB", MIG_A100_40GB),
    ("NVIDIA A100-SXM4-80GB", MIG_A100_80GB),
    ("NVIDIA A100 80GB PCIe", MIG_A100_80GB),
    ("NVIDIA H100 80GB HBM3", MIG_H100_80GB),
    ("NVIDIA H100 PCIe", MIG_H100_80GB),
    ("NVIDIA H200", MIG_H200),
];

/// A MIG slice of `parent` with profile `profile` (`1g.5gb`): named as NVML
/// names MIG devices (`NVIDIA A100-SXM4-40GB MIG 1g.5gb`); compute
/// capability and precision from the card; memory from the profile; tensor
/// and fp32 rates scaled by its compute slices out of 7, bandwidth by its
/// memory slices out of 8 (each slice owns its memory controllers).
fn mig_spec(parent: &GpuSpec, profile: &str, eighths: u64, memory_mib: u64) -> GpuSpec {
    let compute: f64 = profile
        .split_once('g')
        .and_then(|(c, _)| c.parse().ok())
        .unwrap_or(1.0);
    GpuSpec {
        name: format!("{} MIG {profile}", parent.name),
        memory_bytes: memory_mib * MIB,
        compute_capability: parent.compute_capability.clone(),
        bf16: parent.bf16,
        fp8: parent.fp8,
        bf16_tflops: parent.bf16_tflops * compute / 7.0,
        fp32_tflops: parent.fp32_tflops * compute / 7.0,
        memory_bandwidth_gbs: parent.memory_bandwidth_gbs * eighths as f64 / 8.0,
    }
}

/// Lower-case ASCII alphanumerics only; vendor words that tools add or drop
/// ("nvidia", "geforce", "tesla", "amd", "instinct") are removed, so
/// `NVIDIA-A100-SXM4-80GB`, `a100 sxm4 80gb` and `NVIDIA A100-SXM4-80GB` meet.
fn normalize(s: &str) -> String {
    let lower: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                ' '
            }
        })
        .collect();
    lower
        .split_whitespace()
        .filter(|w| !matches!(*w, "nvidia" | "geforce" | "tesla" | "amd" | "instinct"))
        .collect::<Vec<_>>()
        .concat()
}

struct Index {
    /// Whole cards (the first `cards` entries), then MIG slices.
    specs: Vec<GpuSpec>,
    cards: usize,
    by_key: HashMap<String, usize>,
}

fn index() -> &'static Index {
    static INDEX: OnceLock<Index> = OnceLock::new();
    INDEX.get_or_init(|| {
        let specs: Vec<GpuSpec> = ROWS
            .iter()
            .map(|r| GpuSpec {
                name: r.name.to_string(),
                memory_bytes: r.memory_mib * MIB,
                compute_capability: r.cc.to_string(),
                bf16: r.bf16,
                fp8: r.fp8,
                bf16_tflops: r.tflops,
                fp32_tflops: r.fp32_tflops,
                memory_bandwidth_gbs: r.bandwidth_gbs,
            })
            .collect();
        let mut by_key = HashMap::new();
        for (i, r) in ROWS.iter().enumerate() {
            by_key.insert(normalize(r.name), i);
            for a in r.aliases {
                by_key.insert(normalize(a), i);
            }
        }
        let cards = specs.len();
        let mut specs = specs;
        for (parent, profiles) in MIG_PARENTS {
            let Some(&p) = by_key.get(&normalize(parent)) else {
                continue;
            };
            let parent = specs[p].clone();
            for (profile, eighths, mib) in *profiles {
                let slice = mig_spec(&parent, profile, *eighths, *mib);
                by_key.insert(normalize(&slice.name), specs.len());
                specs.push(slice);
            }
        }
        Index {
            specs,
            cards,
            by_key,
        }
    })
}

/// Looks a GPU up by NVML/nvidia-smi name, case- and punctuation-tolerant.
/// An unknown name is an error listing close matches, never a guess.
pub fn lookup_gpu(name: &str) -> Result<GpuSpec, CatalogError> {
    let idx = index();
    let key = normalize(name);
    if let Some(&i) = idx.by_key.get(&key) {
        return Ok(idx.specs[i].clone());
    }
    if let Some(slice) = mig_by_parts(name) {
        return Ok(slice);
    }
    Err(CatalogError::UnknownGpu {
        name: name.to_string(),
        suggestions: close_matches(&key),
    })
}

/// A MIG slice named by a card alias and a profile (`a100-40gb MIG
/// 1g.5gb`, `h100-sxm-mig-1g.10gb+me`): the card resolved on its own, the
/// profile's media-extension suffix (`+me`, or `.me` as GPU Feature
/// Discovery writes it in resource names: same memory) dropped.
fn mig_by_parts(name: &str) -> Option<GpuSpec> {
    let at = name.to_ascii_lowercase().rfind("mig")?;
    let (parent, profile) = (&name[..at], &name[at + 3..]);
    let profile = profile
        .trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .trim_end_matches("+me")
        .trim_end_matches(".me");
    let card = lookup_gpu(parent.trim_end_matches(|c: char| !c.is_ascii_alphanumeric())).ok()?;
    let idx = index();
    let key = normalize(&format!("{} MIG {profile}", card.name));
    idx.by_key.get(&key).map(|&i| idx.specs[i].clone())
}

/// Up to three catalog names close to `key`: names containing it (so `a100`
/// lists every A100 rather than picking one), then by edit distance.
fn close_matches(key: &str) -> Vec<String> {
    let idx = index();
    if key.is_empty() {
        return Vec::new();
    }
    let mut scored: Vec<(usize, usize)> = Vec::new();
    for (i, r) in ROWS.iter().enumerate() {
        let mut best = usize::MAX;
        for cand in std::iter::once(r.name).chain(r.aliases.iter().copied()) {
            let c = normalize(cand);
            let d = if c.contains(key) || key.contains(&c) {
                0
            } else {
                super::edit_distance(key, &c)
            };
            best = best.min(d);
        }
        scored.push((best, i));
    }
    scored.sort();
    let limit = (key.len() / 2).max(2);
    let zero = scored.iter().filter(|(d, _)| *d == 0).count();
    scored
        .into_iter()
        .filter(|(d, _)| *d <= limit)
        .take(zero.max(3))
        .map(|(_, i)| idx.specs[i].name.clone())
        .collect()
}

/// Every GPU in the catalog (whole cards; MIG slices: [`all_mig_slices`]).
pub fn all_gpus() -> Vec<GpuSpec> {
    let idx = index();
    idx.specs[..idx.cards].to_vec()
}

/// Every MIG slice of the catalog's cards.
pub fn all_mig_slices() -> Vec<GpuSpec> {
    let idx = index();
    idx.specs[idx.cards..].to_vec()
}

/// The MIG slice `profile` (`1g.5gb`, `mig-1g.5gb`, `MIG 1g.5gb`) of the
/// card `parent` (any spelling [`lookup_gpu`] takes): how a pod's
/// `nvidia.com/mig-<profile>` resource on a node of that card resolves.
pub fn lookup_mig(parent: &str, profile: &str) -> Result<GpuSpec, CatalogError> {
    let card = lookup_gpu(parent)?;
    let profile = profile.trim();
    let profile = profile
        .strip_prefix("mig-")
        .or_else(|| profile.strip_prefix("MIG "))
        .unwrap_or(profile);
    lookup_gpu(&format!("{} MIG {profile}", card.name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::GIB;

    #[test]
    fn nvml_names_resolve_to_their_cards() {
        let a = lookup_gpu("NVIDIA A100-SXM4-80GB").unwrap();
        assert_eq!(a.memory_bytes, 81920 * MIB);
        assert_eq!(a.compute_capability, "8.0");
        assert!(a.bf16 && !a.fp8);
        let h = lookup_gpu("NVIDIA H100 80GB HBM3").unwrap();
        assert_eq!(h.memory_bytes, 81559 * MIB);
        assert!(h.fp8);
        let t = lookup_gpu("Tesla T4").unwrap();
        assert!(!t.bf16);
        assert_eq!(t.compute_capability, "7.5");
    }

    #[test]
    fn lookup_ignores_case_and_punctuation() {
        assert_eq!(
            lookup_gpu("a100-80gb").unwrap().name,
            "NVIDIA A100-SXM4-80GB"
        );
        assert_eq!(
            lookup_gpu("nvidia_a100_sxm4_80gb").unwrap().name,
            "NVIDIA A100-SXM4-80GB"
        );
        assert_eq!(
            lookup_gpu("NVIDIA-GeForce-RTX-4090").unwrap().name,
            "NVIDIA GeForce RTX 4090"
        );
        assert_eq!(lookup_gpu("t4").unwrap().name, "Tesla T4");
    }

    #[test]
    fn ambiguous_name_is_an_error_listing_every_candidate() {
        let Err(CatalogError::UnknownGpu { suggestions, .. }) = lookup_gpu("A100") else {
            panic!("`A100` must not silently pick one of the A100s");
        };
        assert!(suggestions.iter().any(|s| s.contains("40GB")));
        assert!(suggestions.iter().any(|s| s.contains("80GB")));
    }

    #[test]
    fn unknown_gpu_suggests_close_names() {
        let Err(e) = lookup_gpu("NVIDIA H100 80GB HBM") else {
            panic!("a misspelt name must be an error");
        };
        let msg = e.to_string();
        assert!(msg.contains("NVIDIA H100 80GB HBM3"), "{msg}");
        assert!(lookup_gpu("Voodoo 5").is_err());
    }

    #[test]
    fn precision_flags_follow_compute_capability() {
        for g in all_gpus() {
            if let Some((maj, min)) = g.compute_capability.split_once('.') {
                let v: u32 = maj.parse::<u32>().unwrap() * 10 + min.parse::<u32>().unwrap();
                assert_eq!(g.bf16, v >= 80, "{}", g.name);
                assert_eq!(g.fp8, v >= 89, "{}", g.name);
            }
        }
    }

    #[test]
    fn catalog_memory_is_below_marketing_size_but_close() {
        for g in all_gpus() {
            assert!(g.memory_bytes > 14 * GIB, "{}", g.name);
            assert_eq!(g.memory_bytes % MIB, 0, "{} is whole MiB", g.name);
        }
        assert!(all_gpus().len() >= 25);
    }

    /// The slice's NVML name without its profile: the parent card.
    fn parent_of(slice: &GpuSpec) -> GpuSpec {
        let (parent, _) = slice.name.rsplit_once(" MIG ").expect("a MIG name");
        lookup_gpu(parent).expect("the parent is in the catalog")
    }

    proptest::proptest! {
        /// Every MIG profile resolves to one spec whichever way it is
        /// spelt — NVML's device name, GPU Feature Discovery's product
        /// label, the card plus the `nvidia.com/mig-<profile>` resource,
        /// any letter case — with less memory than its card and the
        /// card's precision support.
        #[test]
        fn every_mig_profile_resolves_from_every_spelling(
            i in 0usize..1000,
            upper in proptest::bool::ANY,
        ) {
            let slices = all_mig_slices();
            let slice = &slices[i % slices.len()];
            let parent = parent_of(slice);
            let profile = slice.name.rsplit_once(" MIG ").unwrap().1;
            let case = |s: String| if upper { s.to_uppercase() } else { s };
            let gfd = slice.name.replace(' ', "-");
            let spellings = [
                lookup_gpu(&case(slice.name.clone())),
                lookup_gpu(&case(gfd)),
                lookup_mig(&parent.name.replace(' ', "-"), &format!("mig-{profile}")),
            ];
            for s in spellings {
                proptest::prop_assert_eq!(s.as_ref(), Ok(slice));
            }
            proptest::prop_assert!(slice.memory_bytes < parent.memory_bytes);
            proptest::prop_assert_eq!(slice.bf16, parent.bf16);
            proptest::prop_assert_eq!(slice.fp8, parent.fp8);
            proptest::prop_assert_eq!(&slice.compute_capability, &parent.compute_capability);
            proptest::prop_assert!(slice.memory_bandwidth_gbs <= parent.memory_bandwidth_gbs);
        }
    }

    #[test]
    fn mig_slices_have_the_memory_nvidia_smi_reports_not_the_names_figure() {
        let s = lookup_gpu("NVIDIA A100-SXM4-40GB MIG 1g.5gb").unwrap();
        assert_eq!(
            s.memory_bytes,
            4864 * MIB,
            "4.75 GiB, below the name's 5 GB"
        );
        assert!(s.bf16);
        assert_eq!(s.compute_capability, "8.0");
        let h = lookup_gpu("NVIDIA-H100-80GB-HBM3-MIG-3g.40gb").unwrap();
        assert_eq!(h.memory_bytes, 40448 * MIB);
        assert!(h.fp8);
        // a card alias, the media-extension variant, the resource name
        let me = lookup_gpu("h100-sxm MIG 1g.10gb+me").unwrap();
        assert_eq!(me.name, "NVIDIA H100 80GB HBM3 MIG 1g.10gb");
        // GPU Feature Discovery's spelling of the same (`+` as `.`).
        assert_eq!(
            lookup_gpu("NVIDIA-H100-80GB-HBM3-MIG-1g.10gb.me").unwrap(),
            me
        );
        assert_eq!(
            lookup_mig("NVIDIA-H100-80GB-HBM3", "1g.10gb.me").unwrap(),
            me
        );
        let r = lookup_mig("NVIDIA-A100-SXM4-80GB", "mig-1g.10gb").unwrap();
        assert_eq!(r.memory_bytes, 9728 * MIB);
        assert_eq!(
            lookup_gpu("NVIDIA H200 MIG 1g.18gb").unwrap().memory_bytes,
            16 * GIB
        );
        // a profile the card does not have
        assert!(lookup_gpu("NVIDIA A100-SXM4-40GB MIG 1g.10gb").is_ok());
        assert!(lookup_gpu("NVIDIA A100-SXM4-40GB MIG 1g.18gb").is_err());
        assert!(lookup_mig("NVIDIA H100 80GB HBM3", "mig-1g.5gb").is_err());
        // slices are listed apart from whole cards, every one once
        let slices = all_mig_slices();
        assert_eq!(slices.len(), 7 * 6);
        assert!(all_gpus().iter().all(|g| !g.name.contains(" MIG ")));
    }

    /// The throughput model times the optimizer step by the bandwidth: a
    /// catalog card without one would silently drop that step.
    #[test]
    fn every_catalog_gpu_has_a_memory_bandwidth_within_datasheet_range() {
        for g in all_gpus() {
            assert!(
                (300.0..=8000.0).contains(&g.memory_bandwidth_gbs),
                "{}: {} GB/s",
                g.name,
                g.memory_bandwidth_gbs
            );
        }
        let h100 = lookup_gpu("h100-sxm").unwrap();
        let h200 = lookup_gpu("h200").unwrap();
        assert_eq!(h100.memory_bandwidth_gbs, 3350.0);
        assert_eq!(h200.memory_bandwidth_gbs, 4800.0);
    }

    /// The CUDA cores' fp32 rate is below the tensor cores' 16-bit rate on
    /// every card (the throughput model divides by it), and the Hopper
    /// datacenter parts share one datasheet figure.
    #[test]
    fn every_catalog_gpu_has_an_fp32_rate_below_its_tensor_rate() {
        for g in all_gpus() {
            assert!(
                g.fp32_tflops > 0.0 && g.fp32_tflops < g.bf16_tflops,
                "{}: fp32 {} against {} TFLOP/s",
                g.name,
                g.fp32_tflops,
                g.bf16_tflops
            );
        }
        for name in ["h100-sxm", "h200", "gh200"] {
            assert_eq!(lookup_gpu(name).unwrap().fp32_tflops, 66.9, "{name}");
        }
    }
}
