//! The ipvs mode's registry entry: its settings from the configuration, its dataplane, the
//! removal of what it leaves, and the start-up probe that sends a node without IPVS to the
//! iptables mode (as upstream's `CanUseIPVSProxier` did before choosing a proxier).

use std::collections::BTreeSet;
use std::process::Command;

use kp_core::dataplane::{Dataplane, DataplaneError, HeldBackend};
use kp_core::model::IpFamily;
use kp_iptables::IptablesCommand;
use kp_ipvs::dataplane::{IpvsDataplane, IpvsSettings, NodeResolve};
use kp_ipvs_plan::local;

use super::{detect_local, node_port_addresses, Footprint, ModeContext, Removal};
use crate::config::Config;
use crate::Fatal;

/// The ipvs mode's settings, from the configuration: `ipvs.scheduler` (`--ipvs-scheduler`),
/// `ipvs.excludeCIDRs`, `ipvs.strictARP`, the masquerade bit and `masqueradeAll`, detect-local
/// and `nodePortAddresses` (resolved at each sync against the Node and the node's interfaces).
/// The sync periods are the sync loop's (`ipvs.syncPeriod`, `ipvs.minSyncPeriod`, already
/// resolved into [`Config::sync_period`]).
pub fn ipvs_settings(cfg: &Config, netns: Option<&str>) -> Result<IpvsSettings, Fatal> {
    let ipvs = kp_ipvs_plan::Config::new(&cfg.ipvs.scheduler, 0, cfg.ipvs.exclude_cidrs.clone())
        .map_err(|e| Fatal::Config(format!("ipvs.scheduler (--ipvs-scheduler): {e}")))?;
    Ok(IpvsSettings {
        families: IpFamily::ALL.to_vec(),
        ipvs,
        masquerade_bit: u32::from(cfg.masquerade_bit),
        masquerade_all: cfg.masquerade_all,
        // Resolved at each sync (below).
        node: Default::default(),
        node_port_addresses: Vec::new(),
        strict_arp: cfg.ipvs.strict_arp,
        timeouts: kp_ipvs::Timeouts {
            tcp: seconds(cfg.ipvs.tcp_timeout),
            tcp_fin: seconds(cfg.ipvs.tcp_fin_timeout),
            udp: seconds(cfg.ipvs.udp_timeout),
        },
        netns: netns.map(str::to_string),
        resolve: Some(NodeResolve {
            detect_local: detect_local(cfg)?,
            node_ports: node_port_addresses(cfg),
        }),
    })
}

/// A timeout in whole seconds for IPVS (at least 1 for a non-zero one, at most `u32::MAX`);
/// 0 (leave the kernel's) without one.
fn seconds(d: Option<std::time::Duration>) -> u32 {
    match d {
        None => 0,
        Some(d) => u32::try_from(d.as_secs()).unwrap_or(u32::MAX).max(1),
    }
}

fn iptables(ctx: &ModeContext<'_>) -> IptablesCommand {
    ctx.netns
        .map_or_else(IptablesCommand::new, IptablesCommand::in_netns)
}

pub(super) fn build(ctx: &ModeContext<'_>) -> Result<Box<dyn Dataplane>, Fatal> {
    let settings = ipvs_settings(ctx.config, ctx.netns)?;
    let mark = 1u32 << ctx.config.masquerade_bit;
    let short_circuit_bits = local::SHORT_CIRCUIT_MARK | (local::SHORT_CIRCUIT_MARKS - 1);
    if mark & short_circuit_bits != 0 {
        tracing::warn!(
            masquerade_bit = ctx.config.masquerade_bit,
            "the masquerade bit lies among the short-circuit marks of externalTrafficPolicy: \
             Local Services ({:#x}); pod traffic short-circuited to them may be masqueraded: \
             use a masquerade bit of 14 to 19 or above 20",
            local::SHORT_CIRCUIT_MARK
        );
    }
    let backend = kp_iptables::detect_backend(ctx.netns);
    tracing::info!(
        backend = backend.as_str(),
        scheduler = %ctx.config.ipvs.scheduler,
        "ipvs mode (iptables backend for its chains)"
    );
    IpvsDataplane::new(settings, Box::new(iptables(ctx)), backend)
        .map(|d| Box::new(d) as Box<dyn Dataplane>)
        .map_err(|error| Fatal::Dataplane {
            mode: "ipvs",
            error,
        })
}

/// Removes the ipvs mode's leftovers. With a running mode (a switch): the chains and jumps it
/// uses stay, and virtual servers that still carry connections stay with `kube-ipvs0` until
/// those end ([`Removal::Draining`]; the new mode translates every new connection before IPVS
/// sees it).
pub(super) fn remove(
    ctx: &ModeContext<'_>,
    running: Option<&Footprint>,
) -> Result<Removal, DataplaneError> {
    let keep = running.map_or_else(Default::default, |f| f.ipvs_keep(true));
    let removed = kp_ipvs::cleanup::remove_leftovers_keeping(
        ctx.netns,
        &iptables(ctx),
        &ctx.config.ipvs.exclude_cidrs,
        &keep,
    )
    .map_err(kp_ipvs::Error::into_dataplane)?;
    if !removed.is_empty() {
        tracing::info!(
            services = removed.services,
            interface = removed.interface,
            chains = removed.chains,
            sets = removed.sets,
            draining = removed.draining,
            idle_real_servers = removed.real_servers,
            "removed the ipvs mode's leftovers"
        );
    }
    if removed.draining > 0 {
        return Ok(Removal::Draining(format!(
            "{} IPVS virtual servers and kube-ipvs0 still carry connections",
            removed.draining
        )));
    }
    Ok(Removal::Gone)
}

/// The real servers of the ipvs mode's leftover virtual servers that IPVS keeps closing
/// connections' entries on (`kp_ipvs::cleanup::held_real_servers`).
pub(super) fn held(ctx: &ModeContext<'_>) -> Result<BTreeSet<HeldBackend>, DataplaneError> {
    kp_ipvs::cleanup::held_real_servers(ctx.netns, &ctx.config.ipvs.exclude_cidrs)
        .map_err(kp_ipvs::Error::into_dataplane)
}

/// Why the ipvs mode cannot run here, if it cannot: the kernel has no IPVS generic netlink
/// family (asking for it loads `ip_vs` where the module exists), or the `ipset` tool the mode
/// fills its sets with does not run.
pub(super) fn unusable(ctx: &ModeContext<'_>) -> Option<String> {
    match kp_ipvs::Client::open(ctx.netns) {
        Ok(_) => {}
        Err(e @ kp_ipvs::Error::Unavailable { .. }) => {
            return Some(format!(
                "{e}; load it with `modprobe ip_vs` or build the kernel with CONFIG_IP_VS"
            ))
        }
        Err(e) => return Some(format!("IPVS cannot be reached: {e}")),
    }
    let mut version = match ctx.netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, "ipset", "version"]);
            c
        }
        None => {
            let mut c = Command::new("ipset");
            c.arg("version");
            c
        }
    };
    match version.output() {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!(
            "the ipset tool fails: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Some(format!("the ipset tool does not run: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(args: &[&str]) -> Config {
        let mut argv = vec!["kube-proxy", "--proxy-mode", "ipvs"];
        argv.extend_from_slice(args);
        crate::config::load(argv).expect("config").config
    }

    #[test]
    fn the_settings_take_the_scheduler_strict_arp_excluded_cidrs_and_the_mark() {
        let mut cfg = config(&[
            "--ipvs-scheduler",
            "lc",
            "--ipvs-strict-arp",
            "--iptables-masquerade-bit",
            "12",
            "--cluster-cidr",
            "10.244.0.0/16",
        ]);
        // `ipvs.excludeCIDRs` is a config-file setting (no flag here).
        cfg.ipvs.exclude_cidrs = vec!["10.200.0.0/16".parse().unwrap()];
        let s = ipvs_settings(&cfg, Some("ns1")).expect("settings");
        assert_eq!(
            s.ipvs,
            kp_ipvs_plan::Config::new("lc", 0, vec!["10.200.0.0/16".parse().unwrap()]).unwrap()
        );
        assert!(s.strict_arp);
        assert_eq!(s.timeouts, kp_ipvs::Timeouts::default());
        assert_eq!(s.masquerade_bit, 12);
        assert_eq!(s.netns.as_deref(), Some("ns1"));
        let r = s.resolve.expect("resolved at each sync");
        assert_eq!(
            r.detect_local,
            kp_core::node::DetectLocal::ClusterCidr(vec!["10.244.0.0/16".parse().unwrap()])
        );
    }

    /// The start-up probe against this machine's kernel, in a namespace of the test's own:
    /// it agrees with what the kernel shows after it (`/proc/net/ip_vs` exists once `ip_vs` is
    /// loaded, and the probe asks for the family, which loads it where it can), and a node
    /// without IPVS runs iptables mode, saying why.
    #[test]
    #[ignore = "needs root"]
    fn the_probe_sends_a_node_without_ipvs_to_iptables_mode_and_says_why() {
        if !kp_test::netns::require_root() {
            return;
        }
        let ns = kp_test::netns::Netns::new("ipvs-probe").expect("namespace");
        ns.run(&["ip", "link", "set", "lo", "up"]).expect("lo up");
        let cfg = config(&[]);
        let metrics = std::sync::Arc::new(kp_metrics::Metrics::new());
        let ctx = ModeContext {
            config: &cfg,
            netns: Some(ns.name()),
            metrics,
        };
        let fallback = super::super::fallback(&ctx);
        let kernel_has_ipvs = std::path::Path::new("/proc/net/ip_vs").exists();
        let ipset_runs = Command::new("ipset")
            .arg("version")
            .output()
            .is_ok_and(|o| o.status.success());
        if kernel_has_ipvs && ipset_runs {
            assert_eq!(fallback, None);
            return;
        }
        let fb = fallback.expect("a node without IPVS or ipset falls back");
        assert_eq!(fb.from, crate::config::ProxyMode::Ipvs);
        // The namespace's iptables works: the next mode down is iptables.
        assert_eq!(fb.to, crate::config::ProxyMode::Iptables, "{fb:?}");
        if !kernel_has_ipvs {
            assert!(fb.why.contains("IPVS"), "{}", fb.why);
            assert!(fb.why.contains("ip_vs"), "{}", fb.why);
        } else {
            assert!(fb.why.contains("ipset"), "{}", fb.why);
        }
        // And removing the mode's leftovers where it never ran changes nothing and succeeds.
        let before = ns.run(&["ip", "-o", "link"]).expect("links");
        assert_eq!(
            remove(&ctx, None).expect("nothing to remove is no error"),
            Removal::Gone
        );
        assert_eq!(ns.run(&["ip", "-o", "link"]).expect("links"), before);
    }

    #[test]
    fn ipvs_timeouts_are_whole_seconds_and_an_unset_one_leaves_the_kernels() {
        let mut cfg = config(&[]);
        cfg.ipvs.tcp_timeout = Some(std::time::Duration::from_secs(1800));
        cfg.ipvs.udp_timeout = Some(std::time::Duration::from_millis(500));
        let s = ipvs_settings(&cfg, None).expect("settings");
        assert_eq!(
            s.timeouts,
            kp_ipvs::Timeouts {
                tcp: 1800,
                tcp_fin: 0,
                udp: 1
            }
        );
    }

    #[test]
    fn the_default_scheduler_is_rr_and_a_bad_one_is_a_configuration_error() {
        let s = ipvs_settings(&config(&[]), None).expect("settings");
        assert_eq!(
            s.ipvs,
            kp_ipvs_plan::Config::new("rr", 0, Vec::new()).unwrap()
        );
        let mut cfg = config(&[]);
        cfg.ipvs.scheduler = "round robin".into();
        match ipvs_settings(&cfg, None) {
            Err(Fatal::Config(msg)) => assert!(msg.contains("--ipvs-scheduler"), "{msg}"),
            Err(other) => panic!("not a configuration error: {other}"),
            Ok(_) => panic!("accepted"),
        }
    }
}
