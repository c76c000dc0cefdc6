//! The dummy interface `kube-ipvs0` and its addresses, over `NETLINK_ROUTE` (the messages of
//! `ip link add kube-ipvs0 type dummy` and `ip addr add|del ADDR/32 dev kube-ipvs0`).
//!
//! As upstream, the interface stays down: an address on it is still local (the kernel adds
//! its `local` route), which is all IPVS needs to see the packets in `INPUT`.

use std::collections::BTreeSet;
use std::net::IpAddr;

use kp_netlink::abi::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REPLACE, NLM_F_REQUEST,
};
use kp_netlink::{attr, message, Protocol, Socket};

use crate::{Error, Result};

// linux/rtnetlink.h
const RTM_NEWLINK: u16 = 16;
const RTM_DELLINK: u16 = 17;
const RTM_GETLINK: u16 = 18;
const RTM_NEWADDR: u16 = 20;
const RTM_DELADDR: u16 = 21;
const RTM_GETADDR: u16 = 22;
// linux/if_link.h
const IFLA_IFNAME: u16 = 3;
const IFLA_LINKINFO: u16 = 18;
const IFLA_INFO_KIND: u16 = 1;
// linux/if_addr.h
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const IFA_CACHEINFO: u16 = 6;
const RT_SCOPE_HOST: u8 = 254;
// linux/socket.h
const AF_UNSPEC: u8 = 0;
const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
/// `struct ifinfomsg`: family, pad, type, index, flags, change.
const IFINFOMSG_LEN: usize = 16;
/// `struct ifaddrmsg`: family, prefixlen, flags, scope, index.
const IFADDRMSG_LEN: usize = 8;

/// A `NETLINK_ROUTE` socket for one dummy interface in one namespace.
pub struct Dummy {
    socket: Socket,
    name: String,
    index: u32,
}

fn sock_err(op: String) -> impl FnOnce(kp_netlink::socket::Error) -> Error {
    move |source| match source.kernel() {
        Some(error) => Error::Kernel { op, error },
        None => Error::Socket { op, source },
    }
}

fn ifinfomsg(buf: &mut Vec<u8>, index: u32) {
    buf.extend_from_slice(&[AF_UNSPEC, 0, 0, 0]);
    buf.extend_from_slice(&index.to_ne_bytes());
    buf.extend_from_slice(&[0u8; 8]);
}

impl Dummy {
    /// Creates the dummy interface `name` in `netns` (kept if it exists) and opens it.
    pub fn ensure(netns: Option<&str>, name: &str) -> Result<Dummy> {
        let socket = Socket::open(Protocol::Route, netns)
            .map_err(sock_err(format!("open a NETLINK_ROUTE socket for {name}")))?;
        let mut d = Dummy {
            socket,
            name: name.to_string(),
            index: 0,
        };
        let created = d.socket.request(
            |b, seq| {
                let m = message::begin(
                    b,
                    RTM_NEWLINK,
                    NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
                    seq,
                );
                ifinfomsg(b, 0);
                attr::put_str(b, IFLA_IFNAME, name);
                attr::put_nested(b, IFLA_LINKINFO, |b| {
                    attr::put_str(b, IFLA_INFO_KIND, "dummy")
                });
                message::end(b, m);
            },
            |_| Ok(()),
        );
        match created {
            Ok(_) => {}
            Err(e) if e.kernel().is_some_and(|k| k.is_exists()) => {}
            Err(e) => return Err(sock_err(format!("ip link add {name} type dummy"))(e)),
        }
        d.index = d.lookup()?;
        Ok(d)
    }

    /// Opens the interface `name` in `netns` if it exists (`None` if it does not), without
    /// creating it: what removing the mode's leftovers starts from.
    pub fn find(netns: Option<&str>, name: &str) -> Result<Option<Dummy>> {
        let socket = Socket::open(Protocol::Route, netns)
            .map_err(sock_err(format!("open a NETLINK_ROUTE socket for {name}")))?;
        let mut d = Dummy {
            socket,
            name: name.to_string(),
            index: 0,
        };
        match d.lookup() {
            Ok(index) => {
                d.index = index;
                Ok(Some(d))
            }
            Err(e) if e.errno() == Some(kp_netlink::abi::ENODEV) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn lookup(&mut self) -> Result<u32> {
        let name = self.name.clone();
        let mut index = None;
        self.socket
            .request(
                |b, seq| {
                    // With an ack, the answer ends the exchange (a lone reply would not).
                    let m = message::begin(b, RTM_GETLINK, NLM_F_REQUEST | NLM_F_ACK, seq);
                    ifinfomsg(b, 0);
                    attr::put_str(b, IFLA_IFNAME, &name);
                    message::end(b, m);
                },
                |m| {
                    if m.payload.len() >= IFINFOMSG_LEN {
                        let i = &m.payload[4..8];
                        index = Some(u32::from_ne_bytes([i[0], i[1], i[2], i[3]]));
                    }
                    Ok(())
                },
            )
            .map_err(sock_err(format!("ip link show {name}")))?;
        index.ok_or_else(|| Error::Tool {
            op: format!("ip link show {name}"),
            detail: "no link in the answer".into(),
        })
    }

    /// The interface's index.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The addresses on the interface (`ip addr show dev NAME`).
    pub fn addresses(&mut self) -> Result<BTreeSet<IpAddr>> {
        let index = self.index;
        self.dump_addresses(|i| i == index)
    }

    /// The node's own addresses, where NodePorts can answer: those of every other interface
    /// (`ip addr show`, less this one), without loopback and IPv6 link-local addresses (as
    /// upstream's ipvs mode, which lists the local addresses not on `kube-ipvs0`).
    pub fn node_addresses(&mut self) -> Result<BTreeSet<IpAddr>> {
        let index = self.index;
        let mut all = self.dump_addresses(|i| i != index)?;
        all.retain(|ip| match ip {
            IpAddr::V4(a) => !a.is_loopback(),
            IpAddr::V6(a) => !a.is_loopback() && (a.segments()[0] & 0xffc0) != 0xfe80,
        });
        Ok(all)
    }

    /// The addresses of the interfaces whose index `keep` accepts.
    fn dump_addresses(&mut self, keep: impl Fn(u32) -> bool) -> Result<BTreeSet<IpAddr>> {
        self.socket
            .dump(
                |b, seq| {
                    let m = message::begin(b, RTM_GETADDR, NLM_F_REQUEST | NLM_F_DUMP, seq);
                    b.extend_from_slice(&[AF_UNSPEC, 0, 0, 0]);
                    b.extend_from_slice(&0u32.to_ne_bytes());
                    message::end(b, m);
                },
                |set: &mut BTreeSet<IpAddr>, m| {
                    if m.payload.len() < IFADDRMSG_LEN {
                        return Ok(());
                    }
                    let p = m.payload;
                    if !keep(u32::from_ne_bytes([p[4], p[5], p[6], p[7]])) {
                        return Ok(());
                    }
                    let family = p[0];
                    for a in attr::attrs(&p[IFADDRMSG_LEN..]) {
                        let a = a?;
                        if a.kind != IFA_LOCAL && a.kind != IFA_ADDRESS {
                            continue;
                        }
                        let ip = match (family, a.payload.len()) {
                            (AF_INET, 4) => {
                                let o: [u8; 4] = a.payload.try_into().unwrap_or([0; 4]);
                                IpAddr::from(o)
                            }
                            (AF_INET6, 16) => {
                                let o: [u8; 16] = a.payload.try_into().unwrap_or([0; 16]);
                                IpAddr::from(o)
                            }
                            _ => continue,
                        };
                        set.insert(ip);
                    }
                    Ok(())
                },
            )
            .map_err(sock_err(format!("ip addr show dev {}", self.name)))
    }

    /// Adds (`RTM_NEWADDR`) or deletes (`RTM_DELADDR`) `ips` on the interface, pipelined:
    /// up to [`crate::PIPELINE`] requests in one datagram, each acknowledged (a round trip per
    /// datagram: a full sync binds every Service address). An address already there on add,
    /// or already gone on delete (`EADDRNOTAVAIL`), is the state asked for; the first other
    /// refusal is returned (the requests around it ran).
    fn addresses_change(&mut self, kind: u16, ips: &[IpAddr]) -> Result<()> {
        let index = self.index;
        let add = kind == RTM_NEWADDR;
        let verb = if add { "add" } else { "del" };
        let refused = self
            .socket
            .pipeline(
                ips.len(),
                crate::PIPELINE,
                |i, buf, seq| address_request(buf, kind, index, ips[i], seq),
                |_, e| {
                    if add {
                        e.is_exists()
                    } else {
                        e.errno == EADDRNOTAVAIL
                    }
                },
            )
            .map_err(sock_err(format!(
                "ip addr {verb} ({} addresses) dev {}",
                ips.len(),
                self.name
            )))?;
        match refused {
            None => Ok(()),
            Some((i, error)) => {
                let ip = ips[i];
                let prefix = if ip.is_ipv6() { 128 } else { 32 };
                Err(sock_err(format!(
                    "ip addr {verb} {ip}/{prefix} dev {}",
                    self.name
                ))(kp_netlink::socket::Error::Kernel {
                    seq: 0,
                    error,
                }))
            }
        }
    }

    /// `ip addr add IP/32 (or /128) dev NAME`; an address already there is fine.
    pub fn bind(&mut self, ip: IpAddr) -> Result<()> {
        self.addresses_change(RTM_NEWADDR, &[ip])
    }

    /// [`Dummy::bind`] for many addresses, pipelined.
    pub fn bind_all(&mut self, ips: &[IpAddr]) -> Result<()> {
        self.addresses_change(RTM_NEWADDR, ips)
    }

    /// `ip addr del IP/32 (or /128) dev NAME`; a missing address is fine.
    pub fn unbind(&mut self, ip: IpAddr) -> Result<()> {
        self.addresses_change(RTM_DELADDR, &[ip])
    }

    /// [`Dummy::unbind`] for many addresses, pipelined.
    pub fn unbind_all(&mut self, ips: &[IpAddr]) -> Result<()> {
        self.addresses_change(RTM_DELADDR, ips)
    }

    /// `ip link del NAME` (its addresses go with it).
    pub fn delete(mut self) -> Result<()> {
        let index = self.index;
        let name = self.name.clone();
        self.socket
            .request(
                |b, seq| {
                    let m = message::begin(b, RTM_DELLINK, NLM_F_REQUEST | NLM_F_ACK, seq);
                    ifinfomsg(b, index);
                    message::end(b, m);
                },
                |_| Ok(()),
            )
            .map_err(sock_err(format!("ip link del {name}")))?;
        Ok(())
    }
}

/// Writes one `RTM_NEWADDR`/`RTM_DELADDR` request for `ip` (a host address) on interface
/// `index`, with `NLM_F_ACK`.
fn address_request(b: &mut Vec<u8>, kind: u16, index: u32, ip: IpAddr, seq: u32) {
    let (family, prefix, octets): (u8, u8, Vec<u8>) = match ip {
        IpAddr::V4(a) => (AF_INET, 32, a.octets().to_vec()),
        IpAddr::V6(a) => (AF_INET6, 128, a.octets().to_vec()),
    };
    let v6 = family == AF_INET6;
    let flags = if kind == RTM_NEWADDR && v6 {
        // Replace: an address bound before gets the lifetimes below too.
        NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE
    } else if kind == RTM_NEWADDR {
        NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL
    } else {
        NLM_F_REQUEST | NLM_F_ACK
    };
    let m = message::begin(b, kind, flags, seq);
    b.extend_from_slice(&[family, prefix, 0, RT_SCOPE_HOST]);
    b.extend_from_slice(&index.to_ne_bytes());
    attr::put(b, IFA_LOCAL, &octets);
    attr::put(b, IFA_ADDRESS, &octets);
    if v6 && kind == RTM_NEWADDR {
        // struct ifa_cacheinfo: preferred 0 (deprecated: never chosen as a source address, so
        // the masquerade of traffic leaving the node does not pick a Service address), valid
        // forever; the timestamps are the kernel's.
        let mut ci = Vec::with_capacity(16);
        ci.extend_from_slice(&0u32.to_ne_bytes());
        ci.extend_from_slice(&u32::MAX.to_ne_bytes());
        ci.extend_from_slice(&[0u8; 8]);
        attr::put(b, IFA_CACHEINFO, &ci);
    }
    message::end(b, m);
}

/// asm-generic/errno.h: what deleting an address that is not there answers.
const EADDRNOTAVAIL: i32 = 99;
