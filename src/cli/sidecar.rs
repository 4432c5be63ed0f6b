//! `gpufit sidecar`.

use std::process::ExitCode;

use super::Global;

#[derive(Debug, clap::Args)]
pub struct SidecarArgs {}

pub fn run(_g: &Global, _args: SidecarArgs) -> crate::Result<ExitCode> {
    Err(crate::Error::Usage(
        "`gpufit sidecar` is not implemented yet".into(),
    ))
}
