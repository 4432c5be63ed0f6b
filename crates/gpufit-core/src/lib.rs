//! The pure core: everything gpufit *knows*, nothing it *does* to the world.
//!
//! This crate (`gpufit-core`) depends on no kube, k8s-openapi, hyper, tokio,
//! rusqlite, postgres or nvml-wrapper: its `Cargo.toml` does not name them, so
//! the compiler refuses any such import (`tests/architecture.rs` also checks
//! `cargo tree`). Adapters — the `gpufit` crate's history stores, sidecar,
//! controller, Slurm hooks, CLI, and the Python package — call the core, never
//! the reverse. Inside the `gpufit` crate this crate is `gpufit::core`.

pub mod advisor;
pub mod capability;
pub mod catalog;
pub mod confirm;
pub mod learner;
pub mod logs;
pub mod memory;
pub mod report;
pub mod request;
pub mod result_record;
pub mod run;
pub mod run_check;
pub mod settings;
pub mod similarity;
pub mod throughput;
pub mod units;
pub mod workload;
