//! What the controller's HTTP API and the Slurm hooks' local mode both do,
//! so `src/slurm` does not depend on `src/controller`
//! (`tests/architecture.rs`): the one suggestion pipeline every path uses
//! ([`pipeline`]), a wire request through it ([`suggest`]), and the shared
//! bearer token ([`token`]). Blocking; no HTTP.

pub mod pipeline;
pub mod suggest;
pub mod token;

pub use pipeline::{Ask, Pipeline, PipelineError, SimilarRuns};
pub use suggest::{canonical_model, resolve_gpu, resolve_workload, suggest_blocking, SuggestError};
pub use token::{read_token_file, TokenFileError};
