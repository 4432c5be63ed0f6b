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
//! | `POST /v1/jobs/{id}/log-peak` | bearer token; body `{"peak_bytes": 123}` — the peak the job's own log states (bytes per GPU); answers `JOB` with `"method":"log"` |
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
//! Unknown path: 404; known path, wrong method: 405 with `Allow`; bad body: 400; body over
//! 64 KiB: 413. `log-peak` needs `Authorization: Bearer <token>` (401; 403 when the sidecar
//! has no `--token-file`) and a peak in bytes, positive and not above the GPU's memory (400).

use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
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
    let body = serde_json::to_string(&crate::wire::sidecar::ErrorBody {
        error: msg.to_string(),
    })
    .unwrap_or_default();
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
    req: Request<crate::serve::Body>,
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

/// A stated peak above the largest GPU by more than this is refused: logs
/// round (`Peak memory: 79.65 GiB`), so a little over is still honest.
const LOG_PEAK_TOLERANCE: f64 = 0.02;

/// A log-stated peak the sidecar may keep: a positive whole number of
/// bytes, not above `gpu_memory` (plus [`LOG_PEAK_TOLERANCE`]): the job's
/// own device (its MIG slice on a MIG node), else the node's largest,
/// which `what` names.
fn check_log_peak(n: &serde_json::Number, gpu_memory: u64, what: &str) -> Result<u64, String> {
    let Some(peak) = n.as_u64() else {
        return Err(format!(
            "peak_bytes {n} is not a whole number of bytes: give the peak per GPU in bytes, e.g. 42949672960"
        ));
    };
    if peak == 0 {
        return Err("peak_bytes 0: a job that used its GPU has a positive peak".into());
    }
    let limit = (gpu_memory as f64 * (1.0 + LOG_PEAK_TOLERANCE)) as u64;
    if gpu_memory > 0 && peak > limit {
        return Err(format!(
            "peak_bytes {peak} is above {what} ({gpu_memory} bytes): give the peak per GPU in bytes, not a sum over GPUs nor another unit"
        ));
    }
    Ok(peak)
}

/// Writes need the bearer token of `--token-file` (the controller's).
#[allow(clippy::result_large_err)]
fn authorize(sc: &Sidecar, req: &Request<crate::serve::Body>) -> Result<(), Response<Full<Bytes>>> {
    let Some(token) = &sc.http_config().token else {
        return Err(error(
            StatusCode::FORBIDDEN,
            "this sidecar takes no writes: start it with --token-file (GPUFIT_TOKEN_FILE), the controller's token file",
        ));
    };
    let given = req
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match given {
        None => Err(error(
            StatusCode::UNAUTHORIZED,
            "send the sidecar's token as `Authorization: Bearer <token>`",
        )),
        Some(g) if !constant_time_eq(g.as_bytes(), token.as_bytes()) => {
            Err(error(StatusCode::UNAUTHORIZED, "wrong bearer token"))
        }
        Some(_) => Ok(()),
    }
}

/// Compares without an early exit, so the time taken does not tell how
/// much of a guessed token was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// What every handler answers.
type Reply = crate::serve::Reply;

/// Routes one request: each route is a function below.
pub async fn handle(sc: &Arc<Sidecar>, req: Request<crate::serve::Body>) -> Reply {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let segs: Vec<&str> = path.trim_end_matches('/').split('/').skip(1).collect();
    let get = method == Method::GET;
    match segs.as_slice() {
        ["healthz"] if get => healthz(sc),
        ["metrics"] if get => metrics(sc),
        ["v1", "gpus"] if get => json(StatusCode::OK, &sc.gpus()),
        ["v1", "jobs"] if get => json(StatusCode::OK, &sc.jobs()),
        ["healthz"] | ["metrics"] | ["v1", "gpus"] | ["v1", "jobs"] => {
            method_not_allowed(&method, &path, "GET")
        }
        // POST only, so that a pod named `log-peak` can still be read with GET.
        ["v1", "jobs", rest @ ..]
            if method == Method::POST && rest.last() == Some(&"log-peak") && rest.len() >= 2 =>
        {
            post_log_peak(sc, &rest[..rest.len() - 1], req).await
        }
        ["v1", "jobs", rest @ ..] if !rest.is_empty() => get_job(sc, &method, &path, rest),
        ["v1", "simulate", "processes", tail @ ..] if tail.len() <= 1 => {
            simulate_processes(sc, req, &method, &path, tail).await
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

/// 405 naming what the path takes (RFC 9110 requires `Allow`).
fn method_not_allowed(method: &Method, path: &str, allow: &str) -> Reply {
    let mut resp = error(
        StatusCode::METHOD_NOT_ALLOWED,
        &format!("{method} is not allowed on {path}: use {allow}"),
    );
    if let Ok(v) = http::HeaderValue::from_str(allow) {
        resp.headers_mut().insert(http::header::ALLOW, v);
    }
    resp
}

/// `GET /healthz`: 503 when sampling stopped, so a probe sees it.
fn healthz(sc: &Sidecar) -> Reply {
    let h = sc.health();
    let status = if h.status == "ok" {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json(status, &h)
}

/// `GET /metrics`: Prometheus text, not JSON.
fn metrics(sc: &Sidecar) -> Reply {
    match sc.render_metrics() {
        Ok(text) => Response::builder()
            .header("content-type", prometheus::TEXT_FORMAT)
            .body(Full::new(Bytes::from(text)))
            .unwrap_or_else(|_| Response::new(Full::new(Bytes::new()))),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    }
}

/// `POST /v1/jobs/{id}/log-peak`; `id_segs` is the path between `jobs/`
/// and `/log-peak`. The id is checked before the token so that a typo is
/// named even to a caller without one.
async fn post_log_peak(sc: &Sidecar, id_segs: &[&str], req: Request<crate::serve::Body>) -> Reply {
    let Some(id) = percent_decode(&id_segs.join("/")) else {
        return error(
            StatusCode::BAD_REQUEST,
            "malformed percent-escape in job id",
        );
    };
    let Some(key) = key_from_id(&id) else {
        return error(
            StatusCode::BAD_REQUEST,
            &format!("`{id}` is not a job id: give a Slurm job id, namespace/pod, or a pod UID"),
        );
    };
    if let Err(resp) = authorize(sc, &req) {
        return resp;
    }
    let body = match read_json::<crate::wire::sidecar::LogPeakRequest>(req).await {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    let (limit, what) = sc.log_peak_limit(&key);
    match check_log_peak(&body.peak_bytes, limit, &what) {
        Ok(peak) => json(StatusCode::OK, &sc.set_log_peak(key, peak)),
        Err(why) => error(StatusCode::BAD_REQUEST, &why),
    }
}

/// `GET /v1/jobs/{id}`; `rest` is the path after `jobs/` (a `namespace/pod`
/// id may come with its `/` unescaped).
fn get_job(sc: &Sidecar, method: &Method, path: &str, rest: &[&str]) -> Reply {
    if method != Method::GET {
        // `…/log-peak` takes POST (and a pod so named, GET).
        let allow = if rest.len() >= 2 && rest.last() == Some(&"log-peak") {
            "GET, POST"
        } else {
            "GET"
        };
        return method_not_allowed(method, path, allow);
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

/// `/v1/simulate/processes[/{pid}]`: only with `--backend simulate`.
async fn simulate_processes(
    sc: &Sidecar,
    req: Request<crate::serve::Body>,
    method: &Method,
    path: &str,
    tail: &[&str],
) -> Reply {
    let Some(sim) = sc.simulator().cloned() else {
        return error(
            StatusCode::NOT_FOUND,
            &format!(
                "{path} exists only with `--backend simulate` (this sidecar runs --backend {})",
                sc.backend()
            ),
        );
    };
    match (method.clone(), tail) {
        (Method::GET, []) => json(
            StatusCode::OK,
            &serde_json::json!({ "processes": sim.processes() }),
        ),
        (Method::POST, []) => post_sim_process(sc, &sim, req).await,
        (Method::DELETE, [pid]) => delete_sim_process(sc, &sim, pid),
        (_, []) => method_not_allowed(method, path, "GET, POST"),
        _ => method_not_allowed(method, path, "DELETE"),
    }
}

/// `POST /v1/simulate/processes`: registers the process (or sets its
/// memory) and samples at once, so that each call is seen.
async fn post_sim_process(
    sc: &Sidecar,
    sim: &super::simulate::SimulatedSource,
    req: Request<crate::serve::Body>,
) -> Reply {
    let p: SimProcess = match read_json(req).await {
        Ok(p) => p,
        Err(resp) => return resp,
    };
    let id = p.job.key().id();
    // --max-jobs bounds the jobs held, running ones included.
    if !sc.has_room_for(&id) {
        return error(
            StatusCode::TOO_MANY_REQUESTS,
            &format!("job `{id}` would exceed --max-jobs running jobs on this sidecar: end a job first (DELETE /v1/simulate/processes/{{pid}})"),
        );
    }
    if let Err(e) = sim.upsert(p.clone()) {
        return error(StatusCode::BAD_REQUEST, &e.to_string());
    }
    sc.sample_now();
    json(
        StatusCode::OK,
        &serde_json::json!({ "process": p, "job": sc.job_peek(&id) }),
    )
}

/// `DELETE /v1/simulate/processes/{pid}`: the process ends; answers the
/// job it belonged to as now sampled.
fn delete_sim_process(sc: &Sidecar, sim: &super::simulate::SimulatedSource, pid: &str) -> Reply {
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
