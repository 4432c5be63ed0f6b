//! `gpufit plan`: the three strategies side by side, with data-loader advice.

use crate::cli::common::TextRows;
use std::process::ExitCode;

use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};

use super::suggest::{AdviceArgs, Resolved};
use super::{print_json, Global, OutputFormat};
use crate::core::advisor::{Strategy, Suggestion};
use crate::core::units::fmt_gib;

#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    #[command(flatten)]
    pub advice: AdviceArgs,
}

pub fn run(g: &Global, args: PlanArgs) -> crate::Result<ExitCode> {
    let r = args.advice.resolve()?;
    let plan: Vec<Suggestion> = Strategy::ALL
        .iter()
        .map(|&s| r.suggest(s))
        .collect::<crate::Result<_>>()?;
    match g.output {
        OutputFormat::Json => print_json(&plan)?,
        OutputFormat::Table => print_plan(&r, &plan),
    }
    Ok(ExitCode::SUCCESS)
}

fn on_off(b: bool) -> String {
    if b { "on" } else { "off" }.to_string()
}

fn print_plan(r: &Resolved, plan: &[Suggestion]) {
    let model = &r.workload.model.name;
    let gpus = r.workload.gpus;
    let Some(first) = plan.first() else {
        return;
    };
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    let mut header = vec![format!("{model} on {}", first.gpu)];
    header.extend(plan.iter().map(|s| s.strategy.to_string()));
    t.set_header(header);
    type Row<'a> = (&'a str, &'a dyn Fn(&Suggestion) -> String);
    let rows: [Row; 12] = [
        ("micro_batch_size", &|s| {
            s.settings.micro_batch_size.to_string()
        }),
        ("gradient_accumulation_steps", &|s| {
            s.settings.gradient_accumulation_steps.to_string()
        }),
        ("effective batch", &|s| s.effective_batch(gpus).to_string()),
        ("dtype", &|s| s.settings.dtype.to_string()),
        ("activation_checkpointing", &|s| {
            on_off(s.settings.activation_checkpointing)
        }),
        ("compile", &|s| on_off(s.settings.compile)),
        ("predicted peak", &|s| fmt_gib(s.predicted_peak_bytes)),
        ("memory used", &|s| {
            format!("{:.0} %", s.memory_fraction * 100.0)
        }),
        ("target", &|s| {
            format!("{:.0} %", r.targets.for_strategy(s.strategy) * 100.0)
        }),
        ("throughput", &|s| super::suggest::fmt_tokens_per_sec(s)),
        ("confidence", &|s| format!("{:.2}", s.confidence)),
        ("source", &|s| s.source.as_str().to_string()),
    ];
    for (name, f) in rows {
        let mut row = vec![name.to_string()];
        row.extend(plan.iter().map(f));
        t.add_text_row(row);
    }
    println!("{t}");
    let dl = &first.settings.dataloader;
    println!(
        "Data loader: num_workers={} pin_memory={} persistent_workers={} prefetch_factor={} \
         (one core per GPU stays with the training process; more than 8 workers rarely help tokenised text).",
        dl.num_workers, dl.pin_memory, dl.persistent_workers, dl.prefetch_factor
    );
    for s in plan {
        println!("{}: {}", s.strategy, s.reasoning);
        for w in &s.warnings {
            println!("  warning: {w}");
        }
    }
}
