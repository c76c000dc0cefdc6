//! Every Prometheus metric kube-proxy-rs exports, in one place, with upstream's names.
//!
//! Mirrors upstream `pkg/proxy/metrics/metrics.go`. Names that upstream has keep upstream's
//! spelling; metrics of our own start with `kubeproxy_rs_`. prometheus-client appends `_total` to
//! counters, so counters are registered without it. Serving them over HTTP is `kp-serve`'s job.

use prometheus_client::encoding::{text::encode, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use std::sync::atomic::AtomicU64;

/// A gauge holding a float (timestamps).
pub type FloatGauge = Gauge<f64, AtomicU64>;

/// Label for `traffic_policy`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TrafficPolicyLabel {
    /// `internal` or `external`.
    pub traffic_policy: String,
}

/// Label naming an object kind.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// `Service`, `EndpointSlice` or `Node`.
    pub kind: String,
}

/// Labels for source errors.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceErrorLabel {
    /// `kubernetes` or `manifests`.
    pub source: String,
    /// What failed (`watch`, `parse`, ...).
    pub reason: String,
}

/// Labels of a proxy mode fallback.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FallbackLabel {
    /// The mode configured (`iptables`).
    pub from: String,
    /// The mode that runs instead (`userspace`).
    pub to: String,
}

/// Label naming one of the ebpf mode's BPF maps (`kp_services`, `kp_backends`, ...).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MapLabel {
    /// The map's name.
    pub map: String,
}

/// Label naming a table (`ip`, `ip6`, `nat`, `filter`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TableLabel {
    /// The table.
    pub table: String,
}

/// Label naming a Service port, upstream's spelling (`namespace/name:port`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServicePortLabel {
    /// The Service port, or [`SERVICE_PORT_OVERFLOW`].
    pub service_port: String,
}

/// The most Service ports the userspace mode's per-port series are kept for
/// ([`UserspaceByServicePort`]); the traffic of any further one is counted under
/// [`SERVICE_PORT_OVERFLOW`]. Eight series per Service port: at most 8008 series in all.
pub const SERVICE_PORT_SERIES_MAX: usize = 1000;

/// The `service_port` label of the traffic of the Service ports past [`SERVICE_PORT_SERIES_MAX`]
/// (no Service port is spelled so: a real one has a `/`).
pub const SERVICE_PORT_OVERFLOW: &str = "(overflow)";

/// The handles of one `service_port` label in every family of [`UserspaceByServicePort`]: a
/// connection takes them once and counts through them to its end (a clone shares the value).
#[derive(Clone, Debug, Default)]
pub struct UserspacePortSeries {
    /// Whether these are the port's own series (not the overflow ones).
    pub own: bool,
    /// `kubeproxy_rs_userspace_service_port_active_connections`.
    pub active_connections: Gauge,
    /// `kubeproxy_rs_userspace_service_port_connections_total`.
    pub connections: Counter,
    /// `kubeproxy_rs_userspace_service_port_endpoint_connect_failures_total`.
    pub connect_failures: Counter,
    /// `kubeproxy_rs_userspace_service_port_endpoint_connect_retries_total`.
    pub connect_retries: Counter,
    /// `kubeproxy_rs_userspace_service_port_connections_failed_total`.
    pub connections_failed: Counter,
    /// `kubeproxy_rs_userspace_service_port_udp_sessions`.
    pub udp_sessions: Gauge,
    /// `kubeproxy_rs_userspace_service_port_udp_sessions_created_total`.
    pub udp_sessions_created: Counter,
    /// `kubeproxy_rs_userspace_service_port_bytes_relayed_total`.
    pub bytes_relayed: Counter,
}

/// The userspace mode's metrics by Service port (`{service_port="namespace/name:port"}`), with
/// bounded cardinality: the first [`SERVICE_PORT_SERIES_MAX`] Service ports that carry traffic
/// get series of their own, the traffic of any other one is counted under
/// [`SERVICE_PORT_OVERFLOW`], and [`UserspaceByServicePort::remove`] deletes a Service port's
/// series (when the port goes), which frees its place.
#[derive(Debug, Default)]
pub struct UserspaceByServicePort {
    active_connections: Family<ServicePortLabel, Gauge>,
    connections: Family<ServicePortLabel, Counter>,
    connect_failures: Family<ServicePortLabel, Counter>,
    connect_retries: Family<ServicePortLabel, Counter>,
    connections_failed: Family<ServicePortLabel, Counter>,
    udp_sessions: Family<ServicePortLabel, Gauge>,
    udp_sessions_created: Family<ServicePortLabel, Counter>,
    bytes_relayed: Family<ServicePortLabel, Counter>,
    /// The Service ports with series of their own.
    admitted: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl UserspaceByServicePort {
    /// The series of `service_port` (made on first use while fewer than
    /// [`SERVICE_PORT_SERIES_MAX`] Service ports have series), or the overflow ones.
    pub fn series(&self, service_port: &str) -> UserspacePortSeries {
        // Under the lock to the end, so a removal cannot come between the admission and the
        // series' creation (and leave series of a port that is gone).
        let mut admitted = self.lock();
        let own = admitted.contains(service_port)
            || (admitted.len() < SERVICE_PORT_SERIES_MAX
                && admitted.insert(service_port.to_string()));
        let l = ServicePortLabel {
            service_port: if own {
                service_port
            } else {
                SERVICE_PORT_OVERFLOW
            }
            .to_string(),
        };
        let series = UserspacePortSeries {
            own,
            active_connections: self.active_connections.get_or_create(&l).clone(),
            connections: self.connections.get_or_create(&l).clone(),
            connect_failures: self.connect_failures.get_or_create(&l).clone(),
            connect_retries: self.connect_retries.get_or_create(&l).clone(),
            connections_failed: self.connections_failed.get_or_create(&l).clone(),
            udp_sessions: self.udp_sessions.get_or_create(&l).clone(),
            udp_sessions_created: self.udp_sessions_created.get_or_create(&l).clone(),
            bytes_relayed: self.bytes_relayed.get_or_create(&l).clone(),
        };
        drop(admitted);
        series
    }

    /// Deletes the series of `service_port` (the Service port is gone) and frees its place.
    /// Handles taken before keep counting, unexported. The overflow series stay.
    pub fn remove(&self, service_port: &str) {
        let mut admitted = self.lock();
        if !admitted.remove(service_port) {
            return;
        }
        let l = ServicePortLabel {
            service_port: service_port.to_string(),
        };
        self.active_connections.remove(&l);
        self.connections.remove(&l);
        self.connect_failures.remove(&l);
        self.connect_retries.remove(&l);
        self.connections_failed.remove(&l);
        self.udp_sessions.remove(&l);
        self.udp_sessions_created.remove(&l);
        self.bytes_relayed.remove(&l);
        drop(admitted);
    }

    /// How many Service ports have series of their own.
    pub fn admitted(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
        self.admitted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn register(&self, r: &mut Registry) {
        let p = "kubeproxy_rs_userspace_service_port_";
        r.register(
            format!("{p}active_connections"),
            "TCP connections the userspace proxy relays now, by Service port",
            self.active_connections.clone(),
        );
        r.register(
            format!("{p}connections"),
            "TCP connections the userspace proxy accepted, by Service port",
            self.connections.clone(),
        );
        r.register(
            format!("{p}endpoint_connect_failures"),
            "Connection attempts to an endpoint that were refused or timed out, by Service port",
            self.connect_failures.clone(),
        );
        r.register(
            format!("{p}endpoint_connect_retries"),
            "Connection attempts made after another endpoint failed, by Service port",
            self.connect_retries.clone(),
        );
        r.register(
            format!("{p}connections_failed"),
            "Client connections reset because every endpoint failed, by Service port",
            self.connections_failed.clone(),
        );
        r.register(
            format!("{p}udp_sessions"),
            "UDP sessions the userspace proxy holds now, by Service port",
            self.udp_sessions.clone(),
        );
        r.register(
            format!("{p}udp_sessions_created"),
            "UDP sessions the userspace proxy opened, by Service port",
            self.udp_sessions_created.clone(),
        );
        r.register(
            format!("{p}bytes_relayed"),
            "Bytes the userspace proxy relayed, both directions, by Service port",
            self.bytes_relayed.clone(),
        );
    }
}

/// All metrics. Cheap to share behind an `Arc`; every field is internally synchronised.
pub struct Metrics {
    registry: Registry,
    /// `kubeproxy_sync_proxy_rules_duration_seconds`: every sync.
    pub sync_duration: Histogram,
    /// `kubeproxy_sync_full_proxy_rules_duration_seconds`.
    pub sync_full_duration: Histogram,
    /// `kubeproxy_sync_partial_proxy_rules_duration_seconds`.
    pub sync_partial_duration: Histogram,
    /// `kubeproxy_sync_proxy_rules_last_timestamp_seconds`.
    pub last_sync_timestamp: FloatGauge,
    /// `kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds`.
    pub last_queued_timestamp: FloatGauge,
    /// `kubeproxy_network_programming_duration_seconds`.
    pub network_programming_duration: Histogram,
    /// `kubeproxy_sync_proxy_rules_endpoint_changes_pending`.
    pub endpoint_changes_pending: Gauge,
    /// `kubeproxy_sync_proxy_rules_endpoint_changes_total`.
    pub endpoint_changes_total: Counter,
    /// `kubeproxy_sync_proxy_rules_service_changes_pending`.
    pub service_changes_pending: Gauge,
    /// `kubeproxy_sync_proxy_rules_service_changes_total`.
    pub service_changes_total: Counter,
    /// `kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy}` (a gauge, as upstream).
    pub no_local_endpoints: Family<TrafficPolicyLabel, Gauge>,
    /// `kubeproxy_sync_proxy_rules_nftables_sync_failures_total`.
    pub nftables_sync_failures: Counter,
    /// `kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total`.
    pub nftables_cleanup_failures: Counter,
    /// `kubeproxy_rs_nftables_transaction_statements`: size of each nft transaction sent.
    pub nftables_transaction_statements: Histogram,
    /// `kubeproxy_rs_nftables_readback_mismatches_total`: differences found by the read-back check.
    pub nftables_readback_mismatches: Counter,
    /// `kubeproxy_sync_proxy_rules_iptables_restore_failures_total`.
    pub iptables_restore_failures: Counter,
    /// `kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total`.
    pub iptables_partial_restore_failures: Counter,
    /// `kubeproxy_sync_proxy_rules_iptables_total{table}`: rules kube-proxy owns, per table.
    pub iptables_rules: Family<TableLabel, Gauge>,
    /// `kubeproxy_rs_iptables_readback_mismatches_total`.
    pub iptables_readback_mismatches: Counter,
    /// `kubeproxy_conntrack_reconciler_deleted_entries_total`.
    pub conntrack_deleted_entries: Counter,
    /// `kubeproxy_conntrack_reconciler_sync_duration_seconds`.
    pub conntrack_reconciler_duration: Histogram,
    /// `kubeproxy_rs_conntrack_reconciler_errors_total`.
    pub conntrack_reconciler_errors: Counter,
    /// `kubeproxy_rs_invalid_objects_total{kind}`: objects skipped because they failed validation.
    pub invalid_objects: Family<KindLabel, Counter>,
    /// `kubeproxy_rs_source_errors_total{source,reason}`: watch failures, unreadable files.
    pub source_errors: Family<SourceErrorLabel, Counter>,
    /// `kubeproxy_rs_proxy_mode_fallbacks_total{from,to}`: starts that ran another mode than the
    /// configured one because the node cannot run it (iptables → userspace, as older releases).
    pub proxy_mode_fallbacks: Family<FallbackLabel, Counter>,
    /// `kubeproxy_rs_ebpf_map_full_total{map}`: ebpf-mode syncs that stopped because a BPF map
    /// had no room for another entry (its size in the configuration is too small).
    pub ebpf_map_full: Family<MapLabel, Counter>,
    /// `kubeproxy_rs_ebpf_stale_udp_sockets_destroyed_total`: connected UDP sockets ebpf mode
    /// destroyed because a sync took their backend from the frontend they were sent for.
    pub ebpf_stale_udp_sockets_destroyed: Counter,
    /// `kubeproxy_rs_ebpf_stale_udp_failures_total`: syncs whose stale UDP sockets could not
    /// be destroyed (they stay connected to the gone backend).
    pub ebpf_stale_udp_failures: Counter,
    /// `kubeproxy_rs_userspace_active_connections`: TCP connections being relayed now.
    pub userspace_active_connections: Gauge,
    /// `kubeproxy_rs_userspace_connections_total`: TCP connections accepted for a Service.
    pub userspace_connections: Counter,
    /// `kubeproxy_rs_userspace_endpoint_connect_failures_total`: attempts to an endpoint refused or timed out.
    pub userspace_connect_failures: Counter,
    /// `kubeproxy_rs_userspace_endpoint_connect_retries_total`: attempts made after another endpoint failed.
    pub userspace_connect_retries: Counter,
    /// `kubeproxy_rs_userspace_connections_failed_total`: client connections reset because every endpoint failed.
    pub userspace_connections_failed: Counter,
    /// `kubeproxy_rs_userspace_udp_sessions`: UDP sessions held now.
    pub userspace_udp_sessions: Gauge,
    /// `kubeproxy_rs_userspace_udp_sessions_created_total`: UDP sessions opened.
    pub userspace_udp_sessions_created: Counter,
    /// `kubeproxy_rs_userspace_bytes_relayed_total`: bytes relayed, both directions, TCP and UDP.
    pub userspace_bytes_relayed: Counter,
    /// `kubeproxy_rs_userspace_service_port_*{service_port}`: the userspace metrics above by
    /// Service port, bounded.
    pub userspace_by_service_port: UserspaceByServicePort,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn duration_buckets() -> impl Iterator<Item = f64> {
    // 1 ms .. ~16 s, as upstream's exponential buckets.
    exponential_buckets(0.001, 2.0, 15)
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let sync_duration = Histogram::new(duration_buckets());
        let sync_full_duration = Histogram::new(duration_buckets());
        let sync_partial_duration = Histogram::new(duration_buckets());
        // Upstream's buckets (0.25 s .. 5 min), with sub-second ones in front: we aim for ms.
        let network_programming_duration = Histogram::new([
            0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0,
            8.0, 9.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0,
        ]);
        let m = Metrics {
            sync_duration,
            sync_full_duration,
            sync_partial_duration,
            last_sync_timestamp: FloatGauge::default(),
            last_queued_timestamp: FloatGauge::default(),
            network_programming_duration,
            endpoint_changes_pending: Gauge::default(),
            endpoint_changes_total: Counter::default(),
            service_changes_pending: Gauge::default(),
            service_changes_total: Counter::default(),
            no_local_endpoints: Family::default(),
            nftables_sync_failures: Counter::default(),
            nftables_cleanup_failures: Counter::default(),
            nftables_transaction_statements: Histogram::new(exponential_buckets(1.0, 4.0, 12)),
            nftables_readback_mismatches: Counter::default(),
            iptables_restore_failures: Counter::default(),
            iptables_partial_restore_failures: Counter::default(),
            iptables_rules: Family::default(),
            iptables_readback_mismatches: Counter::default(),
            conntrack_deleted_entries: Counter::default(),
            conntrack_reconciler_duration: Histogram::new(duration_buckets()),
            conntrack_reconciler_errors: Counter::default(),
            invalid_objects: Family::default(),
            source_errors: Family::default(),
            proxy_mode_fallbacks: Family::default(),
            ebpf_map_full: Family::default(),
            ebpf_stale_udp_sockets_destroyed: Counter::default(),
            ebpf_stale_udp_failures: Counter::default(),
            userspace_active_connections: Gauge::default(),
            userspace_connections: Counter::default(),
            userspace_connect_failures: Counter::default(),
            userspace_connect_retries: Counter::default(),
            userspace_connections_failed: Counter::default(),
            userspace_udp_sessions: Gauge::default(),
            userspace_udp_sessions_created: Counter::default(),
            userspace_bytes_relayed: Counter::default(),
            userspace_by_service_port: UserspaceByServicePort::default(),
            registry: Registry::default(),
        };
        let r = &mut registry;
        r.register(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            m.sync_duration.clone(),
        );
        r.register(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
            m.sync_full_duration.clone(),
        );
        r.register(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
            m.sync_partial_duration.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            m.last_sync_timestamp.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            m.last_queued_timestamp.clone(),
        );
        r.register(
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            m.network_programming_duration.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules Endpoint changes",
            m.endpoint_changes_pending.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules Endpoint changes",
            m.endpoint_changes_total.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes",
            m.service_changes_pending.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_service_changes",
            "Cumulative proxy rules Service changes",
            m.service_changes_total.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            m.no_local_endpoints.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_nftables_sync_failures",
            "Number of times an nftables transaction failed",
            m.nftables_sync_failures.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_nftables_cleanup_failures",
            "Number of times an nftables cleanup transaction failed",
            m.nftables_cleanup_failures.clone(),
        );
        r.register(
            "kubeproxy_rs_nftables_transaction_statements",
            "Statements in each nftables transaction sent to the kernel",
            m.nftables_transaction_statements.clone(),
        );
        r.register(
            "kubeproxy_rs_nftables_readback_mismatches",
            "Differences between kernel and desired state found by the read-back check",
            m.nftables_readback_mismatches.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_iptables_restore_failures",
            "Cumulative proxy iptables restore failures",
            m.iptables_restore_failures.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures",
            "Cumulative proxy iptables partial restore failures",
            m.iptables_partial_restore_failures.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_iptables_total",
            "Total number of iptables rules owned by kube-proxy",
            m.iptables_rules.clone(),
        );
        r.register(
            "kubeproxy_rs_iptables_readback_mismatches",
            "Differences between the kernel's iptables rules and the desired ones found by the read-back check",
            m.iptables_readback_mismatches.clone(),
        );
        r.register(
            "kubeproxy_conntrack_reconciler_deleted_entries",
            "Cumulative conntrack flows deleted by conntrack reconciler",
            m.conntrack_deleted_entries.clone(),
        );
        r.register(
            "kubeproxy_conntrack_reconciler_sync_duration_seconds",
            "ReconcileConntrackFlowsLatency latency in seconds",
            m.conntrack_reconciler_duration.clone(),
        );
        r.register(
            "kubeproxy_rs_conntrack_reconciler_errors",
            "Errors listing or deleting conntrack entries",
            m.conntrack_reconciler_errors.clone(),
        );
        r.register(
            "kubeproxy_rs_invalid_objects",
            "Objects skipped because they failed validation",
            m.invalid_objects.clone(),
        );
        r.register(
            "kubeproxy_rs_source_errors",
            "Errors reading the Kubernetes API or the manifest directory",
            m.source_errors.clone(),
        );
        r.register(
            "kubeproxy_rs_proxy_mode_fallbacks",
            "Starts that ran another proxy mode than the configured one, because the node cannot run it",
            m.proxy_mode_fallbacks.clone(),
        );
        r.register(
            "kubeproxy_rs_ebpf_map_full",
            "ebpf mode syncs stopped by a full BPF map, by map (raise its size in the configuration)",
            m.ebpf_map_full.clone(),
        );
        r.register(
            "kubeproxy_rs_ebpf_stale_udp_sockets_destroyed",
            "Connected UDP sockets ebpf mode destroyed because their backend left the frontend they were sent for",
            m.ebpf_stale_udp_sockets_destroyed.clone(),
        );
        r.register(
            "kubeproxy_rs_ebpf_stale_udp_failures",
            "ebpf mode syncs whose stale UDP sockets could not be destroyed",
            m.ebpf_stale_udp_failures.clone(),
        );
        r.register(
            "kubeproxy_rs_userspace_active_connections",
            "TCP connections the userspace proxy relays now",
            m.userspace_active_connections.clone(),
        );
        r.register(
            "kubeproxy_rs_userspace_connections",
            "TCP connections the userspace proxy accepted for a Service",
            m.userspace_connections.clone(),
        );
        r.register(
            "kubeproxy_rs_userspace_endpoint_connect_failures",
            "Connection attempts to an endpoint that were refused or timed out",
            m.userspace_connect_failures.clone(),
        );
        r.register(
            "kubeproxy_rs_userspace_endpoint_connect_retries",
            "Connection attempts made after another endpoint failed",
            m.userspace_connect_retries.clone(),
        );
        r.register(
            "kubeproxy_rs_userspace_connections_failed",
            "Client connections reset because every endpoint failed",
            m.userspace_connections_failed.clone(),
        );
        r.register(
            "kubeproxy_rs_userspace_udp_sessions",
            "UDP sessions the userspace proxy holds now",
            m.userspace_udp_sessions.clone(),
        );
        r.register(
            "kubeproxy_rs_userspace_udp_sessions_created",
            "UDP sessions the userspace proxy opened",
            m.userspace_udp_sessions_created.clone(),
        );
        r.register(
            "kubeproxy_rs_userspace_bytes_relayed",
            "Bytes the userspace proxy relayed, both directions, TCP and UDP",
            m.userspace_bytes_relayed.clone(),
        );
        m.userspace_by_service_port.register(r);
        Metrics { registry, ..m }
    }

    /// Counts an object skipped because it failed validation.
    pub fn invalid_object(&self, kind: &str) {
        self.invalid_objects
            .get_or_create(&KindLabel {
                kind: kind.to_string(),
            })
            .inc();
    }

    /// Counts a source error.
    pub fn source_error(&self, source: &str, reason: &str) {
        self.source_errors
            .get_or_create(&SourceErrorLabel {
                source: source.to_string(),
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Counts a start that runs mode `to` because the node cannot run the configured `from`.
    pub fn mode_fallback(&self, from: &str, to: &str) {
        self.proxy_mode_fallbacks
            .get_or_create(&FallbackLabel {
                from: from.to_string(),
                to: to.to_string(),
            })
            .inc();
    }

    /// Counts an ebpf-mode sync stopped because BPF map `map` is full.
    pub fn ebpf_map_full(&self, map: &str) {
        self.ebpf_map_full
            .get_or_create(&MapLabel {
                map: map.to_string(),
            })
            .inc();
    }

    /// Renders the registry in the Prometheus text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exports_upstream_names() {
        let m = Metrics::new();
        m.nftables_sync_failures.inc();
        m.no_local_endpoints
            .get_or_create(&TrafficPolicyLabel {
                traffic_policy: "external".into(),
            })
            .set(2);
        m.sync_full_duration.observe(0.5);
        m.mode_fallback("iptables", "userspace");
        m.ebpf_map_full("kp_services");
        m.ebpf_stale_udp_sockets_destroyed.inc_by(2);
        let text = m.encode();
        for name in [
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
            "kubeproxy_sync_full_proxy_rules_duration_seconds_count 1",
            "kubeproxy_sync_partial_proxy_rules_duration_seconds_count 0",
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "kubeproxy_network_programming_duration_seconds_bucket",
            "kubeproxy_sync_proxy_rules_endpoint_changes_total 0",
            "kubeproxy_sync_proxy_rules_service_changes_pending 0",
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total 1",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"external\"} 2",
            "kubeproxy_rs_proxy_mode_fallbacks_total{from=\"iptables\",to=\"userspace\"} 1",
            "kubeproxy_rs_ebpf_map_full_total{map=\"kp_services\"} 1",
            "kubeproxy_rs_ebpf_stale_udp_sockets_destroyed_total 2",
            "kubeproxy_rs_ebpf_stale_udp_failures_total 0",
        ] {
            assert!(text.contains(name), "missing {name} in:\n{text}");
        }
    }

    /// The exported lines of one `kubeproxy_rs_userspace_service_port_*` metric.
    fn lines(text: &str, metric: &str) -> Vec<String> {
        let prefix = format!("kubeproxy_rs_userspace_service_port_{metric}{{");
        text.lines()
            .filter(|l| l.starts_with(&prefix))
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn service_port_series_are_labelled_and_shared_by_every_handle_of_a_port() {
        let m = Metrics::new();
        let by = &m.userspace_by_service_port;
        let a = by.series("default/web:http");
        a.connections.inc();
        a.active_connections.inc();
        a.bytes_relayed.inc_by(100);
        // A second handle of the same port counts into the same series.
        let again = by.series("default/web:http");
        again.connections.inc();
        again.connect_failures.inc();
        again.connect_retries.inc();
        again.connections_failed.inc();
        again.udp_sessions.inc();
        again.udp_sessions_created.inc();
        by.series("kube-system/dns:dns").udp_sessions_created.inc();
        let text = m.encode();
        for line in [
            "kubeproxy_rs_userspace_service_port_connections_total{service_port=\"default/web:http\"} 2",
            "kubeproxy_rs_userspace_service_port_active_connections{service_port=\"default/web:http\"} 1",
            "kubeproxy_rs_userspace_service_port_bytes_relayed_total{service_port=\"default/web:http\"} 100",
            "kubeproxy_rs_userspace_service_port_endpoint_connect_failures_total{service_port=\"default/web:http\"} 1",
            "kubeproxy_rs_userspace_service_port_endpoint_connect_retries_total{service_port=\"default/web:http\"} 1",
            "kubeproxy_rs_userspace_service_port_connections_failed_total{service_port=\"default/web:http\"} 1",
            "kubeproxy_rs_userspace_service_port_udp_sessions{service_port=\"default/web:http\"} 1",
            "kubeproxy_rs_userspace_service_port_udp_sessions_created_total{service_port=\"kube-system/dns:dns\"} 1",
        ] {
            assert!(text.contains(line), "missing {line} in:\n{text}");
        }
        assert_eq!(by.admitted(), 2);
    }

    #[test]
    fn past_the_maximum_service_ports_share_the_overflow_series_until_a_place_is_freed() {
        let m = Metrics::new();
        let by = &m.userspace_by_service_port;
        for i in 0..SERVICE_PORT_SERIES_MAX {
            by.series(&format!("ns/svc-{i}:p")).connections.inc();
        }
        assert_eq!(by.admitted(), SERVICE_PORT_SERIES_MAX);
        // Three more Service ports: one overflow series counts all of them.
        for i in 0..3 {
            let late = by.series(&format!("ns/late-{i}:p"));
            assert!(!late.own);
            late.connections.inc();
        }
        assert_eq!(by.admitted(), SERVICE_PORT_SERIES_MAX);
        let text = m.encode();
        let connections = lines(&text, "connections_total");
        assert_eq!(connections.len(), SERVICE_PORT_SERIES_MAX + 1);
        assert!(
            connections.contains(&format!(
                "kubeproxy_rs_userspace_service_port_connections_total{{service_port=\"{SERVICE_PORT_OVERFLOW}\"}} 3"
            )),
            "{:?}",
            &connections[connections.len() - 3..]
        );
        assert!(!text.contains("ns/late-"));
        // An admitted port keeps its own series at the maximum.
        by.series("ns/svc-7:p").connections.inc();
        assert!(text.contains("{service_port=\"ns/svc-7:p\"} 1"));
        assert!(m
            .encode()
            .contains("connections_total{service_port=\"ns/svc-7:p\"} 2"));

        // A removed port's series go from every family, and its place goes to the next port.
        let held = by.series("ns/svc-0:p");
        by.remove("ns/svc-0:p");
        held.connections.inc();
        let text = m.encode();
        assert!(
            !text.contains("\"ns/svc-0:p\""),
            "series of a removed port left"
        );
        for metric in ["active_connections", "udp_sessions", "bytes_relayed_total"] {
            assert_eq!(
                lines(&text, metric).len(),
                SERVICE_PORT_SERIES_MAX,
                "{metric}"
            );
        }
        let late = by.series("ns/late-0:p");
        assert!(late.own);
        late.connections.inc();
        let text = m.encode();
        assert!(text.contains("connections_total{service_port=\"ns/late-0:p\"} 1"));
        assert_eq!(by.admitted(), SERVICE_PORT_SERIES_MAX);
        // Removing one that never had series (or the overflow) changes nothing.
        by.remove("ns/late-1:p");
        by.remove(SERVICE_PORT_OVERFLOW);
        assert_eq!(
            lines(&m.encode(), "connections_total").len(),
            SERVICE_PORT_SERIES_MAX + 1
        );
    }
}
