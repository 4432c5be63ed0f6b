//! `gpufit gpus`: the GPU catalog (and, with `--live`, the GPUs on this node).

use std::process::ExitCode;

use comfy_table::{presets::UTF8_FULL_CONDENSED, Cell, CellAlignment, Table};

use super::{Global, OutputFormat};
use crate::core::catalog::{all_gpus, all_mig_slices, lookup_gpu, GpuSpec};
use crate::core::units::to_gib;

#[derive(Debug, clap::Args)]
pub struct GpusArgs {
    /// Show only this GPU (NVML name, case- and punctuation-tolerant).
    pub name: Option<String>,
    /// Show the GPUs on this node as the sidecar's source reads them (NVML unless --backend says otherwise).
    #[arg(long, env = "GPUFIT_GPUS_LIVE")]
    pub live: bool,
    #[command(flatten)]
    pub source: super::sidecar::BackendArgs,
}

/// The rows to print: one named GPU, or the whole catalog (cards, then
/// their MIG slices).
fn catalog_rows(args: &GpusArgs) -> crate::Result<Vec<GpuSpec>> {
    Ok(match &args.name {
        Some(n) => vec![lookup_gpu(n)?],
        None => all_gpus().into_iter().chain(all_mig_slices()).collect(),
    })
}

pub fn run(g: &Global, args: GpusArgs) -> crate::Result<ExitCode> {
    if args.live {
        return super::sidecar::print_live(g, &args.source, args.name.as_deref());
    }
    let rows = catalog_rows(&args)?;
    print_gpus(g, &rows)?;
    Ok(ExitCode::SUCCESS)
}

/// Prints GPUs as a table or JSON (shared with the live listing).
pub fn print_gpus(g: &Global, rows: &[GpuSpec]) -> crate::Result<()> {
    match g.output {
        OutputFormat::Json => super::print_json(&rows),
        OutputFormat::Table => {
            let mut t = Table::new();
            t.load_preset(UTF8_FULL_CONDENSED);
            t.set_header(vec![
                "name",
                "memory GiB",
                "compute cap.",
                "bf16",
                "fp8",
                "bf16 TFLOP/s",
                "memory GB/s",
            ]);
            for r in rows {
                t.add_row(vec![
                    Cell::new(super::common::cell_text(&r.name)),
                    Cell::new(format!("{:.2}", to_gib(r.memory_bytes)))
                        .set_alignment(CellAlignment::Right),
                    Cell::new(super::common::cell_text(&r.compute_capability)),
                    Cell::new(if r.bf16 { "yes" } else { "no" }),
                    Cell::new(if r.fp8 { "yes" } else { "no" }),
                    Cell::new(format!("{:.0}", r.bf16_tflops)).set_alignment(CellAlignment::Right),
                    Cell::new(format!("{:.0}", r.memory_bandwidth_gbs))
                        .set_alignment(CellAlignment::Right),
                ]);
            }
            println!("{t}");
            Ok(())
        }
    }
}
