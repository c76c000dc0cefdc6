//! Configuration of the `kube-proxy` binary: flags, the `KubeProxyConfiguration` file, and
//! the resolved [`Config`] that `main` runs with.
//!
//! Mirrors upstream `cmd/kube-proxy/app/options.go` (flags, loading),
//! `pkg/proxy/apis/config/v1alpha1/defaults.go` (defaults) and
//! `pkg/proxy/apis/config/validation/validation.go` (rules), with these differences:
//!
//! - Flags given on the command line override the config file. Upstream ignores most flags
//!   when `--config` is given (only `--hostname-override` and logging flags still apply).
//! - Unknown fields in the file are an error naming the field. Upstream retries with a lenient
//!   decoder and only logs a warning.
//! - Unknown feature gates are accepted (and reported in [`Loaded::warnings`]); upstream
//!   rejects them. None of them changes our behaviour.
//! - `udpIdleTimeout`, `--udp-timeout` and `--proxy-port-range` date from before 1.26, when
//!   upstream removed the userspace mode; we keep them for our userspace mode, and give
//!   `portRange` (still accepted but unused upstream) its old meaning.
//! - `nodePortAddresses` takes CIDRs or `primary` alone, as 1.29–1.35; the newest upstream's
//!   `localhost` and `all` keywords are not accepted yet.
//! - Modes `userspace` and `ebpf` are accepted in addition to `iptables`, `ipvs` and
//!   `nftables`.
//!
//! Loading reads the config file and nothing else of the environment; [`load_with`] takes the
//! file reader as an argument so tests never touch the file system.

// `main` is still being written and does not read every setting yet; remove this once it
// consumes `Loaded`, so that unread settings show up again.
#![allow(
    dead_code,
    reason = "ipvs, conntrack and userspace settings are read by modes not built yet"
)]

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use ipnet::IpNet;

pub mod duration;
mod error;
mod flags;
mod resolve;
pub mod types;

#[cfg(test)]
mod tests;

pub use duration::GoDuration;
pub use error::{ConfigError, FieldError};
pub use types::{KubeProxyConfiguration, API_VERSION, KIND};

/// The proxy mode (`mode`, `--proxy-mode`). An empty value means [`ProxyMode::Iptables`], as
/// upstream on Linux.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProxyMode {
    /// Upstream's default: iptables-restore of nat and filter chains.
    Iptables,
    /// IPVS virtual servers, with iptables and ipsets around them.
    Ipvs,
    /// nftables, in one `kube-proxy` table per family.
    Nftables,
    /// The original proxy that relays connections itself (removed upstream in 1.26).
    Userspace,
    /// Our eBPF socket-level load balancing (not an upstream mode).
    Ebpf,
}

impl ProxyMode {
    /// Every mode, in the order help texts list them.
    pub const ALL: [ProxyMode; 5] = [
        ProxyMode::Iptables,
        ProxyMode::Ipvs,
        ProxyMode::Nftables,
        ProxyMode::Userspace,
        ProxyMode::Ebpf,
    ];

    /// The name used in the config file, on the command line and at `/proxyMode`.
    pub fn as_str(self) -> &'static str {
        match self {
            ProxyMode::Iptables => "iptables",
            ProxyMode::Ipvs => "ipvs",
            ProxyMode::Nftables => "nftables",
            ProxyMode::Userspace => "userspace",
            ProxyMode::Ebpf => "ebpf",
        }
    }
}

impl fmt::Display for ProxyMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ProxyMode {
    type Err = String;

    /// Accepts the empty string as `iptables`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() {
            return Ok(ProxyMode::Iptables);
        }
        ProxyMode::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| {
                let names: Vec<_> = ProxyMode::ALL.iter().map(|m| m.as_str()).collect();
                format!(
                    "must be one of {}, or blank (blank means iptables)",
                    names.join(", ")
                )
            })
    }
}

/// How to tell traffic from local pods apart from the rest (`detectLocalMode`), which decides
/// what is masqueraded on its way to a ClusterIP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LocalMode {
    /// Sources in [`Config::cluster_cidrs`] are local. With no cluster CIDR, nothing is
    /// (upstream installs a no-op detector then).
    ClusterCIDR,
    /// Sources in this Node's `spec.podCIDRs` are local; `main` learns them from the Node.
    NodeCIDR,
    /// Traffic arriving on this bridge interface is local.
    BridgeInterface(String),
    /// Traffic arriving on any interface whose name starts with this prefix is local.
    InterfaceNamePrefix(String),
}

impl LocalMode {
    /// The spellings of `detectLocalMode`, as upstream.
    pub const NAMES: [&'static str; 4] = [
        "ClusterCIDR",
        "NodeCIDR",
        "BridgeInterface",
        "InterfaceNamePrefix",
    ];
}

/// One entry of `nodePortAddresses`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodePortAddress {
    /// The node's primary IPv4 and/or IPv6 address, per the Node object. Upstream allows it
    /// only as the sole entry.
    Primary,
    /// Node IPs inside this range (host bits cleared) accept NodePort connections.
    Cidr(IpNet),
}

/// Settings of the ipvs mode, resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ipvs {
    /// The scheduler; an empty setting resolves to `rr`.
    pub scheduler: String,
    /// Ranges whose IPVS virtual servers cleanup leaves alone.
    pub exclude_cidrs: Vec<IpNet>,
    /// Set arp_ignore=1 and arp_announce=2.
    pub strict_arp: bool,
    /// IPVS TCP idle timeout; `None` leaves the kernel's value.
    pub tcp_timeout: Option<Duration>,
    /// IPVS TCP FIN timeout; `None` leaves the kernel's value.
    pub tcp_fin_timeout: Option<Duration>,
    /// IPVS UDP timeout; `None` leaves the kernel's value.
    pub udp_timeout: Option<Duration>,
}

/// Settings of the ebpf mode, resolved (our addition): its map sizes, in entries, each
/// greater than 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ebpf {
    /// `kp_services`: frontends plus backend slots.
    pub services_map_max: u32,
    /// `kp_backends`: distinct endpoints.
    pub backends_map_max: u32,
    /// `kp_affinity` (LRU).
    pub affinity_map_max: u32,
    /// `kp_ct` and `kp_sk_rev` (LRU).
    pub conntrack_map_max: u32,
}

/// Conntrack sysctls, resolved. `None` (upstream: zero) means "leave the kernel's value".
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conntrack {
    /// nf_conntrack_max per CPU core; 0 leaves nf_conntrack_max alone and ignores `min`.
    pub max_per_core: u32,
    /// Lower bound for nf_conntrack_max.
    pub min: u32,
    /// nf_conntrack_tcp_timeout_established.
    pub tcp_established_timeout: Option<Duration>,
    /// nf_conntrack_tcp_timeout_close_wait.
    pub tcp_close_wait_timeout: Option<Duration>,
    /// nf_conntrack_tcp_be_liberal=1.
    pub tcp_be_liberal: bool,
    /// nf_conntrack_udp_timeout (UNREPLIED entries).
    pub udp_timeout: Option<Duration>,
    /// nf_conntrack_udp_timeout_stream (ASSURED entries).
    pub udp_stream_timeout: Option<Duration>,
}

/// How long a stopping userspace proxy may drain unless `--userspace-drain-timeout` says
/// otherwise: a third of a pod's default terminationGracePeriodSeconds (30 s), so it exits
/// well before the kubelet's SIGKILL.
pub const DEFAULT_USERSPACE_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// How long, unless `--bpf-handover-idle` says otherwise, the ebpf mode's tc programs carry the
/// connections they made from outside after another mode took over, counted from their last
/// packet: a minute, so that an interactive session's pauses and keep-alives of 30 s or more
/// (HTTP/1.1 clients, gRPC pings) are carried while the programs go soon after the traffic.
pub const DEFAULT_BPF_HANDOVER_IDLE: Duration = Duration::from_secs(60);

/// Where the ebpf mode pins its maps unless `--bpf-pin-dir` says otherwise.
pub const DEFAULT_BPF_PIN_DIR: &str = "/sys/fs/bpf/kube-proxy-rs";

/// The resolved configuration `main` runs with. Every value here has been validated.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// The proxy mode. `main` refuses the modes it cannot run.
    pub mode: ProxyMode,
    /// The `--config` file, if any (upstream exits when it changes).
    pub config_file: Option<PathBuf>,
    /// `clientConnection.kubeconfig` / `--kubeconfig`; `None` means in-cluster or default
    /// kubeconfig discovery, as `main` decides.
    pub kubeconfig: Option<PathBuf>,
    /// `--master`: overrides the API server address of the kubeconfig.
    pub master: Option<String>,
    /// `--manifests`: standalone mode, reading manifests from this directory instead of an
    /// API server.
    pub manifests_dir: Option<PathBuf>,
    /// The Node name (trimmed and lowercased `hostnameOverride`); `None` means "the host
    /// name", which `main` looks up (and lowercases).
    pub hostname: Option<String>,
    /// `bindAddress`: the node's primary IP override; unspecified (`0.0.0.0` / `::`) means
    /// "take it from the Node object".
    pub bind_address: IpAddr,
    /// Where the proxy health server listens (`/healthz`, `/livez`); `None` disables it.
    pub healthz_bind_address: Option<SocketAddr>,
    /// Where the metrics server listens (`/metrics`, `/proxyMode`, `/configz`); `None`
    /// disables it.
    pub metrics_bind_address: Option<SocketAddr>,
    /// Exit when the healthz or metrics port cannot be bound.
    pub bind_address_hard_fail: bool,
    /// `clusterCIDR`: zero, one, or a dual-stack pair of pod ranges (host bits cleared).
    pub cluster_cidrs: Vec<IpNet>,
    /// How local traffic is recognised.
    pub detect_local_mode: LocalMode,
    /// Where NodePorts answer. Empty means every local IP.
    pub node_port_addresses: Vec<NodePortAddress>,
    /// `serviceCIDRs` (our addition): Service ranges known without ServiceCIDR objects.
    pub service_cidrs: Vec<IpNet>,
    /// The masquerade mark is `1 << masquerade_bit`; from `nftables.masqueradeBit` in nftables
    /// mode and `iptables.masqueradeBit` otherwise, as upstream. Always in 0..=31.
    pub masquerade_bit: u8,
    /// Masquerade all ClusterIP traffic; from the section of the active mode.
    pub masquerade_all: bool,
    /// Longest time between syncs, from the section of the active mode (`nftables`, `ipvs`,
    /// otherwise `iptables`), as upstream. Greater than zero.
    pub sync_period: Duration,
    /// Shortest time between syncs, from the same section; at most `sync_period`, may be 0.
    pub min_sync_period: Duration,
    /// How often informers re-list. Greater than zero.
    pub config_sync_period: Duration,
    /// `iptables.localhostNodePorts`: upstream honours it only in iptables mode, for IPv4.
    pub localhost_nodeports: bool,
    /// Settings of the ipvs mode.
    pub ipvs: Ipvs,
    /// Conntrack sysctls.
    pub conntrack: Conntrack,
    /// Settings of the ebpf mode (`ebpf`, `--bpf-*-map-max`).
    pub ebpf: Ebpf,
    /// Host ports the userspace mode may listen on; `None` picks them at random.
    pub port_range: Option<RangeInclusive<u16>>,
    /// Idle timeout of userspace-mode UDP sessions. Greater than zero.
    pub udp_idle_timeout: Duration,
    /// `--userspace-drain-timeout` (userspace mode; our addition): the longest a stopping
    /// userspace proxy serves on while its redirect rules reach it, and lets its relays finish
    /// after another proxy took over. Zero stops at once.
    pub userspace_drain_timeout: Duration,
    /// `--bpf-handover-idle` (our addition, read by the mode taking over from ebpf): how long
    /// the ebpf mode's tc programs stay to carry connections they made from outside, counted
    /// from the last packet of any. Zero removes them at once.
    pub bpf_handover_idle: Duration,
    /// `--bpf-cgroup-root` (ebpf mode; our addition): the cgroup v2 directory the socket hooks
    /// attach to. `None`: the root of the cgroup v2 hierarchy, found in /proc/self/mountinfo at
    /// start, so every process of the node and its pods is covered.
    pub bpf_cgroup_root: Option<PathBuf>,
    /// `--bpf-pin-dir` (ebpf mode; our addition): the bpffs directory its maps are pinned in,
    /// so a restarted proxy adopts them. [`DEFAULT_BPF_PIN_DIR`] unless given.
    pub bpf_pin_dir: PathBuf,
    /// oom_score_adj for this process, in [-1000, 1000].
    pub oom_score_adj: i32,
    /// Feature gates as given; none changes behaviour yet.
    pub feature_gates: BTreeMap<String, bool>,
    /// `--cleanup`: remove every mode's rules and exit.
    pub cleanup: bool,
    /// `--write-config-to`: write [`Loaded::effective`] there with [`to_yaml`] and exit.
    pub write_config_to: Option<PathBuf>,
    /// Log verbosity (`-v`, else `logging.verbosity`), saturated at 255.
    pub verbosity: u8,
    /// Log format (`--logging-format`, else `logging.format`).
    pub logging_format: LogFormat,
    /// `--init-only`: apply the privileged start-up settings (sysctls, conntrack) and exit.
    pub init_only: bool,
}

/// The log format (`logging.format`, `--logging-format`), as upstream's component-base.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// klog-like text lines (the default).
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// What [`load`] produces.
#[derive(Clone, Debug, PartialEq)]
pub struct Loaded {
    /// The resolved configuration.
    pub config: Config,
    /// The full effective `KubeProxyConfiguration` (defaults, file, flags, platform defaults),
    /// for `/configz` and `--write-config-to`.
    pub effective: KubeProxyConfiguration,
    /// Settings that were accepted but have no effect here; `main` logs each at start.
    pub warnings: Vec<String>,
}

/// Parses the command line (`args` includes the program name, as [`std::env::args_os`]),
/// reads the `--config` file if one is named, and resolves the configuration.
///
/// On error, `main` should call [`ConfigError::print`] and exit with
/// [`ConfigError::exit_code`] (64 for a bad configuration, 0 for `--help`).
pub fn load<I, T>(args: I) -> Result<Loaded, ConfigError>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    load_with(args, |path| std::fs::read_to_string(path))
}

/// [`load`] with the config file read by `read_file`, so tests need no file system.
pub fn load_with<I, T, R>(args: I, read_file: R) -> Result<Loaded, ConfigError>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
    R: FnOnce(&Path) -> std::io::Result<String>,
{
    let flags = flags::parse(args)?;
    let file = match &flags.config {
        Some(path) => {
            let text = read_file(path).map_err(|source| ConfigError::Read {
                path: path.clone(),
                source,
            })?;
            Some(parse_config(path, &text)?)
        }
        None => None,
    };
    resolve::resolve(flags, file)
}

/// Parses a `KubeProxyConfiguration` document, checking `apiVersion` and `kind` but applying
/// no defaults. `path` is only used in error messages.
pub fn parse_config(path: &Path, text: &str) -> Result<KubeProxyConfiguration, ConfigError> {
    let doc: KubeProxyConfiguration =
        serde_saphyr::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
    for (field, found, expected) in [
        ("apiVersion", &doc.api_version, API_VERSION),
        ("kind", &doc.kind, KIND),
    ] {
        if found != expected {
            return Err(ConfigError::TypeMeta {
                path: path.to_owned(),
                field,
                found: found.clone(),
                expected,
            });
        }
    }
    Ok(doc)
}

/// Renders a configuration as YAML for `--write-config-to`. The output reads back through
/// [`parse_config`] to an equal value (after defaults, which it already carries).
pub fn to_yaml(config: &KubeProxyConfiguration) -> Result<String, ConfigError> {
    serde_saphyr::to_string(config).map_err(|e| ConfigError::Serialize(e.to_string()))
}

/// Parses `portRange` / `--proxy-port-range` (upstream's `utilnet.ParsePortRange`):
/// `begin-end`, `begin+offset` or a single port, inclusive. Empty, `0` and `0-0` mean "any
/// port" (`None`).
pub fn parse_port_range(s: &str) -> Result<Option<RangeInclusive<u16>>, String> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(None);
    }
    let port = |p: &str| {
        p.trim()
            .parse::<u16>()
            .map_err(|_| format!("{p:?} is not a port number (0-65535)"))
    };
    let (low, high) = if let Some((a, b)) = s.split_once('-') {
        (port(a)?, port(b)?)
    } else if let Some((a, b)) = s.split_once('+') {
        let low = port(a)?;
        let offset = port(b)?;
        let high = low
            .checked_add(offset)
            .ok_or_else(|| format!("{s:?} goes past port 65535"))?;
        (low, high)
    } else {
        let p = port(s)?;
        (p, p)
    };
    if high < low {
        return Err(format!("{s:?}: the end is below the start"));
    }
    if low == 0 && high == 0 {
        return Ok(None);
    }
    Ok(Some(low..=high))
}
