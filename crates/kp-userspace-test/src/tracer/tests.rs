use std::time::Duration;

use kp_core::flow::Tracer;
use kp_core::node::DetectLocal;
use kp_core::track::{Changes, Object, SourceEvent};
use kp_userspace_plan::{Balancer, BalancerConfig, RedirectConfig, RedirectPlanner, Scheduler};

use super::*;

fn balancer_config() -> BalancerConfig {
    BalancerConfig {
        scheduler: Scheduler::RoundRobin,
        masquerade_all: false,
        detect_local: DetectLocal::ClusterCidr(vec![
            kp_flows::CLUSTER_CIDR.parse().expect("cidr"),
            kp_flows::CLUSTER_CIDR6.parse().expect("cidr"),
        ]),
        quarantine: Duration::from_secs(10),
    }
}

fn redirect_config(restricted: bool) -> RedirectConfig {
    RedirectConfig {
        proxy_port: 31000,
        transparent_mark: 0x4000,
        node_ports_restricted: restricted,
    }
}

/// The fixture's table and balancer, as the proxy would program them.
fn tracer_over(
    state: &kp_core::track::ProxyState,
    planner: &mut RedirectPlanner,
) -> UserspaceTracer {
    tracer_with(state, planner, &kp_flows::node_context())
}

fn tracer_with(
    state: &kp_core::track::ProxyState,
    planner: &mut RedirectPlanner,
    node: &kp_core::node::NodeContext,
) -> UserspaceTracer {
    let mut balancer = Balancer::new(balancer_config());
    balancer.sync(state, node, &Changes::default(), true);
    let mut tracer = UserspaceTracer::new(kp_flows::node_addresses(), balancer);
    tracer
        .apply(&planner.full(state, node).text)
        .expect("the tracer replays the full table");
    tracer
}

#[test]
fn the_flow_table_passes_through_the_rules_and_the_balancer() {
    let state = kp_flows::state();
    let mut planner = RedirectPlanner::new(redirect_config(true));
    let tracer = tracer_over(&state, &mut planner);
    // The proxy has no SCTP socket: the table rejects SCTP frontends.
    let failures = kp_flows::check_tracer_for(&tracer, kp_flows::Support::NO_SCTP);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn element_changes_replay_and_the_table_follows_them() {
    let mut state = kp_flows::state();
    let node = kp_flows::node_context();
    let mut planner = RedirectPlanner::new(redirect_config(true));
    let mut tracer = tracer_over(&state, &mut planner);
    let web = Packet {
        origin: Origin::Pod,
        src: "10.244.1.14".parse().expect("ip"),
        protocol: Protocol::Tcp,
        dst: "10.96.0.10".parse().expect("ip"),
        dport: 80,
    };
    assert!(matches!(tracer.trace(&web), Verdict::Dnat { .. }));
    state
        .apply(SourceEvent::Upsert(Object::EndpointSlice(Box::new(
            kp_flows::web_slice(&[]),
        ))))
        .expect("slice");
    let changes = state.take_changes();
    tracer.balancer_mut().sync(&state, &node, &changes, false);
    let tx = planner.sync(&state, &node, &changes, false);
    tracer.apply(&tx.text).expect("partial replays");
    assert_eq!(tracer.trace(&web), Verdict::Reject);
    // The kernel rejects before the proxy sees anything: the table alone decides.
    let web_key = kp_nftables_plan::element::parse_tuple("10.96.0.10 . tcp . 80").expect("key");
    let no_endpoints = tracer.elements("no-endpoint-vips-v4").expect("map");
    assert!(no_endpoints.contains_key(&web_key));
    let redirects = tracer.elements("redirect-vips-v4").expect("set");
    assert!(!redirects.contains_key(&web_key));
}

#[test]
fn with_every_local_address_the_node_ports_still_follow_the_table() {
    let state = kp_flows::state();
    let mut planner = RedirectPlanner::new(redirect_config(false));
    // nodePortAddresses unset: the context restricts nothing either.
    let node = kp_core::node::NodeContext {
        node_port_addresses: Vec::new(),
        ..kp_flows::node_context()
    };
    let tracer = tracer_with(&state, &mut planner, &node);
    let to = |dst: &str, port: u16| Packet {
        origin: Origin::External,
        src: kp_flows::CLIENT.parse().expect("ip"),
        protocol: Protocol::Tcp,
        dst: dst.parse().expect("ip"),
        dport: port,
    };
    // Every local address answers, loopback excepted.
    assert!(matches!(
        tracer.trace(&to(kp_flows::NODE_POD_GATEWAY, 30080)),
        Verdict::Dnat { .. }
    ));
    assert_eq!(tracer.trace(&to("127.0.0.1", 30080)), Verdict::Untouched);
    assert_eq!(
        tracer.trace(&to(kp_flows::NODE_POD_GATEWAY, 30071)),
        Verdict::Drop
    );
}

#[test]
fn rule_shapes_the_planner_does_not_emit_are_refused() {
    let balancer = Balancer::new(balancer_config());
    let mut tracer = UserspaceTracer::new(Vec::new(), balancer);
    tracer
        .apply(
            "add table inet kube-proxy-userspace\n\
             add chain inet kube-proxy-userspace services\n",
        )
        .expect("table and chain");
    for rule in [
        "add rule inet kube-proxy-userspace services ip daddr 10.0.0.1 dnat to 10.0.0.2",
        "add rule inet kube-proxy-userspace services tcp dport 80 redirect to :1",
        "add rule inet kube-proxy-userspace services ip daddr @nowhere drop",
        "add rule inet kube-proxy-userspace services ct state new",
        "add rule inet kube-proxy-userspace services masquerade",
    ] {
        assert!(tracer.apply(rule).is_err(), "accepted: {rule}");
    }
    for statement in [
        "add table ip kube-proxy-userspace",
        "add table inet kube-proxy",
        "flush table inet kube-proxy-userspace",
        "add chain inet kube-proxy-userspace c { type route hook output priority 0; policy accept; }",
        "delete element inet kube-proxy-userspace nowhere { 10.0.0.1 }",
    ] {
        assert!(tracer.apply(statement).is_err(), "accepted: {statement}");
    }
}

/// The fixture's full redirect table replayed into a tracer whose balancer never synced.
fn fixture_table_with_an_empty_balancer() -> UserspaceTracer {
    let mut planner = RedirectPlanner::new(redirect_config(true));
    let mut tracer =
        UserspaceTracer::new(kp_flows::node_addresses(), Balancer::new(balancer_config()));
    tracer
        .apply(
            &planner
                .full(&kp_flows::state(), &kp_flows::node_context())
                .text,
        )
        .expect("the tracer replays the full table");
    tracer
}

#[test]
fn the_proxy_refusing_a_connection_the_kernel_redirected_reads_as_a_reject() {
    // The table redirects web, but the balancer never heard of it (a sync race).
    let tracer = fixture_table_with_an_empty_balancer();
    let p = Packet {
        origin: Origin::Pod,
        src: "10.244.1.14".parse().expect("ip"),
        protocol: Protocol::Tcp,
        dst: "10.96.0.10".parse().expect("ip"),
        dport: 80,
    };
    assert_eq!(tracer.trace(&p), Verdict::Reject);
}

/// The fixture's full table and balancer with detect-local `detect`, over the node's links
/// `links`, as the proxy programs them.
fn traced_by_interface(
    detect: &kp_core::node::DetectLocal,
    links: kp_core::flow::Ingress,
) -> UserspaceTracer {
    let state = kp_flows::state();
    let node = kp_flows::node_context_with(detect);
    let mut planner = RedirectPlanner::new(redirect_config(true));
    let text = planner.full(&state, &node).text;
    let mut balancer = Balancer::new(BalancerConfig {
        detect_local: detect.clone(),
        ..balancer_config()
    });
    balancer.sync(&state, &node, &Changes::default(), true);
    let mut tracer = UserspaceTracer::new(kp_flows::node_addresses(), balancer).with_ingress(links);
    tracer
        .apply(&text)
        .expect("the tracer replays the full table");
    tracer
}

/// Detect-local by interface: the table sends what arrives on the pods' interface(s) to the
/// pod port, and the balancer takes what the proxy accepts there for a pod's, so every row
/// passes as with the cluster CIDRs (the mode's one declared difference, no SCTP, aside); with
/// a prefix no pod interface has, only rows from pods differ.
#[test]
fn the_flow_table_passes_with_detect_local_by_interface() {
    kp_flows::check_detect_local_by_interface_for(kp_flows::Support::NO_SCTP, traced_by_interface);
}

/// Where each origin is redirected under detect-local by interface: a pod's connection to the
/// pod port, an outside client's and the node's own to the proxy port; a pod's connection
/// keeps its source at a ClusterIP. A table without the pod port's comment (another
/// version's) leaves the tracer, as the proxy, without a pod port: the pod is masqueraded.
#[test]
fn with_detect_local_by_interface_pods_are_redirected_to_the_pod_port() {
    for (detect, links) in kp_flows::interface_detect_locals() {
        let tracer = traced_by_interface(&detect, links.clone());
        assert_eq!(tracer.pod_port(), Some(31001));
        assert_eq!(tracer.redirect_ports(), BTreeSet::from([31000, 31001]));
        let packet = |origin, src: &str| Packet {
            origin,
            src: src.parse().expect("ip"),
            protocol: Protocol::Tcp,
            dst: "10.96.0.10".parse().expect("ip"),
            dport: 80,
        };
        let pod = packet(Origin::Pod, "10.244.1.14");
        assert_eq!(tracer.walk(&pod), Walked::Redirected(31001), "{detect:?}");
        assert_eq!(
            tracer.walk(&packet(Origin::External, kp_flows::CLIENT)),
            Walked::Redirected(31000)
        );
        assert_eq!(
            tracer.walk(&packet(Origin::Node, kp_flows::NODE_IP)),
            Walked::Redirected(31000)
        );
        match tracer.trace(&pod) {
            Verdict::Dnat { masquerade, .. } => assert!(!masquerade, "{detect:?}"),
            other => panic!("{other:?}"),
        }
        // The same table under a comment that names no pod port.
        let node = kp_flows::node_context_with(&detect);
        let text = RedirectPlanner::new(redirect_config(true))
            .full(&kp_flows::state(), &node)
            .text
            .replace(" pod-port 31001", "");
        let mut balancer = Balancer::new(BalancerConfig {
            detect_local: detect.clone(),
            ..balancer_config()
        });
        balancer.sync(&kp_flows::state(), &node, &Changes::default(), true);
        let mut unnamed =
            UserspaceTracer::new(kp_flows::node_addresses(), balancer).with_ingress(links);
        unnamed.apply(&text).expect("replays");
        assert_eq!(unnamed.pod_port(), None);
        match unnamed.trace(&pod) {
            Verdict::Dnat { masquerade, .. } => assert!(masquerade, "{detect:?}"),
            other => panic!("{other:?}"),
        }
    }
}

/// The table alone: a Service frontend is redirected to the proxy's port whatever the balancer
/// holds (an empty one would refuse it), an endpoint-less one is rejected by the table, and the
/// ports the rules redirect to are the planner's.
#[test]
fn the_walk_names_the_redirect_without_asking_the_balancer() {
    let tracer = fixture_table_with_an_empty_balancer();
    let packet = |dst: &str| Packet {
        origin: Origin::Pod,
        src: "10.244.1.14".parse().expect("ip"),
        protocol: Protocol::Tcp,
        dst: dst.parse().expect("ip"),
        dport: 80,
    };
    assert_eq!(
        tracer.walk(&packet("10.96.0.10")),
        Walked::Redirected(31000)
    );
    // The balancer knows no Service: the proxy would refuse what the table sends it.
    assert_eq!(tracer.trace(&packet("10.96.0.10")), Verdict::Reject);
    assert_eq!(tracer.walk(&packet("10.96.0.20")), Walked::Reject);
    assert_eq!(tracer.walk(&packet("192.0.2.200")), Walked::Untouched);
    assert_eq!(tracer.redirect_ports(), BTreeSet::from([31000]));
    let names = tracer.set_names();
    assert!(names.contains(&"redirect-vips-v4".to_string()), "{names:?}");
    assert!(names.windows(2).all(|w| w[0] < w[1]), "{names:?}");
}
