//! The `ebpf` Dataplane on the shared fixture cluster, attached to a cgroup of the test's own
//! with its maps and links pinned on a bpffs of the test's own: a full sync fills the maps,
//! verify finds them as planned, the programs stay attached while no dataplane runs, and a
//! restarted dataplane adopts the pinned maps without rewriting them; cleanup detaches.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use kp_core::dataplane::Dataplane;
use kp_core::track::{Changes, Object, SourceEvent};
use kp_ebpf::dataplane::{Config, EbpfDataplane, Event, Events};
use kp_ebpf::{names, MapSizes, Resized};
use kp_test::lab::Lab;
use kp_test::netns::{require_root, Netns};

mod common;
use common::{Bpffs, Cgroup};

#[test]
#[ignore = "needs root"]
fn a_restarted_dataplane_adopts_the_pinned_maps_without_rewriting_them() {
    if !require_root() {
        return;
    }
    let cgroup = Cgroup::new();
    let bpffs = Bpffs::new();
    let config = Config {
        pin_dir: Some(bpffs.path.clone()),
        ..Config::new(cgroup.path.clone())
    };
    let state = kp_flows::fixture::state();
    let ns = Netns::new("ebpf-restart").expect("namespace");
    // `empty` (10.96.0.20:80) has no endpoints: the programs refuse it with ECONNREFUSED;
    // without them the connect meets the namespace's empty routing table.
    let refused = || {
        let lines = sockpeer(&cgroup, &ns, &["tcp", "10.96.0.20", "80", "1"]);
        lines.first().is_some_and(|l| l.contains("os error 111"))
    };

    let mut first = EbpfDataplane::new(config.clone());
    first.start().expect("start");
    let report = first
        .sync(&state, &Changes::default(), true)
        .expect("first full sync");
    assert!(report.operations > 20, "{report:?}");
    // itp-local-none (internal); local-none (external): Local policies with endpoints on
    // node-b only, as the nftables mode counts them.
    assert_eq!(report.no_local_endpoints, (1, 1), "{report:?}");
    assert_eq!(first.verify().expect("verify"), Vec::<String>::new());
    let again = first
        .sync(&state, &Changes::default(), true)
        .expect("second full sync");
    assert_eq!(again.operations, 0, "an unchanged cluster rewrote maps");
    assert!(
        refused(),
        "the programs do not refuse an endpoint-less Service"
    );
    drop(first);
    // The links are pinned: no gap while no proxy runs.
    assert!(refused(), "the programs went with the first dataplane");

    let mut second = EbpfDataplane::new(config);
    second.start().expect("restart");
    let adopted = second
        .sync(&state, &Changes::default(), true)
        .expect("full sync after restart");
    assert_eq!(adopted.operations, 0, "the restart rewrote the pinned maps");
    assert_eq!(second.verify().expect("verify"), Vec::<String>::new());
    assert!(refused(), "the second dataplane's programs do not refuse");
    for program in kp_ebpf::SOCK_PROGRAMS {
        let link = kp_ebpf::names::link(program);
        assert!(bpffs.path.join(&link).exists(), "{link} is not pinned");
    }
    second.cleanup().expect("cleanup");
    for name in kp_ebpf::names::ALL {
        assert!(!bpffs.path.join(name).exists(), "{name} still pinned");
    }
    for program in kp_ebpf::SOCK_PROGRAMS {
        let link = kp_ebpf::names::link(program);
        assert!(!bpffs.path.join(&link).exists(), "{link} still pinned");
    }
    let after = sockpeer(&cgroup, &ns, &["tcp", "10.96.0.20", "80", "1"]);
    assert!(
        after.first().is_some_and(|l| l.contains("os error 101")),
        "after cleanup the connect should meet plain routing (ENETUNREACH): {after:?}"
    );
}

/// Runs kp-sockpeer from `ns` inside `cgroup`; its lines.
fn sockpeer(cgroup: &Cgroup, ns: &Netns, args: &[&str]) -> Vec<String> {
    let out = common::sockpeer(cgroup, ns)
        .args(args)
        .output()
        .expect("running kp-sockpeer");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

/// Runs kp-sockpeer from `ns` inside `cgroup` and counts answers by backend, requiring the
/// application to see `peer` every time.
fn spread(cgroup: &Cgroup, ns: &Netns, args: &[&str], peer: &str) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for line in sockpeer(cgroup, ns, args) {
        let (backend, seen) = line.split_once(' ').unwrap_or((&line, ""));
        assert_eq!(seen, peer, "the application saw another peer: {line}");
        *counts.entry(backend.to_string()).or_insert(0) += 1;
    }
    counts
}

#[test]
#[ignore = "needs root"]
fn the_node_reaches_the_fixture_web_service_through_the_dataplane_and_follows_a_partial_sync() {
    if !require_root() {
        return;
    }
    let lab = Lab::new(4).expect("lab");
    let _pods: Vec<_> = (1..=3)
        .map(|i| lab.serve_echo(i, &[8080], &[]).expect("echo server"))
        .collect();
    let cgroup = Cgroup::new();
    let mut state = kp_flows::fixture::state();
    let mut dp = EbpfDataplane::new(Config::new(cgroup.path.clone()));
    dp.start().expect("start");
    dp.sync(&state, &Changes::default(), true)
        .expect("full sync");

    // web: ClusterIP 10.96.0.10:80, endpoints pod-1..3 (10.244.1.11-13:8080).
    let all = spread(
        &cgroup,
        lab.node(),
        &["tcp", "10.96.0.10", "80", "45"],
        "10.96.0.10:80",
    );
    assert_eq!(
        all.keys().collect::<Vec<_>>(),
        ["pod-1", "pod-2", "pod-3"],
        "{all:?}"
    );

    let slice = kp_flows::fixture::web_slice(&["pod-1"]);
    state
        .apply(SourceEvent::Upsert(Object::EndpointSlice(Box::new(slice))))
        .expect("slice update");
    let changes = state.take_changes();
    let report = dp.sync(&state, &changes, false).expect("partial sync");
    assert!(
        report.operations <= 8,
        "two endpoints removed took {} map updates",
        report.operations
    );
    assert_eq!(dp.verify().expect("verify"), Vec::<String>::new());
    let one = spread(
        &cgroup,
        lab.node(),
        &["tcp", "10.96.0.10", "80", "15"],
        "10.96.0.10:80",
    );
    assert_eq!(one, [("pod-1".to_string(), 15)].into());
}

/// A services map too small for the fixture stops the full sync with `Full`, naming the map,
/// and reports it as an event (the registry's log line and metric); a dataplane started with
/// the configured size back finds the pinned map at the old size, reports it made afresh, and
/// fills it.
#[test]
#[ignore = "needs root"]
fn a_too_small_map_reports_full_and_a_pinned_map_of_another_size_is_made_afresh() {
    if !require_root() {
        return;
    }
    let cgroup = Cgroup::new();
    let bpffs = Bpffs::new();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let events = {
        let seen = seen.clone();
        Events::new(move |e| seen.lock().unwrap().push(e.clone()))
    };
    let config = Config {
        pin_dir: Some(bpffs.path.clone()),
        sizes: MapSizes {
            services: 8,
            ..MapSizes::default()
        },
        events,
        ..Config::new(cgroup.path.clone())
    };
    let state = kp_flows::fixture::state();
    let mut small = EbpfDataplane::new(config.clone());
    small.start().expect("start");
    assert_eq!(*seen.lock().unwrap(), Vec::<Event>::new());
    let err = small
        .sync(&state, &Changes::default(), true)
        .expect_err("the fixture in a services map of 8 entries");
    assert!(
        err.to_string().contains("kp_services is full (8 entries)"),
        "{err}"
    );
    assert_eq!(
        *seen.lock().unwrap(),
        [Event::Full {
            name: names::SERVICES,
            max_entries: 8
        }]
    );
    drop(small);

    seen.lock().unwrap().clear();
    let mut sized = EbpfDataplane::new(Config {
        sizes: MapSizes::default(),
        nat_hooks: None,
        ..config
    });
    sized.start().expect("start at the configured size");
    assert_eq!(
        *seen.lock().unwrap(),
        [Event::Resized(Resized {
            name: names::SERVICES,
            pinned: 8,
            wanted: MapSizes::default().services,
        })]
    );
    sized
        .sync(&state, &Changes::default(), true)
        .expect("full sync");
    assert_eq!(sized.verify().expect("verify"), Vec::<String>::new());
    assert_eq!(seen.lock().unwrap().len(), 1, "{:?}", seen.lock().unwrap());
    sized.cleanup().expect("cleanup");
    assert!(!bpffs.path.join(names::SERVICES).exists());
}
