use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use kp_core::flow::Origin;
use kp_core::model::Protocol;
use kp_core::node::DetectLocal;
use kp_core::track::{Changes, Object, SourceEvent};
use kp_flows::Expect;

use super::*;

fn cluster_cidrs() -> DetectLocal {
    DetectLocal::ClusterCidr(vec![
        kp_flows::CLUSTER_CIDR.parse().expect("cidr"),
        kp_flows::CLUSTER_CIDR6.parse().expect("cidr"),
    ])
}

fn config(scheduler: Scheduler) -> BalancerConfig {
    BalancerConfig {
        scheduler,
        masquerade_all: false,
        detect_local: cluster_cidrs(),
        quarantine: Duration::from_secs(10),
    }
}

fn synced(config: BalancerConfig) -> Balancer {
    let mut b = Balancer::new(config);
    b.sync(
        &kp_flows::state(),
        &kp_flows::node_context(),
        &Changes::default(),
        true,
    );
    b
}

fn sa(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().expect("address"), port)
}

/// The fixture pod at `ep`'s address.
fn pod_name(ep: SocketAddr) -> &'static str {
    kp_flows::pods()
        .into_iter()
        .find(|p| {
            p.v4.parse::<IpAddr>().ok() == Some(ep.ip())
                || p.v6.and_then(|a| a.parse().ok()) == Some(ep.ip())
        })
        .map(|p| p.name)
        .unwrap_or_else(|| panic!("no fixture pod at {ep}"))
}

const POD4: &str = "10.244.1.14";

fn connect(pick: Pick) -> (RouteId, Vec<Attempt>) {
    match pick {
        Pick::Connect { route, attempts } => (route, attempts),
        other => panic!("expected Connect, got {other:?}"),
    }
}

/// The first attempt's pod for a connection from `client` to `dst`.
fn first(b: &mut Balancer, dst: SocketAddr, client: &str, now: Instant) -> &'static str {
    let (_, attempts) = connect(b.pick(Protocol::Tcp, dst, sa(client, 40000), false, now));
    pod_name(attempts[0].endpoint)
}

fn web() -> SocketAddr {
    sa("10.96.0.10", 80)
}

#[test]
fn scheduler_names_parse_as_ipvs_spells_them_and_others_are_refused() {
    for s in Scheduler::ALL {
        assert_eq!(s.as_str().parse::<Scheduler>(), Ok(s));
    }
    assert_eq!("".parse::<Scheduler>(), Ok(Scheduler::RoundRobin));
    let err = "wrr"
        .parse::<Scheduler>()
        .expect_err("wrr is not supported");
    assert!(
        err.contains("wrr") && err.contains("rr, lc, sh, dh, sed, nq"),
        "{err}"
    );
}

#[test]
fn round_robin_takes_each_endpoint_in_turn() {
    let mut b = synced(config(Scheduler::RoundRobin));
    let now = Instant::now();
    let seq: Vec<&str> = (0..6).map(|_| first(&mut b, web(), POD4, now)).collect();
    assert_eq!(seq, ["pod-1", "pod-2", "pod-3", "pod-1", "pod-2", "pod-3"]);
}

#[test]
fn every_pick_lists_every_endpoint_once_with_the_choice_first() {
    let mut b = synced(config(Scheduler::RoundRobin));
    let now = Instant::now();
    first(&mut b, web(), POD4, now);
    let (_, attempts) = connect(b.pick(Protocol::Tcp, web(), sa(POD4, 1), false, now));
    let order: Vec<&str> = attempts.iter().map(|a| pod_name(a.endpoint)).collect();
    assert_eq!(order, ["pod-2", "pod-3", "pod-1"]);
}

#[test]
fn least_connection_picks_the_endpoint_with_fewest_active_connections() {
    let mut b = synced(config(Scheduler::LeastConnection));
    let now = Instant::now();
    let mut seq = Vec::new();
    let mut opened = Vec::new();
    for _ in 0..3 {
        let (route, attempts) = connect(b.pick(Protocol::Tcp, web(), sa(POD4, 1), false, now));
        seq.push(pod_name(attempts[0].endpoint));
        b.report(&route, attempts[0].endpoint, Outcome::Connected, now);
        opened.push((route, attempts[0].endpoint));
    }
    assert_eq!(seq, ["pod-1", "pod-2", "pod-3"]);
    // pod-2's connection ends: it has fewest now.
    let (route, ep) = &opened[1];
    b.report(route, *ep, Outcome::Closed, now);
    assert_eq!(b.active(route, *ep), 0);
    assert_eq!(first(&mut b, web(), POD4, now), "pod-2");
    // Without reports nothing changes: ties go to the first in order.
    assert_eq!(first(&mut b, web(), POD4, now), "pod-2");
}

#[test]
fn shortest_expected_delay_and_never_queue_follow_active_counts() {
    for scheduler in [Scheduler::ShortestExpectedDelay, Scheduler::NeverQueue] {
        let mut b = synced(config(scheduler));
        let now = Instant::now();
        let (route, attempts) = connect(b.pick(Protocol::Tcp, web(), sa(POD4, 1), false, now));
        let pod1 = attempts[0].endpoint;
        assert_eq!(pod_name(pod1), "pod-1");
        // Two connections on pod-1, one on pod-2: pod-3 is idle and goes next.
        b.report(&route, pod1, Outcome::Connected, now);
        b.report(&route, pod1, Outcome::Connected, now);
        let pod2 = attempts[1].endpoint;
        b.report(&route, pod2, Outcome::Connected, now);
        assert_eq!(first(&mut b, web(), POD4, now), "pod-3", "{scheduler}");
        // pod-3 busy with 2 as well: pod-2 (1 active) has the smallest expected delay.
        let pod3 = attempts[2].endpoint;
        b.report(&route, pod3, Outcome::Connected, now);
        b.report(&route, pod3, Outcome::Connected, now);
        assert_eq!(first(&mut b, web(), POD4, now), "pod-2", "{scheduler}");
    }
}

#[test]
fn never_queue_keeps_choosing_an_idle_endpoint_until_the_proxy_reports_a_connection() {
    // With every weight 1, lc, sed and nq choose alike (they differ only with weights): the
    // first endpoint with the fewest active connections. Without a report nothing moves.
    let mut b = synced(config(Scheduler::NeverQueue));
    let now = Instant::now();
    let (route, attempts) = connect(b.pick(Protocol::Tcp, web(), sa(POD4, 1), false, now));
    b.report(&route, attempts[0].endpoint, Outcome::Connected, now);
    let seq: Vec<&str> = (0..3).map(|_| first(&mut b, web(), POD4, now)).collect();
    assert_eq!(seq, ["pod-2", "pod-2", "pod-2"]);
}

#[test]
fn every_pick_is_each_endpoint_once_with_quarantined_ones_last_for_every_scheduler() {
    for scheduler in Scheduler::ALL {
        let mut b = synced(config(scheduler));
        let t0 = Instant::now();
        let (route, attempts) = connect(b.pick(Protocol::Tcp, web(), sa(POD4, 1), false, t0));
        let all: BTreeSet<SocketAddr> = attempts.iter().map(|a| a.endpoint).collect();
        let mut bad: Vec<SocketAddr> = Vec::new();
        // Quarantine one, then two endpoints; each pick stays a permutation, healthy first.
        for failed in attempts.iter().take(2) {
            b.report(&route, failed.endpoint, Outcome::Refused, t0);
            bad.push(failed.endpoint);
            for i in 0..5 {
                let client = format!("10.244.1.{}", 100 + i);
                let (_, got) = connect(b.pick(Protocol::Tcp, web(), sa(&client, 1), false, t0));
                let eps: Vec<SocketAddr> = got.iter().map(|a| a.endpoint).collect();
                assert_eq!(eps.len(), all.len(), "{scheduler}: {eps:?}");
                assert_eq!(
                    eps.iter().copied().collect::<BTreeSet<_>>(),
                    all,
                    "{scheduler}"
                );
                let healthy = all.len() - bad.len();
                assert!(
                    eps[..healthy].iter().all(|e| !bad.contains(e)),
                    "{scheduler}: a quarantined endpoint before a healthy one: {eps:?}"
                );
            }
        }
    }
}

#[test]
fn source_hashing_keeps_each_client_on_one_endpoint_and_spreads_clients() {
    let mut b = synced(config(Scheduler::SourceHashing));
    let now = Instant::now();
    let mut seen = BTreeSet::new();
    for i in 0..20 {
        let client = format!("10.244.1.{}", 100 + i);
        let a = first(&mut b, web(), &client, now);
        for _ in 0..3 {
            assert_eq!(first(&mut b, web(), &client, now), a);
        }
        seen.insert(a);
    }
    assert_eq!(
        seen.len(),
        3,
        "20 clients should reach all 3 endpoints: {seen:?}"
    );
}

#[test]
fn destination_hashing_sends_every_client_of_a_frontend_to_one_endpoint() {
    let mut b = synced(config(Scheduler::DestinationHashing));
    let now = Instant::now();
    let a = first(&mut b, web(), POD4, now);
    for i in 0..10 {
        assert_eq!(
            first(&mut b, web(), &format!("10.244.1.{}", 100 + i), now),
            a
        );
    }
}

#[test]
fn hashing_schedulers_move_on_when_the_hashed_endpoint_is_quarantined() {
    let mut b = synced(config(Scheduler::SourceHashing));
    let now = Instant::now();
    let (route, attempts) = connect(b.pick(Protocol::Tcp, web(), sa(POD4, 1), false, now));
    b.report(&route, attempts[0].endpoint, Outcome::Refused, now);
    let (_, again) = connect(b.pick(Protocol::Tcp, web(), sa(POD4, 1), false, now));
    assert_ne!(again[0].endpoint, attempts[0].endpoint);
    assert_eq!(again.last().map(|a| a.endpoint), Some(attempts[0].endpoint));
}

#[test]
fn a_refusing_endpoint_is_tried_last_until_its_quarantine_expires() {
    let mut b = synced(config(Scheduler::RoundRobin));
    let t0 = Instant::now();
    let (route, attempts) = connect(b.pick(Protocol::Tcp, web(), sa(POD4, 1), false, t0));
    let pod1 = attempts[0].endpoint;
    b.report(&route, pod1, Outcome::Refused, t0);
    b.report(&route, attempts[1].endpoint, Outcome::TimedOut, t0);
    assert_eq!(b.stats().refused, 1);
    assert_eq!(b.stats().timed_out, 1);
    assert_eq!(b.stats().quarantined, 2);
    assert_eq!(b.quarantined(), 2);
    for _ in 0..4 {
        let (_, a) = connect(b.pick(Protocol::Tcp, web(), sa(POD4, 1), false, t0));
        let order: Vec<&str> = a.iter().map(|x| pod_name(x.endpoint)).collect();
        assert_eq!(order[0], "pod-3", "{order:?}");
        assert_eq!(order.len(), 3);
        assert!(order[1..].contains(&"pod-1") && order[1..].contains(&"pod-2"));
    }
    // 10 s later both are healthy again, and expire() forgets them.
    let later = t0 + Duration::from_secs(10);
    let seq: BTreeSet<&str> = (0..3).map(|_| first(&mut b, web(), POD4, later)).collect();
    assert_eq!(seq.len(), 3);
    b.expire(later);
    assert_eq!(b.quarantined(), 0);
}

#[test]
fn failing_again_while_quarantined_extends_without_counting_twice() {
    let mut b = synced(config(Scheduler::RoundRobin));
    let t0 = Instant::now();
    let (route, attempts) = connect(b.pick(Protocol::Tcp, web(), sa(POD4, 1), false, t0));
    let ep = attempts[0].endpoint;
    b.report(&route, ep, Outcome::Refused, t0);
    b.report(&route, ep, Outcome::Refused, t0 + Duration::from_secs(5));
    assert_eq!(b.stats().quarantined, 1);
    b.expire(t0 + Duration::from_secs(12));
    assert_eq!(
        b.quarantined(),
        1,
        "the second failure extended the quarantine to 15 s"
    );
    b.expire(t0 + Duration::from_secs(15));
    assert_eq!(b.quarantined(), 0);
}

#[test]
fn when_every_endpoint_is_quarantined_all_are_still_tried() {
    let mut b = synced(config(Scheduler::RoundRobin));
    let t0 = Instant::now();
    let (route, attempts) = connect(b.pick(Protocol::Tcp, web(), sa(POD4, 1), false, t0));
    for a in &attempts {
        b.report(&route, a.endpoint, Outcome::Refused, t0);
    }
    let (_, again) = connect(b.pick(Protocol::Tcp, web(), sa(POD4, 1), false, t0));
    assert_eq!(again.len(), 3);
}

fn sticky() -> SocketAddr {
    sa("10.96.0.30", 80)
}

#[test]
fn client_ip_affinity_sticks_until_its_timeout_then_expires() {
    let mut b = synced(config(Scheduler::RoundRobin));
    let t0 = Instant::now();
    let a = first(&mut b, sticky(), POD4, t0);
    for s in 1..5 {
        assert_eq!(
            first(&mut b, sticky(), POD4, t0 + Duration::from_secs(s)),
            a
        );
    }
    assert_eq!(b.stats().affinity_hits, 4);
    // Each use refreshes the entry: 60 s after the last use it is gone.
    let last = t0 + Duration::from_secs(4);
    // Another client is not affected by the first one's entry: rr moves on.
    assert_ne!(first(&mut b, sticky(), "10.244.1.13", last), a);
    b.expire(last + Duration::from_secs(59));
    assert_eq!(b.affinity_entries(), 2);
    b.expire(last + Duration::from_secs(60));
    assert_eq!(b.affinity_entries(), 0);
}

#[test]
fn an_expired_affinity_lets_the_scheduler_choose_again() {
    let mut b = synced(config(Scheduler::RoundRobin));
    let t0 = Instant::now();
    let a = first(&mut b, sticky(), POD4, t0);
    let later = t0 + Duration::from_secs(61);
    assert_ne!(first(&mut b, sticky(), POD4, later), a);
}

#[test]
fn affinity_to_a_quarantined_endpoint_gives_way() {
    let mut b = synced(config(Scheduler::RoundRobin));
    let t0 = Instant::now();
    let (route, attempts) = connect(b.pick(Protocol::Tcp, sticky(), sa(POD4, 1), false, t0));
    b.report(&route, attempts[0].endpoint, Outcome::Refused, t0);
    let b2 = first(&mut b, sticky(), POD4, t0);
    assert_ne!(b2, pod_name(attempts[0].endpoint));
    assert_eq!(
        first(&mut b, sticky(), POD4, t0),
        b2,
        "sticks to the new choice"
    );
}

/// The kp-flows rows through the balancer alone: every row the kernel redirects gets the
/// expected endpoints and sources; rows the kernel rejects or drops by itself are no
/// connection here either.
#[test]
fn the_flow_table_rows_get_their_endpoints_and_sources() {
    let mut b = synced(config(Scheduler::RoundRobin));
    let now = Instant::now();
    let mut failures = Vec::new();
    for case in kp_flows::cases() {
        let p = &case.packet;
        let pick = b.pick(
            p.protocol,
            SocketAddr::new(p.dst, p.dport),
            SocketAddr::new(p.src, 40000),
            p.origin == Origin::Node,
            now,
        );
        match (&case.expect, pick) {
            (Expect::Pods { .. }, Pick::Connect { attempts, .. }) => {
                let want = kp_flows::expected_verdict(&case);
                let kp_core::flow::Verdict::Dnat {
                    endpoints,
                    masquerade,
                    ..
                } = want
                else {
                    unreachable!("Pods rows expect Dnat");
                };
                let got: BTreeSet<(IpAddr, u16)> = attempts
                    .iter()
                    .map(|a| (a.endpoint.ip(), a.endpoint.port()))
                    .collect();
                let sources: BTreeSet<Source> = attempts.iter().map(|a| a.source).collect();
                let want_source = if masquerade {
                    Source::Node
                } else {
                    Source::Client
                };
                if got != endpoints || sources != BTreeSet::from([want_source]) {
                    failures.push(format!("{}: got {got:?} {sources:?}", case.name));
                }
            }
            (Expect::Pods { .. }, other) => failures.push(format!("{}: got {other:?}", case.name)),
            (Expect::Reject, Pick::Reject | Pick::NotAService)
            | (Expect::Drop, Pick::Drop | Pick::NotAService)
            | (Expect::Untouched, Pick::NotAService) => {}
            (_, other) => failures.push(format!("{}: got {other:?}", case.name)),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn local_policy_without_local_endpoints_drops_outside_clients_and_serves_pods_and_node() {
    let mut b = synced(config(Scheduler::RoundRobin));
    let now = Instant::now();
    let np = sa(kp_flows::NODE_IP, 30071);
    assert_eq!(
        b.pick(Protocol::Tcp, np, sa(kp_flows::CLIENT, 1), false, now),
        Pick::Drop
    );
    let (_, pod) = connect(b.pick(Protocol::Tcp, np, sa(POD4, 1), false, now));
    assert_eq!(pod[0].source, Source::Client);
    let (_, node) = connect(b.pick(Protocol::Tcp, np, sa(kp_flows::NODE_IP, 1), true, now));
    assert_eq!(node[0].source, Source::Node);
    assert_eq!(pod_name(node[0].endpoint), "remote-1");
}

#[test]
fn hairpin_to_the_clients_own_address_goes_from_the_node() {
    let mut b = synced(config(Scheduler::RoundRobin));
    let now = Instant::now();
    // web from pod-1: pod-1's own attempt is masqueraded, the others keep the source.
    let (_, attempts) = connect(b.pick(Protocol::Tcp, web(), sa("10.244.1.11", 1), false, now));
    for a in attempts {
        let want = if pod_name(a.endpoint) == "pod-1" {
            Source::Node
        } else {
            Source::Client
        };
        assert_eq!(a.source, want, "{}", a.endpoint);
    }
}

#[test]
fn masquerade_follows_each_frontend_kind() {
    let now = Instant::now();
    let client = sa(kp_flows::CLIENT, 1);
    let pod = sa(POD4, 1);
    let node = sa(kp_flows::NODE_IP, 1);
    let source = |b: &mut Balancer, dst: SocketAddr, from: SocketAddr, is_node: bool| {
        connect(b.pick(Protocol::Tcp, dst, from, is_node, now)).1[0].source
    };
    let mut b = synced(config(Scheduler::RoundRobin));
    // ClusterIP: not from pods.
    assert_eq!(source(&mut b, web(), pod, false), Source::Client);
    assert_eq!(source(&mut b, web(), client, false), Source::Node);
    assert_eq!(source(&mut b, web(), node, true), Source::Node);
    // External IP, LoadBalancer IP, NodePort with Cluster policy: always.
    for dst in [
        sa("198.51.100.10", 80),
        sa("198.51.100.20", 80),
        sa(kp_flows::NODE_IP, 30080),
    ] {
        assert_eq!(source(&mut b, dst, client, false), Source::Node, "{dst}");
    }
    // (The LoadBalancer's source ranges leave pods out.)
    for dst in [sa("198.51.100.10", 80), sa(kp_flows::NODE_IP, 30080)] {
        assert_eq!(source(&mut b, dst, pod, false), Source::Node, "{dst}");
    }
    // Local policy: only from the node.
    for dst in [sa("198.51.100.70", 80), sa(kp_flows::NODE_IP, 30070)] {
        assert_eq!(source(&mut b, dst, client, false), Source::Client, "{dst}");
        assert_eq!(source(&mut b, dst, pod, false), Source::Client, "{dst}");
        assert_eq!(source(&mut b, dst, node, true), Source::Node, "{dst}");
    }
    // masqueradeAll: every ClusterIP connection.
    let mut all = synced(BalancerConfig {
        masquerade_all: true,
        ..config(Scheduler::RoundRobin)
    });
    assert_eq!(source(&mut all, web(), pod, false), Source::Node);
    // No detect-local: a ClusterIP keeps every source but the node's.
    let mut none = synced(BalancerConfig {
        detect_local: DetectLocal::None,
        ..config(Scheduler::RoundRobin)
    });
    assert_eq!(source(&mut none, web(), client, false), Source::Client);
    assert_eq!(source(&mut none, web(), node, true), Source::Node);
}

/// Detect-local by interface: a connection is a pod's when it arrived on the pods'
/// interface(s) (accepted on the pod port), whatever its address; one from the same pod
/// address accepted on the proxy port is not (it came in elsewhere), and with detect-local by
/// CIDR the address decides, not the port.
#[test]
fn with_detect_local_by_interface_the_arrival_decides_what_is_a_pods() {
    let now = Instant::now();
    let pod = sa(POD4, 1);
    let client = sa(kp_flows::CLIENT, 1);
    for (detect, _) in kp_flows::interface_detect_locals() {
        let mut b = Balancer::new(BalancerConfig {
            detect_local: detect.clone(),
            ..config(Scheduler::RoundRobin)
        });
        b.sync(
            &kp_flows::state(),
            &kp_flows::node_context_with(&detect),
            &Changes::default(),
            true,
        );
        let mut source = |dst: SocketAddr, from: SocketAddr, arrival: Arrival| {
            connect(b.pick_via(Protocol::Tcp, dst, from, arrival, now)).1[0].source
        };
        // ClusterIP: a pod's keeps its source, anything else is masqueraded.
        assert_eq!(source(web(), pod, Arrival::PodInterface), Source::Client);
        assert_eq!(source(web(), pod, Arrival::Other), Source::Node);
        assert_eq!(source(web(), client, Arrival::Other), Source::Node);
        assert_eq!(
            source(web(), sa(kp_flows::NODE_IP, 1), Arrival::Node),
            Source::Node
        );
        // `Local` policy without local endpoints: a pod short-circuits to every endpoint,
        // what arrived elsewhere is dropped.
        let np = sa(kp_flows::NODE_IP, 30071);
        let (_, attempts) = connect(b.pick_via(Protocol::Tcp, np, pod, Arrival::PodInterface, now));
        assert_eq!(pod_name(attempts[0].endpoint), "remote-1");
        assert_eq!(
            b.pick_via(Protocol::Tcp, np, pod, Arrival::Other, now),
            Pick::Drop,
            "{detect:?}"
        );
        // `pick` is the proxy port's: never a pod's.
        let (_, attempts) = connect(b.pick(Protocol::Tcp, web(), pod, false, now));
        assert_eq!(attempts[0].source, Source::Node);
    }
    // By CIDR the address decides: an outside client is not a pod wherever it was accepted.
    let mut b = synced(config(Scheduler::RoundRobin));
    let (_, attempts) =
        connect(b.pick_via(Protocol::Tcp, web(), client, Arrival::PodInterface, now));
    assert_eq!(attempts[0].source, Source::Node);
    let (_, attempts) = connect(b.pick_via(Protocol::Tcp, web(), pod, Arrival::Other, now));
    assert_eq!(attempts[0].source, Source::Client);
}

#[test]
fn terminating_endpoints_serve_only_when_none_is_ready() {
    let mut b = synced(config(Scheduler::RoundRobin));
    let now = Instant::now();
    let (_, a) = connect(b.pick(Protocol::Tcp, sa("10.96.0.90", 80), sa(POD4, 1), false, now));
    assert_eq!(
        a.iter().map(|x| pod_name(x.endpoint)).collect::<Vec<_>>(),
        ["pod-1"]
    );
    let (_, a) = connect(b.pick(Protocol::Tcp, sa("10.96.0.91", 80), sa(POD4, 1), false, now));
    assert_eq!(
        a.iter().map(|x| pod_name(x.endpoint)).collect::<Vec<_>>(),
        ["pod-3"]
    );
}

#[test]
fn a_direct_connection_to_an_unknown_address_is_not_a_service() {
    let mut b = synced(config(Scheduler::RoundRobin));
    let now = Instant::now();
    assert_eq!(
        b.pick(Protocol::Tcp, sa("10.96.0.10", 81), sa(POD4, 1), false, now),
        Pick::NotAService
    );
    assert_eq!(
        b.pick(
            Protocol::Tcp,
            sa(kp_flows::NODE_POD_GATEWAY, 30080),
            sa(POD4, 1),
            false,
            now
        ),
        Pick::NotAService,
        "NodePorts answer only on the primary address"
    );
}

fn apply(state: &mut kp_core::track::ProxyState, object: Object) {
    state
        .apply(SourceEvent::Upsert(object))
        .expect("valid object");
}

#[test]
fn an_endpoint_change_rebuilds_only_its_services_routes() {
    let mut state = kp_flows::state();
    let node = kp_flows::node_context();
    let mut b = Balancer::new(config(Scheduler::RoundRobin));
    b.sync(&state, &node, &Changes::default(), true);
    let full = b.last_sync();
    assert!(full.routes_built > 20, "{full:?}");
    apply(
        &mut state,
        Object::EndpointSlice(Box::new(kp_flows::web_slice(&["pod-1", "pod-2"]))),
    );
    let changes = state.take_changes();
    b.sync(&state, &node, &changes, false);
    let s = b.last_sync();
    assert_eq!(s.services, 1);
    // web is single-stack IPv4 with a NodePort: its IPv6 route holds only the NodePort.
    assert!(s.routes_built <= 2 && s.routes_built >= 1, "{s:?}");
    assert_eq!(s.routes_built, s.routes_removed);
    assert_eq!(s.routes, full.routes);
    let now = Instant::now();
    let (_, a) = connect(b.pick(Protocol::Tcp, web(), sa(POD4, 1), false, now));
    assert_eq!(a.len(), 2);
}

#[test]
fn a_changed_service_keeps_its_round_robin_position_and_active_counts() {
    let mut state = kp_flows::state();
    let node = kp_flows::node_context();
    let mut b = Balancer::new(config(Scheduler::RoundRobin));
    b.sync(&state, &node, &Changes::default(), true);
    let now = Instant::now();
    let (route, a) = connect(b.pick(Protocol::Tcp, web(), sa(POD4, 1), false, now));
    b.report(&route, a[0].endpoint, Outcome::Connected, now);
    apply(
        &mut state,
        Object::EndpointSlice(Box::new(kp_flows::web_slice(&["pod-2", "pod-3"]))),
    );
    let changes = state.take_changes();
    b.sync(&state, &node, &changes, false);
    // pod-1 left but its connection is still open: it is counted until it closes.
    assert_eq!(b.active(&route, a[0].endpoint), 1);
    b.report(&route, a[0].endpoint, Outcome::Closed, now);
    assert_eq!(b.active(&route, a[0].endpoint), 0);
    let (_, a) = connect(b.pick(Protocol::Tcp, web(), sa(POD4, 1), false, now));
    assert_eq!(
        pod_name(a[0].endpoint),
        "pod-3",
        "rr position 1 now holds pod-3"
    );
}

#[test]
fn a_removed_service_stops_being_a_service() {
    let mut state = kp_flows::state();
    let node = kp_flows::node_context();
    let mut b = Balancer::new(config(Scheduler::RoundRobin));
    b.sync(&state, &node, &Changes::default(), true);
    state
        .apply(SourceEvent::Delete(
            kp_core::track::Kind::Service,
            kp_core::track::ObjectKey {
                namespace: "default".into(),
                name: "web".into(),
            },
        ))
        .expect("delete");
    let changes = state.take_changes();
    b.sync(&state, &node, &changes, false);
    let now = Instant::now();
    assert_eq!(
        b.pick(Protocol::Tcp, web(), sa(POD4, 1), false, now),
        Pick::NotAService
    );
    assert_eq!(
        b.pick(
            Protocol::Tcp,
            sa(kp_flows::NODE_IP, 30080),
            sa(POD4, 1),
            false,
            now
        ),
        Pick::NotAService
    );
}
