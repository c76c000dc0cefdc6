//! One rule as `iptables-save` prints it: the [`Rule`] builder and the spelling of its parts
//! (strings, addresses, probabilities, marks, REJECT and `recent` defaults).

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use kp_core::model::{IpFamily, Protocol};
use kp_core::node::LocalInterface;

/// One rule under construction. Whatever order the parts are added in, [`Rule::build`] puts
/// them in `iptables-save`'s order: `-s`, `-d`, `-i`, `-p`, the matches in the order added,
/// `-j`.
#[derive(Clone, Debug, Default)]
pub(crate) struct Rule {
    src: Option<(bool, IpNet)>,
    dst: Option<(bool, IpNet)>,
    /// `-i …` or `! -i …`, as [`LocalInterface::iptables`] spells it.
    in_iface: Option<String>,
    proto: Option<Protocol>,
    matches: String,
    target: String,
}

impl Rule {
    pub(crate) fn new() -> Self {
        Rule::default()
    }

    /// `-s NET`. A zero-length prefix matches every source and is left out, as `iptables-save`
    /// prints it.
    pub(crate) fn src(mut self, net: IpNet) -> Self {
        self.src = Some((false, net));
        self
    }

    /// `! -s NET`. `NET` must not be a zero-length prefix: that rule would match nothing, and
    /// iptables-nft refuses it (see [`crate::validate`]); callers leave such a rule out.
    pub(crate) fn not_src(mut self, net: IpNet) -> Self {
        self.src = Some((true, net));
        self
    }

    /// `-d NET` (a zero-length prefix is left out, as for [`Rule::src`]).
    pub(crate) fn dst(mut self, net: IpNet) -> Self {
        self.dst = Some((false, net));
        self
    }

    /// `! -d NET` (never a zero-length prefix, as for [`Rule::not_src`]).
    pub(crate) fn not_dst(mut self, net: IpNet) -> Self {
        self.dst = Some((true, net));
        self
    }

    /// Detect-local by interface: `-i cbr0` / `-i veth+` (from a pod), or with `negate`
    /// `! -i cbr0` (not from a pod).
    pub(crate) fn local_iface(mut self, local: &LocalInterface, negate: bool) -> Self {
        self.in_iface = Some(local.iptables(negate));
        self
    }

    /// `-m comment --comment TEXT`.
    pub(crate) fn comment(mut self, text: &str) -> Self {
        let _ = write!(self.matches, " -m comment --comment {}", save_string(text));
        self
    }

    /// A comment, unless `text` is `None` (large-cluster mode).
    pub(crate) fn maybe_comment(self, text: Option<&str>) -> Self {
        match text {
            Some(t) => self.comment(t),
            None => self,
        }
    }

    /// `-p P` alone: what a DNAT to a port needs. Upstream also loads the protocol's match
    /// (`-m P -p P`) without options, which matches every packet `-p P` lets through; leaving it
    /// out saves an xtables match per endpoint rule: 12% of a full iptables-nft load at 10k
    /// Services, and one match per new connection.
    pub(crate) fn proto(mut self, p: Protocol) -> Self {
        self.proto = Some(p);
        self
    }

    /// `-p P` and `-m P --dport PORT`.
    pub(crate) fn dport(mut self, p: Protocol, port: u16) -> Self {
        self.proto = Some(p);
        let _ = write!(self.matches, " -m {} --dport {port}", p.as_lower());
        self
    }

    /// Any other match, as `-m NAME OPTIONS`.
    pub(crate) fn m(mut self, text: &str) -> Self {
        self.matches.push(' ');
        self.matches.push_str(text);
        self
    }

    /// `-j TARGET [OPTIONS]`.
    pub(crate) fn jump(mut self, target: &str) -> Self {
        self.target = format!(" -j {target}");
        self
    }

    /// The rule's arguments (what follows `-A CHAIN `).
    pub(crate) fn build(self) -> String {
        let mut out = String::new();
        for (flag, part) in [("-s", &self.src), ("-d", &self.dst)] {
            match part {
                // Every address: no match at all, which is what iptables-save prints.
                Some((false, net)) if net.prefix_len() == 0 => {}
                Some((neg, net)) => {
                    let neg = if *neg { "! " } else { "" };
                    let _ = write!(out, " {neg}{flag} {}", net.trunc());
                }
                None => {}
            }
        }
        if let Some(i) = &self.in_iface {
            let _ = write!(out, " {i}");
        }
        if let Some(p) = self.proto {
            let _ = write!(out, " -p {}", p.as_lower());
        }
        out.push_str(&self.matches);
        out.push_str(&self.target);
        out.trim_start().to_string()
    }
}

/// A string argument as `iptables-save` prints it (libxtables' `xtables_save_string`): bare if
/// it is only letters, digits, `-` and `_`; otherwise double-quoted with `"`, `\` and `'`
/// escaped.
pub(crate) fn save_string(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return s.to_string();
    }
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        if matches!(c, '"' | '\\' | '\'') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// One address as a host network (`10.0.0.1/32`, `fd00::1/128`).
pub(crate) fn host(ip: &IpAddr) -> IpNet {
    IpNet::from(*ip)
}

/// A network as printed back: host bits cleared.
pub(crate) fn net(n: &IpNet) -> IpNet {
    n.trunc()
}

/// The probability of rule `i` of `n` remaining endpoints, `1/n`, as `iptables-save` prints it
/// after upstream wrote it with 10 decimals: the kernel keeps `round(2^31 × p)` and save prints
/// that fraction with 11 decimals.
pub fn probability(n: usize) -> String {
    const SCALE: f64 = 2_147_483_648.0; // 0x80000000, xt_statistic's unit.
    let written = format!("{:.10}", 1.0 / n.max(1) as f64);
    let p: f64 = written.parse().unwrap_or(1.0);
    let stored = (p * SCALE).round();
    format!("{:.11}", stored / SCALE)
}

/// The masquerade mark in save form (`0x4000`).
pub(crate) fn hex(mark: u32) -> String {
    format!("{mark:#x}")
}

pub(crate) fn reject(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "REJECT --reject-with icmp-port-unreachable",
        IpFamily::V6 => "REJECT --reject-with icmp6-port-unreachable",
    }
}

pub(crate) fn recent_mask(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "255.255.255.255",
        IpFamily::V6 => "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
    }
}

/// The loopback network of a family, as NodePorts exclude it.
pub(crate) fn loopback(family: IpFamily) -> IpNet {
    match family {
        IpFamily::V4 => IpNet::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 0)), 8),
        IpFamily::V6 => IpNet::new(IpAddr::V6(Ipv6Addr::LOCALHOST), 128),
    }
    .unwrap_or_default()
}
