//! The pure core must not know about HTTP, Kubernetes, databases or NVML
//! (STYLE.md): adapters call the core, never the reverse.

use std::path::Path;

const FORBIDDEN: &[&str] = &[
    "kube",
    "k8s_openapi",
    "hyper",
    "hyper_util",
    "tokio",
    "rusqlite",
    "postgres",
    "tokio_postgres",
    "nvml_wrapper",
    "ureq",
    "crate::history",
    "crate::sidecar",
    "crate::controller",
    "crate::slurm",
    "crate::cli",
];

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src/core is readable") {
        let p = entry.expect("dir entry").path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn pure_core_imports_no_io_crates_and_no_adapters() {
    let mut files = Vec::new();
    rust_files(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src/core"),
        &mut files,
    );
    assert!(
        files.len() >= 5,
        "expected the core's modules under src/core"
    );
    let mut offenders = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).expect("readable source");
        for (n, line) in text.lines().enumerate() {
            let l = line.trim_start();
            for krate in FORBIDDEN {
                let uses = l.starts_with(&format!("use {krate}::"))
                    || l.starts_with(&format!("use {krate};"))
                    || l.contains(&format!(" {krate}::"))
                    || l.contains(&format!("({krate}::"));
                if uses && !l.starts_with("//") {
                    offenders.push(format!("{}:{}: {}", f.display(), n + 1, l));
                }
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "pure core reaches an adapter or I/O crate:\n{}",
        offenders.join("\n")
    );
}
