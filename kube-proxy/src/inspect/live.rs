//! The live kernel state, read the way an operator would read it (`nft list table`,
//! `iptables-save`, the ebpf mode's maps through their pins under `--bpf-pin-dir`, the
//! userspace mode's redirect table and whether its proxy port is listened on), into the
//! mode's tracer; which mode the node runs; the node's addresses; and the running proxy's HTTP
//! answers.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kp_core::flow::Ingress;
use kp_core::model::IpFamily;
use kp_ebpf_test::EbpfTracer;
use kp_iptables::{Backend, IptablesCommand};
use kp_iptables_test::IptablesTracer;
use kp_ipvs_test::{IpvsNode, IpvsTracer};
use kp_nftables_test::NftTracer;
use kp_proxy::config::{Config, ProxyMode};
use kp_userspace_plan::names as userspace_names;
use kp_userspace_test::UserspaceTracer;

/// What the kernel holds for one mode, read into that mode's tracer.
pub enum Live {
    /// The nftables mode's `kube-proxy` tables (`ip` and `ip6`).
    Nftables {
        /// The tables, replayed from their listings.
        tracer: NftTracer,
    },
    /// The iptables mode's `KUBE-*` chains in the filter and nat tables of both families.
    Iptables {
        /// The chains, replayed from `iptables-save` (boxed: it holds four tables).
        tracer: Box<IptablesTracer>,
        /// The backend whose tools were read.
        backend: Backend,
        /// Other programs' rules in the filter and nat tables, left out of the trace.
        foreign_rules: usize,
    },
    /// The ipvs mode: its `KUBE-*` chains (nat, filter, mangle), its ipsets and IPVS's
    /// virtual servers, read over netlink.
    Ipvs {
        /// The chains, sets and virtual servers (boxed: it holds six tables).
        tracer: Box<IpvsTracer>,
        /// The backend whose tools were read.
        backend: Backend,
        /// Other programs' rules in the filter, nat and mangle tables, left out of the trace.
        foreign_rules: usize,
    },
    /// The ebpf mode's maps, read through their pins (nothing is loaded or attached).
    Ebpf {
        /// The services, backends, reverse-NAT, address and source-range maps.
        tracer: EbpfTracer,
        /// Where they are pinned (`--bpf-pin-dir`).
        pin_dir: PathBuf,
        /// The socket hooks' links pinned there (`kp_connect4_link`, …), by program: the
        /// programs attached to the cgroup while no proxy runs.
        hooks: Vec<&'static str>,
        /// The interfaces whose tc link is pinned there (`kp_tc_link_DEV`): where traffic
        /// from outside the node meets `kp_tc_outside` or gets its replies undone.
        tc_links: Vec<String>,
    },
    /// The userspace mode's redirect table (`inet kube-proxy-userspace`). Where a redirected
    /// connection goes is the running proxy's balancer's choice, not the kernel's: the
    /// tracer's balancer is synced from the objects once they are read
    /// ([`Live::with_objects`]), and says which endpoints the proxy may pick.
    Userspace {
        /// The table, replayed from its listing, and the balancer.
        tracer: Box<UserspaceTracer>,
        /// The proxy ports its rules redirect to (one while a proxy runs or after it stopped;
        /// with detect-local by interface two: the proxy port and its pod port).
        ports: Vec<u16>,
        /// The ports of those a TCP socket listens on (the running proxy).
        listening: Vec<u16>,
        /// Whether the balancer was synced from the objects.
        synced: bool,
    },
}

impl Live {
    /// Hands the objects to what needs them to trace: userspace mode's balancer, synced as the
    /// proxy syncs its own (its settings from `cfg`).
    pub fn with_objects(&mut self, cfg: &Config, state: &kp_core::track::ProxyState) {
        if let Live::Userspace { tracer, synced, .. } = self {
            let Ok(uc) = kp_proxy::modes::userspace_config(cfg) else {
                return;
            };
            let node = kp_core::node::NodeContext::resolve(
                &uc.balancer.detect_local,
                &uc.node_ports,
                state,
            );
            tracer
                .balancer_mut()
                .sync(state, &node, &kp_core::track::Changes::default(), true);
            *synced = true;
        }
    }
}

/// Reads `mode`'s rules from the kernel into its tracer; `local` are the node's addresses;
/// `cfg` the proxy's flags (ebpf mode: `--bpf-pin-dir`).
pub fn read(mode: ProxyMode, cfg: &Config, local: Vec<IpAddr>) -> Result<Live, String> {
    match mode {
        ProxyMode::Nftables => {
            let mut tracer = NftTracer::new(local).with_ingress(node_links());
            for f in IpFamily::ALL {
                let text = nft_listing(f)?;
                tracer
                    .apply_listing(&text)
                    .map_err(|e| format!("reading nft list table {}: {e}", nft_family(f)))?;
            }
            Ok(Live::Nftables { tracer })
        }
        ProxyMode::Iptables => {
            let (saved, backend, foreign_rules) =
                kube_chains(&["filter", "nat"], &kp_iptables_test::save::is_kube_chain)?;
            let mut tracer = IptablesTracer::new(local).with_ingress(node_links());
            for (f, restore) in &saved {
                tracer
                    .apply(*f, restore)
                    .map_err(|e| format!("reading {f:?} iptables-save: {e}"))?;
            }
            Ok(Live::Iptables {
                tracer: Box::new(tracer),
                backend,
                foreign_rules,
            })
        }
        ProxyMode::Ipvs => {
            let (saved, backend, foreign_rules) =
                kube_chains(&["filter", "nat", "mangle"], &|c: &str| {
                    kp_iptables_test::save::is_kube_chain(c)
                        || kp_ipvs_plan::rules::is_owned_chain(c)
                })?;
            let ipset = Command::new("ipset")
                .arg("save")
                .output()
                .map_err(|e| format!("cannot run ipset: {e}"))?;
            if !ipset.status.success() {
                return Err(format!(
                    "ipset save: {}",
                    String::from_utf8_lossy(&ipset.stderr).trim()
                ));
            }
            let ipset = String::from_utf8_lossy(&ipset.stdout);
            let sets = IpFamily::ALL
                .map(|f| kp_ipvs_plan::ipset::Sets::parse_save(f, &ipset))
                .to_vec();
            let dump = kp_ipvs::Client::open(None)
                .and_then(|mut c| c.dump())
                .map_err(|e| format!("reading IPVS over netlink: {e}"))?;
            let node = IpvsNode::new(
                sets,
                dump.into_iter()
                    .map(|(s, d)| (s, d.into_iter().map(|d| d.destination).collect())),
            );
            // The addresses bound to kube-ipvs0 are among the interfaces' (`local`).
            let tracer = IpvsTracer::new(local, node, &saved, Some(node_links()))
                .map_err(|e| format!("reading iptables-save: {e}"))?;
            Ok(Live::Ipvs {
                tracer: Box::new(tracer),
                backend,
                foreign_rules,
            })
        }
        ProxyMode::Ebpf => {
            let dir = &cfg.bpf_pin_dir;
            if !dir.join(kp_ebpf::names::SERVICES).exists() {
                return Err(format!(
                    "no ebpf maps are pinned in {} (the proxy's --bpf-pin-dir; pass the same \
                     flag here)",
                    dir.display()
                ));
            }
            let maps = kp_ebpf::read_pinned(dir)
                .map_err(|e| format!("reading the maps pinned in {}: {e}", dir.display()))?;
            let (hooks, tc_links) = pinned_links(dir);
            // Nothing rewrites a source in this mode: a backend sees the node's address only
            // for the node's unbound sockets, whose source is an address of the interface
            // towards it, never one held on loopback alone (a LoadBalancer IP on `lo` is a
            // source only for a socket bound to it; loopback itself the tracer knows).
            Ok(Live::Ebpf {
                tracer: EbpfTracer::new(maps, interface_addresses(|name| name != "lo")),
                pin_dir: dir.clone(),
                hooks,
                tc_links,
            })
        }
        ProxyMode::Userspace => {
            let uc = kp_proxy::modes::userspace_config(cfg).map_err(|e| e.to_string())?;
            let listing = nft_table_listing(userspace_names::FAMILY, userspace_names::TABLE)?;
            let mut tracer =
                UserspaceTracer::new(local, kp_userspace_plan::Balancer::new(uc.balancer))
                    .with_ingress(node_links());
            let text = kp_nftables_test::listing::transaction(&listing).map_err(|e| {
                format!(
                    "reading nft list table {} {}: {e}",
                    userspace_names::FAMILY,
                    userspace_names::TABLE
                )
            })?;
            tracer.apply(&text).map_err(|e| {
                format!(
                    "replaying nft list table {} {}: {e}",
                    userspace_names::FAMILY,
                    userspace_names::TABLE
                )
            })?;
            let ports: Vec<u16> = tracer.redirect_ports().into_iter().collect();
            let listening = ports.iter().copied().filter(|p| tcp_listens(*p)).collect();
            Ok(Live::Userspace {
                tracer: Box::new(tracer),
                ports,
                listening,
                synced: false,
            })
        }
    }
}

/// kube-proxy's chains (those `ours` names) and the jumps into them, of each family's
/// `iptables-save` (its `tables`) of the backend the node uses, as `iptables-restore` input;
/// the backend; how many rules of other programs were left out.
#[allow(clippy::type_complexity)] // Private; the three parts are named above.
fn kube_chains(
    tables: &[&str],
    ours: &dyn Fn(&str) -> bool,
) -> Result<(Vec<(IpFamily, String)>, Backend, usize), String> {
    let backend = kp_iptables::detect_backend(None);
    let cmd = IptablesCommand::new();
    let mut saved = Vec::new();
    let mut foreign_rules = 0;
    for f in IpFamily::ALL {
        let save = match cmd.save(backend, f, None) {
            Ok(s) => s,
            // A node without IPv6 tables (no ip6tables module) holds nothing of ours.
            Err(_) if f == IpFamily::V6 => continue,
            Err(e) => return Err(format!("reading {} save: {e}", backend.as_str())),
        };
        let kept = kp_iptables_test::save::kube_rules_of(&save, tables, ours);
        foreign_rules += kept.foreign_rules;
        saved.push((f, kept.restore));
    }
    Ok((saved, backend, foreign_rules))
}

/// The socket hooks whose link is pinned in `dir`, and the interfaces whose tc link is.
pub fn pinned_links(dir: &Path) -> (Vec<&'static str>, Vec<String>) {
    let hooks = kp_ebpf::SOCK_PROGRAMS
        .into_iter()
        .filter(|p| dir.join(kp_ebpf::names::link(p)).exists())
        .collect();
    let mut tc: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let name = e.ok()?.file_name().to_string_lossy().into_owned();
            name.strip_prefix(kp_ebpf::names::TC_LINK_PREFIX)
                .map(str::to_string)
        })
        .collect();
    tc.sort();
    (hooks, tc)
}

fn nft_family(f: IpFamily) -> &'static str {
    kp_nftables_plan::names::family(f)
}

/// `nft list table FAMILY kube-proxy`; empty when the table does not exist.
fn nft_listing(f: IpFamily) -> Result<String, String> {
    nft_table_listing(nft_family(f), kp_nftables_plan::names::TABLE)
}

/// `nft list table FAMILY NAME`; empty when the table does not exist.
fn nft_table_listing(family: &str, name: &str) -> Result<String, String> {
    let out = Command::new("nft")
        .args(["list", "table", family, name])
        .output()
        .map_err(|e| format!("cannot run nft: {e}"))?;
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    if err.contains("No such file or directory") {
        return Ok(String::new());
    }
    Err(format!("nft list table {family} {name}: {}", err.trim()))
}

/// Whether a TCP socket of this network namespace listens on `port` (any address, either
/// family), from `/proc/net/tcp` and `/proc/net/tcp6`.
pub fn tcp_listens(port: u16) -> bool {
    const LISTEN: &str = "0A";
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|path| {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .skip(1)
            .any(|l| {
                let w: Vec<&str> = l.split_whitespace().collect();
                let local_port = w
                    .get(1)
                    .and_then(|a| a.rsplit_once(':'))
                    .and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
                w.get(3) == Some(&LISTEN) && local_port == Some(port)
            })
    })
}

/// Which mode's rules the kernel holds. ebpf first: its programs, attached while their links
/// are pinned in `--bpf-pin-dir` (`cfg`'s), translate a connection when it is made, before any
/// netfilter rule sees a packet; its maps pinned there, or its NAT hooks' table
/// (`inet kube-proxy-ebpf`), say the same of a mode whose links went. Then in the order a mode
/// switch leaves them (the new mode's rules are there before the old mode's are removed):
/// nftables, ipvs, iptables, userspace.
pub fn detect_mode(cfg: &Config) -> Option<ProxyMode> {
    let tables = Command::new("nft")
        .args(["list", "tables"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let has = |t: &str| tables.lines().any(|l| l.trim() == t);
    let (hooks, _) = pinned_links(&cfg.bpf_pin_dir);
    if !hooks.is_empty()
        || cfg.bpf_pin_dir.join(kp_ebpf::names::SERVICES).exists()
        || has(&format!("table inet {}", kp_ebpf::nat_hooks::TABLE))
    {
        return Some(ProxyMode::Ebpf);
    }
    if has("table ip kube-proxy") || has("table ip6 kube-proxy") {
        return Some(ProxyMode::Nftables);
    }
    if std::path::Path::new("/sys/class/net/kube-ipvs0").exists() {
        return Some(ProxyMode::Ipvs);
    }
    let backend = kp_iptables::detect_backend(None);
    if let Ok(nat) = IptablesCommand::new().save(backend, IpFamily::V4, Some("nat")) {
        if nat.lines().any(|l| l.starts_with(":KUBE-SERVICES ")) {
            return Some(ProxyMode::Iptables);
        }
    }
    if has("table inet kube-proxy-userspace") {
        return Some(ProxyMode::Userspace);
    }
    None
}

/// The node's addresses (what `fib … type local` and `--dst-type LOCAL` match).
pub fn local_addresses() -> Vec<IpAddr> {
    interface_addresses(|_| true)
}

/// The addresses of the node's interfaces whose name `keep` admits.
fn interface_addresses(keep: impl Fn(&str) -> bool) -> Vec<IpAddr> {
    let mut v: Vec<IpAddr> = match nix::ifaddrs::getifaddrs() {
        Ok(addrs) => addrs
            .filter(|a| keep(&a.interface_name))
            .filter_map(|a| {
                let s = a.address?;
                if let Some(v4) = s.as_sockaddr_in() {
                    return Some(IpAddr::V4(v4.ip()));
                }
                s.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
            })
            .collect(),
        Err(_) => Vec::new(),
    };
    v.sort();
    v.dedup();
    v
}

/// The source address the kernel's route to `dst` prefers (`ip route get DST`: its `src`).
pub fn route_source(dst: IpAddr) -> Option<IpAddr> {
    let out = Command::new("ip")
        .args(["route", "get", &dst.to_string()])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let words: Vec<&str> = text.split_whitespace().collect();
    words
        .windows(2)
        .find(|w| w[0] == "src")
        .and_then(|w| w[1].parse().ok())
}

/// The interface a traced packet arrives on, for rules of detect-local by interface: the link
/// this node's main routing table routes its source through (what reverse-path filtering
/// holds a real packet to), from `ip route`. A source no route covers arrives on no named
/// link (an empty name, which no detect-local interface matches).
pub fn node_links() -> Ingress {
    let routes = |family: &str| {
        Command::new("ip")
            .args([family, "-o", "route", "show", "table", "main"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    };
    links_of_routes(&routes("-4"), &routes("-6"))
}

/// [`node_links`] from what `ip -4 -o route show` and `ip -6 -o route show` print: each route
/// with a `dev` whose destination is `default`, a network or an address; other lines (route
/// types such as `unreachable`) are left out.
pub fn links_of_routes(v4: &str, v6: &str) -> Ingress {
    let net = |s: &str| {
        s.parse::<ipnet::IpNet>()
            .ok()
            .or_else(|| s.parse::<IpAddr>().ok().map(ipnet::IpNet::from))
    };
    let any4 = ipnet::IpNet::V4(ipnet::Ipv4Net::default());
    let any6 = ipnet::IpNet::V6(ipnet::Ipv6Net::default());
    // First, so that a real default route (added later) wins the tie.
    let mut links = Ingress::new().route(any4, "").route(any6, "");
    for (text, any) in [(v4, any4), (v6, any6)] {
        for line in text.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            let Some(dev) = words.windows(2).find(|w| w[0] == "dev").map(|w| w[1]) else {
                continue;
            };
            let dst = match words.first() {
                Some(&"default") => Some(any),
                Some(w) => net(w),
                None => None,
            };
            if let Some(dst) = dst {
                links = links.route(dst, dev);
            }
        }
    }
    links
}

/// The address a client on this node reaches a server bound to `addr` at.
pub fn reachable(addr: SocketAddr) -> SocketAddr {
    let ip = match addr.ip() {
        IpAddr::V4(a) if a.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(a) if a.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, addr.port())
}

/// `GET path` from the proxy's server at `addr`: the status code and the body.
pub fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    let addr = reachable(addr);
    let t = Duration::from_secs(2);
    let mut s = TcpStream::connect_timeout(&addr, t).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(t)).map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(t)).map_err(|e| e.to_string())?;
    let host = match addr {
        SocketAddr::V4(a) => a.to_string(),
        SocketAddr::V6(a) => format!("[{}]:{}", a.ip(), a.port()),
    };
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nUser-Agent: kube-proxy-status\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("not an HTTP answer from {addr}"))?;
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_string()
    };
    Ok((code, body))
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use kp_core::flow::{Origin, Packet};
    use kp_core::model::Protocol;

    use super::*;

    fn from(src: &str) -> Packet {
        let src: IpAddr = src.parse().unwrap();
        Packet {
            origin: Origin::Pod,
            src,
            protocol: Protocol::Tcp,
            dst: if src.is_ipv6() {
                "fd00:10:96::1".parse().unwrap()
            } else {
                "10.96.0.10".parse().unwrap()
            },
            dport: 80,
        }
    }

    #[test]
    fn links_follow_the_most_specific_route_and_unrouted_sources_arrive_on_none_named() {
        let v4 = "default via 192.0.2.2 dev eth0 proto static \n\
                  10.244.1.11 dev veth1 scope link \n\
                  10.244.2.0/24 via 198.18.0.2 dev eth1 \n\
                  unreachable 203.0.113.0/24 \n";
        let v6 = "fd00:10:244:1::11 dev veth1 metric 1024 pref medium\n";
        let links = links_of_routes(v4, v6);
        assert_eq!(links.interface(&from("10.244.1.11")), Some("veth1"));
        assert_eq!(links.interface(&from("10.244.2.21")), Some("eth1"));
        assert_eq!(links.interface(&from("203.0.113.9")), Some("eth0"));
        assert_eq!(links.interface(&from("fd00:10:244:1::11")), Some("veth1"));
        // No IPv6 default route: an IPv6 source elsewhere arrives on no named link.
        assert_eq!(links.interface(&from("2001:db8::2")), Some(""));
    }
}
