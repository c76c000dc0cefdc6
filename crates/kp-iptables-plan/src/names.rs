//! Chain names, as upstream spells them (`pkg/proxy/iptables/proxier.go`).
//!
//! Per-Service-port chains are named by a prefix and the first 16 characters of the standard
//! base32 encoding of SHA-256 over the Service port's name (`namespace/name:port`, or
//! `namespace/name` for an unnamed port) followed by the lower-case protocol; endpoint chains
//! also hash in the endpoint (`ip:port`, `[ip]:port` for IPv6). Keeping upstream's names means
//! a node switched between upstream kube-proxy and kube-proxy-rs sees the same chains.

use data_encoding::BASE32;
use kp_core::model::{Endpoint, ServicePortName};
use sha2::{Digest, Sha256};

/// Jumped to from nat PREROUTING and OUTPUT (ClusterIPs, ExternalIPs, LoadBalancer IPs), and
/// from filter FORWARD and OUTPUT (REJECT/DROP for Services without endpoints).
pub const KUBE_SERVICES: &str = "KUBE-SERVICES";
/// filter: REJECT/DROP for external destinations without (local) endpoints.
pub const KUBE_EXTERNAL_SERVICES: &str = "KUBE-EXTERNAL-SERVICES";
/// nat: NodePort dispatch (the last rule of nat `KUBE-SERVICES` jumps here); filter: health
/// check node ports accepted.
pub const KUBE_NODEPORTS: &str = "KUBE-NODEPORTS";
/// nat: masquerades packets carrying the masquerade mark.
pub const KUBE_POSTROUTING: &str = "KUBE-POSTROUTING";
/// nat: sets the masquerade mark.
pub const KUBE_MARK_MASQ: &str = "KUBE-MARK-MASQ";
/// filter: drops INVALID and accepts marked and established forwarded traffic.
pub const KUBE_FORWARD: &str = "KUBE-FORWARD";
/// filter: drops LoadBalancer traffic from outside `loadBalancerSourceRanges`.
pub const KUBE_PROXY_FIREWALL: &str = "KUBE-PROXY-FIREWALL";
/// filter: kubelet's anti-martian rule for localhost NodePorts (IPv4 only).
pub const KUBE_FIREWALL: &str = "KUBE-FIREWALL";

/// Prefix of a Service port's `Cluster`-policy endpoint chain.
pub const SVC_PREFIX: &str = "KUBE-SVC-";
/// Prefix of a Service port's `Local`-policy endpoint chain.
pub const SVL_PREFIX: &str = "KUBE-SVL-";
/// Prefix of a Service port's external-destination chain.
pub const EXT_PREFIX: &str = "KUBE-EXT-";
/// Prefix of a Service port's `loadBalancerSourceRanges` chain.
pub const FW_PREFIX: &str = "KUBE-FW-";
/// Prefix of an endpoint's DNAT chain.
pub const SEP_PREFIX: &str = "KUBE-SEP-";

/// Above this many endpoints in total, per-endpoint rules carry no `-m comment` (upstream's
/// `largeClusterEndpointsThreshold`): comments make the restore input and the kernel's
/// ruleset up to 40% larger.
pub const LARGE_CLUSTER_ENDPOINTS_THRESHOLD: usize = 1000;

/// The four per-Service-port chain names (they share one hash).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceChainNames {
    /// `KUBE-SVC-…`: endpoints for `Cluster` traffic policy.
    pub svc: String,
    /// `KUBE-SVL-…`: endpoints for `Local` traffic policy.
    pub svl: String,
    /// `KUBE-EXT-…`: entry for NodePort, ExternalIP and LoadBalancer traffic.
    pub ext: String,
    /// `KUBE-FW-…`: `loadBalancerSourceRanges` filter.
    pub fw: String,
}

/// First 16 characters of base32(SHA-256(`input`)).
fn hash16(input: &str) -> String {
    let digest = Sha256::digest(input.as_bytes());
    let mut encoded = BASE32.encode(&digest);
    encoded.truncate(16);
    encoded
}

/// The chain names of one Service port.
pub fn service_chains(name: &ServicePortName) -> ServiceChainNames {
    let hash = hash16(&format!("{name}{}", name.protocol.as_lower()));
    ServiceChainNames {
        svc: format!("{SVC_PREFIX}{hash}"),
        svl: format!("{SVL_PREFIX}{hash}"),
        ext: format!("{EXT_PREFIX}{hash}"),
        fw: format!("{FW_PREFIX}{hash}"),
    }
}

/// The `KUBE-SEP-…` chain of one endpoint of a Service port.
pub fn endpoint_chain(name: &ServicePortName, endpoint: &Endpoint) -> String {
    format!(
        "{SEP_PREFIX}{}",
        hash16(&format!("{name}{}{endpoint}", name.protocol.as_lower()))
    )
}

/// A per-Service-port or per-endpoint chain name in 11 bytes: which prefix, and the 10 bytes
/// the 16 base32 characters of its hash encode (the planner keeps 128k of them at 10k Services).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ChainId {
    kind: u8,
    hash: [u8; 10],
}

const PREFIXES: [&str; 5] = [SVC_PREFIX, SVL_PREFIX, EXT_PREFIX, FW_PREFIX, SEP_PREFIX];

impl ChainId {
    /// The id of a chain named by [`service_chains`] or [`endpoint_chain`]; `None` for any
    /// other name.
    pub fn parse(chain: &str) -> Option<ChainId> {
        let (kind, rest) = PREFIXES
            .iter()
            .enumerate()
            .find_map(|(i, p)| chain.strip_prefix(p).map(|r| (i as u8, r)))?;
        if rest.len() != 16 {
            return None;
        }
        let bytes = BASE32.decode(rest.as_bytes()).ok()?;
        let hash: [u8; 10] = bytes.try_into().ok()?;
        Some(ChainId { kind, hash })
    }

    /// The chain's name.
    pub fn name(&self) -> String {
        let prefix = PREFIXES
            .get(self.kind as usize)
            .copied()
            .unwrap_or(SEP_PREFIX);
        format!("{prefix}{}", BASE32.encode(&self.hash))
    }
}

impl std::fmt::Display for ChainId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// Whether `chain` is a per-Service-port or per-endpoint chain (upstream's
/// `isServiceChainName`): the ones a full sync deletes when nothing plans them any more.
pub fn is_service_chain(chain: &str) -> bool {
    [SVC_PREFIX, SVL_PREFIX, EXT_PREFIX, FW_PREFIX, SEP_PREFIX]
        .iter()
        .any(|p| chain.starts_with(p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kp_core::model::{Protocol, ServiceKey};

    fn spn(ns: &str, name: &str, port: &str, protocol: Protocol) -> ServicePortName {
        ServicePortName {
            service: ServiceKey::new(ns, name),
            port: port.into(),
            protocol,
        }
    }

    fn ep(addr: &str, port: u16) -> Endpoint {
        Endpoint {
            ip: addr.parse().unwrap(),
            port,
            ready: true,
            serving: true,
            terminating: false,
            is_local: false,
            zone_hints: None,
        }
    }

    /// Expected names from upstream's `pkg/proxy/iptables/proxier_test.go` (TestOverallIPTablesRules).
    #[test]
    fn names_match_upstreams_test_vectors() {
        let tcp = Protocol::Tcp;
        assert_eq!(
            service_chains(&spn("ns1", "svc1", "p80", tcp)).svc,
            "KUBE-SVC-XPGD46QRK7WJZT7O"
        );
        assert_eq!(
            service_chains(&spn("ns2", "svc2", "p80", tcp)).ext,
            "KUBE-EXT-GNZBNJ2PO5MGZ6GT"
        );
        assert_eq!(
            service_chains(&spn("ns3", "svc3", "p80", tcp)).svc,
            "KUBE-SVC-X27LE4BHSL4DOUIK"
        );
        let svc5 = service_chains(&spn("ns5", "svc5", "p80", tcp));
        assert_eq!(svc5.fw, "KUBE-FW-NUKIZ6OKUXPJNT4C");
        assert_eq!(svc5.svl, "KUBE-SVL-NUKIZ6OKUXPJNT4C");
        assert_eq!(
            endpoint_chain(&spn("ns1", "svc1", "p80", tcp), &ep("10.180.0.1", 80)),
            "KUBE-SEP-SXIVWICOYRO3J4NJ"
        );
        assert_eq!(
            endpoint_chain(&spn("ns2", "svc2", "p80", tcp), &ep("10.180.0.2", 80)),
            "KUBE-SEP-RS4RBKLTHTF2IUXJ"
        );
        assert_eq!(
            endpoint_chain(&spn("ns4", "svc4", "p80", tcp), &ep("10.180.0.4", 80)),
            "KUBE-SEP-UKSFD7AGPMPPLUHC"
        );
        assert_eq!(
            endpoint_chain(&spn("ns4", "svc4", "p80", tcp), &ep("10.180.0.5", 80)),
            "KUBE-SEP-C6EBXVWJJZMIWKLZ"
        );
    }

    #[test]
    fn protocol_unnamed_ports_and_ipv6_endpoints_change_the_hash() {
        let tcp = service_chains(&spn("ns", "svc", "p", Protocol::Tcp));
        let udp = service_chains(&spn("ns", "svc", "p", Protocol::Udp));
        let unnamed = service_chains(&spn("ns", "svc", "", Protocol::Tcp));
        assert_ne!(tcp.svc, udp.svc);
        assert_ne!(tcp.svc, unnamed.svc);
        // An unnamed port hashes `ns/svc` + protocol: the same as hashing the string by hand.
        assert_eq!(unnamed.svc, format!("KUBE-SVC-{}", hash16("ns/svctcp")));
        let name = spn("ns", "svc", "p", Protocol::Tcp);
        let v6 = endpoint_chain(&name, &ep("fd00::1", 80));
        assert_eq!(
            v6,
            format!("KUBE-SEP-{}", hash16("ns/svc:ptcp[fd00::1]:80"))
        );
        for chain in [&tcp.svc, &tcp.svl, &tcp.ext, &tcp.fw, &v6] {
            assert!(chain.len() <= 28, "{chain} is too long for iptables");
            assert!(is_service_chain(chain));
        }
        assert!(!is_service_chain(KUBE_SERVICES));
        assert!(!is_service_chain(KUBE_MARK_MASQ));
    }

    #[test]
    fn chain_ids_round_trip_every_service_chain_name() {
        let name = spn("ns1", "svc1", "p80", Protocol::Tcp);
        let n = service_chains(&name);
        for c in [&n.svc, &n.svl, &n.ext, &n.fw] {
            let id = ChainId::parse(c).expect("parses");
            assert_eq!(&id.name(), c);
        }
        assert_ne!(ChainId::parse(&n.svc), ChainId::parse(&n.svl));
        for bad in [
            "KUBE-SERVICES",
            "KUBE-SVC-SHORT",
            "KUBE-SEP-0000000000000000",
            "X",
        ] {
            assert_eq!(ChainId::parse(bad), None, "{bad}");
        }
    }
}
