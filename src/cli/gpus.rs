//! `gpufit gpus`.

use std::process::ExitCode;

use super::Global;

#[derive(Debug, clap::Args)]
pub struct GpusArgs {}

pub fn run(_g: &Global, _args: GpusArgs) -> crate::Result<ExitCode> {
    Err(crate::Error::Usage(
        "`gpufit gpus` is not implemented yet".into(),
    ))
}
