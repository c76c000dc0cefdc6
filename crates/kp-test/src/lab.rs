//! A small cluster in network namespaces: one node, K pods on it, and one outside client.
//!
//! # Addressing plan
//!
//! This is the one place test IP ranges are fixed; `scripts/lab.sh` builds the same topology.
//! Every address exists only inside the lab's own namespaces.
//!
//! ```text
//!  client ns   eth0  192.0.2.2/24 (+ aliases .3 .4 .5)    2001:db8::2/64 (+ ::3 ::4 ::5, deprecated)
//!                │   routes via the node: 10.96.0.0/16 10.244.0.0/16 198.51.100.0/24 203.0.113.0/24
//!                │                        fd00:10:96::/112 fd00:10:244::/48 2001:db8:e::/64 2001:db8:b::/64
//!                │   TEST-NET-1 link
//!  node ns     eth0  192.0.2.1/24                         2001:db8::1/64
//!                    default routes via the client (the node's "uplink")
//!                    ip_forward=1, ipv6 forwarding=1
//!              vethI 10.244.1.1/32                        fe80::1/64        (the same on every vethI)
//!                    route 10.244.1.(10+I)/32 dev vethI   route fd00:10:244:1::(10+I)/128 dev vethI
//!                │
//!  pod I ns    eth0  10.244.1.(10+I)/32                   fd00:10:244:1::(10+I)/128
//!                    default via 10.244.1.1 (on-link)     default via fe80::1
//! ```
//!
//! | range                                | role                                            |
//! |--------------------------------------|-------------------------------------------------|
//! | `10.244.0.0/16`, `fd00:10:244::/48`  | cluster CIDR (`--cluster-cidr`)                 |
//! | `10.244.1.0/24`, `fd00:10:244:1::/64`| this node's podCIDR; pod I is `.(10+I)` / `::(10+I)` (the same digits) |
//! | `10.96.0.0/16`, `fd00:10:96::/112`   | ClusterIPs                                      |
//! | `198.51.100.0/24`, `2001:db8:e::/64` | externalIPs (TEST-NET-2)                        |
//! | `203.0.113.0/24`, `2001:db8:b::/64`  | LoadBalancer ingress IPs (TEST-NET-3)           |
//! | `192.0.2.0/24`, `2001:db8::/64`      | node ↔ client link (TEST-NET-1); node IP `.1`, client `.2`-`.5` |
//!
//! Pods are routed point-to-point (like the CNI `ptp` plugin and kindnet), not bridged: every
//! packet between two pods crosses the node's IP layer and conntrack. On a bridge, the reply of
//! pod B to pod A after a ClusterIP DNAT would be switched straight back to A, skipping the
//! un-DNAT, unless `br_netfilter` is loaded; the lab must not depend on a host module.
//!
//! The node's default routes point at the client, as a real node's point at its uplink: the
//! node's own connections to ClusterIPs need a route before nat OUTPUT can rewrite them.
//! Unclaimed service traffic therefore goes to the client, which does not forward, and dies.

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

/// The lab topology; dropping it kills everything in it and deletes its namespaces.
#[derive(Debug)]
pub struct Lab {
    node: Netns,
    client: Netns,
    pods: Vec<Netns>,
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
        node.sysctl("net.ipv4.ip_forward", "1")?;
        node.sysctl("net.ipv6.conf.all.forwarding", "1")?;
        client.sysctl("net.ipv4.ip_forward", "0")?;
        client.sysctl("net.ipv6.conf.all.forwarding", "0")?;

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
        };
        for i in 0..pods {
            lab.add_pod(i)?;
        }
        Ok(lab)
    }

    fn add_pod(&mut self, i: usize) -> Result<()> {
        let pod = Netns::new(&format!("pod{i}"))?;
        no_dad(&pod)?;
        let (ip, ip6) = (pod_ip(i), pod_ip6(i));
        let node_dev = format!("veth{i}");
        veth(
            VethEnd {
                ns: &pod,
                dev: "eth0",
                addrs: &[&format!("{ip}/32"), &format!("{ip6}/128")],
            },
            VethEnd {
                ns: &self.node,
                dev: &node_dev,
                addrs: &[&format!("{POD_GATEWAY}/32"), &format!("{POD_GATEWAY6}/64")],
            },
        )?;
        pod.add_route_dev(&POD_GATEWAY.to_string(), "eth0")?;
        pod.add_route("default", &POD_GATEWAY.to_string())?;
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
        self.node.add_route_dev(&format!("{ip}/32"), &node_dev)?;
        self.node.add_route_dev(&format!("{ip6}/128"), &node_dev)?;
        self.pods.push(pod);
        Ok(())
    }

    /// The node's namespace: where kube-proxy runs.
    pub fn node(&self) -> &Netns {
        &self.node
    }

    /// The outside client's namespace.
    pub fn client(&self) -> &Netns {
        &self.client
    }

    /// Pod `i`'s namespace. Panics if there is no pod `i`.
    pub fn pod(&self, i: usize) -> &Netns {
        &self.pods[i]
    }

    /// How many pods the lab has.
    pub fn pod_count(&self) -> usize {
        self.pods.len()
    }

    /// Pod `i`'s IPv4 address, `10.244.1.(10+i)`.
    pub fn pod_ip(&self, i: usize) -> IpAddr {
        pod_ip(i).into()
    }

    /// Pod `i`'s IPv6 address, `fd00:10:244:1::(10+i)` (the same digits as its IPv4 address).
    pub fn pod_ip6(&self, i: usize) -> IpAddr {
        pod_ip6(i).into()
    }

    /// The name pod `i`'s echo server answers with: `pod-i`.
    pub fn pod_name(&self, i: usize) -> String {
        format!("pod-{i}")
    }

    /// The names of all the lab's namespaces, to check that they are gone after a drop.
    pub fn namespaces(&self) -> Vec<String> {
        [&self.node, &self.client]
            .into_iter()
            .chain(&self.pods)
            .map(|ns| ns.name().to_string())
            .collect()
    }

    /// Starts kp-echo in pod `i`, named [`Lab::pod_name`], and waits until it listens.
    pub fn serve_echo(&self, i: usize, tcp: &[u16], udp: &[u16]) -> Result<ChildGuard> {
        echo::serve(self.pod(i), &self.pod_name(i), tcp, udp)
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

fn no_dad(ns: &Netns) -> Result<()> {
    ns.sysctl("net.ipv6.conf.all.accept_dad", "0")?;
    ns.sysctl("net.ipv6.conf.default.accept_dad", "0")
}

fn pod_ip(i: usize) -> Ipv4Addr {
    // Lab::new keeps i below MAX_PODS, so the last octet stays below 256.
    Ipv4Addr::new(10, 244, 1, (10 + i) as u8)
}

fn pod_ip6(i: usize) -> Ipv6Addr {
    // The decimal digits of the IPv4 octet, read as hex: pod 5 is 10.244.1.15 and
    // fd00:10:244:1::15.
    let group = u16::from_str_radix(&(10 + i).to_string(), 16).unwrap_or(0);
    Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, group)
}

#[cfg(test)]
mod tests;
