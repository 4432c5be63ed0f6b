//! The bearer token shared by the controller (which checks it) and its
//! clients (the Slurm Epilog, the sidecar's write endpoint).

use std::path::{Path, PathBuf};

/// Why a token file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenFileError {
    #[error("cannot read token file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// An empty token would let any empty `Authorization` header through.
    #[error("token file {} is empty: put a long random token in it (e.g. `openssl rand -hex 32`)", path.display())]
    Empty { path: PathBuf },
}

/// Reads a bearer token from a file (surrounding whitespace trimmed).
pub fn read_token_file(path: &Path) -> Result<String, TokenFileError> {
    let text = std::fs::read_to_string(path).map_err(|source| TokenFileError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let token = text.trim().to_string();
    if token.is_empty() {
        return Err(TokenFileError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(token)
}
