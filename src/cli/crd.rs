//! `gpufit crd`.

use std::process::ExitCode;

use super::Global;

#[derive(Debug, clap::Args)]
pub struct CrdArgs {}

pub fn run(_g: &Global, _args: CrdArgs) -> crate::Result<ExitCode> {
    Err(crate::Error::Usage(
        "`gpufit crd` is not implemented yet".into(),
    ))
}
