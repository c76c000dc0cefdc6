//! Turning Kubernetes objects into the validated model.
//!
//! Every field that can reach rule text (addresses, ports, protocols, names) is checked here, so
//! a malformed or hostile object is rejected whole, with a reason, before any renderer sees it.
//! Mirrors the filtering in upstream `pkg/proxy/servicechangetracker.go` (`serviceToServiceMap`)
//! and `pkg/proxy/endpointslicecache.go`.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::str::FromStr;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;

use crate::model::{
    Endpoint, IpFamily, NodeInfo, Protocol, ServiceKey, ServicePort, ServicePortName,
    SliceEndpoints, SlicePort,
};

/// Label naming another proxy that owns a Service.
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// Label marking a headless Service.
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";
/// Label joining an EndpointSlice to its Service.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// Annotation carrying the time of the change that produced an EndpointSlice.
pub const ANNOTATION_TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";
/// Node label holding the zone.
pub const LABEL_ZONE: &str = "topology.kubernetes.io/zone";
/// Taint the cluster autoscaler puts on nodes it is about to delete.
pub const TAINT_TO_BE_DELETED: &str = "ToBeDeletedByClusterAutoscaler";

/// Why an object was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidObject {
    /// A required field is missing.
    #[error("missing field {0}")]
    Missing(&'static str),
    /// A name is not a valid DNS label / subdomain.
    #[error("invalid {field} {value:?}: {reason}")]
    Name {
        /// Which field.
        field: &'static str,
        /// The offending value (escaped by `Debug`).
        value: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// An address or CIDR does not parse.
    #[error("invalid {field} {value:?}")]
    Address {
        /// Which field.
        field: &'static str,
        /// The offending value.
        value: String,
    },
    /// An address parses but is one the API server refuses for this field (loopback,
    /// link-local, multicast, unspecified, broadcast, IPv4-mapped IPv6). Programming one would
    /// capture traffic the node needs: a ClusterIP of 127.0.0.1 with a reject rule for its
    /// unknown ports refuses every TCP connection to the node's own loopback.
    #[error("invalid {field} {value:?}: {reason}")]
    SpecialAddress {
        /// Which field.
        field: &'static str,
        /// The offending value.
        value: String,
        /// Which range it falls in.
        reason: &'static str,
    },
    /// A port is out of range.
    #[error("invalid {field} {value}: must be 1-65535")]
    Port {
        /// Which field.
        field: &'static str,
        /// The offending value.
        value: i64,
    },
    /// A number other than a port is outside the range the API allows.
    #[error("invalid {field} {value}: must be {min}-{max}")]
    OutOfRange {
        /// Which field.
        field: &'static str,
        /// The offending value.
        value: i64,
        /// The smallest allowed value.
        min: i64,
        /// The largest allowed value.
        max: i64,
    },
    /// A protocol is not TCP, UDP or SCTP.
    #[error("invalid protocol {0:?}")]
    Protocol(String),
    /// Two ports of one Service share a name and protocol.
    #[error("duplicate port {0:?}")]
    DuplicatePort(String),
    /// Two ports of one Service share a port number and protocol, which the API server refuses
    /// (both would want the same frontends).
    #[error("duplicate port number {port}/{protocol}")]
    DuplicatePortNumber {
        /// The port number.
        port: u16,
        /// Its protocol.
        protocol: String,
    },
}

/// How a Service was accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServiceDisposition {
    /// Proxied through these ports.
    Proxied(Vec<ServicePort>),
    /// Valid, but not ours to proxy (headless, ExternalName, other proxy, no ClusterIP).
    Ignored(&'static str),
}

const MAX_LABEL: usize = 63;
const MAX_SUBDOMAIN: usize = 253;

/// Checks an RFC 1123 DNS label (namespaces, Service names, port names).
pub fn validate_dns_label(field: &'static str, value: &str) -> Result<(), InvalidObject> {
    let err = |reason| InvalidObject::Name {
        field,
        value: value.to_string(),
        reason,
    };
    if value.is_empty() {
        return Err(err("must not be empty"));
    }
    if value.len() > MAX_LABEL {
        return Err(err("longer than 63 characters"));
    }
    let bytes = value.as_bytes();
    if !bytes
        .iter()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
    {
        return Err(err("only lower-case letters, digits and '-' are allowed"));
    }
    if bytes[0] == b'-' || bytes[bytes.len() - 1] == b'-' {
        return Err(err("must start and end with a letter or digit"));
    }
    Ok(())
}

/// Checks an RFC 1123 DNS subdomain (EndpointSlice and Node names).
pub fn validate_dns_subdomain(field: &'static str, value: &str) -> Result<(), InvalidObject> {
    if value.len() > MAX_SUBDOMAIN {
        return Err(InvalidObject::Name {
            field,
            value: value.to_string(),
            reason: "longer than 253 characters",
        });
    }
    for label in value.split('.') {
        validate_dns_label(field, label).map_err(|_| InvalidObject::Name {
            field,
            value: value.to_string(),
            reason: "must be dot-separated DNS labels",
        })?;
    }
    Ok(())
}

fn parse_ip(field: &'static str, value: &str) -> Result<IpAddr, InvalidObject> {
    // std's parser is strict: no leading zeros, no zones, no whitespace.
    IpAddr::from_str(value).map_err(|_| InvalidObject::Address {
        field,
        value: value.to_string(),
    })
}

/// Why `ip` cannot be a Service or endpoint address, if it cannot: the ranges the API server
/// refuses for external IPs and endpoint addresses (`ValidateNonSpecialIP`, `validateEndpointIP`)
/// plus the rest of multicast and the IPv4 broadcast address, which no allocator hands out as a
/// ClusterIP. IPv4-mapped IPv6 addresses are refused too: they would be programmed into the IPv6
/// table, where no IPv4 connection ever matches them, and so are the deprecated IPv4-compatible
/// ones (`::a.b.c.d`).
pub fn special_address(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(a) => {
            if a.is_unspecified() {
                Some("may not be unspecified (0.0.0.0)")
            } else if a.is_loopback() {
                Some("may not be in the loopback range (127.0.0.0/8)")
            } else if a.is_link_local() {
                Some("may not be in the link-local range (169.254.0.0/16)")
            } else if a.is_multicast() {
                Some("may not be multicast (224.0.0.0/4)")
            } else if a.is_broadcast() {
                Some("may not be the broadcast address (255.255.255.255)")
            } else {
                None
            }
        }
        IpAddr::V6(a) => {
            if a.is_unspecified() {
                Some("may not be unspecified (::)")
            } else if a.is_loopback() {
                Some("may not be the loopback address (::1)")
            } else if a.is_unicast_link_local() {
                Some("may not be in the link-local range (fe80::/10)")
            } else if a.is_multicast() {
                Some("may not be multicast (ff00::/8)")
            } else if a.to_ipv4_mapped().is_some() {
                Some("may not be an IPv4-mapped IPv6 address (::ffff:0:0/96)")
            } else if a.segments()[..6] == [0; 6] {
                // Deprecated (RFC 4291), and printed in dotted form by iptables-save
                // (`::10.0.0.1`), so no rule holding one ever reads back as written.
                Some("may not be an IPv4-compatible IPv6 address (::/96)")
            } else {
                None
            }
        }
    }
}

/// Parses an address that traffic is sent to or from (a ClusterIP, external IP, LoadBalancer
/// IP or endpoint), refusing the special ranges of [`special_address`].
pub(crate) fn parse_service_ip(field: &'static str, value: &str) -> Result<IpAddr, InvalidObject> {
    let ip = parse_ip(field, value)?;
    match special_address(ip) {
        Some(reason) => Err(InvalidObject::SpecialAddress {
            field,
            value: value.to_string(),
            reason,
        }),
        None => Ok(ip),
    }
}

fn parse_cidr(field: &'static str, value: &str) -> Result<IpNet, InvalidObject> {
    let net = IpNet::from_str(value.trim()).map_err(|_| InvalidObject::Address {
        field,
        value: value.to_string(),
    })?;
    Ok(net.trunc())
}

fn port(field: &'static str, value: i32) -> Result<u16, InvalidObject> {
    if (1..=65535).contains(&value) {
        Ok(value as u16)
    } else {
        Err(InvalidObject::Port {
            field,
            value: value.into(),
        })
    }
}

fn protocol(value: Option<&String>) -> Result<Protocol, InvalidObject> {
    match value {
        None => Ok(Protocol::Tcp),
        Some(p) => Protocol::from_kubernetes(p).ok_or_else(|| InvalidObject::Protocol(p.clone())),
    }
}

/// Validates the namespace and name of an object's metadata.
fn service_key(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> Result<ServiceKey, InvalidObject> {
    let namespace = meta.namespace.as_deref().unwrap_or("default");
    let name = meta
        .name
        .as_deref()
        .ok_or(InvalidObject::Missing("metadata.name"))?;
    validate_dns_label("metadata.namespace", namespace)?;
    validate_dns_label("metadata.name", name)?;
    Ok(ServiceKey::new(namespace, name))
}

/// Default ClientIP affinity timeout (3 hours), as upstream.
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10800;
/// Largest affinity timeout the API accepts (1 day).
pub const MAX_AFFINITY_TIMEOUT: u32 = 86400;

/// Converts a Service into its ports, or says why it is ignored or invalid.
pub fn service_ports(svc: &Service) -> Result<(ServiceKey, ServiceDisposition), InvalidObject> {
    let key = service_key(&svc.metadata)?;
    let labels = svc.metadata.labels.as_ref();
    if labels.is_some_and(|l| l.contains_key(LABEL_SERVICE_PROXY_NAME)) {
        return Ok((
            key,
            ServiceDisposition::Ignored("owned by another service proxy"),
        ));
    }
    if labels.is_some_and(|l| l.contains_key(LABEL_HEADLESS)) {
        return Ok((key, ServiceDisposition::Ignored("headless")));
    }
    let spec = svc.spec.as_ref().ok_or(InvalidObject::Missing("spec"))?;
    if spec.type_.as_deref() == Some("ExternalName") {
        return Ok((key, ServiceDisposition::Ignored("ExternalName")));
    }
    let mut cluster_ip_strings: Vec<&String> = spec.cluster_ips.iter().flatten().collect();
    if cluster_ip_strings.is_empty() {
        cluster_ip_strings.extend(spec.cluster_ip.iter());
    }
    // Upstream skips a Service whose primary ClusterIP is unset, "" or "None" (ShouldSkipService).
    if cluster_ip_strings.first().is_none_or(|ip| ip.is_empty())
        || cluster_ip_strings.iter().any(|ip| ip.as_str() == "None")
    {
        return Ok((key, ServiceDisposition::Ignored("headless or no ClusterIP")));
    }
    let mut cluster_ips: Vec<IpAddr> = Vec::new();
    for s in cluster_ip_strings {
        let ip = parse_service_ip("spec.clusterIPs", s)?;
        if !cluster_ips
            .iter()
            .any(|c| IpFamily::of(c) == IpFamily::of(&ip))
        {
            cluster_ips.push(ip);
        }
    }
    let external_ips = spec
        .external_ips
        .iter()
        .flatten()
        .map(|s| parse_service_ip("spec.externalIPs", s))
        .collect::<Result<Vec<_>, _>>()?;
    let is_lb = spec.type_.as_deref() == Some("LoadBalancer");
    let mut load_balancer_ips = Vec::new();
    if is_lb {
        let ingress = svc
            .status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|lb| lb.ingress.as_ref());
        for ing in ingress.into_iter().flatten() {
            // With ipMode "Proxy" the load balancer forwards to the node itself; short-circuiting
            // its IP in-node would bypass it, so upstream programs only VIP-mode (or unset) IPs.
            if ing.ip_mode.as_deref().is_some_and(|m| m != "VIP") {
                continue;
            }
            if let Some(ip) = &ing.ip {
                load_balancer_ips.push(parse_service_ip("status.loadBalancer.ingress.ip", ip)?);
            }
        }
    }
    let load_balancer_source_ranges = if is_lb {
        spec.load_balancer_source_ranges
            .iter()
            .flatten()
            .map(|s| {
                let net = parse_cidr("spec.loadBalancerSourceRanges", s)?;
                // As for a Service's addresses: an IPv4-mapped IPv6 range is the IPv4 range in
                // disguise (the ebpf mode's keys hold IPv4 addresses in that form, so its
                // range key would not read back: found by kp-fuzz). IPv4-compatible ranges
                // (`::a.b.c.d`) are left to the modes' validators.
                if ipv4_mapped(&net) {
                    return Err(InvalidObject::SpecialAddress {
                        field: "spec.loadBalancerSourceRanges",
                        value: s.clone(),
                        reason: "may not be an IPv4-mapped IPv6 range (::ffff:0:0/96)",
                    });
                }
                Ok(net)
            })
            .collect::<Result<Vec<_>, _>>()?
    } else {
        Vec::new()
    };
    let session_affinity_timeout = if spec.session_affinity.as_deref() == Some("ClientIP") {
        let t = spec
            .session_affinity_config
            .as_ref()
            .and_then(|c| c.client_ip.as_ref())
            .and_then(|c| c.timeout_seconds)
            .unwrap_or(DEFAULT_AFFINITY_TIMEOUT as i32);
        if t < 1 || t as u32 > MAX_AFFINITY_TIMEOUT {
            return Err(InvalidObject::OutOfRange {
                field: "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
                value: t.into(),
                min: 1,
                max: MAX_AFFINITY_TIMEOUT.into(),
            });
        }
        Some(t as u32)
    } else {
        None
    };
    let internal_traffic_local = spec.internal_traffic_policy.as_deref() == Some("Local");
    let external_traffic_local = spec.external_traffic_policy.as_deref() == Some("Local");
    let health_check_node_port = match spec.health_check_node_port {
        Some(p) if external_traffic_local => Some(port("spec.healthCheckNodePort", p)?),
        _ => None,
    };
    let mut ports = Vec::new();
    let mut seen = BTreeSet::new();
    let mut numbers = BTreeSet::new();
    for sp in spec.ports.iter().flatten() {
        let port_name = sp.name.clone().unwrap_or_default();
        if !port_name.is_empty() {
            validate_dns_label("spec.ports.name", &port_name)?;
        }
        let protocol = protocol(sp.protocol.as_ref())?;
        if !seen.insert((port_name.clone(), protocol)) {
            return Err(InvalidObject::DuplicatePort(port_name));
        }
        let node_port = match sp.node_port {
            Some(p) if spec.type_.as_deref() == Some("NodePort") || is_lb => {
                Some(port("spec.ports.nodePort", p)?)
            }
            _ => None,
        };
        let number = port("spec.ports.port", sp.port)?;
        if !numbers.insert((number, protocol)) {
            return Err(InvalidObject::DuplicatePortNumber {
                port: number,
                protocol: protocol.as_kubernetes().to_owned(),
            });
        }
        ports.push(ServicePort {
            name: ServicePortName {
                service: key.clone(),
                port: port_name,
                protocol,
            },
            cluster_ips: cluster_ips.clone(),
            port: number,
            node_port,
            external_ips: external_ips.clone(),
            load_balancer_ips: load_balancer_ips.clone(),
            load_balancer_source_ranges: load_balancer_source_ranges.clone(),
            session_affinity_timeout,
            internal_traffic_local,
            external_traffic_local,
            health_check_node_port,
        });
    }
    Ok((key, ServiceDisposition::Proxied(ports)))
}

/// Converts an EndpointSlice. `node_name` is this node, to mark local endpoints.
///
/// Returns `Ok(None)` for slices that are not ours to use (not IPv4/IPv6, or not joined to a
/// Service by label).
pub fn slice_endpoints(
    slice: &EndpointSlice,
    node_name: &str,
) -> Result<Option<SliceEndpoints>, InvalidObject> {
    let namespace = slice.metadata.namespace.as_deref().unwrap_or("default");
    validate_dns_label("metadata.namespace", namespace)?;
    let slice_name = slice
        .metadata
        .name
        .as_deref()
        .ok_or(InvalidObject::Missing("metadata.name"))?;
    validate_dns_subdomain("metadata.name", slice_name)?;
    let Some(service_name) = slice
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(LABEL_SERVICE_NAME))
    else {
        return Ok(None);
    };
    validate_dns_label("label kubernetes.io/service-name", service_name)?;
    let family = match slice.address_type.as_str() {
        "IPv4" => IpFamily::V4,
        "IPv6" => IpFamily::V6,
        _ => return Ok(None),
    };
    let trigger_time = slice
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_TRIGGER_TIME))
        .and_then(|t| parse_rfc3339_seconds(t));

    // Validate every endpoint once, then fan out per port.
    let mut base = Vec::new();
    for ep in slice.endpoints.iter().flatten() {
        let Some(addr) = ep.addresses.first() else {
            return Err(InvalidObject::Missing("endpoints.addresses"));
        };
        let ip = parse_service_ip("endpoints.addresses", addr)?;
        if IpFamily::of(&ip) != family {
            return Err(InvalidObject::Address {
                field: "endpoints.addresses (family differs from addressType)",
                value: addr.to_string(),
            });
        }
        if let Some(n) = &ep.node_name {
            validate_dns_subdomain("endpoints.nodeName", n)?;
        }
        let cond = ep.conditions.as_ref();
        let ready = cond.and_then(|c| c.ready).unwrap_or(true);
        let serving = cond.and_then(|c| c.serving).unwrap_or(ready);
        let terminating = cond.and_then(|c| c.terminating).unwrap_or(false);
        let zone_hints = ep
            .hints
            .as_ref()
            .and_then(|h| h.for_zones.as_ref())
            .map(|zones| {
                zones
                    .iter()
                    .map(|z| z.name.clone())
                    .collect::<BTreeSet<_>>()
            });
        base.push(Endpoint {
            ip,
            port: 0,
            ready,
            serving,
            terminating,
            is_local: ep.node_name.as_deref() == Some(node_name),
            zone_hints,
        });
    }
    let mut ports = Vec::with_capacity(slice.ports.as_ref().map_or(0, Vec::len));
    for p in slice.ports.iter().flatten() {
        let Some(number) = p.port else { continue };
        let number = port("ports.port", number)?;
        let port_name = p.name.clone().unwrap_or_default();
        if !port_name.is_empty() {
            validate_dns_label("ports.name", &port_name)?;
        }
        let protocol = protocol(p.protocol.as_ref())?;
        let endpoints = base
            .iter()
            .map(|e| Endpoint {
                port: number,
                ..e.clone()
            })
            .collect();
        ports.push(SlicePort {
            port_name,
            protocol,
            endpoints,
        });
    }
    Ok(Some(SliceEndpoints {
        service: ServiceKey::new(namespace, service_name.clone()),
        slice_name: slice_name.to_string(),
        family,
        ports,
        trigger_time,
    }))
}

/// Converts this node's Node object.
pub fn node_info(node: &Node) -> Result<NodeInfo, InvalidObject> {
    let name = node
        .metadata
        .name
        .clone()
        .ok_or(InvalidObject::Missing("metadata.name"))?;
    let spec = node.spec.as_ref();
    let mut pod_cidrs = Vec::new();
    let cidrs: Vec<&String> = match spec.and_then(|s| s.pod_cidrs.as_ref()) {
        Some(list) if !list.is_empty() => list.iter().collect(),
        _ => spec.and_then(|s| s.pod_cidr.as_ref()).into_iter().collect(),
    };
    for c in cidrs {
        let net = parse_cidr("spec.podCIDRs", c)?;
        if ipv4_embedded(&net) {
            return Err(InvalidObject::SpecialAddress {
                field: "spec.podCIDRs",
                value: c.clone(),
                reason: "may not be an IPv4-mapped or IPv4-compatible IPv6 range",
            });
        }
        pod_cidrs.push(net);
    }
    let to_be_deleted = spec
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == TAINT_TO_BE_DELETED));
    let mut addresses: Vec<IpAddr> = Vec::new();
    let status_addresses = node.status.as_ref().and_then(|s| s.addresses.as_ref());
    for wanted in ["InternalIP", "ExternalIP"] {
        for a in status_addresses
            .into_iter()
            .flatten()
            .filter(|a| a.type_ == wanted)
        {
            let ip = parse_ip("status.addresses", &a.address)?;
            // NodePort rules match the node's address; one the kernel tools print back in
            // another form (IPv4-mapped or -compatible IPv6) could never be verified.
            if ipv4_embedded(&IpNet::from(ip)) {
                return Err(InvalidObject::SpecialAddress {
                    field: "status.addresses",
                    value: a.address.clone(),
                    reason: "may not be an IPv4-mapped or IPv4-compatible IPv6 address",
                });
            }
            if !addresses
                .iter()
                .any(|x| IpFamily::of(x) == IpFamily::of(&ip))
            {
                addresses.push(ip);
            }
        }
    }
    Ok(NodeInfo {
        name,
        exists: true,
        deleting: node.metadata.deletion_timestamp.is_some(),
        to_be_deleted,
        zone: node
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(LABEL_ZONE))
            .cloned(),
        pod_cidrs,
        addresses,
    })
}

/// The special ranges of [`special_address`] as networks, for checking whole CIDRs.
const SPECIAL_NETS: [(IpNet, &str); 11] = {
    const fn v4(a: u8, b: u8, c: u8, d: u8, len: u8) -> IpNet {
        IpNet::V4(ipnet::Ipv4Net::new_assert(
            std::net::Ipv4Addr::new(a, b, c, d),
            len,
        ))
    }
    const fn v6(seg: [u16; 8], len: u8) -> IpNet {
        let [a, b, c, d, e, f, g, h] = seg;
        IpNet::V6(ipnet::Ipv6Net::new_assert(
            std::net::Ipv6Addr::new(a, b, c, d, e, f, g, h),
            len,
        ))
    }
    [
        (v4(0, 0, 0, 0, 8), "may not overlap 0.0.0.0/8"),
        (
            v4(127, 0, 0, 0, 8),
            "may not overlap the loopback range (127.0.0.0/8)",
        ),
        (
            v4(169, 254, 0, 0, 16),
            "may not overlap the link-local range (169.254.0.0/16)",
        ),
        (
            v4(224, 0, 0, 0, 4),
            "may not overlap multicast (224.0.0.0/4)",
        ),
        (
            v4(255, 255, 255, 255, 32),
            "may not hold the broadcast address (255.255.255.255)",
        ),
        (v6([0; 8], 128), "may not hold the unspecified address (::)"),
        (
            v6([0, 0, 0, 0, 0, 0, 0, 1], 128),
            "may not hold the loopback address (::1)",
        ),
        (
            v6([0xfe80, 0, 0, 0, 0, 0, 0, 0], 10),
            "may not overlap the link-local range (fe80::/10)",
        ),
        (
            v6([0xff00, 0, 0, 0, 0, 0, 0, 0], 8),
            "may not overlap multicast (ff00::/8)",
        ),
        (
            v6([0, 0, 0, 0, 0, 0xffff, 0, 0], 96),
            "may not overlap IPv4-mapped addresses (::ffff:0:0/96)",
        ),
        (
            v6([0; 8], 96),
            "may not overlap IPv4-compatible addresses (::/96)",
        ),
    ]
};

/// Whether `net` is an IPv6 range inside the IPv4-mapped addresses (`::ffff:0:0/96`).
fn ipv4_mapped(net: &IpNet) -> bool {
    match net {
        IpNet::V6(v6) => v6.prefix_len() >= 96 && v6.network().to_ipv4_mapped().is_some(),
        IpNet::V4(_) => false,
    }
}

/// Whether `net` is an IPv6 range of IPv4-mapped (`::ffff:0:0/96`) or IPv4-compatible
/// (`::/96`) addresses. The kernel tools print such addresses in dotted form, so a rule holding
/// one never reads back as written; the IPv4 range is what is meant.
pub fn ipv4_embedded(net: &IpNet) -> bool {
    let IpNet::V6(v6) = net else {
        return false;
    };
    if v6.prefix_len() < 96 {
        return false;
    }
    let segments = v6.network().segments();
    let mapped = segments[..6] == [0, 0, 0, 0, 0, 0xffff];
    // `::/96`, but the unspecified and loopback addresses alone: they are not IPv4 in disguise.
    let lone_special = v6.prefix_len() == 128 && u128::from(v6.network()) <= 1;
    let compatible = segments[..6] == [0; 6] && !lone_special;
    mapped || compatible
}

/// Converts a ServiceCIDR (networking.k8s.io/v1) into its ranges.
///
/// Traffic to an address inside a Service CIDR that no Service holds is dropped, so a range
/// that overlaps loopback, link-local or multicast (or a `/0`, which overlaps all of them) would
/// cut the node off: such an object is refused whole.
pub fn service_cidrs(obj: &ServiceCIDR) -> Result<Vec<IpNet>, InvalidObject> {
    let name = obj
        .metadata
        .name
        .as_deref()
        .ok_or(InvalidObject::Missing("metadata.name"))?;
    validate_dns_subdomain("metadata.name", name)?;
    let mut out = Vec::new();
    for c in obj.spec.iter().flat_map(|s| s.cidrs.iter().flatten()) {
        let net = parse_cidr("spec.cidrs", c)?;
        if let Some(reason) = special_service_cidr(&net) {
            return Err(InvalidObject::SpecialAddress {
                field: "spec.cidrs",
                value: c.clone(),
                reason,
            });
        }
        out.push(net);
    }
    Ok(out)
}

/// Why `net` cannot be a Service CIDR, if it cannot: it overlaps a special range of
/// [`special_address`]. For ServiceCIDR objects and the `serviceCIDRs` setting alike.
pub fn special_service_cidr(net: &IpNet) -> Option<&'static str> {
    SPECIAL_NETS
        .iter()
        .find(|(special, _)| net.contains(special) || special.contains(net))
        .map(|(_, reason)| *reason)
}

/// Parses an RFC 3339 UTC timestamp (`2024-01-02T03:04:05Z`, optional fraction) to Unix seconds.
/// Returns `None` for anything else; the annotation only feeds a metric.
pub fn parse_rfc3339_seconds(s: &str) -> Option<f64> {
    // Only unsigned decimal digits: `str::parse` alone would accept "-1", "+1" and "5e3".
    fn digits(p: &str) -> Option<&str> {
        (!p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())).then_some(p)
    }
    fn number(p: &str) -> Option<i64> {
        digits(p)?.parse().ok()
    }
    let s = s.strip_suffix('Z')?;
    let (date, time) = s.split_once('T')?;
    let mut d = date.splitn(3, '-').map(number);
    let (y, mo, day) = (d.next()??, d.next()??, d.next()??);
    let (hms, frac) = match time.split_once('.') {
        Some((hms, f)) => (hms, format!("0.{}", digits(f)?).parse::<f64>().ok()?),
        None => (time, 0.0),
    };
    let mut t = hms.splitn(3, ':').map(number);
    let (h, mi, sec) = (t.next()??, t.next()??, t.next()??);
    let leap = y % 4 == 0 && (y % 100 != 0 || y % 400 == 0);
    let month_days = match mo {
        2 if leap => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    };
    if !(1..=12).contains(&mo) || !(1..=month_days).contains(&day) || h > 23 || mi > 59 || sec > 60
    {
        return None;
    }
    // Days from civil date (Howard Hinnant's algorithm).
    let y = if mo <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146097 + doe - 719468;
    Some((days * 86400 + h * 3600 + mi * 60 + sec) as f64 + frac)
}

#[cfg(test)]
mod tests;
