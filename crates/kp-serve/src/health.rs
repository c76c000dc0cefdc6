//! The proxy's health state: upstream's `ProxyHealthServer` bookkeeping, without the server.
//!
//! Mirrors `pkg/proxy/healthcheck/proxy_health.go` (called `proxier_health.go` before 1.30).
//! [`ProxyHealth`] is pure: every method takes the time as an argument. [`SharedHealth`] wraps
//! it with a lock and a clock so the sync loop and the HTTP handlers can share it.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use kp_core::model::{IpFamily, NodeInfo};

/// Upstream's health timeout for a given sync period: a queued change may wait two sync periods
/// before the proxy reports itself unhealthy (`cmd/kube-proxy` passes `2 * syncPeriod`).
pub fn health_timeout(sync_period: Duration) -> Duration {
    sync_period.saturating_mul(2)
}

/// Health bookkeeping for one proxy, per IP family.
///
/// Contract for the sync loop, as upstream's proxiers keep it:
/// - call [`updated`](Self::updated) once when the sync loop starts, so a first sync that never
///   succeeds still turns the proxy unhealthy after the timeout;
/// - call [`queued_update`](Self::queued_update) whenever a change asks for a sync;
/// - call [`updated`](Self::updated) after every successful sync.
///
/// A family that has never been [`updated`](Self::updated) is ignored, exactly as upstream
/// ignores families missing from its `lastUpdatedMap`: it is healthy however long a change has
/// been queued, and it is absent from [`HealthStatus::families`]. (Before 1.30 upstream had one
/// family and no such exception; the per-family rule replaced it.)
#[derive(Clone, Debug)]
pub struct ProxyHealth {
    /// How long a queued change may wait for a sync before the proxy is unhealthy.
    health_timeout: Duration,
    /// The families [`queued_update`](Self::queued_update) and [`updated`](Self::updated) touch.
    families: Vec<IpFamily>,
    /// When each family last completed a sync (upstream's `lastUpdatedMap`).
    last_updated: BTreeMap<IpFamily, SystemTime>,
    /// When the oldest change still waiting for a sync was queued, per family
    /// (upstream's `oldestPendingQueuedMap`).
    oldest_pending: BTreeMap<IpFamily, SystemTime>,
    /// Whether the Node may receive load-balancer traffic; `None` until the Node is first seen.
    node_eligible: Option<bool>,
}

/// The health of one family's proxier: upstream's `ProxierHealth`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProxierHealth {
    /// When this family last completed a sync.
    pub last_updated: SystemTime,
    /// Whether no change has waited longer than the health timeout.
    pub healthy: bool,
}

/// A snapshot of the proxy's health: upstream's `ProxyHealth` plus node eligibility.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthStatus {
    /// True when every family that has synced at least once is healthy (what `/livez` reports).
    pub healthy: bool,
    /// Whether the Node exists, is not being deleted and lacks the
    /// `ToBeDeletedByClusterAutoscaler` taint. True until the Node is first seen.
    pub node_eligible: bool,
    /// The most recent sync of any family; `None` if no family has synced yet.
    pub last_updated: Option<SystemTime>,
    /// The time this snapshot was taken.
    pub current_time: SystemTime,
    /// Per-family health, for families that have synced at least once.
    pub families: BTreeMap<IpFamily, ProxierHealth>,
}

impl HealthStatus {
    /// Whether `/healthz` answers 200: healthy and the node eligible.
    pub fn healthz_ok(&self) -> bool {
        self.healthy && self.node_eligible
    }

    /// Whether `/livez` answers 200: healthy, whatever the node's state.
    pub fn livez_ok(&self) -> bool {
        self.healthy
    }
}

impl ProxyHealth {
    /// Health state for a proxy that programs `families`, unhealthy once a change has waited
    /// `health_timeout` (see [`health_timeout`]) for a sync.
    pub fn new(health_timeout: Duration, families: impl IntoIterator<Item = IpFamily>) -> Self {
        let mut families: Vec<IpFamily> = families.into_iter().collect();
        families.sort();
        families.dedup();
        ProxyHealth {
            health_timeout,
            families,
            last_updated: BTreeMap::new(),
            oldest_pending: BTreeMap::new(),
            node_eligible: None,
        }
    }

    /// The families this proxy programs.
    pub fn families(&self) -> &[IpFamily] {
        &self.families
    }

    /// A change arrived that needs a sync of every configured family (upstream's
    /// `QueuedUpdate`). Only the oldest pending change counts, so later calls before the next
    /// [`updated`](Self::updated) do not move the clock forward.
    pub fn queued_update(&mut self, now: SystemTime) {
        for &family in &self.families {
            self.oldest_pending.entry(family).or_insert(now);
        }
    }

    /// Like [`queued_update`](Self::queued_update), for one family.
    pub fn queued_update_for(&mut self, family: IpFamily, now: SystemTime) {
        self.oldest_pending.entry(family).or_insert(now);
    }

    /// Every configured family completed a sync at `now` (upstream's `Updated`): nothing is
    /// pending any more.
    pub fn updated(&mut self, now: SystemTime) {
        for &family in &self.families {
            self.oldest_pending.remove(&family);
            self.last_updated.insert(family, now);
        }
    }

    /// Like [`updated`](Self::updated), for one family.
    pub fn updated_for(&mut self, family: IpFamily, now: SystemTime) {
        self.oldest_pending.remove(&family);
        self.last_updated.insert(family, now);
    }

    /// Records this node's Node object. Until the first call the node counts as eligible, as
    /// upstream's start-up grace: kube-proxy must not fail `/healthz` before it has even seen
    /// its Node. A Node that is gone (`exists == false`) is not eligible.
    pub fn set_node(&mut self, node: &NodeInfo) {
        self.node_eligible = Some(node.eligible());
    }

    /// Whether the node may receive load-balancer traffic.
    pub fn node_eligible(&self) -> bool {
        self.node_eligible.unwrap_or(true)
    }

    /// The health at `now` (upstream's `Health` plus `NodeEligible`).
    ///
    /// A family is unhealthy when a change has been queued for at least the health timeout
    /// without a sync completing. A queue time later than `now` (the clock stepped back) counts
    /// as not late.
    pub fn status(&self, now: SystemTime) -> HealthStatus {
        let mut families = BTreeMap::new();
        for (&family, &last_updated) in &self.last_updated {
            let healthy = match self.oldest_pending.get(&family) {
                None => true,
                Some(&queued) => {
                    now.duration_since(queued).unwrap_or(Duration::ZERO) < self.health_timeout
                }
            };
            families.insert(
                family,
                ProxierHealth {
                    last_updated,
                    healthy,
                },
            );
        }
        HealthStatus {
            healthy: families.values().all(|f| f.healthy),
            node_eligible: self.node_eligible(),
            last_updated: self.last_updated.values().max().copied(),
            current_time: now,
            families,
        }
    }
}

/// Where [`SharedHealth`] reads the time.
pub type Clock = Arc<dyn Fn() -> SystemTime + Send + Sync>;

/// [`ProxyHealth`] behind a lock, with a clock: cloned into the sync loop, the health and
/// metrics servers and the [`ServiceHealthServer`](crate::ServiceHealthServer).
#[derive(Clone)]
pub struct SharedHealth {
    state: Arc<Mutex<ProxyHealth>>,
    clock: Clock,
}

impl fmt::Debug for SharedHealth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedHealth")
            .field("state", &*self.lock())
            .finish_non_exhaustive()
    }
}

impl SharedHealth {
    /// Shares `health`, reading the system clock.
    pub fn new(health: ProxyHealth) -> Self {
        Self::with_clock(health, SystemTime::now)
    }

    /// Shares `health`, reading time from `clock` (tests pass a fixed or stepped clock).
    pub fn with_clock(
        health: ProxyHealth,
        clock: impl Fn() -> SystemTime + Send + Sync + 'static,
    ) -> Self {
        SharedHealth {
            state: Arc::new(Mutex::new(health)),
            clock: Arc::new(clock),
        }
    }

    /// The clock's current time.
    pub fn now(&self) -> SystemTime {
        (self.clock)()
    }

    // The state is plain data and every update is a single assignment, so a panic while the
    // lock was held cannot leave it half-written: a poisoned lock is still safe to use.
    fn lock(&self) -> MutexGuard<'_, ProxyHealth> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// [`ProxyHealth::queued_update`] at the clock's time.
    pub fn queued_update(&self) {
        let now = self.now();
        self.lock().queued_update(now);
    }

    /// [`ProxyHealth::queued_update_for`] at the clock's time.
    pub fn queued_update_for(&self, family: IpFamily) {
        let now = self.now();
        self.lock().queued_update_for(family, now);
    }

    /// [`ProxyHealth::updated`] at the clock's time.
    pub fn updated(&self) {
        let now = self.now();
        self.lock().updated(now);
    }

    /// [`ProxyHealth::updated_for`] at the clock's time.
    pub fn updated_for(&self, family: IpFamily) {
        let now = self.now();
        self.lock().updated_for(family, now);
    }

    /// [`ProxyHealth::set_node`].
    pub fn set_node(&self, node: &NodeInfo) {
        self.lock().set_node(node);
    }

    /// [`ProxyHealth::status`] at the clock's time.
    pub fn status(&self) -> HealthStatus {
        let now = self.now();
        self.lock().status(now)
    }
}

#[cfg(test)]
mod tests;
