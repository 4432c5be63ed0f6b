//! `gpufit crd`: prints the TrainingJob CustomResourceDefinition as YAML
//! (what `crds/trainingjob.yaml` holds; `kubectl apply -f -` installs it).

use std::io::Write;
use std::process::ExitCode;

use super::Global;

#[derive(Debug, clap::Args)]
pub struct CrdArgs {}

pub fn run(_g: &Global, _args: CrdArgs) -> crate::Result<ExitCode> {
    let yaml = crate::controller::crd::crd_yaml().map_err(|e| {
        crate::Error::Usage(format!("cannot render the TrainingJob CRD as YAML: {e}"))
    })?;
    let mut out = std::io::stdout().lock();
    out.write_all(yaml.as_bytes())
        .and_then(|_| out.flush())
        .map_err(|e| crate::Error::Io {
            context: "cannot write the CRD to stdout".into(),
            source: e,
        })?;
    Ok(ExitCode::SUCCESS)
}
