use super::*;

#[test]
fn pod_addresses_share_their_digits_across_families() {
    assert_eq!(pod_ip(Side::Local, 0), Ipv4Addr::new(10, 244, 1, 10));
    assert_eq!(pod_ip(Side::Local, 5).to_string(), "10.244.1.15");
    assert_eq!(pod_ip6(Side::Local, 5).to_string(), "fd00:10:244:1::15");
    assert_eq!(
        pod_ip(Side::Local, MAX_PODS - 1).to_string(),
        "10.244.1.209"
    );
    assert_eq!(
        pod_ip6(Side::Local, MAX_PODS - 1).to_string(),
        "fd00:10:244:1::209"
    );
}

#[test]
fn every_pod_sits_where_the_flow_fixture_expects_it() {
    assert_eq!(pod_ip(Side::Remote, 1).to_string(), "10.244.2.21");
    assert_eq!(pod_ip6(Side::Remote, 1).to_string(), "fd00:10:244:2::21");
    assert_eq!(
        pod_ip(Side::Remote, MAX_REMOTE_PODS - 1).to_string(),
        "10.244.2.219"
    );
    // The fixture's pods are this lab's pods, address for address.
    for p in kp_flows::pods() {
        let (side, prefix) = if p.node == kp_flows::NODE {
            (Side::Local, "pod-")
        } else {
            (Side::Remote, "remote-")
        };
        let i: usize = p
            .name
            .strip_prefix(prefix)
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("fixture pod {} is not {prefix}N", p.name));
        assert_eq!(pod_ip(side, i).to_string(), p.v4, "{}", p.name);
        assert_eq!(
            Some(pod_ip6(side, i).to_string().as_str()),
            p.v6,
            "{}",
            p.name
        );
    }
}

#[test]
fn too_many_pods_is_refused_before_anything_is_created() {
    assert!(matches!(
        Lab::new(MAX_PODS + 1),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        Lab::two_nodes(1, MAX_REMOTE_PODS + 1),
        Err(Error::InvalidArgument(_))
    ));
}

fn answered(backend: &str, client_seen: impl Into<IpAddr>) -> Outcome {
    Outcome::Answered {
        backend: backend.to_string(),
        client_seen: client_seen.into(),
    }
}

#[test]
#[ignore = "needs root"]
fn a_two_node_lab_routes_between_the_nodes_and_replies_return_through_node_a() {
    if !crate::require_root() {
        return;
    }
    let lab = Lab::two_nodes(2, 2).unwrap();
    assert!(lab.other_node().is_some());
    assert_eq!((lab.pod_count(), lab.remote_pod_count()), (2, 2));
    let _local = lab.serve_echo(1, &[8080], &[5353]).unwrap();
    let _remote = lab.serve_remote_echo(1, &[8080], &[5353]).unwrap();
    let remote = lab.remote_pod_name(1);

    for proto in [Proto::Tcp, Proto::Udp] {
        let port = if proto == Proto::Tcp { 8080 } else { 5353 };
        // Pod to pod across the nodes, and back: sources are kept, as without any NAT.
        assert_eq!(
            lab.request(lab.pod(0), proto, lab.remote_pod_ip(1), port),
            answered(&remote, lab.pod_ip(0)),
            "{proto:?} pod-0 to remote-1"
        );
        assert_eq!(
            lab.request(lab.pod(0), proto, lab.remote_pod_ip6(1), port),
            answered(&remote, lab.pod_ip6(0)),
            "{proto:?} pod-0 to remote-1 over IPv6"
        );
        assert_eq!(
            lab.request(lab.remote_pod(0), proto, lab.pod_ip(1), port),
            answered("pod-1", lab.remote_pod_ip(0)),
            "{proto:?} remote-0 to pod-1"
        );
        // node-b has no route to the client but through node-a, so this answer proves the
        // return path that un-NAT on node-a relies on.
        assert_eq!(
            lab.request(lab.client(), proto, lab.remote_pod_ip(1), port),
            answered(&remote, CLIENT_IP),
            "{proto:?} client to remote-1"
        );
        assert_eq!(
            lab.request(lab.client(), proto, lab.remote_pod_ip6(1), port),
            answered(&remote, CLIENT_IP6),
            "{proto:?} client to remote-1 over IPv6"
        );
    }
    // The node reaches node-b's pods from its address on the node-to-node link.
    assert_eq!(
        lab.request(lab.node(), Proto::Tcp, lab.remote_pod_ip(1), 8080),
        answered(&remote, NODE_LINK_IP)
    );
    assert!(lab.node_ips().contains(&IpAddr::from(NODE_LINK_IP)));

    let names = lab.namespaces();
    assert_eq!(names.len(), 2 + 2 + 1 + 2, "{names:?}");
    drop(lab);
    let listed = crate::netns::list().unwrap();
    let left: Vec<&String> = names.iter().filter(|n| listed.contains(n)).collect();
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
}

#[test]
#[ignore = "needs root"]
fn a_one_node_lab_has_no_node_b() {
    if !crate::require_root() {
        return;
    }
    let lab = Lab::new(1).unwrap();
    assert!(lab.other_node().is_none());
    assert_eq!(lab.remote_pod_count(), 0);
    assert_eq!(lab.namespaces().len(), 3);
    assert!(!lab.node_ips().contains(&IpAddr::from(NODE_LINK_IP)));
}
