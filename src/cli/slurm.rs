//! `gpufit slurm task-prolog|prolog|epilog`: the Slurm hooks (docs/slurm.md;
//! docs/design.md, "Slurm and the controller's HTTP API").
//!
//! Each always exits 0: a failing TaskProlog fails the user's job and a
//! failing Prolog/Epilog drains the node, so gpufit being down or
//! misconfigured must never do either. Problems are logged to stderr.

use std::io::Write;
use std::process::ExitCode;

use super::Global;
use crate::slurm::exec;

#[derive(Debug, clap::Args)]
pub struct SlurmArgs {
    #[command(subcommand)]
    pub hook: SlurmHook,
}

#[derive(Debug, clap::Subcommand)]
pub enum SlurmHook {
    /// TaskProlog (runs as the job's user): prints `export GPUFIT_…=value`
    /// lines with the suggested settings, and nothing else on stdout.
    TaskProlog,
    /// Prolog (root): writes the GPU → job mapping files the sidecar reads.
    Prolog,
    /// Epilog (root): records the job's run with its peak GPU memory.
    Epilog,
}

pub fn run(_g: &Global, args: SlurmArgs) -> crate::Result<ExitCode> {
    let env = exec::read_env();
    match args.hook {
        SlurmHook::TaskProlog => {
            let lines = exec::task_prolog(env);
            if !lines.is_empty() {
                let mut out = std::io::stdout().lock();
                let text = lines.join("\n") + "\n";
                if let Err(e) = out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
                    tracing::warn!("gpufit task-prolog: cannot print the settings: {e}");
                }
            }
        }
        SlurmHook::Prolog => exec::prolog(env),
        SlurmHook::Epilog => exec::epilog(env),
    }
    Ok(ExitCode::SUCCESS)
}
