//! The controller: the Kubernetes `TrainingJob` reconciler, the admission
//! webhook, leader election, and the HTTP API the Slurm hooks use.

pub mod api;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum ControllerError {
    #[error("{0}")]
    Other(String),
}
