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

/// Where a MIG slice's memory figure comes from (docs/gpus.md lists each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum MigMemorySource {
    /// The "Memory GiB" column of `nvidia-smi mig -lgip` on a real card
    /// (what NVML and PyTorch then report as the slice's total).
    Lgip,
    /// `MemorySizeMB` of the GPU instance profile in NVIDIA/go-nvml's mock
    /// devices (`pkg/nvml/mock/gpus/*.go`), where it is a figure below the
    /// profile name's (A100, A30); the H100, H200 and B200 mocks only
    /// restate the name's figure in GiB, above what real slices report, so
    /// they are not used.
    GoNvml,
    /// No measured figure: 8/9 of the profile name's figure read as GiB,
    /// the lowest ratio of a measured slice to its name (H200 `1g.18gb`:
    /// 16.00 GiB). Planning for a little less than the slice has costs
    /// headroom, never an OOM; a node's GFD `.memory` label, when lower,
    /// wins at planning time.
    Derived,
}

impl MigMemorySource {
    /// A short name for tables.
    pub fn as_str(self) -> &'static str {
        match self {
            MigMemorySource::Lgip => "nvidia-smi mig -lgip",
            MigMemorySource::GoNvml => "go-nvml mock",
            MigMemorySource::Derived => "derived (8/9 of the name)",
        }
    }
}

/// One MIG profile of a card: `(profile, memory eighths, usable MiB, source)`.
///
/// Profiles and their "Fraction of Memory" (eighths; A30 and RTX PRO
/// quarters and halves counted as eighths) are the tables of NVIDIA's
/// Multi-Instance GPU User Guide r580, "Supported MIG Profiles", and the
/// profile names of NVIDIA/mig-parted v0.15.0 `config-default.yaml` (the
/// H100 94/96 GB, H20, GH200 and GB200 ones the guide's tables leave out).
/// The usable memory is *not* the figure in the profile's name: it is the
/// smallest of the sources in [`MigMemorySource`] that give one. Measured
/// (`nvidia-smi mig -lgip`): A100 40GB 4.75 / 9.75 / 19.62 / 39.50 GiB,
/// A100 80GB 9.50 / 19.50 / 39.25 / 79.00 GiB, H100 80GB 9.75 / 19.62 / 39.50 / 79.25 GiB, H200 16.00 / 32.50 / 140.00
/// GiB (1g.18gb, 2g.35gb, 7g.141gb); go-nvml's A100 and A30 mocks; the rest
/// derived. Media-extension and graphics variants (`+me`, `+me.all`,
/// `-me`, `+gfx`) have their base profile's memory and resolve to it.
type MigProfile = (&'static str, u64, u64, MigMemorySource);

use MigMemorySource::{Derived, GoNvml, Lgip};

/// A profile without a measured figure: 8/9 of `name_gb` GiB
/// ([`MigMemorySource::Derived`]); a test checks `name_gb` is the name's.
const fn d(profile: &'static str, eighths: u64, name_gb: u64) -> MigProfile {
    (profile, eighths, name_gb * 1024 * 8 / 9, Derived)
}

// A100 40GB: min(lgip, go-nvml a100_40gb: 4864 / 9856 / 19968 / 40192).
const MIG_A100_40GB: &[MigProfile] = &[
    ("1g.5gb", 1, 4864, Lgip),
    ("1g.10gb", 2, 9856, GoNvml),
    ("2g.10gb", 2, 9856, GoNvml),
    ("3g.20gb", 4, 19968, GoNvml),
    ("4g.20gb", 4, 19968, GoNvml),
    ("7g.40gb", 8, 40192, GoNvml),
];
// A100 80GB: lgip 9.50 / 19.50 / 39.25 / 79.00 GiB; go-nvml a100_80gb:
// 9856 / 19968 / 40192 / 80384 (equal figures credited to lgip).
const MIG_A100_80GB: &[MigProfile] = &[
    ("1g.10gb", 1, 9728, Lgip),
    ("1g.20gb", 2, 19968, Lgip),
    ("2g.20gb", 2, 19968, Lgip),
    ("3g.40gb", 4, 40192, Lgip),
    ("4g.40gb", 4, 40192, Lgip),
    ("7g.80gb", 8, 80384, GoNvml),
];
// A30 24GB: quarters (1/4, 2/4, full); go-nvml a30_24gb.
const MIG_A30: &[MigProfile] = &[
    ("1g.6gb", 2, 5836, GoNvml),
    ("2g.12gb", 4, 11672, GoNvml),
    ("4g.24gb", 8, 23344, GoNvml),
];
const MIG_H100_80GB: &[MigProfile] = &[
    ("1g.10gb", 1, 9984, Lgip),
    ("1g.20gb", 2, 20096, Lgip),
    ("2g.20gb", 2, 20096, Lgip),
    ("3g.40gb", 4, 40448, Lgip),
    ("4g.40gb", 4, 40448, Lgip),
    ("7g.80gb", 8, 81152, Lgip),
];
// H100 94GB (NVL, SXM5 94GB): mig-parted "H100 NVL, H800 NVL".
const MIG_H100_94GB: &[MigProfile] = &[
    d("1g.12gb", 1, 12),
    d("1g.24gb", 2, 24),
    d("2g.24gb", 2, 24),
    d("3g.47gb", 4, 47),
    d("4g.47gb", 4, 47),
    d("7g.94gb", 8, 94),
];
// H100 96GB (H100 on GH200, H20): mig-parted "H100-96GB, PG506-96GB, GH200, H20".
const MIG_H100_96GB: &[MigProfile] = &[
    d("1g.12gb", 1, 12),
    d("1g.24gb", 2, 24),
    d("2g.24gb", 2, 24),
    d("3g.48gb", 4, 48),
    d("4g.48gb", 4, 48),
    d("7g.96gb", 8, 96),
];
// H200 141GB (SXM5, NVL): lgip 16.00 / 32.50 / 140.00 GiB.
const MIG_H200: &[MigProfile] = &[
    ("1g.18gb", 1, 16384, Lgip),
    ("1g.35gb", 2, 33280, Lgip),
    ("2g.35gb", 2, 33280, Lgip),
    d("3g.71gb", 4, 71),
    d("4g.71gb", 4, 71),
    ("7g.141gb", 8, 143360, Lgip),
];
// GH200 144G HBM3e: mig-parted "GH200 144G HBM3e".
const MIG_GH200_144GB: &[MigProfile] = &[
    d("1g.18gb", 1, 18),
    d("1g.36gb", 2, 36),
    d("2g.36gb", 2, 36),
    d("3g.72gb", 4, 72),
    d("4g.72gb", 4, 72),
    d("7g.144gb", 8, 144),
];
const MIG_B200: &[MigProfile] = &[
    d("1g.23gb", 1, 23),
    d("1g.45gb", 2, 45),
    d("2g.45gb", 2, 45),
    d("3g.90gb", 4, 90),
    d("4g.90gb", 4, 90),
    d("7g.180gb", 8, 180),
];
// GB200: mig-parted "GB200 HGX".
const MIG_GB200: &[MigProfile] = &[
    d("1g.23gb", 1, 23),
    d("1g.47gb", 2, 47),
    d("2g.47gb", 2, 47),
    d("3g.93gb", 4, 93),
    d("4g.93gb", 4, 93),
    d("7g.186gb", 8, 186),
];
// RTX PRO 6000 Blackwell: quarters (1/4, 1/2, full).
const MIG_RTX_PRO_6000: &[MigProfile] = &[
    d("1g.24gb", 2, 24),
    d("2g.48gb", 4, 48),
    d("4g.96gb", 8, 96),
];
// RTX PRO 5000 Blackwell: the guide lists `2g.24gb-me` only (its base
// profile is offered through it).
const MIG_RTX_PRO_5000: &[MigProfile] = &[
    d("1g.12gb", 2, 12),
    d("2g.24gb", 4, 24),
    d("4g.48gb", 8, 48),
];

/// A MIG-capable card the whole-card catalog ([`ROWS`]) lacks: its slices
/// are known, the card itself is not (no NVML total or datasheet rates
/// here): `gpufit suggest --gpu "NVIDIA A30 MIG 1g.6gb"` works,
/// `--gpu "NVIDIA A30"` does not.
struct MigOnlyCard {
    name: &'static str,
    aliases: &'static [&'static str],
    /// Compute capability: the MIG guide's "Supported GPU Products" table.
    cc: &'static str,
}

/// Every card in the MIG guide's "Supported GPU Products" (r580) with its
/// profiles: by the NVML name of a catalog card, or a [`MigOnlyCard`].
/// (GB300 and B300, in mig-parted but not in that list, are left out.)
const MIG_PARENTS: &[(&str, &[MigProfile])] = &[
    ("NVIDIA A100-SXM4-40GB", MIG_A100_40GB),
    ("NVIDIA A100-PCIE-40GB", MIG_A100_40GB),
    ("NVIDIA A100-SXM4-80GB", MIG_A100_80GB),
    ("NVIDIA A100 80GB PCIe", MIG_A100_80GB),
    ("NVIDIA A30", MIG_A30),
    ("NVIDIA H100 80GB HBM3", MIG_H100_80GB),
    ("NVIDIA H100 PCIe", MIG_H100_80GB),
    ("NVIDIA H100 NVL", MIG_H100_94GB),
    ("NVIDIA H100 SXM5 94GB", MIG_H100_94GB),
    ("NVIDIA GH200 480GB", MIG_H100_96GB),
    ("NVIDIA H20", MIG_H100_96GB),
    ("NVIDIA H200", MIG_H200),
    ("NVIDIA H200 NVL", MIG_H200),
    ("NVIDIA GH200 144G HBM3e", MIG_GH200_144GB),
    ("NVIDIA B200", MIG_B200),
    ("NVIDIA GB200", MIG_GB200),
    (
        "NVIDIA RTX PRO 6000 Blackwell Server Edition",
        MIG_RTX_PRO_6000,
    ),
    (
        "NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
        MIG_RTX_PRO_6000,
    ),
    (
        "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition",
        MIG_RTX_PRO_6000,
    ),
    ("NVIDIA RTX PRO 5000 Blackwell", MIG_RTX_PRO_5000),
];

/// The MIG parents [`ROWS`] lacks. Names as NVML prints them where known
/// (GFD product labels in public tests: `NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition`);
/// the aliases take the MIG guide's and go-nvml's spellings.
const MIG_ONLY_CARDS: &[MigOnlyCard] = &[
    MigOnlyCard {
        name: "NVIDIA A30",
        aliases: &["a30", "a30-pcie-24gb", "a30-24gb"],
        cc: "8.0",
    },
    MigOnlyCard {
        name: "NVIDIA H100 SXM5 94GB",
        aliases: &["h100-sxm5-94gb", "h100-94gb"],
        cc: "9.0",
    },
    MigOnlyCard {
        name: "NVIDIA H20",
        aliases: &["h20", "h20-96gb"],
        cc: "9.0",
    },
    MigOnlyCard {
        name: "NVIDIA H200 NVL",
        aliases: &["h200-nvl"],
        cc: "9.0",
    },
    MigOnlyCard {
        name: "NVIDIA GH200 144G HBM3e",
        aliases: &["gh200-144gb", "gh200 144g"],
        cc: "9.0",
    },
    MigOnlyCard {
        name: "NVIDIA GB200",
        aliases: &["gb200"],
        cc: "10.0",
    },
    MigOnlyCard {
        name: "NVIDIA RTX PRO 6000 Blackwell Server Edition",
        aliases: &["rtx-pro-6000-server"],
        cc: "12.0",
    },
    MigOnlyCard {
        name: "NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
        aliases: &["rtx-pro-6000-workstation"],
        cc: "12.0",
    },
    MigOnlyCard {
        name: "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition",
        aliases: &["rtx-pro-6000-max-q"],
        cc: "12.0",
    },
    MigOnlyCard {
        name: "NVIDIA RTX PRO 5000 Blackwell",
        aliases: &["rtx-pro-5000"],
        cc: "12.0",
    },
];

/// The base profile of a MIG profile name, lower case: `1g.10gb+me`,
/// `1g.10gb.me` (GFD's resource spelling), `1g.10gbme` (GFD's product
/// label, `+` dropped), `1g.24gb+gfx`, `2g.24gb-me` → `1g.10gb`… A
/// compute-instance prefix (`1c.3g.40gb`, Slurm's spelling) is dropped
/// too. None when it is not `<n>g.<m>gb…`.
pub fn mig_base_profile(profile: &str) -> Option<String> {
    let p = profile.trim().to_ascii_lowercase();
    let p = p
        .strip_prefix("mig-")
        .or_else(|| p.strip_prefix("mig "))
        .unwrap_or(&p);
    // `1c.3g.40gb`: a compute instance of a `3g.40gb` GPU instance.
    let p = match p.split_once("c.") {
        Some((c, rest)) if !c.is_empty() && c.bytes().all(|b| b.is_ascii_digit()) => rest,
        _ => p,
    };
    let (g, rest) = p.split_once("g.")?;
    if g.is_empty() || !g.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 || !rest[digits..].starts_with("gb") {
        return None;
    }
    Some(format!("{g}g.{}gb", &rest[..digits]))
}

/// One row of the MIG catalog: a slice of a card, with where its memory
/// figure comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MigCatalogEntry {
    /// The card's NVML name.
    pub card: String,
    /// The base profile (`1g.10gb`).
    pub profile: String,
    /// Its share of the card's memory, in eighths.
    pub memory_eighths: u64,
    /// The memory planned for, MiB.
    pub memory_mib: u64,
    pub source: MigMemorySource,
}

/// Every MIG slice the catalog knows, card by card in [`MIG_PARENTS`] order.
pub fn mig_catalog() -> Vec<MigCatalogEntry> {
    MIG_PARENTS
        .iter()
        .flat_map(|(card, profiles)| {
            profiles
                .iter()
                .map(|(profile, eighths, mib, source)| MigCatalogEntry {
                    card: card.to_string(),
                    profile: profile.to_string(),
                    memory_eighths: *eighths,
                    memory_mib: *mib,
                    source: *source,
                })
        })
        .collect()
}

/// The cards with MIG the catalog knows (NVIDIA's list), by NVML name.
pub fn mig_cards() -> Vec<String> {
    MIG_PARENTS.iter().map(|(c, _)| c.to_string()).collect()
}

/// A MIG slice of `parent` with profile `profile` (`1g.5gb`): named as NVML
/// names MIG devices (`NVIDIA A100-SXM4-40GB MIG 1g.5gb`); compute
/// capability and precision from the card; memory from the profile; tensor
/// and fp32 rates scaled by its compute slices out of the card's (7; 4 on
/// A30 and RTX PRO: its largest profile's), bandwidth by its
/// memory slices out of 8 (each slice owns its memory controllers).
fn mig_spec(
    parent: &GpuSpec,
    (profile, eighths, memory_mib, _): &MigProfile,
    compute_slices: f64,
) -> GpuSpec {
    let compute = compute_of(profile);
    let of = compute_slices;
    GpuSpec {
        name: format!("{} MIG {profile}", parent.name),
        memory_bytes: *memory_mib * MIB,
        compute_capability: parent.compute_capability.clone(),
        bf16: parent.bf16,
        fp8: parent.fp8,
        bf16_tflops: parent.bf16_tflops * compute / of,
        fp32_tflops: parent.fp32_tflops * compute / of,
        memory_bandwidth_gbs: parent.memory_bandwidth_gbs * *eighths as f64 / 8.0,
    }
}

/// The compute slices in a profile's name (`3g.40gb` → 3).
fn compute_of(profile: &str) -> f64 {
    profile
        .split_once('g')
        .and_then(|(c, _)| c.parse().ok())
        .unwrap_or(1.0)
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
    /// MIG parents by normalised name or alias: the card's NVML name and
    /// what its slices inherit (compute capability, precision, rates).
    mig_parents: HashMap<String, GpuSpec>,
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
        let mut mig_parents = HashMap::new();
        for c in MIG_ONLY_CARDS {
            // The precision rule of `core::capability` (a test keeps it so);
            // rates unknown: the throughput model leaves them out.
            let v = cc_value(c.cc);
            let spec = GpuSpec {
                name: c.name.to_string(),
                memory_bytes: 0,
                compute_capability: c.cc.to_string(),
                bf16: v >= 80,
                fp8: v >= 89,
                bf16_tflops: 0.0,
                fp32_tflops: 0.0,
                memory_bandwidth_gbs: 0.0,
            };
            for key in std::iter::once(c.name).chain(c.aliases.iter().copied()) {
                mig_parents.insert(normalize(key), spec.clone());
            }
        }
        for (i, r) in ROWS.iter().enumerate() {
            if MIG_PARENTS.iter().any(|(p, _)| *p == r.name) {
                for key in std::iter::once(r.name).chain(r.aliases.iter().copied()) {
                    mig_parents.insert(normalize(key), specs[i].clone());
                }
            }
        }
        let cards = specs.len();
        let mut specs = specs;
        for (parent, profiles) in MIG_PARENTS {
            let Some(parent) = mig_parents.get(&normalize(parent)).cloned() else {
                continue;
            };
            let slices = profiles.iter().map(|p| compute_of(p.0)).fold(1.0, f64::max);
            for p in *profiles {
                let slice = mig_spec(&parent, p, slices);
                by_key.insert(normalize(&slice.name), specs.len());
                specs.push(slice);
            }
        }
        Index {
            specs,
            cards,
            by_key,
            mig_parents,
        }
    })
}

/// `"9.0"` → 90, `"10.0"` → 100; 0 when not `major.minor`.
fn cc_value(cc: &str) -> u32 {
    cc.split_once('.')
        .and_then(|(a, b)| Some(a.parse::<u32>().ok()? * 10 + b.parse::<u32>().ok()?))
        .unwrap_or(0)
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

/// The MIG parent card `name` names (any spelling), when the catalog
/// knows MIG slices of it.
fn mig_parent(name: &str) -> Option<&'static GpuSpec> {
    index().mig_parents.get(&normalize(name))
}

/// A MIG slice named by a card alias and a profile (`a100-40gb MIG
/// 1g.5gb`, `h100-sxm-mig-1g.10gb+me`, GFD's `NVIDIA-A30-MIG-1g.6gb`): the
/// card resolved on its own, the profile's variant suffix (`+me`, `.me`,
/// `+gfx`, `-me`…: same memory) dropped.
fn mig_by_parts(name: &str) -> Option<GpuSpec> {
    let at = name.to_ascii_lowercase().rfind("mig")?;
    let (parent, profile) = (&name[..at], &name[at + 3..]);
    let profile = mig_base_profile(profile.trim_matches(|c: char| !c.is_ascii_alphanumeric()))?;
    let card = mig_parent(parent.trim_end_matches(|c: char| !c.is_ascii_alphanumeric()))?;
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

/// The MIG slice `profile` (`1g.5gb`, `mig-1g.5gb`, `MIG 1g.5gb`,
/// `1g.5gb+me`) of the card `parent` (any spelling of a MIG-capable card):
/// how a pod's `nvidia.com/mig-<profile>` resource on a node of that card
/// resolves.
pub fn lookup_mig(parent: &str, profile: &str) -> Result<GpuSpec, CatalogError> {
    let Some(card) = mig_parent(parent) else {
        // Not a MIG card: the whole-card lookup says why (unknown, ambiguous).
        let card = lookup_gpu(parent)?;
        return Err(CatalogError::UnknownGpu {
            name: format!("{} MIG {}", card.name, profile.trim()),
            suggestions: Vec::new(),
        });
    };
    let name = format!("{} MIG {}", card.name, profile.trim());
    let Some(base) = mig_base_profile(profile) else {
        return Err(CatalogError::UnknownGpu {
            name,
            suggestions: mig_profiles_of(&card.name),
        });
    };
    lookup_gpu(&format!("{} MIG {base}", card.name)).map_err(|_| CatalogError::UnknownGpu {
        name,
        suggestions: mig_profiles_of(&card.name),
    })
}

/// The MIG slices of card `card` (its NVML name), by name.
fn mig_profiles_of(card: &str) -> Vec<String> {
    MIG_PARENTS
        .iter()
        .filter(|(c, _)| *c == card)
        .flat_map(|(c, ps)| ps.iter().map(move |(p, ..)| format!("{c} MIG {p}")))
        .collect()
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
        mig_parent(parent)
            .cloned()
            .expect("the parent is a MIG card")
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
            // A MIG-only card's total is not in the catalog (0).
            proptest::prop_assert!(parent.memory_bytes == 0 || slice.memory_bytes < parent.memory_bytes);
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
        // 140.00 GiB as `nvidia-smi mig -lgip` prints it, not 128.
        assert_eq!(
            lookup_gpu("NVIDIA-H200-MIG-7g.141gb").unwrap().memory_bytes,
            143_360 * MIB
        );
        // a profile the card does not have
        assert!(lookup_gpu("NVIDIA A100-SXM4-40GB MIG 1g.10gb").is_ok());
        assert!(lookup_gpu("NVIDIA A100-SXM4-40GB MIG 1g.18gb").is_err());
        assert!(lookup_mig("NVIDIA H100 80GB HBM3", "mig-1g.5gb").is_err());
        // slices are listed apart from whole cards, every one once
        let slices = all_mig_slices();
        assert_eq!(slices.len(), mig_catalog().len());
        let mut names: Vec<_> = slices.iter().map(|s| s.name.clone()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), slices.len(), "every slice once");
        assert!(all_gpus().iter().all(|g| !g.name.contains(" MIG ")));
    }

    #[test]
    fn every_card_in_nvidias_mig_list_has_its_profiles() {
        let cards = mig_cards();
        assert_eq!(cards.len(), MIG_PARENTS.len());
        for card in &cards {
            let parent = mig_parent(card).unwrap_or_else(|| panic!("{card} resolves"));
            assert_eq!(&parent.name, card);
            assert!(parent.bf16, "{card}: every MIG card is Ampere or later");
            assert!(!mig_profiles_of(card).is_empty(), "{card}");
        }
        for (card, profile) in [
            ("NVIDIA A30", "1g.6gb"),
            ("NVIDIA B200", "1g.23gb"),
            ("NVIDIA B200", "7g.180gb"),
            ("NVIDIA GB200", "7g.186gb"),
            ("NVIDIA H100 NVL", "7g.94gb"),
            ("NVIDIA H20", "3g.48gb"),
            ("NVIDIA GH200 480GB", "7g.96gb"),
            ("NVIDIA GH200 144G HBM3e", "1g.18gb"),
            ("NVIDIA H200 NVL", "7g.141gb"),
            ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "4g.96gb"),
            ("NVIDIA RTX PRO 5000 Blackwell", "2g.24gb"),
        ] {
            let s = lookup_gpu(&format!("{card} MIG {profile}"))
                .unwrap_or_else(|e| panic!("{card} MIG {profile}: {e}"));
            assert_eq!(s.name, format!("{card} MIG {profile}"));
        }
        // Blackwell: fp8 from its compute capability, on a card the
        // whole-card catalog lacks as on one it has.
        let gb = lookup_gpu("NVIDIA GB200 MIG 1g.23gb").unwrap();
        assert_eq!(gb.compute_capability, "10.0");
        assert!(gb.bf16 && gb.fp8);
        let a30 = lookup_gpu("NVIDIA-A30-MIG-1g.6gb").unwrap();
        assert!(a30.bf16 && !a30.fp8);
        assert_eq!(a30.memory_bytes, 5836 * MIB);
        // The card alone is not planned for: its total is not here.
        assert!(lookup_gpu("NVIDIA A30").is_err());
    }

    #[test]
    fn profile_variants_resolve_to_their_base_profile() {
        for (p, want) in [
            ("1g.10gb", Some("1g.10gb")),
            ("1g.10gb+me", Some("1g.10gb")),
            ("1g.10gb.me", Some("1g.10gb")),
            ("1g.10gbme", Some("1g.10gb")),
            ("1g.24gb+me.all", Some("1g.24gb")),
            ("2g.24gb-me", Some("2g.24gb")),
            ("4g.96gb+gfx", Some("4g.96gb")),
            ("mig-3g.40gb", Some("3g.40gb")),
            ("1c.3g.40gb", Some("3g.40gb")),
            ("7G.141GB", Some("7g.141gb")),
            ("INVALID", None),
            ("g.10gb", None),
            ("1g.gb", None),
            ("1g.10", None),
            ("", None),
        ] {
            assert_eq!(mig_base_profile(p).as_deref(), want, "{p}");
        }
        let base = lookup_gpu("NVIDIA RTX PRO 6000 Blackwell Server Edition MIG 1g.24gb").unwrap();
        for v in [
            "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition-MIG-1g.24gb+gfx",
            "NVIDIA RTX PRO 6000 Blackwell Server Edition MIG 1g.24gb-me",
            "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition-MIG-1g.24gbme.all",
        ] {
            assert_eq!(lookup_gpu(v).as_ref(), Ok(&base), "{v}");
        }
        assert!(lookup_gpu("NVIDIA-A100-SXM4-40GB-MIG-INVALID").is_err());
        let err = lookup_mig("NVIDIA B200", "1g.5gb").expect_err("not a B200 profile");
        assert!(err.to_string().contains("NVIDIA B200 MIG 1g.23gb"), "{err}");
        assert!(lookup_mig("Tesla T4", "1g.5gb").is_err(), "no MIG on a T4");
    }

    /// Each figure has the source it names, and every one is at or below
    /// the profile's memory share of what real slices of that size report.
    #[test]
    fn mig_memory_figures_follow_their_sources() {
        for e in mig_catalog() {
            let name_gb: u64 = e
                .profile
                .split_once("g.")
                .unwrap()
                .1
                .trim_end_matches("gb")
                .parse()
                .unwrap();
            let named = name_gb * 1024;
            assert!(
                e.memory_mib < named,
                "{} {}: below the name's figure",
                e.card,
                e.profile
            );
            match e.source {
                MigMemorySource::Derived => {
                    assert_eq!(e.memory_mib, named * 8 / 9, "{} {}", e.card, e.profile)
                }
                // Measured figures sit between 8/9 of the name and the name.
                _ => assert!(e.memory_mib >= named * 8 / 9, "{} {}", e.card, e.profile),
            }
            if let Some(card) = all_gpus().into_iter().find(|g| g.name == e.card) {
                assert!(
                    e.memory_mib * MIB * 8 <= card.memory_bytes * e.memory_eighths + 8 * GIB,
                    "{} {}",
                    e.card,
                    e.profile
                );
            }
        }
        for (i, (_, profiles)) in MIG_PARENTS.iter().enumerate() {
            for p in *profiles {
                if p.3 == MigMemorySource::Derived {
                    // `d`'s `name_gb` is the name's: recomputed above.
                    assert!(p.2 > 0, "{i}");
                }
            }
        }
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
