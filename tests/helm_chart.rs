//! The Helm chart (charts/gpufit) checked without a helm binary or a cluster.
//!
//! `scripts/helm_check.py` renders the chart with Helm's own Go library
//! (PyPI helm-python-sdk), lints it, validates every manifest against the
//! Kubernetes schemas in strict mode (PyPI kubernetes-validate) and checks the
//! chart's invariants (least-privilege RBAC, opt-in fail-open webhook, leader
//! election, sidecar only on GPU nodes, dashboards). This test runs it once
//! and then checks what only Rust can: that every command line the chart
//! renders is accepted by gpufit's own clap definitions, and that the chart's
//! CRD is the one the controller generates.
//!
//! Needs the Python environment from `bash scripts/helm_venv.sh` (and
//! `promtool`, from Debian's prometheus package, for the dashboards' PromQL);
//! without them the test fails and says so — it never skips.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command as Process, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use clap::{CommandFactory, Parser};
use gpufit::cli::{Cli, Command};
use serde::Deserialize;

/// Rendering ~9 value sets and ~13 refusals takes a few seconds; a minute
/// of slack for a loaded CI machine.
const CHECK_TIMEOUT: Duration = Duration::from_secs(240);

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// One rendered container: argv (command + args) and its GPUFIT_* env names.
#[derive(Debug, Deserialize)]
struct Rendered {
    command: Vec<String>,
    env: Vec<String>,
}

/// value-set name -> component ("controller" | "sidecar") -> what it runs.
type Dump = BTreeMap<String, BTreeMap<String, Rendered>>;

struct CheckRun {
    ok: bool,
    output: String,
    dump: Option<Dump>,
}

/// Runs helm_check.py once for all tests of this file.
fn check_run() -> &'static Result<CheckRun, String> {
    static RUN: OnceLock<Result<CheckRun, String>> = OnceLock::new();
    RUN.get_or_init(run_helm_check)
}

fn run_helm_check() -> Result<CheckRun, String> {
    let python: PathBuf = root().join(".build/helm-venv/bin/python");
    if !python.exists() {
        return Err(format!(
            "{} is missing: run `bash scripts/helm_venv.sh` to create the Python \
             environment (helm-python-sdk + kubernetes-validate) the chart checks need",
            python.display()
        ));
    }
    let dir = tempfile::tempdir().map_err(|e| format!("cannot create a temp dir: {e}"))?;
    let dump_path = dir.path().join("args.json");
    let out_path = dir.path().join("output.txt");
    let out_file =
        std::fs::File::create(&out_path).map_err(|e| format!("cannot create {out_path:?}: {e}"))?;
    let err_file = out_file
        .try_clone()
        .map_err(|e| format!("cannot clone a file handle: {e}"))?;
    let mut child = Process::new(&python)
        .arg(root().join("scripts/helm_check.py"))
        .arg("--dump-args")
        .arg(&dump_path)
        .current_dir(root())
        .stdin(Stdio::null())
        .stdout(out_file)
        .stderr(err_file)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", python.display()))?;
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() > CHECK_TIMEOUT => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "scripts/helm_check.py ran longer than {CHECK_TIMEOUT:?} and was stopped"
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("cannot wait for scripts/helm_check.py: {e}"));
            }
        }
    };
    let output = std::fs::read_to_string(&out_path).unwrap_or_default();
    let dump = match std::fs::read_to_string(&dump_path) {
        Ok(text) => Some(
            serde_json::from_str::<Dump>(&text)
                .map_err(|e| format!("helm_check.py wrote unreadable --dump-args JSON: {e}"))?,
        ),
        Err(_) => None,
    };
    Ok(CheckRun {
        ok: status.success(),
        output,
        dump,
    })
}

fn run_or_fail() -> &'static CheckRun {
    match check_run() {
        Ok(run) => run,
        Err(msg) => panic!("{msg}"),
    }
}

fn dump_or_fail() -> &'static Dump {
    let run = run_or_fail();
    match &run.dump {
        Some(d) => d,
        None => panic!(
            "helm_check.py wrote no command lines; its output:\n{}",
            run.output
        ),
    }
}

#[test]
fn chart_renders_lints_and_validates_for_every_value_set() {
    let run = run_or_fail();
    assert!(
        run.ok,
        "scripts/helm_check.py found problems in charts/gpufit:\n{}",
        run.output
    );
    assert!(
        run.output.contains("helm_check: ok"),
        "helm_check.py exited 0 without its summary line:\n{}",
        run.output
    );
}

#[test]
fn every_rendered_command_line_is_accepted_by_the_gpufit_cli() {
    let dump = dump_or_fail();
    assert!(
        dump.get("defaults")
            .is_some_and(|d| d.contains_key("controller") && d.contains_key("sidecar")),
        "the default values must run both the controller and the sidecar: {dump:?}"
    );
    let mut checked = 0;
    for (case, components) in dump {
        for (component, rendered) in components {
            let cli = Cli::try_parse_from(&rendered.command).unwrap_or_else(|e| {
                panic!(
                    "value set {case:?}: the chart runs `{}`, which gpufit rejects:\n{e}",
                    rendered.command.join(" ")
                )
            });
            let runs_the_right_subcommand = matches!(
                (component.as_str(), &cli.command),
                ("controller", Command::Controller(_)) | ("sidecar", Command::Sidecar(_))
            );
            assert!(
                runs_the_right_subcommand,
                "value set {case:?}: the {component} container runs `{}`",
                rendered.command.join(" ")
            );
            // The Kueue namespace selector is read after the flags: it must
            // be a LabelSelector gpufit reads, not only a string clap takes.
            if let Command::Controller(args) = &cli.command {
                gpufit::controller::kueue::Unlabelled::managing(
                    &args.kueue_managed_jobs_namespace_selector,
                )
                .unwrap_or_else(|e| panic!("value set {case:?}: {e}"));
            }
            checked += 1;
        }
    }
    assert!(checked >= 10, "only {checked} command lines were checked");
}

#[test]
fn every_gpufit_env_var_the_chart_sets_is_read_by_the_binary() {
    let dump = dump_or_fail();
    let cli = Cli::command();
    for (case, components) in dump {
        for (component, rendered) in components {
            let sub = cli.find_subcommand(component).unwrap_or_else(|| {
                panic!("gpufit has no `{component}` subcommand (value set {case:?})")
            });
            let known: Vec<String> = cli
                .get_arguments()
                .chain(sub.get_arguments())
                .filter_map(|a| a.get_env())
                .map(|e| e.to_string_lossy().into_owned())
                .collect();
            for name in &rendered.env {
                assert!(
                    known.contains(name),
                    "value set {case:?}: the chart sets {name} for `gpufit {component}`, \
                     which reads none such (it reads {known:?})"
                );
            }
        }
    }
}

#[test]
fn the_chart_crd_is_the_crd_the_controller_generates() {
    let chart_copy = root().join("charts/gpufit/crds/trainingjob.yaml");
    let chart_text = std::fs::read_to_string(&chart_copy)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", chart_copy.display()));
    assert!(
        chart_text.contains("name: trainingjobs.gpufit.io"),
        "{} is not the TrainingJob CRD",
        chart_copy.display()
    );
    let generated = root().join("crds/trainingjob.yaml");
    if generated.exists() {
        let generated_text = std::fs::read_to_string(&generated)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", generated.display()));
        assert!(
            chart_text == generated_text,
            "charts/gpufit/crds/trainingjob.yaml differs from crds/trainingjob.yaml: \
             copy it (`cp crds/trainingjob.yaml charts/gpufit/crds/`)"
        );
    }
}

/// Every `.rs` file under `dir`, recursively.
fn rust_sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries =
        std::fs::read_dir(dir).unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()));
    for entry in entries {
        let path = entry
            .unwrap_or_else(|e| panic!("cannot read an entry of {}: {e}", dir.display()))
            .path();
        if path.is_dir() {
            rust_sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `gpufit_…` metric names in a PromQL expression, with the suffixes
/// Prometheus adds to histograms removed.
fn metric_names(expr: &str) -> Vec<String> {
    let re = regex::Regex::new(r"\bgpufit_[a-z0-9_]+").expect("static regex");
    re.find_iter(expr)
        .map(|m| {
            let name = m.as_str();
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name)
                .to_string()
        })
        .collect()
}

#[test]
fn dashboards_only_query_metrics_that_gpufit_exports() {
    let dir = root().join("charts/gpufit/dashboards");
    let mut used = std::collections::BTreeSet::new();
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("cannot read {dir:?}: {e}")) {
        let path = entry
            .unwrap_or_else(|e| panic!("cannot read an entry of {dir:?}: {e}"))
            .path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
        let json: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path:?} is not JSON: {e}"));
        let mut stack = vec![&json];
        while let Some(v) = stack.pop() {
            match v {
                serde_json::Value::Object(m) => {
                    for (k, v) in m {
                        match (k.as_str(), v) {
                            ("expr" | "definition", serde_json::Value::String(s)) => {
                                used.extend(metric_names(s))
                            }
                            _ => stack.push(v),
                        }
                    }
                }
                serde_json::Value::Array(a) => stack.extend(a),
                _ => {}
            }
        }
    }
    assert!(
        used.len() >= 5,
        "the dashboards query only {used:?}: expected the sidecar's and the controller's metrics"
    );
    let mut files = Vec::new();
    rust_sources(&root().join("src"), &mut files);
    let sources: String = files
        .iter()
        .map(|p| std::fs::read_to_string(p).unwrap_or_default())
        .collect();
    let missing: Vec<&String> = used
        .iter()
        .filter(|m| !sources.contains(&format!("\"{m}\"")))
        .collect();
    assert!(
        missing.is_empty(),
        "the dashboards query {missing:?}, which no metric definition under src/ exports \
         (rename the panel's query, or export the metric)"
    );
}
