//! The crate's top-level error: each layer has its own enum, wrapped here.

use thiserror::Error;

/// Result alias for the crate's top-level error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, Error)]
pub enum Error {
    #[error(transparent)]
    Catalog(#[from] crate::core::catalog::CatalogError),
    /// A workload that does not resolve or hold together, the field at
    /// fault named as the command line names it (its flag).
    /// (Not a `source`: the domain's wording of the same message would
    /// repeat it as a cause.)
    #[error("{}", .0.render(&crate::cli::common::CliNames))]
    Workload(crate::core::workload::WorkloadError),
    #[error(transparent)]
    Memory(#[from] crate::core::memory::MemoryError),
    /// What would fit said with the command line's flags (not a `source`,
    /// as for `Workload`).
    #[error("{}", .0.render(&crate::cli::common::CliChanges))]
    Advisor(crate::core::advisor::AdvisorError),
    #[error(transparent)]
    LogParse(#[from] crate::core::logs::LogParseError),
    #[error(transparent)]
    History(#[from] crate::history::HistoryError),
    #[error(transparent)]
    Sidecar(#[from] crate::sidecar::SidecarError),
    #[error(transparent)]
    Controller(#[from] crate::controller::ControllerError),
    #[error(transparent)]
    Slurm(#[from] crate::slurm::SlurmError),
    /// A command-line argument is wrong: names the flag and the fix.
    #[error("{0}")]
    Usage(String),
    /// Stopped by a signal (its number); the exit code is 128 + it.
    #[error("interrupted by signal {0}; the running trial was stopped")]
    Interrupted(i32),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl From<crate::core::workload::WorkloadError> for Error {
    fn from(e: crate::core::workload::WorkloadError) -> Self {
        Error::Workload(e)
    }
}

impl From<crate::core::advisor::AdvisorError> for Error {
    fn from(e: crate::core::advisor::AdvisorError) -> Self {
        Error::Advisor(e)
    }
}

impl Error {
    /// A short, static, low-cardinality label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Catalog(_) => "catalog",
            Error::Workload(_) => "workload",
            Error::Memory(_) => "memory",
            Error::Advisor(_) => "advisor",
            Error::LogParse(_) => "log_parse",
            Error::History(_) => "history",
            Error::Sidecar(_) => "sidecar",
            Error::Controller(_) => "controller",
            Error::Slurm(_) => "slurm",
            Error::Usage(_) => "usage",
            Error::Interrupted(_) => "interrupted",
            Error::Io { .. } => "io",
        }
    }

    /// Process exit code for the CLI: 2 usage/bad input, 3 does-not-fit,
    /// 4 external service (history store, sidecar, controller), 1 anything else.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Usage(_)
            | Error::Catalog(_)
            | Error::Workload(_)
            | Error::Memory(_)
            | Error::LogParse(_) => 2,
            Error::Advisor(crate::core::advisor::AdvisorError::DoesNotFit { .. }) => 3,
            Error::Advisor(_) => 2,
            Error::History(h)
            | Error::Controller(crate::controller::ControllerError::History(h)) => {
                history_exit_code(h)
            }
            // A bad flag, environment variable or file is the user's input
            // (`--simulate-mig 0:9g.99gb`), not the service failing.
            Error::Sidecar(
                crate::sidecar::SidecarError::Config(_)
                | crate::sidecar::SidecarError::BadRequest(_),
            ) => 2,
            Error::Sidecar(_) | Error::Controller(_) | Error::Slurm(_) => 4,
            Error::Interrupted(signo) => u8::try_from(128 + signo).unwrap_or(1),
            // A file the user named that is not there (or not theirs to
            // read) is bad input, not a failure of gpufit.
            Error::Io { source, .. }
                if matches!(
                    source.kind(),
                    std::io::ErrorKind::NotFound
                        | std::io::ErrorKind::PermissionDenied
                        | std::io::ErrorKind::IsADirectory
                ) =>
            {
                2
            }
            Error::Io { .. } => 1,
        }
    }
}

/// A history URL that cannot name a store is bad input (2); a store that
/// does not answer is an external failure (4).
fn history_exit_code(e: &crate::history::HistoryError) -> u8 {
    use crate::history::HistoryError;
    match e {
        HistoryError::BadUrl(_) | HistoryError::Invalid(_) => 2,
        // The PostgreSQL store reports a URL it cannot parse as a Store
        // error; its message is the only mark of it.
        HistoryError::Store { message, .. } if message.starts_with("invalid PostgreSQL URL") => 2,
        _ => 4,
    }
}
