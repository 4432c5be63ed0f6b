//! `gpufit plan`.

use std::process::ExitCode;

use super::Global;

#[derive(Debug, clap::Args)]
pub struct PlanArgs {}

pub fn run(_g: &Global, _args: PlanArgs) -> crate::Result<ExitCode> {
    Err(crate::Error::Usage(
        "`gpufit plan` is not implemented yet".into(),
    ))
}
