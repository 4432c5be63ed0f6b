//! gpufit picks the engineering settings of GPU training jobs (micro batch,
//! gradient accumulation, precision, activation checkpointing, compile, data
//! loader) so each job fills its GPU without running out of memory, and
//! learns from every finished job.
//!
//! Module map — data flows one way, adapters call the core:
//!
//! | module        | what it owns                                                     |
//! |---------------|------------------------------------------------------------------|
//! | [`core`]      | the pure core (crate `gpufit-core`, `crates/gpufit-core`): workload/settings types, GPU and model catalogs, memory model, advisor, learner, log parsers. No I/O crates. |
//! | [`history`]   | run-history stores behind one trait: SQLite (default), PostgreSQL, JSON Lines |
//! | [`sidecar`]   | node-local GPU reader (NVML, inventory, simulate), job attribution, HTTP API, Prometheus metrics |
//! | [`controller`]| Kubernetes controller (TrainingJob CRD, reconcile pipeline, webhook, leader election) and the HTTP API the Slurm hooks use |
//! | [`slurm`]     | Slurm TaskProlog / Prolog / Epilog: a pure plan plus a thin executor |
//! | [`wire`]      | the JSON of the sidecar's and the controller's HTTP APIs, defined once (serde types only) |
//! | [`serve`]     | the one HTTP server behind the sidecar, the controller's API + `/metrics` and the webhook: connection cap under the descriptor limit, timeouts, accept back-off, graceful drain |
//! | [`service`]   | what the controller's API and the Slurm hooks share: the blocking suggestion, the token file |
//! | [`cli`]       | the `gpufit` command line (clap) |
#![forbid(unsafe_code)]

pub mod cli;
pub mod controller;
/// The pure core lives in its own crate (`crates/gpufit-core`), so the
/// compiler keeps I/O crates out of it; `gpufit::core` is that crate.
pub use gpufit_core as core;
pub mod error;
pub mod history;
pub mod serve;
pub mod service;
pub mod sidecar;
pub mod slurm;
pub mod wire;

pub use error::{Error, Result};
