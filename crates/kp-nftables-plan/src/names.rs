//! Every name in the `kube-proxy` table, in one place.
//!
//! Nothing derived from a Kubernetes object ever becomes part of a name: per-class objects are
//! named by numbers only (endpoint count, affinity timeout). That keeps rule text free of
//! anything an object could inject.

use kp_core::model::IpFamily;

/// Our table's name, in both the `ip` and `ip6` families.
pub const TABLE: &str = "kube-proxy";

/// nft family keyword for an IP family.
pub fn family(f: IpFamily) -> &'static str {
    match f {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

/// Base chain: NAT at prerouting (DNAT of Service traffic arriving on an interface).
pub const NAT_PREROUTING: &str = "nat-prerouting";
/// Base chain: NAT at output (DNAT of Service traffic sent by the node itself).
pub const NAT_OUTPUT: &str = "nat-output";
/// Base chain: NAT at postrouting (masquerade).
pub const NAT_POSTROUTING: &str = "nat-postrouting";
/// Base chain: filter at prerouting before DNAT (loadBalancerSourceRanges).
pub const FILTER_PREROUTING: &str = "filter-prerouting";
/// Base chain: filter at output before DNAT (loadBalancerSourceRanges).
pub const FILTER_OUTPUT_PRE_DNAT: &str = "filter-output-pre-dnat";
/// Base chain: filter at input (no-endpoint reject/drop).
pub const FILTER_INPUT: &str = "filter-input";
/// Base chain: filter at forward (no-endpoint reject/drop).
pub const FILTER_FORWARD: &str = "filter-forward";
/// Base chain: filter at output after DNAT (no-endpoint reject/drop).
pub const FILTER_OUTPUT: &str = "filter-output";
/// Base chain: filter at postrouting, before SNAT (records ClientIP affinity).
pub const AFFINITY_POSTROUTING: &str = "affinity-postrouting";
/// Base chain: filter at input (records ClientIP affinity for node-local endpoints).
pub const AFFINITY_INPUT: &str = "affinity-input";

/// Regular chain: the Service dispatch entry, jumped from both NAT DNAT hooks.
pub const SERVICES: &str = "services";
/// Regular chain: sets the masquerade mark.
pub const SERVICE_MASQUERADE: &str = "service-masquerade";
/// Regular chain: reuses a remembered ClientIP affinity choice.
pub const SERVICE_AFFINITY: &str = "service-affinity";
/// Regular chain: short-circuits pod and node traffic to `externalTrafficPolicy: Local` entries.
pub const SERVICE_LOCAL_SOURCE: &str = "service-local-source";
/// Regular chain: random choice of an endpoint, one rule per endpoint-count class.
pub const SERVICE_DISPATCH: &str = "service-dispatch";
/// Regular chain: loadBalancerSourceRanges check.
pub const FIREWALL_CHECK: &str = "firewall-check";
/// Regular chain: REJECT/DROP for Services without usable endpoints.
pub const ENDPOINTS_CHECK: &str = "service-endpoints-check";
/// Regular chain: the REJECT target of the no-endpoint verdict map.
pub const REJECT_PACKET: &str = "reject-packet";
/// Regular chain: masquerade of marked and hairpin traffic.
pub const MASQUERADING: &str = "masquerading";
/// Regular chain: records ClientIP affinity choices.
pub const AFFINITY_UPDATE: &str = "affinity-update";

/// Set: every ClusterIP (masquerade of off-cluster sources).
pub const CLUSTER_IPS: &str = "cluster-ips";
/// Set: the Service CIDRs; traffic still addressed to one after DNAT is dropped (unallocated
/// ClusterIP).
pub const SERVICE_CIDRS: &str = "service-cidrs";
/// Set: pod-network CIDRs for detect-local.
pub const POD_CIDRS: &str = "pod-cidrs";
/// Set: `nodePortAddresses` CIDRs (only when configured).
pub const NODEPORT_ADDRESSES: &str = "nodeport-addresses";
/// Set: external entries (ExternalIP, LB IP) with `externalTrafficPolicy: Cluster`: always masqueraded.
pub const MASQ_VIPS: &str = "masquerade-vips";
/// Set: NodePorts with `externalTrafficPolicy: Cluster`: always masqueraded.
pub const MASQ_NODEPORTS: &str = "masquerade-nodeports";
/// Set: external entries with `externalTrafficPolicy: Local`.
pub const LOCAL_POLICY_VIPS: &str = "local-policy-vips";
/// Set: NodePorts with `externalTrafficPolicy: Local`.
pub const LOCAL_POLICY_NODEPORTS: &str = "local-policy-nodeports";
/// Verdict map: VIP entries with no usable endpoints → drop or REJECT.
pub const NO_ENDPOINT_VIPS: &str = "no-endpoint-vips";
/// Verdict map: NodePorts with no usable endpoints → drop or REJECT.
pub const NO_ENDPOINT_NODEPORTS: &str = "no-endpoint-nodeports";
/// Set: LoadBalancer entries that have loadBalancerSourceRanges.
pub const FIREWALL_VIPS: &str = "firewall-vips";
/// Interval set: (LB entry, allowed source range).
pub const FIREWALL_ALLOW: &str = "firewall-allow";
/// Set: (endpoint, endpoint) pairs; a connection from an endpoint to itself is masqueraded.
pub const HAIRPIN: &str = "hairpin";
