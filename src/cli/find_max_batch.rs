//! `gpufit find-max-batch`.

use std::process::ExitCode;

use super::Global;

#[derive(Debug, clap::Args)]
pub struct FindMaxBatchArgs {}

pub fn run(_g: &Global, _args: FindMaxBatchArgs) -> crate::Result<ExitCode> {
    Err(crate::Error::Usage(
        "`gpufit find-max-batch` is not implemented yet".into(),
    ))
}
