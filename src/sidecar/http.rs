//! The sidecar's HTTP API (hyper 1, HTTP/1.1). Every body is JSON except
//! `/metrics`; every error is `{"error": "<what went wrong and what to do>"}`
//! with a 4xx/5xx status. The same text is in `docs/sidecar-api.md`.
//!
//! | method & path | body / answer |
//! |---|---|
//! | `GET /healthz` | 200 `{"status":"ok","node","backend","gpus":8,"unhealthy_gpus":[],"tracked_jobs":1,"last_sample_age_seconds":0.04}`; 503 with `"status":"stale"` when sampling stopped |
//! | `GET /v1/gpus` | `{"node","backend","sampled_at","gpus":[GPU…]}` |
//! | `GET /v1/jobs` | `{"node","backend","per_job_data":true,"jobs":[JOB…]}` (marks ended jobs read) |
//! | `GET /v1/jobs/{id}` | `JOB`, or 404. `id` is a Slurm job id, `namespace/pod` (the `/` may be sent as is or as `%2F`), or a pod UID |
//! | `POST /v1/jobs/{id}/log-peak` | body `{"peak_bytes": 123}` — the peak the job's own log states (bytes per GPU); answers `JOB` with `"method":"log"` |
//! | `GET /metrics` | Prometheus text format |
//! | `POST /v1/simulate/processes` | simulate backend only: body `{"pid":1001,"gpu":0,"job":{"namespace":"ns","pod":"p"},"memory_bytes":1073741824}` or `"job":{"slurm_job_id":"42"}`; registers the process or sets its memory (same pid); the sidecar samples at once, so each call is seen. Answers `{"process":{…},"job":JOB}` |
//! | `DELETE /v1/simulate/processes/{pid}` | simulate backend only: the process ends; answers `{"deleted":1001,"job":JOB}`, 404 when unknown |
//! | `GET /v1/simulate/processes` | simulate backend only: `{"processes":[…]}` |
//!
//! `GPU`: `{"index":0,"uuid":"GPU-…","name":"NVIDIA H100 80GB HBM3","memory_total_bytes":…,
//! "memory_used_bytes":…,"memory_free_bytes":…,"compute_capability":"9.0","utilization_ratio":0.97,
//! "mig_enabled":false,"accounting_enabled":false,"healthy":true,"error":null}`.
//!
//! `JOB`: `{"id":"team-a/train-0","kind":"pod"|"pod_uid"|"slurm","namespace","pod","pod_uid",
//! "slurm_job_id","node","running":true,"current_bytes","current_total_bytes","peak_bytes",
//! "method":"sampled"|"nvml_accounting"|"log","measured_peak_bytes","measured_method",
//! "gpus":[{"gpu":0,"current_bytes","peak_bytes","method"}],"processes":1,
//! "first_seen","last_seen","ended_at":null}` — bytes are integers, times RFC 3339 UTC,
//! `peak_bytes`/`current_bytes` are per GPU (the largest over the job's GPUs).
//!
//! Unknown path: 404; known path, wrong method: 405; bad body: 400; body over 64 KiB: 413.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde::Serialize;

use super::attribution::JobKey;
use super::simulate::SimProcess;
use super::Sidecar;

/// Largest request body accepted.
pub const MAX_BODY: usize = 64 * 1024;

/// Routes served, for the 404 answer.
const ROUTES: &[&str] = &[
    "GET /healthz",
    "GET /metrics",
    "GET /v1/gpus",
    "GET /v1/jobs",
    "GET /v1/jobs/{id}",
    "POST /v1/jobs/{id}/log-peak",
    "GET|POST /v1/simulate/processes",
    "DELETE /v1/simulate/processes/{pid}",
];

/// Accepts connections until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    sidecar: Arc<Sidecar>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((s, _)) => s,
                    Err(e) => {
                        // Out of file descriptors and the like: back off, keep serving.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let sc = Arc::clone(&sidecar);
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let sc = Arc::clone(&sc);
                        async move { Ok::<_, Infallible>(handle(&sc, req).await) }
                    });
                    if let Err(e) = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await
                    {
                        tracing::debug!(error = %e, "connection ended with an error");
                    }
                });
            }
        }
    }
}

fn json<T: Serialize>(status: StatusCode, v: &T) -> Response<Full<Bytes>> {
    match serde_json::to_vec(v) {
        Ok(body) => Response::builder()
            .status(status)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap_or_else(|_| Response::new(Full::new(Bytes::new()))),
        Err(e) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!("cannot encode JSON: {e}"),
        ),
    }
}

fn error(status: StatusCode, msg: &str) -> Response<Full<Bytes>> {
    let body = serde_json::json!({ "error": msg }).to_string();
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}

/// Percent-decodes a path segment; None on malformed escapes or non-UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// A job id as given in a path → its key (for jobs reported before they are seen).
fn key_from_id(id: &str) -> Option<JobKey> {
    if let Some((ns, pod)) = id.split_once('/') {
        (!ns.is_empty() && !pod.is_empty() && !pod.contains('/')).then(|| JobKey::Pod {
            namespace: ns.to_string(),
            pod: pod.to_string(),
        })
    } else if !id.is_empty() && id.chars().all(|c| c.is_ascii_digit() || c == '_') {
        Some(JobKey::Slurm {
            slurm_job_id: id.to_string(),
        })
    } else if !id.is_empty()
        && id.len() <= 64
        && id.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
    {
        Some(JobKey::PodUid {
            pod_uid: id.to_string(),
        })
    } else {
        None
    }
}

async fn read_json<T: serde::de::DeserializeOwned>(
    req: Request<Incoming>,
) -> Result<T, Response<Full<Bytes>>> {
    let body = Limited::new(req.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| {
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some()
            {
                error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    &format!("body over {MAX_BODY} bytes"),
                )
            } else {
                error(StatusCode::BAD_REQUEST, &format!("cannot read body: {e}"))
            }
        })?
        .to_bytes();
    serde_json::from_slice(&body)
        .map_err(|e| error(StatusCode::BAD_REQUEST, &format!("invalid JSON body: {e}")))
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct LogPeak {
    peak_bytes: u64,
}

/// Routes one request.
pub async fn handle(sc: &Arc<Sidecar>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let segs: Vec<&str> = path.trim_end_matches('/').split('/').skip(1).collect();
    let not_allowed = || {
        error(
            StatusCode::METHOD_NOT_ALLOWED,
            &format!("{method} is not allowed on {path}"),
        )
    };
    match segs.as_slice() {
        ["healthz"] => match method {
            Method::GET => {
                let h = sc.health();
                let status = if h.status == "ok" {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                };
                json(status, &h)
            }
            _ => not_allowed(),
        },
        ["metrics"] => match method {
            Method::GET => match sc.render_metrics() {
                Ok(text) => Response::builder()
                    .header("content-type", prometheus::TEXT_FORMAT)
                    .body(Full::new(Bytes::from(text)))
                    .unwrap_or_else(|_| Response::new(Full::new(Bytes::new()))),
                Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
            },
            _ => not_allowed(),
        },
        ["v1", "gpus"] => match method {
            Method::GET => json(StatusCode::OK, &sc.gpus()),
            _ => not_allowed(),
        },
        ["v1", "jobs"] => match method {
            Method::GET => json(StatusCode::OK, &sc.jobs()),
            _ => not_allowed(),
        },
        // POST only, so that a pod named `log-peak` can still be read with GET.
        ["v1", "jobs", rest @ ..]
            if method == Method::POST && rest.last() == Some(&"log-peak") && rest.len() >= 2 =>
        {
            let Some(id) = percent_decode(&rest[..rest.len() - 1].join("/")) else {
                return error(
                    StatusCode::BAD_REQUEST,
                    "malformed percent-escape in job id",
                );
            };
            let Some(key) = key_from_id(&id) else {
                return error(
                    StatusCode::BAD_REQUEST,
                    &format!(
                        "`{id}` is not a job id: give a Slurm job id, namespace/pod, or a pod UID"
                    ),
                );
            };
            match read_json::<LogPeak>(req).await {
                Ok(b) => json(StatusCode::OK, &sc.set_log_peak(key, b.peak_bytes)),
                Err(resp) => resp,
            }
        }
        ["v1", "jobs", rest @ ..] if !rest.is_empty() => {
            if method != Method::GET {
                return not_allowed();
            }
            let Some(id) = percent_decode(&rest.join("/")) else {
                return error(
                    StatusCode::BAD_REQUEST,
                    "malformed percent-escape in job id",
                );
            };
            match sc.job(&id) {
                Some(j) => json(StatusCode::OK, &j),
                None => error(
                    StatusCode::NOT_FOUND,
                    &format!("no job `{id}` on node {}: it has not used a GPU here, or it ended and was evicted after being read (GET /v1/jobs lists what is held)", sc.node()),
                ),
            }
        }
        ["v1", "simulate", "processes", tail @ ..] if tail.len() <= 1 => {
            let Some(sim) = sc.simulator().cloned() else {
                return error(
                    StatusCode::NOT_FOUND,
                    &format!("{path} exists only with `--backend simulate` (this sidecar runs --backend {})", sc.backend()),
                );
            };
            match (method.clone(), tail) {
                (Method::GET, []) => json(
                    StatusCode::OK,
                    &serde_json::json!({ "processes": sim.processes() }),
                ),
                (Method::POST, []) => {
                    let p: SimProcess = match read_json(req).await {
                        Ok(p) => p,
                        Err(resp) => return resp,
                    };
                    let id = p.job.key().id();
                    if let Err(e) = sim.upsert(p.clone()) {
                        return error(StatusCode::BAD_REQUEST, &e.to_string());
                    }
                    sc.sample_now();
                    json(
                        StatusCode::OK,
                        &serde_json::json!({ "process": p, "job": sc.job_peek(&id) }),
                    )
                }
                (Method::DELETE, [pid]) => {
                    let Ok(pid) = pid.parse::<u32>() else {
                        return error(
                            StatusCode::BAD_REQUEST,
                            &format!("`{pid}` is not a process id"),
                        );
                    };
                    let job = sim
                        .processes()
                        .into_iter()
                        .find(|p| p.pid == pid)
                        .map(|p| p.job.key().id());
                    if !sim.remove(pid) {
                        return error(
                            StatusCode::NOT_FOUND,
                            &format!("no simulated process {pid}"),
                        );
                    }
                    sc.sample_now();
                    let job = job.and_then(|id| sc.job_peek(&id));
                    json(
                        StatusCode::OK,
                        &serde_json::json!({ "deleted": pid, "job": job }),
                    )
                }
                _ => not_allowed(),
            }
        }
        _ => error(
            StatusCode::NOT_FOUND,
            &format!(
                "no route for {method} {path}; routes: {}",
                ROUTES.join(", ")
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_ids_in_paths_decode_to_keys() {
        assert_eq!(
            percent_decode("team-a%2Ftrain-0").as_deref(),
            Some("team-a/train-0")
        );
        assert_eq!(percent_decode("bad%2"), None);
        assert_eq!(percent_decode("bad%zz"), None);
        assert_eq!(
            key_from_id("ns/p"),
            Some(JobKey::Pod {
                namespace: "ns".into(),
                pod: "p".into()
            })
        );
        assert_eq!(
            key_from_id("123"),
            Some(JobKey::Slurm {
                slurm_job_id: "123".into()
            })
        );
        assert_eq!(
            key_from_id("0f4d7a3e-5b9c-4b1e-9e0c-2a0c7c3d8f11"),
            Some(JobKey::PodUid {
                pod_uid: "0f4d7a3e-5b9c-4b1e-9e0c-2a0c7c3d8f11".into()
            })
        );
        assert_eq!(key_from_id("a/b/c"), None);
        assert_eq!(key_from_id("/p"), None);
        assert_eq!(key_from_id("not an id"), None);
    }
}
