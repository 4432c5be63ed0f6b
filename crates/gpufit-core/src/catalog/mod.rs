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

pub use gpus::{
    all_gpus, all_mig_slices, lookup_gpu, lookup_mig, mig_base_profile, mig_cards, mig_catalog,
    GpuSpec, MigCatalogEntry, MigMemorySource,
};
pub use models::{
    all_models, arch_from_hf_config, lookup_model, small_task_head_in_hf_config, ModelRef,
};

/// Levenshtein distance over bytes (names are ASCII after normalisation),
/// used to list close matches for an unknown name.
pub(crate) fn edit_distance(a: &str, b: &str) -> usize {
    let a = a.as_bytes();
    let b = b.as_bytes();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for (i, ca) in a.iter().enumerate() {
        cur[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}
