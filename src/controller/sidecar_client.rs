//! Client for the node sidecar's job endpoint, the fallback source of a
//! finished pod's peak GPU memory when Prometheus has none:
//! `GET {base}/v1/jobs/{namespace}/{pod}`. The base URL is a template: the
//! sidecar runs on every GPU node, so `{host_ip}` and `{node}` are replaced
//! by the pod's node (e.g. `http://{host_ip}:9400`).

use std::time::Duration;

/// The sidecar endpoint template and timeout.
#[derive(Debug, Clone)]
pub struct SidecarClient {
    template: String,
    agent: ureq::Agent,
}

impl SidecarClient {
    pub fn new(template: &str, timeout: Duration) -> Self {
        SidecarClient {
            template: template.trim_end_matches('/').to_string(),
            agent: ureq::AgentBuilder::new()
                .timeout_connect(timeout)
                .timeout(timeout)
                .build(),
        }
    }

    /// The base URL for a pod on a node.
    pub fn base_for(&self, host_ip: &str, node: &str) -> String {
        self.template
            .replace("{host_ip}", host_ip)
            .replace("{node}", node)
    }

    /// Peak GPU memory of one pod in bytes; `Ok(None)` when the sidecar does
    /// not know the pod (404) or reports no peak. Blocking.
    pub fn pod_peak(
        &self,
        host_ip: &str,
        node: &str,
        namespace: &str,
        pod: &str,
    ) -> Result<Option<u64>, String> {
        let url = format!("{}/v1/jobs/{namespace}/{pod}", self.base_for(host_ip, node));
        let resp = match self.agent.get(&url).call() {
            Ok(r) => r,
            Err(ureq::Error::Status(404, _)) => return Ok(None),
            Err(e) => return Err(format!("GET {url}: {e}")),
        };
        // The sidecar's own type: one definition for its server and clients.
        let job: crate::wire::sidecar::JobView = resp
            .into_json()
            .map_err(|e| format!("GET {url}: not a sidecar job: {e}"))?;
        // 0: the sidecar saw the pod but no memory figure of it.
        Ok(Some(job.peak_bytes).filter(|p| *p > 0))
    }
}
