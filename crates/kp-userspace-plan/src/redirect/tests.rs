use std::collections::BTreeMap;

use kp_core::model::IpFamily;
use kp_core::track::{Changes, Kind, Object, ObjectKey, ProxyState, SourceEvent};
use kp_nftables_plan::element::parse_tuple;

use super::*;

fn config() -> RedirectConfig {
    RedirectConfig {
        proxy_port: 31000,
        transparent_mark: 0x4000,
        node_ports_restricted: true,
    }
}

fn planned() -> (ProxyState, RedirectPlanner, Transaction) {
    let state = kp_flows::state();
    let mut p = RedirectPlanner::new(config());
    let tx = p.full(&state, &kp_flows::node_context());
    (state, p, tx)
}

fn set(kind: SetKind, family: IpFamily) -> SetId {
    SetId { kind, family }
}

fn tuple(s: &str) -> Tuple {
    parse_tuple(s).expect("tuple")
}

fn has(p: &RedirectPlanner, kind: SetKind, family: IpFamily, key: &str) -> Option<Option<Tuple>> {
    p.expected_elements(set(kind, family))
        .get(&tuple(key))
        .cloned()
}

fn apply(state: &mut ProxyState, object: Object) -> Changes {
    state
        .apply(SourceEvent::Upsert(object))
        .expect("valid object");
    state.take_changes()
}

use IpFamily::{V4, V6};
use SetKind::*;

#[test]
fn each_frontend_gets_the_elements_of_its_verdict() {
    let (_, p, _) = planned();
    // Endpoints for everyone: redirected.
    assert_eq!(
        has(&p, RedirectVips, V4, "10.96.0.10 . tcp . 80"),
        Some(None)
    );
    assert_eq!(has(&p, RedirectNodePorts, V4, "tcp . 30080"), Some(None));
    assert_eq!(
        has(&p, RedirectVips, V6, "fd00:10:96::120 . tcp . 80"),
        Some(None)
    );
    // No endpoints: rejected, not redirected.
    assert_eq!(
        has(&p, NoEndpointVips, V4, "10.96.0.20 . tcp . 80"),
        Some(Some(tuple("goto reject-packet")))
    );
    assert_eq!(has(&p, RedirectVips, V4, "10.96.0.20 . tcp . 80"), None);
    // A dual-stack Service without IPv6 endpoints rejects on its IPv6 ClusterIP only.
    assert_eq!(
        has(&p, NoEndpointVips, V6, "fd00:10:96::121 . tcp . 80"),
        Some(Some(tuple("goto reject-packet")))
    );
    assert_eq!(
        has(&p, RedirectVips, V4, "10.96.0.121 . tcp . 80"),
        Some(None)
    );
    // internalTrafficPolicy Local without local endpoints: dropped.
    assert_eq!(
        has(&p, NoEndpointVips, V4, "10.96.0.86 . tcp . 80"),
        Some(Some(tuple("drop")))
    );
    // externalTrafficPolicy Local without local endpoints: redirected for pods and the node,
    // outside clients dropped first.
    assert_eq!(has(&p, NoLocalNodePorts, V4, "tcp . 30071"), Some(None));
    assert_eq!(has(&p, RedirectNodePorts, V4, "tcp . 30071"), Some(None));
    assert_eq!(has(&p, NoLocalNodePorts, V4, "tcp . 30070"), None);
    // Source ranges, with the LoadBalancer IP itself as the node's own source.
    assert_eq!(
        has(&p, FirewallVips, V4, "198.51.100.20 . tcp . 80"),
        Some(None)
    );
    let allow = p.expected_elements(set(FirewallAllow, V4));
    assert_eq!(
        allow.keys().map(ToString::to_string).collect::<Vec<_>>(),
        [
            "198.51.100.20 . tcp . 80 . 192.0.2.0/30",
            "198.51.100.20 . tcp . 80 . 198.51.100.20/32"
        ]
    );
    // Node-level sets.
    assert_eq!(has(&p, ClusterIps, V4, "10.96.0.10"), Some(None));
    assert_eq!(
        p.expected_elements(set(NodePortAddresses, V4))
            .keys()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        ["192.0.2.1/32"]
    );
    assert_eq!(
        p.expected_elements(set(PodCidrs, V6))
            .keys()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        ["fd00:10:244::/48"]
    );
}

#[test]
fn the_full_transaction_replaces_the_table_and_holds_every_element() {
    let (_, p, tx) = planned();
    let lines: Vec<&str> = tx.text.lines().collect();
    assert_eq!(lines[0], "add table inet kube-proxy-userspace");
    assert_eq!(lines[1], "delete table inet kube-proxy-userspace");
    assert!(tx
        .text
        .contains("redirect to :31000 comment \"redirect-vips-v4\""));
    assert!(tx
        .text
        .contains("socket transparent 1 meta mark set 0x4000 accept"));
    let elements: usize = tx
        .text
        .lines()
        .filter(|l| l.starts_with("add element"))
        .map(|l| l.matches(',').count() + 1)
        .sum();
    assert_eq!(elements, p.element_count());
}

#[test]
fn an_endpoint_change_that_keeps_every_verdict_sends_nothing() {
    let (mut state, mut p, _) = planned();
    let changes = apply(
        &mut state,
        Object::EndpointSlice(Box::new(kp_flows::web_slice(&["pod-1"]))),
    );
    let tx = p.sync(&state, &kp_flows::node_context(), &changes, false);
    assert_eq!(tx.operations, 0, "{}", tx.text);
    assert!(tx.text.is_empty());
}

#[test]
fn losing_the_last_endpoint_swaps_redirects_for_rejects_element_by_element() {
    let (mut state, mut p, _) = planned();
    let changes = apply(
        &mut state,
        Object::EndpointSlice(Box::new(kp_flows::web_slice(&[]))),
    );
    let tx = p.sync(&state, &kp_flows::node_context(), &changes, false);
    assert_eq!(
        tx.text,
        "delete element inet kube-proxy-userspace redirect-vips-v4 { 10.96.0.10 . tcp . 80 }\n\
         delete element inet kube-proxy-userspace redirect-nodeports-v4 { tcp . 30080 }\n\
         add element inet kube-proxy-userspace no-endpoint-vips-v4 { 10.96.0.10 . tcp . 80 : goto reject-packet }\n\
         add element inet kube-proxy-userspace no-endpoint-nodeports-v4 { tcp . 30080 : goto reject-packet }\n"
    );
    assert_eq!(tx.operations, 4);
}

#[test]
fn removing_a_service_deletes_only_its_elements_and_a_new_one_adds_only_its_own() {
    let (mut state, mut p, _) = planned();
    let node = kp_flows::node_context();
    let web = ObjectKey {
        namespace: "default".into(),
        name: "web".into(),
    };
    state
        .apply(SourceEvent::Delete(Kind::Service, web))
        .expect("delete");
    let changes = state.take_changes();
    let tx = p.sync(&state, &node, &changes, false);
    assert!(
        tx.text.lines().all(|l| l.starts_with("delete element")),
        "{}",
        tx.text
    );
    // The ClusterIP, its redirect, the NodePort's redirect, and the IPv6 NodePort's reject.
    assert_eq!(tx.operations, 4, "{}", tx.text);
    assert_eq!(has(&p, ClusterIps, V4, "10.96.0.10"), None);
    // Back again: the same four come back.
    let svc = kp_flows::objects()
        .into_iter()
        .find(|o| matches!(o, Object::Service(_)) && o.key().name == "web")
        .expect("web Service");
    let changes = apply(&mut state, svc);
    let tx = p.sync(&state, &node, &changes, false);
    assert!(
        tx.text.lines().all(|l| l.starts_with("add element")),
        "{}",
        tx.text
    );
    assert_eq!(tx.operations, 4, "{}", tx.text);
}

#[test]
fn partial_syncs_leave_the_same_record_as_a_full_sync() {
    let (mut state, mut p, _) = planned();
    let node = kp_flows::node_context();
    for pods in [&["pod-2"][..], &[], &["pod-1", "pod-3"], &[]] {
        let changes = apply(
            &mut state,
            Object::EndpointSlice(Box::new(kp_flows::sticky_slice(pods))),
        );
        p.sync(&state, &node, &changes, false);
        let changes = apply(
            &mut state,
            Object::EndpointSlice(Box::new(kp_flows::web_slice(pods))),
        );
        p.sync(&state, &node, &changes, false);
        let mut fresh = RedirectPlanner::new(config());
        fresh.full(&state, &node);
        assert_eq!(p.expected_sets(), fresh.expected_sets(), "after {pods:?}");
    }
}

#[test]
fn a_node_change_or_a_first_sync_is_full() {
    let state = kp_flows::state();
    let node = kp_flows::node_context();
    let mut p = RedirectPlanner::new(config());
    let tx = p.sync(&state, &node, &Changes::default(), false);
    assert!(tx.text.starts_with("add table"), "the first sync is full");
    let changes = Changes {
        node_changed: true,
        ..Changes::default()
    };
    let tx = p.sync(&state, &node, &changes, false);
    assert!(tx.text.starts_with("add table"));
}

#[test]
fn unrestricted_node_ports_match_every_local_address_but_loopback() {
    let mut p = RedirectPlanner::new(RedirectConfig {
        node_ports_restricted: false,
        ..config()
    });
    let tx = p.full(&kp_flows::state(), &kp_flows::node_context());
    assert!(tx.text.contains(
        "meta nfproto ipv4 fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport @redirect-nodeports-v4"
    ));
    assert!(p.expected_elements(set(NodePortAddresses, V4)).is_empty());
}

#[test]
fn the_record_names_every_chain_and_rule_for_the_read_back() {
    let (_, p, tx) = planned();
    let chains = p.expected_chains();
    assert_eq!(chains.len(), crate::layout::chains().len());
    let rules: usize = chains.values().map(Vec::len).sum();
    assert_eq!(
        rules,
        tx.text
            .lines()
            .filter(|l| l.starts_with("add rule"))
            .count()
    );
    let sets: BTreeMap<_, _> = p.expected_sets();
    assert_eq!(sets.len(), 24);
    assert!(sets.values().all(Option::is_some));
}

/// Detect-local by interface: the `Local` policy's check lets through what arrived on the
/// pods' interface(s) (`iifname != "veth*" drop`) instead of what comes from `pod-cidrs`, in
/// both families, and the `pod-cidrs` sets stay empty.
#[test]
fn detect_local_by_interface_checks_iifname() {
    use kp_core::node::{DetectLocal, InterfaceName};
    let state = kp_flows::state();
    for (detect, not_pod) in [
        (
            DetectLocal::InterfaceNamePrefix(InterfaceName::new("veth").unwrap()),
            "iifname != \"veth*\"",
        ),
        (
            DetectLocal::BridgeInterface(InterfaceName::new("cbr0").unwrap()),
            "iifname != \"cbr0\"",
        ),
    ] {
        let mut p = RedirectPlanner::new(config());
        let text = p.full(&state, &kp_flows::node_context_with(&detect)).text;
        let checks: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("comment \"no-local-"))
            .collect();
        assert_eq!(checks.len(), 4, "{text}");
        for l in checks {
            assert!(l.contains(&format!(" {not_pod} drop comment")), "{l}");
        }
        assert!(!text.contains("saddr != @pod-cidrs"), "{text}");
        for family in IpFamily::ALL {
            assert!(p
                .expected_elements(set(SetKind::PodCidrs, family))
                .is_empty());
        }
        // What arrives on the pods' interface(s) goes to the pod port, the proxy port's
        // sibling, ahead of the rules that send the rest to the proxy port; the comment names
        // both ports, and the record names the rules for the read-back.
        let services: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("add rule inet kube-proxy-userspace services "))
            .collect();
        let is_pod = |l: &str| l.contains("comment \"redirect-pod-");
        assert_eq!(services.iter().filter(|l| is_pod(l)).count(), 4, "{text}");
        for l in services.iter().filter(|l| is_pod(l)) {
            let iif = not_pod.replace(" != ", " ");
            assert!(l.contains(&format!("services {iif} ")), "{l}");
            assert!(l.contains("redirect to :31001 comment"), "{l}");
        }
        for l in services.iter().filter(|l| !is_pod(l)) {
            assert!(l.contains("redirect to :31000 comment"), "{l}");
            assert!(!l.contains("iifname"), "{l}");
        }
        for family in ["v4", "v6"] {
            for kind in ["vips", "nodeports"] {
                let at = |id: &str| {
                    services
                        .iter()
                        .position(|l| l.ends_with(&format!("comment \"{id}\"")))
                        .unwrap_or_else(|| panic!("no rule {id}: {text}"))
                };
                assert!(
                    at(&format!("redirect-pod-{kind}-{family}"))
                        < at(&format!("redirect-{kind}-{family}"))
                );
            }
        }
        assert!(
            text.contains("comment \"kube-proxy-rs userspace port 31000 pod-port 31001 mark"),
            "{text}"
        );
        let ids = &p.expected_chains()[crate::names::SERVICES];
        assert!(ids.contains(&"redirect-pod-vips-v6".to_string()), "{ids:?}");
    }
}

/// Without detect-local by interface the table has no pod port; a proxy port of 65535 has no
/// sibling, so its table redirects everything there, as without the interface. The comment
/// reads back as the ports it names.
#[test]
fn the_pod_port_is_only_in_a_table_that_detects_local_by_interface() {
    use kp_core::node::{DetectLocal, InterfaceName};
    let state = kp_flows::state();
    let (_, _, tx) = planned();
    assert!(!tx.text.contains("redirect-pod-"), "{}", tx.text);
    assert!(!tx.text.contains(":31001"), "{}", tx.text);
    let comment = crate::layout::table_comment(&config(), None);
    assert_eq!(crate::layout::comment_ports(&comment), Some((31000, None)));
    let veth = kp_core::node::LocalInterface::Prefix(InterfaceName::new("veth").unwrap());
    let comment = crate::layout::table_comment(&config(), Some(&veth));
    assert_eq!(
        crate::layout::comment_ports(&comment),
        Some((31000, Some(31001)))
    );
    assert_eq!(crate::layout::comment_ports("kube-proxy-rs nftables"), None);
    let last = RedirectConfig {
        proxy_port: u16::MAX,
        ..config()
    };
    assert_eq!(last.pod_port(), None);
    let detect = DetectLocal::InterfaceNamePrefix(InterfaceName::new("veth").unwrap());
    let text = RedirectPlanner::new(last)
        .full(&state, &kp_flows::node_context_with(&detect))
        .text;
    assert!(!text.contains("redirect-pod-"), "{text}");
    assert!(!text.contains("pod-port"), "{text}");
}
