//! A scripted API server (tower-test mock): a [`Scenario`] is the exact list of calls a
//! reconciliation must make, each [`Step`] asserts the method, path, query and body of one
//! request and answers it. A missing call, a call out of order or an extra call fails the
//! test. The step builders below script the calls the reconciler makes.

use std::{collections::BTreeMap, time::Duration};

use http::{Method, Request, Response, StatusCode};
use k8s_openapi::{api::resource::v1::ResourceSlice, jiff::Timestamp};
use kube::{ResourceExt, client::Body, runtime::controller::Action};
use migdra_api::inventory::heartbeat_lease_name;
use serde_json::{Value, json};

use super::{DRIVER, NAMESPACE, NODE, SLICES, harness::Handle, lease};

/// What the scripted server answered.
#[derive(Debug, Default)]
pub struct Served {
    /// Slices as stored after each create/replace, in order.
    pub written: Vec<ResourceSlice>,
    /// Names of deleted slices, in order.
    pub deleted: Vec<String>,
    /// Bodies of status patches.
    pub status_patches: Vec<Value>,
    /// Bodies of created events.
    pub events: Vec<Value>,
    pub(super) next_rv: u64,
}

type Check = Box<dyn Fn(&Request<()>, &Value) + Send>;

/// What one step answers.
pub enum Answer {
    /// Store the body (as the API server would) and return it.
    Store(StatusCode),
    /// Answer with an error status.
    Fail(StatusCode, &'static str),
    /// Return the stored object, with this spec field dropped (a feature gate that is off).
    DropField(&'static str),
    /// Store the body with its quantities in the API server's canonical form (`40960Mi` as
    /// `40Gi`, `2000` as `2k`) and return it.
    StoreCanonical,
    /// Return `{"kind":"Status","status":"Success"}`.
    Success,
    /// Return this object as it is.
    Return(Value),
}

/// One expected call.
pub struct Step {
    pub method: Method,
    pub path: String,
    pub check: Check,
    pub answer: Answer,
}

/// The exact calls of one reconciliation.
#[derive(Default)]
pub struct Scenario(pub Vec<Step>);

impl Scenario {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn then(mut self, step: Step) -> Self {
        self.0.push(step);
        self
    }

    pub fn then_all(mut self, steps: impl IntoIterator<Item = Step>) -> Self {
        self.0.extend(steps);
        self
    }

    pub(super) async fn serve(self, mut handle: Handle, mut rv: u64) -> (Handle, Served) {
        let mut served = Served::default();
        let total = self.0.len();
        for (i, step) in self.0.into_iter().enumerate() {
            let next = tokio::time::timeout(Duration::from_secs(5), handle.next_request()).await;
            let (request, send) = next
                .unwrap_or_else(|_| {
                    panic!(
                        "missing call {}/{total}: expected {} {}",
                        i + 1,
                        step.method,
                        step.path
                    )
                })
                .expect("client dropped");
            let (parts, body) = request.into_parts();
            let bytes = body.collect_bytes().await.expect("request body");
            let body: Value = if bytes.is_empty() {
                Value::Null
            } else {
                serde_json::from_slice(&bytes).expect("a JSON request body")
            };
            let head = Request::from_parts(parts, ());
            assert_eq!(
                (head.method(), head.uri().path()),
                (&step.method, step.path.as_str()),
                "call {}/{total} (query {:?})",
                i + 1,
                head.uri().query()
            );
            (step.check)(&head, &body);
            let response = match step.answer {
                Answer::Store(code) => {
                    rv += 1;
                    let stored = store(body, rv);
                    if step.path.starts_with(SLICES) {
                        served
                            .written
                            .push(serde_json::from_value(stored.clone()).expect("a stored slice"));
                    } else if step.path.ends_with("/status") {
                        served.status_patches.push(stored.clone());
                        // The server answers with the whole object.
                        let object = json!({
                            "apiVersion": "gpu.migdra.dev/v1alpha1", "kind": "GpuNode",
                            "metadata": {"name": NODE, "resourceVersion": rv.to_string()},
                            "spec": {"nodeName": NODE, "driver": DRIVER},
                            "status": stored["status"],
                        });
                        send.send_response(json_response(code, &object));
                        continue;
                    } else if step.path.contains("/events") {
                        served.events.push(stored.clone());
                    }
                    json_response(code, &stored)
                }
                Answer::StoreCanonical => {
                    rv += 1;
                    let mut stored = store(body, rv);
                    canonical_quantities(&mut stored, false);
                    served
                        .written
                        .push(serde_json::from_value(stored.clone()).expect("a stored slice"));
                    json_response(StatusCode::CREATED, &stored)
                }
                Answer::DropField(field) => {
                    rv += 1;
                    let mut stored = store(body, rv);
                    drop_field(&mut stored, field);
                    json_response(StatusCode::OK, &stored)
                }
                Answer::Fail(code, reason) => json_response(
                    code,
                    &json!({
                        "kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "reason": reason, "code": code.as_u16(),
                        "message": format!("scripted {reason}"),
                    }),
                ),
                Answer::Return(object) => json_response(StatusCode::OK, &object),
                Answer::Success => {
                    served
                        .deleted
                        .push(step.path.rsplit('/').next().unwrap_or_default().to_string());
                    json_response(
                        StatusCode::OK,
                        &json!({"kind": "Status", "apiVersion": "v1", "status": "Success"}),
                    )
                }
            };
            send.send_response(response);
        }
        // Nothing else may come.
        if let Ok(Some((request, _))) =
            tokio::time::timeout(Duration::from_millis(200), handle.next_request()).await
        {
            panic!("unexpected extra call {} {}", request.method(), request.uri());
        }
        served.next_rv = rv;
        (handle, served)
    }
}

fn json_response(code: StatusCode, v: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Body::from(v.to_string().into_bytes()))
        .expect("a valid response")
}

/// What the API server stores: server metadata added, quantities in canonical form
/// (`40960Mi` becomes `40Gi`), false booleans and empty lists dropped.
fn store(mut body: Value, rv: u64) -> Value {
    if let Some(meta) = body.get_mut("metadata").and_then(Value::as_object_mut) {
        let name = meta
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or("x")
            .to_string();
        meta.insert("resourceVersion".into(), json!(rv.to_string()));
        meta.insert("uid".into(), json!(format!("uid-{name}")));
        meta.insert("creationTimestamp".into(), json!("2026-01-01T00:00:00Z"));
    }
    canonicalize(&mut body);
    body
}

fn canonicalize(v: &mut Value) {
    match v {
        Value::Object(map) => {
            if let Some(Value::String(q)) = map.get_mut("value")
                && let Some(mi) = q.strip_suffix("Mi").and_then(|n| n.parse::<u64>().ok())
                && mi % 1024 == 0
            {
                *q = format!("{}Gi", mi / 1024);
            }
            map.retain(|_, v| {
                !matches!(v, Value::Bool(false)) && !matches!(v, Value::Array(a) if a.is_empty())
            });
            for v in map.values_mut() {
                canonicalize(v);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(canonicalize),
        _ => {}
    }
}

fn drop_field(v: &mut Value, field: &str) {
    match v {
        Value::Object(map) => {
            map.remove(field);
            map.values_mut().for_each(|v| drop_field(v, field));
        }
        Value::Array(items) => items.iter_mut().for_each(|v| drop_field(v, field)),
        _ => {}
    }
}

/// Rewrites the quantities under `capacity` and `counters` maps (`{"value": q}`) the way the
/// API server stores them: binary suffixes scaled up while divisible by 1024, plain integers
/// by 1000.
fn canonical_quantities(v: &mut Value, in_quantity_map: bool) {
    match v {
        Value::Object(map) => {
            for (key, value) in map.iter_mut() {
                if in_quantity_map && let Some(Value::String(q)) = value.get_mut("value") {
                    *q = canonical_quantity(q);
                }
                canonical_quantities(value, key == "capacity" || key == "counters");
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| canonical_quantities(v, false)),
        _ => {}
    }
}

fn canonical_quantity(q: &str) -> String {
    let digits = q.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let (Ok(mut n), suffix) = (digits.parse::<u64>(), &q[digits.len()..]) else {
        return q.to_string();
    };
    // A binary suffix scales by 1024; a plain integer by 1000, into decimal suffixes.
    let (suffixes, base): (&[&str], u64) = match suffix {
        "Ki" | "Mi" | "Gi" | "Ti" => (&["", "Ki", "Mi", "Gi", "Ti"], 1024),
        "" => (&["", "k", "M", "G"], 1000),
        _ => return q.to_string(),
    };
    let mut i = suffixes.iter().position(|s| *s == suffix).unwrap_or(0);
    while n > 0 && n % base == 0 && i + 1 < suffixes.len() {
        n /= base;
        i += 1;
    }
    format!("{n}{}", suffixes[i])
}

fn query(req: &Request<()>) -> BTreeMap<String, String> {
    req.uri()
        .query()
        .unwrap_or_default()
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (k.to_string(), v.to_string())
        })
        .collect()
}

fn slice_of(body: &Value) -> ResourceSlice {
    serde_json::from_value(body.clone()).expect("a ResourceSlice body")
}

/// A POST creating slice `name`, checked by `check`.
pub fn create_slice(name: &str, check: impl Fn(&ResourceSlice) + Send + 'static) -> Step {
    let expected = name.to_string();
    Step {
        method: Method::POST,
        path: SLICES.into(),
        check: Box::new(move |req, body| {
            assert_eq!(
                query(req).get("fieldManager").map(String::as_str),
                Some("migdra-controller")
            );
            let slice = slice_of(body);
            assert_eq!(slice.name_any(), expected);
            assert!(
                slice.metadata.resource_version.is_none(),
                "a create carries no resourceVersion"
            );
            check(&slice);
        }),
        answer: Answer::Store(StatusCode::CREATED),
    }
}

/// A PUT replacing slice `name` read at `rv`.
pub fn replace_slice(name: &str, rv: Option<&str>, check: impl Fn(&ResourceSlice) + Send + 'static) -> Step {
    let expected_rv = rv.map(str::to_string);
    Step {
        method: Method::PUT,
        path: format!("{SLICES}/{name}"),
        check: Box::new(move |req, body| {
            assert_eq!(
                query(req).get("fieldManager").map(String::as_str),
                Some("migdra-controller")
            );
            let slice = slice_of(body);
            if let Some(rv) = &expected_rv {
                assert_eq!(
                    slice.metadata.resource_version.as_deref(),
                    Some(rv.as_str()),
                    "a replace is conditional on the version read"
                );
            }
            check(&slice);
        }),
        answer: Answer::Store(StatusCode::OK),
    }
}

/// A GET of slice `name` (the live version of a slice whose taint times a rewrite keeps),
/// answered with `live`.
pub fn get_slice(live: ResourceSlice) -> Step {
    let name = live.name_any();
    Step {
        method: Method::GET,
        path: format!("{SLICES}/{name}"),
        check: Box::new(|_, _| {}),
        answer: Answer::Return(serde_json::to_value(live).expect("a slice serializes")),
    }
}

/// A DELETE of slice `name`, with its UID as precondition.
pub fn delete_slice(name: &str) -> Step {
    let uid = format!("uid-{name}");
    Step {
        method: Method::DELETE,
        path: format!("{SLICES}/{name}"),
        check: Box::new(move |_, body| {
            assert_eq!(
                body["preconditions"]["uid"],
                json!(uid),
                "delete is conditional on the UID"
            );
        }),
        answer: Answer::Success,
    }
}

/// The server-side apply of the GpuNode status.
pub fn patch_status(check: impl Fn(&Value) + Send + 'static) -> Step {
    Step {
        method: Method::PATCH,
        path: format!("/apis/gpu.migdra.dev/v1alpha1/gpunodes/{NODE}/status"),
        check: Box::new(move |req, body| {
            let q = query(req);
            assert_eq!(
                q.get("fieldManager").map(String::as_str),
                Some("migdra-controller")
            );
            assert_eq!(q.get("force").map(String::as_str), Some("true"));
            assert_eq!(
                req.headers().get("content-type").expect("a content type"),
                "application/apply-patch+yaml"
            );
            let status = body["status"].as_object().expect("a status");
            assert!(
                status.keys().all(|k| k == "publication" || k == "conditions"),
                "the controller writes only its own status fields: {status:?}"
            );
            check(body);
        }),
        answer: Answer::Store(StatusCode::OK),
    }
}

/// A Warning event about the GpuNode with `reason`.
pub fn event(reason: &'static str) -> Step {
    Step {
        method: Method::POST,
        path: "/apis/events.k8s.io/v1/namespaces/default/events".into(),
        check: Box::new(move |_, body| {
            assert_eq!(body["reason"], reason);
            assert_eq!(body["type"], "Warning");
            assert_eq!(body["regarding"]["kind"], "GpuNode");
            assert_eq!(body["regarding"]["name"], NODE);
            assert_eq!(body["reportingController"], "migdra-controller");
        }),
        answer: Answer::Store(StatusCode::CREATED),
    }
}

/// Replaces the answer of a step.
pub fn answering(mut step: Step, answer: Answer) -> Step {
    step.answer = answer;
    step
}

/// The condition of a status patch body.
pub fn condition(body: &Value) -> (&str, &str) {
    let c = &body["status"]["conditions"][0];
    assert_eq!(c["type"], "Published");
    (
        c["status"].as_str().expect("a condition status"),
        c["reason"].as_str().expect("a condition reason"),
    )
}

/// The seconds of a requeue action.
pub fn requeue_secs(action: &Action) -> Option<u64> {
    let debug = format!("{action:?}");
    let inner = debug.split("Some(").nth(1)?;
    let secs: String = inner
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    secs.parse::<f64>().ok().map(|s| s as u64)
}
/// The quorum GET of `NODE`'s heartbeat Lease that confirms a heartbeat expiry, answered
/// with one renewed at `renewed`, or 404 for `None`.
pub fn get_lease(renewed: Option<Timestamp>) -> Step {
    Step {
        method: Method::GET,
        path: format!(
            "/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/{}",
            heartbeat_lease_name(NODE, DRIVER)
        ),
        check: Box::new(|req, _| {
            assert_eq!(req.uri().query(), None, "a quorum read: no resourceVersion");
        }),
        answer: match renewed {
            Some(at) => Answer::Return(serde_json::to_value(lease(NODE, at)).expect("a Lease serializes")),
            None => Answer::Fail(StatusCode::NOT_FOUND, "NotFound"),
        },
    }
}
