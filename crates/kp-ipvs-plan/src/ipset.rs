//! The ipsets the ipvs mode's iptables rules match (upstream's `pkg/proxy/ipvs/ipset.go` and
//! the set entries `syncProxyRules` collects), their contents planned from the frontends, the
//! element-level difference against what the kernel holds, and that difference as
//! `ipset restore` text.
//!
//! Names are upstream's; an IPv6 proxier's sets are named `KUBE-6-...` (upstream's rule for
//! dual-stack nodes, where both families' sets coexist).

use std::collections::BTreeSet;
use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::frontend::{FrontendKind, Frontends, TrafficPolicy};
use kp_core::model::{IpFamily, Protocol};
use kp_core::node::NodeContext;

/// The longest set name the kernel takes (`IPSET_MAXNAMELEN` less the NUL).
pub const NAME_MAX: usize = 31;

/// How a set stores its entries (the `ipset create` type).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SetType {
    /// `bitmap:port` (ports 0-65535).
    BitmapPort,
    /// `hash:ip`.
    HashIp,
    /// `hash:ip,port`.
    HashIpPort,
    /// `hash:ip,port,ip`.
    HashIpPortIp,
    /// `hash:ip,port,net`.
    HashIpPortNet,
}

impl SetType {
    /// The type as `ipset` spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            SetType::BitmapPort => "bitmap:port",
            SetType::HashIp => "hash:ip",
            SetType::HashIpPort => "hash:ip,port",
            SetType::HashIpPortIp => "hash:ip,port,ip",
            SetType::HashIpPortNet => "hash:ip,port,net",
        }
    }
}

/// One of the mode's sets (upstream's names without the family prefix).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SetName {
    /// `KUBE-LOOP-BACK`: endpoint IP, port and the same IP as source (hairpin masquerade).
    LoopBack,
    /// `KUBE-CLUSTER-IP`: ClusterIP and port (masquerade of traffic from outside the pods).
    ClusterIp,
    /// `KUBE-EXTERNAL-IP`: external IP and port with `externalTrafficPolicy: Cluster`.
    ExternalIp,
    /// `KUBE-EXTERNAL-IP-LOCAL`: external IP and port with `externalTrafficPolicy: Local`.
    ExternalIpLocal,
    /// `KUBE-LOAD-BALANCER`: every LoadBalancer IP and port.
    LoadBalancer,
    /// `KUBE-LOAD-BALANCER-LOCAL`: LoadBalancer IP and port with `externalTrafficPolicy: Local`.
    LoadBalancerLocal,
    /// `KUBE-LOAD-BALANCER-FW`: LoadBalancer IP and port with `loadBalancerSourceRanges`.
    LoadBalancerFw,
    /// `KUBE-LOAD-BALANCER-SOURCE-IP`: LoadBalancer IP, port and the LoadBalancer IP as source
    /// (the node reaching its own LoadBalancer when its address is in the ranges).
    LoadBalancerSourceIp,
    /// `KUBE-LOAD-BALANCER-SOURCE-CIDR`: LoadBalancer IP, port and an allowed source range.
    LoadBalancerSourceCidr,
    /// `KUBE-NODE-PORT-TCP`: TCP NodePorts.
    NodePortTcp,
    /// `KUBE-NODE-PORT-LOCAL-TCP`: TCP NodePorts with `externalTrafficPolicy: Local`.
    NodePortLocalTcp,
    /// `KUBE-NODE-PORT-UDP`: UDP NodePorts.
    NodePortUdp,
    /// `KUBE-NODE-PORT-LOCAL-UDP`: UDP NodePorts with `externalTrafficPolicy: Local`.
    NodePortLocalUdp,
    /// `KUBE-NODE-PORT-SCTP-HASH`: node address and SCTP NodePort.
    NodePortSctp,
    /// `KUBE-NODE-PORT-LOCAL-SCTP-HASH`: the same with `externalTrafficPolicy: Local`.
    NodePortLocalSctp,
    /// `KUBE-HEALTH-CHECK-NODE-PORT`: health check node ports (accepted in filter INPUT).
    HealthCheckNodePort,
    /// `KUBE-IPVS-IPS`: every address bound to `kube-ipvs0` (other ports on them rejected).
    IpvsIps,
}

impl SetName {
    /// Every set, in the order they are created.
    pub const ALL: [SetName; 17] = [
        SetName::LoopBack,
        SetName::ClusterIp,
        SetName::ExternalIp,
        SetName::ExternalIpLocal,
        SetName::LoadBalancer,
        SetName::LoadBalancerLocal,
        SetName::LoadBalancerFw,
        SetName::LoadBalancerSourceIp,
        SetName::LoadBalancerSourceCidr,
        SetName::NodePortTcp,
        SetName::NodePortLocalTcp,
        SetName::NodePortUdp,
        SetName::NodePortLocalUdp,
        SetName::NodePortSctp,
        SetName::NodePortLocalSctp,
        SetName::HealthCheckNodePort,
        SetName::IpvsIps,
    ];

    /// Upstream's name, without the family prefix.
    fn base(self) -> &'static str {
        match self {
            SetName::LoopBack => "KUBE-LOOP-BACK",
            SetName::ClusterIp => "KUBE-CLUSTER-IP",
            SetName::ExternalIp => "KUBE-EXTERNAL-IP",
            SetName::ExternalIpLocal => "KUBE-EXTERNAL-IP-LOCAL",
            SetName::LoadBalancer => "KUBE-LOAD-BALANCER",
            SetName::LoadBalancerLocal => "KUBE-LOAD-BALANCER-LOCAL",
            SetName::LoadBalancerFw => "KUBE-LOAD-BALANCER-FW",
            SetName::LoadBalancerSourceIp => "KUBE-LOAD-BALANCER-SOURCE-IP",
            SetName::LoadBalancerSourceCidr => "KUBE-LOAD-BALANCER-SOURCE-CIDR",
            SetName::NodePortTcp => "KUBE-NODE-PORT-TCP",
            SetName::NodePortLocalTcp => "KUBE-NODE-PORT-LOCAL-TCP",
            SetName::NodePortUdp => "KUBE-NODE-PORT-UDP",
            SetName::NodePortLocalUdp => "KUBE-NODE-PORT-LOCAL-UDP",
            SetName::NodePortSctp => "KUBE-NODE-PORT-SCTP-HASH",
            SetName::NodePortLocalSctp => "KUBE-NODE-PORT-LOCAL-SCTP-HASH",
            SetName::HealthCheckNodePort => "KUBE-HEALTH-CHECK-NODE-PORT",
            SetName::IpvsIps => "KUBE-IPVS-IPS",
        }
    }

    /// The set's name for a proxier of `family`: `KUBE-...` for IPv4, `KUBE-6-...` for IPv6
    /// (cut to [`NAME_MAX`]).
    pub fn name(self, family: IpFamily) -> String {
        let base = self.base();
        match family {
            IpFamily::V4 => base.to_string(),
            IpFamily::V6 => {
                // ipset names are at most 31 bytes; like upstream, the longer v6 name is cut
                // (`KUBE-6-LOAD-BALANCER-SOURCE-CID`).
                let mut name = format!("KUBE-6-{}", &base["KUBE-".len()..]);
                name.truncate(NAME_MAX);
                name
            }
        }
    }

    /// The set's type.
    pub fn set_type(self) -> SetType {
        match self {
            SetName::LoopBack | SetName::LoadBalancerSourceIp => SetType::HashIpPortIp,
            SetName::LoadBalancerSourceCidr => SetType::HashIpPortNet,
            SetName::NodePortTcp
            | SetName::NodePortLocalTcp
            | SetName::NodePortUdp
            | SetName::NodePortLocalUdp
            | SetName::HealthCheckNodePort => SetType::BitmapPort,
            SetName::IpvsIps => SetType::HashIp,
            _ => SetType::HashIpPort,
        }
    }

    /// Upstream's comment for the set (used in the iptables rules that match it).
    pub fn comment(self) -> &'static str {
        match self {
            SetName::LoopBack => "Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose",
            SetName::ClusterIp => "Kubernetes service cluster ip + port for masquerade purpose",
            SetName::ExternalIp => "Kubernetes service external ip + port for masquerade and filter purpose",
            SetName::ExternalIpLocal => "Kubernetes service external ip + port with externalTrafficPolicy=local",
            SetName::LoadBalancer => "Kubernetes service lb portal",
            SetName::LoadBalancerLocal => "Kubernetes service load balancer ip + port with externalTrafficPolicy=local",
            SetName::LoadBalancerFw => "Kubernetes service load balancer ip + port for load balancer with sourceRange",
            SetName::LoadBalancerSourceIp => "Kubernetes service load balancer ip + port + source IP for packet filter purpose",
            SetName::LoadBalancerSourceCidr => "Kubernetes service load balancer ip + port + source cidr for packet filter purpose",
            SetName::NodePortTcp => "Kubernetes nodeport TCP port for masquerade purpose",
            SetName::NodePortLocalTcp => "Kubernetes nodeport TCP port with externalTrafficPolicy=local",
            SetName::NodePortUdp => "Kubernetes nodeport UDP port for masquerade purpose",
            SetName::NodePortLocalUdp => "Kubernetes nodeport UDP port with externalTrafficPolicy=local",
            SetName::NodePortSctp => "Kubernetes nodeport SCTP port for masquerade purpose with type 'hash ip:port'",
            SetName::NodePortLocalSctp => "Kubernetes nodeport SCTP port with externalTrafficPolicy=local with type 'hash ip:port'",
            SetName::HealthCheckNodePort => "Kubernetes health check node port",
            SetName::IpvsIps => "Kubernetes service cluster ip + external ip + load balancer ip",
        }
    }

    /// The set named `name` for a proxier of `family`, if it is one of ours.
    pub fn parse(name: &str, family: IpFamily) -> Option<SetName> {
        SetName::ALL.into_iter().find(|s| s.name(family) == name)
    }
}

fn proto(p: Protocol) -> &'static str {
    match p {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
        Protocol::Sctp => "sctp",
    }
}

/// One set entry. Its [`Display`](fmt::Display) is `ipset`'s own spelling, the one
/// `ipset save` prints back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Entry {
    /// `PORT` (`bitmap:port`).
    Port(u16),
    /// `IP` (`hash:ip`).
    Ip(IpAddr),
    /// `IP,PROTO:PORT` (`hash:ip,port`).
    IpPort(IpAddr, Protocol, u16),
    /// `IP,PROTO:PORT,IP` (`hash:ip,port,ip`).
    IpPortIp(IpAddr, Protocol, u16, IpAddr),
    /// `IP,PROTO:PORT,NET` (`hash:ip,port,net`).
    IpPortNet(IpAddr, Protocol, u16, IpNet),
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Entry::Port(p) => write!(f, "{p}"),
            Entry::Ip(ip) => write!(f, "{ip}"),
            Entry::IpPort(ip, p, port) => write!(f, "{ip},{}:{port}", proto(*p)),
            Entry::IpPortIp(ip, p, port, ip2) => write!(f, "{ip},{}:{port},{ip2}", proto(*p)),
            Entry::IpPortNet(ip, p, port, net) => write!(f, "{ip},{}:{port},{net}", proto(*p)),
        }
    }
}

impl Entry {
    /// Reads an entry as `ipset save` prints it for a set of type `set_type`.
    pub fn parse(set_type: SetType, text: &str) -> Option<Entry> {
        if set_type == SetType::BitmapPort {
            return text.parse().ok().map(Entry::Port);
        }
        if set_type == SetType::HashIp {
            return text.parse().ok().map(Entry::Ip);
        }
        let mut parts = text.splitn(3, ',');
        let ip: IpAddr = parts.next()?.parse().ok()?;
        let (p, port) = parts.next()?.split_once(':')?;
        let p = match p {
            "tcp" => Protocol::Tcp,
            "udp" => Protocol::Udp,
            "sctp" => Protocol::Sctp,
            _ => return None,
        };
        let port: u16 = port.parse().ok()?;
        let third = parts.next();
        match (set_type, third) {
            (SetType::HashIpPort, None) => Some(Entry::IpPort(ip, p, port)),
            (SetType::HashIpPortIp, Some(t)) => Some(Entry::IpPortIp(ip, p, port, t.parse().ok()?)),
            (SetType::HashIpPortNet, Some(t)) => {
                // `ipset save` prints a host network without its prefix length.
                let net = match t.parse::<IpNet>() {
                    Ok(n) => n,
                    Err(_) => IpNet::from(t.parse::<IpAddr>().ok()?),
                };
                Some(Entry::IpPortNet(ip, p, port, net))
            }
            _ => None,
        }
    }
}

/// The bytes an IPv4 entry packs into ([`Packed`]): the widest, `hash:ip,port,net`, is an
/// address, a protocol, a port, a network address and a prefix length.
pub(crate) const PACKED: usize = 12;

/// A set entry of an IPv4 set packed into [`PACKED`] bytes: its fields big-endian in order,
/// the variant implied by the set's type, so that the bytes of one set's entries sort as the
/// entries do. A 40-byte [`Entry`] in a tree node costs 60 to 80 bytes; this, 20 to 25.
pub(crate) type Packed = [u8; PACKED];

fn proto_byte(p: Protocol) -> u8 {
    match p {
        Protocol::Tcp => 0,
        Protocol::Udp => 1,
        Protocol::Sctp => 2,
    }
}

/// Packs `entry` of a set of type `set_type`, if it is the type's variant with IPv4 addresses
/// only (other entries are kept as they are).
pub(crate) fn pack(set_type: SetType, entry: &Entry) -> Option<Packed> {
    let mut out = [0u8; PACKED];
    let v4 = |ip: &IpAddr| match ip {
        IpAddr::V4(a) => Some(a.octets()),
        IpAddr::V6(_) => None,
    };
    let head = |out: &mut Packed, ip: &IpAddr, p: Protocol, port: u16| -> Option<()> {
        out[..4].copy_from_slice(&v4(ip)?);
        out[4] = proto_byte(p);
        out[5..7].copy_from_slice(&port.to_be_bytes());
        Some(())
    };
    match (set_type, entry) {
        (SetType::BitmapPort, Entry::Port(p)) => out[..2].copy_from_slice(&p.to_be_bytes()),
        (SetType::HashIp, Entry::Ip(ip)) => out[..4].copy_from_slice(&v4(ip)?),
        (SetType::HashIpPort, Entry::IpPort(ip, p, port)) => head(&mut out, ip, *p, *port)?,
        (SetType::HashIpPortIp, Entry::IpPortIp(ip, p, port, ip2)) => {
            head(&mut out, ip, *p, *port)?;
            out[7..11].copy_from_slice(&v4(ip2)?);
        }
        (SetType::HashIpPortNet, Entry::IpPortNet(ip, p, port, IpNet::V4(net))) => {
            head(&mut out, ip, *p, *port)?;
            out[7..11].copy_from_slice(&net.addr().octets());
            out[11] = net.prefix_len();
        }
        _ => return None,
    }
    Some(out)
}

/// The entry [`pack`] packed for a set of type `set_type`.
pub(crate) fn unpack(set_type: SetType, b: &Packed) -> Entry {
    let ip = |at: usize| IpAddr::from([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let proto = match b[4] {
        0 => Protocol::Tcp,
        1 => Protocol::Udp,
        _ => Protocol::Sctp,
    };
    let port = u16::from_be_bytes([b[5], b[6]]);
    match set_type {
        SetType::BitmapPort => Entry::Port(u16::from_be_bytes([b[0], b[1]])),
        SetType::HashIp => Entry::Ip(ip(0)),
        SetType::HashIpPort => Entry::IpPort(ip(0), proto, port),
        SetType::HashIpPortIp => Entry::IpPortIp(ip(0), proto, port, ip(7)),
        SetType::HashIpPortNet => {
            let addr = std::net::Ipv4Addr::from([b[7], b[8], b[9], b[10]]);
            // Packed from a valid network, so the prefix length is at most 32.
            let net = ipnet::Ipv4Net::new(addr, b[11].min(32))
                .unwrap_or_else(|_| ipnet::Ipv4Net::from(addr));
            Entry::IpPortNet(ip(0), proto, port, IpNet::V4(net))
        }
    }
}

/// Every entry of the sets of one family: those packed, and the others, sorted.
pub(crate) type Parts = (Vec<(SetName, Packed)>, Vec<(SetName, Entry)>);

/// One set's entries: packed where [`pack`] can ([`Packed`]), as they are otherwise (IPv6
/// sets, an entry of another type or family).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Set {
    packed: BTreeSet<Packed>,
    plain: BTreeSet<Entry>,
}

/// One set's entries, read from [`Sets::get`].
#[derive(Clone, Copy)]
pub struct Entries<'a> {
    set_type: SetType,
    set: &'a Set,
}

impl<'a> Entries<'a> {
    /// How many.
    pub fn len(&self) -> usize {
        self.set.packed.len() + self.set.plain.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.set.packed.is_empty() && self.set.plain.is_empty()
    }

    /// Whether `entry` is one.
    pub fn contains(&self, entry: &Entry) -> bool {
        match pack(self.set_type, entry) {
            Some(p) => self.set.packed.contains(&p),
            None => self.set.plain.contains(entry),
        }
    }

    /// The entries, sorted.
    pub fn iter(&self) -> Box<dyn Iterator<Item = Entry> + 'a> {
        let set_type = self.set_type;
        let packed = self.set.packed.iter().map(move |p| unpack(set_type, p));
        if self.set.plain.is_empty() {
            Box::new(packed)
        } else if self.set.packed.is_empty() {
            Box::new(self.set.plain.iter().copied())
        } else {
            let mut all: Vec<Entry> = packed.chain(self.set.plain.iter().copied()).collect();
            all.sort_unstable();
            Box::new(all.into_iter())
        }
    }
}

impl<'a> IntoIterator for Entries<'a> {
    type Item = Entry;
    type IntoIter = Box<dyn Iterator<Item = Entry> + 'a>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl fmt::Debug for Entries<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

/// The contents of every set of one family; an IPv4 set's entries packed (12 bytes each).
#[derive(Clone, PartialEq, Eq)]
pub struct Sets {
    family: IpFamily,
    sets: [Set; SetName::ALL.len()],
}

impl fmt::Debug for Sets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(SetName::ALL.iter().map(|s| (s, self.get(*s))))
            .finish()
    }
}

impl Sets {
    /// Every set of `family`, empty.
    pub fn new(family: IpFamily) -> Sets {
        Sets {
            family,
            sets: Default::default(),
        }
    }

    /// The family.
    pub fn family(&self) -> IpFamily {
        self.family
    }

    /// One set's entries.
    pub fn get(&self, set: SetName) -> Entries<'_> {
        Entries {
            set_type: set.set_type(),
            set: &self.sets[set as usize],
        }
    }

    /// Whether `set` has no entry.
    pub fn is_empty(&self, set: SetName) -> bool {
        self.get(set).is_empty()
    }

    /// Every entry of every set, sorted by set and entry: those packed, and the others.
    pub(crate) fn into_parts(self) -> Parts {
        let (mut packed, mut plain) = (Vec::new(), Vec::new());
        for (set, s) in SetName::ALL.into_iter().zip(self.sets) {
            packed.extend(s.packed.into_iter().map(|p| (set, p)));
            plain.extend(s.plain.into_iter().map(|e| (set, e)));
        }
        (packed, plain)
    }

    /// Adds `entry` to `set`.
    pub fn insert(&mut self, set: SetName, entry: Entry) {
        let s = &mut self.sets[set as usize];
        match pack(set.set_type(), &entry) {
            Some(p) => s.packed.insert(p),
            None => s.plain.insert(entry),
        };
    }

    /// Removes `entry` from `set`.
    pub fn remove(&mut self, set: SetName, entry: &Entry) {
        let s = &mut self.sets[set as usize];
        match pack(set.set_type(), entry) {
            Some(p) => s.packed.remove(&p),
            None => s.plain.remove(entry),
        };
    }

    /// Adds the entries of one Service port's frontends (of this set's family; others are
    /// ignored). `node_addresses` are the addresses NodePorts answer on (SCTP NodePorts get
    /// one entry per address); `node` says whether the node's own address lies in a
    /// LoadBalancer's source ranges.
    pub fn add(
        &mut self,
        frontends: &Frontends<'_>,
        node_addresses: &[IpAddr],
        node: &NodeContext,
    ) {
        if frontends.family() != self.family {
            return;
        }
        let port = frontends.port();
        for f in frontends.iter() {
            let local = f.policy == TrafficPolicy::Local;
            match (f.kind, f.address) {
                (FrontendKind::ClusterIp, Some(ip)) => {
                    self.insert(SetName::ClusterIp, Entry::IpPort(ip, f.protocol, f.port));
                    self.insert(SetName::IpvsIps, Entry::Ip(ip));
                    for e in f.endpoints {
                        self.insert(
                            SetName::LoopBack,
                            Entry::IpPortIp(e.ip, f.protocol, e.port, e.ip),
                        );
                    }
                }
                (FrontendKind::ExternalIp, Some(ip)) => {
                    let set = if local {
                        SetName::ExternalIpLocal
                    } else {
                        SetName::ExternalIp
                    };
                    self.insert(set, Entry::IpPort(ip, f.protocol, f.port));
                    self.insert(SetName::IpvsIps, Entry::Ip(ip));
                }
                (FrontendKind::LoadBalancer { .. }, Some(ip)) => {
                    let entry = Entry::IpPort(ip, f.protocol, f.port);
                    self.insert(SetName::LoadBalancer, entry);
                    self.insert(SetName::IpvsIps, Entry::Ip(ip));
                    if local {
                        self.insert(SetName::LoadBalancerLocal, entry);
                    }
                    if let Some(ranges) = f.source_ranges() {
                        self.insert(SetName::LoadBalancerFw, entry);
                        for net in ranges.of_family() {
                            self.insert(
                                SetName::LoadBalancerSourceCidr,
                                Entry::IpPortNet(ip, f.protocol, f.port, *net),
                            );
                        }
                        if f.admits_node(node) {
                            self.insert(
                                SetName::LoadBalancerSourceIp,
                                Entry::IpPortIp(ip, f.protocol, f.port, ip),
                            );
                        }
                    }
                }
                (FrontendKind::NodePort, _) => match f.protocol {
                    Protocol::Tcp | Protocol::Udp => {
                        let (all, loc) = if f.protocol == Protocol::Tcp {
                            (SetName::NodePortTcp, SetName::NodePortLocalTcp)
                        } else {
                            (SetName::NodePortUdp, SetName::NodePortLocalUdp)
                        };
                        self.insert(all, Entry::Port(f.port));
                        if local {
                            self.insert(loc, Entry::Port(f.port));
                        }
                    }
                    Protocol::Sctp => {
                        let family = self.family;
                        for a in node_addresses.iter().filter(|a| IpFamily::of(a) == family) {
                            let entry = Entry::IpPort(*a, Protocol::Sctp, f.port);
                            self.insert(SetName::NodePortSctp, entry);
                            if local {
                                self.insert(SetName::NodePortLocalSctp, entry);
                            }
                        }
                    }
                },
                (_, None) => {}
            }
        }
        if let (Some(hc), TrafficPolicy::Local) =
            (port.health_check_node_port, frontends.external_policy())
        {
            if frontends.externally_accessible() {
                self.insert(SetName::HealthCheckNodePort, Entry::Port(hc));
            }
        }
    }

    /// Reads `ipset save` output: the entries of this family's sets (other sets and lines
    /// are skipped, as are entries that do not parse for their set's type).
    pub fn parse_save(family: IpFamily, text: &str) -> Sets {
        let mut sets = Sets::new(family);
        for line in text.lines() {
            let mut words = line.split_whitespace();
            if words.next() != Some("add") {
                continue;
            }
            let (Some(name), Some(entry)) = (words.next(), words.next()) else {
                continue;
            };
            let Some(set) = SetName::parse(name, family) else {
                continue;
            };
            if let Some(e) = Entry::parse(set.set_type(), entry) {
                sets.insert(set, e);
            }
        }
        sets
    }
}

/// One change to the sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetChange {
    /// `add SET ENTRY`.
    Add(SetName, Entry),
    /// `del SET ENTRY`.
    Del(SetName, Entry),
}

/// The element changes that bring `current` to `desired` (both of one family): entries
/// added, then entries removed, set by set.
pub fn diff(desired: &Sets, current: &Sets) -> Vec<SetChange> {
    changes(desired, current).collect()
}

/// [`diff`] as it goes, for a full sync that writes each change out as it comes instead of
/// holding every one.
pub fn changes<'a>(desired: &'a Sets, current: &'a Sets) -> impl Iterator<Item = SetChange> + 'a {
    SetName::ALL.into_iter().flat_map(move |set| {
        let (want, have) = (desired.get(set), current.get(set));
        let adds = want
            .iter()
            .filter(move |e| !have.contains(e))
            .map(move |e| SetChange::Add(set, e));
        let dels = have
            .iter()
            .filter(move |e| !want.contains(e))
            .map(move |e| SetChange::Del(set, e));
        adds.chain(dels)
    })
}

/// What `ipset save` showed of the sets, read line by line as the tool writes it (at 10,000
/// Services its text is 8 MiB and a tree of its entries more): the `create` lines as text
/// (for [`misfits`]) and each family's entries as a sorted vector.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Saved {
    creates: String,
    /// Per family of `families` (in that order).
    entries: Vec<SavedEntries>,
}

/// One family's saved entries, sorted: packed where they pack ([`pack`]), as they are
/// otherwise.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct SavedEntries {
    packed: Vec<(SetName, Packed)>,
    plain: Vec<(SetName, Entry)>,
}

/// The part of sorted `entries` in `set`.
fn of_set<T>(entries: &[(SetName, T)], set: SetName) -> &[(SetName, T)] {
    let start = entries.partition_point(|(s, _)| *s < set);
    let end = entries.partition_point(|(s, _)| *s <= set);
    &entries[start..end]
}

impl Saved {
    /// Reads `ipset save` output from `input`, keeping the sets of `families`.
    pub fn read(families: &[IpFamily], input: impl std::io::BufRead) -> std::io::Result<Saved> {
        let mut saved = Saved {
            creates: String::new(),
            entries: vec![SavedEntries::default(); families.len()],
        };
        for line in input.lines() {
            let line = line?;
            let mut words = line.split_whitespace();
            match words.next() {
                Some("create") => {
                    saved.creates.push_str(&line);
                    saved.creates.push('\n');
                }
                Some("add") => {
                    let (Some(name), Some(entry)) = (words.next(), words.next()) else {
                        continue;
                    };
                    for (i, family) in families.iter().enumerate() {
                        let Some(set) = SetName::parse(name, *family) else {
                            continue;
                        };
                        if let Some(e) = Entry::parse(set.set_type(), entry) {
                            let to = &mut saved.entries[i];
                            match pack(set.set_type(), &e) {
                                Some(p) => to.packed.push((set, p)),
                                None => to.plain.push((set, e)),
                            }
                        }
                    }
                }
                _ => {}
            }
        }
        for entries in &mut saved.entries {
            entries.packed.sort_unstable();
            entries.packed.dedup();
            entries.packed.shrink_to_fit();
            entries.plain.sort_unstable();
            entries.plain.dedup();
            entries.plain.shrink_to_fit();
        }
        Ok(saved)
    }

    /// The `create` lines, for [`misfits`].
    pub fn creates(&self) -> &str {
        &self.creates
    }

    /// The changes that bring family number `family`'s sets to `desired`, the sets `cleared`
    /// taken as empty (they are replaced): as [`changes`].
    pub fn changes<'a>(
        &'a self,
        family: usize,
        desired: &'a Sets,
        cleared: &'a [SetName],
    ) -> impl Iterator<Item = SetChange> + 'a {
        static NONE: SavedEntries = SavedEntries {
            packed: Vec::new(),
            plain: Vec::new(),
        };
        let entries = self.entries.get(family).unwrap_or(&NONE);
        SetName::ALL.into_iter().flat_map(move |set| {
            let (packed, plain) = if cleared.contains(&set) {
                (&[][..], &[][..])
            } else {
                (of_set(&entries.packed, set), of_set(&entries.plain, set))
            };
            let set_type = set.set_type();
            let has = move |e: &Entry| match pack(set_type, e) {
                Some(p) => packed.binary_search(&(set, p)).is_ok(),
                None => plain.binary_search(&(set, *e)).is_ok(),
            };
            let want = desired.get(set);
            let adds = want
                .iter()
                .filter(move |e| !has(e))
                .map(move |e| SetChange::Add(set, e));
            let dels = packed
                .iter()
                .map(move |(_, p)| unpack(set_type, p))
                .chain(plain.iter().map(|(_, e)| *e))
                .filter(move |e| !want.contains(e))
                .map(move |e| SetChange::Del(set, e));
            adds.chain(dels)
        })
    }
}

/// The most elements a hash set takes (`maxelem`). Upstream's 65,536 is too few at scale:
/// `KUBE-LOOP-BACK` holds one element per endpoint of every ClusterIP port (100,000 at 10,000
/// Services of 10 endpoints), and a full set refuses the rest ("Hash is full"). A hash set's
/// memory follows its elements, not this bound.
pub const MAX_ELEMENTS: u32 = 1 << 20;

fn inet(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "inet",
        IpFamily::V6 => "inet6",
    }
}

/// The type and options `set` is created with (after its name, without `-exist`).
fn create_options(set: SetName, family: IpFamily) -> String {
    let t = set.set_type();
    match t {
        SetType::BitmapPort => format!("{} range 0-65535", t.as_str()),
        _ => format!(
            "{} family {} hashsize 1024 maxelem {MAX_ELEMENTS}",
            t.as_str(),
            inet(family)
        ),
    }
}

/// The `ipset restore` text for `changes` in `family`, led by a `create ... -exist` of every
/// set (creating one that exists is a no-op, so the rules that name every set always load).
pub fn restore_text(family: IpFamily, changes: &[SetChange]) -> String {
    let mut out = Vec::new();
    // Writing to a vector cannot fail.
    let _ = write_restore(&mut out, family, changes.iter().copied());
    String::from_utf8_lossy(&out).into_owned()
}

/// Writes [`restore_text`]'s text to `out` as the changes come; returns how many there were.
pub fn write_restore(
    out: &mut dyn std::io::Write,
    family: IpFamily,
    changes: impl IntoIterator<Item = SetChange>,
) -> std::io::Result<usize> {
    for set in SetName::ALL {
        writeln!(
            out,
            "create {} {} -exist",
            set.name(family),
            create_options(set, family)
        )?;
    }
    let mut n = 0;
    for c in changes {
        let (verb, set, entry) = match c {
            SetChange::Add(s, e) => ("add", s, e),
            SetChange::Del(s, e) => ("del", s, e),
        };
        writeln!(out, "{verb} {} {entry} -exist", set.name(family))?;
        n += 1;
    }
    Ok(n)
}

/// The sets of `family` that `ipset save` output shows created with other options than
/// [`restore_text`]'s (another `maxelem`, as upstream's or an older kube-proxy-rs's, or
/// options such as `comment` or `counters`): `create ... -exist` refuses those, so they must
/// be replaced ([`replace_text`]). The size the kernel reports (`hashsize`, which grows with
/// the elements, `bucketsize`, `initval`) is not compared.
pub fn misfits(family: IpFamily, saved: &str) -> Vec<SetName> {
    let mut out = Vec::new();
    for line in saved.lines() {
        let mut words = line.split_whitespace();
        if words.next() != Some("create") {
            continue;
        }
        let Some(set) = words.next().and_then(|n| SetName::parse(n, family)) else {
            continue;
        };
        let mut shown = Vec::new();
        let mut words = words.peekable();
        while let Some(w) = words.next() {
            if matches!(w, "hashsize" | "bucketsize" | "initval") {
                words.next();
            } else {
                shown.push(w);
            }
        }
        let mut wanted: Vec<String> = Vec::new();
        let mut options = create_options(set, family);
        options = options.replace(" hashsize 1024", "");
        wanted.extend(options.split_whitespace().map(str::to_string));
        if shown != wanted {
            out.push(set);
        }
    }
    out
}

/// The `ipset restore` text that replaces each of `sets` by an empty one created as
/// [`restore_text`] creates it, under the same name: a new set is created, swapped with the
/// old one (iptables rules that match the name keep working throughout) and the old one
/// destroyed. The caller then adds every element again.
pub fn replace_text(family: IpFamily, sets: &[SetName]) -> String {
    let mut out = String::new();
    for (i, set) in sets.iter().enumerate() {
        let temp = format!("KUBE-REPLACING-{i}");
        out.push_str(&format!(
            "create {temp} {}\nswap {} {temp}\ndestroy {temp}\n",
            create_options(*set, family),
            set.name(family)
        ));
    }
    out
}

impl Sets {
    /// Empties `set` (what a replaced set holds).
    pub fn clear(&mut self, set: SetName) {
        self.sets[set as usize] = Set::default();
    }
}

#[cfg(test)]
mod tests;
