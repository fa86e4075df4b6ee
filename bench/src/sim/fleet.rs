//! The fleet of simulated nodes: creates Node, node Lease and GpuNode for each, then keeps
//! every node live the way its kubelet and plugin would (node Lease every 10 s, plugin
//! heartbeat every interval, phases spread over the interval, `Ready` posted again when the
//! node lifecycle controller marked a node Unknown) until stopped. Records the
//! heartbeat writes' latency and failures: a late beat is a finding, not noise.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::Context as _;
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::{
    api::{coordination::v1::Lease, core::v1::Node},
    apimachinery::pkg::apis::meta::v1::MicroTime,
    jiff::Timestamp,
};
use kube::{
    Api, Client,
    api::{Patch, PatchParams, PostParams},
};
use serde_json::json;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{
    heartbeat::{Heartbeat, SimPlugin},
    objects::{NODE_LEASE_NAMESPACE, SIMULATED_LABEL, node_gpus, node_lease, node_name, node_object},
    transport::SharedTransport,
};
use crate::{retry::retry, stats::Samples};
use migdra_api::inventory::RenewalRetry;
use migdra_e2e::cluster::PluginIdentities;

/// How often a kubelet renews its node Lease.
const NODE_LEASE_RENEW: Duration = Duration::from_secs(10);
/// GPUs per simulated node.
pub const GPUS_PER_NODE: u32 = 8;

/// Heartbeat writes since the last [`Fleet::take_beat_stats`].
#[derive(Debug, Default)]
pub struct BeatStats {
    /// Latency of each successful heartbeat write.
    pub latency: Samples,
    /// Heartbeats that failed (after the retries due before the next beat).
    pub failures: u64,
    /// Refused heartbeat writes tried again before the next beat.
    pub retried: u64,
}

/// Simulated nodes kept live.
pub struct Fleet {
    client: Client,
    /// Mints each simulated plugin's own client; `None`: they share the admin client.
    identities: Option<PluginIdentities>,
    /// The connection stacks the plugins' own clients share, made with the first of them.
    transport: Arc<tokio::sync::OnceCell<SharedTransport>>,
    heartbeat: Heartbeat,
    plugins: Vec<SimPlugin>,
    cancel: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    stats: Arc<Mutex<BeatStats>>,
}

impl Fleet {
    /// An empty fleet whose plugins report with `heartbeat`, each through a client of its own
    /// from `identities`, or all through `client` (the admin's, for Nodes and node Leases).
    pub fn new(client: Client, identities: Option<PluginIdentities>, heartbeat: Heartbeat) -> Self {
        Self {
            client,
            identities,
            transport: Arc::default(),
            heartbeat,
            plugins: Vec::new(),
            cancel: CancellationToken::new(),
            tasks: Vec::new(),
            stats: Arc::default(),
        }
    }

    /// Number of simulated nodes.
    pub fn len(&self) -> usize {
        self.plugins.len()
    }

    /// True without nodes.
    pub fn is_empty(&self) -> bool {
        self.plugins.is_empty()
    }

    /// Names of the simulated nodes, in creation order.
    pub fn node_names(&self) -> Vec<String> {
        self.plugins.iter().map(|p| p.node.clone()).collect()
    }

    /// Adds nodes until there are `count`, `concurrency` creations at a time, and keeps each
    /// live from its creation on.
    pub async fn grow_to(&mut self, count: usize, concurrency: usize) -> anyhow::Result<()> {
        let start = self.plugins.len();
        if count <= start {
            return Ok(());
        }
        if self.tasks.is_empty() {
            self.tasks.push(tokio::spawn(restore_ready(
                self.client.clone(),
                self.cancel.clone(),
            )));
        }
        let (client, heartbeat) = (self.client.clone(), self.heartbeat.clone());
        let identities = self.identities.clone().map(|i| (i, self.transport.clone()));
        let (cancel, stats) = (self.cancel.clone(), self.stats.clone());
        // Each node is kept live from the moment it exists: a node created early must not
        // go stale while later ones are still being created.
        let created: Vec<(SimPlugin, JoinHandle<()>)> = stream::iter(start..count)
            .map(|i| {
                let (client, heartbeat) = (client.clone(), heartbeat.clone());
                let (cancel, stats, identities) = (cancel.clone(), stats.clone(), identities.clone());
                async move {
                    let identities = identities.as_ref().map(|(i, t)| (i, t.as_ref()));
                    let plugin = create_node(&client, identities, &heartbeat, i).await?;
                    let task = tokio::spawn(keep_live(
                        client,
                        heartbeat,
                        plugin.clone(),
                        phase(i),
                        cancel,
                        stats,
                    ));
                    anyhow::Ok((plugin, task))
                }
            })
            .buffer_unordered(concurrency.max(1))
            .try_collect()
            .await?;
        let mut created = created;
        created.sort_by(|a, b| a.0.node.cmp(&b.0.node));
        for (plugin, task) in created {
            self.tasks.push(task);
            self.plugins.push(plugin);
        }
        Ok(())
    }

    /// The heartbeat statistics since the last call.
    pub fn take_beat_stats(&self) -> BeatStats {
        self.stats
            .lock()
            .map(|mut s| std::mem::take(&mut *s))
            .unwrap_or_default()
    }

    /// Stops keeping the nodes live (their objects stay).
    pub async fn stop(self) {
        self.cancel.cancel();
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

/// Where in the interval node `index` beats, as a fraction: spread over the interval as
/// independent kubelets are (a multiplicative hash, so nodes added later do not bunch).
fn phase(index: usize) -> f64 {
    ((index as u64).wrapping_mul(2_654_435_761) % 10_000) as f64 / 10_000.0
}

async fn create_node(
    client: &Client,
    identities: Option<(&PluginIdentities, &tokio::sync::OnceCell<SharedTransport>)>,
    heartbeat: &Heartbeat,
    i: usize,
) -> anyhow::Result<SimPlugin> {
    let name = node_name(i);
    let nodes: Api<Node> = Api::all(client.clone());
    let now = Timestamp::now();
    let node = node_object(&name, now)?;
    let uid = match retry(|| async { nodes.create(&PostParams::default(), &node).await }).await {
        Ok(n) => n.metadata.uid,
        Err(kube::Error::Api(e)) if e.code == 409 => retry(|| nodes.get(&name)).await?.metadata.uid,
        Err(e) => return Err(e).with_context(|| format!("creating Node {name}")),
    }
    .with_context(|| format!("Node {name} has no uid"))?;
    // Status on create is kept for Nodes, but apply it too in case a policy dropped it.
    let status = json!({"status": serde_json::to_value(&node)?["status"].clone()});
    retry(|| async {
        nodes
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
            .await
    })
    .await
    .with_context(|| format!("writing the status of Node {name}"))?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), NODE_LEASE_NAMESPACE);
    let lease: Lease = serde_json::from_value(node_lease(&name, &uid, now))?;
    match retry(|| async { leases.create(&PostParams::default(), &lease).await }).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => return Err(e).with_context(|| format!("creating the node Lease of {name}")),
    }
    let (plugin_client, heartbeat_client) = match identities {
        Some((identities, transport)) => plugin_clients(identities, transport, &name, &uid).await?,
        None => (client.clone(), client.clone()),
    };
    let plugin = SimPlugin {
        gpus: Arc::new(node_gpus(&name, GPUS_PER_NODE)?),
        node: name.clone(),
        node_uid: uid,
        started: now,
        client: plugin_client,
        heartbeat_client,
    };
    retry(|| heartbeat.announce(&plugin))
        .await
        .with_context(|| format!("writing the GpuNode of {name}"))?;
    Ok(plugin)
}

/// The plugin's own clients for node `name` ([`SharedTransport::plugin_clients`]), with a
/// token of its own. The TokenRequest is retried a few times, as a loaded API server may
/// refuse one.
async fn plugin_clients(
    identities: &PluginIdentities,
    transport: &tokio::sync::OnceCell<SharedTransport>,
    name: &str,
    uid: &str,
) -> anyhow::Result<(Client, Client)> {
    let mut attempt = 1;
    loop {
        match identities.config_for(name, uid).await {
            Ok(config) => {
                let transport = transport
                    .get_or_try_init(|| async { SharedTransport::new(&config) })
                    .await?;
                return Ok(transport.plugin_clients(&config)?);
            }
            Err(e) if attempt < 4 => {
                tracing::debug!(node = %name, error = %format!("{e:#}"), "minting the plugin token failed; retrying");
                tokio::time::sleep(Duration::from_secs(attempt)).await;
                attempt += 1;
            }
            Err(e) => return Err(e.context(format!("minting the plugin token of {name}"))),
        }
    }
}

/// What a kubelet does when the node lifecycle controller marked its node Unknown (a Lease
/// renewal arrived late on a loaded API server): it posts `Ready=True` again on its next
/// status sync. One watch over the simulated Nodes does that for all of them.
async fn restore_ready(client: Client, cancel: CancellationToken) {
    let nodes: Api<Node> = Api::all(client);
    let config = kube::runtime::watcher::Config::default().labels(&format!("{SIMULATED_LABEL}=true"));
    let mut events = std::pin::pin!(kube::runtime::WatchStreamExt::applied_objects(
        kube::runtime::watcher(nodes.clone(), config)
    ));
    loop {
        let node = tokio::select! {
            _ = cancel.cancelled() => return,
            event = events.next() => match event {
                Some(Ok(node)) => node,
                Some(Err(_)) => continue,
                None => return,
            },
        };
        let ready = node
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
            .is_some_and(|c| c.status == "True");
        let Some(name) = node.metadata.name.clone() else {
            continue;
        };
        if ready {
            continue;
        }
        let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Timestamp::now());
        let patch = json!({"status": {"conditions": [{
            "type": "Ready", "status": "True", "reason": "KubeletReady",
            "message": "simulated by migdra-bench", "lastHeartbeatTime": now, "lastTransitionTime": now,
        }]}});
        if let Err(e) = nodes
            .patch_status(&name, &PatchParams::default(), &Patch::Strategic(patch))
            .await
        {
            tracing::debug!(node = %name, error = %e, "restoring Ready failed");
        }
    }
}

async fn keep_live(
    client: Client,
    heartbeat: Heartbeat,
    plugin: SimPlugin,
    phase: f64,
    cancel: CancellationToken,
    stats: Arc<Mutex<BeatStats>>,
) {
    let leases: Api<Lease> = Api::namespaced(client, NODE_LEASE_NAMESPACE);
    let interval = Duration::from_secs(u64::from(heartbeat.interval_seconds.max(1)));
    let start = tokio::time::Instant::now();
    let mut beats = tokio::time::interval_at(start + interval.mul_f64(phase), interval);
    let mut renewals = tokio::time::interval_at(start + NODE_LEASE_RENEW.mul_f64(phase), NODE_LEASE_RENEW);
    for timer in [&mut beats, &mut renewals] {
        timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    }
    // A refused renewal is tried again before the next beat, as the plugin's Lease task does.
    let mut retry = RenewalRetry::default();
    let mut retry_at: Option<tokio::time::Instant> = None;
    let mut began = Instant::now();
    let mut next_beat = tokio::time::Instant::now();
    loop {
        let attempt = tokio::select! {
            _ = cancel.cancelled() => return,
            beat = beats.tick() => {
                began = Instant::now();
                next_beat = beat + interval;
                retry_at = None;
                true
            }
            _ = sleep_until_some(retry_at) => {
                retry_at = None;
                true
            }
            _ = renewals.tick() => {
                let renew = json!({"spec": {"renewTime": MicroTime(Timestamp::now())}});
                if let Err(e) = leases.patch(&plugin.node, &PatchParams::default(), &Patch::Merge(renew)).await {
                    tracing::debug!(node = %plugin.node, error = %e, "renewing the node Lease failed");
                }
                false
            }
        };
        if !attempt {
            continue;
        }
        let result = heartbeat.beat(&plugin).await;
        let delay = match &result {
            Ok(()) => {
                retry.succeeded();
                None
            }
            Err(e) => {
                let status = match e {
                    kube::Error::Api(status) => Some(status.code),
                    _ => None,
                };
                let until_next_beat = next_beat.saturating_duration_since(tokio::time::Instant::now());
                RenewalRetry::retryable(status)
                    .then(|| retry.failed_now(until_next_beat))
                    .flatten()
            }
        };
        retry_at = delay.map(|d| tokio::time::Instant::now() + d);
        if let Ok(mut s) = stats.lock() {
            match (result, delay) {
                (Ok(()), _) => s.latency.push(began.elapsed()),
                (Err(_), Some(_)) => s.retried += 1,
                (Err(_), None) => s.failures += 1,
            }
        }
    }
}

/// Sleeps until `at`, or forever without one.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
