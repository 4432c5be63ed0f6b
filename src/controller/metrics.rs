//! The controller's own metrics (a `prometheus` registry), the reconcile
//! timer that records on `Drop`, and the routes of the controller's HTTP
//! port (`/metrics`, `/healthz`, `/readyz`, the Slurm API), served by
//! [`crate::serve`].

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode};
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry,
    TextEncoder,
};

use super::api::ApiState;
use super::ControllerError;
use crate::core::run::RunPath;

/// The name of every metric the controller exports, in one place (the
/// dashboards, alerts and docs use them as written here).
pub mod names {
    pub const RECONCILES: &str = "gpufit_controller_reconciles_total";
    pub const RECONCILE_DURATION: &str = "gpufit_controller_reconcile_duration_seconds";
    pub const ERRORS: &str = "gpufit_controller_errors_total";
    pub const SUGGESTIONS: &str = "gpufit_controller_suggestions_total";
    pub const SUGGESTION_CONFIDENCE: &str = "gpufit_controller_suggestion_confidence";
    pub const OOMS: &str = "gpufit_controller_ooms_total";
    pub const PREDICTION_ERROR: &str = "gpufit_controller_prediction_error_ratio";
    pub const RUNS: &str = "gpufit_controller_runs_total";
    pub const PREDICTION_ERROR_BY_GPU: &str = "gpufit_controller_prediction_error_by_gpu_ratio";
    pub const THROUGHPUT_VS_BEST: &str = "gpufit_controller_throughput_vs_best_ratio";
    pub const WEBHOOK_REQUESTS: &str = "gpufit_webhook_requests_total";
    pub const WEBHOOK_DURATION: &str = "gpufit_webhook_duration_seconds";
    pub const KUEUE_PENDING_OLDEST: &str = "gpufit_kueue_pending_check_oldest_seconds";
    pub const KUEUE_ANSWERS: &str = "gpufit_kueue_answers_total";
    pub const KUEUE_WAIT: &str = "gpufit_kueue_check_wait_seconds";
}

/// Which way a suggestion came in: the `path` label, in the fleet view's
/// one vocabulary ([`RunPath`]: `trainingjob`, `webhook`, `slurm`), so a
/// dashboard's `path` and `gpufit report`'s name the same thing alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// The TrainingJob reconciler.
    Kubernetes,
    /// The admission webhook.
    Webhook,
    /// The HTTP API the Slurm hooks call.
    SlurmApi,
}

impl Via {
    /// The path runs configured this way are recorded under.
    pub fn path(self) -> RunPath {
        match self {
            Via::Kubernetes => RunPath::TrainingJob,
            Via::Webhook => RunPath::Webhook,
            Via::SlurmApi => RunPath::Slurm,
        }
    }

    pub fn as_str(self) -> &'static str {
        self.path().as_str()
    }
}

/// A recorded run's `outcome` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunOutcome {
    Success,
    Oom,
    OtherError,
}

impl RunOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            RunOutcome::Success => "success",
            RunOutcome::Oom => "oom",
            RunOutcome::OtherError => "other_error",
        }
    }
}

/// Every metric the controller exports.
#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    /// Reconciles by result (`ok`, `error`).
    pub reconciles: IntCounterVec,
    /// Reconcile duration in seconds.
    pub reconcile_duration: Histogram,
    /// Reconcile errors by [`ControllerError::metric_label`].
    pub errors: IntCounterVec,
    /// Suggestions made, by source and strategy.
    pub suggestions: IntCounterVec,
    /// Confidence (0–1) of each suggestion, for the dashboards' "suggestions
    /// by confidence" panel.
    pub suggestion_confidence: Histogram,
    /// CUDA out-of-memory failures seen.
    pub ooms: IntCounter,
    /// Relative prediction error (predicted − measured) / measured.
    pub prediction_error: Histogram,
    /// Runs recorded, by path, GPU model and outcome. Cardinality: the 5
    /// paths of [`RunPath::ALL`] (3 in practice: trainingjob, webhook,
    /// slurm) × the fleet's GPU models × 3 outcomes (a fleet of 20 GPU
    /// models: 180 series).
    pub runs: IntCounterVec,
    /// Prediction error by GPU model (11 buckets × GPU models).
    pub prediction_error_by_gpu: HistogramVec,
    /// A recorded run's tokens/s over the best known for its workload on
    /// that GPU model (1 = as fast as the best setting seen), by GPU model.
    pub throughput_vs_best: HistogramVec,
    /// Webhook admissions by kind and result (`mutated`, `untouched`, `denied`, `error`).
    pub webhook_requests: IntCounterVec,
    /// Webhook handling time in seconds.
    pub webhook_duration: HistogramVec,
    /// Age of the oldest Workload whose gpufit check is Pending with its
    /// quota reserved (0 when none): Kueue holds that quota meanwhile.
    pub kueue_pending_oldest: prometheus::Gauge,
    /// Kueue check answers, by result (`configured`, `not_configured`,
    /// `not_opted_in`, `unknown_owner`).
    pub kueue_answers: IntCounterVec,
    /// From quota reservation to gpufit's answer.
    pub kueue_wait: Histogram,
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let registry = Registry::new();
        let reconciles = IntCounterVec::new(
            Opts::new(names::RECONCILES, "TrainingJob reconciles by result"),
            &["result"],
        )
        .expect("static metric definition");
        let reconcile_duration = Histogram::with_opts(
            HistogramOpts::new(
                names::RECONCILE_DURATION,
                "Time spent in one TrainingJob reconcile",
            )
            .buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ]),
        )
        .expect("static metric definition");
        let errors = IntCounterVec::new(
            Opts::new(names::ERRORS, "Reconcile errors by kind"),
            &["error"],
        )
        .expect("static metric definition");
        let suggestions = IntCounterVec::new(
            Opts::new(
                names::SUGGESTIONS,
                "Suggestions made, by source, strategy and path (trainingjob, webhook, slurm)",
            ),
            &["source", "strategy", "path"],
        )
        .expect("static metric definition");
        let suggestion_confidence = Histogram::with_opts(
            HistogramOpts::new(
                names::SUGGESTION_CONFIDENCE,
                "Confidence (0-1) of the suggestions made",
            )
            // The advisor caps confidence at 0.95 and keeps heuristic
            // suggestions below 0.5 (docs/design.md, "Contracts").
            .buckets(vec![0.25, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95]),
        )
        .expect("static metric definition");
        let ooms = IntCounter::new(
            names::OOMS,
            "CUDA out-of-memory failures seen in finished Jobs",
        )
        .expect("static metric definition");
        let prediction_error = Histogram::with_opts(
            HistogramOpts::new(
                names::PREDICTION_ERROR,
                "(predicted - measured) / measured peak GPU memory of finished Jobs",
            )
            .buckets(vec![
                -0.5, -0.25, -0.1, -0.05, 0.0, 0.05, 0.1, 0.25, 0.5, 1.0,
            ]),
        )
        .expect("static metric definition");
        let runs = IntCounterVec::new(
            Opts::new(
                names::RUNS,
                "Runs recorded, by path (trainingjob, webhook, slurm, cli, import: as gpufit report names them), GPU model and outcome (success, oom, other_error)",
            ),
            &["path", "gpu_model", "outcome"],
        )
        .expect("static metric definition");
        let prediction_error_by_gpu = HistogramVec::new(
            HistogramOpts::new(
                names::PREDICTION_ERROR_BY_GPU,
                "(predicted - measured) / measured peak GPU memory of recorded runs, by GPU model",
            )
            .buckets(vec![
                -0.5, -0.25, -0.1, -0.05, 0.0, 0.05, 0.1, 0.25, 0.5, 1.0,
            ]),
            &["gpu_model"],
        )
        .expect("static metric definition");
        let throughput_vs_best = HistogramVec::new(
            HistogramOpts::new(
                names::THROUGHPUT_VS_BEST,
                "Tokens/s of a recorded run over the best known for its workload and GPU model",
            )
            .buckets(vec![0.5, 0.7, 0.8, 0.9, 0.95, 0.97, 0.99, 1.0]),
            &["gpu_model"],
        )
        .expect("static metric definition");
        let webhook_requests = IntCounterVec::new(
            Opts::new(
                names::WEBHOOK_REQUESTS,
                "Admission requests by kind and result",
            ),
            &["kind", "result"],
        )
        .expect("static metric definition");
        let webhook_duration = HistogramVec::new(
            HistogramOpts::new(
                names::WEBHOOK_DURATION,
                "Time to answer one admission request",
            )
            .buckets(vec![0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1]),
            &["kind"],
        )
        .expect("static metric definition");
        let kueue_pending_oldest = prometheus::Gauge::with_opts(Opts::new(
            names::KUEUE_PENDING_OLDEST,
            "Seconds the oldest quota-reserved Workload has waited on gpufit's admission check",
        ))
        .expect("static metric definition");
        let kueue_answers = IntCounterVec::new(
            Opts::new(
                names::KUEUE_ANSWERS,
                "Kueue admission check answers by result",
            ),
            &["result"],
        )
        .expect("static metric definition");
        let kueue_wait = Histogram::with_opts(
            HistogramOpts::new(
                names::KUEUE_WAIT,
                "Seconds from a Workload's quota reservation to gpufit's answer",
            )
            .buckets(vec![
                0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 300.0,
            ]),
        )
        .expect("static metric definition");
        for c in [
            Box::new(reconciles.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(kueue_pending_oldest.clone()),
            Box::new(kueue_answers.clone()),
            Box::new(kueue_wait.clone()),
            Box::new(reconcile_duration.clone()),
            Box::new(errors.clone()),
            Box::new(suggestions.clone()),
            Box::new(suggestion_confidence.clone()),
            Box::new(ooms.clone()),
            Box::new(prediction_error.clone()),
            Box::new(runs.clone()),
            Box::new(prediction_error_by_gpu.clone()),
            Box::new(throughput_vs_best.clone()),
            Box::new(webhook_requests.clone()),
            Box::new(webhook_duration.clone()),
        ] {
            registry.register(c).expect("metric names are unique");
        }
        Metrics {
            registry,
            reconciles,
            reconcile_duration,
            errors,
            suggestions,
            suggestion_confidence,
            ooms,
            prediction_error,
            runs,
            prediction_error_by_gpu,
            throughput_vs_best,
            webhook_requests,
            webhook_duration,
            kueue_pending_oldest,
            kueue_answers,
            kueue_wait,
        }
    }

    /// Counts a suggestion made (a Job created, an object mutated, an API
    /// answer), labelled with the core's own names of its source and strategy.
    pub fn count_suggestion(&self, via: Via, s: &crate::core::advisor::Suggestion) {
        self.suggestions
            .with_label_values(&[s.source.as_str(), s.strategy.as_str(), via.as_str()])
            .inc();
        self.suggestion_confidence.observe(s.confidence);
    }

    /// Counts a recorded run under its own path ([`RunRecord::run_path`](crate::core::run::RunRecord::run_path)).
    pub fn count_run(&self, path: RunPath, gpu_model: &str, outcome: RunOutcome) {
        self.runs
            .with_label_values(&[path.as_str(), gpu_model, outcome.as_str()])
            .inc();
    }

    /// Observes a recorded run's throughput against the best known for its
    /// workload on its GPU model (the similar runs of the history, this one
    /// included). Blocking: reads the history.
    pub fn observe_throughput(
        &self,
        history: &dyn crate::history::HistoryStore,
        run: &crate::core::run::RunRecord,
    ) {
        let Some(mine) = run
            .result
            .tokens_per_sec
            .filter(|t| run.result.success() && *t > 0.0)
        else {
            return;
        };
        let q = crate::core::similarity::HistoryQuery::new(
            &run.model,
            run.method,
            &run.gpu_model,
            run.seq_len,
        );
        let best = history
            .similar(&q)
            .unwrap_or_default()
            .iter()
            .filter(|r| r.result.success())
            .filter_map(|r| r.result.tokens_per_sec)
            .filter(|t| t.is_finite())
            .fold(mine, f64::max);
        self.throughput_vs_best
            .with_label_values(&[run.gpu_model.as_str()])
            .observe(mine / best);
    }

    /// Observes a prediction error, fleet-wide and for its GPU model.
    pub fn observe_prediction_error(&self, gpu_model: &str, err: f64) {
        self.prediction_error.observe(err);
        self.prediction_error_by_gpu
            .with_label_values(&[gpu_model])
            .observe(err);
    }

    /// Starts timing one reconcile; the time is recorded when the guard drops.
    pub fn reconcile_timer(&self) -> ReconcileTimer {
        ReconcileTimer {
            start: Instant::now(),
            histogram: self.reconcile_duration.clone(),
        }
    }

    /// Counts a failed reconcile by its bounded error label.
    pub fn record_error(&self, e: &ControllerError) {
        self.reconciles.with_label_values(&["error"]).inc();
        self.errors.with_label_values(&[e.metric_label()]).inc();
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Records the reconcile duration on `Drop` (the controller-rs pattern), so
/// every return path is timed.
pub struct ReconcileTimer {
    start: Instant,
    histogram: Histogram,
}

impl Drop for ReconcileTimer {
    fn drop(&mut self) {
        self.histogram.observe(self.start.elapsed().as_secs_f64());
    }
}

/// Liveness/readiness state shared with the HTTP endpoints.
#[derive(Debug, Default)]
pub struct Health {
    /// Set once the controller (or webhook) is up and serving.
    pub ready: AtomicBool,
}

/// What the controller's HTTP port answers: `/metrics`, `/healthz` and
/// `/readyz`, and every other path through the Slurm HTTP API (`api`) when given.
#[derive(Clone)]
pub struct Routes {
    pub metrics: Metrics,
    pub health: Arc<Health>,
    pub api: Option<Arc<ApiState>>,
}

impl Routes {
    /// How [`crate::serve`] holds the port's connections: a client that
    /// connects and sends nothing is dropped after 5 s.
    pub fn serve_config() -> crate::serve::ServeConfig {
        crate::serve::ServeConfig {
            name: "controller",
            idle_timeout: std::time::Duration::from_secs(5),
            ..crate::serve::ServeConfig::default()
        }
    }

    /// Answers one request.
    pub async fn handle(self, req: Request<crate::serve::Body>) -> Response<Full<Bytes>> {
        let ours = matches!(req.uri().path(), "/metrics" | "/healthz" | "/readyz");
        match self.api {
            Some(api) if !ours => super::api::handle(api, req).await,
            _ => route(&req, &self.metrics, &self.health),
        }
    }

    /// Serves on a bound listener (see [`bind`]) until `shutdown` resolves.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) {
        if let Ok(listen) = listener.local_addr() {
            tracing::info!(%listen, "serving /metrics, /healthz, /readyz and the Slurm API");
        }
        let handler = move |req| self.clone().handle(req);
        crate::serve::serve(listener, &Self::serve_config(), None, handler, shutdown).await;
    }
}

/// Binds the HTTP port, with an error that says what to do.
pub async fn bind(listen: SocketAddr) -> Result<tokio::net::TcpListener, ControllerError> {
    tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| ControllerError::Io {
            context: format!("cannot listen on {listen} (is the port in use? pass --listen)"),
            source: e,
        })
}

fn route<B>(req: &Request<B>, metrics: &Metrics, health: &Health) -> Response<Full<Bytes>> {
    let text = |status: StatusCode, body: String| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        r
    };
    match req.uri().path() {
        "/metrics" => {
            let mut r = text(StatusCode::OK, metrics.render());
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("text/plain; version=0.0.4"),
            );
            r
        }
        "/healthz" => text(StatusCode::OK, "ok\n".into()),
        "/readyz" => {
            if health.ready.load(Ordering::Relaxed) {
                text(StatusCode::OK, "ready\n".into())
            } else {
                text(StatusCode::SERVICE_UNAVAILABLE, "not ready\n".into())
            }
        }
        _ => text(
            StatusCode::NOT_FOUND,
            "not found: try /metrics, /healthz or /readyz\n".into(),
        ),
    }
}
