//! Stale connected UDP sockets, with real sockets: a resolver-like client (one connected UDP
//! socket, a query every 20 ms) in a network namespace and a cgroup of the test's, the socket
//! hooks attached to that cgroup. When its backend leaves the frontend, the socket iterator
//! destroys the socket (and only it), and the client's next socket goes to the remaining
//! backend. The gone backend still answers here: without the destruction the client would go on
//! talking to it, which the test would see.

use std::time::{Duration, Instant};

use kp_core::model::{Protocol, ServiceKey as ServiceName};
use kp_ebpf::{MapSizes, SocketLb};
use kp_ebpf_plan::{Planner, StaleUdp};
use kp_test::echo::{resolver_queries, spawn_resolver};
use kp_test::netns::{require_root, ChildGuard, Netns};

mod common;
use common::{ip, spec, Bpffs, Cgroup};

/// A UDP frontend `vip:53` with `backends`.
fn dns(vip: &str, backends: &[(&str, u16)]) -> kp_ebpf_plan::FrontendSpec {
    spec(vip, 53, Protocol::Udp, backends)
}

/// Who answered the queries made after `after` (on the client's clock, which starts after
/// the test's), in order; failures by their word.
fn answers_after(client: &ChildGuard, after: Duration) -> Vec<String> {
    resolver_queries(&client.log())
        .into_iter()
        .filter(|(at, _)| *at > after)
        .map(|(_, o)| o.label())
        .collect()
}

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
#[ignore = "needs root"]
fn a_connected_udp_socket_whose_backend_left_is_destroyed_and_its_client_moves_on() {
    if !require_root() {
        return;
    }
    let ns = Netns::new("ebpf-stale").expect("namespace");
    for cidr in ["10.244.1.1/32", "10.244.1.2/32"] {
        ns.add_addr("lo", cidr).expect("address on lo");
    }
    let _servers = [
        kp_test::echo::serve(&ns, "a", &[], &[5353]).expect("backend a"),
        kp_test::echo::serve(&ns, "b", &[], &[5354]).expect("backend b"),
    ];
    let cgroup = Cgroup::new();
    // Pinned, as the proxy loads it: kp_stale is not pinned, the rest is.
    let bpffs = Bpffs::new();
    let mut lb = SocketLb::load(MapSizes::default(), Some(&bpffs.path)).expect("load");
    assert!(!bpffs.path.join(kp_ebpf::stale_udp::MAP).exists());
    assert_eq!(
        lb.stale_udp_support(),
        Ok(()),
        "this machine's kernel has bpf_sock_destroy"
    );
    lb.attach(&cgroup.path).expect("attach");

    // Two Services, both on backend a: only the one whose backend goes loses its socket.
    let (gone, kept) = (ServiceName::new("t", "gone"), ServiceName::new("t", "kept"));
    let mut planner = Planner::new();
    let mut ops = planner
        .set_service(&gone, &[dns("10.96.0.10", &[("10.244.1.1", 5353)])])
        .expect("plan");
    ops.extend(
        planner
            .set_service(&kept, &[dns("10.96.0.11", &[("10.244.1.1", 5353)])])
            .expect("plan"),
    );
    lb.apply(&ops).expect("apply");

    ns.place_in_cgroup(Some(&cgroup.path));
    let started = Instant::now();
    let spawn = |vip: &str| {
        spawn_resolver(
            &ns,
            ip(vip),
            53,
            Duration::from_millis(20),
            Duration::from_millis(200),
            Duration::from_secs(4),
        )
        .expect("resolver")
    };
    let (moving, staying) = (spawn("10.96.0.10"), spawn("10.96.0.11"));
    wait_for(
        "both resolvers answered by a",
        Duration::from_secs(3),
        || {
            [&moving, &staying].iter().all(|c| {
                answers_after(c, Duration::ZERO)
                    .iter()
                    .filter(|b| *b == "a")
                    .count()
                    >= 3
            })
        },
    );

    // Backend a leaves 10.96.0.10 for b.
    let ops = planner
        .set_service(&gone, &[dns("10.96.0.10", &[("10.244.1.2", 5354)])])
        .expect("plan");
    lb.apply(&ops).expect("apply");
    let pairs = planner.take_stale_udp();
    let pair = StaleUdp {
        frontend: "10.96.0.10:53".parse().unwrap(),
        backend: "10.244.1.1:5353".parse().unwrap(),
    };
    assert_eq!(pairs, [pair]);
    let namespaces = kp_ebpf::cgroup::network_namespaces(&cgroup.path).expect("namespaces");
    assert_eq!(namespaces.len(), 1, "the resolvers' namespace");
    let destroyed = lb
        .destroy_stale_udp(&pairs, namespaces)
        .expect("destroying");
    let destroyed_at = started.elapsed();
    assert_eq!(destroyed, [pair], "one socket, the moving resolver's");

    wait_for(
        "answers after the destruction",
        Duration::from_secs(2),
        || {
            answers_after(&moving, destroyed_at).len() >= 5
                && answers_after(&staying, destroyed_at).len() >= 5
        },
    );
    let moved = answers_after(&moving, destroyed_at);
    let first_b = moved.iter().position(|b| b == "b");
    assert!(
        first_b.is_some_and(|i| i <= 2) && moved[first_b.unwrap()..].iter().all(|b| b == "b"),
        "the destroyed socket's client moves to b at once: {moved:?}\n{}",
        moving.log()
    );
    // Its next call failed (a destroyed UDP socket is disconnected: EDESTADDRREQ), maybe
    // before the test's clock read `destroyed_at`.
    let all = answers_after(&moving, Duration::ZERO);
    assert_eq!(
        all.iter().filter(|b| b.starts_with("error")).count(),
        1,
        "the client saw its socket destroyed, once: {all:?}"
    );
    let stayed = answers_after(&staying, Duration::ZERO);
    assert!(
        stayed.iter().all(|b| b == "a"),
        "the other frontend's socket stays with a, without an error: {stayed:?}"
    );
}
