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
#[command(name = "kube-proxy", version)]
pub(crate) struct Flags {
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
    /// 'userspace' or 'ebpf'. 'iptables', 'nftables' and 'userspace' are implemented so far;
    /// 'iptables' runs 'userspace' instead, with a warning, where the node cannot run iptables.
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
    /// userspace mode may listen on; empty, 0 or 0-0 picks ports at random. No effect in other
    /// modes.
    #[arg(long, value_name = "RANGE", value_parser = parse_port_range_flag)]
    pub proxy_port_range: Option<String>,

    /// How long an idle UDP session stays open in userspace mode (e.g. '250ms'). No effect in
    /// other modes. [default: 250ms]
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub udp_timeout: Option<GoDuration>,

    /// ebpf mode (not an upstream flag): the cgroup v2 directory the socket load balancer's
    /// hooks attach to. Unset: the root of the cgroup v2 hierarchy (found in
    /// /proc/self/mountinfo), which covers every process of the node and its pods.
    #[arg(long, value_name = "DIR")]
    pub bpf_cgroup_root: Option<PathBuf>,

    /// ebpf mode (not an upstream flag): the bpffs directory its maps are pinned in, so that a
    /// restarted proxy adopts them. [default: /sys/fs/bpf/kube-proxy-rs]
    #[arg(long, value_name = "DIR")]
    pub bpf_pin_dir: Option<PathBuf>,

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
