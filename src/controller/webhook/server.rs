//! The webhook's HTTPS server: TLS with a certificate reloaded when its
//! files change (cert-manager rotates it), `POST /mutate`, and the
//! AdmissionReview encoding the API server expects.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::{Method as HttpMethod, Request, Response, StatusCode};
use kube::api::DynamicObject;
use kube::core::admission::AdmissionReview;
use serde_json::Value;

use super::super::ControllerError;
use super::admission::review;
use super::{WebhookConfig, WebhookState, PATH};

/// Largest AdmissionReview accepted (the API server's own request limit is 3 MiB).
const MAX_BODY: usize = 8 << 20;

/// Reads a PEM certificate chain and private key into a rustls key.
fn load_certified_key(
    cert: &Path,
    key: &Path,
) -> Result<rustls::sign::CertifiedKey, ControllerError> {
    let read = |p: &Path| {
        std::fs::read(p)
            .map_err(|e| ControllerError::Tls(format!("cannot read {}: {e}", p.display())))
    };
    let cert_pem = read(cert)?;
    let key_pem = read(key)?;
    let certs = rustls_pemfile::certs(&mut cert_pem.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| {
            ControllerError::Tls(format!("{}: not a PEM certificate: {e}", cert.display()))
        })?;
    if certs.is_empty() {
        return Err(ControllerError::Tls(format!(
            "{} holds no certificate: pass the webhook's PEM certificate with --tls-cert",
            cert.display()
        )));
    }
    let key_der = rustls_pemfile::private_key(&mut key_pem.as_slice())
        .map_err(|e| ControllerError::Tls(format!("{}: not a PEM key: {e}", key.display())))?
        .ok_or_else(|| {
            ControllerError::Tls(format!(
                "{} holds no private key: pass the webhook's PEM key with --tls-key",
                key.display()
            ))
        })?;
    let signing = rustls::crypto::ring::sign::any_supported_type(&key_der)
        .map_err(|e| ControllerError::Tls(format!("{}: unsupported key: {e}", key.display())))?;
    let ck = rustls::sign::CertifiedKey::new(certs, signing);
    ck.keys_match()
        .map_err(|e| ControllerError::Tls(format!("certificate and key do not match: {e}")))?;
    Ok(ck)
}

/// Serves the certificate files' current content: cert-manager (or the
/// chart's own rotation) replaces them in place, and new handshakes pick the
/// new pair up within [`RELOAD_CHECK`] without a restart. A pair that fails
/// to load keeps the previous one (and says so in the log).
#[derive(Debug)]
struct ReloadingCert {
    cert: PathBuf,
    key: PathBuf,
    state: std::sync::RwLock<CertState>,
}

#[derive(Debug)]
struct CertState {
    key: Arc<rustls::sign::CertifiedKey>,
    stamp: Option<(std::time::SystemTime, std::time::SystemTime)>,
    checked: Instant,
}

/// How often the certificate files are looked at.
const RELOAD_CHECK: std::time::Duration = std::time::Duration::from_secs(30);

fn stamp(cert: &Path, key: &Path) -> Option<(std::time::SystemTime, std::time::SystemTime)> {
    let m = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    Some((m(cert)?, m(key)?))
}

impl rustls::server::ResolvesServerCert for ReloadingCert {
    fn resolve(
        &self,
        _hello: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        let (current, due) = {
            let st = self.state.read().ok()?;
            (st.key.clone(), st.checked.elapsed() >= RELOAD_CHECK)
        };
        if !due {
            return Some(current);
        }
        let mut st = self.state.write().ok()?;
        st.checked = Instant::now();
        let now = stamp(&self.cert, &self.key);
        if now.is_some() && now != st.stamp {
            match load_certified_key(&self.cert, &self.key) {
                Ok(k) => {
                    tracing::info!(cert = %self.cert.display(), "webhook certificate reloaded");
                    st.key = Arc::new(k);
                    st.stamp = now;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "new webhook certificate not usable; keeping the previous one")
                }
            }
        }
        Some(st.key.clone())
    }
}

/// A rustls server config over the PEM certificate and key, reloaded when
/// the files change.
pub fn tls_config(cert: &Path, key: &Path) -> Result<rustls::ServerConfig, ControllerError> {
    let first = load_certified_key(cert, key)?;
    let resolver = ReloadingCert {
        cert: cert.to_path_buf(),
        key: key.to_path_buf(),
        state: std::sync::RwLock::new(CertState {
            key: Arc::new(first),
            stamp: stamp(cert, key),
            checked: Instant::now(),
        }),
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ControllerError::Tls(e.to_string()))?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(resolver));
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

/// A bound webhook listener; [`Self::local_addr`] tells the port (tests bind port 0).
pub struct WebhookServer {
    listener: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl WebhookServer {
    /// Binds the listener and loads the certificate.
    pub async fn bind(cfg: &WebhookConfig) -> Result<Self, ControllerError> {
        let tls = tls_config(&cfg.cert, &cfg.key)?;
        let listener = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| ControllerError::Io {
                context: format!("cannot listen on {} for the webhook (is the port in use? pass --webhook-listen)", cfg.listen),
                source: e,
            })?;
        Ok(WebhookServer {
            listener,
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(tls)),
        })
    }

    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// How [`crate::serve`] holds the webhook's connections (TLS handshake
    /// and idle timeouts, the cap).
    pub fn serve_config() -> crate::serve::ServeConfig {
        crate::serve::ServeConfig {
            name: "webhook",
            ..crate::serve::ServeConfig::default()
        }
    }

    /// Serves until `shutdown` resolves.
    pub async fn serve(
        self,
        state: Arc<WebhookState>,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> Result<(), ControllerError> {
        let handler = move |req| handle(req, state.clone());
        crate::serve::serve(
            self.listener,
            &Self::serve_config(),
            Some(self.acceptor),
            handler,
            shutdown,
        )
        .await;
        Ok(())
    }
}

async fn handle(
    req: Request<crate::serve::Body>,
    state: Arc<WebhookState>,
) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, body: Vec<u8>, json: bool| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        if json {
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("application/json"),
            );
        }
        r
    };
    match (req.method(), req.uri().path()) {
        (&HttpMethod::GET, "/healthz") => reply(StatusCode::OK, b"ok\n".to_vec(), false),
        (&HttpMethod::POST, PATH) => {
            let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) => {
                    return reply(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        format!("cannot read the request: {e}\n").into_bytes(),
                        false,
                    )
                }
            };
            // The history lookup is blocking (SQLite/PostgreSQL).
            let out = tokio::task::spawn_blocking(move || {
                let review = review(&body, &state);
                review_json(&review)
            })
            .await;
            match out {
                Ok(Ok(bytes)) => reply(StatusCode::OK, bytes, true),
                Ok(Err(e)) => reply(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("{e}\n").into_bytes(),
                    false,
                ),
                Err(e) => reply(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("{e}\n").into_bytes(),
                    false,
                ),
            }
        }
        _ => reply(
            StatusCode::NOT_FOUND,
            format!("not found: POST {PATH}\n").into_bytes(),
            false,
        ),
    }
}

/// The review as the API server expects it: like Go's `[]byte`, the JSON
/// patch travels as a base64 string (kube serializes it as an array of
/// numbers, which only some API server versions accept).
pub fn review_json(review: &AdmissionReview<DynamicObject>) -> Result<Vec<u8>, serde_json::Error> {
    let mut v = serde_json::to_value(review)?;
    if let Some(p) = v.pointer_mut("/response/patch") {
        if let Some(arr) = p.as_array() {
            let bytes: Vec<u8> = arr
                .iter()
                .filter_map(|b| b.as_u64().and_then(|b| u8::try_from(b).ok()))
                .collect();
            *p = Value::String(base64::engine::general_purpose::STANDARD.encode(&bytes));
        }
    }
    serde_json::to_vec(&v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_patch_travels_as_standard_base64() {
        use kube::core::admission::AdmissionResponse;
        let patch: json_patch::Patch = serde_json::from_value(serde_json::json!([
            {"op": "add", "path": "/metadata/annotations/a", "value": "fooba"}
        ]))
        .expect("a patch");
        let review = AdmissionResponse::invalid("x")
            .with_patch(patch.clone())
            .expect("patch encodes")
            .into_review();
        let v: Value = serde_json::from_slice(&review_json(&review).expect("encodes")).unwrap();
        let text = v
            .pointer("/response/patch")
            .and_then(Value::as_str)
            .expect("a base64 string");
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(text)
            .expect("standard base64");
        assert_eq!(decoded, serde_json::to_vec(&patch).unwrap());
        // RFC 4648 test vector, as the hand-written encoder was checked.
        assert_eq!(
            base64::engine::general_purpose::STANDARD.encode("fooba"),
            "Zm9vYmE="
        );
    }
}
