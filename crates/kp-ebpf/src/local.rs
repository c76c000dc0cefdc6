//! The node's interface addresses, where NodePorts answer when `nodePortAddresses` is unset or
//! names CIDRs: read from the calling thread's network namespace's `/proc` files (no netlink
//! socket, no dependency): IPv4 from `fib_trie` (its `/32 host LOCAL` entries), IPv6 from
//! `if_inet6`. Loopback and IPv6 link-local addresses are left out (localhost NodePorts are off,
//! as in the nftables mode; a link-local address names no node).

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The local IPv4 addresses in `fib_trie`'s text: each `|-- ADDRESS` followed by a
/// `/32 host LOCAL` line, loopback excepted.
pub fn parse_fib_trie(text: &str) -> BTreeSet<Ipv4Addr> {
    let mut out = BTreeSet::new();
    let mut last: Option<Ipv4Addr> = None;
    for line in text.lines() {
        let line = line.trim();
        if let Some(addr) = line.strip_prefix("|-- ") {
            last = addr.trim().parse().ok();
        } else if line.starts_with('/') {
            let words: Vec<&str> = line.split_whitespace().collect();
            if let (["/32", "host", "LOCAL"], Some(a)) = (words.as_slice(), last) {
                if !a.is_loopback() {
                    out.insert(a);
                }
            }
        } else {
            last = None;
        }
    }
    out
}

/// The IPv6 addresses in `if_inet6`'s text (32 hex digits, then index, prefix length, scope,
/// flags, name), loopback and link-local excepted.
pub fn parse_if_inet6(text: &str) -> BTreeSet<Ipv6Addr> {
    text.lines()
        .filter_map(|line| {
            let hex = line.split_whitespace().next()?;
            let bits = u128::from_str_radix(hex, 16)
                .ok()
                .filter(|_| hex.len() == 32)?;
            let a = Ipv6Addr::from(bits);
            let link_local = (a.segments()[0] & 0xffc0) == 0xfe80;
            (!a.is_loopback() && !link_local).then_some(a)
        })
        .collect()
}

/// The calling thread's network namespace's addresses ([`parse_fib_trie`], [`parse_if_inet6`]);
/// a kernel without IPv6 has no `if_inet6`, and then no IPv6 address.
pub fn local_addresses() -> std::io::Result<Vec<IpAddr>> {
    let v4 = parse_fib_trie(&std::fs::read_to_string("/proc/thread-self/net/fib_trie")?);
    let v6 = match std::fs::read_to_string("/proc/thread-self/net/if_inet6") {
        Ok(text) => parse_if_inet6(&text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeSet::new(),
        Err(e) => return Err(e),
    };
    Ok(v4
        .into_iter()
        .map(IpAddr::V4)
        .chain(v6.into_iter().map(IpAddr::V6))
        .collect())
}

/// The calling thread's network namespace's interface names, from `/proc/thread-self/net/dev`.
pub fn interfaces() -> std::io::Result<Vec<String>> {
    Ok(parse_net_dev(&std::fs::read_to_string(
        "/proc/thread-self/net/dev",
    )?))
}

/// The interface names in `/proc/net/dev`'s text (two header lines, then `NAME: counters`).
pub fn parse_net_dev(text: &str) -> Vec<String> {
    text.lines()
        .skip(2)
        .filter_map(|l| l.split_once(':'))
        .map(|(name, _)| name.trim().to_string())
        .filter(|n| !n.is_empty())
        .collect()
}

/// The interfaces of the calling thread's network namespace's IPv4 default routes, from
/// `/proc/thread-self/net/route`: where traffic from outside the node arrives (its uplinks).
pub fn default_route_interfaces() -> std::io::Result<Vec<String>> {
    Ok(parse_default_routes(&std::fs::read_to_string(
        "/proc/thread-self/net/route",
    )?))
}

/// The interfaces of the default routes (destination and mask 0) in `/proc/net/route`'s text.
pub fn parse_default_routes(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        if let [dev, dest, _gw, _flags, _refs, _use, _metric, mask, ..] = f.as_slice() {
            if *dest == "00000000" && *mask == "00000000" && !out.iter().any(|d| d == dev) {
                out.push((*dev).to_string());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIB_TRIE: &str = "\
Main:
  +-- 0.0.0.0/0 3 0 5
     |-- 0.0.0.0
        /0 universe UNICAST
     +-- 127.0.0.0/8 2 0 2
        +-- 127.0.0.0/31 1 0 0
           |-- 127.0.0.0
              /8 host LOCAL
           |-- 127.0.0.1
              /32 host LOCAL
        |-- 127.255.255.255
           /32 link BROADCAST
     +-- 192.0.2.0/24 2 0 2
        +-- 192.0.2.0/30 2 0 2
           |-- 192.0.2.0
              /24 link UNICAST
           |-- 192.0.2.2
              /32 host LOCAL
        |-- 192.0.2.255
           /32 link BROADCAST
     |-- 10.244.1.1
        /32 link UNICAST
        /32 host LOCAL
Local:
  +-- 0.0.0.0/0 3 0 5
           |-- 192.0.2.2
              /32 host LOCAL
";

    #[test]
    fn fib_trie_gives_the_host_local_addresses_but_loopback() {
        let got: Vec<Ipv4Addr> = parse_fib_trie(FIB_TRIE).into_iter().collect();
        assert_eq!(
            got,
            [Ipv4Addr::new(10, 244, 1, 1), Ipv4Addr::new(192, 0, 2, 2)]
        );
    }

    #[test]
    fn if_inet6_gives_the_global_addresses() {
        let text = "\
fd000000000000000000000000000002 04 40 00 82     eth0
fe8000000000000000fc00fffe000001 04 40 20 80     eth0
00000000000000000000000000000001 01 80 10 80       lo
20010db8000000000000000000000001 05 40 00 80     eth1
";
        let got: Vec<Ipv6Addr> = parse_if_inet6(text).into_iter().collect();
        let want: Vec<Ipv6Addr> = ["2001:db8::1", "fd00::2"]
            .iter()
            .map(|s| s.parse().expect("address"))
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn net_dev_gives_the_interface_names() {
        let text = "\
Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets
    lo:    1234      10    0    0    0     0          0         0     1234      10
  eth0: 5678       20    0    0    0     0          0         0     5678      20
veth12:       0       0    0    0    0     0          0         0        0       0
";
        assert_eq!(parse_net_dev(text), ["lo", "eth0", "veth12"]);
    }

    #[test]
    fn the_default_routes_name_the_uplinks() {
        let text = "\
Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth0\t00000000\t0202000A\t0003\t0\t0\t0\t00000000\t0\t0\t0
eth0\t0002000A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
veth1\t0B01F40A\t00000000\t0005\t0\t0\t0\tFFFFFFFF\t0\t0\t0
";
        assert_eq!(parse_default_routes(text), ["eth0"]);
    }
}
