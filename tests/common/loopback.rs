//! Small HTTP helpers shared by the test files that talk to a server on
//! loopback.

// Each consumer uses part of this module.
#![allow(dead_code)]

use std::net::TcpListener;
use std::time::Duration;

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

pub fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(10))
        .build()
}

/// (status, JSON body) of a request, whatever the status.
pub fn call(req: ureq::Request, body: Option<&str>) -> (u16, serde_json::Value) {
    let resp = match body {
        Some(b) => req.set("Content-Type", "application/json").send_string(b),
        None => req.call(),
    };
    let resp = match resp {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("request failed: {e}"),
    };
    let status = resp.status();
    let text = resp.into_string().unwrap();
    let json =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("body is not JSON ({e}): {text}"));
    (status, json)
}
