//! `gpufit apply`.

use std::process::ExitCode;

use super::Global;

#[derive(Debug, clap::Args)]
pub struct ApplyArgs {}

pub fn run(_g: &Global, _args: ApplyArgs) -> crate::Result<ExitCode> {
    Err(crate::Error::Usage(
        "`gpufit apply` is not implemented yet".into(),
    ))
}
