//! The command line, with upstream's flag names (`cmd/kube-proxy/app/options.go`).
//!
//! Every value is an `Option` so that only the flags a user actually passed override the
//! config file. Values are checked here where the check needs nothing else (a CIDR parses, a
//! bit is in range), so the error names the flag; rules that span fields run later, on the
//! merged configuration.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use clap::Parser;
use ipnet::IpNet;

use super::duration::GoDuration;
use super::types::{
    append_port_if_needed, NODE_PORT_ADDRESSES_PRIMARY, PROXY_HEALTHZ_PORT, PROXY_STATUS_PORT,
};
use super::{LocalMode, ProxyMode};

/// kube-proxy-rs: the Kubernetes network proxy. Watches Services, EndpointSlices and this
/// Node, and programs the kernel so that Service traffic reaches the endpoints.
#[derive(Clone, Debug, Parser)]
#[command(
    name = "kube-proxy",
    version,
    disable_version_flag = true,
    after_help = WITHOUT_EFFECT
)]
pub(crate) struct Flags {
    /// Print version information and exit. As upstream, '--version=raw' prints it too and
    /// '--version=false' does nothing.
    #[arg(
        short = 'V',
        long,
        value_name = "true|false|raw",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        value_parser = ["true", "false", "raw"]
    )]
    pub version: Option<String>,

    /// Path to a KubeProxyConfiguration file (kubeproxy.config.k8s.io/v1alpha1). Flags given on
    /// the command line override its values.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Write the effective configuration (defaults, then the config file, then flags) to this
    /// file as YAML, and exit.
    #[arg(long, value_name = "FILE")]
    pub write_config_to: Option<PathBuf>,

    /// Remove the rules kube-proxy-rs installs (its nftables tables, and its iptables chains on
    /// both the nft and legacy backends), then exit. Chains and tables of others are left alone.
    #[arg(
        long,
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub cleanup: Option<bool>,

    /// Which proxy mode to use: 'iptables' (the default, as upstream), 'ipvs', 'nftables',
    /// 'userspace' or 'ebpf'. 'ipvs' runs 'iptables' instead, with a warning, where the
    /// kernel has no IPVS; 'iptables' runs 'userspace' instead where the node cannot run
    /// iptables. 'ebpf' balances connections made on the node and in its pods only (no
    /// NodePort, external or LoadBalancer IP traffic from outside the node yet).
    #[arg(long, value_name = "MODE", value_parser = parse_proxy_mode)]
    pub proxy_mode: Option<String>,

    /// Path to kubeconfig file with authorization information (the master location can be
    /// overridden by the master flag).
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,

    /// The address of the Kubernetes API server (overrides any value in kubeconfig).
    #[arg(long, value_name = "URL")]
    pub master: Option<String>,

    /// Run without an API server: read Service, EndpointSlice and Node manifests (YAML) from
    /// this directory instead. Not an upstream flag.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["master", "kubeconfig"])]
    pub manifests: Option<PathBuf>,

    /// If non-empty, will be used as the name of the Node that kube-proxy is running on. If
    /// unset, the node name is assumed to be the same as the node's hostname.
    #[arg(long, value_name = "NAME")]
    pub hostname_override: Option<String>,

    /// Overrides kube-proxy's idea of what its node's primary IP is (by default it comes from
    /// the Node object). Despite the name, nothing binds to this IP. [default: 0.0.0.0]
    #[arg(long, value_name = "IP")]
    pub bind_address: Option<IpAddr>,

    /// The IP address and port for the health check server to serve on. A bare IP gets port
    /// 10256; an empty value disables the server. [default: 0.0.0.0:10256]
    #[arg(long, value_name = "IP[:PORT]", value_parser = parse_healthz_address)]
    pub healthz_bind_address: Option<String>,

    /// The IP address and port for the metrics server to serve on (set to 0.0.0.0:10249 or
    /// [::]:10249 to serve on all interfaces). A bare IP gets port 10249; an empty value
    /// disables the server. [default: 127.0.0.1:10249]
    #[arg(long, value_name = "IP[:PORT]", value_parser = parse_metrics_address)]
    pub metrics_bind_address: Option<String>,

    /// The CIDR range of the pods in the cluster; for dual-stack clusters, a comma-separated
    /// pair of one IPv4 and one IPv6 range. When --detect-local-mode is ClusterCIDR, traffic
    /// whose source is in this range is local. (Otherwise it is not used.)
    #[arg(long, value_name = "CIDR[,CIDR]", value_parser = parse_cluster_cidr)]
    pub cluster_cidr: Option<String>,

    /// Mode to use to detect local traffic: ClusterCIDR, NodeCIDR, BridgeInterface or
    /// InterfaceNamePrefix. [default: ClusterCIDR]
    #[arg(long, value_name = "MODE", value_parser = parse_detect_local_mode)]
    pub detect_local_mode: Option<String>,

    /// A bridge interface name. When --detect-local-mode is BridgeInterface, traffic that
    /// originates from this bridge is local.
    #[arg(long, value_name = "NAME")]
    pub pod_bridge_interface: Option<String>,

    /// An interface name prefix. When --detect-local-mode is InterfaceNamePrefix, traffic that
    /// originates from any interface whose name begins with this prefix is local.
    #[arg(long, value_name = "PREFIX")]
    pub pod_interface_name_prefix: Option<String>,

    /// SNAT all traffic sent via Service cluster IPs. This may be required with some CNI
    /// plugins.
    #[arg(
        long,
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub masquerade_all: Option<bool>,

    /// Comma-separated CIDR ranges of the node IPs that accept NodePort connections, or the
    /// single word 'primary' (the node's primary IPs according to the Node object). Unset means
    /// all local IPs, except in nftables mode, where it means 'primary' (as upstream).
    #[arg(
        long,
        value_name = "CIDRS",
        value_delimiter = ',',
        value_parser = parse_node_port_address
    )]
    pub nodeport_addresses: Option<Vec<String>>,

    /// Our addition: the ranges ClusterIPs are allocated from (the API server's
    /// --service-cluster-ip-range), comma-separated. Traffic to an address inside them that no
    /// Service holds is dropped, as upstream's nftables mode does. Ranges from the cluster's
    /// ServiceCIDR objects (Kubernetes 1.33+) are added to these.
    #[arg(long, value_name = "CIDRS", value_delimiter = ',', value_parser = parse_service_cidr)]
    pub service_cidrs: Option<Vec<String>>,

    /// In iptables and ipvs modes, the bit of the fwmark space that marks packets to SNAT, in
    /// [0, 31]. As upstream, nftables mode ignores it and reads nftables.masqueradeBit from the
    /// config file. [default: 14]
    #[arg(long, value_name = "BIT", value_parser = clap::value_parser!(i32).range(0..=31))]
    pub iptables_masquerade_bit: Option<i32>,

    /// The longest interval between two syncs of the rules (e.g. '5s', '1m', '2h22m'); must be
    /// greater than 0. As upstream, this sets the sync period of every mode but ipvs.
    /// [default: 30s]
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub iptables_sync_period: Option<GoDuration>,

    /// The shortest interval between two syncs of the rules (e.g. '5s', '1m'); 0 means every
    /// Service or EndpointSlice change syncs at once. As upstream, this applies to every mode
    /// but ipvs. [default: 1s]
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub iptables_min_sync_period: Option<GoDuration>,

    /// If true, NodePort services can be reached via localhost (127.0.0.1) too. Applies only
    /// to iptables mode and IPv4. Off by default, unlike upstream, because answering on
    /// localhost needs route_localnet, which exposes localhost-bound services to the node's
    /// neighbours (CVE-2020-8558). [default: false]
    #[arg(
        long,
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub iptables_localhost_nodeports: Option<bool>,

    /// The IPVS scheduler in ipvs mode: rr (the default), wrr, lc, wlc, lblc, lblcr, sh, dh,
    /// sed, nq or mh. Userspace mode uses it too, and supports rr, lc, sh, dh, sed and nq.
    #[arg(long, value_name = "NAME")]
    pub ipvs_scheduler: Option<String>,

    /// Like --iptables-sync-period, for ipvs mode. [default: 30s]
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub ipvs_sync_period: Option<GoDuration>,

    /// Like --iptables-min-sync-period, for ipvs mode. [default: 1s]
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub ipvs_min_sync_period: Option<GoDuration>,

    /// In ipvs mode, set arp_ignore to 1 and arp_announce to 2.
    #[arg(
        long,
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub ipvs_strict_arp: Option<bool>,

    /// Range of host ports (begin-end, a single port, or begin+offset, inclusive) that the
    /// userspace mode may listen on; empty, 0 or 0-0 picks ports at random. With detect-local
    /// by interface it takes two neighbouring ports of the range (the second for pods'
    /// connections). No effect in other modes.
    #[arg(long, value_name = "RANGE", value_parser = parse_port_range_flag)]
    pub proxy_port_range: Option<String>,

    /// How long an idle UDP session stays open in userspace mode (e.g. '250ms'). No effect in
    /// other modes. [default: 250ms]
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub udp_timeout: Option<GoDuration>,

    /// userspace mode (not an upstream flag): how long a proxy told to stop (SIGTERM, SIGINT)
    /// keeps serving while its redirect rules still send connections to it, and lets running
    /// relays and UDP sessions finish once another proxy has taken over; it exits sooner when
    /// its rules are gone and nothing runs. Keep it below the pod's
    /// terminationGracePeriodSeconds (30s by default). 0 stops at once. A second signal stops
    /// at once too. [default: 10s]
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub userspace_drain_timeout: Option<GoDuration>,

    /// ebpf mode (not an upstream flag), read by the mode that takes over from it: the tc
    /// programs stay attached to carry the connections they made from outside the node (a
    /// NodePort's, an external or LoadBalancer IP's) until none has been used for this long,
    /// then go with the rest of the mode's pins; new connections meet the new mode at once. A
    /// connection idle for longer, then used again, is reset. 0 removes them at once.
    /// [default: 60s]
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub bpf_handover_idle: Option<GoDuration>,

    /// ebpf mode (not an upstream flag): the cgroup v2 directory the socket load balancer's
    /// hooks attach to. Unset: the root of the cgroup v2 hierarchy (found in
    /// /proc/self/mountinfo), which covers every process of the node and its pods.
    #[arg(long, value_name = "DIR")]
    pub bpf_cgroup_root: Option<PathBuf>,

    /// ebpf mode (not an upstream flag): the bpffs directory its maps are pinned in, so that a
    /// restarted proxy adopts them. [default: /sys/fs/bpf/kube-proxy-rs]
    #[arg(long, value_name = "DIR")]
    pub bpf_pin_dir: Option<PathBuf>,

    /// ebpf mode (not an upstream flag): entries of the services map (kp_services), one per
    /// frontend plus one per backend slot; a full map stops the sync with a log line and
    /// counts kubeproxy_rs_ebpf_map_full_total. A pinned map of another size is made afresh at
    /// start. [default: 524288, room for 30,000 Services x 10 endpoints]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub bpf_services_map_max: Option<u32>,

    /// ebpf mode (not an upstream flag): entries of the backends map (kp_backends), one per
    /// distinct endpoint address and port. [default: 524288]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub bpf_backends_map_max: Option<u32>,

    /// ebpf mode (not an upstream flag): entries of the ClientIP affinity map (kp_affinity,
    /// LRU). [default: 65536]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub bpf_affinity_map_max: Option<u32>,

    /// ebpf mode (not an upstream flag): entries of the tc path's connection table (kp_ct, two
    /// per connection from outside the node) and of the socket reverse map (kp_sk_rev, one per
    /// load-balanced socket), both LRU. [default: 262144]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub bpf_conntrack_map_max: Option<u32>,

    /// How often configuration from the API server is refreshed (re-listed); must be greater
    /// than 0. Accepted for compatibility: kube-proxy-rs keeps its watches open and re-lists
    /// only when a watch expires. [default: 15m0s]
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub config_sync_period: Option<GoDuration>,

    /// The oom-score-adj value for the kube-proxy process, in [-1000, 1000]. [default: -999]
    #[arg(long, value_name = "N", allow_hyphen_values = true,
          value_parser = clap::value_parser!(i32).range(-1000..=1000))]
    pub oom_score_adj: Option<i32>,

    /// Maximum number of NAT connections to track per CPU core (0 to leave the limit as-is and
    /// ignore --conntrack-min). [default: 32768]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(i32).range(0..))]
    pub conntrack_max_per_core: Option<i32>,

    /// Minimum number of conntrack entries to allocate, regardless of --conntrack-max-per-core
    /// (set --conntrack-max-per-core=0 to leave the limit as-is). [default: 131072]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(i32).range(0..))]
    pub conntrack_min: Option<i32>,

    /// Feature gates as comma-separated key=true|false pairs. Accepted for compatibility and
    /// reported at start; none changes kube-proxy-rs's behaviour yet.
    #[arg(
        long,
        value_name = "KEY=BOOL,...",
        value_delimiter = ',',
        value_parser = parse_feature_gate
    )]
    pub feature_gates: Option<Vec<(String, bool)>>,

    /// Log verbosity: the number for the log level. [default: 0]
    #[arg(short = 'v', long = "v", value_name = "LEVEL")]
    pub verbosity: Option<u8>,

    /// Log format: 'text' (the default) or 'json' (one JSON object per line, with "ts", "v"
    /// and "msg" keys, as upstream's json format).
    #[arg(long, value_name = "FORMAT", value_parser = ["text", "json"])]
    pub logging_format: Option<String>,

    /// Only perform the start-up steps that need full root privileges (sysctls, the conntrack
    /// table size), then exit, as upstream's --init-only for a privileged init container.
    #[arg(
        long,
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub init_only: Option<bool>,

    /// Idle timeout for established TCP connections, written to
    /// nf_conntrack_tcp_timeout_established (0 to leave as-is). [default: 24h0m0s]
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub conntrack_tcp_timeout_established: Option<GoDuration>,

    /// NAT timeout for TCP connections in the CLOSE_WAIT state, written to
    /// nf_conntrack_tcp_timeout_close_wait (0 to leave as-is). [default: 1h0m0s]
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub conntrack_tcp_timeout_close_wait: Option<GoDuration>,

    /// Set nf_conntrack_tcp_be_liberal (packets outside the TCP window are not marked
    /// INVALID).
    #[arg(
        long,
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub conntrack_tcp_be_liberal: Option<bool>,

    /// Idle timeout for UNREPLIED UDP conntrack entries, written to nf_conntrack_udp_timeout
    /// (0 to leave as-is).
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub conntrack_udp_timeout: Option<GoDuration>,

    /// Idle timeout for ASSURED UDP conntrack entries, written to
    /// nf_conntrack_udp_timeout_stream (0 to leave as-is).
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub conntrack_udp_timeout_stream: Option<GoDuration>,

    /// Comma-separated CIDRs whose IPVS virtual servers the ipvs mode leaves alone when it
    /// cleans up.
    #[arg(long, value_name = "CIDRS", value_delimiter = ',', value_parser = parse_service_cidr)]
    pub ipvs_exclude_cidrs: Option<Vec<String>>,

    /// The timeout for idle IPVS TCP connections, 0 to leave as-is (ipvs mode).
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub ipvs_tcp_timeout: Option<GoDuration>,

    /// The timeout for IPVS TCP connections after a FIN, 0 to leave as-is (ipvs mode).
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub ipvs_tcpfin_timeout: Option<GoDuration>,

    /// The timeout for IPVS UDP packets, 0 to leave as-is (ipvs mode).
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub ipvs_udp_timeout: Option<GoDuration>,

    /// Exit when the healthz or metrics port cannot be bound.
    #[arg(
        long,
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub bind_address_hard_fail: Option<bool>,

    /// Accepted without effect: kube-rs has no client-side rate limit. Recorded as
    /// clientConnection.qps. [default: 5]
    #[arg(long, value_name = "QPS")]
    pub kube_api_qps: Option<f32>,

    /// Accepted without effect: kube-rs has no client-side rate limit. Recorded as
    /// clientConnection.burst. [default: 10]
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub kube_api_burst: Option<i32>,

    /// Accepted without effect: requests are always JSON. Recorded as
    /// clientConnection.contentType. [default: application/vnd.kubernetes.protobuf]
    #[arg(long, value_name = "TYPE")]
    pub kube_api_content_type: Option<String>,

    /// Accepted without effect: there is no /debug/pprof.
    #[arg(
        long,
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub profiling: Option<bool>,

    /// Accepted without effect: no metric is hidden.
    #[arg(long, value_name = "VERSION")]
    pub show_hidden_metrics_for_version: Option<String>,

    /// Accepted without effect: per-file verbosity (pattern=N,...).
    #[arg(long, value_name = "PATTERN=N,...", value_delimiter = ',', value_parser = parse_vmodule)]
    pub vmodule: Option<Vec<(String, u32)>>,

    /// Accepted without effect: the logger does not buffer. [default: 5s]
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub log_flush_frequency: Option<GoDuration>,

    /// Accepted without effect: info buffer size of the json format's split stream.
    #[arg(long, value_name = "QUANTITY", value_parser = parse_quantity)]
    pub log_json_info_buffer_size: Option<String>,

    /// Accepted without effect: the json format writes every line to stderr.
    #[arg(
        long,
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub log_json_split_stream: Option<bool>,

    /// Accepted without effect: info buffer size of the text format's split stream.
    #[arg(long, value_name = "QUANTITY", value_parser = parse_quantity)]
    pub log_text_info_buffer_size: Option<String>,

    /// Accepted without effect: the text format writes every line to stderr.
    #[arg(
        long,
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub log_text_split_stream: Option<bool>,

    /// Accepted without effect: kube-proxy-rs reads no boot id.
    #[arg(long, value_name = "FILES")]
    pub boot_id_file: Option<String>,

    /// Accepted without effect: kube-proxy-rs reads no machine id.
    #[arg(long, value_name = "FILES")]
    pub machine_id_file: Option<String>,

    /// Deprecated (upstream hides it): the health server's port; 0 disables the server, any
    /// other value changes nothing (the address already carries a port), as upstream.
    #[arg(long, hide = true, value_name = "PORT", value_parser = clap::value_parser!(i32).range(0..=65535))]
    pub healthz_port: Option<i32>,

    /// Deprecated (upstream hides it): the metrics server's port; 0 disables the server, any
    /// other value changes nothing, as upstream.
    #[arg(long, hide = true, value_name = "PORT", value_parser = clap::value_parser!(i32).range(0..=65535))]
    pub metrics_port: Option<i32>,

    /// Removed upstream (1.16): the old name of --cleanup.
    #[arg(
        long,
        hide = true,
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub cleanup_iptables: Option<bool>,

    /// Old klog, cloud and container flags that upstream has removed and DaemonSets still pass:
    /// accepted without effect, with a deprecation warning.
    #[command(flatten)]
    pub legacy: LegacyFlags,
}

/// Flags removed upstream but still found in DaemonSets and guides. Every one is accepted with
/// a deprecation warning and has no effect: logs always go to stderr.
#[derive(Clone, Debug, Default, clap::Args)]
pub(crate) struct LegacyFlags {
    /// klog (removed in 1.26).
    #[arg(long, hide = true, value_name = "BOOL", num_args = 0..=1, require_equals = true,
          default_missing_value = "true")]
    pub add_dir_header: Option<bool>,
    /// klog (removed in 1.26).
    #[arg(long, hide = true, value_name = "BOOL", num_args = 0..=1, require_equals = true,
          default_missing_value = "true")]
    pub alsologtostderr: Option<bool>,
    /// klog (removed in 1.26).
    #[arg(long, hide = true, value_name = "FILE:LINE")]
    pub log_backtrace_at: Option<String>,
    /// klog (removed in 1.26).
    #[arg(long, hide = true, value_name = "DIR")]
    pub log_dir: Option<String>,
    /// klog (removed in 1.26).
    #[arg(long, hide = true, value_name = "FILE")]
    pub log_file: Option<String>,
    /// klog (removed in 1.26).
    #[arg(long, hide = true, value_name = "MB")]
    pub log_file_max_size: Option<u64>,
    /// klog (removed in 1.26).
    #[arg(long, hide = true, value_name = "BOOL", num_args = 0..=1, require_equals = true,
          default_missing_value = "true")]
    pub logtostderr: Option<bool>,
    /// klog (removed in 1.26).
    #[arg(long, hide = true, value_name = "BOOL", num_args = 0..=1, require_equals = true,
          default_missing_value = "true")]
    pub one_output: Option<bool>,
    /// klog (removed in 1.26).
    #[arg(long, hide = true, value_name = "BOOL", num_args = 0..=1, require_equals = true,
          default_missing_value = "true")]
    pub skip_headers: Option<bool>,
    /// klog (removed in 1.26).
    #[arg(long, hide = true, value_name = "BOOL", num_args = 0..=1, require_equals = true,
          default_missing_value = "true")]
    pub skip_log_headers: Option<bool>,
    /// klog (removed in 1.26).
    #[arg(long, hide = true, value_name = "SEVERITY")]
    pub stderrthreshold: Option<String>,
    /// Removed upstream: ipvs cleanup along with --cleanup (always done here).
    #[arg(long, hide = true, value_name = "BOOL", num_args = 0..=1, require_equals = true,
          default_missing_value = "true")]
    pub cleanup_ipvs: Option<bool>,
    /// Removed upstream (1.16): the cgroup container to run in.
    #[arg(long, hide = true, value_name = "NAME")]
    pub resource_container: Option<String>,
    /// Removed upstream (1.30): Azure registry credentials.
    #[arg(long, hide = true, value_name = "FILE")]
    pub azure_container_registry_config: Option<String>,
    /// Removed upstream: a fixed nf_conntrack_max (--conntrack-max-per-core applies instead).
    #[arg(long, hide = true, value_name = "N")]
    pub conntrack_max: Option<i32>,
}

impl LegacyFlags {
    /// The names of the legacy flags that were given.
    pub fn given(&self) -> Vec<&'static str> {
        let set = [
            ("--add-dir-header", self.add_dir_header.is_some()),
            ("--alsologtostderr", self.alsologtostderr.is_some()),
            ("--log-backtrace-at", self.log_backtrace_at.is_some()),
            ("--log-dir", self.log_dir.is_some()),
            ("--log-file", self.log_file.is_some()),
            ("--log-file-max-size", self.log_file_max_size.is_some()),
            ("--logtostderr", self.logtostderr.is_some()),
            ("--one-output", self.one_output.is_some()),
            ("--skip-headers", self.skip_headers.is_some()),
            ("--skip-log-headers", self.skip_log_headers.is_some()),
            ("--stderrthreshold", self.stderrthreshold.is_some()),
            ("--cleanup-ipvs", self.cleanup_ipvs.is_some()),
            ("--resource-container", self.resource_container.is_some()),
            (
                "--azure-container-registry-config",
                self.azure_container_registry_config.is_some(),
            ),
            ("--conntrack-max", self.conntrack_max.is_some()),
        ];
        set.into_iter()
            .filter(|(_, given)| *given)
            .map(|(name, _)| name)
            .collect()
    }
}

/// The flags that are accepted and change nothing, for `--help` and the README.
pub(crate) const WITHOUT_EFFECT: &str = "Accepted without effect (for drop-in compatibility): \
--kube-api-qps, --kube-api-burst, --kube-api-content-type, --profiling, \
--show-hidden-metrics-for-version, --vmodule, --log-flush-frequency, \
--log-json-info-buffer-size, --log-json-split-stream, --log-text-info-buffer-size, \
--log-text-split-stream, --boot-id-file, --machine-id-file, --feature-gates; deprecated, with a \
warning: --healthz-port and --metrics-port (except 0, which disables the server), \
--add-dir-header, --alsologtostderr, --log-backtrace-at, --log-dir, --log-file, \
--log-file-max-size, --logtostderr, --one-output, --skip-headers, --skip-log-headers, \
--stderrthreshold, --cleanup-ipvs, --resource-container, --azure-container-registry-config, \
--conntrack-max. --cleanup-iptables is the old name of --cleanup. As upstream, '_' in a flag \
name reads as '-' (--log_dir is --log-dir).";

/// Parses the command line (after [`normalize_args`]); `--version` and `--version=raw` come
/// back as clap's "display version" error, which prints to stdout and exits 0, like `--help`.
pub(crate) fn parse<I, T>(args: I) -> Result<Flags, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let flags = Flags::try_parse_from(normalize_args(args))?;
    if matches!(flags.version.as_deref(), Some("true" | "raw")) {
        // A command with clap's own version flag renders the version exactly as `-V` would.
        let printer = clap::Command::new("kube-proxy").version(env!("CARGO_PKG_VERSION"));
        return match printer.try_get_matches_from(["kube-proxy", "--version"]) {
            Err(version) => Err(version),
            Ok(_) => unreachable!("clap's --version always ends parsing"),
        };
    }
    Ok(flags)
}

/// pflag's `WordSepNormalizeFunc`: `_` in a flag's name reads as `-`, so klog's old spellings
/// (`--log_dir`, `--skip_headers`) and `--log-dir` are one flag. Values are left alone.
pub(crate) fn normalize_args<I, T>(args: I) -> Vec<std::ffi::OsString>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let mut out = Vec::new();
    let mut rest_are_values = false;
    for (i, arg) in args.into_iter().enumerate() {
        let arg: std::ffi::OsString = arg.into();
        if i == 0 || rest_are_values {
            out.push(arg);
            continue;
        }
        match arg.to_str() {
            Some("--") => {
                rest_are_values = true;
                out.push(arg);
            }
            Some(s) if s.starts_with("--") && s.contains('_') => {
                let (name, value) = match s.split_once('=') {
                    Some((n, v)) => (n, Some(v)),
                    None => (s, None),
                };
                let mut fixed = name.replace('_', "-");
                if let Some(v) = value {
                    fixed.push('=');
                    fixed.push_str(v);
                }
                out.push(fixed.into());
            }
            _ => out.push(arg),
        }
    }
    out
}

/// One `pattern=N` of `--vmodule`.
fn parse_vmodule(s: &str) -> Result<(String, u32), String> {
    let (pattern, level) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not pattern=N"))?;
    let level = level
        .trim()
        .parse::<u32>()
        .map_err(|_| format!("{level:?} is not a verbosity level"))?;
    Ok((pattern.trim().to_owned(), level))
}

/// A Kubernetes resource quantity (`0`, `512Ki`, `1Mi`, `1e3`, `1.5G`), checked for shape only.
fn parse_quantity(s: &str) -> Result<String, String> {
    let t = s.trim();
    let number_end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
        .unwrap_or(t.len());
    let (number, suffix) = t.split_at(number_end);
    let suffix_ok = matches!(
        suffix,
        "" | "Ki"
            | "Mi"
            | "Gi"
            | "Ti"
            | "Pi"
            | "Ei"
            | "n"
            | "u"
            | "m"
            | "k"
            | "M"
            | "G"
            | "T"
            | "P"
            | "E"
    ) || (suffix.starts_with(['e', 'E']) && suffix[1..].parse::<i32>().is_ok());
    if number.parse::<f64>().is_ok() && suffix_ok {
        Ok(t.to_owned())
    } else {
        Err(format!("{s:?} is not a quantity (e.g. 0, 64Ki, 1Mi)"))
    }
}

fn parse_proxy_mode(s: &str) -> Result<String, String> {
    s.parse::<ProxyMode>().map(|_| s.to_owned())
}

fn parse_detect_local_mode(s: &str) -> Result<String, String> {
    if s.is_empty() || LocalMode::NAMES.contains(&s) {
        Ok(s.to_owned())
    } else {
        Err(format!("must be one of {}", LocalMode::NAMES.join(", ")))
    }
}

/// Upstream's `IPPortVar`: empty (disable), a bare IP (gets the default port), or `ip:port`.
fn parse_bind_address_flag(s: &str, default_port: u16) -> Result<String, String> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(String::new());
    }
    if s.parse::<IpAddr>().is_ok() {
        return Ok(append_port_if_needed(s, default_port));
    }
    match s.parse::<SocketAddr>() {
        Ok(addr) if addr.port() != 0 => Ok(addr.to_string()),
        Ok(_) => Err("port must be in 1-65535".to_owned()),
        Err(_) => Err("expected an IP address, optionally with :port".to_owned()),
    }
}

fn parse_healthz_address(s: &str) -> Result<String, String> {
    parse_bind_address_flag(s, PROXY_HEALTHZ_PORT)
}

fn parse_metrics_address(s: &str) -> Result<String, String> {
    parse_bind_address_flag(s, PROXY_STATUS_PORT)
}

fn parse_cluster_cidr(s: &str) -> Result<String, String> {
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        part.parse::<IpNet>()
            .map_err(|_| format!("{part:?} is not a CIDR (e.g. 10.244.0.0/16)"))?;
    }
    Ok(s.to_owned())
}

fn parse_service_cidr(s: &str) -> Result<String, String> {
    let s = s.trim();
    if s.is_empty() || s.parse::<IpNet>().is_ok() {
        Ok(s.to_owned())
    } else {
        Err(format!("{s:?} is not a CIDR (e.g. 10.96.0.0/12)"))
    }
}

fn parse_node_port_address(s: &str) -> Result<String, String> {
    let s = s.trim();
    if s.is_empty() || s == NODE_PORT_ADDRESSES_PRIMARY || s.parse::<IpNet>().is_ok() {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "{s:?} is neither a CIDR (e.g. 192.168.0.0/24) nor 'primary'"
        ))
    }
}

fn parse_port_range_flag(s: &str) -> Result<String, String> {
    super::parse_port_range(s).map(|_| s.to_owned())
}

/// One `key=bool` of `--feature-gates`, with Go's `strconv.ParseBool` spellings.
fn parse_feature_gate(s: &str) -> Result<(String, bool), String> {
    let (key, value) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not key=true|false"))?;
    let key = key.trim();
    if key.is_empty() {
        return Err(format!("{s:?} has an empty feature name"));
    }
    let enabled = match value.trim() {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => true,
        "0" | "f" | "F" | "false" | "FALSE" | "False" => false,
        other => return Err(format!("{other:?} is not true or false")),
    };
    Ok((key.to_owned(), enabled))
}
