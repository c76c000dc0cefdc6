//! Every name in the `inet kube-proxy-userspace` table, in one place.
//!
//! As in the nftables mode's table, nothing derived from a Kubernetes object becomes part of a
//! name: sets are named by their role and IP family only.

use kp_core::model::IpFamily;

/// Our table's name, in the `inet` family (one table for both IP families).
pub const TABLE: &str = "kube-proxy-userspace";
/// The table's nft family.
pub const FAMILY: &str = "inet";

/// The suffix of a set of one IP family (`-v4`, `-v6`): an `inet` table holds both families,
/// but a set's key holds addresses of one.
pub fn family_suffix(f: IpFamily) -> &'static str {
    match f {
        IpFamily::V4 => "v4",
        IpFamily::V6 => "v6",
    }
}

/// Base chain: mangle at prerouting (marks replies to the proxy's transparent sockets).
pub const MANGLE_PREROUTING: &str = "mangle-prerouting";
/// Base chain: filter at prerouting before the redirect (source ranges, `Local` policy drops).
pub const FILTER_PREROUTING: &str = "filter-prerouting";
/// Base chain: filter at output before the redirect (source ranges, no-endpoint verdicts).
pub const FILTER_OUTPUT_PRE_DNAT: &str = "filter-output-pre-dnat";
/// Base chain: NAT at prerouting (the redirect of traffic arriving on an interface).
pub const NAT_PREROUTING: &str = "nat-prerouting";
/// Base chain: NAT at output (the redirect of traffic the node itself sends).
pub const NAT_OUTPUT: &str = "nat-output";
/// Base chain: filter at output after the redirect (ClusterIP checks).
pub const FILTER_OUTPUT_POST_DNAT: &str = "filter-output-post-dnat";
/// Base chain: filter at input (no-endpoint verdicts of NodePorts and local addresses).
pub const FILTER_INPUT: &str = "filter-input";
/// Base chain: filter at forward (no-endpoint verdicts, ClusterIP checks).
pub const FILTER_FORWARD: &str = "filter-forward";

/// Regular chain: the redirect of every frontend to the proxy port.
pub const SERVICES: &str = "services";
/// Regular chain: `loadBalancerSourceRanges`.
pub const FIREWALL_CHECK: &str = "firewall-check";
/// Regular chain: `Local` policy frontends without local endpoints drop external clients.
pub const NO_LOCAL_CHECK: &str = "no-local-check";
/// Regular chain: REJECT/DROP for frontends without usable endpoints.
pub const ENDPOINTS_CHECK: &str = "service-endpoints-check";
/// Regular chain: unknown ports of ClusterIPs are rejected, unallocated ClusterIPs dropped.
pub const CLUSTER_IPS_CHECK: &str = "cluster-ips-check";
/// Regular chain: the REJECT target of the no-endpoint verdict maps. The same name as the
/// nftables mode's, whose element rendering (`goto reject-packet`) this table shares.
pub const REJECT_PACKET: &str = kp_nftables_plan::names::REJECT_PACKET;

/// Set: every ClusterIP.
pub const CLUSTER_IPS: &str = "cluster-ips";
/// Interval set: the Service CIDRs (an address in them that no Service holds is dropped).
pub const SERVICE_CIDRS: &str = "service-cidrs";
/// Interval set: detect-local's pod networks.
pub const POD_CIDRS: &str = "pod-cidrs";
/// Interval set: `nodePortAddresses` (only used when NodePorts are restricted).
pub const NODEPORT_ADDRESSES: &str = "nodeport-addresses";
/// Set: `address . protocol . port` frontends redirected to the proxy.
pub const REDIRECT_VIPS: &str = "redirect-vips";
/// Set: `protocol . port` NodePorts redirected to the proxy.
pub const REDIRECT_NODEPORTS: &str = "redirect-nodeports";
/// Verdict map: frontends without usable endpoints → drop or REJECT.
pub const NO_ENDPOINT_VIPS: &str = "no-endpoint-vips";
/// Verdict map: NodePorts without usable endpoints → drop or REJECT.
pub const NO_ENDPOINT_NODEPORTS: &str = "no-endpoint-nodeports";
/// Set: `Local` policy frontends with no local endpoint (external clients are dropped).
pub const NO_LOCAL_VIPS: &str = "no-local-vips";
/// Set: `Local` policy NodePorts with no local endpoint.
pub const NO_LOCAL_NODEPORTS: &str = "no-local-nodeports";
/// Set: LoadBalancer frontends with `loadBalancerSourceRanges`.
pub const FIREWALL_VIPS: &str = "firewall-vips";
/// Interval set: (LoadBalancer frontend, allowed source range).
pub const FIREWALL_ALLOW: &str = "firewall-allow";
