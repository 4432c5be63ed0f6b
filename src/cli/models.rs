//! `gpufit models`: the model catalog.

use std::process::ExitCode;

use comfy_table::{presets::UTF8_FULL_CONDENSED, Cell, CellAlignment, Table};
use serde::Serialize;

use super::{Global, OutputFormat};
use crate::core::catalog::models::aliases;
use crate::core::catalog::{all_models, lookup_model};
use crate::core::workload::ModelArch;

#[derive(Debug, clap::Args)]
pub struct ModelsArgs {
    /// Show only this model (any accepted name: HF id, short id, torchtune name).
    pub name: Option<String>,
}

#[derive(Serialize)]
struct Row {
    #[serde(flatten)]
    arch: ModelArch,
    aliases: Vec<String>,
}

pub fn run(g: &Global, args: ModelsArgs) -> crate::Result<ExitCode> {
    let archs = match &args.name {
        Some(n) => vec![lookup_model(n)?.arch],
        None => all_models(),
    };
    let rows: Vec<Row> = archs
        .into_iter()
        .map(|a| Row {
            aliases: aliases(&a.name),
            arch: a,
        })
        .collect();
    match g.output {
        OutputFormat::Json => super::print_json(&rows)?,
        OutputFormat::Table => {
            let mut t = Table::new();
            t.load_preset(UTF8_FULL_CONDENSED);
            t.set_header(vec![
                "model", "params", "hidden", "layers", "heads/kv", "MLP", "vocab", "context",
                "also",
            ]);
            for r in &rows {
                let a = &r.arch;
                let experts = if a.num_experts > 1 {
                    format!(" ×{} (top {})", a.num_experts, a.experts_per_token)
                } else {
                    String::new()
                };
                t.add_row(vec![
                    Cell::new(super::common::cell_text(&a.name)),
                    Cell::new(format!("{:.2} B", a.params as f64 / 1e9))
                        .set_alignment(CellAlignment::Right),
                    Cell::new(a.hidden_size).set_alignment(CellAlignment::Right),
                    Cell::new(a.num_layers).set_alignment(CellAlignment::Right),
                    Cell::new(format!("{}/{}", a.num_attention_heads, a.num_kv_heads)),
                    Cell::new(format!("{}{experts}", a.intermediate_size)),
                    Cell::new(a.vocab_size).set_alignment(CellAlignment::Right),
                    Cell::new(a.max_position_embeddings).set_alignment(CellAlignment::Right),
                    // short id and torchtune name; JSON lists every alias
                    Cell::new(super::common::cell_text(&short_aliases(&r.aliases))),
                ]);
            }
            println!("{t}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Aliases without an organisation prefix (short ids, torchtune names).
fn short_aliases(all: &[String]) -> String {
    all.iter()
        .filter(|a| {
            !a.contains('/')
                || a.split('/').next().is_some_and(|p| {
                    !p.contains('-') && p.contains('_')
                        || p.chars()
                            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
                })
        })
        .cloned()
        .collect::<Vec<_>>()
        .join(", ")
}
