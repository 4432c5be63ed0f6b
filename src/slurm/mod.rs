//! Slurm integration: TaskProlog asks for a suggestion and prints
//! `export GPUFIT_…=value` lines; Prolog writes GPU→job mapping files;
//! Epilog reports the run. A pure `plan` plus a thin executor.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum SlurmError {
    #[error("{0}")]
    Other(String),
}
