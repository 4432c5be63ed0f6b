//! Model catalog: architecture numbers from each model's published config.json.

use crate::core::workload::{Method, ModelArch};

use super::CatalogError;

/// A resolved model reference: the architecture, plus the method when the
/// name implies one (torchtune `llama3_1/8B_lora_single_device` → LoRA).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelRef {
    pub arch: ModelArch,
    pub method: Option<Method>,
}

/// Resolves a Hugging Face id, short id, torchtune config name or torchtune
/// component path to a catalog model.
pub fn lookup_model(name: &str) -> Result<ModelRef, CatalogError> {
    Err(CatalogError::UnknownModel {
        name: name.to_string(),
        suggestions: vec![],
    })
}

/// Parses a Hugging Face `config.json` text into an architecture.
pub fn arch_from_hf_config(name: &str, json: &str) -> Result<ModelArch, CatalogError> {
    let _ = json;
    Err(CatalogError::BadConfig {
        path: name.to_string(),
        message: "not implemented".into(),
    })
}

/// Every model in the catalog.
pub fn all_models() -> Vec<ModelArch> {
    Vec::new()
}
