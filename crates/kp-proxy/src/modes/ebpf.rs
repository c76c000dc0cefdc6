//! The ebpf mode's registry entry: its settings from the configuration, its dataplane (the
//! socket load balancer on cgroup v2 hooks, `kp-ebpf`), and the removal of what it leaves:
//! the maps and the programs' links pinned under `--bpf-pin-dir` (the links stay pinned when
//! the proxy exits, so a restart has no gap; removing their pins detaches the programs).
//!
//! Translation happens when a socket connects, before any packet exists: no NAT, so no
//! conntrack entry of this mode's can go stale, and the registry entry says so
//! (`reconciles_conntrack: false`). The mode still keeps netfilter's NAT hooks registered
//! (`kp_ebpf::nat_hooks`: an nftables table `inet kube-proxy-ebpf` of empty `nat` chains), so
//! the connections the mode before it translated go on being translated after a switch.

use std::path::PathBuf;

use kp_core::dataplane::{Dataplane, DataplaneError};
use kp_core::model::IpFamily;
use kp_ebpf::dataplane::{Config as EbpfConfig, EbpfDataplane, Event, Events, TcDevices};
use kp_ebpf::nat_hooks::NatHooks;
use kp_ebpf::{MapSizes, Scheduler};
use kp_metrics::Metrics;

use super::{node_port_addresses, ModeContext, Removal};
use crate::config::{Config, DEFAULT_BPF_PIN_DIR};
use crate::Fatal;

/// The cgroup the hooks attach to: `--bpf-cgroup-root`, else the cgroup v2 hierarchy's root.
/// In a network namespace of a caller's (tests, benchmarks) only an explicit one: the
/// hierarchy's root would rewrite the connections of every process on the machine.
fn cgroup_root(ctx: &ModeContext<'_>) -> Result<PathBuf, Fatal> {
    if let Some(dir) = &ctx.config.bpf_cgroup_root {
        return Ok(dir.clone());
    }
    if let Some(ns) = ctx.netns {
        return Err(Fatal::Config(format!(
            "ebpf mode for network namespace {ns}: its socket hooks act on a cgroup, not a \
             namespace; name a cgroup of the caller's own with --bpf-cgroup-root"
        )));
    }
    match kp_ebpf::cgroup::find_cgroup2_root() {
        Ok(Some(root)) => Ok(root),
        Ok(None) => Err(Fatal::Config(
            "ebpf mode needs a cgroup v2 hierarchy and none is mounted (see /proc/self/mountinfo); \
             mount one or name it with --bpf-cgroup-root"
                .into(),
        )),
        Err(e) => Err(Fatal::Start {
            what: "reading /proc/self/mountinfo for the cgroup v2 root".into(),
            source: Box::new(e),
        }),
    }
}

/// The ebpf mode's settings, from the configuration: the cgroup (`--bpf-cgroup-root` or the
/// hierarchy's root), the pin directory (`--bpf-pin-dir`), `nodePortAddresses`, the map sizes
/// (`ebpf.*MapMax`, [`map_sizes`]), the pick ([`scheduler`]), and the events that become log
/// lines and metrics ([`events`]).
pub fn ebpf_settings(ctx: &ModeContext<'_>) -> Result<EbpfConfig, Fatal> {
    Ok(EbpfConfig {
        scheduler: scheduler(ctx.config)?,
        cgroup: cgroup_root(ctx)?,
        pin_dir: Some(ctx.config.bpf_pin_dir.clone()),
        sizes: map_sizes(ctx.config),
        nat_hooks: Some(NatHooks::new(ctx.netns)),
        node_ports: node_port_addresses(ctx.config),
        tc: tc_devices(ctx)?,
        events: events(ctx.metrics.clone()),
    })
}

/// How the programs pick a backend, from `ipvs.scheduler` (`--ipvs-scheduler`): `sh` and `mh`
/// hash the client into each frontend's Maglev table (the socket hooks its network namespace,
/// the tc path its address); blank, `rr` and upstream's other schedulers pick at random
/// (`kp_ebpf_plan::Scheduler::from_ipvs`). A name upstream does not know is a configuration
/// error here, as the section is otherwise validated in ipvs mode only.
pub fn scheduler(cfg: &Config) -> Result<Scheduler, Fatal> {
    Scheduler::from_ipvs(&cfg.ipvs.scheduler).ok_or_else(|| {
        Fatal::Config(format!(
            "ipvs.scheduler (--ipvs-scheduler) {:?}: the ebpf mode knows rr, wrr, lc, wlc, lblc, \
             lblcr, dh, sed, nq (a random pick) and sh, mh (Maglev hashing of the client)",
            cfg.ipvs.scheduler
        ))
    })
}

/// The loader's map sizes from the `ebpf` section: the four configured ones, the rest as the
/// loader's defaults (the reverse-NAT map's key is a 16-bit frontend id; the address and
/// source-range tries allocate as they fill).
pub fn map_sizes(cfg: &Config) -> MapSizes {
    let e = &cfg.ebpf;
    MapSizes {
        services: e.services_map_max,
        backends: e.backends_map_max,
        affinity: e.affinity_map_max,
        connections: e.conntrack_map_max,
        sockets: e.conntrack_map_max,
        ..MapSizes::default()
    }
}

/// A full map: an error line naming the map and its size (the sync fails with the same
/// message and is retried) and `kubeproxy_rs_ebpf_map_full_total{map}`. A pinned map made
/// afresh at a new size: a warning line (it is empty until the first full sync). Stale UDP
/// sockets destroyed: a line each and `kubeproxy_rs_ebpf_stale_udp_sockets_destroyed_total`;
/// not destroyed: a warning and `kubeproxy_rs_ebpf_stale_udp_failures_total`.
fn events(metrics: std::sync::Arc<Metrics>) -> Events {
    Events::new(move |event| match event {
        Event::Full { name, max_entries } => {
            metrics.ebpf_map_full(name);
            tracing::error!(
                map = *name,
                max_entries = *max_entries,
                "ebpf: BPF map is full, the sync stopped; raise its size (ebpf.*MapMax, \
                 --bpf-*-map-max)"
            );
        }
        Event::StaleUdp { pairs, destroyed } => {
            metrics
                .ebpf_stale_udp_sockets_destroyed
                .inc_by(destroyed.len() as u64);
            for d in destroyed {
                tracing::info!(
                    frontend = %d.frontend,
                    backend = %d.backend,
                    "ebpf: destroyed a connected UDP socket whose backend left the frontend"
                );
            }
            tracing::debug!(
                pairs = *pairs,
                destroyed = destroyed.len(),
                "ebpf: stale UDP frontend and backend pairs checked"
            );
        }
        Event::StaleUdpFailed(why) => {
            metrics.ebpf_stale_udp_failures.inc();
            tracing::warn!(
                error = %why,
                "ebpf: stale connected UDP sockets are not destroyed; their clients keep \
                 sending to the gone backend until they reconnect"
            );
        }
        Event::Resized(r) => tracing::warn!(
            map = r.name,
            pinned = r.pinned,
            configured = r.wanted,
            "ebpf: pinned BPF map has another size than configured: unpinned and made afresh \
             (filled by the first full sync)"
        ),
    })
}

/// Where the tc path attaches: outside traffic is taken on the interfaces of the node's
/// default routes (its uplinks), replies on every other interface (found again at each full
/// sync, so new pods' veths are covered). For a network namespace of a caller's (tests,
/// benchmarks, whose dataplane may run on a thread of the machine's own namespace), none: the
/// tc programs go only on interfaces of the namespace the proxy itself runs in.
fn tc_devices(ctx: &ModeContext<'_>) -> Result<Option<TcDevices>, Fatal> {
    if ctx.netns.is_some() {
        return Ok(None);
    }
    let outside = kp_ebpf::local::default_route_interfaces().map_err(|e| Fatal::Start {
        what: "reading /proc/thread-self/net/route for the node's uplinks".into(),
        source: Box::new(e),
    })?;
    Ok(Some(TcDevices::Discover { outside }))
}

/// Builds the dataplane; nothing is loaded or attached before its `start`.
pub fn build_ebpf(ctx: &ModeContext<'_>) -> Result<Box<dyn Dataplane>, Fatal> {
    Ok(Box::new(EbpfDataplane::new(ebpf_settings(ctx)?)))
}

/// Whether the pin directory is this caller's to clean: always in the node's own namespace;
/// in a caller's namespace only a directory it named (the default one belongs to a proxy
/// running on the machine).
fn owns_pins(cfg: &Config, netns: Option<&str>) -> bool {
    netns.is_none() || cfg.bpf_pin_dir != std::path::Path::new(DEFAULT_BPF_PIN_DIR)
}

/// The ebpf mode's leftovers on a switch to another mode: the socket hooks and the table that
/// kept the NAT hooks go (the running mode has NAT chains of its own), new connections from
/// outside meet the running mode, and the tc programs stay for the connections they made until
/// none has been used for `--bpf-handover-idle` ([`kp_ebpf::hand_over`]).
pub fn hand_over(ctx: &ModeContext<'_>) -> Result<Removal, DataplaneError> {
    let left = if owns_pins(ctx.config, ctx.netns) {
        kp_ebpf::hand_over(&ctx.config.bpf_pin_dir, ctx.config.bpf_handover_idle)
            .map_err(DataplaneError::transient)?
    } else {
        kp_ebpf::HandOver::Gone
    };
    NatHooks::new(ctx.netns)
        .remove()
        .map_err(kp_nftables::Error::into_dataplane)?;
    Ok(match left {
        kp_ebpf::HandOver::Gone => Removal::Gone,
        kp_ebpf::HandOver::Carrying { entries, last_used } => Removal::Draining(format!(
            "the tc programs carry connections from outside the node ({entries} connection \
             table entries used within --bpf-handover-idle, the last {last_used:?} ago)"
        )),
    })
}

/// Taking the node over: forgets the conntrack entries of TCP connections that the mode before
/// translated and that have ended (`TIME_WAIT`, `CLOSE`; established ones stay, they carry the
/// old mode's connections on). The socket hooks connect straight to a backend, so a new
/// connection's reply tuple (backend to the client's port) can be the one such an entry holds
/// for two minutes: conntrack refuses the new entry when the SYN leaves and drops it, and the
/// client times out (up to two in a thousand new ClusterIP connections failed in the host's
/// switches to ebpf mode before, none in 8,900 since; after ipvs mode the failures that stay
/// are IPVS's own, `kp_ipvs::cleanup`). Entries of connections this mode made are never
/// translated, so only the old mode's are found.
pub fn forget_closed_translations(ctx: &ModeContext<'_>) -> Result<(), DataplaneError> {
    let conntrack = match ctx.netns {
        Some(ns) => kp_conntrack::Conntrack::in_netns(ns),
        None => kp_conntrack::Conntrack::new(),
    };
    let mut forgotten = 0;
    for family in IpFamily::ALL {
        let closed: Vec<_> = conntrack
            .list_closed_tcp(family)
            .map_err(DataplaneError::transient)?
            .into_iter()
            .filter(|e| e.translated())
            .collect();
        let deleted = conntrack.delete(&closed);
        ctx.metrics
            .conntrack_deleted_entries
            .inc_by(deleted.as_ref().map_or_else(|e| e.deleted(), |n| *n) as u64);
        forgotten += deleted.map_err(DataplaneError::transient)?;
    }
    if forgotten > 0 {
        tracing::info!(
            entries = forgotten,
            "forgot the conntrack entries of ended TCP connections the previous mode translated \
             (they would refuse this mode's direct connections from the same client ports)"
        );
    }
    Ok(())
}

/// Removes the links (detaching the programs) and maps the mode pinned, and their directory
/// once empty; then the table that kept the NAT hooks (the running mode, if any, has NAT
/// chains of its own).
pub fn remove_ebpf(ctx: &ModeContext<'_>) -> Result<(), DataplaneError> {
    if owns_pins(ctx.config, ctx.netns) {
        kp_ebpf::remove_pins(&ctx.config.bpf_pin_dir).map_err(DataplaneError::transient)?;
    }
    NatHooks::new(ctx.netns)
        .remove()
        .map_err(kp_nftables::Error::into_dataplane)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn config(args: &[&str]) -> Config {
        crate::config::load(
            ["kube-proxy", "--proxy-mode", "ebpf"]
                .into_iter()
                .chain(args.iter().copied()),
        )
        .expect("config")
        .config
    }

    #[test]
    fn the_settings_follow_the_flags() {
        let cfg = config(&[
            "--bpf-cgroup-root",
            "/sys/fs/cgroup/kpt",
            "--bpf-pin-dir",
            "/sys/fs/bpf/kpt",
            "--nodeport-addresses",
            "primary",
        ]);
        let metrics = Arc::new(kp_metrics::Metrics::new());
        let ctx = ModeContext::new(&cfg, metrics);
        let s = ebpf_settings(&ctx).expect("settings");
        assert_eq!(s.cgroup, PathBuf::from("/sys/fs/cgroup/kpt"));
        assert_eq!(s.pin_dir, Some(PathBuf::from("/sys/fs/bpf/kpt")));
        assert_eq!(s.node_ports, kp_core::node::NodePortAddresses::Primary);
    }

    #[test]
    fn the_map_sizes_follow_the_configuration_and_a_full_map_counts() {
        let cfg = config(&["--bpf-cgroup-root", "/sys/fs/cgroup/kpt"]);
        let sizes = map_sizes(&cfg);
        // Room for 30k Services x 10 endpoints by default: a frontend and ten slots each.
        assert!(sizes.services >= 30_000 * 11, "{sizes:?}");
        assert!(sizes.backends >= 30_000 * 10, "{sizes:?}");
        let cfg = config(&[
            "--bpf-services-map-max",
            "1000",
            "--bpf-backends-map-max",
            "2000",
            "--bpf-affinity-map-max",
            "3000",
            "--bpf-conntrack-map-max",
            "4000",
        ]);
        let sizes = map_sizes(&cfg);
        assert_eq!(
            (
                sizes.services,
                sizes.backends,
                sizes.affinity,
                sizes.connections,
                sizes.sockets
            ),
            (1000, 2000, 3000, 4000, 4000)
        );
        assert_eq!(sizes.rev_nat, MapSizes::default().rev_nat);

        // The events the dataplane reports: a full map counts per map.
        let metrics = Arc::new(kp_metrics::Metrics::new());
        let events = events(metrics.clone());
        let full = |name| Event::Full {
            name,
            max_entries: 1000,
        };
        for e in [
            full(kp_ebpf::names::SERVICES),
            full(kp_ebpf::names::SERVICES),
            full(kp_ebpf::names::BACKENDS),
        ] {
            events.emit(e);
        }
        events.emit(Event::Resized(kp_ebpf::Resized {
            name: kp_ebpf::names::SERVICES,
            pinned: 65536,
            wanted: 1000,
        }));
        let text = metrics.encode();
        assert!(
            text.contains("kubeproxy_rs_ebpf_map_full_total{map=\"kp_services\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("kubeproxy_rs_ebpf_map_full_total{map=\"kp_backends\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn the_ipvs_scheduler_chooses_maglev_or_a_random_pick() {
        let with = |args: &[&str]| {
            let mut all = vec!["--bpf-cgroup-root", "/sys/fs/cgroup/kpt"];
            all.extend_from_slice(args);
            let cfg = config(&all);
            let metrics = Arc::new(kp_metrics::Metrics::new());
            ebpf_settings(&ModeContext::new(&cfg, metrics)).map(|s| s.scheduler)
        };
        assert_eq!(with(&[]).expect("default"), Scheduler::Random);
        for (name, want) in [
            ("rr", Scheduler::Random),
            ("wlc", Scheduler::Random),
            ("dh", Scheduler::Random),
            ("sh", Scheduler::Maglev),
            ("mh", Scheduler::Maglev),
        ] {
            assert_eq!(
                with(&["--ipvs-scheduler", name]).expect(name),
                want,
                "{name}"
            );
        }
        match with(&["--ipvs-scheduler", "fastest"]) {
            Err(Fatal::Config(msg)) => {
                assert!(
                    msg.contains("--ipvs-scheduler") && msg.contains("fastest"),
                    "{msg}"
                )
            }
            Err(other) => panic!("not a configuration error: {other}"),
            Ok(s) => panic!("accepted as {s:?}"),
        }
    }

    #[test]
    fn in_a_callers_namespace_the_machines_cgroup_root_and_pins_are_left_alone() {
        let cfg = config(&[]);
        let metrics = Arc::new(kp_metrics::Metrics::new());
        let ctx = ModeContext {
            netns: Some("kpt-test"),
            ..ModeContext::new(&cfg, metrics)
        };
        match ebpf_settings(&ctx) {
            Err(Fatal::Config(msg)) => assert!(msg.contains("--bpf-cgroup-root"), "{msg}"),
            Err(other) => panic!("not a configuration error: {other}"),
            Ok(s) => panic!("attached to {:?}", s.cgroup),
        }
        assert!(!owns_pins(&cfg, Some("kpt-test")));
        assert!(owns_pins(&cfg, None));
        let own = config(&["--bpf-pin-dir", "/tmp/kpt-pins"]);
        assert!(owns_pins(&own, Some("kpt-test")));
    }
}
