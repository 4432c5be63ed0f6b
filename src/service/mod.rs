//! What the controller's HTTP API and the Slurm hooks' local mode both do,
//! so `src/slurm` does not depend on `src/controller`
//! (`tests/architecture.rs`): resolve a request, read the similar runs and
//! ask the advisor ([`suggest`]), and read the shared bearer token
//! ([`token`]). Blocking; no HTTP.

pub mod suggest;
pub mod token;

pub use suggest::{canonical_model, resolve_gpu, resolve_workload, suggest_blocking, SuggestError};
pub use token::{read_token_file, TokenFileError};
