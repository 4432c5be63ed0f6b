//! The one suggestion pipeline: the similar runs of the history, then the
//! advisor. Every path that suggests goes through it — `gpufit suggest`
//! (and `plan`, `apply`, `find-max-batch`), the TrainingJob reconciler, the
//! admission webhook, `POST /v1/suggest` and the Slurm hooks' local mode —
//! so a workload on a GPU gets the same history query and the same advice
//! whichever way it came in. Each path keeps only its own policy: where the
//! runs are read from, and what a failure means to its user. The
//! controller counts what it suggests with
//! `controller::metrics::Metrics::count_suggestion`, the one place that
//! names the metric and its labels.

use std::sync::Arc;

use crate::core::advisor::{
    self, AdviceRequest, AdvisorError, AdvisorOptions, BuiltinModel, Strategy, StrategyTargets,
    Suggestion,
};
use crate::core::catalog::GpuSpec;
use crate::core::run::RunRecord;
use crate::core::settings::Pins;
use crate::core::similarity::HistoryQuery;
use crate::core::workload::Workload;
use crate::history::{HistoryError, HistoryStore};

/// Where a pipeline reads the similar runs: a store, or a cache over one
/// (the webhook's, for bursts of one workload).
pub trait SimilarRuns {
    /// The runs similar to `q`.
    fn similar_runs(&self, q: &HistoryQuery) -> Result<Arc<Vec<RunRecord>>, HistoryError>;
}

impl SimilarRuns for dyn HistoryStore + '_ {
    fn similar_runs(&self, q: &HistoryQuery) -> Result<Arc<Vec<RunRecord>>, HistoryError> {
        self.similar(q).map(Arc::new)
    }
}

/// What is asked: one workload on one GPU, the user's pins, a strategy.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    pub workload: &'a Workload,
    pub gpu: &'a GpuSpec,
    pub strategy: Strategy,
    pub pins: &'a Pins,
}

/// Why the pipeline gave no suggestion.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// The history could not be read: the store's fault, not the request's.
    #[error("history store unavailable: {0}")]
    History(#[source] HistoryError),
    /// The advisor's refusal (nothing fits, a global batch the pins cannot
    /// keep, …): an answer about the request.
    #[error("{0}")]
    Advisor(#[source] AdvisorError),
}

/// The advisor's settings for the pipeline: memory targets per strategy,
/// and the CPU cores per GPU when the caller knows them (the CLI runs on
/// the training machine; the controller does not).
#[derive(Debug, Clone, Copy)]
pub struct Pipeline {
    targets: StrategyTargets,
    cpus_per_gpu: Option<u32>,
}

impl Pipeline {
    pub fn new(targets: StrategyTargets) -> Self {
        Pipeline {
            targets,
            cpus_per_gpu: None,
        }
    }

    /// Data-loader advice for this many CPU cores per GPU.
    pub fn with_cpus_per_gpu(mut self, cpus_per_gpu: Option<u32>) -> Self {
        self.cpus_per_gpu = cpus_per_gpu;
        self
    }

    /// Step 1: the runs of the history similar to this workload on this GPU
    /// (same model, method and GPU model; sequence length nearby).
    pub fn similar_runs(
        history: &(impl SimilarRuns + ?Sized),
        workload: &Workload,
        gpu: &GpuSpec,
    ) -> Result<Arc<Vec<RunRecord>>, HistoryError> {
        let q = HistoryQuery::new(
            &workload.model.name,
            workload.method,
            &gpu.name,
            workload.seq_len,
        );
        history.similar_runs(&q)
    }

    /// Step 2: the advisor's suggestion from runs already read (a caller
    /// asking for several strategies reads the history once).
    pub fn advise(&self, ask: &Ask<'_>, runs: &[RunRecord]) -> Result<Suggestion, AdvisorError> {
        let req = AdviceRequest {
            workload: ask.workload,
            gpu: ask.gpu,
            strategy: ask.strategy,
            targets: self.targets,
            pins: ask.pins,
            history: runs,
        };
        let opts = AdvisorOptions {
            model: &BuiltinModel,
            cpus_per_gpu: self.cpus_per_gpu,
        };
        advisor::suggest_with(&req, &opts)
    }

    /// Both steps. Blocking (reads the history): async callers use
    /// `spawn_blocking`.
    pub fn suggest(
        &self,
        history: &(impl SimilarRuns + ?Sized),
        ask: &Ask<'_>,
    ) -> Result<Suggestion, PipelineError> {
        let runs =
            Self::similar_runs(history, ask.workload, ask.gpu).map_err(PipelineError::History)?;
        self.advise(ask, &runs).map_err(PipelineError::Advisor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::catalog::lookup_gpu;
    use crate::core::request::{ModelRequest, WorkloadRequest};

    /// A store that serves fixed runs and remembers the query it was asked.
    struct Fixed(
        std::sync::Mutex<Option<HistoryQuery>>,
        Result<Vec<RunRecord>, String>,
    );

    impl SimilarRuns for Fixed {
        fn similar_runs(&self, q: &HistoryQuery) -> Result<Arc<Vec<RunRecord>>, HistoryError> {
            *self.0.lock().unwrap() = Some(q.clone());
            self.1
                .clone()
                .map(Arc::new)
                .map_err(|message| HistoryError::Store {
                    url: "fixed:".into(),
                    message,
                })
        }
    }

    fn workload() -> Workload {
        WorkloadRequest {
            model: Some(ModelRequest::Catalog("meta-llama/Llama-3.1-8B".into())),
            seq_len: Some(2048),
            ..WorkloadRequest::default()
        }
        .resolve()
        .expect("catalog workload")
    }

    #[test]
    fn the_history_is_asked_for_the_workloads_model_method_gpu_and_length() {
        let w = workload();
        let gpu = lookup_gpu("NVIDIA A100-SXM4-80GB").unwrap();
        let store = Fixed(Default::default(), Ok(vec![]));
        let ask = Ask {
            workload: &w,
            gpu: &gpu,
            strategy: Strategy::Balanced,
            pins: &Pins::default(),
        };
        let s = Pipeline::new(StrategyTargets::default())
            .suggest(&store, &ask)
            .expect("a suggestion");
        assert_eq!(s.strategy, Strategy::Balanced);
        let asked = store.0.lock().unwrap().clone().expect("history asked");
        assert_eq!(
            asked,
            HistoryQuery::new(&w.model.name, w.method, &gpu.name, w.seq_len)
        );
    }

    #[test]
    fn a_history_that_cannot_be_read_is_told_from_an_advisor_refusal() {
        let w = workload();
        let gpu = lookup_gpu("NVIDIA A100-SXM4-80GB").unwrap();
        let ask = Ask {
            workload: &w,
            gpu: &gpu,
            strategy: Strategy::Balanced,
            pins: &Pins::default(),
        };
        let down = Fixed(Default::default(), Err("connection refused".into()));
        let e = Pipeline::new(StrategyTargets::default())
            .suggest(&down, &ask)
            .expect_err("history down");
        assert!(matches!(e, PipelineError::History(_)), "{e:?}");
        assert!(e.to_string().contains("connection refused"), "{e}");
    }
}
