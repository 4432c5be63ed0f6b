//! Slurm integration (docs/design.md, "Slurm and the controller's HTTP API"): the TaskProlog asks for a suggestion and
//! prints `export GPUFIT_…=value` lines; the Prolog writes GPU → job mapping
//! files for the sidecar; the Epilog reports the run. A pure [`plan`] decides,
//! a thin [`exec`] executor does the I/O.

pub mod exec;
pub mod plan;

use std::path::PathBuf;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum SlurmError {
    #[error("{0}")]
    Other(String),
    /// The site config file is unreadable or invalid.
    #[error("site config {}: {message}", path.display())]
    Config { path: PathBuf, message: String },
    /// The job's request (environment or comment) is invalid.
    #[error("{0}")]
    Job(String),
    /// A service (controller, sidecar, history, scontrol) did not answer usefully.
    #[error("{0}")]
    Service(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}
