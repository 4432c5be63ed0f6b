//! `gpufit profile`.

use std::process::ExitCode;

use super::Global;

#[derive(Debug, clap::Args)]
pub struct ProfileArgs {}

pub fn run(_g: &Global, _args: ProfileArgs) -> crate::Result<ExitCode> {
    Err(crate::Error::Usage(
        "`gpufit profile` is not implemented yet".into(),
    ))
}
