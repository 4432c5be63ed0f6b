//! `gpufit controller`.

use std::process::ExitCode;

use super::Global;

#[derive(Debug, clap::Args)]
pub struct ControllerArgs {}

pub fn run(_g: &Global, _args: ControllerArgs) -> crate::Result<ExitCode> {
    Err(crate::Error::Usage(
        "`gpufit controller` is not implemented yet".into(),
    ))
}
