//! The socket options and ancillary data the proxy needs, through `nix` (no `unsafe` here):
//! the original destination of a redirected TCP connection, transparent sockets bound to a
//! client's address, and UDP datagrams with the local address they arrived at.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsFd, OwnedFd};

use nix::libc;
use nix::sys::socket::{self, sockopt, ControlMessage, ControlMessageOwned, MsgFlags};

/// The destination a redirected connection had before REDIRECT rewrote it: `SO_ORIGINAL_DST`
/// (IPv4) or `IP6T_SO_ORIGINAL_DST` (IPv6), asked of the accepted socket. `local` (the address
/// the connection arrived at) tells the family.
pub fn original_dst(fd: &impl AsFd, local: SocketAddr) -> io::Result<SocketAddr> {
    match local {
        SocketAddr::V4(_) => {
            let sin = socket::getsockopt(fd, sockopt::OriginalDst)?;
            Ok(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
                u16::from_be(sin.sin_port),
            )))
        }
        SocketAddr::V6(_) => {
            let sin6 = socket::getsockopt(fd, sockopt::Ip6tOriginalDst)?;
            Ok(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            )))
        }
    }
}

/// Marks a socket transparent (`IP_TRANSPARENT`), so it may bind a non-local address: the
/// client's, for a connection the endpoint should see coming from the client. The option at
/// `SOL_IP` sets the same flag `IPV6_TRANSPARENT` does, so it serves both families.
pub fn set_transparent(fd: &impl AsFd) -> io::Result<()> {
    socket::setsockopt(fd, sockopt::IpTransparent, &true)?;
    Ok(())
}

/// Makes closing the socket send a reset (`SO_LINGER` on, 0 seconds): how the proxy refuses
/// a client, or passes on an endpoint's reset.
pub fn reset_on_close(fd: &impl AsFd) -> io::Result<()> {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    socket::setsockopt(fd, sockopt::Linger, &linger)?;
    Ok(())
}

/// Asks for the local address of every received datagram (`IP_PKTINFO` /
/// `IPV6_RECVPKTINFO`).
pub fn set_recv_pktinfo(fd: &impl AsFd, v6: bool) -> io::Result<()> {
    if v6 {
        socket::setsockopt(fd, sockopt::Ipv6RecvPacketInfo, &true)?;
    } else {
        socket::setsockopt(fd, sockopt::Ipv4PacketInfo, &true)?;
    }
    Ok(())
}

/// A non-blocking socket of `kind` for `addr`'s family, `setup` applied before it is bound to
/// `addr` (options that must precede `bind`: `IP_TRANSPARENT`, `IPV6_V6ONLY`, `SO_REUSEADDR`).
pub fn bound_socket(
    addr: SocketAddr,
    kind: socket::SockType,
    setup: impl FnOnce(&OwnedFd) -> io::Result<()>,
) -> io::Result<OwnedFd> {
    use std::os::fd::AsRawFd;
    let family = if addr.is_ipv4() {
        socket::AddressFamily::Inet
    } else {
        socket::AddressFamily::Inet6
    };
    let fd = socket::socket(
        family,
        kind,
        socket::SockFlag::SOCK_CLOEXEC | socket::SockFlag::SOCK_NONBLOCK,
        None,
    )?;
    setup(&fd)?;
    socket::bind(fd.as_raw_fd(), &socket::SockaddrStorage::from(addr))?;
    Ok(fd)
}

/// Sets `IPV6_V6ONLY`, so the IPv6 listener leaves IPv4 to its own socket.
pub fn set_v6only(fd: &impl AsFd) -> io::Result<()> {
    socket::setsockopt(fd, sockopt::Ipv6V6Only, &true)?;
    Ok(())
}

/// One datagram received on a listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Received {
    /// Its length in the buffer.
    pub len: usize,
    /// Who sent it.
    pub peer: SocketAddr,
    /// The address it was delivered to (after REDIRECT: the node's address on the incoming
    /// interface, or loopback for the node's own traffic).
    pub local: IpAddr,
}

/// Receives one datagram without blocking (`EWOULDBLOCK` when none is queued), with the local
/// address it arrived at.
pub fn recv_with_local(fd: &impl AsFd, buf: &mut [u8]) -> io::Result<Received> {
    use std::os::fd::AsRawFd;
    let mut iov = [io::IoSliceMut::new(buf)];
    let mut cmsg = nix::cmsg_space!(libc::in6_pktinfo);
    let msg = socket::recvmsg::<socket::SockaddrStorage>(
        fd.as_fd().as_raw_fd(),
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::MSG_DONTWAIT,
    )?;
    let peer = msg
        .address
        .as_ref()
        .and_then(storage_to_std)
        .ok_or_else(|| io::Error::other("datagram without a source address"))?;
    let mut local = None;
    for c in msg.cmsgs()? {
        match c {
            ControlMessageOwned::Ipv4PacketInfo(info) => {
                local = Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                    info.ipi_addr.s_addr,
                ))));
            }
            ControlMessageOwned::Ipv6PacketInfo(info) => {
                local = Some(IpAddr::V6(Ipv6Addr::from(info.ipi6_addr.s6_addr)));
            }
            _ => {}
        }
    }
    let local = local.ok_or_else(|| io::Error::other("datagram without packet info"))?;
    Ok(Received {
        len: msg.bytes,
        peer,
        local,
    })
}

/// Sends `data` to `to` from local address `from` (`IP_PKTINFO` / `IPV6_PKTINFO` source), so
/// a reply leaves with the address the request arrived at and conntrack un-NATs it.
pub fn send_from(fd: &impl AsFd, data: &[u8], from: IpAddr, to: SocketAddr) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    let iov = [io::IoSlice::new(data)];
    let raw = fd.as_fd().as_raw_fd();
    let flags = MsgFlags::MSG_DONTWAIT;
    match (from, to) {
        (IpAddr::V4(src), SocketAddr::V4(dst)) => {
            let info = libc::in_pktinfo {
                ipi_ifindex: 0,
                ipi_spec_dst: libc::in_addr {
                    s_addr: u32::from(src).to_be(),
                },
                ipi_addr: libc::in_addr { s_addr: 0 },
            };
            let cmsg = [ControlMessage::Ipv4PacketInfo(&info)];
            let addr = socket::SockaddrIn::from(dst);
            Ok(socket::sendmsg(raw, &iov, &cmsg, flags, Some(&addr))?)
        }
        (IpAddr::V6(src), SocketAddr::V6(dst)) => {
            let info = libc::in6_pktinfo {
                ipi6_addr: libc::in6_addr {
                    s6_addr: src.octets(),
                },
                ipi6_ifindex: 0,
            };
            let cmsg = [ControlMessage::Ipv6PacketInfo(&info)];
            let addr = socket::SockaddrIn6::from(dst);
            Ok(socket::sendmsg(raw, &iov, &cmsg, flags, Some(&addr))?)
        }
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("cannot send from {from} to {to}: families differ"),
        )),
    }
}

fn storage_to_std(s: &socket::SockaddrStorage) -> Option<SocketAddr> {
    if let Some(v4) = s.as_sockaddr_in() {
        return Some(SocketAddr::V4(SocketAddrV4::new(v4.ip(), v4.port())));
    }
    s.as_sockaddr_in6().map(|v6| {
        SocketAddr::V6(SocketAddrV6::new(
            v6.ip(),
            v6.port(),
            v6.flowinfo(),
            v6.scope_id(),
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs in a namespace the test creates, so its datagrams never cross the machine's own
    /// loopback.
    #[test]
    #[ignore = "needs root"]
    fn a_datagram_reports_the_local_address_it_arrived_at_and_a_reply_leaves_from_it() {
        if !kp_test::netns::require_root() {
            return;
        }
        let ns = kp_test::netns::Netns::new("pktinfo").expect("a namespace of the test's own");
        kp_netlink::netns::run_in(ns.name(), "pktinfo", || {
            pktinfo_round_trip();
            Ok::<(), ()>(())
        })
        .expect("the test's thread ran in its namespace (a panic there is the test's failure)")
        .expect("no error");
    }

    fn pktinfo_round_trip() {
        let server = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        set_recv_pktinfo(&server, false).unwrap();
        let port = server.local_addr().unwrap().port();
        let client = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        client.send_to(b"ping", ("127.0.0.1", port)).unwrap();
        let mut buf = [0u8; 16];
        server
            .set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .unwrap();
        // Wait until the datagram is queued, then read it without blocking.
        let mut peek = [0u8; 1];
        server.peek_from(&mut peek).unwrap();
        let got = recv_with_local(&server, &mut buf).unwrap();
        assert_eq!(&buf[..got.len], b"ping");
        assert_eq!(got.peer, client.local_addr().unwrap());
        assert_eq!(got.local, "127.0.0.1".parse::<IpAddr>().unwrap());
        send_from(&server, b"pong", got.local, got.peer).unwrap();
        client
            .set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .unwrap();
        let (n, from) = client.recv_from(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"pong");
        assert_eq!(from, server.local_addr().unwrap());
    }
}
