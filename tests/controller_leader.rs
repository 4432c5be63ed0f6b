//! Leader election against kube's `Client` over `tower_test::mock`: a fake
//! API server holding one Lease, with optimistic concurrency on
//! `resourceVersion` as the real one has.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Request, Response};
use kube::client::Body;
use kube::Client;
use serde_json::{json, Value};

#[path = "common/controller.rs"]
mod fixtures;
use fixtures::*;

/// A fake API server holding one Lease, with optimistic concurrency on
/// `resourceVersion` as the real one has.
fn lease_client(lease: Arc<Mutex<Option<Value>>>) -> Client {
    let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    tokio::spawn(async move {
        while let Some((req, send)) = handle.next_request().await {
            let method = req.method().to_string();
            let path = req.uri().path().to_string();
            let bytes = req.into_body().collect_bytes().await.unwrap_or_default();
            let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            let base = "/apis/coordination.k8s.io/v1/namespaces/gpufit/leases";
            let (code, out) = {
                let mut l = lease.lock().unwrap();
                match (method.as_str(), path.as_str()) {
                    ("GET", p) if p == format!("{base}/gpufit-controller") => match l.as_ref() {
                        Some(v) => (200, v.clone()),
                        None => status_404("lease"),
                    },
                    ("POST", p) if p == base => {
                        let mut v = body.clone();
                        v["metadata"]["resourceVersion"] = json!("1");
                        *l = Some(v.clone());
                        (201, v)
                    }
                    ("PUT", p) if p == format!("{base}/gpufit-controller") => {
                        let current = l
                            .as_ref()
                            .and_then(|v| v["metadata"]["resourceVersion"].as_str())
                            .unwrap_or("");
                        if body["metadata"]["resourceVersion"].as_str() != Some(current) {
                            (
                                409,
                                json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Conflict", "code": 409, "message": "conflict"}),
                            )
                        } else {
                            let mut v = body.clone();
                            let next = current.parse::<u64>().unwrap_or(0) + 1;
                            v["metadata"]["resourceVersion"] = json!(next.to_string());
                            *l = Some(v.clone());
                            (200, v)
                        }
                    }
                    _ => (
                        500,
                        json!({"kind": "Status", "code": 500, "message": format!("unexpected {method} {path}")}),
                    ),
                }
            };
            send.send_response(
                Response::builder()
                    .status(code)
                    .header("content-type", "application/json")
                    .body(Body::from(serde_json::to_vec(&out).unwrap()))
                    .unwrap(),
            );
        }
    });
    Client::new(svc, "gpufit")
}

fn lease_cfg(identity: &str) -> gpufit::controller::leader::LeaderConfig {
    gpufit::controller::leader::LeaderConfig {
        lease_name: "gpufit-controller".into(),
        namespace: "gpufit".into(),
        identity: identity.into(),
        lease_duration: Duration::from_secs(15),
        renew_every: Duration::from_secs(5),
    }
}

#[tokio::test]
async fn the_first_replica_takes_the_lease_and_a_second_waits_until_it_expires() {
    use gpufit::controller::leader::{release, try_acquire};
    use k8s_openapi::api::coordination::v1::Lease;
    let lease = Arc::new(Mutex::new(None));
    let api: kube::Api<Lease> = kube::Api::namespaced(lease_client(lease.clone()), "gpufit");

    assert!(
        try_acquire(&api, &lease_cfg("replica-a"))
            .await
            .expect("api"),
        "a takes the free lease"
    );
    assert!(
        try_acquire(&api, &lease_cfg("replica-a"))
            .await
            .expect("api"),
        "a renews its lease"
    );
    assert!(
        !try_acquire(&api, &lease_cfg("replica-b"))
            .await
            .expect("api"),
        "b must not take a live lease"
    );
    assert_eq!(
        lease.lock().unwrap().as_ref().unwrap()["spec"]["holderIdentity"],
        "replica-a"
    );

    // a stops renewing: the lease expires and b takes over.
    lease.lock().unwrap().as_mut().unwrap()["spec"]["renewTime"] =
        json!("2020-01-01T00:00:00.000000Z");
    assert!(
        try_acquire(&api, &lease_cfg("replica-b"))
            .await
            .expect("api"),
        "b takes the expired lease"
    );
    let held = lease.lock().unwrap().clone().unwrap();
    assert_eq!(held["spec"]["holderIdentity"], "replica-b");
    assert_eq!(held["spec"]["leaseTransitions"], 1);
    assert!(
        !try_acquire(&api, &lease_cfg("replica-a"))
            .await
            .expect("api"),
        "a is follower now"
    );

    // b releases on shutdown; a takes over at once.
    release(&api, &lease_cfg("replica-b"))
        .await
        .expect("release");
    assert!(try_acquire(&api, &lease_cfg("replica-a"))
        .await
        .expect("api"));
}
