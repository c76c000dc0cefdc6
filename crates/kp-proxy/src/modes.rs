//! The mode registry: every dataplane mode kube-proxy-rs can run, in one list.
//!
//! Each entry names the mode, builds its dataplane from the configuration, removes what the
//! mode leaves in the kernel, and says what the mode needs from the sync loop. `--cleanup`,
//! the start-up removal of other modes' leftovers, the benchmark harness and the test
//! runners all iterate [`MODES`]; a new mode is one entry here plus its crates.

use std::sync::Arc;

use ipnet::IpNet;
use kp_core::dataplane::{Dataplane, DataplaneError};
use kp_core::model::IpFamily;
use kp_iptables::{IptablesCommand, IptablesConfig, IptablesDataplane};
use kp_metrics::Metrics;
use kp_nftables::{DetectLocal, NftCommand, NftablesConfig, NftablesDataplane, NodePortAddresses};
use kp_userspace::{UserspaceConfig, UserspaceDataplane};
use kp_userspace_plan::{BalancerConfig, Scheduler};

use crate::config::{Config, LocalMode, NodePortAddress, ProxyMode};
use crate::Fatal;

mod ebpf;
mod ipvs;
pub use ebpf::ebpf_settings;
pub use ipvs::ipvs_settings;

/// What building or cleaning up a mode works from.
pub struct ModeContext<'a> {
    /// The resolved configuration.
    pub config: &'a Config,
    /// The network namespace to program, when not the process's own (tests and benchmarks
    /// program namespaces they created; the proxy itself programs its node's).
    pub netns: Option<&'a str>,
    /// Where the mode counts its failures and sizes.
    pub metrics: Arc<Metrics>,
}

impl<'a> ModeContext<'a> {
    /// The process's own namespace, as the proxy runs.
    pub fn new(config: &'a Config, metrics: Arc<Metrics>) -> Self {
        ModeContext {
            config,
            netns: None,
            metrics,
        }
    }
}

/// One dataplane mode.
pub struct Mode {
    /// The mode (`--proxy-mode`).
    pub mode: ProxyMode,
    /// Builds a dataplane that has programmed nothing yet. Called after every other mode's
    /// leftovers are gone, so a mode that reads the kernel ahead (to adopt a restart's state)
    /// reads what will stay.
    pub build: fn(&ModeContext<'_>) -> Result<Box<dyn Dataplane>, Fatal>,
    /// Removes everything the mode may have left in the kernel, and nothing else.
    pub remove_leftovers: fn(&ModeContext<'_>) -> Result<(), DataplaneError>,
    /// What [`Mode::remove_leftovers`] removes, for logs.
    pub leftovers: &'static str,
    /// Whether stale UDP/SCTP conntrack entries towards gone endpoints are this mode's to
    /// delete after each sync. True for modes that translate in netfilter; a userspace proxy's
    /// REDIRECT entries point at the proxy itself and must not be taken for stale.
    pub reconciles_conntrack: bool,
}

impl Mode {
    /// Upstream's name for the mode.
    pub fn name(&self) -> &'static str {
        self.mode.as_str()
    }
}

/// Every mode kube-proxy-rs implements.
pub static MODES: &[Mode] = &[
    Mode {
        mode: ProxyMode::Nftables,
        build: build_nftables,
        remove_leftovers: remove_nftables,
        leftovers: "the kube-proxy nftables tables",
        reconciles_conntrack: true,
    },
    Mode {
        mode: ProxyMode::Iptables,
        build: build_iptables,
        remove_leftovers: remove_iptables,
        leftovers: "the kube-proxy iptables chains (nft and legacy backends)",
        reconciles_conntrack: true,
    },
    Mode {
        mode: ProxyMode::Userspace,
        build: build_userspace,
        remove_leftovers: remove_userspace,
        leftovers: "the kube-proxy-userspace nftables table and its policy routing",
        // Its UDP entries are REDIRECTs to the proxy itself, never stale.
        reconciles_conntrack: false,
    },
    Mode {
        mode: ProxyMode::Ipvs,
        build: ipvs::build,
        remove_leftovers: ipvs::remove,
        leftovers: "the kube-proxy IPVS virtual servers, kube-ipvs0, the ipvs-mode ipsets and iptables chains",
        reconciles_conntrack: true,
    },
    Mode {
        mode: ProxyMode::Ebpf,
        build: ebpf::build_ebpf,
        remove_leftovers: ebpf::remove_ebpf,
        leftovers: "the ebpf mode's pinned programs and maps (--bpf-pin-dir)",
        // Socket load balancing translates no packet: no conntrack entry is its.
        reconciles_conntrack: false,
    },
];

/// The entry for `mode`, if kube-proxy-rs implements it.
pub fn find(mode: ProxyMode) -> Option<&'static Mode> {
    MODES.iter().find(|m| m.mode == mode)
}

/// The entry for `mode`, or the configuration error an operator sees when it is not built.
pub fn require(mode: ProxyMode) -> Result<&'static Mode, Fatal> {
    find(mode).ok_or_else(|| {
        let built: Vec<&str> = MODES.iter().map(Mode::name).collect();
        Fatal::Config(format!(
            "proxy mode {:?} is not implemented in kube-proxy-rs yet; run with --proxy-mode {} \
             (an empty mode means iptables, as upstream)",
            mode.as_str(),
            built.join(" or ")
        ))
    })
}

/// The mode that runs when the configured one cannot run on this node, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fallback {
    /// The configured mode.
    pub from: ProxyMode,
    /// The mode that runs instead.
    pub to: ProxyMode,
    /// What the start-up probe found.
    pub why: String,
}

/// Probes, once at start, whether the configured mode can run on this node, as older upstream
/// releases did before choosing a proxier: `iptables` that cannot (the tools do not run, the
/// kernel has no `nat` table, or no `route_localnet` sysctl, upstream's kernel check) falls
/// back to `userspace`; `ipvs` that cannot (no IPVS in the kernel, no `ipset` tool) falls
/// back to `iptables`, or to `userspace` if iptables cannot run either. Every other mode runs
/// as configured (or fails at build).
pub fn fallback(ctx: &ModeContext<'_>) -> Option<Fallback> {
    match ctx.config.mode {
        ProxyMode::Iptables => iptables_unusable(ctx).map(|why| Fallback {
            from: ProxyMode::Iptables,
            to: ProxyMode::Userspace,
            why,
        }),
        ProxyMode::Ipvs => ipvs::unusable(ctx).map(|why| match iptables_unusable(ctx) {
            None => Fallback {
                from: ProxyMode::Ipvs,
                to: ProxyMode::Iptables,
                why,
            },
            Some(also) => Fallback {
                from: ProxyMode::Ipvs,
                to: ProxyMode::Userspace,
                why: format!("{why}; and iptables mode cannot run either: {also}"),
            },
        }),
        _ => None,
    }
}

/// Why the iptables mode cannot run here, if it cannot: the backend the mode would choose lists
/// the `nat` table's OUTPUT chain (tools present and working, kernel NAT support loaded), and,
/// in the process's own namespace, `net.ipv4.conf.all.route_localnet` exists.
fn iptables_unusable(ctx: &ModeContext<'_>) -> Option<String> {
    let cmd = ctx
        .netns
        .map_or_else(IptablesCommand::new, IptablesCommand::in_netns);
    let backend = kp_iptables::detect_backend(ctx.netns);
    if let Err(e) = cmd.run_ok(backend, IpFamily::V4, &["-t", "nat", "-S", "OUTPUT"]) {
        return Some(format!("the iptables tools do not work here ({e})"));
    }
    let route_localnet = std::path::Path::new("/proc/sys/net/ipv4/conf/all/route_localnet");
    if ctx.netns.is_none() && !route_localnet.exists() {
        return Some(format!(
            "the kernel has no {} (upstream's kernel check)",
            route_localnet.display()
        ));
    }
    None
}

/// Removes the leftovers of every mode except `keep` (all of them for `--cleanup`). Returns
/// the failures, each with the mode's name; the caller decides whether they are fatal.
pub fn remove_leftovers(
    ctx: &ModeContext<'_>,
    keep: Option<ProxyMode>,
) -> Vec<(&'static str, DataplaneError)> {
    let mut failed = Vec::new();
    for m in MODES.iter().filter(|m| Some(m.mode) != keep) {
        match (m.remove_leftovers)(ctx) {
            Ok(()) => tracing::debug!(mode = m.name(), "removed {}", m.leftovers),
            Err(e) => failed.push((m.name(), e)),
        }
    }
    failed
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
pub fn nftables_config(cfg: &Config) -> Result<NftablesConfig, Fatal> {
    Ok(NftablesConfig {
        families: IpFamily::ALL.to_vec(),
        masquerade_bit: u32::from(cfg.masquerade_bit),
        masquerade_all: cfg.masquerade_all,
        detect_local: detect_local(cfg)?,
        node_ports: node_port_addresses(cfg),
    })
}

/// The iptables mode's settings, from the configuration and the iptables backend the node
/// (or `netns`) uses.
pub fn iptables_config(cfg: &Config, netns: Option<&str>) -> Result<IptablesConfig, Fatal> {
    Ok(IptablesConfig {
        families: IpFamily::ALL.to_vec(),
        masquerade_bit: u32::from(cfg.masquerade_bit),
        masquerade_all: cfg.masquerade_all,
        localhost_node_ports: cfg.localhost_nodeports,
        detect_local: detect_local(cfg)?,
        node_ports: node_port_addresses(cfg),
        backend: kp_iptables::detect_backend(netns),
        // Restore step size and read-back budget: the crate's measured defaults.
        ..IptablesConfig::default()
    })
}

fn nft_command(ctx: &ModeContext<'_>) -> NftCommand {
    ctx.netns.map_or_else(NftCommand::new, NftCommand::in_netns)
}

fn build_nftables(ctx: &ModeContext<'_>) -> Result<Box<dyn Dataplane>, Fatal> {
    let mut dataplane = NftablesDataplane::new(
        nftables_config(ctx.config)?,
        nft_command(ctx),
        ctx.metrics.clone(),
    );
    // A restart adopts the table it finds; read it while the initial lists run.
    dataplane.read_ahead();
    Ok(Box::new(dataplane))
}

fn remove_nftables(ctx: &ModeContext<'_>) -> Result<(), DataplaneError> {
    // The table's settings do not matter for removing it.
    let mut nft = NftablesDataplane::new(
        NftablesConfig::default(),
        nft_command(ctx),
        ctx.metrics.clone(),
    );
    nft.cleanup().map_err(kp_nftables::Error::into_dataplane)
}

fn build_iptables(ctx: &ModeContext<'_>) -> Result<Box<dyn Dataplane>, Fatal> {
    let cfg = iptables_config(ctx.config, ctx.netns)?;
    tracing::info!(backend = cfg.backend.as_str(), "iptables backend");
    let cmd = ctx
        .netns
        .map_or_else(IptablesCommand::new, IptablesCommand::in_netns);
    Ok(Box::new(IptablesDataplane::new(
        cfg,
        cmd,
        ctx.metrics.clone(),
    )))
}

/// The userspace mode's settings, from the configuration: the scheduler is `ipvs.scheduler`
/// (`--ipvs-scheduler`), shared with ipvs mode, of which this mode supports rr, lc, sh, dh,
/// sed and nq.
pub fn userspace_config(cfg: &Config) -> Result<UserspaceConfig, Fatal> {
    let scheduler: Scheduler =
        cfg.ipvs.scheduler.parse().map_err(|e: String| {
            Fatal::Config(format!("ipvs.scheduler (--ipvs-scheduler): {e}"))
        })?;
    let defaults = UserspaceConfig::default();
    Ok(UserspaceConfig {
        balancer: BalancerConfig {
            scheduler,
            masquerade_all: cfg.masquerade_all,
            detect_local: detect_local(cfg)?,
            ..defaults.balancer
        },
        node_ports: node_port_addresses(cfg),
        port_range: cfg.port_range.clone(),
        udp_timeout: cfg.udp_idle_timeout,
        ..defaults
    })
}

fn build_userspace(ctx: &ModeContext<'_>) -> Result<Box<dyn Dataplane>, Fatal> {
    Ok(Box::new(UserspaceDataplane::new(
        userspace_config(ctx.config)?,
        ctx.netns,
        ctx.metrics.clone(),
    )))
}

fn remove_userspace(ctx: &ModeContext<'_>) -> Result<(), DataplaneError> {
    // Its settings do not matter for removing what it installs.
    UserspaceDataplane::new(UserspaceConfig::default(), ctx.netns, ctx.metrics.clone())
        .cleanup()
        .map_err(kp_userspace::Error::into_dataplane)
}

fn remove_iptables(ctx: &ModeContext<'_>) -> Result<(), DataplaneError> {
    kp_iptables::cleanup_all(ctx.netns).map_err(kp_iptables::Error::into_dataplane)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_mode_is_listed_once() {
        for m in MODES {
            assert_eq!(
                MODES.iter().filter(|o| o.mode == m.mode).count(),
                1,
                "{}",
                m.name()
            );
            assert!(find(m.mode).is_some());
        }
    }

    #[test]
    fn the_userspace_mode_takes_the_ipvs_scheduler_and_names_the_ones_it_supports() {
        let mut cfg = crate::config::load(["kube-proxy", "--proxy-mode", "userspace"])
            .expect("config")
            .config;
        cfg.ipvs.scheduler = "lc".into();
        let us = userspace_config(&cfg).expect("lc is supported");
        assert_eq!(us.balancer.scheduler, Scheduler::LeastConnection);
        // wrr is an IPVS scheduler the userspace mode does not have.
        cfg.ipvs.scheduler = "wrr".into();
        match userspace_config(&cfg) {
            Err(Fatal::Config(msg)) => {
                for name in ["rr", "lc", "sh", "dh", "sed", "nq"] {
                    assert!(msg.contains(name), "{msg}");
                }
                assert!(msg.contains("ipvs.scheduler"), "{msg}");
            }
            Err(other) => panic!("not a configuration error: {other}"),
            Ok(_) => panic!("wrr accepted"),
        }
    }

    #[test]
    fn a_mode_not_built_yet_is_a_configuration_error_naming_the_built_ones() {
        let missing = ProxyMode::ALL.into_iter().find(|m| find(*m).is_none());
        let Some(missing) = missing else {
            return; // every mode is built
        };
        match require(missing) {
            Err(Fatal::Config(msg)) => {
                for m in MODES {
                    assert!(msg.contains(m.name()), "{msg}");
                }
            }
            Err(other) => panic!("not a configuration error: {other}"),
            Ok(_) => panic!("{missing:?} is not built"),
        }
    }
}
