//! The controller's heartbeat state: the Lease cache, when it observed each node's last
//! renewal and its kubelet Lease's (the witness), which nodes it found live and until when,
//! the heartbeat census, the rate limit on expiry withdrawals and how late renewals arrive
//! right now.

use std::{
    collections::HashMap,
    sync::{
        Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use k8s_openapi::api::coordination::v1::Lease;
use kube::{
    Api, Client,
    runtime::reflector::{ObjectRef, Store},
};
use migdra_api::inventory::{GpuNode, heartbeat_lease_name};

use super::{DEFAULT_NODE_LEASE_DURATION, Heartbeat, HeartbeatCensus, LeaseBeat, Witness, lease_node};
use crate::{
    context::{ControllerConfig, Stores},
    error::Error,
    lag_windows::RecentDelays,
    lock,
    metrics::Metrics,
};

/// How long the read that confirms a heartbeat expiry may take before the expiry counts as
/// unconfirmed (the pool is kept and the node retried with backoff).
pub const CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);

/// The most a slow control plane extends a heartbeat's timeout by (see
/// [`HeartbeatTracker::allowance`]). A plugin that really died loses its slices to the
/// kubelet's wipe 30 s after its connection drops, whatever this is.
pub const MAX_HEARTBEAT_ALLOWANCE: Duration = Duration::from_secs(120);

/// How many recent renewals the allowance needs: fewer say nothing about the control plane.
pub const MIN_DELAY_SAMPLES: u64 = 20;

/// A renewal of a plugin's Lease and when the controller first observed it.
#[derive(Clone, Debug)]
struct Renewal {
    beat: LeaseBeat,
    observed: Instant,
}

/// The heartbeat state every reconciliation shares.
pub struct HeartbeatTracker {
    config: ControllerConfig,
    /// Every GpuNode, for the registrations the census counts.
    gpunodes: Store<GpuNode>,
    leases: Store<Lease>,
    /// For the reads that confirm an expiry.
    lease_api: Api<Lease>,
    metrics: Metrics,
    /// Whether the last census held expiry withdrawals back (logged when it changes).
    holding: AtomicBool,
    /// The last census, when it was taken and whether it holds expiry back.
    census: Mutex<Option<(Instant, HeartbeatCensus, bool)>>,
    last_expiry_withdrawal: Mutex<Option<Instant>>,
    /// Per node, the last renewal observed and when.
    observed: Mutex<HashMap<String, Renewal>>,
    /// Per node, its kubelet Lease's last renewal and the run of renewals it belongs to.
    witnesses: Mutex<HashMap<String, (LeaseBeat, Witness)>>,
    /// How much later than the one before it each recent renewal reached the controller (see
    /// [`Self::allowance`]).
    lateness: Mutex<RecentDelays>,
    /// Nodes whose last reconciliation found the plugin live, with the heartbeat expiry it
    /// saw: a Lease renewal of theirs needs no reconciliation (the expiry watch re-checks
    /// them, see [`Self::take_expired`]), one of any other node does.
    live: Mutex<HashMap<String, Instant>>,
}

impl HeartbeatTracker {
    pub fn new(client: Client, config: &ControllerConfig, stores: &Stores, metrics: Metrics) -> Self {
        Self {
            config: config.clone(),
            gpunodes: stores.gpunodes.clone(),
            leases: stores.leases.clone(),
            lease_api: Api::namespaced(client, &config.heartbeat_namespace),
            metrics,
            holding: AtomicBool::new(false),
            census: Mutex::new(None),
            last_expiry_withdrawal: Mutex::new(None),
            observed: Mutex::new(HashMap::new()),
            witnesses: Mutex::new(HashMap::new()),
            lateness: Mutex::new(RecentDelays::new(Instant::now())),
            live: Mutex::new(HashMap::new()),
        }
    }

    /// `node`'s heartbeat: the last renewal of its Lease and when the controller observed it.
    /// A Lease the controller has not observed yet (the first look after a start) counts as
    /// observed now.
    pub fn heartbeat(&self, node: &str) -> Option<Heartbeat> {
        let name = heartbeat_lease_name(node, &self.config.driver);
        let lease = self
            .leases
            .get(&ObjectRef::new(&name).within(&self.config.heartbeat_namespace))?;
        let beat = LeaseBeat::of(&lease).filter(|_| lease_node(&lease, &self.config.driver) == Some(node))?;
        Some(self.note(node, beat, Instant::now(), false))
    }

    /// Notes a Lease a watch event delivered `at`: a renewal, if it is later than the last
    /// one observed, which also measures how late it arrived ([`Self::allowance`]).
    pub fn observe(&self, lease: &Lease, at: Instant) {
        self.observe_lease(lease, at, true);
    }

    /// [`Self::observe`] for a Lease from a list (the watch's start or a relist), whose
    /// arrival says nothing about how fast renewals travel.
    pub fn observe_listed(&self, lease: &Lease, at: Instant) {
        self.observe_lease(lease, at, false);
    }

    /// Forgets a deleted Lease's renewals.
    pub fn forget(&self, lease: &Lease) {
        if let Some(node) = lease_node(lease, &self.config.driver) {
            lock(&self.observed).remove(node);
        }
    }

    fn observe_lease(&self, lease: &Lease, at: Instant, measure: bool) {
        if let Some(node) = lease_node(lease, &self.config.driver)
            && let Some(beat) = LeaseBeat::of(lease)
        {
            self.note(node, beat, at, measure);
        }
    }

    /// Records `beat` of `node`, seen `at`, if it renews the last one observed; returns the
    /// heartbeat that holds now. With `measure`, a renewal's lateness is recorded: how much
    /// longer the controller waited for it than the node took between the two renewals (both
    /// intervals on one clock each, so no clock skew enters it; a constant delay cancels out,
    /// as it does for liveness).
    fn note(&self, node: &str, beat: LeaseBeat, at: Instant, measure: bool) -> Heartbeat {
        let mut observed = lock(&self.observed);
        let renewal = match observed.get_mut(node) {
            None => {
                let renewal = Renewal { beat, observed: at };
                observed.insert(node.to_string(), renewal.clone());
                renewal
            }
            Some(last) if !beat.renews(&last.beat) => last.clone(),
            Some(last) => {
                if measure
                    && let Ok(sent_apart) = Duration::try_from(beat.renewed.duration_since(last.beat.renewed))
                    && !sent_apart.is_zero()
                {
                    let lateness = at
                        .saturating_duration_since(last.observed)
                        .saturating_sub(sent_apart);
                    lock(&self.lateness).record(Instant::now(), lateness);
                }
                *last = Renewal { beat, observed: at };
                last.clone()
            }
        };
        drop(observed);
        Heartbeat {
            beat: renewal.beat,
            observed: renewal.observed,
            witness: self.witness(node),
        }
    }

    /// Notes a kubelet Lease (in [`super::NODE_LEASE_NAMESPACE`], named after its node) a
    /// watch delivered `at`: a renewal later than the last one observed extends the node's
    /// run of renewals, or starts a new one when it comes more than half the Lease's duration
    /// after the last (see [`Witness`]).
    pub fn observe_node_lease(&self, lease: &Lease, at: Instant) {
        let (Some(node), Some(beat)) = (lease.metadata.name.as_deref(), LeaseBeat::of(lease)) else {
            return;
        };
        let mut witnesses = lock(&self.witnesses);
        match witnesses.get_mut(node) {
            None => {
                tracing::debug!(node, "first kubelet Lease renewal observed");
                let witness = Witness { last: at, since: at };
                witnesses.insert(node.to_string(), (beat, witness));
            }
            Some((last_beat, witness)) if beat.renews(last_beat) => {
                let duration = match beat.duration {
                    Duration::ZERO => DEFAULT_NODE_LEASE_DURATION,
                    duration => duration,
                };
                let gap = at.saturating_duration_since(witness.last);
                if gap > duration / 2 {
                    tracing::debug!(
                        node,
                        gap_seconds = gap.as_secs_f64(),
                        "the node's kubelet Lease renews again after a gap: its plugin's \
                         heartbeat timeout restarts"
                    );
                    witness.since = at;
                }
                witness.last = witness.last.max(at);
                *last_beat = beat;
            }
            Some(_) => {}
        }
    }

    /// Forgets `node`'s kubelet Lease (deleted): the node has no witness until a new one is
    /// observed.
    pub fn forget_node_lease(&self, node: &str) {
        lock(&self.witnesses).remove(node);
    }

    /// Keeps the kubelet Leases of the nodes `keep` names (those a relist still shows).
    pub fn retain_node_leases(&self, keep: impl Fn(&str) -> bool) {
        lock(&self.witnesses).retain(|node, _| keep(node));
    }

    fn witness(&self, node: &str) -> Option<Witness> {
        lock(&self.witnesses).get(node).map(|(_, witness)| *witness)
    }

    /// How much later than its timeout a heartbeat may be before its expiry withdraws the
    /// pool: the 99th percentile of renewal lateness over the last one to two minutes (none
    /// with fewer than [`MIN_DELAY_SAMPLES`]), at most [`MAX_HEARTBEAT_ALLOWANCE`]. Behind a
    /// saturated API server renewals are delayed by varying amounts, so the gaps between them
    /// stretch; a beat late by what is normal right now means a slow control plane, not a dead
    /// plugin (see docs/benchmarks.md).
    pub fn allowance(&self) -> Duration {
        lock(&self.lateness)
            .quantile(Instant::now(), 0.99, MIN_DELAY_SAMPLES)
            .map_or(Duration::ZERO, |d| d.min(MAX_HEARTBEAT_ALLOWANCE))
    }

    pub fn set_live(&self, node: &str, expires: Instant) {
        lock(&self.live).insert(node.to_string(), expires);
    }

    pub fn set_not_live(&self, node: &str) {
        lock(&self.live).remove(node);
    }

    /// True when the last reconciliation of `node` found its plugin live.
    pub fn is_live(&self, node: &str) -> bool {
        lock(&self.live).contains_key(node)
    }

    /// The heartbeat expiry `node` is next looked at, while it counts as live.
    pub fn live_until(&self, node: &str) -> Option<Instant> {
        lock(&self.live).get(node).copied()
    }

    /// The live nodes whose heartbeat expired by `now` in the caches, for a reconciliation to
    /// decide what the expiry means. They stop counting as live, so a late renewal of theirs
    /// triggers a reconciliation too. A live node whose Lease was renewed since is moved to
    /// its new expiry: a steady heartbeat costs a comparison, not a reconciliation.
    pub fn take_expired(&self, now: Instant) -> Vec<String> {
        let mut live = lock(&self.live);
        let mut expired = Vec::new();
        for (node, expires) in live.iter_mut() {
            if now < *expires {
                continue;
            }
            let renewed = self
                .heartbeat(node)
                .map(|heartbeat| heartbeat.expires(self.config.heartbeat_timeout))
                .filter(|renewed| now < *renewed);
            match renewed {
                Some(renewed) => *expires = renewed,
                None => expired.push(node.clone()),
            }
        }
        for node in &expired {
            live.remove(node);
        }
        expired
    }

    /// The heartbeats of every GpuNode of this driver at `now` (reused for
    /// [`ControllerConfig::census_ttl`]), and whether heartbeat expiry is held back; records
    /// that in the metrics and the log.
    pub fn census(&self, now: Instant) -> (HeartbeatCensus, bool) {
        let mut cached = lock(&self.census);
        if let Some((at, census, hold)) = *cached
            && at.elapsed() < self.config.census_ttl
        {
            return (census, hold);
        }
        let gpunodes = self.gpunodes.state();
        let census = HeartbeatCensus::take(
            gpunodes
                .iter()
                .filter(|g| g.spec.driver == self.config.driver)
                .map(|g| {
                    let plugin = g.status.as_ref().and_then(|s| s.plugin.as_ref());
                    let name = g.metadata.name.as_deref().unwrap_or_default();
                    let heartbeat = plugin.and_then(|_| self.heartbeat(name));
                    (plugin, heartbeat)
                }),
            now,
            self.config.heartbeat_timeout,
        );
        let hold = census.mass_expiry(self.config.mass_expiry_threshold);
        *cached = Some((Instant::now(), census, hold));
        drop(cached);
        self.metrics.set_heartbeat_census(census.expired, hold);
        self.metrics.set_heartbeat_allowance(self.allowance());
        if self.holding.swap(hold, Ordering::Relaxed) != hold {
            if hold {
                tracing::warn!(
                    expired = census.expired,
                    registered = census.registered,
                    threshold = self.config.mass_expiry_threshold,
                    "too many plugin heartbeats expired at once: suspecting the control plane, \
                     withdrawing no pool on heartbeat expiry alone"
                );
            } else {
                tracing::info!(
                    expired = census.expired,
                    registered = census.registered,
                    "plugin heartbeats recovered: heartbeat expiry withdraws pools again"
                );
            }
        }
        (census, hold)
    }

    /// Whether a pool may be withdrawn for heartbeat expiry alone now; true uses up the
    /// allowance. At most one per [`ControllerConfig::expiry_withdrawal_interval`] (like the
    /// node lifecycle controller's eviction rate), so heartbeats going stale one by one while
    /// the API server struggles cost at most a few pools. A dead plugin still loses its pool
    /// to the kubelet's wipe 30 s after its connection drops, which withdraws without limit.
    pub fn allow_expiry_withdrawal(&self) -> bool {
        self.expiry_allowance(true)
    }

    /// Whether [`Self::allow_expiry_withdrawal`] would allow one now, without using it up
    /// (so a node that would be held anyway costs no confirming read).
    pub fn expiry_withdrawal_due(&self) -> bool {
        self.expiry_allowance(false)
    }

    fn expiry_allowance(&self, take: bool) -> bool {
        let interval = self.config.expiry_withdrawal_interval;
        if interval.is_zero() {
            return true;
        }
        let mut last = lock(&self.last_expiry_withdrawal);
        match *last {
            Some(at) if at.elapsed() < interval => false,
            _ => {
                if take {
                    *last = Some(Instant::now());
                }
                true
            }
        }
    }

    /// `node`'s heartbeat with its Lease as the API server has it now (a quorum read, not the
    /// cache, which a lagging watch shows older than it is): a renewal later than the last
    /// observed counts as observed now. A missing Lease is `None`; no answer within
    /// [`CONFIRM_TIMEOUT`] is an error.
    pub async fn fresh_heartbeat(&self, node: &str) -> Result<Option<Heartbeat>, Error> {
        let unconfirmed = |reason: String| Error::HeartbeatUnconfirmed {
            node: node.to_string(),
            object: "Lease",
            reason,
        };
        let name = heartbeat_lease_name(node, &self.config.driver);
        match tokio::time::timeout(CONFIRM_TIMEOUT, self.lease_api.get_opt(&name)).await {
            Ok(Ok(lease)) => Ok(lease
                .filter(|lease| lease_node(lease, &self.config.driver) == Some(node))
                .as_ref()
                .and_then(LeaseBeat::of)
                .map(|beat| self.note(node, beat, Instant::now(), false))),
            Ok(Err(e)) => Err(unconfirmed(e.to_string())),
            Err(_) => Err(unconfirmed(format!(
                "no answer within {}s",
                CONFIRM_TIMEOUT.as_secs()
            ))),
        }
    }
}
