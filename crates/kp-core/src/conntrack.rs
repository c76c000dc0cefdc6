//! Which conntrack entries are stale: the pure half of the conntrack reconciler.
//!
//! UDP and SCTP have no connection teardown the proxy could rely on, so a conntrack entry keeps
//! translating a client's datagrams to the endpoint chosen for its first one until the entry
//! times out, however long the client keeps sending. When that endpoint goes away, the client
//! talks to nothing. Mirrors upstream `pkg/proxy/conntrack/cleanup.go` (`CleanStaleEntries`):
//! after each sync, an entry is stale when its original destination is a Service frontend (a
//! ClusterIP, external IP or LoadBalancer IP with the Service port, or a NodePort on one of the
//! node's addresses) and its reply source (the endpoint it was translated to) is no longer one
//! the Service may send traffic to.
//!
//! [`ConntrackPlanner::update`] indexes the frontends of a [`ProxyState`];
//! [`ConntrackPlanner::check`] judges one [`FlowEntry`]. Listing and deleting entries is the
//! kernel side's job (`kp-conntrack`). TCP entries are never stale here: TCP endpoints reset or
//! time out connections on their own, and upstream leaves them alone too.
//!
//! # Which reply sources are allowed
//!
//! A frontend's allowed reply sources are its port's *serving* endpoints (ready, or serving
//! while terminating) plus whatever endpoint selection picked for the dataplane. Like upstream,
//! traffic policies, topology hints and the ready/terminating fallback do not narrow the set:
//! a flow already running to an endpoint that still serves keeps going, as a TCP connection
//! would. Unlike upstream, endpoints are matched by address *and* port, so a flow to a changed
//! `targetPort` is stale too.
//!
//! # Frontends without endpoints
//!
//! Datagrams sent while a frontend had no endpoint of their family were never translated
//! (their reply source is the frontend itself). Such entries are kept while the frontend still
//! has no endpoint, and become stale once it has one, so the client's next datagram is
//! translated: upstream's "Service goes from 0 to N endpoints" case. An entry translated to an
//! endpoint that is gone is stale even when no endpoint is left (upstream keeps it until an
//! endpoint appears; dropping it at once lets the client's next datagram meet the proxy's
//! reject rule instead of a vanished pod).
//!
//! # Deleted frontends
//!
//! A Service that is deleted (or that loses a port, an IP or its NodePort) leaves entries still
//! translated to its old endpoints. The planner remembers every frontend it indexed before; one
//! missing from the next [`update`](ConntrackPlanner::update) is *forgotten*, and every entry
//! to a forgotten frontend is stale. A forgotten frontend is remembered until a reconcile that
//! saw it succeeds ([`ConntrackPlanner::reconciled`]), and at most for
//! [`FORGOTTEN_UPDATES`] updates, so failing reconciles cannot make the memory grow without
//! bound. A frontend that comes back (the ClusterIP reused) is current again at once.
//!
//! Only entries to frontends that are, or were, programmed by this proxy are ever stale: other
//! translations on the node (a CNI's, a host port's) are never touched.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use crate::frontend::Frontends;
use crate::model::{Endpoint, IpFamily, Protocol, ServiceKey};
use crate::track::ProxyState;

/// How many [`ConntrackPlanner::update`]s a forgotten frontend is remembered for when no
/// reconcile acknowledges it. Reconciles run after every sync, so this only matters when they
/// keep failing.
pub const FORGOTTEN_UPDATES: u32 = 16;

/// One conntrack entry, as the kernel reports it: the original tuple (what the client sent)
/// and the source of the reply tuple (where the kernel translated it to).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FlowEntry {
    /// The L4 protocol. Entries of other protocols are never listed.
    pub protocol: Protocol,
    /// Original source address (the client).
    pub orig_src: IpAddr,
    /// Original destination address (the frontend the client addressed).
    pub orig_dst: IpAddr,
    /// Original source port.
    pub orig_sport: u16,
    /// Original destination port.
    pub orig_dport: u16,
    /// Reply source address: the endpoint the entry was translated to, or `orig_dst` when it
    /// was not translated.
    pub reply_src: IpAddr,
    /// Reply source port: the endpoint's port, or `orig_dport` when not translated.
    pub reply_sport: u16,
    /// The conntrack zone (0 unless something on the node uses zones); a delete must name it.
    pub zone: u16,
    /// The kernel's id of the entry, when known. A delete that carries it spares a different
    /// entry that took the same original tuple meanwhile. Best effort: the kernel derives the
    /// id from the entry's address and tuple, so a replacement that reuses the memory shares it.
    pub id: Option<u32>,
}

impl FlowEntry {
    /// The entry's IP family (that of its original destination).
    pub fn family(&self) -> IpFamily {
        IpFamily::of(&self.orig_dst)
    }

    /// Whether the kernel translated the destination (DNAT): the reply comes from somewhere
    /// other than where the client sent to.
    pub fn translated(&self) -> bool {
        self.reply_src != self.orig_dst || self.reply_sport != self.orig_dport
    }
}

impl fmt::Display for FlowEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} -> {} (reply from {})",
            self.protocol,
            SocketDisplay(self.orig_src, self.orig_sport),
            SocketDisplay(self.orig_dst, self.orig_dport),
            SocketDisplay(self.reply_src, self.reply_sport),
        )
    }
}

/// `ip:port`, with brackets around IPv6 addresses.
struct SocketDisplay(IpAddr, u16);

impl fmt::Display for SocketDisplay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            IpAddr::V4(ip) => write!(f, "{ip}:{}", self.1),
            IpAddr::V6(ip) => write!(f, "[{ip}]:{}", self.1),
        }
    }
}

/// A Service frontend as conntrack entries are matched against it: its protocol, address (or
/// NodePort family) and port. The frontends themselves, with their endpoints, come from
/// [`crate::frontend::Frontends`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Frontend {
    /// A ClusterIP, external IP or LoadBalancer IP with the Service port.
    Ip {
        /// The protocol.
        protocol: Protocol,
        /// The address.
        ip: IpAddr,
        /// The Service port.
        port: u16,
    },
    /// A NodePort, on any of the node's addresses of one family.
    NodePort {
        /// The protocol.
        protocol: Protocol,
        /// The family of the node addresses it answers on.
        family: IpFamily,
        /// The NodePort.
        port: u16,
    },
}

impl Frontend {
    /// The frontend's protocol.
    pub fn protocol(&self) -> Protocol {
        match self {
            Frontend::Ip { protocol, .. } | Frontend::NodePort { protocol, .. } => *protocol,
        }
    }

    /// The frontend's IP family.
    pub fn family(&self) -> IpFamily {
        match self {
            Frontend::Ip { ip, .. } => IpFamily::of(ip),
            Frontend::NodePort { family, .. } => *family,
        }
    }
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Frontend::Ip { protocol, ip, port } => {
                write!(f, "{protocol} {}", SocketDisplay(*ip, *port))
            }
            Frontend::NodePort {
                protocol,
                family,
                port,
            } => write!(f, "{protocol} NodePort {port} ({})", family.as_str()),
        }
    }
}

/// Why an entry is stale.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Staleness {
    /// It was translated to an endpoint that no longer serves this frontend.
    EndpointGone,
    /// It was never translated (sent while the frontend had no endpoints), and now the
    /// frontend has endpoints.
    Untranslated,
    /// Its frontend is no longer programmed (Service, port, IP or NodePort deleted).
    FrontendGone,
}

/// What [`ConntrackPlanner::check`] says about one entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Check {
    /// Not addressed to a frontend this proxy programs or programmed, or not UDP or SCTP:
    /// never touched.
    NotOurs,
    /// Addressed to one of our frontends and still valid.
    Valid(Frontend),
    /// Addressed to one of our frontends, and stale: delete it.
    Stale(Frontend, Staleness),
}

/// The reply sources one frontend allows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Allowed {
    /// Endpoint address and port.
    endpoints: HashSet<(IpAddr, u16)>,
    /// Whether any endpoint of each family is allowed, indexed by `IpFamily as usize`.
    has_family: [bool; 2],
}

impl Allowed {
    fn insert(&mut self, ep: &Endpoint) {
        self.endpoints.insert((ep.ip, ep.port));
        self.has_family[IpFamily::of(&ep.ip) as usize] = true;
    }

    fn merge(&mut self, other: &Allowed) {
        self.endpoints.extend(other.endpoints.iter().copied());
        for (mine, theirs) in self.has_family.iter_mut().zip(other.has_family) {
            *mine |= theirs;
        }
    }
}

/// An IP frontend's key: (protocol, address, port).
type IpKey = (Protocol, IpAddr, u16);
/// A NodePort's key: (protocol, family, port).
type NodePortKey = (Protocol, IpFamily, u16);

/// What one Service contributes to the index: its UDP and SCTP frontends, each with the reply
/// sources its port allows.
#[derive(Debug, Default)]
struct Contribution {
    ips: Vec<(IpKey, Arc<Allowed>)>,
    node_ports: Vec<(NodePortKey, Arc<Allowed>)>,
}

/// Indexes Service frontends and their allowed endpoints, and judges conntrack entries against
/// them. Holds the memory of forgotten frontends between syncs; see the module docs.
#[derive(Debug, Default)]
pub struct ConntrackPlanner {
    /// Current IP frontends, with what every Service port using them allows.
    ips: HashMap<IpKey, Arc<Allowed>>,
    /// Current NodePorts, likewise.
    node_ports: HashMap<NodePortKey, Arc<Allowed>>,
    /// Each indexed Service's contribution, so that a change re-indexes that Service alone.
    by_service: HashMap<ServiceKey, Contribution>,
    /// The Services contributing to each frontend (nearly always one).
    ip_owners: HashMap<IpKey, Vec<ServiceKey>>,
    node_port_owners: HashMap<NodePortKey, Vec<ServiceKey>>,
    /// Frontends indexed before and missing now, with the number of updates since.
    forgotten: HashMap<Frontend, u32>,
}

impl ConntrackPlanner {
    /// An empty planner: nothing is ours yet.
    pub fn new() -> Self {
        ConntrackPlanner::default()
    }

    /// Re-indexes the frontends of every UDP and SCTP Service port in `state`, for the IP
    /// `families` this proxy programs. Frontends indexed before and missing now are
    /// remembered as forgotten.
    ///
    /// Call it only with a state the dataplane has programmed (after a successful sync): a
    /// state that is still empty at start-up would make every frontend look deleted.
    pub fn update(&mut self, state: &ProxyState, families: &[IpFamily]) {
        let all: HashSet<ServiceKey> = state
            .service_keys()
            .chain(self.by_service.keys())
            .cloned()
            .collect();
        self.update_services(state, &all, families);
    }

    /// Re-indexes the given Services only (changed, added or deleted since the last update),
    /// as [`update`](Self::update) does for all of them: the cost follows the change, not the
    /// cluster. A change that can alter any Service's endpoint selection (the Node's) needs a
    /// full [`update`](Self::update).
    pub fn update_services<'a>(
        &mut self,
        state: &ProxyState,
        services: impl IntoIterator<Item = &'a ServiceKey>,
        families: &[IpFamily],
    ) {
        // Age the forgotten (an update is an update, whatever it touches).
        self.forgotten.retain(|_, age| {
            *age += 1;
            *age <= FORGOTTEN_UPDATES
        });
        let mut touched_ips: HashSet<IpKey> = HashSet::new();
        let mut touched_node_ports: HashSet<NodePortKey> = HashSet::new();
        for key in services {
            if let Some(old) = self.by_service.remove(key) {
                for (k, _) in old.ips {
                    disown(&mut self.ip_owners, k, key);
                    touched_ips.insert(k);
                }
                for (k, _) in old.node_ports {
                    disown(&mut self.node_port_owners, k, key);
                    touched_node_ports.insert(k);
                }
            }
            let new = contribution(state, key, families);
            if new.ips.is_empty() && new.node_ports.is_empty() {
                continue;
            }
            for (k, _) in &new.ips {
                own(&mut self.ip_owners, *k, key);
                touched_ips.insert(*k);
            }
            for (k, _) in &new.node_ports {
                own(&mut self.node_port_owners, *k, key);
                touched_node_ports.insert(*k);
            }
            self.by_service.insert(key.clone(), new);
        }
        for k in touched_ips {
            let (protocol, ip, port) = k;
            let merged = merged(&self.ip_owners, &self.by_service, &k, |c| &c.ips);
            reindex(
                &mut self.ips,
                &mut self.forgotten,
                k,
                merged,
                Frontend::Ip { protocol, ip, port },
            );
        }
        for k in touched_node_ports {
            let (protocol, family, port) = k;
            let merged = merged(&self.node_port_owners, &self.by_service, &k, |c| {
                &c.node_ports
            });
            reindex(
                &mut self.node_ports,
                &mut self.forgotten,
                k,
                merged,
                Frontend::NodePort {
                    protocol,
                    family,
                    port,
                },
            );
        }
    }

    /// Tells the planner that a reconcile run after the last [`update`](Self::update)
    /// succeeded: the entries of forgotten frontends are gone, so they need not be remembered.
    pub fn reconciled(&mut self) {
        self.forgotten.clear();
    }

    /// Whether any current or forgotten frontend has this family and protocol: if not, no entry
    /// of that kind can be stale and the kernel need not be asked for them.
    pub fn wants(&self, family: IpFamily, protocol: Protocol) -> bool {
        self.ips
            .keys()
            .any(|&(p, ip, _)| p == protocol && IpFamily::of(&ip) == family)
            || self
                .node_ports
                .keys()
                .any(|&(p, f, _)| p == protocol && f == family)
            || self
                .forgotten
                .keys()
                .any(|f| f.protocol() == protocol && f.family() == family)
    }

    /// The current frontends, in no particular order.
    pub fn frontends(&self) -> impl Iterator<Item = Frontend> + '_ {
        let ips = self
            .ips
            .keys()
            .map(|&(protocol, ip, port)| Frontend::Ip { protocol, ip, port });
        let node_ports =
            self.node_ports
                .keys()
                .map(|&(protocol, family, port)| Frontend::NodePort {
                    protocol,
                    family,
                    port,
                });
        ips.chain(node_ports)
    }

    /// The forgotten frontends still remembered, in no particular order.
    pub fn forgotten(&self) -> impl Iterator<Item = Frontend> + '_ {
        self.forgotten.keys().copied()
    }

    /// Whether `entry` is stale. `node_port_addrs` are the addresses NodePorts answer on (all
    /// of the node's local addresses is safe: an entry to another address never matches a
    /// NodePort).
    pub fn stale(&self, entry: &FlowEntry, node_port_addrs: &HashSet<IpAddr>) -> bool {
        matches!(self.check(entry, node_port_addrs), Check::Stale(..))
    }

    /// Judges `entry`, saying which frontend it belongs to and why it is stale.
    ///
    /// An IP frontend wins over a NodePort on the same address and port, as in the
    /// dataplanes, where Service IPs are matched before NodePorts.
    pub fn check(&self, entry: &FlowEntry, node_port_addrs: &HashSet<IpAddr>) -> Check {
        let protocol = entry.protocol;
        if protocol == Protocol::Tcp {
            return Check::NotOurs;
        }
        let ip_frontend = Frontend::Ip {
            protocol,
            ip: entry.orig_dst,
            port: entry.orig_dport,
        };
        if let Some(allowed) = self.ips.get(&(protocol, entry.orig_dst, entry.orig_dport)) {
            return judge(ip_frontend, allowed, entry);
        }
        let on_node = node_port_addrs.contains(&entry.orig_dst);
        let family = entry.family();
        let node_port = Frontend::NodePort {
            protocol,
            family,
            port: entry.orig_dport,
        };
        if on_node {
            if let Some(allowed) = self.node_ports.get(&(protocol, family, entry.orig_dport)) {
                return judge(node_port, allowed, entry);
            }
        }
        if self.forgotten.contains_key(&ip_frontend) {
            return Check::Stale(ip_frontend, Staleness::FrontendGone);
        }
        if on_node && self.forgotten.contains_key(&node_port) {
            return Check::Stale(node_port, Staleness::FrontendGone);
        }
        Check::NotOurs
    }
}

/// The UDP and SCTP frontends of one Service in `state` (none if it is gone or TCP only). Two
/// ports of the Service sharing one frontend allow the endpoints of both.
fn contribution(state: &ProxyState, key: &ServiceKey, families: &[IpFamily]) -> Contribution {
    let mut c = Contribution::default();
    let ports = state.service_ports(key);
    if ports.iter().all(|p| p.name.protocol == Protocol::Tcp) {
        return c;
    }
    for sps in state.service_state(key) {
        let port = &sps.port;
        if port.name.protocol == Protocol::Tcp {
            continue;
        }
        let mut allowed = Allowed::default();
        for ep in state.endpoints(&port.name).iter().filter(|e| e.serving) {
            allowed.insert(ep);
        }
        for ep in sps.endpoints.cluster.iter().chain(&sps.endpoints.local) {
            allowed.insert(ep);
        }
        let allowed = Arc::new(allowed);
        for family in families {
            for f in Frontends::of(&sps, *family).iter() {
                match f.address {
                    Some(ip) => add(&mut c.ips, (f.protocol, ip, f.port), &allowed),
                    None => add(&mut c.node_ports, (f.protocol, f.family, f.port), &allowed),
                }
            }
        }
    }
    c
}

/// Adds a frontend to a Service's list, merging with an entry of the same key.
fn add<K: PartialEq>(list: &mut Vec<(K, Arc<Allowed>)>, key: K, allowed: &Arc<Allowed>) {
    match list.iter_mut().find(|(k, _)| *k == key) {
        Some((_, existing)) => Arc::make_mut(existing).merge(allowed),
        None => list.push((key, allowed.clone())),
    }
}

fn own<K: std::hash::Hash + Eq>(owners: &mut HashMap<K, Vec<ServiceKey>>, k: K, svc: &ServiceKey) {
    owners.entry(k).or_default().push(svc.clone());
}

fn disown<K: std::hash::Hash + Eq>(
    owners: &mut HashMap<K, Vec<ServiceKey>>,
    k: K,
    svc: &ServiceKey,
) {
    if let Some(v) = owners.get_mut(&k) {
        v.retain(|s| s != svc);
        if v.is_empty() {
            owners.remove(&k);
        }
    }
}

/// What every Service owning frontend `k` allows, together (`None` when no Service owns it).
fn merged<K: std::hash::Hash + Eq>(
    owners: &HashMap<K, Vec<ServiceKey>>,
    by_service: &HashMap<ServiceKey, Contribution>,
    k: &K,
    list: impl Fn(&Contribution) -> &Vec<(K, Arc<Allowed>)>,
) -> Option<Arc<Allowed>> {
    let mut out: Option<Arc<Allowed>> = None;
    for svc in owners.get(k)? {
        let Some(c) = by_service.get(svc) else {
            continue;
        };
        for (_, allowed) in list(c).iter().filter(|(key, _)| key == k) {
            match &mut out {
                None => out = Some(allowed.clone()),
                Some(acc) => Arc::make_mut(acc).merge(allowed),
            }
        }
    }
    out
}

/// Sets frontend `k` to `allowed`, or, when nothing allows it any more, forgets it (if it was
/// indexed); a frontend indexed again is no longer forgotten.
fn reindex<K: std::hash::Hash + Eq>(
    index: &mut HashMap<K, Arc<Allowed>>,
    forgotten: &mut HashMap<Frontend, u32>,
    k: K,
    allowed: Option<Arc<Allowed>>,
    frontend: Frontend,
) {
    match allowed {
        Some(a) => {
            index.insert(k, a);
            forgotten.remove(&frontend);
        }
        None => {
            if index.remove(&k).is_some() {
                forgotten.insert(frontend, 0);
            }
        }
    }
}

fn judge(frontend: Frontend, allowed: &Allowed, entry: &FlowEntry) -> Check {
    if allowed
        .endpoints
        .contains(&(entry.reply_src, entry.reply_sport))
    {
        return Check::Valid(frontend);
    }
    if !entry.translated() {
        if allowed.has_family[entry.family() as usize] {
            return Check::Stale(frontend, Staleness::Untranslated);
        }
        return Check::Valid(frontend);
    }
    Check::Stale(frontend, Staleness::EndpointGone)
}

#[cfg(test)]
mod tests;
