//! `KubeProxyConfiguration` (`kubeproxy.config.k8s.io/v1alpha1`) as serde types.
//!
//! Mirrors `staging/src/k8s.io/kube-proxy/config/v1alpha1/types.go`, with the same field names
//! and the same "pointer means optional" shapes (`Option` here). Fields are declared in
//! alphabetical order of their YAML names so that `--write-config-to` prints them in the order
//! upstream does.
//!
//! Every struct denies unknown fields, so a misspelt setting is an error naming it rather than
//! a silent no-op. `null` is accepted wherever upstream's Go decoder accepts it (for any field),
//! because kubeadm's generated config is full of `null`s.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::duration::{time_or_meta, GoDuration};

/// The only `apiVersion` we read.
pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
/// The only `kind` we read.
pub const KIND: &str = "KubeProxyConfiguration";

/// The healthz port when `healthzBindAddress` has none (`ports.ProxyHealthzPort`).
pub const PROXY_HEALTHZ_PORT: u16 = 10256;
/// The metrics port when `metricsBindAddress` has none (`ports.ProxyStatusPort`).
pub const PROXY_STATUS_PORT: u16 = 10249;
/// `qos.KubeProxyOOMScoreAdj`.
pub const DEFAULT_OOM_SCORE_ADJ: i32 = -999;
/// Upstream's default fwmark bit for masquerading (`0x4000`).
pub const DEFAULT_MASQUERADE_BIT: i32 = 14;
/// The `nodePortAddresses` keyword for "the node's primary IPs".
pub const NODE_PORT_ADDRESSES_PRIMARY: &str = "primary";

/// Reads `null` (or nothing) as the type's zero value, as Go's JSON decoder does for
/// non-pointer fields.
fn nullable<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// The whole kube-proxy configuration file.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct KubeProxyConfiguration {
    /// Must be `kubeproxy.config.k8s.io/v1alpha1`.
    #[serde(deserialize_with = "nullable")]
    pub api_version: String,
    /// Overrides kube-proxy's idea of the node's primary IP; despite the name, nothing binds
    /// to it. Defaults to `0.0.0.0`, meaning "ask the Node object".
    #[serde(deserialize_with = "nullable")]
    pub bind_address: String,
    /// Treat failure to bind the healthz or metrics port as fatal.
    #[serde(deserialize_with = "nullable")]
    pub bind_address_hard_fail: bool,
    /// How to reach the API server.
    #[serde(deserialize_with = "nullable")]
    pub client_connection: ClientConnectionConfiguration,
    /// Pod CIDR(s) of the cluster; a comma-separated dual-stack pair is allowed. Used by
    /// `detectLocalMode: ClusterCIDR`.
    #[serde(rename = "clusterCIDR", deserialize_with = "nullable")]
    pub cluster_cidr: String,
    /// How often informers re-list from the API server.
    #[serde(deserialize_with = "nullable")]
    pub config_sync_period: GoDuration,
    /// Conntrack sysctls and timeouts.
    #[serde(deserialize_with = "nullable")]
    pub conntrack: KubeProxyConntrackConfiguration,
    /// Settings for the interface-based `detectLocalMode`s.
    #[serde(deserialize_with = "nullable")]
    pub detect_local: DetectLocalConfiguration,
    /// `ClusterCIDR` (default), `NodeCIDR`, `BridgeInterface` or `InterfaceNamePrefix`.
    #[serde(deserialize_with = "nullable")]
    pub detect_local_mode: String,
    /// Our addition: settings of the ebpf mode (the sizes of its BPF maps).
    #[serde(deserialize_with = "nullable")]
    pub ebpf: KubeProxyEBPFConfiguration,
    /// Upstream serves pprof on the metrics port when set; we have no pprof.
    #[serde(deserialize_with = "nullable")]
    pub enable_profiling: bool,
    /// Feature gates by name. Accepted and logged; none changes our behaviour yet.
    #[serde(
        deserialize_with = "nullable",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub feature_gates: BTreeMap<String, bool>,
    /// `ip:port` of the proxy health server.
    #[serde(deserialize_with = "nullable")]
    pub healthz_bind_address: String,
    /// The Node name to use instead of the host name.
    #[serde(deserialize_with = "nullable")]
    pub hostname_override: String,
    /// Settings of the iptables mode (also the fallback for modes without their own section).
    #[serde(deserialize_with = "nullable")]
    pub iptables: KubeProxyIPTablesConfiguration,
    /// Settings of the ipvs mode.
    #[serde(deserialize_with = "nullable")]
    pub ipvs: KubeProxyIPVSConfiguration,
    /// Must be `KubeProxyConfiguration`.
    #[serde(deserialize_with = "nullable")]
    pub kind: String,
    /// component-base logging settings; only `verbosity` and `format` matter to us.
    #[serde(deserialize_with = "nullable")]
    pub logging: LoggingConfiguration,
    /// `ip:port` of the metrics server.
    #[serde(deserialize_with = "nullable")]
    pub metrics_bind_address: String,
    /// The proxy mode; empty means iptables, as upstream.
    #[serde(deserialize_with = "nullable")]
    pub mode: String,
    /// Settings of the nftables mode.
    #[serde(deserialize_with = "nullable")]
    pub nftables: KubeProxyNFTablesConfiguration,
    /// CIDRs of the node IPs that accept NodePort traffic, or `["primary"]`.
    #[serde(deserialize_with = "nullable")]
    pub node_port_addresses: Vec<String>,
    /// oom_score_adj for the kube-proxy process, in [-1000, 1000].
    pub oom_score_adj: Option<i32>,
    /// Host ports the userspace mode may listen on (`low-high`, `base+offset` or one port).
    #[serde(deserialize_with = "nullable")]
    pub port_range: String,
    /// Our addition: the ranges ClusterIPs are allocated from, for clusters whose API server
    /// does not serve ServiceCIDR objects (before Kubernetes 1.33) and for the manifest
    /// directory. Traffic to an address inside them that no Service holds is dropped.
    #[serde(rename = "serviceCIDRs", deserialize_with = "nullable")]
    pub service_cidrs: Vec<String>,
    /// Upstream's hidden-metrics switch; no metric of ours is hidden.
    #[serde(deserialize_with = "nullable")]
    pub show_hidden_metrics_for_version: String,
    /// Idle timeout of userspace-mode UDP sessions. Upstream dropped this field with the
    /// userspace mode (1.26); we keep it because we kept the mode.
    #[serde(deserialize_with = "nullable")]
    pub udp_idle_timeout: GoDuration,
    /// Windows settings: accepted and ignored.
    #[serde(deserialize_with = "nullable")]
    pub winkernel: KubeProxyWinkernelConfiguration,
    /// Windows service integration: accepted and ignored.
    #[serde(deserialize_with = "nullable", skip_serializing_if = "is_false")]
    pub windows_run_as_service: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// componentbaseconfig `ClientConnectionConfiguration`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct ClientConnectionConfiguration {
    /// `Accept` header for API requests.
    #[serde(deserialize_with = "nullable")]
    pub accept_content_types: String,
    /// Client-side burst of API requests.
    #[serde(deserialize_with = "nullable")]
    pub burst: i32,
    /// Content type of API requests.
    #[serde(deserialize_with = "nullable")]
    pub content_type: String,
    /// Path of the kubeconfig file; empty means in-cluster configuration.
    #[serde(deserialize_with = "nullable")]
    pub kubeconfig: String,
    /// Client-side rate of API requests per second.
    #[serde(deserialize_with = "nullable")]
    pub qps: f32,
}

/// `KubeProxyConntrackConfiguration`. Zero timeouts mean "leave the kernel's value".
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct KubeProxyConntrackConfiguration {
    /// nf_conntrack_max per CPU core; 0 leaves the limit alone and ignores `min`.
    pub max_per_core: Option<i32>,
    /// Lower bound for nf_conntrack_max.
    pub min: Option<i32>,
    /// Sets nf_conntrack_tcp_be_liberal.
    #[serde(deserialize_with = "nullable")]
    pub tcp_be_liberal: bool,
    /// Timeout of conntrack entries in CLOSE_WAIT.
    pub tcp_close_wait_timeout: Option<GoDuration>,
    /// Timeout of idle established TCP entries.
    pub tcp_established_timeout: Option<GoDuration>,
    /// Timeout of idle ASSURED UDP entries.
    #[serde(deserialize_with = "nullable")]
    pub udp_stream_timeout: GoDuration,
    /// Timeout of idle UNREPLIED UDP entries.
    #[serde(deserialize_with = "nullable")]
    pub udp_timeout: GoDuration,
}

/// `DetectLocalConfiguration`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct DetectLocalConfiguration {
    /// For `detectLocalMode: BridgeInterface`: traffic from this bridge is local.
    #[serde(deserialize_with = "nullable")]
    pub bridge_interface: String,
    /// For `detectLocalMode: InterfaceNamePrefix`: traffic from interfaces with this prefix
    /// is local.
    #[serde(deserialize_with = "nullable")]
    pub interface_name_prefix: String,
}

/// `KubeProxyIPTablesConfiguration`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct KubeProxyIPTablesConfiguration {
    /// Whether NodePorts answer on 127.0.0.1 (iptables mode, IPv4 only). Default false
    /// (upstream: true), because it needs route_localnet (CVE-2020-8558).
    pub localhost_node_ports: Option<bool>,
    /// Masquerade all traffic to ClusterIPs.
    #[serde(deserialize_with = "nullable")]
    pub masquerade_all: bool,
    /// fwmark bit marking packets to masquerade, in [0, 31]. Default 14.
    pub masquerade_bit: Option<i32>,
    /// Least time between two syncs; 0 syncs on every change.
    #[serde(deserialize_with = "nullable")]
    pub min_sync_period: GoDuration,
    /// Recent upstream's opt-in to SNAT with the node's InternalIP. Not implemented here.
    #[serde(rename = "snatNodeInternalIP", skip_serializing_if = "Option::is_none")]
    pub snat_node_internal_ip: Option<bool>,
    /// Longest time between two syncs.
    #[serde(deserialize_with = "nullable")]
    pub sync_period: GoDuration,
}

/// Default `ebpf.servicesMapMax`: frontends plus backend slots, room for 30,000 Services with
/// 10 endpoints each (330,000 entries for their ClusterIPs) and their NodePorts.
pub const DEFAULT_EBPF_SERVICES_MAP_MAX: u32 = 1 << 19;
/// Default `ebpf.backendsMapMax`: 30,000 Services × 10 endpoints, with room.
pub const DEFAULT_EBPF_BACKENDS_MAP_MAX: u32 = 1 << 19;
/// Default `ebpf.affinityMapMax` (LRU: the oldest entries go when it is full).
pub const DEFAULT_EBPF_AFFINITY_MAP_MAX: u32 = 1 << 16;
/// Default `ebpf.conntrackMapMax` (LRU).
pub const DEFAULT_EBPF_CONNTRACK_MAP_MAX: u32 = 1 << 18;

/// `ebpf` (our addition, no upstream counterpart): the ebpf mode's map sizes, in entries. The
/// kernel allocates the hash maps' entries when the maps are made; a pinned map of another
/// size is made afresh at start (and logged).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct KubeProxyEBPFConfiguration {
    /// `kp_services`: one entry per frontend (address, port, protocol) plus one per backend
    /// slot. Default [`DEFAULT_EBPF_SERVICES_MAP_MAX`].
    pub services_map_max: Option<u32>,
    /// `kp_backends`: one entry per distinct endpoint address and port. Default
    /// [`DEFAULT_EBPF_BACKENDS_MAP_MAX`].
    pub backends_map_max: Option<u32>,
    /// `kp_affinity` (LRU): one entry per client and ClientIP-affinity frontend. Default
    /// [`DEFAULT_EBPF_AFFINITY_MAP_MAX`].
    pub affinity_map_max: Option<u32>,
    /// `kp_ct` (the tc path's connection table, two entries per connection from outside the
    /// node) and `kp_sk_rev` (one per load-balanced socket), both LRU. Default
    /// [`DEFAULT_EBPF_CONNTRACK_MAP_MAX`].
    pub conntrack_map_max: Option<u32>,
}

/// `KubeProxyIPVSConfiguration`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct KubeProxyIPVSConfiguration {
    /// CIDRs whose IPVS services cleanup must not touch.
    #[serde(rename = "excludeCIDRs", deserialize_with = "nullable")]
    pub exclude_cidrs: Vec<String>,
    /// Least time between two syncs; 0 syncs on every change.
    #[serde(deserialize_with = "nullable")]
    pub min_sync_period: GoDuration,
    /// IPVS scheduler; empty means `rr`.
    #[serde(deserialize_with = "nullable")]
    pub scheduler: String,
    /// Set arp_ignore=1 and arp_announce=2.
    #[serde(rename = "strictARP", deserialize_with = "nullable")]
    pub strict_arp: bool,
    /// Longest time between two syncs.
    #[serde(deserialize_with = "nullable")]
    pub sync_period: GoDuration,
    /// IPVS TCP FIN timeout; 0 leaves it alone.
    #[serde(deserialize_with = "nullable")]
    pub tcp_fin_timeout: GoDuration,
    /// IPVS TCP idle timeout; 0 leaves it alone.
    #[serde(deserialize_with = "nullable")]
    pub tcp_timeout: GoDuration,
    /// IPVS UDP timeout; 0 leaves it alone.
    #[serde(deserialize_with = "nullable")]
    pub udp_timeout: GoDuration,
}

/// `KubeProxyNFTablesConfiguration`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct KubeProxyNFTablesConfiguration {
    /// Masquerade all traffic to ClusterIPs.
    #[serde(deserialize_with = "nullable")]
    pub masquerade_all: bool,
    /// Mark bit for packets to masquerade, in [0, 31]. Default 14.
    pub masquerade_bit: Option<i32>,
    /// Least time between two syncs; 0 syncs on every change.
    #[serde(deserialize_with = "nullable")]
    pub min_sync_period: GoDuration,
    /// Longest time between two syncs.
    #[serde(deserialize_with = "nullable")]
    pub sync_period: GoDuration,
}

/// `KubeProxyWinkernelConfiguration`: Windows only, accepted so shared configs load.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct KubeProxyWinkernelConfiguration {
    /// HNS DSR policies.
    #[serde(rename = "enableDSR", deserialize_with = "nullable")]
    pub enable_dsr: bool,
    /// Forward the health-check VIP.
    #[serde(deserialize_with = "nullable")]
    pub forward_health_check_vip: bool,
    /// HNS network name.
    #[serde(deserialize_with = "nullable")]
    pub network_name: String,
    /// Root HNS endpoint name.
    #[serde(deserialize_with = "nullable")]
    pub root_hns_endpoint_name: String,
    /// Source VIP.
    #[serde(deserialize_with = "nullable")]
    pub source_vip: String,
}

/// component-base `LoggingConfiguration`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct LoggingConfiguration {
    /// Longest time between log flushes. Accepted; our logger does not buffer.
    #[serde(deserialize_with = "time_or_meta::deserialize")]
    pub flush_frequency: GoDuration,
    /// Log format; only `text` is supported (as in upstream's default build).
    #[serde(deserialize_with = "nullable")]
    pub format: String,
    /// Format-specific options. Accepted; no effect.
    #[serde(deserialize_with = "nullable")]
    pub options: FormatOptions,
    /// Log verbosity, as `-v`.
    #[serde(deserialize_with = "nullable")]
    pub verbosity: u32,
    /// Per-file verbosity. Accepted; no effect.
    #[serde(deserialize_with = "nullable", skip_serializing_if = "Vec::is_empty")]
    pub vmodule: Vec<VModuleItem>,
}

/// component-base `FormatOptions`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FormatOptions {
    /// Options of the JSON format.
    #[serde(deserialize_with = "nullable")]
    pub json: OutputRoutingOptions,
    /// Options of the text format.
    #[serde(deserialize_with = "nullable")]
    pub text: OutputRoutingOptions,
}

/// component-base `OutputRoutingOptions` (the body of `TextOptions` and `JSONOptions`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct OutputRoutingOptions {
    /// Buffer size for info messages, as a Kubernetes quantity.
    #[serde(deserialize_with = "nullable")]
    pub info_buffer_size: Quantity,
    /// Send errors to stderr and info to stdout.
    #[serde(deserialize_with = "nullable")]
    pub split_stream: bool,
}

/// component-base `VModuleItem`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct VModuleItem {
    /// Glob of file names.
    #[serde(deserialize_with = "nullable")]
    pub file_pattern: String,
    /// Verbosity for matching files.
    #[serde(deserialize_with = "nullable")]
    pub verbosity: u32,
}

/// A Kubernetes resource quantity kept as text (`"0"`, `"1Mi"`); YAML may give it as a number.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quantity(pub String);

impl Default for Quantity {
    /// Zero, as upstream writes it.
    fn default() -> Self {
        Quantity("0".to_owned())
    }
}

impl Serialize for Quantity {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Quantity {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct QuantityVisitor;

        impl Visitor<'_> for QuantityVisitor {
            type Value = Quantity;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a quantity such as \"0\" or \"1Mi\"")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Quantity, E> {
                Ok(Quantity(v.to_owned()))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Quantity, E> {
                Ok(Quantity(v.to_string()))
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Quantity, E> {
                Ok(Quantity(v.to_string()))
            }

            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Quantity, E> {
                Ok(Quantity(v.to_string()))
            }
        }

        deserializer.deserialize_any(QuantityVisitor)
    }
}

impl KubeProxyConfiguration {
    /// Fills unset fields with upstream's v1alpha1 defaults
    /// (`SetDefaults_KubeProxyConfiguration`). As upstream, a zero duration counts as unset,
    /// so `minSyncPeriod: 0s` in a file becomes 1s; only the flags can ask for 0.
    ///
    /// Healthz and metrics addresses default by the family of `bindAddress`, and a bare IP
    /// gets the default port appended (`proxyutil.AppendPortIfNeeded`).
    pub fn set_defaults(&mut self) {
        if self.bind_address.is_empty() {
            self.bind_address = "0.0.0.0".to_owned();
        }
        let ipv6 = self
            .bind_address
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_ipv6());
        let (healthz_host, metrics_host) = if ipv6 {
            ("[::]", "[::1]")
        } else {
            ("0.0.0.0", "127.0.0.1")
        };
        self.healthz_bind_address = if self.healthz_bind_address.is_empty() {
            format!("{healthz_host}:{PROXY_HEALTHZ_PORT}")
        } else {
            append_port_if_needed(&self.healthz_bind_address, PROXY_HEALTHZ_PORT)
        };
        self.metrics_bind_address = if self.metrics_bind_address.is_empty() {
            format!("{metrics_host}:{PROXY_STATUS_PORT}")
        } else {
            append_port_if_needed(&self.metrics_bind_address, PROXY_STATUS_PORT)
        };

        self.oom_score_adj.get_or_insert(DEFAULT_OOM_SCORE_ADJ);

        let default_sync = GoDuration::from_secs(30);
        let default_min_sync = GoDuration::from_secs(1);
        default_zero(&mut self.iptables.sync_period, default_sync);
        default_zero(&mut self.iptables.min_sync_period, default_min_sync);
        self.iptables.localhost_node_ports.get_or_insert(false);
        self.iptables
            .masquerade_bit
            .get_or_insert(DEFAULT_MASQUERADE_BIT);
        default_zero(&mut self.ipvs.sync_period, default_sync);
        default_zero(&mut self.ipvs.min_sync_period, default_min_sync);
        default_zero(&mut self.nftables.sync_period, default_sync);
        default_zero(&mut self.nftables.min_sync_period, default_min_sync);
        self.nftables
            .masquerade_bit
            .get_or_insert(DEFAULT_MASQUERADE_BIT);

        self.ebpf
            .services_map_max
            .get_or_insert(DEFAULT_EBPF_SERVICES_MAP_MAX);
        self.ebpf
            .backends_map_max
            .get_or_insert(DEFAULT_EBPF_BACKENDS_MAP_MAX);
        self.ebpf
            .affinity_map_max
            .get_or_insert(DEFAULT_EBPF_AFFINITY_MAP_MAX);
        self.ebpf
            .conntrack_map_max
            .get_or_insert(DEFAULT_EBPF_CONNTRACK_MAP_MAX);

        self.conntrack.max_per_core.get_or_insert(32 * 1024);
        self.conntrack.min.get_or_insert(128 * 1024);
        self.conntrack
            .tcp_established_timeout
            .get_or_insert(GoDuration::from_secs(24 * 3600));
        // One hour rather than the kernel's 60s, as upstream: see kubernetes#32551.
        self.conntrack
            .tcp_close_wait_timeout
            .get_or_insert(GoDuration::from_secs(3600));

        default_zero(&mut self.config_sync_period, GoDuration::from_secs(15 * 60));
        default_zero(&mut self.udp_idle_timeout, GoDuration::from_millis(250));

        let client = &mut self.client_connection;
        if client.content_type.is_empty() {
            client.content_type = "application/vnd.kubernetes.protobuf".to_owned();
        }
        if client.qps == 0.0 {
            client.qps = 5.0;
        }
        if client.burst == 0 {
            client.burst = 10;
        }

        if self.logging.format.is_empty() {
            self.logging.format = "text".to_owned();
        }
        default_zero(&mut self.logging.flush_frequency, GoDuration::from_secs(5));
    }

    /// Upstream's `platformApplyDefaults` for Linux, run after flags: an empty mode becomes
    /// `iptables`, nftables mode without `nodePortAddresses` gets `["primary"]`, and an empty
    /// `detectLocalMode` becomes `ClusterCIDR`.
    pub fn apply_platform_defaults(&mut self) {
        if self.mode.is_empty() {
            self.mode = "iptables".to_owned();
        }
        if self.mode == "nftables" && self.node_port_addresses.is_empty() {
            self.node_port_addresses = vec![NODE_PORT_ADDRESSES_PRIMARY.to_owned()];
        }
        if self.detect_local_mode.is_empty() {
            self.detect_local_mode = "ClusterCIDR".to_owned();
        }
    }
}

fn default_zero(value: &mut GoDuration, default: GoDuration) {
    if value.is_zero() {
        *value = default;
    }
}

/// Appends `:port` to a bare IP address; anything else is returned unchanged for validation
/// to judge.
pub(crate) fn append_port_if_needed(address: &str, port: u16) -> String {
    match address.parse::<std::net::IpAddr>() {
        Ok(ip) => std::net::SocketAddr::new(ip, port).to_string(),
        Err(_) => address.to_owned(),
    }
}
