//! The GPUs of the synthetic fleet histories the history benches fill:
//! NVML names, each in the catalog (the benches size their peaks from it).

pub const GPUS: [&str; 5] = [
    "NVIDIA A100-SXM4-80GB",
    "NVIDIA H100 80GB HBM3",
    "NVIDIA A10G",
    "NVIDIA L40S",
    "NVIDIA GeForce RTX 4090",
];
