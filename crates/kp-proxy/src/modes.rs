//! The mode registry: every dataplane mode kube-proxy-rs can run, in one list.
//!
//! Each entry names the mode, builds its dataplane from the configuration, removes what the
//! mode leaves in the kernel, says which kernel names it uses ([`Footprint`]), and says what
//! the mode needs from the sync loop. `--cleanup`, the removal of other modes' leftovers after
//! a switch, the benchmark harness and the test runners all iterate [`MODES`]; a new mode is
//! one entry here plus its crates.
//!
//! A mode switch (a restart with another mode) drops no connection: the new mode installs its
//! rules first, while the old mode's stay in force, and the old mode's leftovers are removed
//! only after the new mode's first successful sync ([`remove_leftovers`] with the running
//! mode), leaving whatever the running mode uses by the same names (the chains the iptables
//! and ipvs modes share) and, for the ipvs mode, the virtual servers that still carry
//! connections, until those end.

use std::collections::BTreeSet;
use std::sync::Arc;

use ipnet::IpNet;
use kp_core::dataplane::{Dataplane, DataplaneError, HeldBackend};
use kp_core::model::IpFamily;
use kp_core::node::InterfaceName;
use kp_iptables::{IptablesCommand, IptablesConfig, IptablesDataplane};
use kp_metrics::Metrics;
use kp_nftables::{DetectLocal, NftCommand, NftablesConfig, NftablesDataplane, NodePortAddresses};
use kp_userspace::{UserspaceConfig, UserspaceDataplane};
use kp_userspace_plan::{BalancerConfig, Scheduler};

use crate::config::{Config, LocalMode, NodePortAddress, ProxyMode};
use crate::Fatal;

mod ebpf;
pub mod footprint;
mod ipvs;
pub use ebpf::ebpf_settings;
pub use ebpf::scheduler as ebpf_scheduler;
pub use footprint::Footprint;
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
    /// Builds a dataplane that has programmed nothing yet. Called while other modes'
    /// leftovers are still in force (they go after its first sync); a mode that reads the
    /// kernel ahead (to adopt a restart's state) reads only its own names.
    pub build: fn(&ModeContext<'_>) -> Result<Box<dyn Dataplane>, Fatal>,
    /// Removes everything the mode may have left in the kernel, and nothing else: with the
    /// running mode's [`Footprint`] (a switch), nothing that mode uses either, and state that
    /// still carries connections may stay ([`Removal::Draining`]); without one (`--cleanup`),
    /// everything at once.
    pub remove_leftovers:
        fn(&ModeContext<'_>, Option<&Footprint>) -> Result<Removal, DataplaneError>,
    /// The kernel names the mode uses that another mode's removal could also find.
    pub footprint: fn() -> Footprint,
    /// What [`Mode::remove_leftovers`] removes, for logs.
    pub leftovers: &'static str,
    /// Whether stale UDP/SCTP conntrack entries towards gone endpoints are this mode's to
    /// delete after each sync. True for modes that translate in netfilter; a userspace proxy's
    /// REDIRECT entries point at the proxy itself and must not be taken for stale.
    pub reconciles_conntrack: bool,
    /// What the mode does to take the node over from the mode before it, beside the removal
    /// of that mode's leftovers, and with it: after its first successful sync, then at each
    /// recheck while leftovers stay.
    pub take_over: Option<fn(&ModeContext<'_>) -> Result<(), DataplaneError>>,
    /// The endpoints this mode's leftovers still answer for while another mode runs
    /// ([`HeldBackend`]: IPVS's closing connections' entries), read without changing anything.
    pub held_backends:
        Option<fn(&ModeContext<'_>) -> Result<BTreeSet<HeldBackend>, DataplaneError>>,
}

/// What a removal of one mode's leftovers left.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Removal {
    /// Nothing of the mode's is left.
    Gone,
    /// Some of it stays because connections still use it; call again later.
    Draining(String),
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
        footprint: footprint::nftables,
        leftovers: "the kube-proxy nftables tables",
        reconciles_conntrack: true,
        take_over: None,
        held_backends: None,
    },
    Mode {
        mode: ProxyMode::Iptables,
        build: build_iptables,
        remove_leftovers: remove_iptables,
        footprint: footprint::iptables,
        leftovers: "the kube-proxy iptables chains (nft and legacy backends)",
        reconciles_conntrack: true,
        take_over: None,
        held_backends: None,
    },
    Mode {
        mode: ProxyMode::Userspace,
        build: build_userspace,
        remove_leftovers: remove_userspace,
        footprint: footprint::userspace,
        leftovers: "the kube-proxy-userspace nftables table and its policy routing",
        // Its UDP entries are REDIRECTs to the proxy itself, never stale.
        reconciles_conntrack: false,
        take_over: None,
        held_backends: None,
    },
    Mode {
        mode: ProxyMode::Ipvs,
        build: ipvs::build,
        remove_leftovers: ipvs::remove,
        footprint: footprint::ipvs,
        leftovers: "the kube-proxy IPVS virtual servers, kube-ipvs0, the ipvs-mode ipsets and iptables chains",
        reconciles_conntrack: true,
        take_over: None,
        held_backends: Some(ipvs::held),
    },
    Mode {
        mode: ProxyMode::Ebpf,
        build: ebpf::build_ebpf,
        remove_leftovers: remove_ebpf,
        footprint: footprint::ebpf,
        leftovers: "the ebpf mode's pinned programs and maps (--bpf-pin-dir) and its kube-proxy-ebpf nftables table",
        // Socket load balancing translates no packet: no conntrack entry is its.
        reconciles_conntrack: false,
        take_over: Some(ebpf::forget_closed_translations),
        held_backends: None,
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

/// What [`remove_leftovers`] did.
#[derive(Debug, Default)]
pub struct Leftovers {
    /// Modes whose removal failed, with why; the running mode's name when its take-over
    /// ([`Mode::take_over`]) failed.
    pub failed: Vec<(&'static str, DataplaneError)>,
    /// Modes with state left on purpose (connections still use it), with what.
    pub draining: Vec<(&'static str, String)>,
    /// The endpoints what is left still answers for ([`held_backends`]), read after the
    /// removals; `None`: it could not be read (the failure is in `failed`).
    pub held: Option<BTreeSet<HeldBackend>>,
}

impl Leftovers {
    /// Whether every other mode's state is gone.
    pub fn done(&self) -> bool {
        self.failed.is_empty() && self.draining.is_empty()
    }
}

/// Removes the leftovers of every mode except `running` (all of them, at once, for
/// `--cleanup`). With a running mode, what it uses ([`Mode::footprint`]) stays, and state
/// that still carries connections stays until they end. Call it only after the running mode's
/// first successful sync: until then the other modes' rules are what serves.
pub fn remove_leftovers(ctx: &ModeContext<'_>, running: Option<ProxyMode>) -> Leftovers {
    let running_mode = running.and_then(find);
    let keep = running_mode.map(|m| (m.footprint)());
    let mut out = Leftovers::default();
    for m in MODES.iter().filter(|m| Some(m.mode) != running) {
        match (m.remove_leftovers)(ctx, keep.as_ref()) {
            Ok(Removal::Gone) => tracing::debug!(mode = m.name(), "removed {}", m.leftovers),
            Ok(Removal::Draining(what)) => out.draining.push((m.name(), what)),
            Err(e) => out.failed.push((m.name(), e)),
        }
    }
    // What stays may still answer for some endpoints.
    out.held = match out.draining.is_empty() {
        true => Some(BTreeSet::new()),
        false => match held_backends(ctx, running) {
            Ok(held) => Some(held),
            Err((name, e)) => {
                out.failed.push((name, e));
                None
            }
        },
    };
    // After the removals: the old mode's rules translate nothing more from here on.
    if let Some(m) = running_mode {
        if let Some(take_over) = m.take_over {
            if let Err(e) = take_over(ctx) {
                out.failed.push((m.name(), e));
            }
        }
    }
    out
}

/// The endpoints that other modes' leftovers (all but `running`) still answer for
/// ([`Mode::held_backends`]), read without changing anything: before the running mode's first
/// sync, and after each removal of leftovers that keeps some. The first mode that cannot say
/// fails it.
pub fn held_backends(
    ctx: &ModeContext<'_>,
    running: Option<ProxyMode>,
) -> Result<BTreeSet<HeldBackend>, (&'static str, DataplaneError)> {
    let mut out = BTreeSet::new();
    for m in MODES.iter().filter(|m| Some(m.mode) != running) {
        if let Some(held) = m.held_backends {
            out.extend(held(ctx).map_err(|e| (m.name(), e))?);
        }
    }
    Ok(out)
}

/// detect-local, as the kernel modes interpret it.
fn detect_local(cfg: &Config) -> Result<DetectLocal, Fatal> {
    match &cfg.detect_local_mode {
        LocalMode::ClusterCIDR if cfg.cluster_cidrs.is_empty() => Ok(DetectLocal::None),
        LocalMode::ClusterCIDR => Ok(DetectLocal::ClusterCidr(cfg.cluster_cidrs.clone())),
        LocalMode::NodeCIDR => Ok(DetectLocal::NodeCidr),
        LocalMode::BridgeInterface(name) => Ok(DetectLocal::BridgeInterface(interface_name(
            "detectLocal.bridgeInterface",
            name,
        )?)),
        LocalMode::InterfaceNamePrefix(prefix) => Ok(DetectLocal::InterfaceNamePrefix(
            interface_name("detectLocal.interfaceNamePrefix", prefix)?,
        )),
    }
}

/// The configuration validated the name already; a name that still fails is refused here
/// rather than written into rules.
fn interface_name(field: &str, name: &str) -> Result<InterfaceName, Fatal> {
    InterfaceName::new(name).map_err(|e| Fatal::Config(format!("{field} {name:?}: {e}")))
}

/// `nodePortAddresses`, as the kernel modes interpret it (also what `kube-proxy status` plans
/// ebpf mode's maps with).
pub fn node_port_addresses(cfg: &Config) -> NodePortAddresses {
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

fn remove_nftables(
    ctx: &ModeContext<'_>,
    _running: Option<&Footprint>,
) -> Result<Removal, DataplaneError> {
    // The table's settings do not matter for removing it.
    let mut nft = NftablesDataplane::new(
        NftablesConfig::default(),
        nft_command(ctx),
        ctx.metrics.clone(),
    );
    nft.cleanup().map_err(kp_nftables::Error::into_dataplane)?;
    Ok(Removal::Gone)
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
        drain: cfg.userspace_drain_timeout,
        // The binary handles SIGTERM and SIGINT already: a second one ends the drain.
        signal_ends_drain: true,
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

fn remove_userspace(
    ctx: &ModeContext<'_>,
    running: Option<&Footprint>,
) -> Result<Removal, DataplaneError> {
    // Its settings do not matter for removing what it installs.
    if running.is_none() {
        // --cleanup: everything at once.
        UserspaceDataplane::new(UserspaceConfig::default(), ctx.netns, ctx.metrics.clone())
            .cleanup()
            .map_err(kp_userspace::Error::into_dataplane)?;
        return Ok(Removal::Gone);
    }
    // A switch: the return path of a stopping userspace proxy's open relays stays until they
    // end (that proxy removes it at its exit; a later call once none is open).
    let nft = nft_command(ctx);
    let removed = kp_userspace::leftovers::remove(&nft, &kp_userspace::routing::DEFAULT, ctx.netns)
        .map_err(kp_userspace::Error::into_dataplane)?;
    Ok(match removed {
        kp_userspace::leftovers::Removed::Gone => Removal::Gone,
        kp_userspace::leftovers::Removed::ReturnPathKept { port, relays } => {
            Removal::Draining(format!(
                "the return path (reply mark and policy routing) of the stopping userspace \
                 proxy on port {port}, for its {relays} open relays"
            ))
        }
    })
}

/// The iptables mode's chains, on both backends; with a running mode that fills some of the
/// same chains (ipvs), those and its jumps to them stay.
fn remove_iptables(
    ctx: &ModeContext<'_>,
    running: Option<&Footprint>,
) -> Result<Removal, DataplaneError> {
    let cmd = ctx
        .netns
        .map_or_else(IptablesCommand::new, IptablesCommand::in_netns);
    let result = match running {
        Some(keep) if !keep.chains.is_empty() => kp_iptables::cleanup_with(
            &footprint::KeepingRunner { inner: &cmd, keep },
            kp_iptables::DEFAULT_STEP_CHAINS,
        ),
        _ => kp_iptables::cleanup_with(&cmd, kp_iptables::DEFAULT_STEP_CHAINS),
    };
    result.map_err(kp_iptables::Error::into_dataplane)?;
    Ok(Removal::Gone)
}

fn remove_ebpf(
    ctx: &ModeContext<'_>,
    running: Option<&Footprint>,
) -> Result<Removal, DataplaneError> {
    match running {
        Some(_) => ebpf::hand_over(ctx),
        None => {
            ebpf::remove_ebpf(ctx)?;
            Ok(Removal::Gone)
        }
    }
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

    /// The firewall marks the modes set can meet on one packet during a switch (both modes'
    /// rules in force): the masquerade mark of the default `masqueradeBit` (the iptables,
    /// nftables and ipvs modes: `0x4000`), Kubernetes' drop mark (`0x8000`), the ipvs mode's
    /// short-circuit marks (bit 20 with a 14-bit index) and the userspace mode's mark for its
    /// transparent sockets. No bit of one is a bit of another, and no other mark is taken for
    /// a short-circuit one (its firewall-mark virtual servers match the whole mark).
    #[test]
    fn the_modes_marks_do_not_collide() {
        use kp_ipvs_plan::local::{is_short_circuit_mark, SHORT_CIRCUIT_MARK, SHORT_CIRCUIT_MARKS};
        let cfg = crate::config::load(["kube-proxy"]).expect("config").config;
        let masquerade = 1u32 << cfg.masquerade_bit;
        assert_eq!(masquerade, 0x4000);
        let drop = 0x8000u32;
        let userspace = kp_userspace::routing::DEFAULT.mark;
        let short_circuit_bits = SHORT_CIRCUIT_MARK | (SHORT_CIRCUIT_MARKS - 1);
        let marks = [
            ("masquerade", masquerade),
            ("drop", drop),
            ("userspace", userspace),
            ("ipvs short-circuit", short_circuit_bits),
        ];
        for (i, (a, ma)) in marks.iter().enumerate() {
            for (b, mb) in &marks[i + 1..] {
                assert_eq!(ma & mb, 0, "{a} {ma:#x} and {b} {mb:#x} share bits");
            }
        }
        for m in [masquerade, drop, userspace, masquerade | drop] {
            assert!(!is_short_circuit_mark(m), "{m:#x}");
        }
        for index in [0, 1, SHORT_CIRCUIT_MARKS - 1] {
            let m = SHORT_CIRCUIT_MARK | index;
            assert!(is_short_circuit_mark(m));
            assert_eq!(m & (masquerade | drop | userspace), 0, "{m:#x}");
        }
    }

    /// `BridgeInterface` and `InterfaceNamePrefix` reach every mode's settings (they were
    /// refused at start before).
    #[test]
    fn interface_detect_local_reaches_the_modes() {
        let load = |args: &[&str]| {
            crate::config::load(std::iter::once("kube-proxy").chain(args.iter().copied()))
                .expect("config")
                .config
        };
        let bridge = load(&[
            "--detect-local-mode=BridgeInterface",
            "--pod-bridge-interface=cbr0",
        ]);
        let want = DetectLocal::BridgeInterface(InterfaceName::new("cbr0").unwrap());
        assert_eq!(nftables_config(&bridge).unwrap().detect_local, want);
        assert_eq!(iptables_config(&bridge, None).unwrap().detect_local, want);
        assert_eq!(
            userspace_config(&bridge).unwrap().balancer.detect_local,
            want
        );
        let prefix = load(&[
            "--detect-local-mode=InterfaceNamePrefix",
            "--pod-interface-name-prefix=veth",
        ]);
        assert_eq!(
            nftables_config(&prefix).unwrap().detect_local,
            DetectLocal::InterfaceNamePrefix(InterfaceName::new("veth").unwrap())
        );
        // A name that bypassed the configuration's checks is still refused, not rendered.
        let mut forged = prefix.clone();
        forged.detect_local_mode = LocalMode::InterfaceNamePrefix("veth\" accept".into());
        assert!(matches!(nftables_config(&forged), Err(Fatal::Config(_))));
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
