//! IPVS messages: requests laid out byte by byte from `ip_vs.h` and `ip_vs_ctl.c`'s policy, the
//! kernel's dump answers read back, and every writer's nest read back into what was written.
//! Host byte order is x86_64's (little-endian).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::abi::*;
use super::*;
use crate::abi::{NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST};
use crate::messages;
use crate::tests::bytes;

const FAMILY: u16 = 0x24;

fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(a, b, c, d))
}

fn cluster_ip_http() -> Service {
    Service::new(
        ServiceKey::Addr {
            addr: v4(10, 96, 0, 10),
            protocol: Protocol::Tcp,
            port: 80,
        },
        "rr",
    )
}

/// The one message of `buf`, its `genlmsghdr` and the payload of its first-level attribute
/// `kind`.
fn nest_of(buf: &[u8], kind: u16) -> (Message<'_>, GenlHeader, &[u8]) {
    let all: Vec<_> = messages(buf).collect::<Result<_, _>>().expect("frames");
    assert_eq!(all.len(), 1);
    let (header, body) = GenlHeader::parse(all[0].payload).expect("genlmsghdr");
    let nest = attr::attrs(body)
        .map(|a| a.expect("attribute"))
        .find(|a| a.kind == kind)
        .expect("the nest")
        .payload;
    (all[0], header, nest)
}

#[test]
fn adding_a_tcp_service_sends_what_ipvsadm_sends() {
    let mut out = Vec::new();
    new_service(&mut out, FAMILY, 5, &cluster_ip_http());
    let want = bytes(
        "\
        68000000 2400 0500 05000000 00000000   nlmsghdr: len 104, IPVS's id, REQUEST|ACK, seq 5
        01 01 0000                             genlmsghdr: IPVS_CMD_NEW_SERVICE, version 1
        5400 0100                              IPVS_CMD_ATTR_SERVICE, 84 bytes, not flagged nested
          0600 0100 0200 0000                  IPVS_SVC_ATTR_AF AF_INET
          0600 0200 0600 0000                  IPVS_SVC_ATTR_PROTOCOL IPPROTO_TCP
          1400 0300 0a60000a 00000000 00000000 00000000   IPVS_SVC_ATTR_ADDR 10.96.0.10, nf_inet_addr
          0600 0400 0050 0000                  IPVS_SVC_ATTR_PORT 80, network order
          0700 0600 727200 00                  IPVS_SVC_ATTR_SCHED_NAME \"rr\"
          0c00 0700 00000000 ffffffff          IPVS_SVC_ATTR_FLAGS: flags 0, mask all
          0800 0800 00000000                   IPVS_SVC_ATTR_TIMEOUT 0
          0800 0900 ffffffff                   IPVS_SVC_ATTR_NETMASK /32",
    );
    assert_eq!(out, want);
}

#[test]
fn adding_a_destination_names_its_service_by_key_and_sends_every_setting() {
    let mut out = Vec::new();
    let key = cluster_ip_http().key;
    new_dest(
        &mut out,
        FAMILY,
        6,
        &key,
        &Destination::masquerade(v4(10, 244, 1, 5), 8080, 1),
    );
    let want = bytes(
        "\
        8c000000 2400 0500 06000000 00000000   nlmsghdr: len 140, REQUEST|ACK, seq 6
        05 01 0000                             IPVS_CMD_NEW_DEST, version 1
        3000 0100                              IPVS_CMD_ATTR_SERVICE, key only, 48 bytes
          0600 0100 0200 0000                  AF_INET
          0600 0200 0600 0000                  IPPROTO_TCP
          1400 0300 0a60000a 00000000 00000000 00000000   10.96.0.10
          0600 0400 0050 0000                  port 80
        4800 0200                              IPVS_CMD_ATTR_DEST, 72 bytes
          1400 0100 0af40105 00000000 00000000 00000000   IPVS_DEST_ATTR_ADDR 10.244.1.5
          0600 0200 1f90 0000                  IPVS_DEST_ATTR_PORT 8080, network order
          0800 0300 00000000                   IPVS_DEST_ATTR_FWD_METHOD IP_VS_CONN_F_MASQ
          0800 0400 01000000                   IPVS_DEST_ATTR_WEIGHT 1
          0800 0500 00000000                   IPVS_DEST_ATTR_U_THRESH 0
          0800 0600 00000000                   IPVS_DEST_ATTR_L_THRESH 0
          0600 0b00 0200 0000                  IPVS_DEST_ATTR_ADDR_FAMILY AF_INET",
    );
    assert_eq!(out, want);
}

#[test]
fn deleting_a_destination_sends_only_its_address_and_port() {
    let mut out = Vec::new();
    let key = cluster_ip_http().key;
    del_dest(&mut out, FAMILY, 7, &key, v4(10, 244, 1, 5), 8080);
    let (m, header, nest) = nest_of(&out, IPVS_CMD_ATTR_DEST);
    assert_eq!(header.cmd, IPVS_CMD_DEL_DEST);
    assert_eq!(m.header.flags, NLM_F_REQUEST | NLM_F_ACK);
    let kinds: Vec<u16> = attr::attrs(nest).map(|a| a.expect("attr").kind).collect();
    assert_eq!(kinds, [IPVS_DEST_ATTR_ADDR, IPVS_DEST_ATTR_PORT]);
}

#[test]
fn dumps_are_flagged_dump_and_a_destination_dump_names_its_service() {
    let mut out = Vec::new();
    get_services(&mut out, FAMILY, 1);
    let all: Vec<_> = messages(&out).collect::<Result<_, _>>().expect("frames");
    assert_eq!(all[0].header.flags, NLM_F_REQUEST | NLM_F_DUMP);
    assert_eq!(all[0].payload, [IPVS_CMD_GET_SERVICE, 1, 0, 0]);

    let mut out = Vec::new();
    let key = cluster_ip_http().key;
    get_dests(&mut out, FAMILY, 2, &key);
    let (m, header, nest) = nest_of(&out, IPVS_CMD_ATTR_SERVICE);
    assert_eq!(m.header.flags, NLM_F_REQUEST | NLM_F_DUMP);
    assert_eq!(header.cmd, IPVS_CMD_GET_DEST);
    let svc_attrs: [Option<&[u8]>; 13] = attr::table(nest).expect("attrs");
    assert_eq!(
        svc_attrs[usize::from(IPVS_SVC_ATTR_PORT)],
        Some(&[0, 80][..])
    );
    assert_eq!(svc_attrs[usize::from(IPVS_SVC_ATTR_SCHED_NAME)], None);
}

#[test]
fn every_kind_of_service_reads_back_as_written() {
    let mut persistent_v6 = Service::new(
        ServiceKey::Addr {
            addr: IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x10)),
            protocol: Protocol::Udp,
            port: 53,
        },
        "sh",
    );
    persistent_v6.flags = IP_VS_SVC_F_PERSISTENT | IP_VS_SVC_F_SCHED_SH_PORT;
    persistent_v6.timeout = 10800;
    let sctp = Service::new(
        ServiceKey::Addr {
            addr: v4(192, 168, 0, 1),
            protocol: Protocol::Sctp,
            port: 30000,
        },
        "wlc",
    );
    let fwmark = Service::new(
        ServiceKey::Fwmark {
            mark: 0x4000,
            ipv6: false,
        },
        "lc",
    );
    assert_eq!(persistent_v6.netmask, 128);
    for svc in [cluster_ip_http(), persistent_v6, sctp, fwmark] {
        for write in [new_service, set_service] {
            let mut out = Vec::new();
            write(&mut out, FAMILY, 1, &svc);
            let (_, _, nest) = nest_of(&out, IPVS_CMD_ATTR_SERVICE);
            assert_eq!(read_service(nest).as_ref(), Ok(&svc));
        }
    }
}

#[test]
fn every_kind_of_destination_reads_back_as_written() {
    let v6 = IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 1, 7));
    let mut drained = Destination::masquerade(v4(10, 244, 2, 9), 443, 0);
    drained.upper_threshold = 100;
    drained.lower_threshold = 10;
    let mut tunnel = Destination::masquerade(v6, 8443, 3);
    tunnel.forward = Forward::Tunnel;
    let key = cluster_ip_http().key;
    for dest in [drained, tunnel] {
        for write in [new_dest, set_dest] {
            let mut out = Vec::new();
            write(&mut out, FAMILY, 1, &key, &dest);
            let (_, _, nest) = nest_of(&out, IPVS_CMD_ATTR_DEST);
            // The family travels with the destination, so the service's does not decide it.
            let state = read_destination(nest, false).expect("destination");
            assert_eq!(state.destination, dest);
            assert_eq!(state.active_connections, 0);
        }
    }
}

/// Captured from Debian's Linux 6.1 (booted by kp-vm): the dump answer for a service this
/// module's `new_service` added as `TCP 10.96.0.10:83`, scheduler `sh`, flags
/// `IP_VS_SVC_F_PERSISTENT | IP_VS_SVC_F_SCHED_SH_PORT`, timeout 10800. The kernel adds
/// `IP_VS_SVC_F_HASHED` and two statistics nests.
const KERNEL_SERVICE: &str = "\
40010000 2000 0200 01000000 c6297c8d   nlmsghdr: len 320, IPVS (0x20 there), NLM_F_MULTI, seq 1
01 01 0000                             IPVS_CMD_NEW_SERVICE, version 1
2c01 0100                              IPVS_CMD_ATTR_SERVICE, 300 bytes, not flagged nested
  0600 0100 0200 0000                  IPVS_SVC_ATTR_AF AF_INET
  0600 0200 0600 0000                  IPVS_SVC_ATTR_PROTOCOL IPPROTO_TCP
  1400 0300 0a60000a 00000000 00000000 00000000   IPVS_SVC_ATTR_ADDR 10.96.0.10
  0600 0400 0053 0000                  IPVS_SVC_ATTR_PORT 83
  0700 0600 736800 00                  IPVS_SVC_ATTR_SCHED_NAME \"sh\"
  0c00 0700 13000000 ffffffff          IPVS_SVC_ATTR_FLAGS PERSISTENT|HASHED|SCHED_SH_PORT, mask
  0800 0800 302a0000                   IPVS_SVC_ATTR_TIMEOUT 10800
  0800 0900 ffffffff                   IPVS_SVC_ATTR_NETMASK
  5c00 0a00                            IPVS_SVC_ATTR_STATS, 92 bytes: all zero
    0800 0100 00000000 0800 0200 00000000 0800 0300 00000000   CONNS, INPKTS, OUTPKTS (u32)
    0c00 0400 00000000 00000000 0c00 0500 00000000 00000000   INBYTES, OUTBYTES (u64)
    0800 0600 00000000 0800 0700 00000000 0800 0800 00000000   CPS, INPPS, OUTPPS
    0800 0900 00000000 0800 0a00 00000000                      INBPS, OUTBPS
  7c00 0c00                            IPVS_SVC_ATTR_STATS64, 124 bytes: ten u64, all zero
    0c00 0100 00000000 00000000 0c00 0200 00000000 00000000   CONNS, INPKTS
    0c00 0300 00000000 00000000 0c00 0400 00000000 00000000   OUTPKTS, INBYTES
    0c00 0500 00000000 00000000 0c00 0600 00000000 00000000   OUTBYTES, CPS
    0c00 0700 00000000 00000000 0c00 0800 00000000 00000000   INPPS, OUTPPS
    0c00 0900 00000000 00000000 0c00 0a00 00000000 00000000   INBPS, OUTBPS";

/// Captured with the service above: the dump answer for its destination 10.244.1.5:8080,
/// added by `new_dest` (masqueraded, weight 1). Linux 6.1 also reports the tunnel settings
/// and the address family.
const KERNEL_DEST: &str = "\
64010000 2000 0200 02000000 3d82ec87   nlmsghdr: len 356, NLM_F_MULTI, seq 2
05 01 0000                             IPVS_CMD_NEW_DEST, version 1
5001 0200                              IPVS_CMD_ATTR_DEST, 336 bytes
  1400 0100 0af40105 00000000 00000000 00000000   IPVS_DEST_ATTR_ADDR 10.244.1.5
  0600 0200 1f90 0000                  IPVS_DEST_ATTR_PORT 8080
  0800 0300 00000000                   IPVS_DEST_ATTR_FWD_METHOD IP_VS_CONN_F_MASQ
  0800 0400 01000000                   IPVS_DEST_ATTR_WEIGHT 1
  0500 0d00 00 000000                  IPVS_DEST_ATTR_TUN_TYPE 0
  0600 0e00 0000 0000                  IPVS_DEST_ATTR_TUN_PORT 0
  0600 0f00 0000 0000                  IPVS_DEST_ATTR_TUN_FLAGS 0
  0800 0500 00000000                   IPVS_DEST_ATTR_U_THRESH 0
  0800 0600 00000000                   IPVS_DEST_ATTR_L_THRESH 0
  0800 0700 00000000                   IPVS_DEST_ATTR_ACTIVE_CONNS 0
  0800 0800 00000000                   IPVS_DEST_ATTR_INACT_CONNS 0
  0800 0900 00000000                   IPVS_DEST_ATTR_PERSIST_CONNS 0
  0600 0b00 0200 0000                  IPVS_DEST_ATTR_ADDR_FAMILY AF_INET
  5c00 0a00                            IPVS_DEST_ATTR_STATS, 92 bytes: all zero
    0800 0100 00000000 0800 0200 00000000 0800 0300 00000000   CONNS, INPKTS, OUTPKTS (u32)
    0c00 0400 00000000 00000000 0c00 0500 00000000 00000000   INBYTES, OUTBYTES (u64)
    0800 0600 00000000 0800 0700 00000000 0800 0800 00000000   CPS, INPPS, OUTPPS
    0800 0900 00000000 0800 0a00 00000000                      INBPS, OUTBPS
  7c00 0c00                            IPVS_DEST_ATTR_STATS64, 124 bytes: ten u64, all zero
    0c00 0100 00000000 00000000 0c00 0200 00000000 00000000   CONNS, INPKTS
    0c00 0300 00000000 00000000 0c00 0400 00000000 00000000   OUTPKTS, INBYTES
    0c00 0500 00000000 00000000 0c00 0600 00000000 00000000   OUTBYTES, CPS
    0c00 0700 00000000 00000000 0c00 0800 00000000 00000000   INPPS, OUTPPS
    0c00 0900 00000000 00000000 0c00 0a00 00000000 00000000   INBPS, OUTBPS";

#[test]
fn the_kernel_s_service_dump_reads_back_as_the_service_that_was_added() {
    let raw = bytes(KERNEL_SERVICE);
    assert_eq!(raw.len(), 320);
    let all: Vec<_> = messages(&raw).collect::<Result<_, _>>().expect("frames");
    assert!(all[0].is_multipart());
    let mut want = Service::new(
        ServiceKey::Addr {
            addr: v4(10, 96, 0, 10),
            protocol: Protocol::Tcp,
            port: 83,
        },
        "sh",
    );
    want.flags = IP_VS_SVC_F_PERSISTENT | IP_VS_SVC_F_SCHED_SH_PORT;
    want.timeout = 10800;
    assert_eq!(parse_service(&all[0]), Ok(want));
    assert!(
        parse_destination(&all[0], false).is_err(),
        "a service is no destination"
    );
}

#[test]
fn the_kernel_s_destination_dump_reads_back_as_the_destination_that_was_added() {
    let raw = bytes(KERNEL_DEST);
    assert_eq!(raw.len(), 356);
    let all: Vec<_> = messages(&raw).collect::<Result<_, _>>().expect("frames");
    assert_eq!(
        parse_destination(&all[0], false),
        Ok(DestinationState {
            destination: Destination::masquerade(v4(10, 244, 1, 5), 8080, 1),
            active_connections: 0,
            inactive_connections: 0,
            persistent_connections: 0,
        })
    );
}

/// A kernel's `IPVS_CMD_NEW_DEST` dump answer without `IPVS_DEST_ATTR_ADDR_FAMILY` (before
/// Linux 4.4), with two active and one inactive connection, and its statistics nest.
const OLD_KERNEL_DEST: &str = "\
78000000 2400 0200 09000000 00000000   nlmsghdr: len 120, NLM_F_MULTI, seq 9
05 01 0000                             IPVS_CMD_NEW_DEST
6400 0200                              IPVS_CMD_ATTR_DEST
  1400 0100 fd000000 00000000 00000000 00000005   IPVS_DEST_ATTR_ADDR fd00::5
  0600 0200 1f90 0000                  port 8080
  0800 0300 00000000                   masquerade
  0800 0400 02000000                   weight 2
  0800 0500 00000000                   upper threshold 0
  0800 0600 00000000                   lower threshold 0
  0800 0700 02000000                   IPVS_DEST_ATTR_ACTIVE_CONNS 2
  0800 0800 01000000                   IPVS_DEST_ATTR_INACT_CONNS 1
  0800 0900 00000000                   IPVS_DEST_ATTR_PERSIST_CONNS 0
  0c00 0a00                            IPVS_DEST_ATTR_STATS
    0800 0100 03000000                 IPVS_STATS_ATTR_CONNS 3";

#[test]
fn a_destination_without_its_family_takes_the_services() {
    let raw = bytes(OLD_KERNEL_DEST);
    let all: Vec<_> = messages(&raw).collect::<Result<_, _>>().expect("frames");
    let state = parse_destination(&all[0], true).expect("destination");
    assert_eq!(
        state,
        DestinationState {
            destination: Destination::masquerade(
                IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 5)),
                8080,
                2
            ),
            active_connections: 2,
            inactive_connections: 1,
            persistent_connections: 0,
        }
    );
    // Read as an IPv4 service's, the 16 bytes are not an IPv4 address's.
    let as_v4 = parse_destination(&all[0], false).expect("destination");
    assert_ne!(as_v4.destination.addr, state.destination.addr);
    // And it is not a service.
    assert!(parse_service(&all[0]).is_err());
}

#[test]
fn the_kernel_s_hashed_flag_is_not_part_of_a_dumped_service() {
    let mut out = Vec::new();
    let mut svc = cluster_ip_http();
    svc.flags = IP_VS_SVC_F_PERSISTENT | IP_VS_SVC_F_HASHED;
    new_service(&mut out, FAMILY, 1, &svc);
    let (_, _, nest) = nest_of(&out, IPVS_CMD_ATTR_SERVICE);
    assert_eq!(
        read_service(nest).map(|s| s.flags),
        Ok(IP_VS_SVC_F_PERSISTENT)
    );
}

#[test]
fn an_unknown_protocol_or_a_short_address_is_malformed() {
    let mut nest = Vec::new();
    attr::put_u16(&mut nest, IPVS_SVC_ATTR_AF, AF_INET);
    attr::put_u16(&mut nest, IPVS_SVC_ATTR_PROTOCOL, 47);
    attr::put(&mut nest, IPVS_SVC_ATTR_ADDR, &[10, 0, 0, 1]);
    attr::put_be16(&mut nest, IPVS_SVC_ATTR_PORT, 80);
    attr::put_str(&mut nest, IPVS_SVC_ATTR_SCHED_NAME, "rr");
    let err = read_service(&nest).expect_err("GRE is no IPVS protocol");
    assert!(err.0.contains("protocol 47"), "{err}");

    let mut nest = Vec::new();
    attr::put_u16(&mut nest, IPVS_SVC_ATTR_AF, AF_INET6);
    attr::put_u16(&mut nest, IPVS_SVC_ATTR_PROTOCOL, IPPROTO_TCP);
    attr::put(&mut nest, IPVS_SVC_ATTR_ADDR, &[0xfd, 0, 0, 1]);
    attr::put_be16(&mut nest, IPVS_SVC_ATTR_PORT, 80);
    attr::put_str(&mut nest, IPVS_SVC_ATTR_SCHED_NAME, "rr");
    let err = read_service(&nest).expect_err("4 bytes are no IPv6 address");
    assert!(err.0.contains("IPv6"), "{err}");
}

#[test]
fn the_info_answer_reads_version_and_table_size() {
    let raw = bytes(
        "\
        24000000 2400 0000 03000000 00000000   nlmsghdr: len 36, seq 3
        0e 01 0000                             IPVS_CMD_SET_INFO (the answer to GET_INFO)
        0800 0100 01020100                     IPVS_INFO_ATTR_VERSION 0x010201 (1.2.1)
        0800 0200 00100000                     IPVS_INFO_ATTR_CONN_TAB_SIZE 4096",
    );
    let all: Vec<_> = messages(&raw).collect::<Result<_, _>>().expect("frames");
    assert_eq!(
        parse_info(&all[0]),
        Ok(Info {
            version: 0x010201,
            connection_table_size: 4096
        })
    );
    let mut out = Vec::new();
    get_info(&mut out, FAMILY, 3);
    let all: Vec<_> = messages(&out).collect::<Result<_, _>>().expect("frames");
    assert_eq!(all[0].payload, [IPVS_CMD_GET_INFO, 1, 0, 0]);
}

#[test]
fn services_are_named_as_ipvsadm_lists_them() {
    assert_eq!(cluster_ip_http().key.to_string(), "TCP 10.96.0.10:80");
    let v6 = ServiceKey::Addr {
        addr: IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1)),
        protocol: Protocol::Udp,
        port: 53,
    };
    assert_eq!(v6.to_string(), "UDP [fd00::1]:53");
}
