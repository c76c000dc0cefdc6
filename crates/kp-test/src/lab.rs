//! A small cluster in network namespaces: one node (or two), pods, and one outside client.
//!
//! # Addressing plan
//!
//! This is the one place test IP ranges are fixed; `scripts/lab.sh` builds the one-node
//! topology. Every address exists only inside the lab's own namespaces.
//!
//! ```text
//!  client ns   eth0  192.0.2.2/24 (+ aliases .3 .4 .5)    2001:db8::2/64 (+ ::3 ::4 ::5, deprecated)
//!                │   routes via the node: 10.96.0.0/16 10.244.0.0/16 198.51.100.0/24 203.0.113.0/24
//!                │                        fd00:10:96::/112 fd00:10:244::/48 2001:db8:e::/64 2001:db8:b::/64
//!                │   TEST-NET-1 link
//!  node ns     eth0  192.0.2.1/24                         2001:db8::1/64
//!  (node-a)          default routes via the client (the node's "uplink")
//!                    ip_forward=1, ipv6 forwarding=1
//!              vethI 10.244.1.1/32                        fe80::1/64        (the same on every vethI)
//!                │   route 10.244.1.(10+I)/32 dev vethI   route fd00:10:244:1::(10+I)/128 dev vethI
//!                │
//!  pod I ns    eth0  10.244.1.(10+I)/32                   fd00:10:244:1::(10+I)/128
//!                    default via 10.244.1.1 (on-link)     default via fe80::1
//!
//!  only in a two-node lab (Lab::two_nodes):
//!  node ns     eth1  198.18.0.1/24                        2001:db8:1::1/64
//!                │   route 10.244.2.0/24 via 198.18.0.2   route fd00:10:244:2::/64 via 2001:db8:1::2
//!                │   node-to-node link
//!  node-b ns   eth0  198.18.0.2/24                        2001:db8:1::2/64
//!                    default routes via node-a (198.18.0.1, 2001:db8:1::1)
//!                    ip_forward=1, ipv6 forwarding=1
//!              vethI 10.244.2.1/32                        fe80::1/64
//!                │   route 10.244.2.(20+I)/32 dev vethI   route fd00:10:244:2::(20+I)/128 dev vethI
//!  remote pod  eth0  10.244.2.(20+I)/32                   fd00:10:244:2::(20+I)/128
//!  I ns              default via 10.244.2.1 (on-link)     default via fe80::1
//! ```
//!
//! | range                                | role                                            |
//! |--------------------------------------|-------------------------------------------------|
//! | `10.244.0.0/16`, `fd00:10:244::/48`  | cluster CIDR (`--cluster-cidr`)                 |
//! | `10.244.1.0/24`, `fd00:10:244:1::/64`| this node's podCIDR; pod I is `.(10+I)` / `::(10+I)` (the same digits) |
//! | `10.244.2.0/24`, `fd00:10:244:2::/64`| node-b's podCIDR; remote pod I is `.(20+I)` / `::(20+I)` |
//! | `10.96.0.0/16`, `fd00:10:96::/112`   | ClusterIPs                                      |
//! | `198.51.100.0/24`, `2001:db8:e::/64` | externalIPs (TEST-NET-2)                        |
//! | `203.0.113.0/24`, `2001:db8:b::/64`  | LoadBalancer ingress IPs (TEST-NET-3)           |
//! | `192.0.2.0/24`, `2001:db8::/64`      | node ↔ client link (TEST-NET-1); node IP `.1`, client `.2`-`.5` |
//! | `198.18.0.0/24`, `2001:db8:1::/64`   | node-a ↔ node-b link (RFC 2544 benchmarking range); node-a `.1`, node-b `.2` |
//!
//! Pods are routed point-to-point (like the CNI `ptp` plugin and kindnet), not bridged: every
//! packet between two pods crosses the node's IP layer and conntrack. On a bridge, the reply of
//! pod B to pod A after a ClusterIP DNAT would be switched straight back to A, skipping the
//! un-DNAT, unless `br_netfilter` is loaded; the lab must not depend on a host module.
//!
//! The node's default routes point at the client, as a real node's point at its uplink: the
//! node's own connections to ClusterIPs need a route before nat OUTPUT can rewrite them.
//! Unclaimed service traffic therefore goes to the client, which does not forward, and dies.
//!
//! Node-b runs no proxy: it only routes, like a node whose kube-proxy has nothing to do with
//! traffic that node-a already translated. Its default routes point back at node-a, so every
//! reply from a remote pod (to a masqueraded node address, to a pod on node-a, or, if a
//! dataplane forgot to masquerade, to the client itself) returns through node-a, where
//! conntrack reverses the translation. A masqueraded connection reaches a remote pod from
//! node-a's address on the node-to-node link, 198.18.0.1, and one to a local pod from
//! 10.244.1.1: the address of the interface it leaves by.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::echo::{self, Outcome, Proto, Request};
use crate::netns::{veth, ChildGuard, Netns, VethEnd};
use crate::{Error, Result};

/// The Node name kube-proxy runs as (`--hostname-override`).
pub const NODE_NAME: &str = "lab-node";
/// The node's IPv4 address, on the client link: the NodePort address.
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
/// The node's IPv6 address, on the client link.
pub const NODE_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1);
/// The pods' IPv4 gateway: the node's address on every pod veth.
pub const POD_GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 1);
/// The pods' IPv6 gateway: the node's link-local address on every pod veth.
pub const POD_GATEWAY6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
/// The client's primary IPv4 address.
pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 2);
/// The client's primary IPv6 address.
pub const CLIENT_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 2);
/// More client IPv4 addresses, for source-range tests (`Request::src_ip`).
pub const CLIENT_ALIASES: [Ipv4Addr; 3] = [
    Ipv4Addr::new(192, 0, 2, 3),
    Ipv4Addr::new(192, 0, 2, 4),
    Ipv4Addr::new(192, 0, 2, 5),
];
/// More client IPv6 addresses, for source-range tests.
pub const CLIENT_ALIASES6: [Ipv6Addr; 3] = [
    Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 3),
    Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 4),
    Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 5),
];
/// The cluster's pod range, IPv4 (`--cluster-cidr`).
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// The cluster's pod range, IPv6.
pub const CLUSTER_CIDR6: &str = "fd00:10:244::/48";
/// This node's podCIDR, IPv4.
pub const POD_CIDR: &str = "10.244.1.0/24";
/// This node's podCIDR, IPv6.
pub const POD_CIDR6: &str = "fd00:10:244:1::/64";
/// The ClusterIP range, IPv4.
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
/// The ClusterIP range, IPv6.
pub const SERVICE_CIDR6: &str = "fd00:10:96::/112";
/// The range externalIPs come from, IPv4 (TEST-NET-2).
pub const EXTERNAL_IP_CIDR: &str = "198.51.100.0/24";
/// The range externalIPs come from, IPv6.
pub const EXTERNAL_IP_CIDR6: &str = "2001:db8:e::/64";
/// The range LoadBalancer ingress IPs come from, IPv4 (TEST-NET-3).
pub const LOAD_BALANCER_CIDR: &str = "203.0.113.0/24";
/// The range LoadBalancer ingress IPs come from, IPv6.
pub const LOAD_BALANCER_CIDR6: &str = "2001:db8:b::/64";
/// The most pods a lab can hold (pod addresses run from `.10` to `.209`).
pub const MAX_PODS: usize = 200;
/// The most pods node-b can hold (remote pod addresses run from `.20` to `.219`).
pub const MAX_REMOTE_PODS: usize = 200;
/// Node-a's address on the node-to-node link (two-node labs).
pub const NODE_LINK_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
/// Node-a's IPv6 address on the node-to-node link.
pub const NODE_LINK_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 1);
/// Node-b's address on the node-to-node link.
pub const OTHER_NODE_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
/// Node-b's IPv6 address on the node-to-node link.
pub const OTHER_NODE_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 2);
/// Node-b's podCIDR, IPv4.
pub const OTHER_POD_CIDR: &str = "10.244.2.0/24";
/// Node-b's podCIDR, IPv6.
pub const OTHER_POD_CIDR6: &str = "fd00:10:244:2::/64";
/// The remote pods' IPv4 gateway: node-b's address on every pod veth.
pub const OTHER_POD_GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 1);

/// Linux's default ephemeral port range (`net.ipv4.ip_local_port_range`), from which a
/// connection without a bound port takes its local port ([`Lab::set_local_ports`] narrows it).
pub const EPHEMERAL_PORTS: std::ops::RangeInclusive<u16> = 32768..=60999;

/// The lab topology; dropping it kills everything in it and deletes its namespaces.
#[derive(Debug)]
pub struct Lab {
    node: Netns,
    client: Netns,
    pods: Vec<Netns>,
    other: Option<OtherNode>,
}

/// Node-b and its pods.
#[derive(Debug)]
struct OtherNode {
    node: Netns,
    pods: Vec<Netns>,
}

/// Which node a pod lives on, and so its addresses and gateway.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    /// Node-a, where kube-proxy runs.
    Local,
    /// Node-b.
    Remote,
}

impl Lab {
    /// Builds a node, `pods` pods (at most [`MAX_PODS`]) and a client, per the plan above.
    pub fn new(pods: usize) -> Result<Lab> {
        if pods > MAX_PODS {
            return Err(Error::InvalidArgument(format!(
                "{pods} pods: a lab holds at most {MAX_PODS}"
            )));
        }
        let node = Netns::new("node")?;
        let client = Netns::new("client")?;
        // Before any interface exists, so new interfaces inherit it: addresses must be usable
        // at once, not after duplicate address detection.
        for ns in [&node, &client] {
            no_dad(ns)?;
        }
        forwarding(&node, true)?;
        forwarding(&client, false)?;

        let mut client_addrs = vec![format!("{CLIENT_IP}/24"), format!("{CLIENT_IP6}/64")];
        client_addrs.extend(CLIENT_ALIASES.iter().map(|a| format!("{a}/24")));
        let client_addrs: Vec<&str> = client_addrs.iter().map(String::as_str).collect();
        veth(
            VethEnd {
                ns: &node,
                dev: "eth0",
                addrs: &[&format!("{NODE_IP}/24"), &format!("{NODE_IP6}/64")],
            },
            VethEnd {
                ns: &client,
                dev: "eth0",
                addrs: &client_addrs,
            },
        )?;
        // IPv6 has no secondary addresses: the aliases are deprecated (preferred_lft 0), so the
        // kernel never picks one as a source by itself, yet a socket may still bind to it.
        for alias in CLIENT_ALIASES6 {
            client.ip(&[
                "addr",
                "add",
                &format!("{alias}/64"),
                "dev",
                "eth0",
                "nodad",
                "preferred_lft",
                "0",
            ])?;
        }
        node.add_route("default", &CLIENT_IP.to_string())?;
        node.add_route("default", &CLIENT_IP6.to_string())?;
        for dest in [
            SERVICE_CIDR,
            CLUSTER_CIDR,
            EXTERNAL_IP_CIDR,
            LOAD_BALANCER_CIDR,
        ] {
            client.add_route(dest, &NODE_IP.to_string())?;
        }
        for dest in [
            SERVICE_CIDR6,
            CLUSTER_CIDR6,
            EXTERNAL_IP_CIDR6,
            LOAD_BALANCER_CIDR6,
        ] {
            client.add_route(dest, &NODE_IP6.to_string())?;
        }

        let mut lab = Lab {
            node,
            client,
            pods: Vec::with_capacity(pods),
            other: None,
        };
        for i in 0..pods {
            let pod = lab.add_pod(Side::Local, i)?;
            lab.pods.push(pod);
        }
        Ok(lab)
    }

    /// Builds [`Lab::new`]`(pods)` plus node-b, joined to the node by its own link, holding
    /// `remote_pods` pods (at most [`MAX_REMOTE_PODS`]), per the plan above. Endpoints on
    /// node-b make local-versus-remote rules real: traffic translated on the node is routed
    /// to node-b, and node-b sends every reply back through the node.
    pub fn two_nodes(pods: usize, remote_pods: usize) -> Result<Lab> {
        if remote_pods > MAX_REMOTE_PODS {
            return Err(Error::InvalidArgument(format!(
                "{remote_pods} remote pods: node-b holds at most {MAX_REMOTE_PODS}"
            )));
        }
        let mut lab = Lab::new(pods)?;
        let other = Netns::new("node-b")?;
        no_dad(&other)?;
        forwarding(&other, true)?;
        veth(
            VethEnd {
                ns: &lab.node,
                dev: "eth1",
                addrs: &[
                    &format!("{NODE_LINK_IP}/24"),
                    &format!("{NODE_LINK_IP6}/64"),
                ],
            },
            VethEnd {
                ns: &other,
                dev: "eth0",
                addrs: &[
                    &format!("{OTHER_NODE_IP}/24"),
                    &format!("{OTHER_NODE_IP6}/64"),
                ],
            },
        )?;
        lab.node
            .add_route(OTHER_POD_CIDR, &OTHER_NODE_IP.to_string())?;
        lab.node
            .add_route(OTHER_POD_CIDR6, &OTHER_NODE_IP6.to_string())?;
        other.add_route("default", &NODE_LINK_IP.to_string())?;
        other.add_route("default", &NODE_LINK_IP6.to_string())?;
        lab.other = Some(OtherNode {
            node: other,
            pods: Vec::with_capacity(remote_pods),
        });
        for i in 0..remote_pods {
            let pod = lab.add_pod(Side::Remote, i)?;
            if let Some(other) = &mut lab.other {
                other.pods.push(pod);
            }
        }
        Ok(lab)
    }

    /// Creates pod `i` on `side`'s node, wired point-to-point to it.
    fn add_pod(&self, side: Side, i: usize) -> Result<Netns> {
        let (node, role, gateway) = match (side, &self.other) {
            (Side::Local, _) => (&self.node, format!("pod{i}"), POD_GATEWAY),
            (Side::Remote, Some(other)) => (&other.node, format!("rpod{i}"), OTHER_POD_GATEWAY),
            (Side::Remote, None) => {
                return Err(Error::InvalidArgument(
                    "a remote pod needs node-b".to_string(),
                ))
            }
        };
        let pod = Netns::new(&role)?;
        no_dad(&pod)?;
        let (ip, ip6) = (pod_ip(side, i), pod_ip6(side, i));
        let node_dev = format!("veth{i}");
        veth(
            VethEnd {
                ns: &pod,
                dev: "eth0",
                addrs: &[&format!("{ip}/32"), &format!("{ip6}/128")],
            },
            VethEnd {
                ns: node,
                dev: &node_dev,
                addrs: &[&format!("{gateway}/32"), &format!("{POD_GATEWAY6}/64")],
            },
        )?;
        pod.add_route_dev(&gateway.to_string(), "eth0")?;
        pod.add_route("default", &gateway.to_string())?;
        pod.ip(&[
            "-6",
            "route",
            "add",
            "default",
            "via",
            &POD_GATEWAY6.to_string(),
            "dev",
            "eth0",
        ])?;
        node.add_route_dev(&format!("{ip}/32"), &node_dev)?;
        node.add_route_dev(&format!("{ip6}/128"), &node_dev)?;
        Ok(pod)
    }

    /// The node's namespace: where kube-proxy runs.
    pub fn node(&self) -> &Netns {
        &self.node
    }

    /// Node-b's namespace, in a two-node lab.
    pub fn other_node(&self) -> Option<&Netns> {
        self.other.as_ref().map(|o| &o.node)
    }

    /// The outside client's namespace.
    pub fn client(&self) -> &Netns {
        &self.client
    }

    /// Pod `i`'s namespace. Panics if there is no pod `i`.
    pub fn pod(&self, i: usize) -> &Netns {
        &self.pods[i]
    }

    /// How many pods the lab has on the node.
    pub fn pod_count(&self) -> usize {
        self.pods.len()
    }

    /// Remote pod `i`'s namespace (on node-b). Panics if there is no remote pod `i`.
    pub fn remote_pod(&self, i: usize) -> &Netns {
        match &self.other {
            Some(other) => &other.pods[i],
            None => panic!("remote pod {i}: this lab has no node-b (use Lab::two_nodes)"),
        }
    }

    /// How many pods the lab has on node-b (0 in a one-node lab).
    pub fn remote_pod_count(&self) -> usize {
        self.other.as_ref().map_or(0, |o| o.pods.len())
    }

    /// Pod `i`'s IPv4 address, `10.244.1.(10+i)`.
    pub fn pod_ip(&self, i: usize) -> IpAddr {
        pod_ip(Side::Local, i).into()
    }

    /// Pod `i`'s IPv6 address, `fd00:10:244:1::(10+i)` (the same digits as its IPv4 address).
    pub fn pod_ip6(&self, i: usize) -> IpAddr {
        pod_ip6(Side::Local, i).into()
    }

    /// Remote pod `i`'s IPv4 address, `10.244.2.(20+i)`.
    pub fn remote_pod_ip(&self, i: usize) -> IpAddr {
        pod_ip(Side::Remote, i).into()
    }

    /// Remote pod `i`'s IPv6 address, `fd00:10:244:2::(20+i)`.
    pub fn remote_pod_ip6(&self, i: usize) -> IpAddr {
        pod_ip6(Side::Remote, i).into()
    }

    /// The name pod `i`'s echo server answers with: `pod-i`.
    pub fn pod_name(&self, i: usize) -> String {
        format!("pod-{i}")
    }

    /// The name remote pod `i`'s echo server answers with: `remote-i`.
    pub fn remote_pod_name(&self, i: usize) -> String {
        format!("remote-{i}")
    }

    /// Every address of the node (where kube-proxy runs): a masqueraded connection shows one
    /// of these to its backend. Loopback is left out.
    pub fn node_ips(&self) -> Vec<IpAddr> {
        let mut ips: Vec<IpAddr> = vec![
            NODE_IP.into(),
            NODE_IP6.into(),
            POD_GATEWAY.into(),
            POD_GATEWAY6.into(),
        ];
        if self.other.is_some() {
            ips.extend([IpAddr::from(NODE_LINK_IP), NODE_LINK_IP6.into()]);
        }
        ips
    }

    /// The names of all the lab's namespaces, to check that they are gone after a drop.
    pub fn namespaces(&self) -> Vec<String> {
        self.all().map(|ns| ns.name().to_string()).collect()
    }

    /// Every process started in any of the lab's namespaces from now on joins the cgroup v2
    /// directory `cgroup` first ([`Netns::place_in_cgroup`]).
    pub fn place_in_cgroup(&self, cgroup: Option<&std::path::Path>) {
        self.all().for_each(|ns| ns.place_in_cgroup(cgroup));
    }

    /// Every namespace's new connections take their local port from `ports` from now on
    /// (`net.ipv4.ip_local_port_range`, which IPv6 shares).
    pub fn set_local_ports(&self, ports: std::ops::RangeInclusive<u16>) -> Result<()> {
        let range = format!("{} {}", ports.start(), ports.end());
        self.all()
            .try_for_each(|ns| ns.sysctl("net.ipv4.ip_local_port_range", &range))
    }

    fn all(&self) -> impl Iterator<Item = &Netns> {
        let other = self
            .other
            .iter()
            .flat_map(|o| std::iter::once(&o.node).chain(&o.pods));
        [&self.node, &self.client]
            .into_iter()
            .chain(&self.pods)
            .chain(other)
    }

    /// Starts kp-echo in pod `i`, named [`Lab::pod_name`], and waits until it listens.
    pub fn serve_echo(&self, i: usize, tcp: &[u16], udp: &[u16]) -> Result<ChildGuard> {
        echo::serve(self.pod(i), &self.pod_name(i), tcp, udp)
    }

    /// Starts kp-echo in remote pod `i`, named [`Lab::remote_pod_name`], and waits until it
    /// listens.
    pub fn serve_remote_echo(&self, i: usize, tcp: &[u16], udp: &[u16]) -> Result<ChildGuard> {
        echo::serve(self.remote_pod(i), &self.remote_pod_name(i), tcp, udp)
    }

    /// One request from namespace `from` to `ip:port`, with the default 2 s timeout.
    pub fn request(&self, from: &Netns, proto: Proto, ip: IpAddr, port: u16) -> Outcome {
        let mut outcomes = self.send(from, &Request::new(proto, ip, port));
        outcomes.swap_remove(0)
    }

    /// Runs `req` from namespace `from`: one outcome per attempt.
    pub fn send(&self, from: &Netns, req: &Request) -> Vec<Outcome> {
        echo::request(from, req)
    }
}

fn forwarding(ns: &Netns, on: bool) -> Result<()> {
    let v = if on { "1" } else { "0" };
    ns.sysctl("net.ipv4.ip_forward", v)?;
    ns.sysctl("net.ipv6.conf.all.forwarding", v)
}

fn no_dad(ns: &Netns) -> Result<()> {
    ns.sysctl("net.ipv6.conf.all.accept_dad", "0")?;
    ns.sysctl("net.ipv6.conf.default.accept_dad", "0")
}

fn pod_ip(side: Side, i: usize) -> Ipv4Addr {
    // The constructors keep i below MAX_PODS / MAX_REMOTE_PODS, so the last octet stays below
    // 256.
    match side {
        Side::Local => Ipv4Addr::new(10, 244, 1, (10 + i) as u8),
        Side::Remote => Ipv4Addr::new(10, 244, 2, (20 + i) as u8),
    }
}

fn pod_ip6(side: Side, i: usize) -> Ipv6Addr {
    // The decimal digits of the IPv4 octet, read as hex: pod 5 is 10.244.1.15 and
    // fd00:10:244:1::15.
    let (subnet, octet) = match side {
        Side::Local => (1, 10 + i),
        Side::Remote => (2, 20 + i),
    };
    let group = u16::from_str_radix(&octet.to_string(), 16).unwrap_or(0);
    Ipv6Addr::new(0xfd00, 0x10, 0x244, subnet, 0, 0, 0, group)
}

#[cfg(test)]
mod tests;
