//! `gpufit slurm`.

use std::process::ExitCode;

use super::Global;

#[derive(Debug, clap::Args)]
pub struct SlurmArgs {}

pub fn run(_g: &Global, _args: SlurmArgs) -> crate::Result<ExitCode> {
    Err(crate::Error::Usage(
        "`gpufit slurm` is not implemented yet".into(),
    ))
}
