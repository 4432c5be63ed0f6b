//! `gpufit controller`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use super::Global;
use crate::controller::api::{self, ApiConfig};

#[derive(Debug, clap::Args)]
pub struct ControllerArgs {
    /// Address of the HTTP endpoints (Slurm API, /metrics, /healthz, /readyz).
    #[arg(long, default_value = "0.0.0.0:8080", env = "GPUFIT_LISTEN")]
    pub listen: SocketAddr,
    /// History store URL (sqlite:PATH or postgres://…); default the per-user SQLite file.
    #[arg(long, env = "GPUFIT_HISTORY")]
    pub history: Option<String>,
    /// File holding the bearer token required for writes (POST /v1/runs).
    #[arg(long, env = "GPUFIT_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Serve only the HTTP API (for Slurm sites): no Kubernetes connection.
    #[arg(long, env = "GPUFIT_NO_KUBERNETES")]
    pub no_kubernetes: bool,
}

pub fn run(_g: &Global, args: ControllerArgs) -> crate::Result<ExitCode> {
    let history_url = args
        .history
        .clone()
        .unwrap_or_else(crate::history::default_url);
    let rt = tokio::runtime::Runtime::new().map_err(|e| crate::Error::Io {
        context: "cannot start the async runtime".into(),
        source: e,
    })?;
    if !args.no_kubernetes {
        return Err(crate::Error::Usage(
            "the Kubernetes controller is not implemented yet: use --no-kubernetes".into(),
        ));
    }
    let cfg = ApiConfig {
        listen: args.listen,
        history_url,
        token_file: args.token_file,
    };
    rt.block_on(api::serve(cfg, async {
        let _ = tokio::signal::ctrl_c().await;
    }))?;
    Ok(ExitCode::SUCCESS)
}
