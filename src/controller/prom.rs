//! Prometheus HTTP API client: an instant query (`/api/v1/query`) with a
//! timeout, and the PromQL template that turns a finished Job into its peak
//! GPU memory.
//!
//! The default template reads the sidecar's `gpufit_job_gpu_memory_peak_bytes`
//! (already a per-job maximum, labelled `namespace` and `pod`):
//!
//! ```text
//! max(max_over_time(gpufit_job_gpu_memory_peak_bytes{namespace="{namespace}",pod=~"{pods}"}[{range}]))
//! ```
//!
//! Fleets that run NVIDIA's dcgm-exporter instead can use its framebuffer
//! gauge, which is in MiB and sampled (so it can miss a short spike):
//!
//! ```text
//! max(max_over_time(DCGM_FI_DEV_FB_USED{namespace="{namespace}",pod=~"{pods}"}[{range}])) * 1048576
//! ```
//!
//! (with dcgm-exporter's Kubernetes mapping on; behind a ServiceMonitor
//! without `honorLabels` the labels are `exported_namespace`/`exported_pod`).
//!
//! Placeholders: `{namespace}`, `{pods}` (a regex alternation of the Job's
//! pod names, quoted for PromQL), `{job}` (the Job name) and `{range}` (the
//! Job's run time plus a margin, as a PromQL duration like `3720s`).

use std::time::Duration;

use serde::Deserialize;

/// The default PromQL template (sidecar metric).
pub const DEFAULT_PEAK_QUERY: &str = "max(max_over_time(gpufit_job_gpu_memory_peak_bytes{namespace=\"{namespace}\",pod=~\"{pods}\"}[{range}]))";

/// The dcgm-exporter alternative (framebuffer MiB → bytes).
pub const DCGM_PEAK_QUERY: &str = "max(max_over_time(DCGM_FI_DEV_FB_USED{namespace=\"{namespace}\",pod=~\"{pods}\"}[{range}])) * 1048576";

/// What went wrong talking to Prometheus.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PromError {
    #[error("Prometheus at {url} did not answer within {timeout:?}: {message}")]
    Timeout {
        url: String,
        timeout: Duration,
        message: String,
    },
    #[error("Prometheus at {url} is unreachable: {message}")]
    Unreachable { url: String, message: String },
    #[error("Prometheus at {url} rejected the query ({status}): {message}")]
    Query {
        url: String,
        status: String,
        message: String,
    },
    #[error("Prometheus at {url} answered something that is not a query result: {message}")]
    BadResponse { url: String, message: String },
}

/// A Prometheus server.
#[derive(Debug, Clone)]
pub struct PromClient {
    base: String,
    agent: ureq::Agent,
    timeout: Duration,
}

#[derive(Deserialize)]
struct ApiResponse {
    status: String,
    #[serde(default)]
    data: Option<ApiData>,
    #[serde(default, rename = "errorType")]
    error_type: Option<String>,
    #[serde(default)]
    error: Option<String>,
}

#[derive(Deserialize)]
struct ApiData {
    #[serde(rename = "resultType")]
    result_type: String,
    result: serde_json::Value,
}

/// One sample of an instant vector.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub labels: std::collections::BTreeMap<String, String>,
    pub value: f64,
}

impl PromClient {
    /// `base` is the server's root URL (`http://prometheus:9090`).
    pub fn new(base: &str, timeout: Duration) -> Self {
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(timeout)
            .timeout(timeout)
            .build();
        PromClient {
            base: base.trim_end_matches('/').to_string(),
            agent,
            timeout,
        }
    }

    /// The base URL.
    pub fn url(&self) -> &str {
        &self.base
    }

    /// Runs an instant query (optionally at a Unix time) and returns the
    /// vector's samples (a scalar result is one sample without labels).
    /// Blocking: call it from `spawn_blocking` in async code.
    pub fn query(&self, promql: &str, at_unix: Option<f64>) -> Result<Vec<Sample>, PromError> {
        let url = format!("{}/api/v1/query", self.base);
        let mut req = self.agent.get(&url).query("query", promql);
        let time;
        if let Some(t) = at_unix {
            time = format!("{t:.3}");
            req = req.query("time", &time);
        }
        let resp = match req.call() {
            Ok(r) => r,
            // Prometheus answers 400/422/503 with a JSON error body.
            Err(ureq::Error::Status(_, r)) => r,
            Err(ureq::Error::Transport(t)) => {
                let message = t.to_string();
                let timed_out = message.contains("timed out")
                    || message.contains("Timeout")
                    || message.contains("timeout");
                return Err(if timed_out {
                    PromError::Timeout {
                        url: self.base.clone(),
                        timeout: self.timeout,
                        message,
                    }
                } else {
                    PromError::Unreachable {
                        url: self.base.clone(),
                        message,
                    }
                });
            }
        };
        let body: ApiResponse = resp.into_json().map_err(|e| {
            let message = e.to_string();
            if e.kind() == std::io::ErrorKind::TimedOut
                || e.kind() == std::io::ErrorKind::WouldBlock
            {
                PromError::Timeout {
                    url: self.base.clone(),
                    timeout: self.timeout,
                    message,
                }
            } else {
                PromError::BadResponse {
                    url: self.base.clone(),
                    message,
                }
            }
        })?;
        if body.status != "success" {
            return Err(PromError::Query {
                url: self.base.clone(),
                status: body.error_type.unwrap_or(body.status),
                message: body.error.unwrap_or_default(),
            });
        }
        let data = body.data.ok_or_else(|| PromError::BadResponse {
            url: self.base.clone(),
            message: "no `data`".into(),
        })?;
        parse_result(&data.result_type, &data.result).ok_or_else(|| PromError::BadResponse {
            url: self.base.clone(),
            message: format!("unexpected {} result", data.result_type),
        })
    }

    /// The largest value of the query, or `None` when it matched no series.
    pub fn query_max(&self, promql: &str, at_unix: Option<f64>) -> Result<Option<f64>, PromError> {
        let samples = self.query(promql, at_unix)?;
        Ok(samples
            .iter()
            .map(|s| s.value)
            .filter(|v| v.is_finite())
            .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v)))))
    }
}

fn parse_value(v: &serde_json::Value) -> Option<f64> {
    // [ <unix time>, "<value as string>" ]
    v.get(1)?.as_str()?.parse::<f64>().ok()
}

fn parse_result(kind: &str, result: &serde_json::Value) -> Option<Vec<Sample>> {
    match kind {
        "vector" => result
            .as_array()?
            .iter()
            .map(|s| {
                let labels = s
                    .get("metric")
                    .and_then(|m| serde_json::from_value(m.clone()).ok())
                    .unwrap_or_default();
                Some(Sample {
                    labels,
                    value: parse_value(s.get("value")?)?,
                })
            })
            .collect(),
        "scalar" => Some(vec![Sample {
            labels: Default::default(),
            value: parse_value(result)?,
        }]),
        _ => None,
    }
}

/// Escapes a string for a PromQL double-quoted regex: regex metacharacters
/// and then PromQL string escapes (pod names are DNS labels, but the query is
/// built from API data, so it is escaped anyway).
pub fn regex_alternation(names: &[String]) -> String {
    names
        .iter()
        .map(|n| {
            let mut out = String::new();
            for ch in n.chars() {
                if "\\.+*?()|[]{}^$".contains(ch) {
                    out.push_str("\\\\");
                } else if ch == '"' {
                    out.push('\\');
                }
                out.push(ch);
            }
            out
        })
        .collect::<Vec<_>>()
        .join("|")
}

/// Fills a PromQL template.
pub fn render_query(
    template: &str,
    namespace: &str,
    job: &str,
    pods: &[String],
    range: Duration,
) -> String {
    let esc = |s: &str| s.replace('\\', "\\\\").replace('"', "\\\"");
    template
        .replace("{namespace}", &esc(namespace))
        .replace("{job}", &esc(job))
        .replace("{pods}", &regex_alternation(pods))
        .replace("{range}", &format!("{}s", range.as_secs().max(60)))
}
