//! The requests' bytes, against layouts written out by hand from `ip_set.h`, `nfnetlink.h`
//! and `netlink.h` (and cross-checked against the kernel by kp-ipvs's `ipset_netlink` test).

use std::net::IpAddr;

use super::{error_name, nfproto, request, Command, Element};

/// Host-order (netlink's own fields, attribute headers) bytes.
fn h16(v: u16) -> [u8; 2] {
    v.to_ne_bytes()
}

fn h32(v: u32) -> [u8; 4] {
    v.to_ne_bytes()
}

/// Appends a byte layout piece by piece.
struct Layout(Vec<u8>);

impl Layout {
    fn new() -> Layout {
        Layout(Vec::new())
    }
    fn b(mut self, bytes: &[u8]) -> Layout {
        self.0.extend_from_slice(bytes);
        self
    }
    /// nlmsghdr: length, type, flags, seq, pid 0.
    fn header(self, len: u32, kind: u16, flags: u16, seq: u32) -> Layout {
        self.b(&h32(len))
            .b(&h16(kind))
            .b(&h16(flags))
            .b(&h32(seq))
            .b(&h32(0))
    }
    /// nlattr header: length (header included, padding excluded), type with flags.
    fn attr(self, len: u16, kind: u16) -> Layout {
        self.b(&h16(len)).b(&h16(kind))
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

// NLM_F_REQUEST 0x1 | NLM_F_ACK 0x4; NLA_F_NESTED 0x8000; NLA_F_NET_BYTEORDER 0x4000.
const FLAGS: u16 = 0x0005;

#[test]
fn add_ip_port_v4() {
    let mut buf = Vec::new();
    let e = Element {
        ip: Some(ip("10.96.0.10")),
        port: Some(80),
        proto: Some(6),
        ..Element::default()
    };
    request(
        &mut buf,
        Command::Add,
        nfproto(false),
        7,
        "KUBE-CLUSTER-IP",
        &e,
    );
    let want = Layout::new()
        // NFNL_SUBSYS_IPSET 6 << 8 | IPSET_CMD_ADD 9
        .header(80, 0x0609, FLAGS, 7)
        // nfgenmsg: NFPROTO_IPV4, NFNETLINK_V0, res_id 0
        .b(&[2, 0, 0, 0])
        // IPSET_ATTR_PROTOCOL (1) = IPSET_PROTOCOL 7, padded to 8
        .attr(5, 1)
        .b(&[7, 0, 0, 0])
        // IPSET_ATTR_SETNAME (2): 15 bytes and a NUL
        .attr(20, 2)
        .b(b"KUBE-CLUSTER-IP\0")
        // IPSET_ATTR_DATA (7), nested
        .attr(32, 0x8007)
        // IPSET_ATTR_IP (1), nested: IPSET_ATTR_IPADDR_IPV4 (1), network order
        .attr(12, 0x8001)
        .attr(8, 0x4001)
        .b(&[10, 96, 0, 10])
        // IPSET_ATTR_PORT (4), network order, padded
        .attr(6, 0x4004)
        .b(&[0, 80, 0, 0])
        // IPSET_ATTR_PROTO (7) = IPPROTO_TCP
        .attr(5, 7)
        .b(&[6, 0, 0, 0]);
    assert_eq!(buf, want.0);
}

#[test]
fn del_ip_port_net_v6_with_the_longest_name() {
    let mut buf = Vec::new();
    let e = Element {
        ip: Some(ip("fd00::1")),
        port: Some(0x1234),
        proto: Some(17),
        ip2: Some(ip("2001:db8::")),
        cidr2: Some(32),
    };
    let name = "KUBE-6-LOAD-BALANCER-SOURCE-CID";
    assert_eq!(name.len(), 31);
    request(&mut buf, Command::Del, nfproto(true), 9, name, &e);
    let mut v6a = [0u8; 16];
    v6a[0] = 0xfd;
    v6a[15] = 1;
    let mut v6b = [0u8; 16];
    v6b[..4].copy_from_slice(&[0x20, 0x01, 0x0d, 0xb8]);
    let want = Layout::new()
        // IPSET_CMD_DEL 10
        .header(140, 0x060a, FLAGS, 9)
        // NFPROTO_IPV6
        .b(&[10, 0, 0, 0])
        .attr(5, 1)
        .b(&[7, 0, 0, 0])
        // 31 bytes and a NUL: no padding
        .attr(36, 2)
        .b(name.as_bytes())
        .b(&[0])
        .attr(76, 0x8007)
        // IPSET_ATTR_IP: IPSET_ATTR_IPADDR_IPV6 (2)
        .attr(24, 0x8001)
        .attr(20, 0x4002)
        .b(&v6a)
        .attr(6, 0x4004)
        .b(&[0x12, 0x34, 0, 0])
        .attr(5, 7)
        .b(&[17, 0, 0, 0])
        // IPSET_ATTR_IP2 (20), nested
        .attr(24, 0x8014)
        .attr(20, 0x4002)
        .b(&v6b)
        // IPSET_ATTR_CIDR2 (21)
        .attr(5, 21)
        .b(&[32, 0, 0, 0]);
    assert_eq!(buf, want.0);
}

#[test]
fn add_port_and_ip_and_ip_port_ip() {
    // bitmap:port: the port alone.
    let mut buf = Vec::new();
    let e = Element {
        port: Some(30080),
        ..Element::default()
    };
    request(&mut buf, Command::Add, 2, 1, "KUBE-NODE-PORT-TCP", &e);
    let want = Layout::new()
        .header(64, 0x0609, FLAGS, 1)
        .b(&[2, 0, 0, 0])
        .attr(5, 1)
        .b(&[7, 0, 0, 0])
        // 18 bytes and a NUL, padded to 24
        .attr(23, 2)
        .b(b"KUBE-NODE-PORT-TCP\0\0")
        .attr(12, 0x8007)
        .attr(6, 0x4004)
        .b(&30080u16.to_be_bytes())
        .b(&[0, 0]);
    assert_eq!(buf, want.0);

    // hash:ip: the address alone.
    let mut buf = Vec::new();
    let e = Element {
        ip: Some(ip("192.0.2.7")),
        ..Element::default()
    };
    request(&mut buf, Command::Add, 2, 2, "KUBE-IPVS-IPS", &e);
    let want = Layout::new()
        .header(64, 0x0609, FLAGS, 2)
        .b(&[2, 0, 0, 0])
        .attr(5, 1)
        .b(&[7, 0, 0, 0])
        // 13 bytes and a NUL, padded to 16
        .attr(18, 2)
        .b(b"KUBE-IPVS-IPS\0\0\0")
        .attr(16, 0x8007)
        .attr(12, 0x8001)
        .attr(8, 0x4001)
        .b(&[192, 0, 2, 7]);
    assert_eq!(buf, want.0);

    // hash:ip,port,ip: address, port, protocol, second address.
    let mut buf = Vec::new();
    let e = Element {
        ip: Some(ip("10.0.0.5")),
        port: Some(8080),
        proto: Some(132),
        ip2: Some(ip("10.0.0.5")),
        cidr2: None,
    };
    request(&mut buf, Command::Del, 2, 3, "KUBE-LOOP-BACK", &e);
    let want = Layout::new()
        .header(92, 0x060a, FLAGS, 3)
        .b(&[2, 0, 0, 0])
        .attr(5, 1)
        .b(&[7, 0, 0, 0])
        // 14 bytes and a NUL, padded to 16
        .attr(19, 2)
        .b(b"KUBE-LOOP-BACK\0\0")
        .attr(44, 0x8007)
        .attr(12, 0x8001)
        .attr(8, 0x4001)
        .b(&[10, 0, 0, 5])
        .attr(6, 0x4004)
        .b(&[0x1f, 0x90, 0, 0])
        .attr(5, 7)
        .b(&[132, 0, 0, 0])
        .attr(12, 0x8014)
        .attr(8, 0x4001)
        .b(&[10, 0, 0, 5]);
    assert_eq!(buf, want.0);
}

#[test]
fn pipelined_requests_frame_as_separate_messages() {
    let mut buf = Vec::new();
    let e = Element {
        port: Some(1),
        ..Element::default()
    };
    request(&mut buf, Command::Add, 2, 10, "A", &e);
    request(&mut buf, Command::Del, 2, 11, "B", &e);
    let got: Vec<_> = crate::messages(&buf)
        .map(|m| {
            let m = m.unwrap();
            (m.seq(), m.kind())
        })
        .collect();
    assert_eq!(got, [(10, 0x0609), (11, 0x060a)]);
}

#[test]
fn ipset_errnos_are_named() {
    assert_eq!(error_name(4097), Some("IPSET_ERR_PROTOCOL"));
    assert_eq!(error_name(4103), Some("IPSET_ERR_EXIST"));
    assert_eq!(error_name(4114), Some("IPSET_ERR_SKBINFO"));
    assert_eq!(error_name(4352), Some("IPSET_ERR_HASH_FULL"));
    assert_eq!(error_name(4357), Some("IPSET_ERR_HASH_RANGE"));
    assert_eq!(error_name(2), None);
    assert_eq!(error_name(4115), None);
}
