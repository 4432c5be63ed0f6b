//! The controller's HTTP API used by the Slurm hooks (`POST /v1/suggest`,
//! `POST /v1/runs`, `GET /v1/runs`), with a bearer token for writes.

use std::net::SocketAddr;
use std::path::PathBuf;

use super::ControllerError;

/// How the API server is started.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    pub listen: SocketAddr,
    pub history_url: String,
    pub token_file: Option<PathBuf>,
}

/// Serves the API until `shutdown` resolves.
pub async fn serve(
    cfg: ApiConfig,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), ControllerError> {
    let _ = (cfg, shutdown);
    Err(ControllerError::Other(
        "the controller HTTP API is not implemented yet".into(),
    ))
}
