//! `gpufit estimate`.

use std::process::ExitCode;

use super::Global;

#[derive(Debug, clap::Args)]
pub struct EstimateArgs {}

pub fn run(_g: &Global, _args: EstimateArgs) -> crate::Result<ExitCode> {
    Err(crate::Error::Usage(
        "`gpufit estimate` is not implemented yet".into(),
    ))
}
