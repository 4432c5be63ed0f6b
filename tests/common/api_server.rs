//! One scripted API server for the Kubernetes tests (in the spirit of
//! kube-rs controller-rs's `ApiServerVerifier`): kube's `Client` over
//! `tower_test::mock`, answered from an in-memory store the way the API
//! server answers, with every request kept for the assertions and faults
//! scripted per scenario.
//!
//! - Objects are kept by `plural/name` (one namespace per scenario;
//!   cluster-scoped ones the same way), each with a `resourceVersion`
//!   bumped on every write.
//! - `GET` one or a collection (with `labelSelector`: `key`, `key=value`,
//!   comma-separated), `POST` (409 when it exists), `PUT` and `PATCH` — a
//!   server-side apply (`fieldManager` in the query) merges list-maps by
//!   `name`/`type` and honours a `resourceVersion` precondition (409); a
//!   merge patch is RFC 7386.
//! - Discovery (`GET /apis`) lists [`ApiServer::serving`]'s versions; a
//!   request for another version of a served group is a 404 and
//!   `unexpected`.
//! - Events are accepted and kept; [`Rule`]s script faults (403, 500, …).

// Each consumer uses part of this module.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use kube::Client;
use serde_json::{json, Value};

#[path = "mock_api.rs"]
mod mock_api;

/// One request as it reached the server.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub query: String,
    pub body: Value,
}

/// A scripted fault: requests matching it are answered `code` (`times`
/// times; `u32::MAX`: always).
#[derive(Debug, Clone)]
pub struct Rule {
    /// `GET`, `PATCH`, …; empty: any.
    pub method: &'static str,
    /// The path contains this.
    pub path: String,
    /// …and does not contain this (empty: no exception).
    pub unless: String,
    pub times: u32,
    pub code: u16,
    pub reason: &'static str,
}

#[derive(Default)]
pub struct ApiServer {
    /// Objects by `plural/name`.
    pub objects: BTreeMap<String, Value>,
    /// Every request (events included).
    pub seen: Vec<Seen>,
    /// Requests the server does not serve.
    pub unexpected: Vec<String>,
    /// `(group, version)` served; empty: every version of every group.
    pub served: Vec<(String, String)>,
    pub rules: Vec<Rule>,
    /// Another writer changes this object right after the next `GET` of it.
    pub bump_after_get: Option<String>,
    rv: u64,
}

/// A `Status` failure as the API server writes it.
pub fn status(code: u16, reason: &str) -> (u16, Value) {
    (
        code,
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
               "code": code, "message": format!("{reason} ({code})")}),
    )
}

impl ApiServer {
    /// Serves `group/version` (discovery lists it; other versions of its group 404).
    pub fn serving(mut self, group: &str, version: &str) -> Self {
        self.served.push((group.to_string(), version.to_string()));
        self
    }

    /// Stores `obj` under `key` (`plural/name`) with a fresh `resourceVersion`.
    pub fn insert(&mut self, key: &str, obj: Value) {
        self.objects.insert(key.to_string(), obj);
        self.bump(key);
    }

    /// A new `resourceVersion` for `key` (another writer changed it).
    pub fn bump(&mut self, key: &str) {
        self.rv += 1;
        let rv = self.rv.to_string();
        if let Some(o) = self.objects.get_mut(key) {
            if o.get("metadata").is_none() {
                o["metadata"] = json!({});
            }
            o["metadata"]["resourceVersion"] = json!(rv);
        }
    }

    /// Replaces every pod by `pods` (named by `metadata.name`).
    pub fn set_pods(&mut self, pods: Vec<Value>) {
        self.objects.retain(|k, _| !k.starts_with("pods/"));
        self.add_pods(pods);
    }

    pub fn add_pods(&mut self, pods: Vec<Value>) {
        for p in pods {
            let name = p["metadata"]["name"].as_str().unwrap_or("pod").to_string();
            self.objects.insert(format!("pods/{name}"), p);
        }
    }

    /// `(method, path, query)` of every write (not events).
    pub fn writes(&self) -> Vec<(String, String, String)> {
        self.seen
            .iter()
            .filter(|s| s.method != "GET" && !s.path.contains("/events.k8s.io/"))
            .map(|s| (s.method.clone(), s.path.clone(), s.query.clone()))
            .collect()
    }

    /// Writes to a `…/status` subresource.
    pub fn status_writes(&self) -> usize {
        self.writes()
            .iter()
            .filter(|(_, p, _)| p.ends_with("/status"))
            .count()
    }

    /// Writes to objects of `plural`.
    pub fn writes_to(&self, plural: &str) -> usize {
        self.writes()
            .iter()
            .filter(|(_, p, _)| {
                p.contains(&format!("/{plural}/")) || p.ends_with(&format!("/{plural}"))
            })
            .count()
    }

    /// Events published (their bodies).
    pub fn events(&self) -> Vec<Value> {
        self.seen
            .iter()
            .filter(|s| s.path.contains("/events.k8s.io/") && s.method == "POST")
            .map(|s| s.body.clone())
            .collect()
    }

    /// Scripts a fault.
    pub fn fail(
        &mut self,
        method: &'static str,
        path: &str,
        times: u32,
        code: u16,
        reason: &'static str,
    ) {
        self.rules.push(Rule {
            method,
            path: path.to_string(),
            unless: String::new(),
            times,
            code,
            reason,
        });
    }

    fn next_rv(&mut self) -> String {
        self.rv += 1;
        self.rv.to_string()
    }
}

/// The parts of a resource path.
struct Target {
    group: String,
    version: String,
    plural: String,
    name: Option<String>,
    sub: Option<String>,
}

fn target(path: &str) -> Option<Target> {
    let seg: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let (group, version, rest) = match *seg.first()? {
        "api" => (String::new(), seg.get(1)?.to_string(), &seg[2..]),
        "apis" => (
            seg.get(1)?.to_string(),
            seg.get(2)?.to_string(),
            seg.get(3..)?,
        ),
        _ => return None,
    };
    let rest = match rest {
        ["namespaces", _ns, more @ ..] if !more.is_empty() => more,
        r => r,
    };
    Some(Target {
        group,
        version,
        plural: rest.first()?.to_string(),
        name: rest.get(1).map(|s| s.to_string()),
        sub: rest.get(2).map(|s| s.to_string()),
    })
}

fn decode(q: &str) -> String {
    q.replace("%2F", "/")
        .replace("%3D", "=")
        .replace("%2C", ",")
        .replace("%21", "!")
}

/// Whether `labels` match a selector (`k`, `k=v`, `k!=v`, comma = and).
fn selects(labels: &Value, selector: &str) -> bool {
    selector.split(',').filter(|t| !t.is_empty()).all(|term| {
        if let Some((k, v)) = term.split_once("!=") {
            labels[k].as_str() != Some(v)
        } else if let Some((k, v)) = term.split_once('=') {
            labels[k].as_str() == Some(v.trim_start_matches('='))
        } else {
            labels[term].is_string()
        }
    })
}

/// Server-side apply of `add` onto `target`: objects merged, list-maps
/// (items with `name` or `type`) merged by key, anything else replaced.
fn apply(target: &mut Value, add: &Value) {
    match (target, add) {
        (Value::Object(t), Value::Object(a)) => {
            for (k, v) in a {
                match t.get_mut(k) {
                    Some(old) if !v.is_null() => apply(old, v),
                    _ => {
                        t.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (Value::Array(t), Value::Array(a))
            if a.iter()
                .all(|i| i.get("name").is_some() || i.get("type").is_some()) =>
        {
            for item in a {
                let key = |i: &Value| i.get("name").or(i.get("type")).cloned();
                match t.iter_mut().find(|o| key(o) == key(item)) {
                    Some(o) => *o = item.clone(),
                    None => t.push(item.clone()),
                }
            }
        }
        (t, a) => *t = a.clone(),
    }
}

/// Answers one request as the API server would.
pub fn answer(
    api: &mut ApiServer,
    method: &str,
    path: &str,
    query: &str,
    body: Value,
) -> (u16, Value) {
    api.seen.push(Seen {
        method: method.into(),
        path: path.into(),
        query: query.into(),
        body: body.clone(),
    });
    if path.starts_with("/apis/events.k8s.io/") {
        return (if method == "POST" { 201 } else { 200 }, body);
    }
    if let Some(r) = api.rules.iter_mut().find(|r| {
        r.times > 0
            && (r.method.is_empty() || r.method == method)
            && path.contains(&r.path)
            && (r.unless.is_empty() || !path.contains(&r.unless))
    }) {
        if r.times != u32::MAX {
            r.times -= 1;
        }
        return status(r.code, r.reason);
    }
    if path == "/apis" && method == "GET" {
        let mut groups: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (g, v) in api.served.iter().filter(|(g, _)| !g.is_empty()) {
            groups.entry(g).or_default().push(v);
        }
        let groups: Vec<Value> = groups
            .iter()
            .map(|(g, vs)| {
                let versions: Vec<Value> = vs
                    .iter()
                    .map(|v| json!({"groupVersion": format!("{g}/{v}"), "version": v}))
                    .collect();
                json!({"name": g, "versions": versions, "preferredVersion": versions[0]})
            })
            .collect();
        return (
            200,
            json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}),
        );
    }
    let Some(t) = target(path) else {
        api.unexpected.push(format!("{method} {path}?{query}"));
        return status(404, "NotFound");
    };
    let group_served = api.served.iter().any(|(g, _)| *g == t.group);
    if group_served
        && !api
            .served
            .iter()
            .any(|(g, v)| *g == t.group && *v == t.version)
    {
        api.unexpected
            .push(format!("{method} {path} (version not served)"));
        return status(404, "NotFound");
    }
    let key = t.name.as_ref().map(|n| format!("{}/{n}", t.plural));
    match (method, key, t.sub.as_deref()) {
        ("GET", None, _) => {
            let q = decode(query);
            let selector = q
                .split('&')
                .find_map(|kv| kv.strip_prefix("labelSelector="))
                .unwrap_or_default()
                .to_string();
            let prefix = format!("{}/", t.plural);
            let items: Vec<Value> = api
                .objects
                .iter()
                .filter(|(k, o)| {
                    k.starts_with(&prefix) && selects(&o["metadata"]["labels"], &selector)
                })
                .map(|(_, o)| o.clone())
                .collect();
            let rv = api.rv.to_string();
            (
                200,
                json!({"kind": "List", "apiVersion": "v1", "metadata": {"resourceVersion": rv}, "items": items}),
            )
        }
        ("POST", None, _) => {
            let name = body["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let key = format!("{}/{name}", t.plural);
            if api.objects.contains_key(&key) {
                return status(409, "AlreadyExists");
            }
            let mut obj = body;
            if obj["metadata"]["uid"].is_null() {
                obj["metadata"]["uid"] = json!(format!("uid-{name}"));
            }
            api.insert(&key, obj);
            (201, api.objects[&key].clone())
        }
        ("GET", Some(key), _) => match api.objects.get(&key).cloned() {
            Some(o) => {
                if api.bump_after_get.as_deref() == Some(key.as_str()) {
                    api.bump_after_get = None;
                    api.bump(&key);
                }
                (200, o)
            }
            None => status(404, "NotFound"),
        },
        ("PUT", Some(key), _) => {
            let Some(stored) = api.objects.get(&key) else {
                return status(404, "NotFound");
            };
            if body["metadata"]["resourceVersion"] != stored["metadata"]["resourceVersion"] {
                return status(409, "Conflict");
            }
            let rv = api.next_rv();
            let mut obj = body;
            obj["metadata"]["resourceVersion"] = json!(rv);
            api.objects.insert(key.clone(), obj.clone());
            (200, obj)
        }
        ("PATCH", Some(key), _) => {
            let ssa = query.contains("fieldManager=");
            let Some(stored) = api.objects.get_mut(&key) else {
                return status(404, "NotFound");
            };
            if ssa {
                if body["metadata"]["resourceVersion"].is_string()
                    && body["metadata"]["resourceVersion"] != stored["metadata"]["resourceVersion"]
                {
                    return status(409, "Conflict");
                }
                for (k, v) in body.as_object().into_iter().flatten() {
                    if !matches!(k.as_str(), "apiVersion" | "kind" | "metadata") {
                        apply(&mut stored[k.as_str()], v);
                    }
                }
            } else {
                json_patch::merge(stored, &body);
            }
            api.bump(&key);
            (200, api.objects[&key].clone())
        }
        _ => {
            api.unexpected.push(format!("{method} {path}?{query}"));
            status(405, "MethodNotAllowed")
        }
    }
}

/// A client talking to the scripted server over `api`.
pub fn client(api: Arc<Mutex<ApiServer>>) -> Client {
    mock_api::mock_client(api, answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_and_list_maps_behave_as_the_api_servers() {
        let l = json!({"a": "1", "b": "2"});
        assert!(selects(&l, "a"));
        assert!(selects(&l, "a=1,b=2"));
        assert!(!selects(&l, "a=2"));
        assert!(selects(&l, "a!=2"));
        assert!(!selects(&l, "c"));
        let mut st = json!({"checks": [{"name": "x", "state": "Pending"}, {"name": "y", "state": "Pending"}]});
        apply(
            &mut st,
            &json!({"checks": [{"name": "x", "state": "Ready"}]}),
        );
        assert_eq!(st["checks"][0]["state"], "Ready");
        assert_eq!(st["checks"][1]["state"], "Pending");
    }
}
