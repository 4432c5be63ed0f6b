//! `gpufit record`.

use std::process::ExitCode;

use super::Global;

#[derive(Debug, clap::Args)]
pub struct RecordArgs {}

pub fn run(_g: &Global, _args: RecordArgs) -> crate::Result<ExitCode> {
    Err(crate::Error::Usage(
        "`gpufit record` is not implemented yet".into(),
    ))
}
