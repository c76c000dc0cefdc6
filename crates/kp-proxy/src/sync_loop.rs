//! The sync loop: applies source events to the proxy state and syncs the dataplane at
//! bounded frequency, then keeps conntrack and the health check node ports in step with what
//! was programmed. Mirrors upstream's `SyncLoop` (`pkg/util/async/bounded_frequency_runner.go`
//! driving a proxier's `syncProxyRules`).
//!
//! The loop is mode-agnostic: it holds a `Box<dyn Dataplane>` and what the mode's registry
//! entry asks of it ([`crate::modes::Mode`]). Time comes from tokio's clock, so tests run it on
//! paused time.
//!
//! # The periodic drift check never delays a change
//!
//! Every `syncPeriod` the kernel is compared with what the mode programmed, and drift is
//! repaired. Reading the kernel back is the expensive part (about 0.4 s of netlink dumps at
//! 10k Services × 10 endpoints in nftables mode), so when the mode offers it
//! ([`Dataplane::begin_check`]) the read runs on a thread of its own while the loop keeps
//! applying changes as partial syncs:
//!
//! 1. the periodic full sync falls due; instead of running it, the loop starts the mode's read
//!    and tells the schedule ([`SyncSchedule::check_started`]), which from then on asks only for
//!    partial syncs; changes queued meanwhile are synced at once;
//! 2. while the read runs, each change is a partial sync as usual; the mode records what it
//!    wrote, since the read may or may not have seen it;
//! 3. when the read is back, [`Dataplane::finish_check`] compares it with the mode's record *as
//!    it is then*, leaving out what the mode wrote during the read (the kernel acknowledged those
//!    writes after the read began, so they hold what the record says). Clean: the check is
//!    observed as the period's full sync (`kubeproxy_sync_full_proxy_rules_duration_seconds`,
//!    read plus compare), as upstream's periodic resync is. Drift that no write explains (nothing
//!    was committed during the read): the next sync is a full one, which repairs it. Differences
//!    a concurrent commit might explain (a netlink dump of a set written during the dump can
//!    skip an element): the loop reads once more, and repairs only if the second read, too,
//!    differs.
//!
//! So the guarantee stays "the kernel equals the desired state after every sync": a partial
//! sync writes atomically what changed, and any difference of anything else is found by the
//! next check and repaired by a full sync. What waits for the kernel is only the comparison
//! on the loop (a lookup per element read) and, when there is drift, its repair. A mode
//! without [`Dataplane::begin_check`] keeps the in-line check inside its full sync.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use kp_conntrack::Conntrack;
use kp_core::conntrack::ConntrackPlanner;
use kp_core::dataplane::{
    CheckOutcome, CheckRead, Dataplane, DataplaneError, HeldBackend, KernelRead, Retry,
};
use kp_core::model::{IpFamily, ServiceKey};
use kp_core::sync::{SyncKind, SyncSchedule};
use kp_core::track::{Applied, Changes, Kind, ProxyState, SourceEvent};
use kp_metrics::{Metrics, TrafficPolicyLabel};
use kp_serve::{ServiceHealthServer, SharedHealth};
use tokio::sync::{mpsc, oneshot, watch};

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

/// A periodic drift check whose read runs on another thread.
struct Check {
    /// When the check started, on tokio's clock.
    started: Instant,
    /// The read's result and how long it took.
    done: oneshot::Receiver<(CheckRead, std::time::Duration)>,
    /// This check confirms an unsure one: if it differs too, the loop repairs.
    confirming: bool,
}

/// What woke the loop.
enum Woke {
    Event(Option<SourceEvent>),
    Timer,
    Stop,
    /// The drift check's read is back (or its thread died: `None`).
    Read(Option<(CheckRead, std::time::Duration)>),
    /// The endpoints the mode before still answers for changed.
    Held,
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
    /// The drift check in flight, if any.
    check: Option<Check>,
    /// The thread drift checks read the kernel on, started with the first one.
    reader: Option<CheckReader>,
    /// The endpoints the mode before a switch still answers for, as the removal of its
    /// leftovers finds them ([`Dataplane::hold_backends`]); `None`: not followed.
    held: Option<watch::Receiver<BTreeSet<HeldBackend>>>,
}

/// A read handed to the [`CheckReader`]: the read, and where its result goes.
type ReadJob = (
    KernelRead,
    oneshot::Sender<(CheckRead, std::time::Duration)>,
);

/// One long-lived thread for every drift check's read. A thread of its own per check would give
/// each read a fresh malloc arena (glibc makes one per thread, up to eight per CPU), each holding
/// the freed memory of a read of the whole table: at 10k Services, tens of MiB more resident
/// memory per arena. One thread reuses one.
struct CheckReader {
    jobs: std::sync::mpsc::Sender<ReadJob>,
}

impl CheckReader {
    fn start() -> std::io::Result<CheckReader> {
        let (jobs, queue) = std::sync::mpsc::channel::<ReadJob>();
        std::thread::Builder::new()
            .name("kp-drift-read".into())
            .spawn(move || {
                for (read, done) in queue {
                    let started = std::time::Instant::now();
                    let r = read();
                    let _ = done.send((r, started.elapsed()));
                }
            })?;
        Ok(CheckReader { jobs })
    }

    /// Queues `job`; gives it back if the thread is gone (it panicked in a read).
    fn send(&self, job: ReadJob) -> Result<(), ReadJob> {
        self.jobs.send(job).map_err(|e| e.0)
    }
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
            check: None,
            reader: None,
            held: None,
        }
    }

    /// Follows `held`: the dataplane is handed each new set of endpoints the mode before still
    /// answers for, and a set that changes what it programs makes the next sync full.
    pub fn with_held_backends(mut self, held: watch::Receiver<BTreeSet<HeldBackend>>) -> Self {
        self.held = Some(held);
        self
    }

    /// Hands the dataplane the latest held set: the first one at start, then each that came.
    fn take_held(&mut self) {
        let Some(rx) = self.held.as_mut() else {
            return;
        };
        let held = rx.borrow_and_update().clone();
        if self.dataplane.hold_backends(&held) {
            if held.is_empty() {
                tracing::info!("the mode before answers for no endpoint any more: every endpoint takes new connections again");
            } else {
                tracing::info!(
                    held = held.len(),
                    "the mode before still answers for {} endpoints: new connections go to \
                     their Services' other endpoints where there are any",
                    held.len()
                );
            }
            self.schedule.force_full(now());
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
        // The set read before the mode's first sync, so that sync already leaves them out.
        self.take_held();
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
            let (check, held) = (&mut self.check, &mut self.held);
            let read = async {
                match check.as_mut() {
                    Some(c) => (&mut c.done).await.ok(),
                    None => std::future::pending().await,
                }
            };
            let held_changed = async {
                // A closed channel (the removal is done) changes nothing more.
                if let Some(h) = held.as_mut() {
                    if h.changed().await.is_ok() {
                        return;
                    }
                }
                std::future::pending::<()>().await
            };
            let woke = tokio::select! {
                ev = rx.recv() => Woke::Event(ev),
                r = read => Woke::Read(r),
                _ = held_changed => Woke::Held,
                _ = tokio::time::sleep_until(wake.into()) => Woke::Timer,
                _ = &mut stop => Woke::Stop,
            };
            match woke {
                Woke::Event(Some(ev)) => {
                    self.handle(ev);
                    // Take whatever else is already queued, so a burst costs one sync.
                    while let Ok(ev) = rx.try_recv() {
                        self.handle(ev);
                    }
                }
                Woke::Event(None) => return Err(Fatal::SourceStopped),
                Woke::Timer => {}
                Woke::Stop => {
                    tracing::info!("shutting down; rules stay in place");
                    self.dataplane.shutdown();
                    return Ok(());
                }
                Woke::Read(read) => {
                    let check = self.check.take().expect("a read comes from a check");
                    self.finish_check(check, read);
                }
                Woke::Held => self.take_held(),
            }
            self.tick()?;
            if !self.state.ready_to_program() {
                if !waiting_logged {
                    tracing::info!("waiting for the initial list of Services and EndpointSlices before programming anything");
                    waiting_logged = true;
                }
                continue;
            }
            let Some(mut kind) = self.schedule.due(now()) else {
                continue;
            };
            if kind == SyncKind::Full && self.schedule.periodic() {
                if self.check.is_some() {
                    // The last period's read is still running (a check never outlasts a period
                    // on a sane machine): this period's check waits for it, changes do not.
                    self.schedule.check_started(now());
                    kind = SyncKind::Partial;
                } else if let Some(read) = self.dataplane.begin_check() {
                    self.start_check(read, false);
                    // Changes queued so far sync now, partially; none may be.
                    match self.schedule.due(now()) {
                        Some(k) => kind = k,
                        None => continue,
                    }
                }
            }
            if kind == SyncKind::Partial && self.schedule.oldest_request().is_none() {
                continue;
            }
            self.sync(kind).await?;
        }
    }

    /// Runs `read` on a thread of its own; the loop picks up its result when it is back.
    /// Without a thread to spare, the periodic check runs in line, as a full sync.
    fn start_check(&mut self, read: KernelRead, confirming: bool) {
        let (tx, rx) = oneshot::channel();
        let mut job = (read, tx);
        // A reader whose thread is gone is replaced once.
        for _ in 0..2 {
            if self.reader.is_none() {
                match CheckReader::start() {
                    Ok(r) => self.reader = Some(r),
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot start the drift check's read; checking in line");
                        self.schedule.force_full(now());
                        return;
                    }
                }
            }
            match self.reader.as_ref().map(|r| r.send(job)) {
                Some(Ok(())) => {
                    self.schedule.check_started(now());
                    self.check = Some(Check {
                        started: now(),
                        done: rx,
                        confirming,
                    });
                    return;
                }
                Some(Err(back)) => {
                    job = back;
                    self.reader = None;
                }
                None => return,
            }
        }
        tracing::warn!("the drift check's reader keeps failing; checking in line");
        self.schedule.force_full(now());
    }

    /// Acts on a drift check whose read is back: see the module docs.
    fn finish_check(&mut self, check: Check, read: Option<(CheckRead, std::time::Duration)>) {
        let Some((read, took)) = read else {
            tracing::warn!(
                "the drift check's read ended without an answer; repairing with a full sync"
            );
            self.schedule.force_full(now());
            return;
        };
        let start = now();
        let (state, dataplane) = (&self.state, &mut self.dataplane);
        let outcome = blocking(|| dataplane.finish_check(state, read));
        let compared = now().duration_since(start);
        let mode = self.dataplane.mode();
        match outcome {
            CheckOutcome::Clean => {
                // The period's full sync: what it cost the kernel and the loop, not the
                // partial syncs it let through.
                let elapsed = (took + compared).as_secs_f64();
                self.metrics.sync_duration.observe(elapsed);
                self.metrics.sync_full_duration.observe(elapsed);
                self.metrics.last_sync_timestamp.set(unix_now());
                if self.schedule.oldest_request().is_none() {
                    self.health.updated();
                }
                tracing::debug!(
                    read_seconds = took.as_secs_f64(),
                    compare_seconds = compared.as_secs_f64(),
                    waited_seconds = now().duration_since(check.started).as_secs_f64(),
                    mode,
                    "periodic check: the kernel holds what was programmed"
                );
            }
            CheckOutcome::Superseded => {}
            CheckOutcome::Unsure(diffs) if !check.confirming => {
                tracing::debug!(
                    differences = diffs.len(),
                    first = diffs.first().map(String::as_str).unwrap_or(""),
                    mode,
                    "periodic check: differences a concurrent write may explain; reading again"
                );
                match self.dataplane.begin_check() {
                    Some(read) => self.start_check(read, true),
                    None => self.schedule.force_full(now()),
                }
            }
            CheckOutcome::Unsure(diffs) | CheckOutcome::Drift(diffs) => {
                for d in diffs.iter().take(10) {
                    tracing::warn!(difference = %d, mode, "the kernel differs from the plan; repairing with a full sync");
                }
                self.schedule.force_full(now());
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
