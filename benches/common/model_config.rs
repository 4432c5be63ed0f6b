//! The model of a benchmark data row: gpufit's catalog, else the published
//! `config.json` kept in `bench/data/configs/<owner>__<name>.json`. Shared
//! by the accuracy and saved-tensor benches (`#[path]` include).

use std::path::Path;

use gpufit::core::catalog::{arch_from_hf_config, lookup_model};
use gpufit::core::workload::ModelArch;

pub fn model(name: &str) -> Result<ModelArch, String> {
    if let Ok(m) = lookup_model(name) {
        return Ok(m.arch);
    }
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("bench/data/configs")
        .join(format!("{}.json", name.replace('/', "__")));
    let text = std::fs::read_to_string(&path).map_err(|e| {
        format!(
            "model `{name}` is not in the catalog and {} cannot be read: {e}",
            path.display()
        )
    })?;
    arch_from_hf_config(name, &text).map_err(|e| e.to_string())
}
