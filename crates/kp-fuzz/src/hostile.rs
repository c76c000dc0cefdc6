//! The hostile values the generator injects, and the marker that gives them away.
//!
//! # The marker
//!
//! Every hostile string carries [`MARKER`]. After rendering, no rule, set element, netlink
//! batch or planner error may contain it ([`smuggled`]): finding it means a field an object's
//! author chose reached rule text without being validated.
//!
//! A field may legitimately reach rule text only once validated, and the fields that do are
//! names (namespace, Service name and port name, in iptables comments: RFC 1123 DNS labels of
//! `[a-z0-9-]`), addresses and CIDRs (parsed into `IpAddr`/`IpNet` and printed back by std),
//! ports (integers) and protocols (one of three words). So the marker is built to fail every one
//! of those: it holds `_` and upper-case letters, which no DNS label or subdomain admits, and
//! letters no address parser reads as part of an address. A marker of lower-case letters and
//! digits would be a valid Service name, and a Service legitimately named after it would be a
//! false alarm in every iptables comment.
//!
//! The check looks for the marker's core, [`MARKER_CORE`], case-insensitively, so a renderer
//! that lower-cased a field or escaped its `_` would still be caught. Legitimate rule text never
//! holds the word: chain and set names are fixed words, numbers, or base32 hashes of 16
//! characters (`[A-Z2-7]`, where spelling `SMUGGLED` is a one-in-10^11 event per chain);
//! addresses, ports and protocols cannot spell it; and the generator's valid names come from a
//! pool that does not contain it.
//!
//! A rejected object's log line is a different case: it names the offending value on purpose
//! (quoted and escaped, `invalid metadata.name "web\nZq_SMUGGLED_9"`), so the marker may appear
//! there. What must not is a control character that would end the line or drive a terminal;
//! that is what the harness checks for log lines.

use crate::rng::Rng;

/// The token every hostile string carries.
pub const MARKER: &str = "Zq_SMUGGLED_9";

/// What [`smuggled`] looks for, lower-case.
pub const MARKER_CORE: &str = "smuggled";

/// Whether `text` holds the marker (in any case).
pub fn smuggled(text: &str) -> bool {
    smuggled_bytes(text.as_bytes())
}

/// Whether raw bytes (a netlink batch) hold the marker (in any ASCII case).
pub fn smuggled_bytes(bytes: &[u8]) -> bool {
    // Compared window by window ignoring ASCII case, rather than lower-casing a copy of a
    // rendered table that may be megabytes long.
    let core = MARKER_CORE.as_bytes();
    bytes.len() >= core.len()
        && bytes
            .windows(core.len())
            .any(|w| w.eq_ignore_ascii_case(core))
}

/// Shapes of hostile strings; `{}` is replaced by [`MARKER`]. Each tries a different way out of
/// the field it is put in: a new line or statement in nft or iptables-restore input, a quote or
/// brace that closes what the renderer opened, a comment, a forged log line, terminal escapes,
/// Unicode that looks like ASCII, and lengths past every buffer.
const SHAPES: &[&str] = &[
    "{}",
    "web\n{}",
    "{}\n",
    "web\"; {} flush ruleset; #",
    "\"{}\"",
    "x -j ACCEPT {}",
    "-j ACCEPT --comment {}",
    "} {} {",
    "}\nflush ruleset\n{}",
    "{}; add rule ip kube-proxy services accept",
    "# {}",
    "{} #",
    "a\r{}",
    "\u{0}{}",
    "{}\u{0}",
    "\u{1b}[2J{}",
    "{}\u{7f}",
    "{}\u{85}next",
    "\t{}\t",
    "web\\n{}",
    "web' {} '",
    "\u{202e}{}",
    "w\u{200b}eb{}",
    "ωeb-{}",
    "wеb{}",
    "{}.example.com",
    "{}-",
    "-{}",
    "web.{}",
    "10.96.0.1 {}",
    "10.96.0.1\n{}",
    "10.96.0.1/32 {}",
    "fe80::1%{}",
    "80; {}",
    "TCP {}",
    "tcp{}",
    "*/ {} /*",
    "$(reboot){}",
    "`{}`",
    "{}\u{2028}",
    "\u{feff}{}",
];

/// A hostile string: a shape around the marker, sometimes repeated past every length limit.
pub fn string(rng: &mut Rng) -> String {
    let shape = *rng.pick(SHAPES);
    let s = shape.replace("{}", MARKER);
    match rng.below(12) {
        // Past DNS label (63), subdomain (253), iptables comment (255) and chain name limits.
        0 => s.repeat(1 + rng.below(40)),
        // Past the iptables-restore line buffer (10240 bytes) and a netlink message.
        1 if rng.chance(1, 8) => s.repeat(6000),
        _ => s,
    }
}

/// Addresses that parse but are special (refused for Service and endpoint addresses), that look
/// like addresses but do not parse, or that parse only in a form a renderer might print
/// differently. Injected into address fields with a marker-free value, so they test validation
/// and rendering of odd addresses rather than smuggling.
pub const ODD_ADDRESSES: &[&str] = &[
    "127.0.0.1",
    "127.1.2.3",
    "0.0.0.0",
    "0.1.2.3",
    "255.255.255.255",
    "224.0.0.1",
    "239.255.255.250",
    "169.254.169.254",
    "240.0.0.1",
    "100.64.0.1",
    "10.255.255.255",
    "10.96.0.0",
    "::",
    "::1",
    "::2",
    "::ffff:1.2.3.4",
    "::ffff:10.96.0.10",
    "::1.2.3.4",
    "::102:304",
    "64:ff9b::1.2.3.4",
    "2002:c000:0204::1",
    "fe80::1",
    "fe80::1%eth0",
    "febf::1",
    "fec0::1",
    "ff02::1",
    "ff05::1:3",
    "2001:db8::",
    "2001:0db8:0000:0000:0000:0000:0000:0001",
    "fd00:10:96::a",
    "FD00:10:96::B",
    "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
    "10.96.0.010",
    "010.96.0.10",
    "0x0a.96.0.10",
    "10.96.0",
    "10.96.0.10.",
    "10.96.0.256",
    "1.2.3.4/32",
    " 10.96.0.10",
    "10.96.0.10 ",
    "10.96.0.10\n",
    "",
    "None",
    "none",
    "localhost",
    "::ffff:0:0",
    "1::",
    "1:2:3:4:5:6:7:8",
    "1:2:3:4:5:6:7:8:9",
    ":::",
    "[::1]",
    "[2001:db8::1]:80",
    "10.96.0.10:80",
];

/// CIDRs for source ranges, pod CIDRs and ServiceCIDRs: host bits set, zero and full prefixes,
/// special ranges, prefixes out of range, and spellings that do not parse.
pub const ODD_CIDRS: &[&str] = &[
    "0.0.0.0/0",
    "::/0",
    "0.0.0.0/1",
    "128.0.0.0/1",
    "::/1",
    "8000::/1",
    "10.0.0.1/8",
    "10.96.0.10/32",
    "10.96.0.0/33",
    "fd00::/129",
    "10.96.0.0/-1",
    "10.96.0.0/",
    "/16",
    "10.96.0.0",
    "10.96.0.0/16 ",
    " 10.96.0.0/16",
    "10.96.0.0/016",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "224.0.0.0/4",
    "255.255.255.255/32",
    "fe80::/10",
    "ff00::/8",
    "::ffff:0:0/96",
    "::1/128",
    "::/128",
    "192.0.0.0/3",
    "1.0.0.0/8",
    "100.64.0.0/10",
    "2001:db8::/32",
    "fd00:10:96::/112",
    "fd00:10:96::/64",
    "::1.2.3.0/120",
    "10.96.0.0/255.255.0.0",
    "10.96.0.0/16/16",
    "",
];

/// Integers for ports, NodePorts, timeouts: the edges of every range a field has, and far
/// beyond. Given as JSON numbers (and sometimes as strings or floats by the caller).
pub const ODD_INTEGERS: &[i64] = &[
    0,
    1,
    -1,
    2,
    79,
    80,
    443,
    1023,
    1024,
    30000,
    32767,
    32768,
    65534,
    65535,
    65536,
    65537,
    86399,
    86400,
    86401,
    99999,
    i16::MAX as i64,
    i16::MIN as i64,
    u16::MAX as i64 + 1,
    i32::MAX as i64,
    i32::MIN as i64,
    i32::MAX as i64 + 1,
    u32::MAX as i64,
    i64::MAX,
    i64::MIN,
];

/// Protocol spellings, valid and not.
pub const ODD_PROTOCOLS: &[&str] = &[
    "TCP", "UDP", "SCTP", "tcp", "udp", "sctp", "Tcp", "ICMP", "ALL", "", "TCP ", "DCCP", "all",
];

/// Service types and policies, valid and not.
pub const ODD_WORDS: &[&str] = &[
    "ClusterIP",
    "NodePort",
    "LoadBalancer",
    "ExternalName",
    "clusterip",
    "Local",
    "Cluster",
    "local",
    "ClientIP",
    "None",
    "VIP",
    "Proxy",
    "",
    "IPv4",
    "IPv6",
    "FQDN",
    "ipv4",
    "InternalIP",
    "ExternalIP",
    "Hostname",
    "SingleStack",
    "PreferDualStack",
    "RequireDualStack",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shape_carries_the_marker_and_no_valid_name_can() {
        let mut rng = Rng::new(1);
        for _ in 0..500 {
            let s = string(&mut rng);
            assert!(smuggled(&s), "{s:?}");
            assert!(
                kp_core::convert::validate_dns_label("f", &s).is_err(),
                "{s:?}"
            );
            assert!(
                kp_core::convert::validate_dns_subdomain("f", &s).is_err(),
                "{s:?}"
            );
        }
        assert!(smuggled("a SmUgGlEd b"));
        assert!(!smuggled("KUBE-SVC-ABCDEFGHIJKLMNOP"));
        assert!(smuggled_bytes(b"\0\0SMUGGLED\0"));
    }
}
