//! A stateful fake API server for tests that run whole loops (leader election, the
//! controller with its watches): each request goes to a handler by method and path, in
//! whatever order the client sends them. A handler may hold a request open (a watch).

use std::sync::{Arc, Mutex};

use http::{Method, Request, Response, StatusCode};
use kube::{Client, client::Body};
use serde_json::Value;
use tower_test::mock;

/// One request as the handler sees it.
#[derive(Clone, Debug)]
pub struct Call {
    pub method: Method,
    pub path: String,
    pub query: String,
    pub body: Value,
}

impl Call {
    /// True for a watch request.
    pub fn is_watch(&self) -> bool {
        self.query
            .split('&')
            .any(|kv| kv == "watch=true" || kv == "watch=1")
    }
}

/// What a handler does with a request.
pub enum Reply {
    /// Answer with this status and JSON body.
    Json(StatusCode, Value),
    /// Never answer (a watch that stays open with no events).
    Hold,
}

/// Serves `handler` until the client is dropped; returns the client and the call log.
pub fn serve(handler: impl Fn(&Call) -> Reply + Send + 'static) -> (Client, Arc<Mutex<Vec<Call>>>) {
    let (service, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    let log = Arc::new(Mutex::new(Vec::new()));
    let calls = log.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Some((request, send)) = handle.next_request().await {
            let (parts, body) = request.into_parts();
            let bytes = body.collect_bytes().await.expect("request body");
            let call = Call {
                method: parts.method.clone(),
                path: parts.uri.path().to_string(),
                query: parts.uri.query().unwrap_or_default().to_string(),
                body: if bytes.is_empty() {
                    Value::Null
                } else {
                    serde_json::from_slice(&bytes).unwrap_or(Value::Null)
                },
            };
            calls.lock().unwrap_or_else(|p| p.into_inner()).push(call.clone());
            match handler(&call) {
                Reply::Json(code, value) => send.send_response(
                    Response::builder()
                        .status(code)
                        .header("content-type", "application/json")
                        .body(Body::from(value.to_string().into_bytes()))
                        .expect("a valid response"),
                ),
                Reply::Hold => held.push(send),
            }
        }
    });
    (Client::new(service, "default"), log)
}

/// A Status error body.
pub fn status(code: StatusCode, reason: &str) -> Reply {
    Reply::Json(
        code,
        serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "status": "Failure",
            "reason": reason, "code": code.as_u16(), "message": reason,
        }),
    )
}
