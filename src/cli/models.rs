//! `gpufit models`.

use std::process::ExitCode;

use super::Global;

#[derive(Debug, clap::Args)]
pub struct ModelsArgs {}

pub fn run(_g: &Global, _args: ModelsArgs) -> crate::Result<ExitCode> {
    Err(crate::Error::Usage(
        "`gpufit models` is not implemented yet".into(),
    ))
}
