//! The Kubernetes controller: CRD in sync, pure validate/build steps over
//! YAML fixtures, and reconcile I/O against kube's `Client` over
//! `tower_test::mock`.

use std::process::Command;

// === CRD ===

#[test]
fn checked_in_crd_matches_what_gpufit_crd_prints() {
    let out = Command::new(env!("CARGO_BIN_EXE_gpufit"))
        .arg("crd")
        .output()
        .expect("run gpufit crd");
    assert!(
        out.status.success(),
        "gpufit crd failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8(out.stdout).expect("utf-8 YAML");
    let checked_in = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/crds/trainingjob.yaml"
    ))
    .expect("read crds/trainingjob.yaml");
    assert!(
        printed == checked_in,
        "crds/trainingjob.yaml is out of date: run `cargo run -- crd > crds/trainingjob.yaml`"
    );
    assert!(
        printed.contains("shortNames:\n    - tj"),
        "short name tj missing"
    );
}
