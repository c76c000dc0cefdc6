use super::*;

use kp_core::model::ServiceKey;

fn name(svc: &str, port: &str) -> ServicePortName {
    ServicePortName {
        service: ServiceKey::new("default", svc),
        port: port.into(),
        protocol: Protocol::Tcp,
    }
}

#[test]
fn marks_are_stable_distinct_and_recognisable() {
    let mut a = LocalPolicy::default();
    let web = a.mark(&name("web", "http"));
    let api = a.mark(&name("api", "http"));
    assert_ne!(web, api);
    assert_eq!(a.mark(&name("web", "http")), web);
    // Another process, another order: the same marks (no collision between these two).
    let mut b = LocalPolicy::default();
    assert_eq!(b.mark(&name("api", "http")), api);
    assert_eq!(b.mark(&name("web", "http")), web);
    for m in [web, api] {
        assert!(is_short_circuit_mark(m), "{m:#x}");
        // The masquerade (bit 14) and drop (bit 15) marks stay clear.
        assert_eq!(m & 0xc000, 0, "{m:#x}");
    }
    assert!(!is_short_circuit_mark(7));
    assert!(!is_short_circuit_mark(SHORT_CIRCUIT_MARK | 0x4000));
}

#[test]
fn a_collision_probes_to_the_next_free_mark() {
    let mut p = LocalPolicy::default();
    let first = p.mark(&name("web", "http"));
    // Take the mark the next port would hash to, by hand, then ask for it.
    let other = name("db", "sql");
    let mut q = LocalPolicy::default();
    let wanted = q.mark(&other);
    p.used.insert(wanted);
    let got = p.mark(&other);
    assert_ne!(got, wanted);
    assert_ne!(got, first);
    assert!(is_short_circuit_mark(got));
}

#[test]
fn pods_and_the_node_are_marked_and_the_rest_dropped_without_local_endpoints() {
    let mut p = LocalPolicy::default();
    let mark = p.mark(&name("web", "http"));
    p.add(LocalRule {
        family: IpFamily::V4,
        address: "192.0.2.10".parse().unwrap(),
        protocol: Protocol::Tcp,
        port: 30071,
        mark: Some(mark),
        drop: true,
    });
    p.add(LocalRule {
        family: IpFamily::V4,
        address: "10.96.0.86".parse().unwrap(),
        protocol: Protocol::Tcp,
        port: 80,
        mark: None,
        drop: true,
    });
    p.add(LocalRule {
        family: IpFamily::V6,
        address: "fd00::10".parse().unwrap(),
        protocol: Protocol::Tcp,
        port: 30071,
        mark: Some(mark),
        drop: false,
    });
    let node = NodeContext {
        local_cidrs: vec![
            "10.244.0.0/16".parse().unwrap(),
            "fd00:10:244::/48".parse().unwrap(),
        ],
        ..NodeContext::default()
    };
    let v4 = p.render(IpFamily::V4, &node);
    let lines: Vec<&str> = v4.lines().collect();
    let m = format!("{mark:#x}");
    assert_eq!(
        lines,
        [
            "*mangle".to_string(),
            ":KUBE-IPVS-LOCAL - [0:0]".to_string(),
            "-A KUBE-IPVS-LOCAL -d 10.96.0.86 -p tcp --dport 80 -m comment --comment \"has no local endpoints\" -j DROP".to_string(),
            format!("-A KUBE-IPVS-LOCAL -s 10.244.0.0/16 -d 192.0.2.10 -p tcp --dport 30071 -m comment --comment \"short-circuit pod traffic\" -j MARK --set-xmark {m}/0xffffffff"),
            format!("-A KUBE-IPVS-LOCAL -d 192.0.2.10 -p tcp --dport 30071 -m addrtype --src-type LOCAL -m comment --comment \"short-circuit local traffic\" -j MARK --set-xmark {m}/0xffffffff"),
            format!("-A KUBE-IPVS-LOCAL -d 192.0.2.10 -p tcp --dport 30071 -m mark ! --mark {m} -m comment --comment \"has no local endpoints\" -j DROP"),
            "COMMIT".to_string(),
        ]
    );
    assert!(p.short_circuits(IpFamily::V4));
    let v6 = p.render(IpFamily::V6, &node);
    assert!(v6.contains("-s fd00:10:244::/48 -d fd00::10 "), "{v6}");
    assert!(!v6.contains("DROP"), "{v6}");
    // Without detect-local only the node's traffic is short-circuited.
    let bare = p.render(IpFamily::V4, &NodeContext::default());
    assert!(!bare.contains("short-circuit pod traffic"), "{bare}");
    assert!(bare.contains("short-circuit local traffic"), "{bare}");
    // Detect-local by interface: pod traffic is what arrives on the pods' interface(s), in
    // both families, and the pod CIDRs play no part.
    for (local, from_pods) in [
        (
            kp_core::node::LocalInterface::Bridge(
                kp_core::node::InterfaceName::new("cbr0").unwrap(),
            ),
            "-i cbr0",
        ),
        (
            kp_core::node::LocalInterface::Prefix(
                kp_core::node::InterfaceName::new("veth").unwrap(),
            ),
            "-i veth+",
        ),
    ] {
        let by_iface = NodeContext {
            local_interface: Some(local),
            ..node.clone()
        };
        let v4 = p.render(IpFamily::V4, &by_iface);
        assert!(v4.contains(&format!("-A KUBE-IPVS-LOCAL {from_pods} -d 192.0.2.10 -p tcp --dport 30071 -m comment --comment \"short-circuit pod traffic\" -j MARK --set-xmark {m}/0xffffffff\n")), "{v4}");
        assert!(!v4.contains("-s 10.244.0.0/16"), "{v4}");
        let v6 = p.render(IpFamily::V6, &by_iface);
        assert!(
            v6.contains(&format!("-A KUBE-IPVS-LOCAL {from_pods} -d fd00::10 ")),
            "{v6}"
        );
    }
}
