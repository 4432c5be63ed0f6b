//! `gpufit suggest`.

use std::process::ExitCode;

use super::Global;

#[derive(Debug, clap::Args)]
pub struct SuggestArgs {}

pub fn run(_g: &Global, _args: SuggestArgs) -> crate::Result<ExitCode> {
    Err(crate::Error::Usage(
        "`gpufit suggest` is not implemented yet".into(),
    ))
}
