//! The sync loop: applies source events to the proxy state and syncs the dataplane at
//! bounded frequency, then keeps conntrack and the health check node ports in step with what
//! was programmed. Mirrors upstream's `SyncLoop` (`pkg/util/async/bounded_frequency_runner.go`
//! driving a proxier's `syncProxyRules`).
//!
//! The loop is mode-agnostic: it holds a `Box<dyn Dataplane>` and what the mode's registry
//! entry asks of it ([`crate::modes::Mode`]). Time comes from tokio's clock, so tests run it on
//! paused time.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use kp_conntrack::Conntrack;
use kp_core::conntrack::ConntrackPlanner;
use kp_core::dataplane::{Dataplane, DataplaneError, Retry};
use kp_core::model::{IpFamily, ServiceKey};
use kp_core::sync::{SyncKind, SyncSchedule};
use kp_core::track::{Applied, Changes, Kind, ProxyState, SourceEvent};
use kp_metrics::{Metrics, TrafficPolicyLabel};
use kp_serve::{ServiceHealthServer, SharedHealth};
use tokio::sync::mpsc;

use crate::Fatal;

#[cfg(test)]
mod tests;

/// How long the loop sleeps when nothing but an event can wake it.
const IDLE_WAKE: std::time::Duration = std::time::Duration::from_secs(3600);

/// The current time on tokio's clock (paused in tests), as a std instant for the pure
/// schedule.
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or_default()
}

/// Runs blocking dataplane work without stalling the runtime's other tasks: on a
/// multi-threaded runtime the worker hands its tasks over first; a single-threaded runtime
/// (tests) simply runs it.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Network programming latencies to observe at `now` for EndpointSlice changes triggered at
/// `trigger_times`. As upstream, a trigger time from before this proxy started is skipped: the
/// initial list carries every slice's last change, however old, and counting those would report
/// the age of the cluster as programming latency.
fn programming_latencies(
    trigger_times: &[f64],
    started_at: f64,
    now: f64,
) -> impl Iterator<Item = f64> + '_ {
    trigger_times
        .iter()
        .filter(move |t| **t >= started_at)
        .map(move |t| (now - t).max(0.0))
}

/// Every address of this node's interfaces: where a NodePort may have been reached.
fn local_addresses() -> Vec<std::net::IpAddr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    addrs
        .filter_map(|a| a.address)
        .filter_map(|a| {
            if let Some(v4) = a.as_sockaddr_in() {
                Some(std::net::IpAddr::V4(v4.ip()))
            } else {
                a.as_sockaddr_in6().map(|v6| std::net::IpAddr::V6(v6.ip()))
            }
        })
        .collect()
}

/// Stale UDP/SCTP conntrack cleanup, for modes that translate in netfilter.
pub struct ConntrackCleanup {
    conntrack: Conntrack,
    planner: ConntrackPlanner,
}

impl ConntrackCleanup {
    /// Cleanup in the process's network namespace.
    pub fn new() -> Self {
        ConntrackCleanup {
            conntrack: Conntrack::new(),
            planner: ConntrackPlanner::new(),
        }
    }
}

impl Default for ConntrackCleanup {
    fn default() -> Self {
        Self::new()
    }
}

/// The running proxy's state between syncs.
pub struct SyncLoop {
    /// When this proxy started (Unix seconds): older change trigger times are not observed.
    started_at: f64,
    state: ProxyState,
    schedule: SyncSchedule,
    dataplane: Box<dyn Dataplane>,
    metrics: Arc<Metrics>,
    health: SharedHealth,
    service_health: ServiceHealthServer,
    /// healthCheckNodePort per Service with `externalTrafficPolicy: Local`.
    health_ports: HashMap<ServiceKey, u16>,
    /// Local endpoints of those Services.
    local_endpoints: HashMap<ServiceKey, usize>,
    /// Deletes stale UDP/SCTP conntrack entries after each sync, when the mode wants it.
    conntrack: Option<ConntrackCleanup>,
}

impl SyncLoop {
    /// A loop that has synced nothing yet.
    pub fn new(
        state: ProxyState,
        schedule: SyncSchedule,
        dataplane: Box<dyn Dataplane>,
        metrics: Arc<Metrics>,
        health: SharedHealth,
        conntrack: Option<ConntrackCleanup>,
    ) -> Self {
        SyncLoop {
            started_at: unix_now(),
            state,
            schedule,
            dataplane,
            metrics,
            service_health: ServiceHealthServer::new([], health.clone()),
            health,
            health_ports: HashMap::new(),
            local_endpoints: HashMap::new(),
            conntrack,
        }
    }

    /// The state the loop has applied so far.
    pub fn state(&self) -> &ProxyState {
        &self.state
    }

    /// Runs until `stop` completes (rules stay in place) or a failure no retry can cure.
    /// The first sync waits for every initial list; a failed sync is retried with backoff,
    /// and the retry is full; a periodic full sync lets the mode check the kernel for drift.
    pub async fn run(
        &mut self,
        mut rx: mpsc::Receiver<SourceEvent>,
        stop: impl Future<Output = ()>,
    ) -> Result<(), Fatal> {
        let mode = self.dataplane.mode();
        blocking(|| self.dataplane.start()).map_err(|e| fatal(mode, e))?;
        // As upstream's SyncLoop: healthy from the start until an update waits too long.
        self.health.updated();
        tokio::pin!(stop);
        let mut waiting_logged = false;
        loop {
            // Before every initial list is in, only an event (or the mode's timer) can make
            // progress: waking for the schedule would spin until then.
            let mut wake = if self.state.ready_to_program() {
                self.schedule.next_wakeup(now())
            } else {
                now() + IDLE_WAKE
            };
            if let Some(deadline) = self.dataplane.next_deadline() {
                wake = wake.min(deadline);
            }
            tokio::select! {
                ev = rx.recv() => match ev {
                    Some(ev) => {
                        self.handle(ev);
                        // Take whatever else is already queued, so a burst costs one sync.
                        while let Ok(ev) = rx.try_recv() {
                            self.handle(ev);
                        }
                    }
                    None => return Err(Fatal::SourceStopped),
                },
                _ = tokio::time::sleep_until(wake.into()) => {}
                _ = &mut stop => {
                    tracing::info!("shutting down; rules stay in place");
                    self.dataplane.shutdown();
                    return Ok(());
                }
            }
            self.tick()?;
            if !self.state.ready_to_program() {
                if !waiting_logged {
                    tracing::info!("waiting for the initial list of Services and EndpointSlices before programming anything");
                    waiting_logged = true;
                }
                continue;
            }
            if let Some(kind) = self.schedule.due(now()) {
                self.sync(kind).await?;
            }
        }
    }

    /// The mode's timed work, once its deadline has passed.
    fn tick(&mut self) -> Result<(), Fatal> {
        let at = now();
        if self.dataplane.next_deadline().is_none_or(|d| d > at) {
            return Ok(());
        }
        let mode = self.dataplane.mode();
        match blocking(|| self.dataplane.tick(at)) {
            Ok(()) => Ok(()),
            Err(e) if e.retry() == Retry::Never => Err(fatal(mode, e)),
            Err(e) => {
                tracing::warn!(error = %e, mode, "timed dataplane work failed; retrying at its next deadline");
                Ok(())
            }
        }
    }

    fn handle(&mut self, ev: SourceEvent) {
        let kind = match &ev {
            SourceEvent::Upsert(o) => Some(o.kind()),
            SourceEvent::Delete(k, _) => Some(*k),
            SourceEvent::Synced(_) => None,
        };
        match self.state.apply(ev) {
            Ok(Applied::Changed) => {
                self.schedule.request(now());
                self.health.queued_update();
                self.metrics.last_queued_timestamp.set(unix_now());
                let (svc, eps) = self.state.pending_counts();
                self.metrics.service_changes_pending.set(svc as i64);
                self.metrics.endpoint_changes_pending.set(eps as i64);
                if kind == Some(Kind::Node) {
                    self.health.set_node(self.state.node());
                }
            }
            Ok(Applied::Unchanged) => {}
            Err(rejected) => {
                tracing::warn!(
                    error = %rejected,
                    "skipping an invalid object; its last good version (if any) stays in force"
                );
                self.metrics.invalid_object(&rejected.kind.to_string());
            }
        }
    }

    async fn sync(&mut self, kind: SyncKind) -> Result<(), Fatal> {
        let changes = self.state.take_changes();
        self.metrics
            .service_changes_total
            .inc_by(changes.service_changes);
        self.metrics
            .endpoint_changes_total
            .inc_by(changes.endpoint_changes);
        self.metrics.service_changes_pending.set(0);
        self.metrics.endpoint_changes_pending.set(0);
        let start = now();
        let full = kind == SyncKind::Full;
        let (state, dataplane) = (&self.state, &mut self.dataplane);
        let result = blocking(|| dataplane.sync(state, &changes, full));
        let elapsed = now().duration_since(start).as_secs_f64();
        let mode = self.dataplane.mode();
        let report = match result {
            Ok(report) => report,
            Err(e) if e.retry() == Retry::Never => return Err(fatal(mode, e)),
            Err(e) => {
                self.schedule.finished(now(), kind, false);
                tracing::error!(error = %e, "sync failed; retrying with a full sync");
                return Ok(());
            }
        };
        self.schedule.finished(now(), kind, true);
        self.health.updated();
        let unix = unix_now();
        self.metrics.sync_duration.observe(elapsed);
        // A periodic full sync counts as full even when its read-back found nothing to
        // repair, as upstream's periodic full resyncs do.
        if full || report.full {
            self.metrics.sync_full_duration.observe(elapsed);
        } else {
            self.metrics.sync_partial_duration.observe(elapsed);
        }
        self.metrics.last_sync_timestamp.set(unix);
        for latency in programming_latencies(&changes.trigger_times, self.started_at, unix) {
            self.metrics.network_programming_duration.observe(latency);
        }
        let (internal, external) = report.no_local_endpoints;
        for (policy, n) in [("internal", internal), ("external", external)] {
            self.metrics
                .no_local_endpoints
                .get_or_create(&TrafficPolicyLabel {
                    traffic_policy: policy.into(),
                })
                .set(n as i64);
        }
        if report.full {
            tracing::info!(
                operations = report.operations,
                seconds = elapsed,
                service_ports = self.state.service_port_count(),
                mode,
                "programmed the kernel (full sync)"
            );
        } else {
            tracing::debug!(
                operations = report.operations,
                seconds = elapsed,
                services = changes.services.len(),
                mode,
                "synced"
            );
        }
        self.reconcile_conntrack(&changes, report.full);
        self.sync_health_checks(&changes, report.full).await;
        Ok(())
    }

    /// Deletes UDP and SCTP conntrack entries that still point at endpoints the rules no longer
    /// use (or that never met an endpoint), so a client such as a DNS resolver reusing its
    /// source port reaches a live endpoint with its next datagram. Failures are logged and
    /// counted; the next sync tries again. After a partial sync only the changed Services are
    /// re-indexed.
    fn reconcile_conntrack(&mut self, changes: &Changes, full: bool) {
        let Some(cleanup) = self.conntrack.as_mut() else {
            return;
        };
        let start = now();
        let state = &self.state;
        let ConntrackCleanup { conntrack, planner } = cleanup;
        let result = blocking(|| {
            if full || changes.node_changed {
                planner.update(state, &IpFamily::ALL);
            } else {
                planner.update_services(state, &changes.services, &IpFamily::ALL);
            }
            conntrack.reconcile(planner, &local_addresses())
        });
        self.metrics
            .conntrack_reconciler_duration
            .observe(now().duration_since(start).as_secs_f64());
        match result {
            Ok(0) => {}
            Ok(n) => {
                self.metrics.conntrack_deleted_entries.inc_by(n as u64);
                tracing::info!(entries = n, "deleted stale conntrack entries");
            }
            Err(e) => {
                self.metrics
                    .conntrack_deleted_entries
                    .inc_by(e.deleted() as u64);
                self.metrics.conntrack_reconciler_errors.inc();
                tracing::warn!(error = %e, "conntrack reconciliation failed; retrying after the next sync");
            }
        }
    }

    /// Opens and closes healthCheckNodePort servers as Services come and go, and updates their
    /// local endpoint counts. Only changed Services are looked at, except after a full sync.
    async fn sync_health_checks(&mut self, changes: &Changes, full: bool) {
        let keys: Vec<ServiceKey> = if full || changes.node_changed {
            self.health_ports.clear();
            self.local_endpoints.clear();
            self.state.service_keys().cloned().collect()
        } else {
            changes.services.iter().cloned().collect()
        };
        let before = self.health_ports.clone();
        for key in keys {
            self.health_ports.remove(&key);
            self.local_endpoints.remove(&key);
            for sps in self.state.service_state(&key) {
                if let (Some(port), true) = (
                    sps.port.health_check_node_port,
                    sps.port.external_policy_local(),
                ) {
                    self.health_ports.insert(key.clone(), port);
                    let n = self.local_endpoints.entry(key.clone()).or_default();
                    *n = (*n).max(sps.endpoints.local.len());
                }
            }
        }
        if before != self.health_ports {
            for (svc, e) in self
                .service_health
                .sync_services(self.health_ports.clone())
                .await
            {
                tracing::error!(service = %svc, error = %e, "cannot open the health check node port");
            }
        }
        self.service_health
            .sync_endpoints(self.local_endpoints.clone());
    }
}

/// A dataplane failure that ends the proxy.
fn fatal(mode: &'static str, error: DataplaneError) -> Fatal {
    tracing::error!(error = %error, mode, "retrying cannot help; stopping (the rules in the kernel stay in place)");
    Fatal::Dataplane { mode, error }
}
