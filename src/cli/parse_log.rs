//! `gpufit parse-log`.

use std::process::ExitCode;

use super::Global;

#[derive(Debug, clap::Args)]
pub struct ParseLogArgs {}

pub fn run(_g: &Global, _args: ParseLogArgs) -> crate::Result<ExitCode> {
    Err(crate::Error::Usage(
        "`gpufit parse-log` is not implemented yet".into(),
    ))
}
