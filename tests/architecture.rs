//! The pure core must not know about HTTP, Kubernetes, databases or NVML
//! (docs/design.md, "Data flow"): adapters call the core, never the reverse.

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
    for entry in std::fs::read_dir(dir).expect("source directories are readable") {
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
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/gpufit-core/src"),
        &mut files,
    );
    assert!(
        files.len() >= 5,
        "expected the core's modules under crates/gpufit-core/src"
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

fn sources_under(dirs: &[&str]) -> Vec<std::path::PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for d in dirs {
        rust_files(&root.join(d), &mut files);
    }
    files
}

/// Comments used to cite a numbered SPEC section and a STYLE file that were never in the
/// repository; a pointer must lead to a document (and a section of it) that
/// is here.
#[test]
fn comments_point_only_at_documents_in_the_repository() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let design = std::fs::read_to_string(root.join("docs/design.md")).expect("docs/design.md");
    let headings: Vec<&str> = design
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .collect();
    let mut bad = Vec::new();
    for f in sources_under(&["src", "crates/gpufit-core/src", "tests", "benches"]) {
        let text = std::fs::read_to_string(&f).expect("readable source");
        for (n, line) in text.lines().enumerate() {
            let Some(at) = line.find("//") else { continue };
            let comment = &line[at..];
            if comment.contains(concat!("SPEC", " §")) || comment.contains(concat!("STYLE", ".md"))
            {
                bad.push(format!("{}:{}: {}", f.display(), n + 1, line.trim()));
            }
            // A pointer of the form design.md + quoted section name must name a `## ` heading.
            if let Some(i) = comment.find("docs/design.md, \"") {
                let rest = &comment[i + "docs/design.md, \"".len()..];
                let name = rest.split('"').next().unwrap_or("");
                if !headings.iter().any(|h| h.starts_with(name)) {
                    bad.push(format!("{}:{}: no section {name:?}", f.display(), n + 1));
                }
            }
            for doc in [
                "docs/design.md",
                "docs/slurm.md",
                "docs/sidecar-api.md",
                "docs/controller.md",
                "docs/memory-model.md",
            ] {
                if comment.contains(doc) && !root.join(doc).exists() {
                    bad.push(format!("{}:{}: {doc} is missing", f.display(), n + 1));
                }
            }
        }
    }
    assert!(
        bad.is_empty(),
        "references that lead nowhere:\n{}",
        bad.join("\n")
    );
}

/// Lines of the Rust files under `dir` that name one of `forbidden`.
fn offending_lines(dir: &str, forbidden: &[&str]) -> Vec<String> {
    let mut offenders = Vec::new();
    for f in sources_under(&[dir]) {
        let text = std::fs::read_to_string(&f).expect("readable source");
        for (n, line) in text.lines().enumerate() {
            let l = line.trim_start();
            if l.starts_with("//") {
                continue;
            }
            for m in forbidden {
                if l.starts_with(&format!("use {m}::"))
                    || l.starts_with(&format!("use {m};"))
                    || l.contains(&format!(" {m}::"))
                    || l.contains(&format!("({m}::"))
                {
                    offenders.push(format!("{}:{}: {}", f.display(), n + 1, l));
                }
            }
        }
    }
    offenders
}

/// The Slurm hooks share the wire types and the suggestion service with the
/// controller; they never reach into the Kubernetes controller itself.
#[test]
fn slurm_does_not_depend_on_the_controller() {
    let bad = offending_lines("src/slurm", &["crate::controller", "gpufit::controller"]);
    assert!(
        bad.is_empty(),
        "src/slurm uses the controller:\n{}",
        bad.join("\n")
    );
}

/// The admission webhook and the reconcilers share what they both need
/// (the kinds, the keys, the admission plan) through their own modules,
/// never through each other.
#[test]
fn the_webhook_and_the_reconcilers_do_not_import_each_other() {
    let bad = offending_lines(
        "src/controller/webhook",
        &[
            "crate::controller::reconcile",
            "super::super::reconcile",
            "super::reconcile",
        ],
    );
    assert!(
        bad.is_empty(),
        "the webhook uses reconcile/:\n{}",
        bad.join("\n")
    );
    let bad = offending_lines(
        "src/controller/reconcile",
        &[
            "crate::controller::webhook",
            "super::super::webhook",
            "super::webhook",
        ],
    );
    assert!(
        bad.is_empty(),
        "reconcile/ uses the webhook:\n{}",
        bad.join("\n")
    );
}

/// The wire types are serde structs only: no I/O crate, no adapter.
#[test]
fn wire_types_do_no_io() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("src/wire.rs")).expect("src/wire.rs");
    let mut bad = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let l = line.trim_start();
        for krate in FORBIDDEN {
            if !l.starts_with("//")
                && (l.starts_with(&format!("use {krate}::")) || l.contains(&format!(" {krate}::")))
            {
                bad.push(format!("src/wire.rs:{}: {l}", n + 1));
            }
        }
    }
    assert!(bad.is_empty(), "wire types reach I/O:\n{}", bad.join("\n"));
}

/// The shared layers below both adapters: the suggestion service and the
/// wire types reach neither the controller nor the Slurm hooks.
#[test]
fn shared_layers_do_not_depend_on_either_adapter() {
    let mut bad = offending_lines(
        "src/service",
        &["crate::controller", "crate::slurm", "crate::cli"],
    );
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let wire = std::fs::read_to_string(root.join("src/wire.rs")).expect("src/wire.rs");
    for (n, line) in wire.lines().enumerate() {
        for m in [
            "crate::controller",
            "crate::slurm",
            "crate::sidecar",
            "crate::service",
            "crate::cli",
        ] {
            if !line.trim_start().starts_with("//") && line.contains(m) {
                bad.push(format!("src/wire.rs:{}: {}", n + 1, line.trim()));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "a shared layer uses an adapter:\n{}",
        bad.join("\n")
    );
}

/// The core is its own crate: its dependency tree (what the compiler lets
/// it import) holds no Kubernetes, async runtime, HTTP, database or NVML
/// crate.
#[test]
fn the_core_crates_dependency_tree_has_no_io_crate() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "-p",
            "gpufit-core",
            "-e",
            "normal",
            "--prefix",
            "none",
            "--format",
            "{p}",
        ])
        .current_dir(root)
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8_lossy(&out.stdout);
    let names: Vec<&str> = tree
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(
        names.contains(&"gpufit-core"),
        "tree lists the core: {tree}"
    );
    assert!(
        names.contains(&"serde"),
        "tree lists the core's dependencies: {tree}"
    );
    let forbidden = [
        "kube",
        "kube-client",
        "k8s-openapi",
        "tokio",
        "hyper",
        "hyper-util",
        "rusqlite",
        "postgres",
        "tokio-postgres",
        "nvml-wrapper",
        "ureq",
        "gpufit",
    ];
    let bad: Vec<&&str> = names.iter().filter(|n| forbidden.contains(n)).collect();
    assert!(bad.is_empty(), "the core depends on {bad:?}");
}
