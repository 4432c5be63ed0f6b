//! The model of a benchmark data row: gpufit's catalog, else the published
//! `config.json` kept in `bench/data/configs/<owner>__<name>.json`. Shared
//! by the accuracy and saved-tensor benches (`#[path]` include).

use std::path::Path;

use gpufit::core::catalog::{arch_from_hf_config, lookup_model};
use gpufit::core::workload::ModelArch;

pub fn model(name: &str) -> Result<ModelArch, String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("bench/data/configs")
        .join(format!("{}.json", name.replace('/', "__")));
    if let Ok(mut m) = lookup_model(name) {
        // The attention window is the measured model's: scripts/
        // gpu_measure.py builds its models from the numbers it writes to
        // bench/data/configs/, and where those leave `sliding_window` out
        // the config class's default holds (Phi-3: none, not the published
        // 2,047; Mistral: 4,096).
        if let Ok(text) = std::fs::read_to_string(&path) {
            let measured = arch_from_hf_config(name, &text).map_err(|e| e.to_string())?;
            m.arch.quirks.sliding_window = measured.quirks.sliding_window;
            m.arch.quirks.alternating_sliding_window = measured.quirks.alternating_sliding_window;
        }
        return Ok(m.arch);
    }
    let text = std::fs::read_to_string(&path).map_err(|e| {
        format!(
            "model `{name}` is not in the catalog and {} cannot be read: {e}",
            path.display()
        )
    })?;
    arch_from_hf_config(name, &text).map_err(|e| e.to_string())
}
