use super::*;

fn ips(a: &[&str]) -> Vec<IpAddr> {
    a.iter().map(|s| s.parse().expect("address")).collect()
}

/// The node's interfaces hold 192.0.2.1, 198.51.100.7 and 2001:db8::1; its Node reports
/// 192.0.2.1 and 2001:db8::1.
fn setup() -> (NodeContext, BTreeSet<IpAddr>) {
    let node = NodeContext {
        node_ips: ips(&["192.0.2.1", "2001:db8::1"]),
        ..NodeContext::default()
    };
    let local = ips(&["192.0.2.1", "198.51.100.7", "2001:db8::1"])
        .into_iter()
        .collect();
    (node, local)
}

#[test]
fn nodeports_answer_on_every_local_address_by_default() {
    let (node, local) = setup();
    assert_eq!(
        node_port_addresses(&NodePortAddresses::AllLocal, &node, &local),
        ips(&["192.0.2.1", "198.51.100.7", "2001:db8::1"])
    );
}

#[test]
fn primary_is_the_nodes_own_addresses_and_none_before_it_reports_them() {
    let (node, local) = setup();
    assert_eq!(
        node_port_addresses(&NodePortAddresses::Primary, &node, &local),
        ips(&["192.0.2.1", "2001:db8::1"])
    );
    let unknown = NodeContext::default();
    assert!(node_port_addresses(&NodePortAddresses::Primary, &unknown, &local).is_empty());
}

#[test]
fn cidrs_keep_the_local_addresses_inside_them_per_family() {
    let (mut node, local) = setup();
    // An IPv4 range only: IPv4 addresses inside it; IPv6 has no range, so every local one.
    let cidrs = vec!["198.51.100.0/24".parse().unwrap()];
    node.node_port_addresses = cidrs.clone();
    assert_eq!(
        node_port_addresses(&NodePortAddresses::Cidrs(cidrs), &node, &local),
        ips(&["198.51.100.7", "2001:db8::1"])
    );
    // A zero-length range means every address of its family.
    let cidrs = vec![
        "0.0.0.0/0".parse().unwrap(),
        "2001:db8:ffff::/48".parse().unwrap(),
    ];
    node.node_port_addresses = cidrs.clone();
    assert_eq!(
        node_port_addresses(&NodePortAddresses::Cidrs(cidrs), &node, &local),
        ips(&["192.0.2.1", "198.51.100.7"])
    );
}

#[test]
fn conn_reuse_mode_is_set_to_zero_only_from_4_1_to_before_5_9() {
    assert_eq!(conn_reuse_mode("5.4.0-150-generic\n"), Some("0"));
    assert_eq!(conn_reuse_mode("4.1.12"), Some("0"));
    assert_eq!(conn_reuse_mode("5.8.18-100.fc31.x86_64"), Some("0"));
    assert_eq!(conn_reuse_mode("5.9.0"), None);
    assert_eq!(conn_reuse_mode("6.1.0-56-amd64"), None);
    assert_eq!(conn_reuse_mode("3.10.0-1160.el7.x86_64"), None);
    assert_eq!(conn_reuse_mode(""), None);
}
