//! The controller's HTTP API used by the Slurm hooks (docs/design.md,
//! "Slurm and the controller's HTTP API"):
//!
//! | route                       | what                                                    | auth   |
//! |-----------------------------|---------------------------------------------------------|--------|
//! | `POST /v1/suggest`          | workload + GPU + strategy + pins → the `Suggestion` JSON of `gpufit suggest --output json` | none   |
//! | `POST /v1/runs`             | a `RunRecord` → `{"id": …}` (201)                        | bearer |
//! | `GET /v1/runs?model=&gpu=&limit=` | recorded runs, newest first                       | none   |
//! | `GET /healthz`              | `{"status":"ok"}`                                       | none   |
//!
//! Writes need `Authorization: Bearer <token>` where the token is read from
//! `--token-file` and compared in constant time. Without a token file writes
//! are refused (an open write endpoint would let anyone poison the fleet's
//! history). Every request has a body-size limit (413) and a time limit (503);
//! every error is JSON `{"error": "...", "status": N}` saying what is wrong.
//!
//! [`ApiState`] + [`handle`] are the reusable part: the Kubernetes controller
//! serves them on its HTTP port beside `/metrics` (see
//! [`super::metrics::Routes`]), in Kubernetes mode and with `--no-kubernetes`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::header::{HeaderValue, AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE, WWW_AUTHENTICATE};
use hyper::{Method, Request, Response, StatusCode};
use serde::Serialize;
use subtle::ConstantTimeEq;

use super::metrics::{RunOutcome, Via};
use super::ControllerError;
use crate::core::advisor::{StrategyTargets, Suggestion};
use crate::core::run::RunRecord;
use crate::history::{HistoryStore, ListFilter};
use crate::service::SuggestError;
pub use crate::service::{canonical_model, read_token_file, resolve_gpu, resolve_workload};
pub use crate::wire::api::{ErrorBody, GpuRef, SuggestRequest, WorkloadSpec};

impl From<SuggestError> for ApiError {
    fn from(e: SuggestError) -> Self {
        let status = match &e {
            SuggestError::History(_) => StatusCode::SERVICE_UNAVAILABLE,
            // Does-not-fit is a valid answer about the request, not a server fault.
            SuggestError::DoesNotFit(_) => StatusCode::UNPROCESSABLE_ENTITY,
            SuggestError::Workload(_) | SuggestError::Gpu(_) | SuggestError::Advisor(_) => {
                StatusCode::BAD_REQUEST
            }
        };
        ApiError::new(status, e.to_string())
    }
}

/// The whole suggestion (see [`crate::service::suggest_blocking`]), with
/// its failure as an HTTP error.
pub fn suggest_blocking(
    history: &dyn HistoryStore,
    targets: StrategyTargets,
    req: &SuggestRequest,
) -> Result<Suggestion, ApiError> {
    crate::service::suggest_blocking(history, targets, req).map_err(ApiError::from)
}

/// How the API server is started.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    pub listen: SocketAddr,
    pub history_url: String,
    /// SQLite options for the history (read by the command line).
    pub history_sqlite: crate::history::sqlite::SqliteOptions,
    pub token_file: Option<PathBuf>,
}

/// Request limits. The defaults are generous for the payloads involved (a
/// run record is ~1 KiB) and short enough that a stuck request cannot pile up.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ApiLimits {
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// Wall-clock limit of one request, body read included.
    pub request_timeout: Duration,
    /// Largest `limit` accepted by `GET /v1/runs`.
    pub max_list: usize,
}

impl Default for ApiLimits {
    fn default() -> Self {
        ApiLimits {
            max_body_bytes: 64 * 1024,
            request_timeout: Duration::from_secs(10),
            max_list: 1000,
        }
    }
}

/// What every request shares: the history store, the write token, limits
/// and the strategy targets.
pub struct ApiState {
    history: Arc<dyn HistoryStore>,
    token: Option<Vec<u8>>,
    /// Request limits (public so an embedding server can tune them).
    pub limits: ApiLimits,
    /// Memory targets per strategy used by `POST /v1/suggest`.
    pub targets: StrategyTargets,
    /// The controller's metrics: suggestions, OOMs and prediction errors
    /// made through this API are counted like the Kubernetes path's.
    pub metrics: Option<super::metrics::Metrics>,
}

impl std::fmt::Debug for ApiState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiState")
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("limits", &self.limits)
            .field("targets", &self.targets)
            .finish_non_exhaustive()
    }
}

impl ApiState {
    /// A state over an open store; `token` None refuses every write.
    pub fn new(history: Arc<dyn HistoryStore>, token: Option<String>) -> Self {
        ApiState {
            history,
            token: token.map(|t| t.into_bytes()),
            limits: ApiLimits::default(),
            targets: StrategyTargets::default(),
            metrics: None,
        }
    }

    /// Counts what this API does in `metrics`.
    pub fn with_metrics(mut self, metrics: super::metrics::Metrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Opens the history store and reads the token file of `cfg`.
    /// Blocking (opens a database): call it before the runtime serves, or
    /// through `spawn_blocking`.
    pub fn from_config(cfg: &ApiConfig) -> Result<Self, ControllerError> {
        let token = match &cfg.token_file {
            Some(p) => Some(read_token_file(p)?),
            None => {
                tracing::warn!(
                    "no --token-file: POST /v1/runs is refused; give a token file to accept runs from Slurm epilogs"
                );
                None
            }
        };
        let store =
            crate::history::open_with(&cfg.history_url, cfg.history_sqlite).map_err(|e| {
                ControllerError::Other(format!("cannot open the history for the HTTP API: {e}"))
            })?;
        Ok(ApiState::new(Arc::from(store), token))
    }

    /// Whether a request path belongs to this API (for a server that mounts
    /// it beside other routes).
    pub fn owns_path(path: &str) -> bool {
        matches!(path, "/v1/suggest" | "/v1/runs" | "/healthz")
    }

    /// The store behind the API.
    pub fn history(&self) -> Arc<dyn HistoryStore> {
        self.history.clone()
    }

    fn authorized(&self, header: Option<&HeaderValue>) -> Result<(), ApiError> {
        let Some(expected) = &self.token else {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "writes are disabled: the controller was started without --token-file",
            ));
        };
        let given = header
            .and_then(|h| h.to_str().ok())
            .and_then(|h| h.strip_prefix("Bearer "))
            .map(str::trim)
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "missing `Authorization: Bearer <token>` header: writes need the token of the controller's --token-file",
                )
            })?;
        // Constant-time over the bytes; only the length can leak, and the
        // token is long random data, so that says nothing useful.
        if bool::from(given.as_bytes().ct_eq(expected)) {
            Ok(())
        } else {
            Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "wrong bearer token: use the token of the controller's --token-file",
            ))
        }
    }
}

// === request and response types ===

/// An API error: a status and a message that says what is wrong.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
        }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }

    /// The JSON response for this error.
    pub fn into_response(self) -> Response<Full<Bytes>> {
        let mut resp = json_response(
            self.status,
            &ErrorBody {
                error: self.message,
                status: self.status.as_u16(),
            },
        );
        if self.status == StatusCode::UNAUTHORIZED {
            resp.headers_mut()
                .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.status.as_u16())
    }
}

impl std::error::Error for ApiError {}

// === the pure-ish request logic, shared with the Slurm hooks' local mode ===

// === HTTP ===

/// The response type of every route.
pub type ApiResponse = Response<Full<Bytes>>;

fn json_response<T: Serialize>(status: StatusCode, value: &T) -> ApiResponse {
    let body = serde_json::to_vec(value).unwrap_or_else(|e| {
        format!("{{\"error\":\"cannot serialize the response: {e}\",\"status\":500}}").into_bytes()
    });
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

/// Handles one request: routes it, applies the body-size and time limits,
/// and turns every failure into a JSON error. Generic over the body so any
/// hyper server (or a test) can call it.
pub async fn handle<B>(state: Arc<ApiState>, req: Request<B>) -> ApiResponse
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let limit = state.limits.request_timeout;
    let resp = match tokio::time::timeout(limit, route(state, req)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => e.into_response(),
        Err(_) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the request took longer than the {} s limit; retry later",
                limit.as_secs_f64()
            ),
        )
        .into_response(),
    };
    tracing::debug!(%method, %path, status = resp.status().as_u16(), "api request");
    resp
}

async fn route<B>(state: Arc<ApiState>, req: Request<B>) -> Result<ApiResponse, ApiError>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let path = req.uri().path().to_string();
    match (req.method(), path.as_str()) {
        (&Method::GET, "/healthz") => Ok(json_response(
            StatusCode::OK,
            &crate::wire::api::HealthBody {
                status: "ok".into(),
            },
        )),
        (&Method::POST, "/v1/suggest") => post_suggest(state, req).await,
        (&Method::POST, "/v1/runs") => post_run(state, req).await,
        (&Method::GET, "/v1/runs") => list_runs(state, req.uri().query().unwrap_or("")).await,
        (_, "/healthz" | "/v1/suggest" | "/v1/runs") => {
            Err(method_not_allowed(req.method(), &path))
        }
        _ => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no route {path}: the API has POST /v1/suggest, POST and GET /v1/runs, GET /healthz"),
        )),
    }
}

/// 405 for a known path, naming the methods it takes.
fn method_not_allowed(method: &Method, path: &str) -> ApiError {
    let allow = match path {
        "/v1/suggest" => "POST",
        "/v1/runs" => "GET or POST",
        _ => "GET",
    };
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{method} is not allowed on {path}: use {allow}"),
    )
}

/// `POST /v1/suggest`: the suggestion, counted in the metrics.
async fn post_suggest<B>(state: Arc<ApiState>, req: Request<B>) -> Result<ApiResponse, ApiError>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let body: SuggestRequest = read_json(&state, req).await?;
    let st = state.clone();
    let s = blocking(move || suggest_blocking(st.history.as_ref(), st.targets, &body)).await??;
    if let Some(m) = &state.metrics {
        m.count_suggestion(Via::SlurmApi, &s);
    }
    Ok(json_response(StatusCode::OK, &s))
}

/// `POST /v1/runs`: a token-holder records a finished run.
async fn post_run<B>(state: Arc<ApiState>, req: Request<B>) -> Result<ApiResponse, ApiError>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    // The body is read before the token is checked: answering while
    // the client still sends makes it see a reset, not the 401.
    let auth = req.headers().get(AUTHORIZATION).cloned();
    let body = read_body(&state, req).await?;
    state.authorized(auth.as_ref())?;
    let mut run: RunRecord = parse_json(&body)?;
    validate_run(&run)?;
    run.id = None;
    run.model = canonical_model(&run.model);
    let st = state.clone();
    // Counted once stored, from what the store did: a report it refused
    // is no run, and a repeated one (a retried Epilog) was counted already.
    let id = blocking(move || {
        if run.nodes.as_ref().is_some_and(|n| n.expected > 1) {
            // Every node's Epilog reports; the store merges each into the
            // job's one record in a transaction of its own (several
            // replicas may take the reports of one job).
            let out = st.history.record_node_report_outcome(&run)?;
            if let Some(m) = &st.metrics {
                count_node_report(m, &run, &out);
                if let Some(job) = out.record.as_ref().filter(|_| out.completed) {
                    m.observe_throughput(st.history.as_ref(), job);
                }
            }
            Ok::<_, crate::history::HistoryError>(out.id)
        } else {
            // A replayed report (the same run again) updates its record but
            // is counted once: only a run the history did not hold counts.
            let stored = run.clone().validated(None)?;
            let new = st.history.find(&stored.identity())?.is_none();
            let id = st.history.record(&run)?;
            if let Some(m) = st.metrics.as_ref().filter(|_| new) {
                count_posted_run(m, &stored);
                m.observe_throughput(st.history.as_ref(), &stored);
            }
            Ok(id)
        }
    })
    .await?
    .map_err(|e| match e {
        // A node's report the record refuses (past the window, no node
        // name): sending it again cannot help.
        crate::history::HistoryError::Invalid(r) => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("run refused: {r}"),
        ),
        e => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("cannot record the run: {e}"),
        ),
    })?;
    Ok(json_response(
        StatusCode::CREATED,
        &crate::wire::api::RunCreated { id },
    ))
}

/// The GPU model as the history stores it (NVML name).
fn stored_gpu(run: &RunRecord) -> String {
    run.clone()
        .validated(None)
        .map(|r| r.gpu_model)
        .unwrap_or_else(|_| run.gpu_model.clone())
}

/// Counts a recorded run in `gpufit_controller_runs_total` by outcome,
/// and in the OOM counter.
fn count_outcome(m: &super::metrics::Metrics, run: &RunRecord) {
    let outcome = if run.result.success() {
        RunOutcome::Success
    } else if run.is_oom() {
        RunOutcome::Oom
    } else {
        RunOutcome::OtherError
    };
    m.count_run(run.run_path(), &stored_gpu(run), outcome);
    if run.is_oom() {
        m.ooms.inc();
    }
}

/// Counts a posted one-node run by outcome, OOM and prediction error.
fn count_posted_run(m: &super::metrics::Metrics, run: &RunRecord) {
    count_outcome(m, run);
    if let Some(e) = run.prediction_error().filter(|e| e.is_finite()) {
        m.observe_prediction_error(&stored_gpu(run), e);
    }
}

/// Counts one node's report of a multi-node job from what the store did
/// with it. The job is one run: counted (outcome, OOM) by the report that
/// made its record whole, with the record's outcome, which is then the
/// job's final one (an OOM on any node makes it an OOM run). A job a node
/// of which never reports stays partial and is not counted: its outcome is
/// not known (the history keeps its record, marked partial). The
/// prediction error gets one sample per node, its own peak against the
/// per-GPU prediction (every node ran the predicted settings), when its
/// peak first reaches the record; the record's own peak is only a lower
/// bound until every node's is in. A repeated report counts nothing.
fn count_node_report(
    m: &super::metrics::Metrics,
    report: &RunRecord,
    out: &crate::core::run::NodeReportOutcome,
) {
    if out.adds_a_node_peak(report) {
        if let (Some(peak), Some(pred)) =
            (report.result.peak_memory_bytes, report.predicted_peak_bytes)
        {
            let e = (pred as f64 - peak as f64) / peak as f64;
            if peak > 0 && e.is_finite() {
                m.observe_prediction_error(&stored_gpu(report), e);
            }
        }
    }
    if let Some(job) = out.record.as_ref().filter(|_| out.completed) {
        count_outcome(m, job);
    }
}

/// `GET /v1/runs?…`: the history, filtered.
async fn list_runs(state: Arc<ApiState>, query: &str) -> Result<ApiResponse, ApiError> {
    let filter = list_filter(query, state.limits.max_list)?;
    let st = state.clone();
    let runs = blocking(move || st.history.list(&filter))
        .await?
        .map_err(|e| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("cannot read the history: {e}"),
            )
        })?;
    Ok(json_response(StatusCode::OK, &runs))
}

/// Runs blocking history work off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("internal error while serving the request: {e}"),
        )
    })
}

async fn read_json<T, B>(state: &ApiState, req: Request<B>) -> Result<T, ApiError>
where
    T: serde::de::DeserializeOwned,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    parse_json(&read_body(state, req).await?)
}

/// The request body, within the size limit.
async fn read_body<B>(state: &ApiState, req: Request<B>) -> Result<Bytes, ApiError>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let max = state.limits.max_body_bytes;
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body is larger than the {max}-byte limit"),
        )
    };
    // Refuse early when the client announces a large body.
    if let Some(len) = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
    {
        if len > max as u64 {
            return Err(too_large());
        }
    }
    let bytes = Limited::new(req.into_body(), max)
        .collect()
        .await
        .map_err(|e| {
            if e.downcast_ref::<LengthLimitError>().is_some() {
                too_large()
            } else {
                ApiError::bad_request(format!("cannot read the request body: {e}"))
            }
        })?
        .to_bytes();
    Ok(bytes)
}

fn parse_json<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.is_empty() {
        return Err(ApiError::bad_request(
            "empty request body: send a JSON object",
        ));
    }
    serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}

/// The history's one validation ([`crate::core::run_check::check_run`]),
/// answered 400 before anything is read or written.
fn validate_run(run: &RunRecord) -> Result<(), ApiError> {
    match run.clone().validated(None) {
        Ok(_) => Ok(()),
        Err(e) => Err(ApiError::bad_request(format!("run refused: {e}"))),
    }
}

/// Parses `model=&gpu=&limit=` (percent-encoded, `+` as space).
fn list_filter(query: &str, max_list: usize) -> Result<ListFilter, ApiError> {
    let mut f = ListFilter {
        limit: Some(100.min(max_list)),
        ..ListFilter::default()
    };
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = percent_decode(v)
            .ok_or_else(|| ApiError::bad_request(format!("query `{k}`: bad percent-encoding")))?;
        match k {
            "model" => f.model = Some(canonical_model(&v)),
            "gpu" | "gpu_model" => f.gpu_model = Some(v),
            "limit" => {
                let n: usize = v.parse().map_err(|_| {
                    ApiError::bad_request(format!(
                        "query limit=`{v}` is not a number: use 1 to {max_list}"
                    ))
                })?;
                if n == 0 || n > max_list {
                    return Err(ApiError::bad_request(format!(
                        "query limit={n} is out of range: use 1 to {max_list}"
                    )));
                }
                f.limit = Some(n);
            }
            other => {
                return Err(ApiError::bad_request(format!(
                    "unknown query parameter `{other}`: use model, gpu, limit"
                )))
            }
        }
    }
    Ok(f)
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 2;
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::advisor::Strategy;

    fn node_report(node: &str, peak: Option<u64>, oom: bool) -> RunRecord {
        serde_json::from_value(serde_json::json!({
            "id": null, "timestamp": "2026-01-01T00:00:00Z", "cluster": "c1", "node": node,
            "source": "slurm", "job_id": "7", "model": "m", "method": "lora",
            "gpu_model": "NVIDIA A100-SXM4-80GB", "seq_len": 2048, "lora_rank": 16, "gpus": 16,
            "global_batch": 64, "settings": crate::core::settings::EngineeringSettings::default(),
            "result": {"success": !oom, "failure_reason": if oom { Some("OOM") } else { None },
                       "peak_memory_bytes": peak,
                       "samples_per_sec": null, "tokens_per_sec": null, "duration_sec": null},
            "predicted_peak_bytes": 50,
            "nodes": {"reported": 1, "expected": 2}
        }))
        .expect("a node's report")
    }

    /// Merges `report` into `so_far` as a store does, counts it, and returns the record.
    fn post(
        m: &super::super::metrics::Metrics,
        so_far: Option<RunRecord>,
        report: &RunRecord,
    ) -> Option<RunRecord> {
        let merged = crate::core::run::merge_node_report(so_far.as_ref(), report).expect("merges");
        let out = crate::core::run::NodeReportOutcome::of(so_far.as_ref(), merged, 1);
        count_node_report(m, report, &out);
        out.record.or(so_far)
    }

    fn runs_total(m: &super::super::metrics::Metrics) -> u64 {
        let text = m.render();
        text.lines()
            .filter(|l| l.starts_with("gpufit_controller_runs_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    }

    #[test]
    fn a_multi_node_job_is_one_run_and_a_retried_report_counts_nothing() {
        let m = super::super::metrics::Metrics::new();
        let n1 = node_report("n1", Some(40), false);
        let rec = post(&m, None, &n1);
        // One node of two: not yet a run; its peak is one error sample.
        assert_eq!(runs_total(&m), 0);
        assert_eq!(m.prediction_error.get_sample_count(), 1);
        assert!((m.prediction_error.get_sample_sum() - 0.25).abs() < 1e-9);
        // n1's Epilog retried: nothing.
        let rec = post(&m, rec, &n1);
        assert_eq!(
            (runs_total(&m), m.prediction_error.get_sample_count()),
            (0, 1)
        );
        // n2 ran out of memory: the job is one OOM run.
        let n2 = node_report("n2", Some(100), true);
        let rec = post(&m, rec, &n2);
        assert_eq!(runs_total(&m), 1);
        assert_eq!(m.ooms.get(), 1);
        assert!(m.render().contains("outcome=\"oom\""), "{}", m.render());
        assert_eq!(m.prediction_error.get_sample_count(), 2);
        // Both retried: nothing more.
        let rec = post(&m, rec, &n2);
        post(&m, rec, &n1);
        assert_eq!(runs_total(&m), 1);
        assert_eq!(m.ooms.get(), 1);
        assert_eq!(m.prediction_error.get_sample_count(), 2);
    }

    #[test]
    fn a_peakless_node_gets_its_one_sample_when_its_peak_comes() {
        let m = super::super::metrics::Metrics::new();
        let rec = post(&m, None, &node_report("n1", None, false));
        assert_eq!(
            m.prediction_error.get_sample_count(),
            0,
            "no peak, no sample"
        );
        let rec = post(&m, rec, &node_report("n2", Some(50), false));
        assert_eq!(
            (runs_total(&m), m.prediction_error.get_sample_count()),
            (1, 1)
        );
        // n1 again, now with its peak: its sample, no second run.
        let rec = post(&m, rec, &node_report("n1", Some(40), false));
        assert_eq!(
            (runs_total(&m), m.prediction_error.get_sample_count()),
            (1, 2)
        );
        post(&m, rec, &node_report("n1", Some(40), false));
        assert_eq!(
            (runs_total(&m), m.prediction_error.get_sample_count()),
            (1, 2)
        );
    }

    #[test]
    fn list_filter_reads_model_gpu_and_limit() {
        let f = list_filter("gpu=NVIDIA+A100-SXM4-80GB&limit=5", 1000).unwrap();
        assert_eq!(f.gpu_model.as_deref(), Some("NVIDIA A100-SXM4-80GB"));
        assert_eq!(f.limit, Some(5));
        assert_eq!(f.model, None);
    }

    #[test]
    fn list_filter_refuses_a_limit_out_of_range_and_unknown_keys() {
        assert!(list_filter("limit=0", 1000).is_err());
        assert!(list_filter("limit=1001", 1000).is_err());
        assert!(list_filter("limit=abc", 1000).is_err());
        assert!(list_filter("colour=red", 1000).is_err());
    }

    #[test]
    fn percent_decoding_handles_escapes_and_rejects_broken_ones() {
        assert_eq!(percent_decode("a%2Fb+c").as_deref(), Some("a/b c"));
        assert_eq!(percent_decode("%zz"), None);
        assert_eq!(percent_decode("%4"), None);
    }

    #[test]
    fn suggest_request_accepts_a_gpu_name_or_a_live_spec() {
        let r: SuggestRequest = serde_json::from_str(
            r#"{"workload":{"model":"m","seq_len":2048},"gpu":"NVIDIA A100-SXM4-80GB"}"#,
        )
        .unwrap();
        assert_eq!(r.gpu, GpuRef::Name("NVIDIA A100-SXM4-80GB".into()));
        let r: SuggestRequest = serde_json::from_str(
            r#"{"workload":{"model":"m","seq_len":2048},"strategy":"extreme","gpu":{"name":"X","memory_bytes":1,"compute_capability":"8.0","bf16":true,"fp8":false,"bf16_tflops":1.0}}"#,
        )
        .unwrap();
        assert!(matches!(r.gpu, GpuRef::Spec(ref s) if s.name == "X"));
        assert_eq!(r.strategy, Some(Strategy::Aggressive));
    }
}
