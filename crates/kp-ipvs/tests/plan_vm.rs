//! The planner's changes applied to a real IPVS kernel converge: after applying a plan, the
//! kernel's dump leaves nothing to change. The test runs itself: on the host it boots the
//! kp-vm guest and runs this same test binary inside it (`KP_VM_GUEST` set), where it makes
//! its own network namespace and does the work.

use std::collections::BTreeSet;
use std::net::IpAddr;

use kp_core::frontend::Frontends;
use kp_core::model::{
    Endpoint, IpFamily, NodeInfo, Protocol, ServiceKey as K8sKey, ServicePort, ServicePortName,
};
use kp_core::select::select;
use kp_ipvs::Client;
use kp_ipvs_plan::{diff, Change, Config, Desired};
use kp_test::{Lab, Netns, Outcome, Proto};

mod common;
use common::in_guest;

fn ip(s: &str) -> IpAddr {
    s.parse().expect("address")
}

fn port(protocol: Protocol) -> ServicePort {
    ServicePort {
        name: ServicePortName {
            service: K8sKey::new("web", "api"),
            port: "http".into(),
            protocol,
        },
        cluster_ips: vec![ip("10.96.0.1")],
        port: 80,
        node_port: Some(30080),
        external_ips: Vec::new(),
        load_balancer_ips: vec![ip("198.51.100.10")],
        load_balancer_source_ranges: Vec::new(),
        session_affinity_timeout: None,
        internal_traffic_local: false,
        external_traffic_local: false,
        health_check_node_port: None,
    }
}

fn ep(addr: &str) -> Endpoint {
    Endpoint {
        ip: ip(addr),
        port: 8080,
        ready: true,
        serving: true,
        terminating: false,
        is_local: false,
        zone_hints: None::<BTreeSet<String>>,
    }
}

fn desired(ports: &[(ServicePort, Vec<Endpoint>)], config: &Config) -> Desired {
    let mut d = Desired::new();
    for (p, eps) in ports {
        let sel = select(p, eps, &NodeInfo::default());
        d.add(
            &Frontends::new(p, &sel, IpFamily::V4),
            &[ip("192.0.2.1")],
            config,
        );
    }
    d
}

/// kp-test's lab (client 192.0.2.2 -> node 192.0.2.1, forwarding -> pods 10.244.1.10, .11)
/// with an echo server on port 8080 of both pods and the virtual address 10.96.0.1 on the
/// node's `kube-ipvs0`, as the ipvs mode holds it.
fn vip_lab() -> (Lab, Vec<kp_test::ChildGuard>) {
    let lab = Lab::new(2).expect("lab");
    let servers = (0..2)
        .map(|i| lab.serve_echo(i, &[8080], &[]).expect("kp-echo"))
        .collect();
    let node = lab.node();
    node.ip(&["link", "add", "kube-ipvs0", "type", "dummy"])
        .expect("dummy link");
    node.add_addr("kube-ipvs0", "10.96.0.1/32").expect("VIP");
    node.link_up("kube-ipvs0").expect("up");
    (lab, servers)
}

/// The TCP port 10.96.0.1:80 alone (no NodePort, no load balancer).
fn vip_port() -> ServicePort {
    let mut p = port(Protocol::Tcp);
    p.node_port = None;
    p.load_balancer_ips.clear();
    p
}

/// Pod `i` of [`vip_lab`] as an endpoint on port 8080.
fn pod_endpoint(lab: &Lab, i: usize) -> Endpoint {
    Endpoint {
        ip: lab.pod_ip(i),
        ..ep("0.0.0.0")
    }
}

/// 10.96.0.1:80 in IPVS, round robin over both pods of [`vip_lab`]: the client, the port and
/// the configuration.
fn round_robin_over_both_pods(lab: &Lab) -> (Client, ServicePort, Config) {
    let p = vip_port();
    let config = Config::new("rr", 0, Vec::new()).expect("config");
    let mut client = Client::open(Some(lab.node().name())).expect("IPVS client");
    let pods = vec![pod_endpoint(lab, 0), pod_endpoint(lab, 1)];
    sync(
        &mut client,
        &desired(&[(p.clone(), pods)], &config),
        &config,
    );
    (client, p, config)
}

/// Starts a long-lived connection from the lab's client through 10.96.0.1:80 (a line every
/// 100 ms for `duration_ms`) and returns it with the real server IPVS gave it, once IPVS
/// counts it established there.
fn stream_to_a_busy_real_server(
    lab: &Lab,
    client: &mut Client,
    duration_ms: u32,
) -> (kp_test::ChildGuard, IpAddr) {
    let mut stream = kp_test::echo::spawn_stream(
        lab.client(),
        ip("10.96.0.1"),
        80,
        std::time::Duration::from_millis(100),
        std::time::Duration::from_millis(duration_ms.into()),
    )
    .expect("stream");
    loop {
        let dump = client.dump().expect("dump");
        if let Some(d) = dump[0].1.iter().find(|d| d.active_connections == 1) {
            return (stream, d.destination.addr);
        }
        assert!(
            stream.try_wait().expect("stream").is_none(),
            "{}",
            stream.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Diffs against the kernel, applies, and checks that the next diff is empty; returns the
/// applied changes.
fn sync(client: &mut Client, want: &Desired, config: &Config) -> Vec<Change> {
    let plan = diff(want, &client.dump().expect("dump"), config);
    client.apply(&plan.changes).expect("apply");
    let again = diff(want, &client.dump().expect("dump"), config);
    assert_eq!(again.changes, [], "not converged after {:?}", plan.changes);
    plan.changes
}

#[test]
#[ignore = "needs root"]
fn planned_changes_converge_in_a_real_ipvs_kernel() {
    if !kp_test::netns::require_root()
        || !in_guest("planned_changes_converge_in_a_real_ipvs_kernel")
    {
        return;
    }
    let ns = Netns::new("ipvs-plan").expect("namespace");
    let mut client = Client::open(Some(ns.name())).expect("IPVS client");
    let config = Config::new("rr", 0, Vec::new()).expect("config");

    // A TCP and a UDP port: 3 virtual servers each (ClusterIP, LB IP, NodePort on one node
    // address), 2 real servers each.
    let eps = vec![ep("10.244.1.5"), ep("10.244.2.5")];
    let mut ports = vec![
        (port(Protocol::Tcp), eps.clone()),
        (port(Protocol::Udp), eps.clone()),
    ];
    let first = sync(&mut client, &desired(&ports, &config), &config);
    assert_eq!(first.len(), 6 + 6 * 2);
    let dumped = client.dump().expect("dump");
    assert_eq!(dumped.len(), 6);
    assert!(dumped.iter().all(|(_, d)| d.len() == 2));

    // One endpoint replaced in each port: per virtual server one add and one delete (no
    // connections, so the TCP one goes at once too).
    for (_, e) in &mut ports {
        e[1] = ep("10.244.3.5");
    }
    let change = sync(&mut client, &desired(&ports, &config), &config);
    assert_eq!(change.len(), 12, "{change:?}");
    assert_eq!(
        change
            .iter()
            .filter(|c| matches!(c, Change::AddDestination(..)))
            .count(),
        6
    );

    // A scheduler change updates in place; the UDP port's removal deletes its virtual servers.
    let lc = Config::new("lc", 0, Vec::new()).expect("config");
    ports.pop();
    let last = sync(&mut client, &desired(&ports, &lc), &lc);
    let updates = last
        .iter()
        .filter(|c| matches!(c, Change::UpdateService(s) if s.scheduler == "lc"))
        .count();
    let deletes = last
        .iter()
        .filter(|c| matches!(c, Change::DeleteService(_)))
        .count();
    assert_eq!((updates, deletes, last.len()), (3, 3, 6), "{last:?}");
    assert!(client
        .services()
        .expect("services")
        .iter()
        .all(|s| s.scheduler == "lc"));

    // Pipelined: more changes than one datagram holds, with a refusal in the middle (a real
    // server for a virtual server that does not exist). The first refusal is returned, named
    // as a single request would name it, and the requests around it ran.
    client.flush().expect("flush");
    let svc = |i: u16| {
        kp_netlink::ipvs::Service::new(
            kp_netlink::ipvs::ServiceKey::Addr {
                addr: ip("10.96.1.1"),
                protocol: kp_ipvs::IpvsProtocol::Tcp,
                port: 1000 + i,
            },
            "rr",
        )
    };
    let n = kp_ipvs::PIPELINE as u16 + 50;
    let missing = kp_netlink::ipvs::ServiceKey::Addr {
        addr: ip("10.96.1.2"),
        protocol: kp_ipvs::IpvsProtocol::Tcp,
        port: 80,
    };
    let mut changes: Vec<Change> = (0..n).map(|i| Change::AddService(svc(i))).collect();
    changes.insert(
        10,
        Change::AddDestination(
            missing,
            kp_netlink::ipvs::Destination::masquerade(ip("10.244.1.5"), 8080, 1),
        ),
    );
    let refused = client.apply(&changes).expect_err("a refusal");
    assert_eq!(
        refused.to_string(),
        "add destination 10.244.1.5:8080 to TCP 10.96.1.2:80: ESRCH (No such process)",
        "{refused:?}"
    );
    // The first datagram ran whole (the refusal does not stop it); the next was not sent.
    let added = client.services().expect("services").len();
    assert_eq!(
        added,
        kp_ipvs::PIPELINE - 1,
        "services after the refused datagram"
    );
    client
        .apply(&changes[kp_ipvs::PIPELINE..])
        .expect("the rest");
    assert_eq!(client.services().expect("services").len(), n as usize);
    client.flush().expect("flush");
}

#[test]
#[ignore = "needs root"]
fn a_removed_real_server_drains_at_weight_zero_under_a_held_tcp_connection() {
    if !kp_test::netns::require_root()
        || !in_guest("a_removed_real_server_drains_at_weight_zero_under_a_held_tcp_connection")
    {
        return;
    }
    let (lab, _servers) = vip_lab();
    let (mut client, p, config) = round_robin_over_both_pods(&lab);
    let pod = |i: usize| pod_endpoint(&lab, i);

    // A long-lived connection through the virtual server.
    let (mut stream, held) = stream_to_a_busy_real_server(&lab, &mut client, 6000);
    let vip = ip("10.96.0.1");
    let (gone, kept) = if held == lab.pod_ip(0) {
        (0, 1)
    } else {
        (1, 0)
    };

    // Its endpoint goes: weight 0, listed as draining, not deleted.
    let want = desired(&[(p.clone(), vec![pod(kept)])], &config);
    let plan = diff(&want, &client.dump().expect("dump"), &config);
    assert_eq!(plan.changes.len(), 1, "{:?}", plan.changes);
    assert!(
        matches!(&plan.changes[0], Change::UpdateDestination(_, d) if d.addr == held && d.weight == 0),
        "{:?}",
        plan.changes
    );
    assert_eq!(plan.draining.len(), 1);
    client.apply(&plan.changes).expect("apply");

    // New connections go to the other real server only.
    for _ in 0..4 {
        match lab.request(lab.client(), Proto::Tcp, vip, 80) {
            Outcome::Answered { backend, .. } => assert_eq!(backend, lab.pod_name(kept)),
            other => panic!("no answer through the virtual server: {other:?}"),
        }
    }
    // The held connection lives on to its end, every line echoed.
    let status = loop {
        if let Some(s) = stream.try_wait().expect("stream") {
            break s;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    let log = stream.log();
    assert!(status.success(), "{log}");
    assert!(
        log.contains(&format!("stream {} ", lab.pod_name(gone))),
        "{log}"
    );
    assert!(!log.contains("failed="), "{log}");
    let (sent, echoed) = counts(&log);
    assert!(sent > 10 && sent == echoed, "{log}");

    // Closed, the connection still counts (IPVS keeps it in TIME_WAIT for two minutes), so the
    // next diff keeps the real server draining and changes nothing; deletion once the counts
    // reach zero is the planner's unit tests' to show.
    let plan = diff(&want, &client.dump().expect("dump"), &config);
    assert_eq!(plan.changes, []);
    assert_eq!(plan.draining.len(), 1, "{plan:?}");
    assert_eq!(plan.draining[0].addr, held);
}

#[test]
#[ignore = "needs root"]
fn the_scheduler_is_honoured_lc_picks_the_idle_real_server_and_sh_keeps_a_source_on_one() {
    if !kp_test::netns::require_root()
        || !in_guest(
            "the_scheduler_is_honoured_lc_picks_the_idle_real_server_and_sh_keeps_a_source_on_one",
        )
    {
        return;
    }
    let (lab, _servers) = vip_lab();
    let node = lab.node();
    let p = vip_port();
    let pods = vec![pod_endpoint(&lab, 0), pod_endpoint(&lab, 1)];
    let vip = ip("10.96.0.1");
    let mut client = Client::open(Some(node.name())).expect("IPVS client");
    let backend = |lab: &Lab| match lab.request(lab.client(), Proto::Tcp, vip, 80) {
        Outcome::Answered { backend, .. } => backend,
        other => panic!("no answer through the virtual server: {other:?}"),
    };

    // lc: with one real server holding a connection, new ones go to the idle one (its
    // finished connections, inactive, weigh 1/256 of an active one).
    let lc = Config::new("lc", 0, Vec::new()).expect("config");
    sync(
        &mut client,
        &desired(&[(p.clone(), pods.clone())], &lc),
        &lc,
    );
    assert_eq!(client.services().expect("services")[0].scheduler, "lc");
    let (mut stream, held) = stream_to_a_busy_real_server(&lab, &mut client, 4000);
    let idle = if held == lab.pod_ip(0) { 1 } else { 0 };
    for _ in 0..6 {
        assert_eq!(backend(&lab), lab.pod_name(idle));
    }
    let status = loop {
        if let Some(s) = stream.try_wait().expect("stream") {
            break s;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    assert!(status.success(), "{}", stream.log());

    // sh: one source, one real server, connection after connection (rr would alternate).
    let sh = Config::new("sh", 0, Vec::new()).expect("config");
    let changes = sync(
        &mut client,
        &desired(&[(p.clone(), pods.clone())], &sh),
        &sh,
    );
    assert_eq!(changes.len(), 1, "{changes:?}");
    assert_eq!(client.services().expect("services")[0].scheduler, "sh");
    let first = backend(&lab);
    for _ in 0..7 {
        assert_eq!(backend(&lab), first);
    }
    // And rr again alternates, so the check above could fail.
    let rr = Config::new("rr", 0, Vec::new()).expect("config");
    sync(&mut client, &desired(&[(p, pods)], &rr), &rr);
    let seen: BTreeSet<String> = (0..4).map(|_| backend(&lab)).collect();
    assert_eq!(seen.len(), 2, "{seen:?}");
}

/// `sent=N echoed=N` of kp-echo's stream line.
fn counts(log: &str) -> (u64, u64) {
    let field = |name: &str| {
        log.split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    (field("sent="), field("echoed="))
}

/// A mode switch away from ipvs keeps a virtual server whose real server carries an
/// established connection, and deletes its idle real servers (with their entries); the kept
/// real servers IPVS also keeps closing connections' entries on are what another mode must not
/// connect clients straight to (`held_real_servers`): the busy one, read before the removal as
/// after it; after a removal without keeping, none.
#[test]
#[ignore = "needs root"]
fn a_draining_removal_keeps_the_busy_real_server_and_says_it_is_held() {
    use kp_core::dataplane::HeldBackend;
    use kp_ipvs::cleanup::{held_real_servers, remove_leftovers, remove_leftovers_keeping, Keep};

    if !kp_test::netns::require_root()
        || !in_guest("a_draining_removal_keeps_the_busy_real_server_and_says_it_is_held")
    {
        return;
    }
    let (lab, _servers) = vip_lab();
    let node = lab.node();
    let (mut client, _, _) = round_robin_over_both_pods(&lab);
    let netns = Some(node.name());
    let iptables = kp_iptables::IptablesCommand::in_netns(node.name());
    let held_of = |i: usize| HeldBackend {
        protocol: Protocol::Tcp,
        addr: std::net::SocketAddr::new(lab.pod_ip(i), 8080),
    };
    assert_eq!(
        held_real_servers(netns, &[]).expect("held"),
        BTreeSet::new(),
        "no connection, nothing held"
    );

    // A long-lived connection through the virtual server, then closed ones to both real
    // servers (round robin): IPVS keeps their entries in TIME_WAIT.
    let (mut stream, busy) = stream_to_a_busy_real_server(&lab, &mut client, 20000);
    let busy = if busy == lab.pod_ip(0) { 0 } else { 1 };
    for _ in 0..4 {
        let answer = lab.request(lab.client(), Proto::Tcp, ip("10.96.0.1"), 80);
        assert!(matches!(answer, Outcome::Answered { .. }), "{answer:?}");
    }
    let dump = client.dump().expect("dump");
    assert!(
        dump[0].1.iter().all(|d| d.inactive_connections > 0),
        "both real servers keep closed connections' entries: {dump:?}"
    );
    assert_eq!(
        held_real_servers(netns, &[]).expect("held"),
        BTreeSet::from([held_of(busy)]),
        "the idle one goes with its entries at the removal: {dump:?}"
    );
    let service_cidr: ipnet::IpNet = "10.96.0.0/16".parse().expect("CIDR");
    assert_eq!(
        held_real_servers(netns, &[service_cidr]).expect("held"),
        BTreeSet::new(),
        "an excluded virtual server is not the mode's"
    );

    // A switch: the idle real server goes with its entries, the busy one stays, held.
    let keep = Keep {
        draining: true,
        ..Keep::default()
    };
    let removed = remove_leftovers_keeping(netns, &iptables, &[], &keep).expect("removal");
    assert_eq!(
        (removed.draining, removed.real_servers),
        (1, 1),
        "{removed:?}"
    );
    let dump = client.dump().expect("dump");
    let left: Vec<IpAddr> = dump[0].1.iter().map(|d| d.destination.addr).collect();
    assert_eq!(left, [lab.pod_ip(busy)], "{dump:?}");
    assert_eq!(
        held_real_servers(netns, &[]).expect("held"),
        BTreeSet::from([held_of(busy)])
    );
    // The long-lived connection lives on through it.
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(
        stream.try_wait().expect("stream").is_none(),
        "{}",
        stream.log()
    );

    // `--cleanup`: everything goes, nothing is held.
    let removed = remove_leftovers(netns, &iptables, &[]).expect("cleanup");
    assert!(removed.interface, "{removed:?}");
    assert_eq!(
        held_real_servers(netns, &[]).expect("held"),
        BTreeSet::new()
    );
    let _ = stream.kill_now();
}
