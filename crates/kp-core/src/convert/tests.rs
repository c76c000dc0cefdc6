use super::*;

use std::net::{Ipv4Addr, Ipv6Addr};

use serde_json::{json, Value};

// Test address ranges: ClusterIPs in 10.96.0.0/16 and fd00:96::/64, external and load-balancer
// addresses in TEST-NET-3 (203.0.113.0/24), endpoints in 10.244.0.0/16 and fd00:244::/64.

/// A Service `web/api` with `spec` as given.
fn service(spec: Value) -> Service {
    service_with_meta(json!({"namespace": "web", "name": "api"}), spec)
}

fn service_with_meta(metadata: Value, spec: Value) -> Service {
    serde_json::from_value(json!({"metadata": metadata, "spec": spec})).expect("Service JSON")
}

fn load_balancer(spec: Value, ingress: Value) -> Service {
    let mut svc = service(spec);
    svc.status =
        serde_json::from_value(json!({"loadBalancer": {"ingress": ingress}})).expect("status JSON");
    svc
}

fn proxied(svc: &Service) -> Vec<ServicePort> {
    match service_ports(svc) {
        Ok((_, ServiceDisposition::Proxied(ports))) => ports,
        other => panic!("expected a proxied Service, got {other:?}"),
    }
}

fn only_port(svc: &Service) -> ServicePort {
    let mut ports = proxied(svc);
    assert_eq!(ports.len(), 1, "{ports:?}");
    ports.remove(0)
}

fn ignored_reason(svc: &Service) -> &'static str {
    match service_ports(svc) {
        Ok((_, ServiceDisposition::Ignored(reason))) => reason,
        other => panic!("expected an ignored Service, got {other:?}"),
    }
}

fn rejected(svc: &Service) -> InvalidObject {
    match service_ports(svc) {
        Err(e) => e,
        Ok(other) => panic!("expected an invalid Service, got {other:?}"),
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test address")
}

fn net(s: &str) -> IpNet {
    s.parse().expect("test network")
}

fn tcp_80() -> Value {
    json!([{"port": 80, "protocol": "TCP"}])
}

#[test]
fn a_cluster_ip_service_becomes_one_port_per_spec_port() {
    let svc = service(json!({
        "type": "ClusterIP",
        "clusterIP": "10.96.0.10",
        "clusterIPs": ["10.96.0.10"],
        "ports": [
            {"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"},
            {"name": "dns", "port": 53, "protocol": "UDP"},
        ],
    }));
    let (key, disposition) = service_ports(&svc).expect("valid");
    assert_eq!(key, ServiceKey::new("web", "api"));
    let ServiceDisposition::Proxied(ports) = disposition else {
        panic!("not proxied: {disposition:?}")
    };
    let names: Vec<String> = ports.iter().map(|p| p.name.to_string()).collect();
    assert_eq!(names, ["web/api:http", "web/api:dns"]);
    assert_eq!(ports[0].name.protocol, Protocol::Tcp);
    assert_eq!(ports[0].port, 80);
    assert_eq!(ports[1].name.protocol, Protocol::Udp);
    assert_eq!(ports[1].port, 53);
    for p in &ports {
        assert_eq!(p.cluster_ips, [ip("10.96.0.10")]);
        assert_eq!(p.node_port, None);
        assert!(p.external_ips.is_empty() && p.load_balancer_ips.is_empty());
        assert_eq!(p.session_affinity_timeout, None);
        assert!(!p.has_external());
    }
}

#[test]
fn a_port_without_a_protocol_is_tcp_and_without_a_name_is_unnamed() {
    let port = only_port(&service(
        json!({"clusterIP": "10.96.0.1", "ports": [{"port": 443}]}),
    ));
    assert_eq!(port.name.protocol, Protocol::Tcp);
    assert_eq!(port.name.port, "");
    assert_eq!(port.name.to_string(), "web/api");
}

#[test]
fn a_service_without_a_namespace_is_in_default() {
    let svc = service_with_meta(
        json!({"name": "api"}),
        json!({"clusterIP": "10.96.0.1", "ports": tcp_80()}),
    );
    let (key, _) = service_ports(&svc).expect("valid");
    assert_eq!(key, ServiceKey::new("default", "api"));
}

#[test]
fn a_dual_stack_service_keeps_one_cluster_ip_per_family() {
    let port = only_port(&service(json!({
        "clusterIP": "10.96.0.1",
        "clusterIPs": ["10.96.0.1", "fd00:96::1"],
        "ports": tcp_80(),
    })));
    assert_eq!(port.cluster_ips, [ip("10.96.0.1"), ip("fd00:96::1")]);
}

#[test]
fn a_node_port_service_carries_its_node_ports() {
    let port = only_port(&service(json!({
        "type": "NodePort",
        "clusterIP": "10.96.0.1",
        "ports": [{"port": 80, "nodePort": 30080}],
    })));
    assert_eq!(port.node_port, Some(30080));
    assert!(port.has_external());
}

#[test]
fn a_node_port_on_a_cluster_ip_service_is_not_programmed() {
    let port = only_port(&service(json!({
        "type": "ClusterIP",
        "clusterIP": "10.96.0.1",
        "ports": [{"port": 80, "nodePort": 30080}],
    })));
    assert_eq!(port.node_port, None);
}

#[test]
fn a_load_balancer_service_carries_ingress_ips_and_source_ranges() {
    let svc = load_balancer(
        json!({
            "type": "LoadBalancer",
            "clusterIP": "10.96.0.1",
            "ports": [{"port": 443, "nodePort": 31443}],
            "externalIPs": ["203.0.113.7"],
            "loadBalancerSourceRanges": ["192.0.2.0/24", " 198.51.100.0/25 "],
        }),
        json!([{"ip": "203.0.113.10"}, {"hostname": "lb.example.com"}, {"ip": "203.0.113.11", "ipMode": "VIP"}]),
    );
    let port = only_port(&svc);
    assert_eq!(port.node_port, Some(31443));
    assert_eq!(port.external_ips, [ip("203.0.113.7")]);
    assert_eq!(
        port.load_balancer_ips,
        [ip("203.0.113.10"), ip("203.0.113.11")]
    );
    assert_eq!(
        port.load_balancer_source_ranges,
        [net("192.0.2.0/24"), net("198.51.100.0/25")]
    );
}

#[test]
fn a_proxy_mode_load_balancer_ingress_is_left_to_the_load_balancer() {
    // Upstream programs only VIP-mode ingress IPs: with ipMode Proxy the load balancer
    // forwards to the node itself, so short-circuiting the IP in-node would bypass it.
    let svc = load_balancer(
        json!({"type": "LoadBalancer", "clusterIP": "10.96.0.1", "ports": tcp_80()}),
        json!([{"ip": "203.0.113.10", "ipMode": "Proxy"}, {"ip": "203.0.113.11"}]),
    );
    assert_eq!(only_port(&svc).load_balancer_ips, [ip("203.0.113.11")]);
}

#[test]
fn load_balancer_source_ranges_drop_host_bits() {
    let svc = load_balancer(
        json!({
            "type": "LoadBalancer",
            "clusterIP": "10.96.0.1",
            "ports": tcp_80(),
            "loadBalancerSourceRanges": ["10.1.2.3/8", "2001:db8::1/32", "192.0.2.77/32"],
        }),
        json!([]),
    );
    assert_eq!(
        only_port(&svc).load_balancer_source_ranges,
        [
            net("10.0.0.0/8"),
            net("2001:db8::/32"),
            net("192.0.2.77/32")
        ]
    );
}

#[test]
fn load_balancer_fields_on_other_service_types_are_not_programmed() {
    let svc = load_balancer(
        json!({
            "type": "NodePort",
            "clusterIP": "10.96.0.1",
            "ports": tcp_80(),
            "loadBalancerSourceRanges": ["192.0.2.0/24"],
        }),
        json!([{"ip": "203.0.113.10"}]),
    );
    let port = only_port(&svc);
    assert!(port.load_balancer_ips.is_empty());
    assert!(port.load_balancer_source_ranges.is_empty());
}

#[test]
fn a_malformed_load_balancer_source_range_is_rejected() {
    for bad in [
        "192.0.2.0",
        "192.0.2.0/33",
        "192.0.2.0/24; accept",
        "192.0.2.0/24 /8",
        "::/129",
    ] {
        let svc = load_balancer(
            json!({
                "type": "LoadBalancer",
                "clusterIP": "10.96.0.1",
                "ports": tcp_80(),
                "loadBalancerSourceRanges": [bad],
            }),
            json!([]),
        );
        let err = rejected(&svc);
        assert!(
            matches!(&err, InvalidObject::Address { field: "spec.loadBalancerSourceRanges", value } if value == bad),
            "{bad}: {err:?}"
        );
    }
}

#[test]
fn ipv4_mapped_source_ranges_are_refused_and_compatible_ones_left_to_the_modes() {
    let with_range = |range: &str| {
        load_balancer(
            json!({
                "type": "LoadBalancer",
                "clusterIP": "10.96.0.1",
                "ports": tcp_80(),
                "loadBalancerSourceRanges": [range],
            }),
            json!([]),
        )
    };
    for bad in [
        "::ffff:86.64.0.0/106",
        "::ffff:192.0.2.0/120",
        "::ffff:0:0/96",
    ] {
        let err = rejected(&with_range(bad));
        assert!(
            matches!(
                &err,
                InvalidObject::SpecialAddress {
                    field: "spec.loadBalancerSourceRanges",
                    ..
                }
            ),
            "{bad}: {err:?}"
        );
    }
    // Wider ranges that cover the mapped addresses are ordinary IPv6 ranges.
    for fine in ["::/0", "::ffff:0:0/95", "::102:300/120"] {
        let svc = with_range(fine);
        assert!(service_ports(&svc).is_ok(), "{fine}");
    }
}

#[test]
fn headless_services_are_ignored() {
    let by_cluster_ip = service(json!({"clusterIP": "None", "ports": tcp_80()}));
    assert!(ignored_reason(&by_cluster_ip).contains("headless"));
    let by_cluster_ips =
        service(json!({"clusterIP": "None", "clusterIPs": ["None"], "ports": tcp_80()}));
    assert!(ignored_reason(&by_cluster_ips).contains("headless"));
    let by_label = service_with_meta(
        json!({"namespace": "web", "name": "api", "labels": {"service.kubernetes.io/headless": ""}}),
        json!({"clusterIP": "10.96.0.1", "ports": tcp_80()}),
    );
    assert_eq!(ignored_reason(&by_label), "headless");
}

#[test]
fn external_name_services_are_ignored() {
    let svc = service(
        json!({"type": "ExternalName", "externalName": "db.example.com", "ports": tcp_80()}),
    );
    assert_eq!(ignored_reason(&svc), "ExternalName");
}

#[test]
fn services_owned_by_another_proxy_are_ignored() {
    let svc = service_with_meta(
        json!({
            "namespace": "web",
            "name": "api",
            "labels": {"service.kubernetes.io/service-proxy-name": "other-proxy"},
        }),
        json!({"clusterIP": "10.96.0.1", "ports": tcp_80()}),
    );
    assert_eq!(ignored_reason(&svc), "owned by another service proxy");
}

#[test]
fn a_service_without_an_allocated_cluster_ip_is_ignored() {
    // Upstream skips a Service whose spec.clusterIP is "" or "None" (ShouldSkipService).
    let unset = service(json!({"ports": tcp_80()}));
    assert!(ignored_reason(&unset).contains("no ClusterIP"));
    let empty = service(json!({"clusterIP": "", "ports": tcp_80()}));
    assert!(ignored_reason(&empty).contains("no ClusterIP"));
}

#[test]
fn malformed_cluster_ips_are_rejected() {
    for bad in [
        "10.0.0.300",
        "010.0.0.1",
        "1.2.3.4; flush ruleset",
        " 10.0.0.1",
        "10.0.0.1/32",
        "fe80::1%eth0",
        "10.0.0",
    ] {
        let err = rejected(&service(json!({"clusterIP": bad, "ports": tcp_80()})));
        assert_eq!(
            err,
            InvalidObject::Address {
                field: "spec.clusterIPs",
                value: bad.to_string()
            },
            "{bad}"
        );
        assert_eq!(err.to_string(), format!("invalid spec.clusterIPs {bad:?}"));
    }
}

#[test]
fn a_malformed_secondary_cluster_ip_is_rejected() {
    let svc = service(json!({
        "clusterIP": "10.96.0.1",
        "clusterIPs": ["10.96.0.1", "fd00::1\nflush ruleset"],
        "ports": tcp_80(),
    }));
    assert!(matches!(
        rejected(&svc),
        InvalidObject::Address {
            field: "spec.clusterIPs",
            ..
        }
    ));
}

#[test]
fn a_malformed_external_ip_is_rejected() {
    let svc = service(json!({
        "clusterIP": "10.96.0.1",
        "externalIPs": ["203.0.113.7", "203.0.113.256"],
        "ports": tcp_80(),
    }));
    let err = rejected(&svc);
    assert_eq!(
        err,
        InvalidObject::Address {
            field: "spec.externalIPs",
            value: "203.0.113.256".into()
        }
    );
    assert!(err.to_string().contains("\"203.0.113.256\""), "{err}");
}

#[test]
fn a_malformed_load_balancer_ingress_ip_is_rejected() {
    let svc = load_balancer(
        json!({"type": "LoadBalancer", "clusterIP": "10.96.0.1", "ports": tcp_80()}),
        json!([{"ip": "203.0.113.1 -j ACCEPT"}]),
    );
    assert!(matches!(
        rejected(&svc),
        InvalidObject::Address {
            field: "status.loadBalancer.ingress.ip",
            ..
        }
    ));
}

/// Addresses that parse but that the API server refuses (or never allocates) for Service and
/// endpoint addresses, in both families.
const SPECIAL_ADDRESSES: [&str; 11] = [
    "127.0.0.1",
    "127.1.2.3",
    "0.0.0.0",
    "169.254.10.1",
    "224.0.0.251",
    "239.1.2.3",
    "255.255.255.255",
    "::1",
    "::",
    "fe80::1",
    "ff02::fb",
];

fn assert_special(err: InvalidObject, field: &'static str, value: &str) {
    match &err {
        InvalidObject::SpecialAddress {
            field: f, value: v, ..
        } if *f == field && v == value => {}
        other => panic!("{value} in {field}: expected a special-address rejection, got {other:?}"),
    }
    assert!(err.to_string().contains("may not be"), "{err}");
}

/// Defect: a ClusterIP of 127.0.0.1 was accepted, and the reject rule for its unknown ports
/// then refused every TCP connection to the node's loopback, `/healthz` included.
#[test]
fn special_cluster_ips_are_rejected_as_the_api_server_would() {
    for bad in SPECIAL_ADDRESSES
        .iter()
        .chain(&["::ffff:10.96.0.1", "::a60:1", "::10.96.0.1"])
    {
        let family = if bad.contains(':') { "IPv6" } else { "IPv4" };
        let svc = service(json!({"clusterIP": bad, "clusterIPs": [bad],
            "ipFamilies": [family], "ports": tcp_80()}));
        assert_special(rejected(&svc), "spec.clusterIPs", bad);
    }
}

#[test]
fn special_external_and_load_balancer_ips_are_rejected() {
    for bad in SPECIAL_ADDRESSES {
        let svc = service(json!({
            "clusterIP": "10.96.0.1",
            "externalIPs": ["203.0.113.7", bad],
            "ports": tcp_80(),
        }));
        assert_special(rejected(&svc), "spec.externalIPs", bad);
        let lb = load_balancer(
            json!({"type": "LoadBalancer", "clusterIP": "10.96.0.1", "ports": tcp_80()}),
            json!([{"ip": bad}]),
        );
        assert_special(rejected(&lb), "status.loadBalancer.ingress.ip", bad);
    }
}

#[test]
fn ordinary_private_and_public_addresses_are_accepted() {
    for good in [
        "10.96.0.1",
        "192.168.50.10",
        "203.0.113.7",
        "fd00:10:96::1",
        "2001:db8::7",
    ] {
        let family = if good.contains(':') { "IPv6" } else { "IPv4" };
        let svc = service(json!({"clusterIP": good, "clusterIPs": [good],
            "ipFamilies": [family], "externalIPs": [good], "ports": tcp_80()}));
        assert_eq!(proxied(&svc).len(), 1, "{good}");
    }
}

#[test]
fn service_ports_outside_1_to_65535_are_rejected() {
    for bad in [0, 70000, -1] {
        let err = rejected(&service(
            json!({"clusterIP": "10.96.0.1", "ports": [{"port": bad}]}),
        ));
        assert_eq!(
            err,
            InvalidObject::Port {
                field: "spec.ports.port",
                value: bad.into()
            }
        );
        assert_eq!(
            err.to_string(),
            format!("invalid spec.ports.port {bad}: must be 1-65535")
        );
    }
    assert_eq!(
        only_port(&service(
            json!({"clusterIP": "10.96.0.1", "ports": [{"port": 65535}]})
        ))
        .port,
        65535
    );
    assert_eq!(
        only_port(&service(
            json!({"clusterIP": "10.96.0.1", "ports": [{"port": 1}]})
        ))
        .port,
        1
    );
}

#[test]
fn node_ports_outside_1_to_65535_are_rejected() {
    for bad in [70000, -5, 65536] {
        let svc = service(json!({
            "type": "NodePort",
            "clusterIP": "10.96.0.1",
            "ports": [{"port": 80, "nodePort": bad}],
        }));
        assert_eq!(
            rejected(&svc),
            InvalidObject::Port {
                field: "spec.ports.nodePort",
                value: bad.into()
            }
        );
    }
}

#[test]
fn protocols_other_than_tcp_udp_and_sctp_are_rejected() {
    for bad in ["ICMP", "tcp", "TCP ", ""] {
        let svc =
            service(json!({"clusterIP": "10.96.0.1", "ports": [{"port": 80, "protocol": bad}]}));
        assert_eq!(rejected(&svc), InvalidObject::Protocol(bad.into()));
    }
    let sctp =
        service(json!({"clusterIP": "10.96.0.1", "ports": [{"port": 80, "protocol": "SCTP"}]}));
    assert_eq!(only_port(&sctp).name.protocol, Protocol::Sctp);
}

#[test]
fn two_ports_with_the_same_name_and_protocol_are_rejected() {
    let svc = service(json!({
        "clusterIP": "10.96.0.1",
        "ports": [
            {"name": "http", "port": 80, "protocol": "TCP"},
            {"name": "http", "port": 8080, "protocol": "TCP"},
        ],
    }));
    let err = rejected(&svc);
    assert_eq!(err, InvalidObject::DuplicatePort("http".into()));
    assert_eq!(err.to_string(), "duplicate port \"http\"");

    let two_unnamed =
        service(json!({"clusterIP": "10.96.0.1", "ports": [{"port": 80}, {"port": 81}]}));
    assert_eq!(
        rejected(&two_unnamed),
        InvalidObject::DuplicatePort(String::new())
    );
}

#[test]
fn two_ports_with_the_same_number_and_protocol_are_rejected_as_the_api_server_does() {
    let svc = service(json!({
        "clusterIP": "10.96.0.1",
        "ports": [
            {"name": "a", "port": 80, "protocol": "TCP", "targetPort": 8080},
            {"name": "b", "port": 80, "protocol": "TCP", "targetPort": 9090},
        ],
    }));
    let err = rejected(&svc);
    assert_eq!(
        err,
        InvalidObject::DuplicatePortNumber {
            port: 80,
            protocol: "TCP".into()
        }
    );
    assert_eq!(err.to_string(), "duplicate port number 80/TCP");
    // The same number under two protocols is two frontends.
    let dns = service(json!({
        "clusterIP": "10.96.0.1",
        "ports": [
            {"name": "dns", "port": 53, "protocol": "UDP"},
            {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
        ],
    }));
    assert_eq!(proxied(&dns).len(), 2);
}

#[test]
fn one_port_name_may_be_used_by_two_protocols() {
    let svc = service(json!({
        "clusterIP": "10.96.0.1",
        "ports": [
            {"name": "dns", "port": 53, "protocol": "UDP"},
            {"name": "dns", "port": 53, "protocol": "TCP"},
        ],
    }));
    let protocols: Vec<Protocol> = proxied(&svc).iter().map(|p| p.name.protocol).collect();
    assert_eq!(protocols, [Protocol::Udp, Protocol::Tcp]);
}

#[test]
fn hostile_names_are_rejected_and_shown_escaped() {
    let hostile_port = service(json!({
        "clusterIP": "10.96.0.1",
        "ports": [{"name": "http\"; drop", "port": 80}],
    }));
    let hostile_namespace = service_with_meta(
        json!({"namespace": "web\nflush ruleset", "name": "api"}),
        json!({"clusterIP": "10.96.0.1", "ports": tcp_80()}),
    );
    let hostile_name = service_with_meta(
        json!({"namespace": "web", "name": "api\"; drop"}),
        json!({"clusterIP": "10.96.0.1", "ports": tcp_80()}),
    );
    let cases = [
        (hostile_port, "spec.ports.name", "http\"; drop"),
        (
            hostile_namespace,
            "metadata.namespace",
            "web\nflush ruleset",
        ),
        (hostile_name, "metadata.name", "api\"; drop"),
    ];
    for (svc, expected_field, raw) in cases {
        let err = rejected(&svc);
        let InvalidObject::Name { field, value, .. } = &err else {
            panic!("expected a name error, got {err:?}")
        };
        assert_eq!((*field, value.as_str()), (expected_field, raw));
        let message = err.to_string();
        // The value is shown quoted and escaped, so a log line cannot be split or spoofed.
        assert_eq!(
            message,
            format!("invalid {expected_field} {raw:?}: only lower-case letters, digits and '-' are allowed")
        );
        assert!(
            !message.contains('\n'),
            "message must not carry a raw newline: {message}"
        );
    }
}

#[test]
fn names_must_be_dns_labels() {
    assert!(validate_dns_label("f", "a").is_ok());
    assert!(validate_dns_label("f", "my-svc-2").is_ok());
    assert!(validate_dns_label("f", &"a".repeat(63)).is_ok());
    for bad in ["", "-a", "a-", "A", "a.b", "a_b", "ä", "a b"] {
        assert!(validate_dns_label("f", bad).is_err(), "{bad:?} accepted");
    }
    let too_long = validate_dns_label("f", &"a".repeat(64)).expect_err("64 characters");
    assert!(
        too_long.to_string().contains("longer than 63"),
        "{too_long}"
    );

    assert!(validate_dns_subdomain("f", "api-x7k2p.example").is_ok());
    for bad in ["a..b", ".a", "a.", "a/b"] {
        assert!(
            validate_dns_subdomain("f", bad).is_err(),
            "{bad:?} accepted"
        );
    }
    let long = [
        "a".repeat(63),
        "b".repeat(63),
        "c".repeat(63),
        "d".repeat(63),
    ]
    .join(".");
    assert!(validate_dns_subdomain("f", &long).is_err());
}

#[test]
fn client_ip_affinity_defaults_to_three_hours() {
    let svc = service(
        json!({"clusterIP": "10.96.0.1", "sessionAffinity": "ClientIP", "ports": tcp_80()}),
    );
    assert_eq!(only_port(&svc).session_affinity_timeout, Some(10800));
}

#[test]
fn client_ip_affinity_uses_the_configured_timeout_within_one_day() {
    for ok in [1, 60, 86400] {
        let svc = service(json!({
            "clusterIP": "10.96.0.1",
            "sessionAffinity": "ClientIP",
            "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": ok}},
            "ports": tcp_80(),
        }));
        assert_eq!(only_port(&svc).session_affinity_timeout, Some(ok as u32));
    }
}

#[test]
fn client_ip_affinity_timeouts_outside_one_second_to_one_day_are_rejected() {
    for bad in [0, -1, 86401] {
        let svc = service(json!({
            "clusterIP": "10.96.0.1",
            "sessionAffinity": "ClientIP",
            "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": bad}},
            "ports": tcp_80(),
        }));
        let err = rejected(&svc);
        let message = err.to_string();
        assert!(
            message.contains("spec.sessionAffinityConfig.clientIP.timeoutSeconds"),
            "{message}"
        );
        assert!(message.contains(&bad.to_string()), "{message}");
        assert!(
            message.contains("86400"),
            "the message must state the real bound: {message}"
        );
    }
}

#[test]
fn affinity_config_without_client_ip_affinity_is_not_programmed() {
    let svc = service(json!({
        "clusterIP": "10.96.0.1",
        "sessionAffinity": "None",
        "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}},
        "ports": tcp_80(),
    }));
    assert_eq!(only_port(&svc).session_affinity_timeout, None);
}

#[test]
fn traffic_policies_and_the_health_check_node_port_are_carried() {
    let svc = load_balancer(
        json!({
            "type": "LoadBalancer",
            "clusterIP": "10.96.0.1",
            "internalTrafficPolicy": "Local",
            "externalTrafficPolicy": "Local",
            "healthCheckNodePort": 32000,
            "ports": [{"port": 80, "nodePort": 30080}],
        }),
        json!([{"ip": "203.0.113.10"}]),
    );
    let port = only_port(&svc);
    assert!(port.internal_traffic_local);
    assert!(port.external_policy_local());
    assert_eq!(port.health_check_node_port, Some(32000));
}

#[test]
fn external_local_policy_without_external_access_has_no_effect() {
    let svc = service(json!({
        "type": "ClusterIP",
        "clusterIP": "10.96.0.1",
        "externalTrafficPolicy": "Local",
        "healthCheckNodePort": 32000,
        "ports": tcp_80(),
    }));
    let port = only_port(&svc);
    assert!(!port.external_policy_local());
    assert!(!port.internal_traffic_local);
}

#[test]
fn a_health_check_node_port_under_cluster_policy_is_not_programmed() {
    let svc = service(json!({
        "type": "NodePort",
        "clusterIP": "10.96.0.1",
        "externalTrafficPolicy": "Cluster",
        "healthCheckNodePort": 32000,
        "ports": [{"port": 80, "nodePort": 30080}],
    }));
    assert_eq!(only_port(&svc).health_check_node_port, None);
}

#[test]
fn an_out_of_range_health_check_node_port_is_rejected() {
    let svc = service(json!({
        "type": "NodePort",
        "clusterIP": "10.96.0.1",
        "externalTrafficPolicy": "Local",
        "healthCheckNodePort": 0,
        "ports": [{"port": 80, "nodePort": 30080}],
    }));
    assert!(matches!(
        rejected(&svc),
        InvalidObject::Port {
            field: "spec.healthCheckNodePort",
            value: 0
        }
    ));
}

// ---- EndpointSlices ----

const NODE: &str = "node-a";

/// An EndpointSlice `web/api-abc12` of Service `web/api`, with one port `http` 8080/TCP.
fn slice(address_type: &str, endpoints: Value) -> EndpointSlice {
    serde_json::from_value(json!({
        "metadata": {
            "namespace": "web",
            "name": "api-abc12",
            "labels": {"kubernetes.io/service-name": "api"},
        },
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }))
    .expect("EndpointSlice JSON")
}

fn converted(slice: &EndpointSlice) -> SliceEndpoints {
    slice_endpoints(slice, NODE)
        .expect("valid slice")
        .expect("a slice we use")
}

fn converted_endpoints(slice: &EndpointSlice) -> Vec<Endpoint> {
    let mut eps = converted(slice);
    assert_eq!(eps.ports.len(), 1);
    eps.ports.remove(0).endpoints
}

fn slice_rejected(slice: &EndpointSlice) -> InvalidObject {
    match slice_endpoints(slice, NODE) {
        Err(e) => e,
        Ok(other) => panic!("expected an invalid slice, got {other:?}"),
    }
}

#[test]
fn a_slice_joins_its_service_by_label_and_lists_endpoints_per_port() {
    let mut s = slice(
        "IPv4",
        json!([{"addresses": ["10.244.1.5"]}, {"addresses": ["10.244.2.6"]}]),
    );
    s.ports = serde_json::from_value(json!([
        {"name": "http", "port": 8080, "protocol": "TCP"},
        {"name": "", "port": 53, "protocol": "UDP"},
    ]))
    .expect("ports JSON");
    let eps = converted(&s);
    assert_eq!(eps.service, ServiceKey::new("web", "api"));
    assert_eq!(eps.slice_name, "api-abc12");
    assert_eq!(eps.family, IpFamily::V4);
    assert_eq!(eps.trigger_time, None);
    assert_eq!(eps.ports.len(), 2);
    assert_eq!(
        (eps.ports[0].port_name.as_str(), eps.ports[0].protocol),
        ("http", Protocol::Tcp)
    );
    assert_eq!(
        (eps.ports[1].port_name.as_str(), eps.ports[1].protocol),
        ("", Protocol::Udp)
    );
    let shown: Vec<String> = eps.ports[1]
        .endpoints
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(shown, ["10.244.1.5:53", "10.244.2.6:53"]);
    assert!(eps.ports[0].endpoints.iter().all(|e| e.port == 8080));
}

#[test]
fn endpoint_conditions_default_to_ready_serving_and_not_terminating() {
    let eps = converted_endpoints(&slice("IPv4", json!([{"addresses": ["10.244.1.5"]}])));
    assert!(eps[0].ready && eps[0].serving && !eps[0].terminating);
    let empty = converted_endpoints(&slice(
        "IPv4",
        json!([{"addresses": ["10.244.1.5"], "conditions": {}}]),
    ));
    assert!(empty[0].ready && empty[0].serving && !empty[0].terminating);
}

#[test]
fn an_unset_serving_condition_follows_ready() {
    let eps = converted_endpoints(&slice(
        "IPv4",
        json!([
            {"addresses": ["10.244.1.5"], "conditions": {"ready": false}},
            {"addresses": ["10.244.1.6"], "conditions": {"ready": true}},
        ]),
    ));
    assert!(!eps[0].ready && !eps[0].serving);
    assert!(eps[1].ready && eps[1].serving);
}

#[test]
fn explicit_conditions_are_kept() {
    let eps = converted_endpoints(&slice(
        "IPv4",
        json!([{"addresses": ["10.244.1.5"], "conditions": {"ready": false, "serving": true, "terminating": true}}]),
    ));
    assert!(!eps[0].ready && eps[0].serving && eps[0].terminating);
}

#[test]
fn an_ipv6_slice_converts() {
    let eps = converted(&slice("IPv6", json!([{"addresses": ["fd00:244::5"]}])));
    assert_eq!(eps.family, IpFamily::V6);
    let ep = &eps.ports[0].endpoints[0];
    assert_eq!(
        ep.ip,
        IpAddr::V6(Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, 5))
    );
    assert_eq!(ep.to_string(), "[fd00:244::5]:8080");
}

#[test]
fn an_address_of_the_other_family_is_rejected() {
    for (address_type, address) in [("IPv4", "fd00:244::5"), ("IPv6", "10.244.1.5")] {
        let err = slice_rejected(&slice(address_type, json!([{"addresses": [address]}])));
        let InvalidObject::Address { field, value } = &err else {
            panic!("expected an address error, got {err:?}")
        };
        assert!(field.contains("family"), "{field}");
        assert_eq!(value, address);
    }
}

#[test]
fn malformed_endpoint_addresses_are_rejected() {
    for bad in ["10.244.1.300", "010.244.1.5", "10.244.1.5; drop", ""] {
        let err = slice_rejected(&slice("IPv4", json!([{"addresses": [bad]}])));
        assert_eq!(
            err,
            InvalidObject::Address {
                field: "endpoints.addresses",
                value: bad.into()
            }
        );
    }
    let none = slice_rejected(&slice("IPv4", json!([{"addresses": []}])));
    assert_eq!(none, InvalidObject::Missing("endpoints.addresses"));
}

#[test]
fn special_endpoint_addresses_are_rejected() {
    for bad in SPECIAL_ADDRESSES {
        let family = if bad.contains(':') { "IPv6" } else { "IPv4" };
        let err = slice_rejected(&slice(family, json!([{"addresses": [bad]}])));
        assert_special(err, "endpoints.addresses", bad);
    }
}

#[test]
fn a_slice_without_the_service_name_label_is_not_used() {
    let mut s = slice("IPv4", json!([{"addresses": ["10.244.1.5"]}]));
    s.metadata.labels = None;
    assert_eq!(slice_endpoints(&s, NODE), Ok(None));
}

#[test]
fn an_fqdn_slice_is_not_used() {
    let s = slice("FQDN", json!([{"addresses": ["db.example.com"]}]));
    assert_eq!(slice_endpoints(&s, NODE), Ok(None));
}

#[test]
fn hostile_slice_fields_are_rejected() {
    let mut bad_label = slice("IPv4", json!([{"addresses": ["10.244.1.5"]}]));
    bad_label.metadata.labels =
        Some([(LABEL_SERVICE_NAME.to_string(), "api\"; drop".to_string())].into());
    assert!(matches!(
        slice_rejected(&bad_label),
        InvalidObject::Name {
            field: "label kubernetes.io/service-name",
            ..
        }
    ));

    let mut bad_port_name = slice("IPv4", json!([{"addresses": ["10.244.1.5"]}]));
    bad_port_name.ports =
        serde_json::from_value(json!([{"name": "http\nx", "port": 8080}])).expect("ports JSON");
    assert!(matches!(
        slice_rejected(&bad_port_name),
        InvalidObject::Name {
            field: "ports.name",
            ..
        }
    ));

    let mut bad_port = slice("IPv4", json!([{"addresses": ["10.244.1.5"]}]));
    bad_port.ports =
        serde_json::from_value(json!([{"name": "http", "port": 70000}])).expect("ports JSON");
    assert_eq!(
        slice_rejected(&bad_port),
        InvalidObject::Port {
            field: "ports.port",
            value: 70000
        }
    );

    let mut bad_protocol = slice("IPv4", json!([{"addresses": ["10.244.1.5"]}]));
    bad_protocol.ports =
        serde_json::from_value(json!([{"name": "http", "port": 8080, "protocol": "ICMP"}]))
            .expect("ports JSON");
    assert_eq!(
        slice_rejected(&bad_protocol),
        InvalidObject::Protocol("ICMP".into())
    );

    let bad_node = slice(
        "IPv4",
        json!([{"addresses": ["10.244.1.5"], "nodeName": "node a"}]),
    );
    assert!(matches!(
        slice_rejected(&bad_node),
        InvalidObject::Name {
            field: "endpoints.nodeName",
            ..
        }
    ));

    let mut bad_namespace = slice("IPv4", json!([{"addresses": ["10.244.1.5"]}]));
    bad_namespace.metadata.namespace = Some("web\"".into());
    assert!(matches!(
        slice_rejected(&bad_namespace),
        InvalidObject::Name {
            field: "metadata.namespace",
            ..
        }
    ));
}

#[test]
fn a_slice_port_without_a_number_is_skipped() {
    let mut s = slice("IPv4", json!([{"addresses": ["10.244.1.5"]}]));
    s.ports = serde_json::from_value(json!([{"name": "all"}, {"name": "http", "port": 8080}]))
        .expect("ports JSON");
    let eps = converted(&s);
    assert_eq!(eps.ports.len(), 1);
    assert_eq!(eps.ports[0].port_name, "http");
}

#[test]
fn endpoints_on_this_node_are_local() {
    let eps = converted_endpoints(&slice(
        "IPv4",
        json!([
            {"addresses": ["10.244.1.5"], "nodeName": NODE},
            {"addresses": ["10.244.2.5"], "nodeName": "node-b"},
            {"addresses": ["10.244.3.5"]},
        ]),
    ));
    let local: Vec<bool> = eps.iter().map(|e| e.is_local).collect();
    assert_eq!(local, [true, false, false]);
}

#[test]
fn zone_hints_are_kept_and_absent_hints_stay_absent() {
    let eps = converted_endpoints(&slice(
        "IPv4",
        json!([
            {"addresses": ["10.244.1.5"], "zone": "zone-a", "hints": {"forZones": [{"name": "zone-a"}, {"name": "zone-b"}]}},
            {"addresses": ["10.244.2.5"], "zone": "zone-b"},
        ]),
    ));
    let hinted: BTreeSet<String> = ["zone-a".to_string(), "zone-b".to_string()].into();
    assert_eq!(eps[0].zone_hints, Some(hinted));
    assert_eq!(eps[1].zone_hints, None);
}

#[test]
fn the_trigger_time_annotation_is_read_as_unix_seconds() {
    let mut s = slice("IPv4", json!([{"addresses": ["10.244.1.5"]}]));
    s.metadata.annotations = Some(
        [(
            ANNOTATION_TRIGGER_TIME.to_string(),
            "2021-01-01T00:00:00Z".to_string(),
        )]
        .into(),
    );
    assert_eq!(converted(&s).trigger_time, Some(1_609_459_200.0));
    s.metadata.annotations =
        Some([(ANNOTATION_TRIGGER_TIME.to_string(), "yesterday".to_string())].into());
    assert_eq!(converted(&s).trigger_time, None);
}

// ---- Nodes ----

fn node(value: Value) -> Node {
    serde_json::from_value(value).expect("Node JSON")
}

#[test]
fn a_node_reports_its_pod_cidrs_and_zone() {
    let info = node_info(&node(json!({
        "metadata": {"name": NODE, "labels": {"topology.kubernetes.io/zone": "zone-a"}},
        "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24", "fd00:244:1::/64"]},
    })))
    .expect("valid node");
    assert_eq!(info.name, NODE);
    assert_eq!(info.zone.as_deref(), Some("zone-a"));
    assert_eq!(
        info.pod_cidrs,
        [net("10.244.1.0/24"), net("fd00:244:1::/64")]
    );
    assert!(info.exists && !info.deleting && !info.to_be_deleted);
    assert!(info.eligible());
}

#[test]
fn a_node_with_only_the_single_pod_cidr_field_uses_it() {
    let info = node_info(&node(
        json!({"metadata": {"name": NODE}, "spec": {"podCIDR": "10.244.1.7/24"}}),
    ))
    .expect("valid node");
    assert_eq!(info.pod_cidrs, [net("10.244.1.0/24")]);
    assert_eq!(info.zone, None);
}

#[test]
fn a_node_with_a_malformed_pod_cidr_is_rejected() {
    let err = node_info(&node(
        json!({"metadata": {"name": NODE}, "spec": {"podCIDRs": ["10.244.1.0/24 accept"]}}),
    ));
    assert!(
        matches!(
            err,
            Err(InvalidObject::Address {
                field: "spec.podCIDRs",
                ..
            })
        ),
        "{err:?}"
    );
}

#[test]
fn a_node_marked_by_the_autoscaler_is_not_eligible() {
    let info = node_info(&node(json!({
        "metadata": {"name": NODE},
        "spec": {"taints": [
            {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"},
            {"key": "ToBeDeletedByClusterAutoscaler", "value": "1700000000", "effect": "NoSchedule"},
        ]},
    })))
    .expect("valid node");
    assert!(info.to_be_deleted);
    assert!(!info.eligible());
}

#[test]
fn a_node_being_deleted_is_not_eligible() {
    let info = node_info(&node(json!({
        "metadata": {"name": NODE, "deletionTimestamp": "2024-02-29T12:00:00Z"},
    })))
    .expect("valid node");
    assert!(info.deleting);
    assert!(!info.eligible());
}

#[test]
fn a_node_with_other_taints_is_eligible() {
    let info = node_info(&node(json!({
        "metadata": {"name": NODE},
        "spec": {"taints": [{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}]},
    })))
    .expect("valid node");
    assert!(info.eligible());
}

/// Found by kp-fuzz: a Node address that iptables-save prints in another form (`::10.3.183.72`)
/// made every IPv6 iptables sync refuse its shared rules.
#[test]
fn a_node_with_an_ipv4_compatible_or_mapped_address_is_rejected() {
    for bad in ["::1003:b748", "::ffff:192.0.2.1"] {
        let n = node(json!({
            "metadata": {"name": "node-a"},
            "status": {"addresses": [{"type": "InternalIP", "address": bad}]},
        }));
        assert!(
            matches!(
                node_info(&n),
                Err(InvalidObject::SpecialAddress {
                    field: "status.addresses",
                    ..
                })
            ),
            "{bad}"
        );
    }
    let n = node(json!({"metadata": {"name": "node-a"},
        "spec": {"podCIDRs": ["10.244.1.0/24", "::ffff:10.244.1.0/120"]}}));
    assert!(matches!(
        node_info(&n),
        Err(InvalidObject::SpecialAddress {
            field: "spec.podCIDRs",
            ..
        })
    ));
}

#[test]
fn a_node_without_a_name_is_rejected() {
    assert_eq!(
        node_info(&node(json!({"metadata": {}}))),
        Err(InvalidObject::Missing("metadata.name"))
    );
}

// ---- Timestamps ----

#[test]
fn rfc3339_timestamps_convert_to_unix_seconds() {
    let cases = [
        ("1970-01-01T00:00:00Z", 0.0),
        ("1969-12-31T23:59:59Z", -1.0),
        ("2000-03-01T00:00:00Z", 951_868_800.0),
        ("1999-12-31T23:59:59Z", 946_684_799.0),
        ("2021-01-01T00:00:00Z", 1_609_459_200.0),
        ("2024-02-29T12:00:00.5Z", 1_709_208_000.5),
        ("2024-02-29T12:00:00.000001Z", 1_709_208_000.000_001),
    ];
    for (text, expected) in cases {
        let got = parse_rfc3339_seconds(text).unwrap_or_else(|| panic!("{text} did not parse"));
        assert!((got - expected).abs() < 1e-6, "{text}: {got} != {expected}");
    }
}

#[test]
fn anything_but_an_rfc3339_utc_timestamp_is_not_a_time() {
    for bad in [
        "",
        "yesterday",
        "2024-02-29T12:00:00",
        "2024-02-29T12:00:00+00:00",
        "2024-02-29 12:00:00Z",
        "2024-13-01T00:00:00Z",
        "2024-00-01T00:00:00Z",
        "2024-04-31T00:00:00Z",
        "2023-02-29T00:00:00Z",
        "2024-02-30T00:00:00Z",
        "2024-02-29T24:00:00Z",
        "2024-02-29T-1:00:00Z",
        "2024-02-29T12:-5:00Z",
        "2024--2-29T12:00:00Z",
        "2024-02-29T12:00:00.Z",
        "2024-02-29T12:00:00.-5Z",
        "2024-02-29T12:00:00.5e3Z",
        "2024-02-29T12:00Z",
    ] {
        assert_eq!(parse_rfc3339_seconds(bad), None, "{bad:?}");
    }
}

#[test]
fn endpoint_addresses_parse_to_the_exact_address() {
    let eps = converted_endpoints(&slice("IPv4", json!([{"addresses": ["10.244.1.5"]}])));
    assert_eq!(eps[0].ip, IpAddr::V4(Ipv4Addr::new(10, 244, 1, 5)));
}

#[test]
fn ipv4_mapped_and_compatible_ipv6_ranges_are_told_apart_from_the_rest() {
    for embedded in [
        "::ffff:10.0.0.0/104",
        "::ffff:1.2.3.4/128",
        "::a00:0/104",
        "::/96",
        "::102:304/128",
    ] {
        assert!(ipv4_embedded(&net(embedded)), "{embedded}");
    }
    for other in [
        "::/0",
        "::1/128",
        "::/128",
        "fd00::/64",
        "10.0.0.0/8",
        "2001:db8::/32",
        "::/64",
    ] {
        assert!(!ipv4_embedded(&net(other)), "{other}");
    }
}
