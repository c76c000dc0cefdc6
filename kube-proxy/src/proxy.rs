//! The running proxy: sources feed the state, a bounded-frequency loop syncs the dataplane, and
//! the HTTP servers report health and metrics. Mirrors upstream `cmd/kube-proxy/app/server.go`
//! (`ProxyServer.Run`) and the proxiers' `SyncLoop`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use ipnet::IpNet;
use kp_conntrack::Conntrack;
use kp_core::conntrack::ConntrackPlanner;
use kp_core::dataplane::Dataplane;
use kp_core::model::{IpFamily, ServiceKey};
use kp_core::sync::{SyncKind, SyncSchedule};
use kp_core::track::{Applied, Changes, Kind, ProxyState, SourceEvent};
use kp_iptables::{IptablesCommand, IptablesConfig, IptablesDataplane};
use kp_metrics::{Metrics, TrafficPolicyLabel};
use kp_nftables::{DetectLocal, NftCommand, NftablesConfig, NftablesDataplane, NodePortAddresses};
use kp_serve::{ProxyHealth, ServiceHealthServer, SharedHealth};
use tokio::sync::mpsc;

use crate::config::{Config, Loaded, LocalMode, NodePortAddress, ProxyMode};

/// Why the proxy stopped.
#[derive(Debug)]
pub enum Fatal {
    /// The configuration cannot be served (exit code 64).
    Config(String),
    /// Something failed at run time.
    Runtime(anyhow::Error),
}

impl From<anyhow::Error> for Fatal {
    fn from(e: anyhow::Error) -> Self {
        Fatal::Runtime(e)
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or_default()
}

/// detect-local, as the kernel modes interpret it.
fn detect_local(cfg: &Config) -> Result<DetectLocal, Fatal> {
    match &cfg.detect_local_mode {
        LocalMode::ClusterCIDR if cfg.cluster_cidrs.is_empty() => Ok(DetectLocal::None),
        LocalMode::ClusterCIDR => Ok(DetectLocal::ClusterCidr(cfg.cluster_cidrs.clone())),
        LocalMode::NodeCIDR => Ok(DetectLocal::NodeCidr),
        other => Err(Fatal::Config(format!(
            "detectLocalMode {other:?} is not supported by kube-proxy-rs yet; use ClusterCIDR or NodeCIDR"
        ))),
    }
}

/// `nodePortAddresses`, as the kernel modes interpret it.
fn node_port_addresses(cfg: &Config) -> NodePortAddresses {
    match cfg.node_port_addresses.as_slice() {
        [] => NodePortAddresses::AllLocal,
        [NodePortAddress::Primary] => NodePortAddresses::Primary,
        list => NodePortAddresses::Cidrs(
            list.iter()
                .filter_map(|a| match a {
                    NodePortAddress::Cidr(c) => Some(*c),
                    NodePortAddress::Primary => None,
                })
                .collect::<Vec<IpNet>>(),
        ),
    }
}

/// The nftables mode's settings, from the configuration.
fn nftables_config(cfg: &Config) -> Result<NftablesConfig, Fatal> {
    Ok(NftablesConfig {
        families: IpFamily::ALL.to_vec(),
        masquerade_bit: u32::from(cfg.masquerade_bit),
        masquerade_all: cfg.masquerade_all,
        detect_local: detect_local(cfg)?,
        node_ports: node_port_addresses(cfg),
    })
}

/// The iptables mode's settings, from the configuration and the node's iptables backend.
fn iptables_config(cfg: &Config) -> Result<IptablesConfig, Fatal> {
    Ok(IptablesConfig {
        families: IpFamily::ALL.to_vec(),
        masquerade_bit: u32::from(cfg.masquerade_bit),
        masquerade_all: cfg.masquerade_all,
        localhost_node_ports: cfg.localhost_nodeports,
        detect_local: detect_local(cfg)?,
        node_ports: node_port_addresses(cfg),
        backend: kp_iptables::detect_backend(None),
        // Restore step size and read-back budget: the crate's measured defaults.
        ..IptablesConfig::default()
    })
}

fn node_name(cfg: &Config) -> anyhow::Result<String> {
    match &cfg.hostname {
        Some(h) => Ok(h.clone()),
        None => {
            let h = hostname::get().context("reading the hostname")?;
            Ok(h.to_string_lossy().trim().to_lowercase())
        }
    }
}

/// Applies `oomScoreAdj` and the conntrack table size, as upstream does at start. Failures are
/// logged, not fatal: inside a network namespace, for example, `nf_conntrack_max` is read-only.
fn apply_process_settings(cfg: &Config) {
    if let Err(e) = std::fs::write("/proc/self/oom_score_adj", cfg.oom_score_adj.to_string()) {
        tracing::warn!(error = %e, value = cfg.oom_score_adj, "cannot set oom_score_adj");
    }
    let per_core = u64::from(cfg.conntrack.max_per_core);
    if per_core == 0 {
        return;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
    let want = (per_core * cores).max(u64::from(cfg.conntrack.min));
    let path = "/proc/sys/net/netfilter/nf_conntrack_max";
    let current = std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok());
    match current {
        Some(c) if c >= want => {}
        _ => match std::fs::write(path, want.to_string()) {
            Ok(()) => tracing::info!(value = want, "set nf_conntrack_max"),
            Err(e) => tracing::warn!(error = %e, value = want, "cannot set nf_conntrack_max"),
        },
    }
}

/// Runs the proxy until SIGTERM/SIGINT.
pub async fn run(loaded: Loaded) -> Result<(), Fatal> {
    let cfg = &loaded.config;
    if let Some(path) = &cfg.write_config_to {
        let yaml =
            crate::config::to_yaml(&loaded.effective).map_err(|e| Fatal::Config(e.to_string()))?;
        std::fs::write(path, yaml).with_context(|| format!("writing {}", path.display()))?;
        tracing::info!(path = %path.display(), "wrote the effective configuration");
        return Ok(());
    }
    let metrics = Arc::new(Metrics::new());
    if cfg.cleanup {
        cleanup_all(cfg, &metrics)?;
        return Ok(());
    }
    match cfg.mode {
        ProxyMode::Nftables => {
            let dataplane =
                NftablesDataplane::new(nftables_config(cfg)?, NftCommand::new(), metrics.clone());
            // Switching from iptables mode: its chains would still catch Service traffic first.
            if let Err(e) = kp_iptables::cleanup_all(None) {
                tracing::warn!(error = %e, "cannot remove iptables-mode leftovers");
            }
            run_mode(loaded, metrics, dataplane).await
        }
        ProxyMode::Iptables => {
            let ipt = iptables_config(cfg)?;
            tracing::info!(backend = ipt.backend.as_str(), "iptables backend");
            let dataplane = IptablesDataplane::new(ipt, IptablesCommand::new(), metrics.clone());
            // Switching from nftables mode: remove its tables.
            let mut nft =
                NftablesDataplane::new(nftables_config(cfg)?, NftCommand::new(), metrics.clone());
            if let Err(e) = nft.cleanup() {
                tracing::warn!(error = %e, "cannot remove nftables-mode leftovers");
            }
            run_mode(loaded, metrics, dataplane).await
        }
        other => Err(Fatal::Config(format!(
            "proxy mode {:?} is not implemented in kube-proxy-rs yet; run with --proxy-mode nftables \
             or iptables (an empty mode means iptables, as upstream)",
            other.as_str()
        ))),
    }
}

/// `--cleanup`: removes what every kernel mode may have left behind, and nothing else.
fn cleanup_all(cfg: &Config, metrics: &Arc<Metrics>) -> Result<(), Fatal> {
    let mut nft = NftablesDataplane::new(nftables_config(cfg)?, NftCommand::new(), metrics.clone());
    nft.cleanup()
        .context("removing the kube-proxy nftables tables")?;
    tracing::info!("removed the kube-proxy nftables tables");
    kp_iptables::cleanup_all(None).context("removing the kube-proxy iptables chains")?;
    tracing::info!("removed the kube-proxy iptables chains (nft and legacy backends)");
    Ok(())
}

/// Runs the proxy with one dataplane until SIGTERM/SIGINT.
async fn run_mode<D: Dataplane>(
    loaded: Loaded,
    metrics: Arc<Metrics>,
    dataplane: D,
) -> Result<(), Fatal> {
    let cfg = &loaded.config;
    let mode = dataplane.mode();
    let node = node_name(cfg)?;
    tracing::info!(mode, node = %node, "starting kube-proxy-rs");
    apply_process_settings(cfg);

    let health = SharedHealth::new(ProxyHealth::new(
        kp_serve::health_timeout(cfg.sync_period),
        IpFamily::ALL,
    ));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    if let Some(addr) = cfg.healthz_bind_address {
        let listener = kp_serve::bind(addr)
            .await
            .map_err(|e| Fatal::Runtime(e.into()))?;
        let h = health.clone();
        let stop = stopped(stop_rx.clone());
        tokio::spawn(async move {
            if let Err(e) = kp_serve::serve_health(listener, h, stop).await {
                tracing::error!(error = %e, "health server failed");
            }
        });
        tracing::info!(%addr, "serving /healthz and /livez");
    }
    if let Some(addr) = cfg.metrics_bind_address {
        let listener = kp_serve::bind(addr)
            .await
            .map_err(|e| Fatal::Runtime(e.into()))?;
        let configz = serde_json::to_value(&loaded.effective).unwrap_or_default();
        let server = kp_serve::serve_metrics(
            listener,
            metrics.clone(),
            mode,
            configz,
            stopped(stop_rx.clone()),
        );
        tokio::spawn(async move {
            if let Err(e) = server.await {
                tracing::error!(error = %e, "metrics server failed");
            }
        });
        tracing::info!(%addr, "serving /metrics, /proxyMode and /configz");
    }

    let (tx, rx) = mpsc::channel::<SourceEvent>(4096);
    match &cfg.manifests_dir {
        Some(dir) => {
            tracing::info!(dir = %dir.display(), "reading Services, EndpointSlices and Nodes from manifests");
            let (dir, m) = (dir.clone(), metrics.clone());
            tokio::spawn(async move {
                if let Err(e) = kp_source::run_manifests(dir, tx, m).await {
                    tracing::error!(error = %e, "manifest source stopped");
                }
            });
        }
        None => {
            let client = kp_source::client_from(cfg.kubeconfig.as_deref(), cfg.master.as_deref())
                .await
                .map_err(|e| Fatal::Config(format!("cannot build a Kubernetes client: {e}")))?;
            let (node, m) = (node.clone(), metrics.clone());
            tokio::spawn(kp_source::run_kubernetes(client, node, tx, m));
        }
    }

    let service_health = ServiceHealthServer::new([], health.clone());
    let mut sync_loop = SyncLoop {
        state: ProxyState::new(node),
        schedule: SyncSchedule::new(cfg.min_sync_period, cfg.sync_period),
        dataplane,
        metrics,
        health,
        service_health,
        health_ports: HashMap::new(),
        local_endpoints: HashMap::new(),
        conntrack: Conntrack::new(),
        conntrack_planner: ConntrackPlanner::new(),
    };
    let result = sync_loop.run(rx).await;
    let _ = stop_tx.send(true);
    result
}

struct SyncLoop<D> {
    state: ProxyState,
    schedule: SyncSchedule,
    dataplane: D,
    metrics: Arc<Metrics>,
    health: SharedHealth,
    service_health: ServiceHealthServer,
    /// healthCheckNodePort per Service with `externalTrafficPolicy: Local`.
    health_ports: HashMap<ServiceKey, u16>,
    /// Local endpoints of those Services.
    local_endpoints: HashMap<ServiceKey, usize>,
    /// Deletes stale UDP/SCTP conntrack entries after each sync.
    conntrack: Conntrack,
    /// What the conntrack reconciler knows of Service frontends, past and present.
    conntrack_planner: ConntrackPlanner,
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

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}

impl<D: Dataplane> SyncLoop<D> {
    async fn run(&mut self, mut rx: mpsc::Receiver<SourceEvent>) -> Result<(), Fatal> {
        // As upstream's SyncLoop: healthy from the start until an update waits too long.
        self.health.updated();
        let shutdown = shutdown_signal();
        tokio::pin!(shutdown);
        let mut waiting_logged = false;
        loop {
            let wake = self.schedule.next_wakeup(Instant::now());
            tokio::select! {
                ev = rx.recv() => match ev {
                    Some(ev) => {
                        self.handle(ev);
                        // Take whatever else is already queued, so a burst costs one sync.
                        while let Ok(ev) = rx.try_recv() {
                            self.handle(ev);
                        }
                    }
                    None => return Err(Fatal::Runtime(anyhow::anyhow!("the object source stopped"))),
                },
                _ = tokio::time::sleep_until(wake.into()) => {}
                _ = &mut shutdown => {
                    tracing::info!("shutting down; rules stay in place");
                    return Ok(());
                }
            }
            if !self.state.ready_to_program() {
                if !waiting_logged {
                    tracing::info!("waiting for the initial list of Services and EndpointSlices before programming anything");
                    waiting_logged = true;
                }
                continue;
            }
            if let Some(kind) = self.schedule.due(Instant::now()) {
                self.sync(kind).await;
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
                self.schedule.request(Instant::now());
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

    async fn sync(&mut self, kind: SyncKind) {
        let changes = self.state.take_changes();
        self.metrics
            .service_changes_total
            .inc_by(changes.service_changes);
        self.metrics
            .endpoint_changes_total
            .inc_by(changes.endpoint_changes);
        self.metrics.service_changes_pending.set(0);
        self.metrics.endpoint_changes_pending.set(0);
        let start = Instant::now();
        let full = kind == SyncKind::Full;
        let (state, dataplane) = (&self.state, &mut self.dataplane);
        let result = tokio::task::block_in_place(|| dataplane.sync(state, &changes, full));
        let elapsed = start.elapsed().as_secs_f64();
        match result {
            Ok(report) => {
                self.schedule.finished(Instant::now(), kind, true);
                self.health.updated();
                let now = unix_now();
                self.metrics.sync_duration.observe(elapsed);
                // A periodic full sync counts as full even when its read-back found nothing to
                // repair, as upstream's periodic full resyncs do.
                if full || report.full {
                    self.metrics.sync_full_duration.observe(elapsed);
                } else {
                    self.metrics.sync_partial_duration.observe(elapsed);
                }
                self.metrics.last_sync_timestamp.set(now);
                for t in &changes.trigger_times {
                    self.metrics
                        .network_programming_duration
                        .observe((now - t).max(0.0));
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
                        mode = self.dataplane.mode(),
                        "programmed the kernel (full sync)"
                    );
                } else {
                    tracing::debug!(
                        operations = report.operations,
                        seconds = elapsed,
                        services = changes.services.len(),
                        mode = self.dataplane.mode(),
                        "synced"
                    );
                }
                self.reconcile_conntrack(&changes, report.full);
                self.sync_health_checks(&changes, report.full).await;
            }
            Err(e) => {
                self.schedule.finished(Instant::now(), kind, false);
                tracing::error!(error = %e, "sync failed; retrying with a full sync");
            }
        }
    }

    /// Deletes UDP and SCTP conntrack entries that still point at endpoints the rules no longer
    /// use (or that never met an endpoint), so a client such as a DNS resolver reusing its
    /// source port reaches a live endpoint with its next datagram. Failures are logged and
    /// counted; the next sync tries again. After a partial sync only the changed Services are
    /// re-indexed.
    fn reconcile_conntrack(&mut self, changes: &Changes, full: bool) {
        let start = Instant::now();
        let (state, planner, conntrack) =
            (&self.state, &mut self.conntrack_planner, &self.conntrack);
        let result = tokio::task::block_in_place(|| {
            if full || changes.node_changed {
                planner.update(state, &IpFamily::ALL);
            } else {
                planner.update_services(state, &changes.services, &IpFamily::ALL);
            }
            conntrack.reconcile(planner, &local_addresses())
        });
        self.metrics
            .conntrack_reconciler_duration
            .observe(start.elapsed().as_secs_f64());
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
