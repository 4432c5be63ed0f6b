//! Built-in catalogs of GPUs and models.

pub mod gpus;
pub mod models;

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum CatalogError {
    #[error("unknown GPU `{name}`{}: run `gpufit gpus` for the list, or give --gpu-memory", did_you_mean(.suggestions))]
    UnknownGpu {
        name: String,
        suggestions: Vec<String>,
    },
    #[error("unknown model `{name}`{}: run `gpufit models` for the list, pass a config.json path, or describe it with --params", did_you_mean(.suggestions))]
    UnknownModel {
        name: String,
        suggestions: Vec<String>,
    },
    #[error("cannot read model config `{path}`: {message}")]
    BadConfig { path: String, message: String },
}

fn did_you_mean(s: &[String]) -> String {
    if s.is_empty() {
        String::new()
    } else {
        format!(" (did you mean {}?)", s.join(", "))
    }
}

pub use gpus::{lookup_gpu, GpuSpec};
pub use models::{lookup_model, ModelRef};
