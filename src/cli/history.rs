//! `gpufit history`.

use std::process::ExitCode;

use super::Global;

#[derive(Debug, clap::Args)]
pub struct HistoryArgs {}

pub fn run(_g: &Global, _args: HistoryArgs) -> crate::Result<ExitCode> {
    Err(crate::Error::Usage(
        "`gpufit history` is not implemented yet".into(),
    ))
}
