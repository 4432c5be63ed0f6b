//! `gpufit profile`: this machine — CPU, RAM, disk, GPUs.

use crate::cli::common::TextRows;
use std::process::ExitCode;

use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};
use serde::Serialize;

use super::{Global, OutputFormat};
use crate::core::catalog::GpuSpec;
use crate::core::units::fmt_gib;

#[derive(Debug, clap::Args)]
pub struct ProfileArgs {
    /// Directory whose filesystem is reported (checkpoints, datasets).
    #[arg(long, default_value = ".")]
    pub disk_path: String,
}

/// What `gpufit profile --output json` prints.
#[derive(Debug, Serialize)]
pub struct Profile {
    pub cpu_model: Option<String>,
    pub cpu_threads: usize,
    pub ram_total_bytes: Option<u64>,
    pub ram_available_bytes: Option<u64>,
    pub disk_path: String,
    pub disk_total_bytes: Option<u64>,
    pub disk_available_bytes: Option<u64>,
    pub gpus: Vec<GpuSpec>,
    /// Why no GPU is listed, when none is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_error: Option<String>,
}

pub fn run(g: &Global, args: ProfileArgs) -> crate::Result<ExitCode> {
    let p = collect(&args.disk_path);
    match g.output {
        OutputFormat::Json => super::print_json(&p)?,
        OutputFormat::Table => {
            let opt = |b: Option<u64>| b.map(fmt_gib).unwrap_or_else(|| "unknown".into());
            let mut t = Table::new();
            t.load_preset(UTF8_FULL_CONDENSED);
            t.set_header(vec!["resource", "value"]);
            t.add_text_row(vec![
                "CPU".to_string(),
                format!(
                    "{} ({} threads)",
                    p.cpu_model.as_deref().unwrap_or("unknown"),
                    p.cpu_threads
                ),
            ]);
            t.add_text_row(vec![
                "RAM".to_string(),
                format!(
                    "{} total, {} available",
                    opt(p.ram_total_bytes),
                    opt(p.ram_available_bytes)
                ),
            ]);
            t.add_text_row(vec![
                format!("disk ({})", p.disk_path),
                format!(
                    "{} total, {} available",
                    opt(p.disk_total_bytes),
                    opt(p.disk_available_bytes)
                ),
            ]);
            if p.gpus.is_empty() {
                t.add_text_row(vec![
                    "GPU".to_string(),
                    format!("none ({})", p.gpu_error.as_deref().unwrap_or("not found")),
                ]);
            }
            for (i, gpu) in p.gpus.iter().enumerate() {
                t.add_text_row(vec![
                    format!("GPU {i}"),
                    format!(
                        "{}, {}, compute capability {}",
                        gpu.name,
                        fmt_gib(gpu.memory_bytes),
                        gpu.compute_capability
                    ),
                ]);
            }
            println!("{t}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Reads everything; each part that cannot be read is `None`, never an error.
pub fn collect(disk_path: &str) -> Profile {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let (disk_total_bytes, disk_available_bytes) = disk_space(disk_path);
    let (gpus, gpu_error) = match crate::sidecar::local_gpu() {
        Ok(g) => (vec![g], None),
        Err(e) => (Vec::new(), Some(e.to_string())),
    };
    Profile {
        cpu_model: cpu_model(&cpuinfo),
        cpu_threads: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        ram_total_bytes: meminfo_kib(&meminfo, "MemTotal").map(|k| k * 1024),
        ram_available_bytes: meminfo_kib(&meminfo, "MemAvailable").map(|k| k * 1024),
        disk_path: disk_path.to_string(),
        disk_total_bytes,
        disk_available_bytes,
        gpus,
        gpu_error,
    }
}

fn cpu_model(cpuinfo: &str) -> Option<String> {
    cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
}

/// `MemTotal:       131072000 kB` → 131072000.
fn meminfo_kib(meminfo: &str, key: &str) -> Option<u64> {
    meminfo
        .lines()
        .find(|l| l.split(':').next() == Some(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// Total and available bytes of the filesystem holding `path`, from POSIX
/// `df -Pk` (the crate forbids the unsafe a direct statvfs call needs).
fn disk_space(path: &str) -> (Option<u64>, Option<u64>) {
    let Ok(out) = std::process::Command::new("df")
        .args(["-Pk", path])
        .output()
    else {
        return (None, None);
    };
    parse_df(&String::from_utf8_lossy(&out.stdout))
}

fn parse_df(text: &str) -> (Option<u64>, Option<u64>) {
    let Some(line) = text.lines().nth(1) else {
        return (None, None);
    };
    let f: Vec<&str> = line.split_whitespace().collect();
    let kib = |i: usize| {
        f.get(i)
            .and_then(|v| v.parse::<u64>().ok())
            .map(|k| k * 1024)
    };
    (kib(1), kib(3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_values_are_read_in_kib() {
        let m = "MemTotal:       16384000 kB\nMemFree: 1 kB\nMemAvailable:   8192000 kB\n";
        assert_eq!(meminfo_kib(m, "MemTotal"), Some(16_384_000));
        assert_eq!(meminfo_kib(m, "MemAvailable"), Some(8_192_000));
        assert_eq!(meminfo_kib(m, "SwapTotal"), None);
    }

    #[test]
    fn df_output_gives_total_and_available_bytes() {
        let df = "Filesystem 1024-blocks Used Available Capacity Mounted on\n/dev/sda1 1000 400 600 40% /\n";
        assert_eq!(parse_df(df), (Some(1000 * 1024), Some(600 * 1024)));
        assert_eq!(parse_df(""), (None, None));
    }

    #[test]
    fn cpu_model_comes_from_the_model_name_line() {
        let c = "processor : 0\nmodel name\t: AMD EPYC 7763 64-Core Processor\n";
        assert_eq!(
            cpu_model(c).as_deref(),
            Some("AMD EPYC 7763 64-Core Processor")
        );
    }

    #[test]
    fn a_machine_without_gpus_still_profiles() {
        let p = collect(".");
        assert!(p.cpu_threads >= 1);
        assert!(p.gpus.is_empty() == p.gpu_error.is_some());
    }
}
