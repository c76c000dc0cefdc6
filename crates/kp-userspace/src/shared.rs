//! What the listeners' tasks and the dataplane share: the balancer, the node's addresses, the
//! metrics, and the count of relays still running (for a graceful stop).

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use kp_core::model::{ServiceKey, ServicePortName};
use kp_core::track::{Changes, ProxyState};
use kp_metrics::{Metrics, UserspacePortSeries};
use kp_userspace_plan::{Arrival, Balancer};

use crate::relay::Copying;

/// Shared between the dataplane and every connection's task.
pub struct Shared {
    balancer: Mutex<Balancer>,
    node_addresses: RwLock<HashSet<IpAddr>>,
    /// Where connections and sessions are counted.
    pub metrics: Arc<Metrics>,
    /// How relays move bytes.
    pub copying: Copying,
    /// How long a UDP session lives without traffic.
    pub udp_timeout: Duration,
    relays: AtomicUsize,
    /// UDP sessions open now (a stopping proxy waits for them too).
    udp_sessions: AtomicUsize,
    /// Bumped by every full sync: every UDP session picks again.
    epoch: AtomicU64,
    /// Bumped for a Service by every sync that changed it: its UDP sessions pick again.
    generations: Mutex<HashMap<ServiceKey, u64>>,
    /// The Service ports with metric series of their own (at most
    /// `kp_metrics::SERVICE_PORT_SERIES_MAX`), by Service: their handles, and what a sync
    /// checks to delete the series of a port that went.
    port_series: Mutex<HashMap<ServiceKey, HashMap<ServicePortName, UserspacePortSeries>>>,
}

/// Which syncs a UDP session's pick has seen (see [`Shared::generation`]).
pub type Generation = (u64, u64);

impl Shared {
    /// A new state around `balancer`.
    pub fn new(
        balancer: Balancer,
        metrics: Arc<Metrics>,
        copying: Copying,
        udp_timeout: Duration,
    ) -> Shared {
        Shared {
            balancer: Mutex::new(balancer),
            node_addresses: RwLock::new(HashSet::new()),
            metrics,
            copying,
            udp_timeout,
            relays: AtomicUsize::new(0),
            udp_sessions: AtomicUsize::new(0),
            epoch: AtomicU64::new(0),
            generations: Mutex::new(HashMap::new()),
            port_series: Mutex::new(HashMap::new()),
        }
    }

    /// The metric series of `port` (its own, or the overflow ones past the maximum). Call it
    /// under the balancer's lock, with the route a pick just returned: a sync removes the
    /// series of the ports it removed under the same lock, so no connection brings back the
    /// series of a port that is gone.
    pub fn port_series(&self, port: &ServicePortName) -> UserspacePortSeries {
        let mut all = lock(&self.port_series);
        if let Some(s) = all.get(&port.service).and_then(|ports| ports.get(port)) {
            return s.clone();
        }
        let series = self
            .metrics
            .userspace_by_service_port
            .series(&port.to_string());
        // The overflow series are not kept: the next connection of the port asks again, and
        // gets series of its own once a place is free.
        if series.own {
            all.entry(port.service.clone())
                .or_default()
                .insert(port.clone(), series.clone());
        }
        series
    }

    /// Deletes the metric series of the Service ports `state` no longer has, among the Services
    /// a sync changed (all of them after a full one). Call it under the balancer's lock (see
    /// [`Shared::port_series`]).
    pub fn forget_gone_ports(&self, state: &ProxyState, changes: &Changes, full: bool) {
        let mut all = lock(&self.port_series);
        let keys: Vec<ServiceKey> = if full {
            all.keys().cloned().collect()
        } else {
            changes
                .services
                .iter()
                .filter(|k| all.contains_key(*k))
                .cloned()
                .collect()
        };
        for key in keys {
            let current = state.service_ports(&key);
            let Some(ports) = all.get_mut(&key) else {
                continue;
            };
            ports.retain(|name, _| {
                let kept = current.iter().any(|p| p.name == *name);
                if !kept {
                    self.metrics
                        .userspace_by_service_port
                        .remove(&name.to_string());
                }
                kept
            });
            if ports.is_empty() {
                all.remove(&key);
            }
        }
    }

    /// The balancer, locked: keep each use short (one pick, one report).
    pub fn balancer(&self) -> MutexGuard<'_, Balancer> {
        // A panic while holding the lock leaves a balancer that is still consistent enough to
        // pick from: every method finishes its updates before returning.
        lock(&self.balancer)
    }

    /// Replaces the node's own addresses (loopback counts without being listed).
    pub fn set_node_addresses(&self, addrs: HashSet<IpAddr>) {
        *self
            .node_addresses
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = addrs;
    }

    /// Whether `ip` is one of the node's own addresses (a connection from the node itself).
    pub fn is_node_address(&self, ip: IpAddr) -> bool {
        ip.is_loopback()
            || self
                .node_addresses
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .contains(&ip)
    }

    /// How a connection from `ip` accepted by a listener for `listener` arrived: the node's
    /// own when `ip` is one of the node's addresses, else the listener's.
    pub fn arrival(&self, ip: IpAddr, listener: Arrival) -> Arrival {
        if self.is_node_address(ip) {
            Arrival::Node
        } else {
            listener
        }
    }

    /// Counts a relay of the Service port of `series` as running until the guard is dropped.
    pub fn relay_started(self: &Arc<Self>, series: &UserspacePortSeries) -> RelayGuard {
        self.relays.fetch_add(1, Ordering::Relaxed);
        self.metrics.userspace_active_connections.inc();
        series.active_connections.inc();
        RelayGuard(self.clone(), series.clone())
    }

    /// Marks the UDP sessions of the Services a sync changed (all of them after a full one)
    /// as picked before it: their next datagram picks again, so a client that keeps its source
    /// port (a resolver) leaves an endpoint that was removed. TCP relays are left alone.
    pub fn synced(&self, changes: &Changes, full: bool) {
        if full {
            self.epoch.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let mut g = lock(&self.generations);
        for key in &changes.services {
            *g.entry(key.clone()).or_default() += 1;
        }
    }

    /// The syncs a pick for `service` made now has seen.
    pub fn generation(&self, service: &ServiceKey) -> Generation {
        let epoch = self.epoch.load(Ordering::Relaxed);
        (
            epoch,
            lock(&self.generations).get(service).copied().unwrap_or(0),
        )
    }

    /// Relays running now.
    pub fn relays(&self) -> usize {
        self.relays.load(Ordering::Relaxed)
    }

    /// Counts a UDP session as open (until [`Shared::udp_session_ended`]).
    pub fn udp_session_started(&self) {
        self.udp_sessions.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a UDP session as ended.
    pub fn udp_session_ended(&self) {
        self.udp_sessions.fetch_sub(1, Ordering::Relaxed);
    }

    /// UDP sessions open now.
    pub fn udp_sessions(&self) -> usize {
        self.udp_sessions.load(Ordering::Relaxed)
    }
}

/// A running relay (see [`Shared::relay_started`]).
pub struct RelayGuard(Arc<Shared>, UserspacePortSeries);

impl Drop for RelayGuard {
    fn drop(&mut self) {
        self.0.relays.fetch_sub(1, Ordering::Relaxed);
        self.0.metrics.userspace_active_connections.dec();
        self.1.active_connections.dec();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
