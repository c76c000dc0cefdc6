//! ipset elements over netlink: the element changes of a `kp-ipvs-plan` set difference, added
//! and deleted with nfnetlink requests ([`kp_netlink::ipset`]) instead of an `ipset restore`
//! process. No process spawn: a partial sync's few changes cost a round trip per datagram.
//!
//! Only elements: the sets themselves are created (and read back) by `ipset restore` and
//! `ipset save` in a full sync. Adds of elements already there and deletes of elements already
//! gone succeed (as `-exist` in the restore text).

use kp_core::model::IpFamily;
use kp_ipvs_plan::ipset::{Entry, SetChange};
use kp_netlink::ipset::{self as wire, Command, Element};
use kp_netlink::socket::Socket;

use crate::{wrap, Error, Result, PIPELINE};

/// The attributes of an entry: what its set type reads.
pub fn element(entry: &Entry) -> Element {
    match *entry {
        Entry::Port(port) => Element {
            port: Some(port),
            ..Element::default()
        },
        Entry::Ip(ip) => Element {
            ip: Some(ip),
            ..Element::default()
        },
        Entry::IpPort(ip, p, port) => Element {
            ip: Some(ip),
            port: Some(port),
            proto: Some(p.ip_number()),
            ..Element::default()
        },
        Entry::IpPortIp(ip, p, port, ip2) => Element {
            ip: Some(ip),
            port: Some(port),
            proto: Some(p.ip_number()),
            ip2: Some(ip2),
            cidr2: None,
        },
        Entry::IpPortNet(ip, p, port, net) => Element {
            ip: Some(ip),
            port: Some(port),
            proto: Some(p.ip_number()),
            ip2: Some(net.network()),
            cidr2: Some(net.prefix_len()),
        },
    }
}

/// What a change asks, as `ipset` would be told it: `ipset add KUBE-CLUSTER-IP 10.96.0.10,tcp:80`.
fn describe(family: IpFamily, change: &SetChange) -> String {
    let (command, set, entry) = parts(change);
    format!("ipset {} {} {entry}", command.as_str(), set.name(family))
}

fn parts(change: &SetChange) -> (Command, kp_ipvs_plan::ipset::SetName, &Entry) {
    match change {
        SetChange::Add(s, e) => (Command::Add, *s, e),
        SetChange::Del(s, e) => (Command::Del, *s, e),
    }
}

/// An ipset client: a `NETLINK_NETFILTER` socket in one network namespace. Blocking; one
/// exchange at a time.
#[derive(Debug)]
pub struct Ipset {
    socket: Socket,
}

impl Ipset {
    /// Opens a socket in the current network namespace (`netns` `None`) or in
    /// `/var/run/netns/NAME`.
    pub fn open(netns: Option<&str>) -> Result<Ipset> {
        let socket = Socket::open(kp_netlink::Protocol::Netfilter, netns).map_err(|source| {
            Error::Socket {
                op: "open an ipset socket".into(),
                source,
            }
        })?;
        Ok(Ipset { socket })
    }

    /// Applies element changes to the sets of `family` (`KUBE-...` or `KUBE-6-...`), in order,
    /// pipelined: up to [`PIPELINE`] requests in one datagram, each acknowledged. Every request
    /// of a datagram is tried; the first refused one is returned ([`Error::Kernel`] naming the
    /// set and the entry, and ipset's name for its errno when it has one: `ENOENT` is a set
    /// that does not exist), and the datagrams after it are not sent.
    pub fn apply(&mut self, family: IpFamily, changes: &[SetChange]) -> Result<()> {
        let nfproto = wire::nfproto(family == IpFamily::V6);
        let refused = self
            .socket
            .pipeline(
                changes.len(),
                PIPELINE,
                |i, buf, seq| {
                    let (command, set, entry) = parts(&changes[i]);
                    wire::request(
                        buf,
                        command,
                        nfproto,
                        seq,
                        &set.name(family),
                        &element(entry),
                    );
                },
                |_, _| false,
            )
            .map_err(|e| wrap(format!("apply {} ipset changes", changes.len()), e))?;
        if let Some((i, error)) = refused {
            let mut op = describe(family, &changes[i]);
            if let Some(name) = wire::error_name(error.errno) {
                op.push_str(&format!(" ({name})"));
            }
            return Err(Error::Kernel { op, error });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use kp_core::model::Protocol;

    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn entries_become_the_attributes_their_set_type_reads() {
        assert_eq!(
            element(&Entry::Port(30080)),
            Element {
                port: Some(30080),
                ..Element::default()
            }
        );
        assert_eq!(
            element(&Entry::Ip(ip("fd00::1"))),
            Element {
                ip: Some(ip("fd00::1")),
                ..Element::default()
            }
        );
        assert_eq!(
            element(&Entry::IpPort(ip("10.0.0.1"), Protocol::Sctp, 80)),
            Element {
                ip: Some(ip("10.0.0.1")),
                port: Some(80),
                proto: Some(132),
                ..Element::default()
            }
        );
        assert_eq!(
            element(&Entry::IpPortIp(
                ip("10.0.0.1"),
                Protocol::Udp,
                53,
                ip("10.0.0.1")
            )),
            Element {
                ip: Some(ip("10.0.0.1")),
                port: Some(53),
                proto: Some(17),
                ip2: Some(ip("10.0.0.1")),
                cidr2: None,
            }
        );
        assert_eq!(
            element(&Entry::IpPortNet(
                ip("10.0.0.1"),
                Protocol::Tcp,
                443,
                "198.51.100.0/24".parse().unwrap()
            )),
            Element {
                ip: Some(ip("10.0.0.1")),
                port: Some(443),
                proto: Some(6),
                ip2: Some(ip("198.51.100.0")),
                cidr2: Some(24),
            }
        );
    }
}
