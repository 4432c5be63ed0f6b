//! kube's `Client` over `tower_test::mock`, answered by a scripted
//! in-memory API server: `answer(state, method, path, query, body)` gives
//! the status code and JSON body of each request, as Kubernetes would.

use std::sync::{Arc, Mutex};

use http::{Request, Response};
use kube::client::Body;
use kube::Client;
use serde_json::Value;

/// What the scripted server answers: (status code, JSON body).
pub type Answer<A> = fn(&mut A, &str, &str, &str, Value) -> (u16, Value);

/// Starts the scripted API server over `api`; returns a client talking to it.
pub fn mock_client<A: Send + 'static>(api: Arc<Mutex<A>>, answer: Answer<A>) -> Client {
    let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    tokio::spawn(async move {
        while let Some((req, send)) = handle.next_request().await {
            let method = req.method().to_string();
            let path = req.uri().path().to_string();
            let query = req.uri().query().unwrap_or("").to_string();
            let bytes = req.into_body().collect_bytes().await.unwrap_or_default();
            let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            let (code, out) = {
                let mut api = api.lock().expect("fake api lock");
                answer(&mut api, &method, &path, &query, body)
            };
            let resp = Response::builder()
                .status(code)
                .header("content-type", "application/json")
                .body(Body::from(serde_json::to_vec(&out).expect("json")))
                .expect("response");
            send.send_response(resp);
        }
    });
    Client::new(svc, "default")
}
