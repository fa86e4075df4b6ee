//! A scripted API server (tower-test mock) and fixtures for the reconciler tests.
//!
//! A [`Scenario`] is the exact list of calls a reconciliation must make: each [`Step`]
//! asserts the method, path, query and body of one request and answers it. A missing call,
//! a call out of order or an extra call fails the test.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use http::{Method, Request, Response, StatusCode};
use k8s_openapi::{
    api::{
        coordination::v1::{Lease, LeaseSpec},
        core::v1::Node,
        resource::v1::{ResourceClaim, ResourceSlice},
    },
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time},
    jiff::Timestamp,
};
use kube::{
    Client, ResourceExt,
    client::Body,
    core::PartialObjectMeta,
    runtime::{
        controller::Action,
        reflector::{self, store::Writer},
        watcher,
    },
};
use migdra_api::{
    catalog,
    inventory::{GpuInventory, GpuNode, GpuNodeSpec, GpuNodeStatus, PluginStatus},
    policy::MigPolicy,
};
use migdra_controller::{
    context::{Context, ControllerConfig, Stores},
    metrics::Metrics,
};
use serde_json::{Value, json};
use tower_test::mock;

pub const NODE: &str = "node-a";
pub const NODE_UID: &str = "uid-node-a";
pub const DRIVER: &str = "gpu.migdra.dev";
pub const POOL: &str = "node-a/gpu.migdra.dev";
pub const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(25);
pub const NAMESPACE: &str = "migdra-system";

type Handle = mock::Handle<Request<Body>, Response<Body>>;

/// A Context over stores the test fills by hand, and the mock API behind its client.
pub struct Harness {
    pub ctx: Arc<Context>,
    pub gpunodes: Writer<GpuNode>,
    pub nodes: Writer<PartialObjectMeta<Node>>,
    pub policies: Writer<MigPolicy>,
    pub slices: Writer<PartialObjectMeta<ResourceSlice>>,
    pub claims: Writer<ResourceClaim>,
    pub leases: Writer<Lease>,
    handle: Option<Handle>,
    rv: u64,
}

impl Harness {
    /// Empty, ready caches plus the Node `node-a`.
    pub fn new() -> Self {
        Self::with_config(|_| {})
    }

    /// [`Self::new`], with the controller settings changed by `configure`.
    pub fn with_config(configure: impl FnOnce(&mut ControllerConfig)) -> Self {
        let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(service, "default");
        let (gpunodes_store, mut gpunodes) = reflector::store();
        let (nodes_store, mut nodes) = reflector::store();
        let (policies_store, mut policies) = reflector::store();
        let (slices_store, mut slices) = reflector::store();
        let (claims_store, mut claims) = reflector::store();
        let (leases_store, mut leases) = reflector::store();
        leases.apply_watcher_event(&watcher::Event::InitDone);
        gpunodes.apply_watcher_event(&watcher::Event::InitDone);
        nodes.apply_watcher_event(&watcher::Event::InitDone);
        policies.apply_watcher_event(&watcher::Event::InitDone);
        slices.apply_watcher_event(&watcher::Event::InitDone);
        claims.apply_watcher_event(&watcher::Event::InitDone);
        let mut config = ControllerConfig {
            driver: DRIVER.into(),
            heartbeat_timeout: HEARTBEAT_TIMEOUT,
            mass_expiry_threshold: 0.55,
            identity: "controller-0".into(),
            ready_timeout: Duration::from_secs(1),
            heartbeat_namespace: NAMESPACE.into(),
            census_ttl: Duration::ZERO,
            concurrency: 0,
            expiry_withdrawal_interval: Duration::from_secs(10),
            status_defer_max: migdra_controller::reconcile::STATUS_DEFER_MAX,
            // Statuses wait only while slices are written, unless a test asks for more.
            status_defer_quiet: Duration::ZERO,
        };
        configure(&mut config);
        let stores = Stores {
            gpunodes: gpunodes_store,
            nodes: nodes_store,
            policies: policies_store,
            slices: slices_store,
            claims: claims_store,
            leases: leases_store,
        };
        let ctx = Arc::new(Context::new(client, config, stores, Metrics::new()));
        let mut h = Self {
            ctx,
            gpunodes,
            nodes,
            policies,
            slices,
            claims,
            leases,
            handle: Some(handle),
            rv: 100,
        };
        h.add_node(NODE, &[("gpu", "h100")]);
        h
    }

    pub fn add_node(&mut self, name: &str, labels: &[(&str, &str)]) {
        let node = PartialObjectMeta::<Node> {
            metadata: ObjectMeta {
                name: Some(name.into()),
                uid: Some(format!("uid-{name}")),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                ..Default::default()
            },
            ..Default::default()
        };
        self.nodes.apply_watcher_event(&watcher::Event::Apply(node));
    }

    pub fn delete_node(&mut self, name: &str) {
        let node = PartialObjectMeta::<Node> {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            ..Default::default()
        };
        self.nodes.apply_watcher_event(&watcher::Event::Delete(node));
    }

    /// Puts a claim holding `devices` of node-a's pool into the claim cache (or, with no
    /// devices, shows it released).
    pub fn claim(&mut self, name: &str, devices: &[&str]) {
        use k8s_openapi::api::resource::v1::{
            AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult, ResourceClaimStatus,
        };
        let results: Vec<DeviceRequestAllocationResult> = devices
            .iter()
            .map(|d| DeviceRequestAllocationResult {
                driver: DRIVER.into(),
                pool: POOL.into(),
                device: d.to_string(),
                request: "gpu".into(),
                ..Default::default()
            })
            .collect();
        let claim = ResourceClaim {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("default".into()),
                ..Default::default()
            },
            spec: Default::default(),
            status: (!results.is_empty()).then(|| ResourceClaimStatus {
                allocation: Some(AllocationResult {
                    devices: Some(DeviceAllocationResult {
                        results: Some(results),
                        config: None,
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
        };
        self.claims.apply_watcher_event(&watcher::Event::Apply(claim));
    }

    /// Puts a GpuNode into the GpuNode cache (the heartbeat census reads it).
    pub fn put_gpunode(&mut self, gpunode: &GpuNode) {
        self.gpunodes
            .apply_watcher_event(&watcher::Event::Apply(gpunode.clone()));
    }

    /// Removes a GpuNode from the GpuNode cache (a watch delete event).
    pub fn remove_gpunode(&mut self, gpunode: &GpuNode) {
        self.gpunodes
            .apply_watcher_event(&watcher::Event::Delete(gpunode.clone()));
    }

    /// Puts `node`'s heartbeat Lease, renewed at `renewed`, into the Lease cache.
    pub fn put_lease(&mut self, node: &str, renewed: Timestamp) {
        self.leases
            .apply_watcher_event(&watcher::Event::Apply(lease(node, renewed)));
    }

    pub fn add_policy(&mut self, policy: MigPolicy) {
        self.policies.apply_watcher_event(&watcher::Event::Apply(policy));
    }

    /// Feeds a watch event to the slice cache and to the expectations, as the controller's
    /// slice watch does: metadata only.
    pub fn slice_event(&mut self, event: watcher::Event<ResourceSlice>) {
        let meta = |s: ResourceSlice| PartialObjectMeta::<ResourceSlice> {
            metadata: s.metadata,
            ..Default::default()
        };
        let event = match event {
            watcher::Event::Apply(s) => watcher::Event::Apply(meta(s)),
            watcher::Event::InitApply(s) => watcher::Event::InitApply(meta(s)),
            watcher::Event::Delete(s) => watcher::Event::Delete(meta(s)),
            watcher::Event::Init => watcher::Event::Init,
            watcher::Event::InitDone => watcher::Event::InitDone,
        };
        self.slices.apply_watcher_event(&event);
        let wiped = self.ctx.observe_slice_event(&event);
        self.ctx.metrics.slices_wiped(wiped);
    }

    /// Puts what the API server stored into the slice cache.
    pub fn store_slices(&mut self, stored: &[ResourceSlice]) {
        for s in stored {
            self.slice_event(watcher::Event::Apply(s.clone()));
        }
    }

    /// Removes slices from the cache (a deletion observed by the watch).
    pub fn wipe_slices(&mut self, stored: &[ResourceSlice]) {
        for s in stored {
            self.slice_event(watcher::Event::Delete(s.clone()));
        }
    }

    /// Replaces the slice cache by a relist that shows only `stored` (no delete events).
    pub fn relist_slices(&mut self, stored: &[ResourceSlice]) {
        self.slice_event(watcher::Event::Init);
        for s in stored {
            self.slice_event(watcher::Event::InitApply(s.clone()));
        }
        self.slice_event(watcher::Event::InitDone);
    }

    /// Runs one reconciliation against `scenario`; returns its result and what the server
    /// stored for each write.
    pub async fn reconcile(
        &mut self,
        gpunode: &GpuNode,
        scenario: Scenario,
    ) -> (Result<Action, migdra_controller::Error>, Served) {
        let handle = self.handle.take().unwrap();
        let start_rv = self.rv;
        let verifier = tokio::spawn(scenario.serve(handle, start_rv));
        self.put_gpunode(gpunode);
        let result = tokio::time::timeout(
            Duration::from_secs(10),
            migdra_controller::reconcile::reconcile(Arc::new(gpunode.clone()), self.ctx.clone()),
        )
        .await;
        let (handle, served) = match verifier.await {
            Ok(done) => done,
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        };
        self.handle = Some(handle);
        self.rv = served.next_rv;
        (result.expect("reconcile hung"), served)
    }
}

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
    next_rv: u64,
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

    async fn serve(self, mut handle: Handle, mut rv: u64) -> (Handle, Served) {
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
            let bytes = body.collect_bytes().await.unwrap();
            let body: Value = if bytes.is_empty() {
                Value::Null
            } else {
                serde_json::from_slice(&bytes).unwrap()
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
                            .push(serde_json::from_value(stored.clone()).unwrap());
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
                        .push(serde_json::from_value(stored.clone()).unwrap());
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
                        .push(step.path.rsplit('/').next().unwrap().to_string());
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
        .body(Body::from(serde_json::to_vec(v).unwrap()))
        .unwrap()
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
    serde_json::from_value(body.clone()).unwrap()
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
        answer: Answer::Return(serde_json::to_value(live).unwrap()),
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
                req.headers().get("content-type").unwrap(),
                "application/apply-patch+yaml"
            );
            let status = body["status"].as_object().unwrap();
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
    (c["status"].as_str().unwrap(), c["reason"].as_str().unwrap())
}

/// `count` H100 GPUs.
pub fn h100s(count: u32) -> Vec<GpuInventory> {
    let model = catalog::model("H100-80GB").unwrap();
    (0..count).map(|minor| model.inventory(minor, true)).collect()
}

/// The plugin status of a live plugin.
pub fn live_plugin() -> PluginStatus {
    plugin(true, Timestamp::now())
}

pub fn plugin(registered: bool, heartbeat: Timestamp) -> PluginStatus {
    PluginStatus {
        version: "0.1.0".into(),
        registered,
        registration_error: None,
        start_time: Time(heartbeat),
        heartbeat_time: Time(heartbeat),
        heartbeat_interval_seconds: 15,
        driver_version: Some("580.82.07".into()),
    }
}

/// A heartbeat `seconds` ago.
/// Whole seconds, as a GpuNode's `metav1.Time` carries them: the cached GpuNode and the one
/// a GET returns then say the same.
pub fn ago(seconds: i64) -> Timestamp {
    let now = Timestamp::now().as_second();
    Timestamp::from_second(now - seconds).unwrap()
}

/// The GpuNode of `node-a` as the plugin writes it.
pub fn gpunode(plugin: Option<PluginStatus>, gpus: Vec<GpuInventory>) -> GpuNode {
    let mut g = GpuNode::new(
        NODE,
        GpuNodeSpec {
            node_name: NODE.into(),
            driver: DRIVER.into(),
        },
    );
    g.metadata.generation = Some(1);
    g.metadata.resource_version = Some("1".into());
    g.status = Some(GpuNodeStatus {
        plugin,
        gpus: Some(gpus),
        ..Default::default()
    });
    g
}

/// The GpuNode with the controller's status from a status patch merged in.
pub fn with_status_patch(mut g: GpuNode, patch: &Value) -> GpuNode {
    let status = g.status.get_or_insert_default();
    status.publication = serde_json::from_value(patch["status"]["publication"].clone()).unwrap();
    status.conditions = serde_json::from_value(patch["status"]["conditions"].clone()).unwrap();
    g
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
pub mod router;

/// The heartbeat Lease of `node` as the plugin writes it (15 s interval: 23 s duration).
pub fn lease(node: &str, renewed: Timestamp) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(format!("{node}.{DRIVER}")),
            namespace: Some(NAMESPACE.into()),
            labels: Some([("gpu.migdra.dev/heartbeat".to_string(), DRIVER.to_string())].into()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(node.into()),
            lease_duration_seconds: Some(23),
            renew_time: Some(MicroTime(renewed)),
            ..Default::default()
        }),
    }
}

/// The quorum GET of `g` that confirms a heartbeat expiry, answered with `g` as the server
/// has it.
pub fn get_gpunode(g: &GpuNode) -> Step {
    Step {
        method: Method::GET,
        path: format!("/apis/gpu.migdra.dev/v1alpha1/gpunodes/{}", g.name_any()),
        check: Box::new(|req, _| {
            assert_eq!(req.uri().query(), None, "a quorum read: no resourceVersion");
        }),
        answer: Answer::Return(serde_json::to_value(g).unwrap()),
    }
}

/// The quorum GET of `NODE`'s heartbeat Lease, answered with one renewed at `renewed`, or
/// 404 for `None`.
pub fn get_lease(renewed: Option<Timestamp>) -> Step {
    Step {
        method: Method::GET,
        path: format!("/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/{NODE}.{DRIVER}"),
        check: Box::new(|req, _| {
            assert_eq!(req.uri().query(), None, "a quorum read: no resourceVersion");
        }),
        answer: match renewed {
            Some(at) => Answer::Return(serde_json::to_value(lease(NODE, at)).unwrap()),
            None => Answer::Fail(StatusCode::NOT_FOUND, "NotFound"),
        },
    }
}
