//! The balancer: every frontend's route, and for each new connection or UDP session the
//! endpoints to try, in order, with the source address each attempt uses.
//!
//! Routes come from [`kp_core::frontend::Frontends`], the expansion every mode uses: one route
//! per Service port and IP family, holding the endpoint sets its policies use; one entry per
//! frontend (`protocol . address . port`, or `protocol . port` for a NodePort) pointing at its
//! route with the frontend's policy, masquerading and source ranges. Upstream's userspace proxy
//! (`pkg/proxy/userspace/roundrobin.go`, removed in 1.26) kept one round-robin state per
//! Service port with ClientIP affinity; here any IPVS scheduler ([`Scheduler`]) picks, and
//! endpoints that refused or timed out are tried last for a while (passive health).

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use ipnet::IpNet;
use kp_core::frontend::{Frontend, FrontendKind, Frontends, Masquerade, TrafficPolicy};
use kp_core::model::{IpFamily, Protocol, ServiceKey, ServicePortName};
use kp_core::node::{DetectLocal, NodeContext};
use kp_core::track::{Changes, ProxyState};

use crate::schedule::{Candidates, Scheduler};

/// How the balancer picks and masquerades.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BalancerConfig {
    /// Which IPVS scheduler picks the first endpoint to try.
    pub scheduler: Scheduler,
    /// `masqueradeAll`: every ClusterIP connection leaves with the node's address.
    pub masquerade_all: bool,
    /// Detect-local: with [`DetectLocal::None`] ClusterIP traffic keeps its source; otherwise
    /// traffic that is not a pod's is masqueraded, and a pod's counts for the `Local` policy's
    /// short-circuit. Which traffic is a pod's depends on the form:
    ///
    /// - by CIDR (`ClusterCIDR`, `NodeCIDR`): a source inside [`NodeContext::local_cidrs`] (as
    ///   resolved at each sync);
    /// - by interface (`BridgeInterface`, `InterfaceNamePrefix`): a connection that arrived on
    ///   the pods' interface(s), [`Arrival::PodInterface`]. The accepted socket gives the
    ///   client's address but not the interface, and the address says nothing about it (the
    ///   reason to configure an interface at all), so the redirect table tells: it sends what
    ///   arrives there (`iifname`) to the pod port ([`crate::RedirectConfig::pod_port`]), and
    ///   the proxy passes what it accepted there to [`Balancer::pick_via`] as such. The
    ///   node's own connections never arrive on an interface; any other source is not a pod's.
    pub detect_local: DetectLocal,
    /// How long an endpoint that refused or timed out is tried last (passive health).
    pub quarantine: Duration,
}

/// Identifies a Service port's route (for [`Balancer::report`] and metrics labels): the
/// Service port (kp_core's [`ServicePortName`]) and the IP family of its frontends, as each
/// family has its own endpoints.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RouteId {
    /// The Service port.
    pub service_port: ServicePortName,
    /// The IP family of the route's frontends and endpoints.
    pub family: IpFamily,
}

/// Which address the endpoint sees as the connection's source.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Source {
    /// The node's own (a plain socket: the kernel picks the node's address on the route to the
    /// endpoint, as masquerading does).
    Node,
    /// The client's own (a transparent socket bound to the client's address).
    Client,
}

/// How a connection reached the proxy, as far as the proxy can tell (see
/// [`BalancerConfig::detect_local`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arrival {
    /// The node's own: its source is one of the node's addresses.
    Node,
    /// Arrived on the pods' interface(s): accepted on the pod port, where the redirect table
    /// sends only that with detect-local by interface.
    PodInterface,
    /// Anything else (accepted on the proxy port): from outside, or with detect-local by CIDR
    /// from anywhere (the source address decides).
    Other,
}

/// One endpoint to try, and with which source.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Attempt {
    /// The endpoint.
    pub endpoint: SocketAddr,
    /// The source the endpoint sees.
    pub source: Source,
}

/// What to do with a new connection or UDP session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pick {
    /// Try these in order until one connects: the scheduler's (or the affinity's) choice
    /// first, then the other endpoints, quarantined ones last.
    Connect {
        /// The route, for [`Balancer::report`].
        route: RouteId,
        /// The attempts, in order; never empty.
        attempts: Vec<Attempt>,
    },
    /// The kernel rules should have rejected this (a race with a sync): close it.
    Reject,
    /// The kernel rules should have dropped this (a race with a sync): ignore it.
    Drop,
    /// No frontend at this address and port (e.g. a direct connection to the proxy port).
    NotAService,
}

/// What became of an attempt, or later of the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// The endpoint accepted the connection (it counts as active until [`Outcome::Closed`]).
    Connected,
    /// The endpoint refused (TCP reset, ICMP unreachable): quarantined.
    Refused,
    /// The endpoint did not answer in time: quarantined.
    TimedOut,
    /// A connection that was [`Outcome::Connected`] ended.
    Closed,
}

/// Counters since the balancer was made, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BalancerStats {
    /// Picks that returned [`Pick::Connect`].
    pub picks: u64,
    /// Picks whose first attempt came from a ClientIP affinity entry.
    pub affinity_hits: u64,
    /// Attempts reported [`Outcome::Connected`].
    pub connected: u64,
    /// Attempts reported [`Outcome::Refused`].
    pub refused: u64,
    /// Attempts reported [`Outcome::TimedOut`].
    pub timed_out: u64,
    /// Connections reported [`Outcome::Closed`].
    pub closed: u64,
    /// Times an endpoint entered quarantine (a failure while it was already quarantined
    /// extends it and is not counted again).
    pub quarantined: u64,
}

/// What the last [`Balancer::sync`] did: its cost, in routes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SyncStats {
    /// Services whose routes were derived again.
    pub services: usize,
    /// Routes built (one per Service port and family with frontends).
    pub routes_built: usize,
    /// Routes removed (including those rebuilt).
    pub routes_removed: usize,
    /// Frontend entries after the sync.
    pub frontends: usize,
    /// Routes after the sync.
    pub routes: usize,
}

/// A frontend's key: `protocol . address . port`.
type VipKey = (Protocol, IpAddr, u16);
/// A NodePort's key: `protocol . family . port`.
type NodePortKey = (Protocol, IpFamily, u16);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum FrontKey {
    Vip(VipKey),
    NodePort(NodePortKey),
}

/// One frontend: which route, and how its traffic is treated.
#[derive(Clone, Debug)]
struct Entry {
    route: usize,
    /// Where its Service port stands when several claim the frontend: Service namespace and
    /// name, then port name (see [`Claims`]).
    rank: (ServiceKey, String),
    external: bool,
    policy: TrafficPolicy,
    masquerade: Masquerade,
    /// LoadBalancer source ranges (of either family: a client of another family never
    /// matches), with the LoadBalancer IP itself when the node may reach it.
    source_ranges: Option<Vec<IpNet>>,
}

/// The claims of Service ports on frontends of one kind, by the nftables mode's rule (its
/// element record's `join_claim` and `drop_claim`): of the Service ports that claim a frontend,
/// the first by rank (Service namespace and name, then port name) holds it, whatever order the
/// claims came in; the others wait in rank order, and when the holder lets go the first waiting
/// takes over. So a partial sync leaves a frontend where a full sync puts it, as the redirect
/// table and the nftables mode do.
struct Claims<'a, K> {
    held: &'a mut HashMap<K, Entry>,
    waiting: &'a mut HashMap<K, Vec<Entry>>,
}

impl<'a, K: std::hash::Hash + Eq + Copy> Claims<'a, K> {
    fn new(held: &'a mut HashMap<K, Entry>, waiting: &'a mut HashMap<K, Vec<Entry>>) -> Self {
        Claims { held, waiting }
    }

    /// Route `entry.route` claims `key`: it holds it if no one does or it comes before the
    /// holder (which then waits first), else it waits in rank order (once).
    fn claim(&mut self, key: K, entry: Entry) {
        let Some(holder) = self.held.get_mut(&key) else {
            self.held.insert(key, entry);
            return;
        };
        if holder.route == entry.route {
            return;
        }
        let list = self.waiting.entry(key).or_default();
        if list.iter().any(|e| e.route == entry.route) {
            return;
        }
        if entry.rank < holder.rank {
            let before = std::mem::replace(holder, entry);
            list.insert(0, before);
        } else {
            let at = list.partition_point(|e| e.rank < entry.rank);
            list.insert(at, entry);
        }
    }

    /// Route `slot` lets go of `key`: a waiting claim takes over if it held it.
    fn release(&mut self, key: &K, slot: usize) {
        let holds = self.held.get(key).is_some_and(|e| e.route == slot);
        let Some(list) = self.waiting.get_mut(key) else {
            if holds {
                self.held.remove(key);
            }
            return;
        };
        if holds {
            let next = list.remove(0);
            self.held.insert(*key, next);
        } else {
            list.retain(|e| e.route != slot);
        }
        if list.is_empty() {
            self.waiting.remove(key);
        }
    }
}

/// ClientIP affinity: the endpoint a client sticks to, until `expires`.
#[derive(Clone, Copy, Debug)]
struct Sticky {
    endpoint: SocketAddr,
    expires: Instant,
}

/// The per-endpoint state a route keeps across rebuilds.
#[derive(Clone, Debug, Default)]
struct Carried {
    rr: [usize; 2],
    active: HashMap<SocketAddr, u32>,
    sticky: HashMap<IpAddr, Sticky>,
}

/// A Service port's route in one family.
#[derive(Clone, Debug)]
struct Route {
    id: RouteId,
    /// Endpoints of the `Cluster` set (and of the short-circuit), in selection order.
    cluster: Vec<SocketAddr>,
    /// Endpoints of the `Local` set.
    local: Vec<SocketAddr>,
    /// Whether any endpoint of the family can serve, anywhere.
    has_endpoints: bool,
    affinity: Option<Duration>,
    frontends: Vec<FrontKey>,
    state: Carried,
}

/// Every frontend's route; what the proxy consults for each new connection or UDP session.
/// Not thread-safe by itself: the proxy holds it in a Mutex and keeps each call short.
#[derive(Debug)]
pub struct Balancer {
    config: BalancerConfig,
    /// Routes by slot; `None` slots are in `free`.
    routes: Vec<Option<Route>>,
    free: Vec<usize>,
    by_id: HashMap<RouteId, usize>,
    by_service: HashMap<ServiceKey, Vec<usize>>,
    /// Each frontend's entry: the route of the first Service port by rank that claims it (see
    /// [`Claims`]).
    vips: HashMap<VipKey, Entry>,
    node_ports: HashMap<NodePortKey, Entry>,
    /// The entries of further Service ports claiming a frontend already held, in rank order:
    /// nearly always empty.
    vips_waiting: HashMap<VipKey, Vec<Entry>>,
    node_ports_waiting: HashMap<NodePortKey, Vec<Entry>>,
    /// Where NodePorts answer, per family; empty for anywhere the kernel sends them.
    node_port_addresses: Vec<IpNet>,
    /// Detect-local's pod networks.
    local_cidrs: Vec<IpNet>,
    /// Endpoints tried last until the instant given.
    quarantine: HashMap<SocketAddr, Instant>,
    /// Slots of the routes with ClientIP affinity, so [`Balancer::expire`] visits only them.
    sticky_slots: BTreeSet<usize>,
    stats: BalancerStats,
    last_sync: SyncStats,
}

impl Balancer {
    /// An empty balancer: every pick is [`Pick::NotAService`] until the first sync.
    pub fn new(config: BalancerConfig) -> Balancer {
        Balancer {
            config,
            routes: Vec::new(),
            free: Vec::new(),
            by_id: HashMap::new(),
            by_service: HashMap::new(),
            vips: HashMap::new(),
            node_ports: HashMap::new(),
            vips_waiting: HashMap::new(),
            node_ports_waiting: HashMap::new(),
            node_port_addresses: Vec::new(),
            local_cidrs: Vec::new(),
            quarantine: HashMap::new(),
            sticky_slots: BTreeSet::new(),
            stats: BalancerStats::default(),
            last_sync: SyncStats::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &BalancerConfig {
        &self.config
    }

    /// Re-derives the routes of the Service ports `changes` names (every one when `full`, or
    /// when the node's context changed), through [`Frontends`]. Cost proportional to the
    /// change: see [`Balancer::last_sync`].
    pub fn sync(&mut self, state: &ProxyState, node: &NodeContext, changes: &Changes, full: bool) {
        self.node_port_addresses = node.node_port_addresses.clone();
        self.local_cidrs = match self.config.detect_local {
            DetectLocal::None => Vec::new(),
            _ => node.local_cidrs.clone(),
        };
        let mut stats = SyncStats::default();
        if full || changes.node_changed {
            let mut keys: Vec<ServiceKey> = self.by_service.keys().cloned().collect();
            keys.extend(state.service_keys().cloned());
            keys.sort();
            keys.dedup();
            for key in &keys {
                self.replace_service(state, node, key, &mut stats);
            }
        } else {
            for key in &changes.services {
                self.replace_service(state, node, key, &mut stats);
            }
        }
        stats.frontends = self.vips.len() + self.node_ports.len();
        stats.routes = self.by_id.len();
        self.last_sync = stats;
    }

    /// What the last [`Balancer::sync`] cost and left.
    pub fn last_sync(&self) -> SyncStats {
        self.last_sync
    }

    /// Counters since the balancer was made.
    pub fn stats(&self) -> BalancerStats {
        self.stats
    }

    /// Endpoints in quarantine now (expired ones count until [`Balancer::expire`]).
    pub fn quarantined(&self) -> usize {
        self.quarantine.len()
    }

    /// ClientIP affinity entries held now, over every route.
    pub fn affinity_entries(&self) -> usize {
        self.routes
            .iter()
            .flatten()
            .map(|r| r.state.sticky.len())
            .sum()
    }

    /// Active connections the balancer counts for `endpoint` on `route`.
    pub fn active(&self, route: &RouteId, endpoint: SocketAddr) -> u32 {
        self.route(route)
            .and_then(|r| r.state.active.get(&endpoint).copied())
            .unwrap_or(0)
    }

    /// The ClientIP affinity timeout of `route`; `None` without affinity or for a route that
    /// is gone.
    pub fn affinity(&self, route: &RouteId) -> Option<Duration> {
        self.route(route)?.affinity
    }

    fn route(&self, id: &RouteId) -> Option<&Route> {
        let slot = *self.by_id.get(id)?;
        self.routes.get(slot)?.as_ref()
    }

    fn replace_service(
        &mut self,
        state: &ProxyState,
        node: &NodeContext,
        key: &ServiceKey,
        stats: &mut SyncStats,
    ) {
        stats.services += 1;
        let mut carried: HashMap<RouteId, Carried> = HashMap::new();
        for slot in self.by_service.remove(key).unwrap_or_default() {
            if let Some(route) = self.remove_route(slot) {
                carried.insert(route.id, route.state);
                stats.routes_removed += 1;
            }
        }
        let mut slots = Vec::new();
        for sps in state.service_state(key) {
            for family in IpFamily::ALL {
                let fronts = Frontends::of(&sps, family);
                let id = RouteId {
                    service_port: sps.port.name.clone(),
                    family,
                };
                let state = carried.remove(&id).unwrap_or_default();
                if let Some(slot) = self.add_route(node, &fronts, id, state) {
                    slots.push(slot);
                    stats.routes_built += 1;
                }
            }
        }
        if !slots.is_empty() {
            self.by_service.insert(key.clone(), slots);
        }
    }

    fn remove_route(&mut self, slot: usize) -> Option<Route> {
        let route = self.routes.get_mut(slot)?.take()?;
        self.free.push(slot);
        self.sticky_slots.remove(&slot);
        self.by_id.remove(&route.id);
        for key in &route.frontends {
            match key {
                FrontKey::Vip(k) => {
                    Claims::new(&mut self.vips, &mut self.vips_waiting).release(k, slot);
                }
                FrontKey::NodePort(k) => {
                    Claims::new(&mut self.node_ports, &mut self.node_ports_waiting)
                        .release(k, slot);
                }
            }
        }
        Some(route)
    }

    fn add_route(
        &mut self,
        node: &NodeContext,
        fronts: &Frontends<'_>,
        id: RouteId,
        mut state: Carried,
    ) -> Option<usize> {
        let list: Vec<Frontend<'_>> = fronts.iter().collect();
        if list.is_empty() {
            return None;
        }
        let addrs = |eps: &[&kp_core::model::Endpoint]| -> Vec<SocketAddr> {
            eps.iter().map(|e| SocketAddr::new(e.ip, e.port)).collect()
        };
        let cluster = addrs(fronts.cluster_endpoints());
        let local = addrs(fronts.local_endpoints());
        // Counts of endpoints that left and have no open connection are dropped; affinity to
        // an endpoint that left is dropped too (the next pick chooses again).
        state
            .active
            .retain(|ep, n| *n > 0 || cluster.contains(ep) || local.contains(ep));
        state
            .sticky
            .retain(|_, s| cluster.contains(&s.endpoint) || local.contains(&s.endpoint));
        let slot = self.free.pop().unwrap_or(self.routes.len());
        let mut keys = Vec::with_capacity(list.len());
        for f in &list {
            let source_ranges = f.source_ranges().map(|r| {
                let mut nets: Vec<IpNet> = r.of_family().copied().collect();
                if let (true, Some(ip)) = (f.admits_node(node), f.address) {
                    nets.push(IpNet::from(ip));
                }
                nets
            });
            let entry = Entry {
                route: slot,
                rank: (
                    id.service_port.service.clone(),
                    id.service_port.port.clone(),
                ),
                external: f.is_external(),
                policy: f.policy,
                masquerade: f.masquerade,
                source_ranges,
            };
            let key = match (f.kind, f.address) {
                (FrontendKind::NodePort, _) | (_, None) => {
                    let k = (f.protocol, f.family, f.port);
                    Claims::new(&mut self.node_ports, &mut self.node_ports_waiting).claim(k, entry);
                    FrontKey::NodePort(k)
                }
                (_, Some(ip)) => {
                    let k = (f.protocol, ip, f.port);
                    Claims::new(&mut self.vips, &mut self.vips_waiting).claim(k, entry);
                    FrontKey::Vip(k)
                }
            };
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
        let affinity = fronts
            .port()
            .session_affinity_timeout
            .map(|s| Duration::from_secs(u64::from(s)));
        let route = Route {
            cluster,
            local,
            has_endpoints: fronts.has_endpoints(),
            affinity,
            frontends: keys,
            state,
            id: id.clone(),
        };
        if slot == self.routes.len() {
            self.routes.push(Some(route));
        } else {
            self.routes[slot] = Some(route);
        }
        self.by_id.insert(id, slot);
        if affinity.is_some() {
            self.sticky_slots.insert(slot);
        }
        Some(slot)
    }

    /// Whether a connection from `ip` that reached the proxy by `arrival` is a pod's (see
    /// [`BalancerConfig::detect_local`]): by detect-local's networks, or with detect-local by
    /// interface, by the interface it arrived on.
    fn is_pod(&self, ip: IpAddr, arrival: Arrival) -> bool {
        if self.config.detect_local.interface().is_some() {
            return arrival == Arrival::PodInterface;
        }
        self.local_cidrs.iter().any(|n| n.contains(&ip))
    }

    fn entry(&self, protocol: Protocol, dst: SocketAddr) -> Option<&Entry> {
        let ip = dst.ip();
        if let Some(e) = self.vips.get(&(protocol, ip, dst.port())) {
            return Some(e);
        }
        let family = IpFamily::of(&ip);
        let restricted: Vec<&IpNet> = self
            .node_port_addresses
            .iter()
            .filter(|n| IpFamily::of_net(n) == family)
            .collect();
        if !restricted.is_empty() && !restricted.iter().any(|n| n.contains(&ip)) {
            return None;
        }
        self.node_ports.get(&(protocol, family, dst.port()))
    }

    /// What to do with a new TCP connection / UDP session to `original_dst` from `client`.
    /// `client_is_node`: the client address is one of this node's own addresses. Otherwise the
    /// connection counts as [`Arrival::Other`] (not from the pods' interface): see
    /// [`Balancer::pick_via`].
    pub fn pick(
        &mut self,
        protocol: Protocol,
        original_dst: SocketAddr,
        client: SocketAddr,
        client_is_node: bool,
        now: Instant,
    ) -> Pick {
        let arrival = if client_is_node {
            Arrival::Node
        } else {
            Arrival::Other
        };
        self.pick_via(protocol, original_dst, client, arrival, now)
    }

    /// [`Balancer::pick`] for a connection that reached the proxy by `arrival`: the node's own,
    /// accepted on the pod port (a pod's, with detect-local by interface), or else.
    pub fn pick_via(
        &mut self,
        protocol: Protocol,
        original_dst: SocketAddr,
        client: SocketAddr,
        arrival: Arrival,
        now: Instant,
    ) -> Pick {
        let client_is_node = arrival == Arrival::Node;
        let Some(entry) = self.entry(protocol, original_dst) else {
            return Pick::NotAService;
        };
        let client_ip = client.ip();
        if let Some(ranges) = &entry.source_ranges {
            if !ranges.iter().any(|n| n.contains(&client_ip)) {
                return Pick::Drop;
            }
        }
        let from_pod = self.is_pod(client_ip, arrival);
        let masquerade = entry.masquerade;
        // `externalTrafficPolicy: Local`: pods and the node itself short-circuit to every
        // endpoint, as if through the load balancer to any node.
        let policy = if entry.external
            && entry.policy == TrafficPolicy::Local
            && (client_is_node || from_pod)
        {
            TrafficPolicy::Cluster
        } else {
            entry.policy
        };
        let slot = entry.route;
        let Some(route) = self.routes.get_mut(slot).and_then(Option::as_mut) else {
            return Pick::NotAService;
        };
        // Field by field, so the scheduler may advance `route.state` meanwhile.
        let set: &[SocketAddr] = match policy {
            TrafficPolicy::Cluster => &route.cluster,
            TrafficPolicy::Local => &route.local,
        };
        if set.is_empty() {
            return if route.has_endpoints {
                Pick::Drop
            } else {
                Pick::Reject
            };
        }
        let healthy: Vec<bool> = set
            .iter()
            .map(|ep| self.quarantine.get(ep).is_none_or(|until| *until <= now))
            .collect();
        let sticky = route.affinity.and_then(|timeout| {
            let s = route.state.sticky.get(&client_ip)?;
            let i = set.iter().position(|ep| *ep == s.endpoint)?;
            (s.expires > now && healthy[i]).then_some((i, timeout))
        });
        let chosen = match sticky {
            Some((i, _)) => {
                self.stats.affinity_hits += 1;
                Some(i)
            }
            None => {
                let active: Vec<u32> = set
                    .iter()
                    .map(|ep| route.state.active.get(ep).copied().unwrap_or(0))
                    .collect();
                let candidates = Candidates {
                    active: &active,
                    healthy: &healthy,
                    client: client_ip,
                    destination: original_dst.ip(),
                };
                self.config
                    .scheduler
                    .choose(&candidates, &mut route.state.rr[policy as usize])
            }
        };
        let Some(chosen) = chosen else {
            return Pick::Reject;
        };
        if let Some(timeout) = route.affinity {
            route.state.sticky.insert(
                client_ip,
                Sticky {
                    endpoint: set[chosen],
                    expires: now + timeout,
                },
            );
        }
        // The choice, then the others in route order from it, quarantined ones last.
        let n = set.len();
        let rest = (1..n).map(|k| (chosen + k) % n);
        let ordered: Vec<usize> = std::iter::once(chosen)
            .chain(rest.clone().filter(|i| healthy[*i]))
            .chain(rest.filter(|i| !healthy[*i]))
            .collect();
        let masquerade_all = self.config.masquerade_all;
        let detect_local = !matches!(self.config.detect_local, DetectLocal::None);
        let attempts = ordered
            .into_iter()
            .map(|i| {
                let endpoint = set[i];
                let masqueraded = endpoint.ip() == client_ip
                    || client_is_node
                    || match masquerade {
                        Masquerade::Always => true,
                        Masquerade::FromNode => false,
                        Masquerade::NotFromPods => masquerade_all || (detect_local && !from_pod),
                    };
                Attempt {
                    endpoint,
                    source: if masqueraded {
                        Source::Node
                    } else {
                        Source::Client
                    },
                }
            })
            .collect();
        self.stats.picks += 1;
        Pick::Connect {
            route: route.id.clone(),
            attempts,
        }
    }

    /// What became of an attempt (and later, the connection's end), for lc/sed/nq counts,
    /// passive health and affinity. A route or endpoint that is gone by now is ignored,
    /// except that failures still quarantine the endpoint.
    pub fn report(
        &mut self,
        route: &RouteId,
        endpoint: SocketAddr,
        outcome: Outcome,
        now: Instant,
    ) {
        let slot = self.by_id.get(route).copied();
        let route = slot
            .and_then(|s| self.routes.get_mut(s))
            .and_then(Option::as_mut);
        match outcome {
            Outcome::Connected => {
                self.stats.connected += 1;
                if let Some(r) = route {
                    *r.state.active.entry(endpoint).or_insert(0) += 1;
                }
            }
            Outcome::Closed => {
                self.stats.closed += 1;
                if let Some(r) = route {
                    if let Some(n) = r.state.active.get_mut(&endpoint) {
                        *n = n.saturating_sub(1);
                        if *n == 0 && !r.cluster.contains(&endpoint) && !r.local.contains(&endpoint)
                        {
                            r.state.active.remove(&endpoint);
                        }
                    }
                }
            }
            Outcome::Refused | Outcome::TimedOut => {
                if outcome == Outcome::Refused {
                    self.stats.refused += 1;
                } else {
                    self.stats.timed_out += 1;
                }
                let until = now + self.config.quarantine;
                let previous = self.quarantine.insert(endpoint, until);
                if previous.is_none_or(|p| p <= now) {
                    self.stats.quarantined += 1;
                }
            }
        }
    }

    /// Forgets affinity entries and quarantines that expired by `now`. Visits the routes with
    /// ClientIP affinity and the quarantined endpoints only.
    pub fn expire(&mut self, now: Instant) {
        self.quarantine.retain(|_, until| *until > now);
        for slot in &self.sticky_slots {
            if let Some(Some(route)) = self.routes.get_mut(*slot) {
                route.state.sticky.retain(|_, s| s.expires > now);
            }
        }
    }
}

#[cfg(test)]
mod tests;
