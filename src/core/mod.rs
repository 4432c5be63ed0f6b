//! The pure core: everything gpufit *knows*, nothing it *does* to the world.
//!
//! No module under `core` may import kube, k8s-openapi, hyper, tokio,
//! rusqlite, postgres or nvml-wrapper (`tests/architecture.rs` enforces it):
//! adapters call the core, never the reverse.

pub mod advisor;
pub mod capability;
pub mod catalog;
pub mod learner;
pub mod logs;
pub mod memory;
pub mod report;
pub mod request;
pub mod run;
pub mod settings;
pub mod similarity;
pub mod throughput;
pub mod units;
pub mod workload;
