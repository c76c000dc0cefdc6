//! The socket load balancer with real sockets: programs attached to a cgroup the test
//! creates, clients moved into it and into a network namespace the test creates, backends
//! (kp-echo) in that namespace. Nothing is attached to the machine's own cgroups; the cgroup,
//! the namespace and any bpffs mount are removed on drop, also when an assertion fails.

use std::collections::BTreeMap;
use std::time::Instant;

use kp_core::model::{Protocol, ServiceKey as ServiceName};
use kp_ebpf::{MapSizes, Refusal, SocketLb};
use kp_ebpf_plan::Planner;
use kp_test::netns::{require_root, Netns};

mod common;
use common::{spec, Bpffs, Cgroup};

/// Runs kp-sockpeer inside `cgroup` and `ns` and returns its lines.
fn client(cgroup: &Cgroup, ns: &Netns, args: &[&str]) -> Vec<String> {
    let out = common::sockpeer(cgroup, ns)
        .args(args)
        .output()
        .expect("running kp-sockpeer");
    assert!(
        out.status.success(),
        "kp-sockpeer: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

/// Counts answers by backend, requiring every peer the application saw to be `peer`.
fn spread(lines: &[String], peer: &str) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for line in lines {
        let (backend, seen) = line.split_once(' ').unwrap_or((line, ""));
        assert_eq!(seen, peer, "the application saw another peer: {line}");
        *counts.entry(backend.to_string()).or_insert(0) += 1;
    }
    counts
}

/// A namespace with two kp-echo backends: `a` on 10.244.1.1:8080 and [fd00:10:244::1]:8080's
/// port, `b` on 8081 (all addresses on the namespace's loopback).
fn backends(ns: &Netns) -> Vec<kp_test::netns::ChildGuard> {
    for cidr in [
        "10.244.1.1/32",
        "10.244.1.2/32",
        "fd00:10:244::1/128",
        "fd00:10:244::2/128",
    ] {
        ns.add_addr("lo", cidr).expect("address on lo");
    }
    vec![
        kp_test::echo::serve(ns, "a", &[8080], &[8080]).expect("backend a"),
        kp_test::echo::serve(ns, "b", &[8081], &[8081]).expect("backend b"),
    ]
}

#[test]
#[ignore = "needs root"]
fn connections_to_a_vip_spread_over_both_backends_and_the_application_sees_the_vip() {
    if !require_root() {
        return;
    }
    let ns = Netns::new("ebpf").expect("namespace");
    let _servers = backends(&ns);
    let cgroup = Cgroup::new();

    let started = Instant::now();
    let mut lb = SocketLb::load(MapSizes::default(), None).expect("load");
    let load_time = started.elapsed();
    lb.attach(&cgroup.path).expect("attach");

    let mut planner = Planner::new();
    let v4 = [("10.244.1.1", 8080), ("10.244.1.2", 8081)];
    let v6 = [("fd00:10:244::1", 8080), ("fd00:10:244::2", 8081)];
    let specs = [
        spec("10.96.0.10", 80, Protocol::Tcp, &v4),
        spec("10.96.0.10", 53, Protocol::Udp, &v4),
        spec("fd00:10:96::10", 80, Protocol::Tcp, &v6),
        spec("fd00:10:96::10", 53, Protocol::Udp, &v6),
        spec("10.96.0.11", 80, Protocol::Tcp, &[]),
        spec("10.96.0.11", 80, Protocol::Udp, &[]),
    ];
    let ops = planner
        .set_service(&ServiceName::new("t", "echo"), &specs)
        .expect("plan");
    lb.apply(&ops).expect("apply");
    assert_eq!(lb.read_back().expect("read back"), planner.contents());
    eprintln!("program load (8 programs, verifier included): {load_time:?}");

    let tcp = spread(
        &client(&cgroup, &ns, &["tcp", "10.96.0.10", "80", "40"]),
        "10.96.0.10:80",
    );
    assert_eq!(tcp.keys().collect::<Vec<_>>(), ["a", "b"], "{tcp:?}");
    let udp = spread(
        &client(&cgroup, &ns, &["udp", "10.96.0.10", "53", "40"]),
        "10.96.0.10:53",
    );
    assert_eq!(udp.keys().collect::<Vec<_>>(), ["a", "b"], "{udp:?}");
    let tcp6 = spread(
        &client(&cgroup, &ns, &["tcp", "fd00:10:96::10", "80", "40"]),
        "[fd00:10:96::10]:80",
    );
    assert_eq!(tcp6.keys().collect::<Vec<_>>(), ["a", "b"], "{tcp6:?}");
    let udp6 = spread(
        &client(&cgroup, &ns, &["udp", "fd00:10:96::10", "53", "40"]),
        "[fd00:10:96::10]:53",
    );
    assert_eq!(udp6.keys().collect::<Vec<_>>(), ["a", "b"], "{udp6:?}");

    // A frontend without backends refuses the connect: ECONNREFUSED, as upstream's reject
    // (this machine's kernel has bpf_set_retval), for TCP and for a UDP datagram.
    assert_eq!(lb.refusal(), Refusal::Errno);
    for proto in ["tcp", "udp"] {
        let refused = client(&cgroup, &ns, &[proto, "10.96.0.11", "80", "1"]);
        assert!(
            refused[0].starts_with("error connect") || refused[0].starts_with("error sendto"),
            "{proto} to a frontend without endpoints: {refused:?}"
        );
        assert!(
            refused[0].contains("os error 111"),
            "{proto}: not ECONNREFUSED: {refused:?}"
        );
    }

    // One backend removed: every new connection goes to the other, after one small update.
    let one = [
        spec("10.96.0.10", 80, Protocol::Tcp, &v4[1..]),
        spec("10.96.0.10", 53, Protocol::Udp, &v4),
        spec("fd00:10:96::10", 80, Protocol::Tcp, &v6),
        spec("fd00:10:96::10", 53, Protocol::Udp, &v6),
        spec("10.96.0.11", 80, Protocol::Tcp, &[]),
        spec("10.96.0.11", 80, Protocol::Udp, &[]),
    ];
    let ops = planner
        .set_service(&ServiceName::new("t", "echo"), &one)
        .expect("plan");
    assert!(ops.len() <= 4, "{ops:?}");
    let started = Instant::now();
    lb.apply(&ops).expect("apply");
    eprintln!(
        "one-endpoint removal: {} map updates in {:?}",
        ops.len(),
        started.elapsed()
    );
    let after = spread(
        &client(&cgroup, &ns, &["tcp", "10.96.0.10", "80", "20"]),
        "10.96.0.10:80",
    );
    assert_eq!(after, [("b".to_string(), 20)].into());

    // Outside the cgroup nothing is rewritten: the VIP is nobody's address in the namespace.
    let outside = ns
        .exec(&[
            env!("CARGO_BIN_EXE_kp-sockpeer"),
            "tcp",
            "10.96.0.10",
            "80",
            "1",
        ])
        .expect("client outside the cgroup");
    let line = String::from_utf8_lossy(&outside.stdout);
    assert!(
        line.starts_with("error connect"),
        "outside the cgroup: {line}"
    );
    drop(lb);
    let detached = client(&cgroup, &ns, &["tcp", "10.96.0.10", "80", "1"]);
    assert!(
        detached[0].starts_with("error connect"),
        "after detaching: {detached:?}"
    );
}

#[test]
#[ignore = "needs root"]
fn maps_pinned_under_bpffs_survive_the_loader_and_are_adopted_by_the_next() {
    if !require_root() {
        return;
    }
    let bpffs = Bpffs::new();
    let mut planner = Planner::new();
    let ops = planner
        .set_service(
            &ServiceName::new("t", "pinned"),
            &[spec(
                "10.96.0.20",
                443,
                Protocol::Tcp,
                &[("10.244.2.1", 8443), ("10.244.2.2", 8443)],
            )],
        )
        .expect("plan");
    {
        let mut first = SocketLb::load(MapSizes::default(), Some(&bpffs.path)).expect("load");
        first.apply(&ops).expect("apply");
    }
    for name in kp_ebpf::names::ALL {
        assert!(bpffs.path.join(name).exists(), "{name} is not pinned");
    }
    // Read through the pins alone, with nothing loaded (what `kube-proxy status` does).
    assert_eq!(
        kp_ebpf::read_pinned(&bpffs.path).expect("read the pins"),
        planner.contents()
    );
    let second = SocketLb::load(MapSizes::default(), Some(&bpffs.path)).expect("reload");
    assert_eq!(second.read_back().expect("read back"), planner.contents());
    drop(second);
    // Removal takes every pin and the directory, and only them.
    let dir = bpffs.path.join("kube-proxy-rs");
    std::fs::create_dir(&dir).expect("a directory on bpffs");
    let mut third =
        SocketLb::load(MapSizes::default(), Some(&dir)).expect("load in a subdirectory");
    third.apply(&ops).expect("apply");
    drop(third);
    kp_ebpf::remove_pins(&bpffs.path).expect("remove pins");
    for name in kp_ebpf::names::ALL {
        assert!(!bpffs.path.join(name).exists(), "{name} still pinned");
        assert!(
            dir.join(name).exists(),
            "{name} of another directory went too"
        );
    }
    kp_ebpf::remove_pins(&dir).expect("remove pins");
    assert!(!dir.exists(), "the emptied pin directory stays");
    // Nothing pinned: an error naming the map, not empty contents.
    let err = kp_ebpf::read_pinned(&dir).expect_err("no pins to read");
    assert!(err.to_string().contains(kp_ebpf::names::SERVICES), "{err}");
}

/// The compat object, for kernels before 5.18, passes the verifier here too (its tc programs
/// as well) and refuses with EPERM where the default one gives ECONNREFUSED or ETIMEDOUT.
#[test]
#[ignore = "needs root"]
fn the_compat_object_refuses_with_eperm() {
    if !require_root() {
        return;
    }
    let ns = Netns::new("ebpf-compat").expect("namespace");
    let cgroup = Cgroup::new();
    let mut lb = SocketLb::load_as(Refusal::Eperm, MapSizes::default(), None).expect("load");
    assert_eq!(lb.refusal(), Refusal::Eperm);
    // With no interface named, attach_tc only loads the tc programs: the verifier runs.
    assert_eq!(
        lb.attach_tc(&[], &[]).expect("the compat tc programs load"),
        0
    );
    lb.attach(&cgroup.path).expect("attach");
    let mut planner = Planner::new();
    let ops = planner
        .set_service(
            &ServiceName::new("t", "empty"),
            &[spec("10.96.0.11", 80, Protocol::Tcp, &[])],
        )
        .expect("plan");
    lb.apply(&ops).expect("apply");
    let refused = client(&cgroup, &ns, &["tcp", "10.96.0.11", "80", "1"]);
    assert!(
        refused[0].starts_with("error connect") && refused[0].contains("os error 1)"),
        "not EPERM: {refused:?}"
    );
}
