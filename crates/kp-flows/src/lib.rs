//! The packet-flow test table: one small cluster and the cases every dataplane mode must pass.
//!
//! The same rows run through each mode's tracer (over the rules it renders) and with real
//! packets in network namespaces. A mode joins by running [`check_tracer`] over its tracer and
//! `kp_test::flows::check_all` over a lab its dataplane programs: one line each.
//!
//! - [`fixture`]: the cluster (Services, EndpointSlices, this Node) and its pods.
//! - [`table`]: the rows, what each expects, and [`check_tracer`].
//! - [`synthetic`]: large generated clusters for scale tests.
//!
//! What it leaves to others: rendering rules (each mode), tracing them (each mode's tracer) and
//! sending real packets (`kp-test`, whose `lab` module builds the namespaces this plan names).
//!
//! Addressing plan (all inside test-made namespaces; `kp_test::lab` builds the same):
//! - node `node-a` (this node, zone `zone-a`): 192.0.2.1 and 2001:db8::1 towards external
//!   clients (TEST-NET-1), 10.244.1.1 towards its pods (pod CIDR 10.244.1.0/24 and
//!   fd00:10:244:1::/64; cluster CIDR 10.244.0.0/16 and fd00:10:244::/48).
//! - pods on node-a: pod-1..pod-4 at 10.244.1.11-14 and fd00:10:244:1::11-14. pod-4 is a client
//!   pod that backs no Service.
//! - node `node-b`, joined to node-a by its own link, with pod CIDR 10.244.2.0/24 and
//!   fd00:10:244:2::/64: remote-1 at 10.244.2.21 and fd00:10:244:2::21. Rows whose answers
//!   must come from it are marked [`Case::needs_second_node`].
//! - external clients: 192.0.2.2 / 2001:db8::2 (inside the LoadBalancer source range
//!   192.0.2.0/30) and 192.0.2.5 / 2001:db8::5 (outside it).
//! - ClusterIPs in 10.96.0.0/16 and fd00:10:96::/112; external and LoadBalancer IPs in
//!   198.51.100.0/24 (TEST-NET-2).
//!
//! The table's configuration, for every mode: detect-local by cluster CIDR (both families),
//! `nodePortAddresses: primary` (the Node's InternalIPs, 192.0.2.1 and 2001:db8::1), localhost
//! NodePorts off, no `masqueradeAll` ([`node_context`]).

pub mod fixture;
pub mod synthetic;
pub mod table;

pub use fixture::{
    ingress, ingress_bridged, interface_detect_locals, load, manifest, manifest_list,
    manifest_list_of, node_context, node_context_with, objects, pods, state, sticky_slice,
    web_slice, Pod, POD_BRIDGE, POD_VETH_PREFIX,
};
pub use table::{
    cases, check_detect_local_by_interface, check_detect_local_by_interface_for, check_tracer,
    check_tracer_for, expected_verdict, node_addresses, Case, Expect, Support, NODE_FROM_LB_IP,
};

/// This node's name.
pub const NODE: &str = "node-a";
/// The other node's name.
pub const OTHER_NODE: &str = "node-b";
/// This node's zone (its `topology.kubernetes.io/zone` label).
pub const ZONE: &str = "zone-a";
/// The node's address towards external clients: its primary IPv4 address (InternalIP).
pub const NODE_IP: &str = "192.0.2.1";
/// The node's IPv6 address towards external clients: its primary IPv6 address (InternalIP).
pub const NODE_IP6: &str = "2001:db8::1";
/// The node's address on the pod network.
pub const NODE_POD_GATEWAY: &str = "10.244.1.1";
/// The node's IPv6 address on the pod network (tracer view; the lab's pods reach the node
/// through the link-local fe80::1 instead).
pub const NODE_POD_GATEWAY_V6: &str = "fd00:10:244:1::1";
/// The cluster's pod network.
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// The cluster's IPv6 pod network.
pub const CLUSTER_CIDR6: &str = "fd00:10:244::/48";
/// This node's pod network.
pub const POD_CIDR: &str = "10.244.1.0/24";
/// This node's IPv6 pod network.
pub const POD_CIDR6: &str = "fd00:10:244:1::/64";
/// The cluster's IPv4 Service CIDR (its ServiceCIDR object `kubernetes`): every fixture
/// ClusterIP is inside it, and an address inside it that no Service holds is dropped.
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
/// The cluster's IPv6 Service CIDR.
pub const SERVICE_CIDR6: &str = "fd00:10:96::/112";
/// External client inside the LoadBalancer source range.
pub const CLIENT: &str = "192.0.2.2";
/// The same client's IPv6 address.
pub const CLIENT6: &str = "2001:db8::2";
/// External client outside the LoadBalancer source range.
pub const CLIENT_OUTSIDE: &str = "192.0.2.5";
/// The outside client's IPv6 address.
pub const CLIENT_OUTSIDE6: &str = "2001:db8::5";

/// Port the pods' echo servers listen on for TCP.
pub const TCP_PORT: u16 = 8080;
/// UDP port of the pods' echo servers.
pub const UDP_PORT: u16 = 5353;
/// SCTP port of the pods' echo servers (where the kernel has SCTP).
pub const SCTP_PORT: u16 = 3868;

#[cfg(test)]
mod tests;
