//! Plans kube-proxy-rs's IPVS state (the ipvs mode's pure half; the I/O is `kp-ipvs`).
//!
//! - [`Desired::add`] turns a Service port's frontends ([`kp_core::frontend::Frontends`], one
//!   IP family) into IPVS virtual servers: one per ClusterIP, external IP and LoadBalancer IP,
//!   and one per node address for a NodePort, each listing the endpoints its traffic policy
//!   leaves as masqueraded real servers of weight 1. ClientIP affinity makes the virtual server
//!   persistent with the Service's timeout. The addresses to bind to `kube-ipvs0` come with it
//!   ([`Desired::bind_addresses`]).
//! - [`diff`] compares the desired state with a dump of the kernel's and returns the changes,
//!   in an order the kernel accepts (a service before its destinations): services added,
//!   changed or deleted, destinations added, changed or removed. A removed real server of a
//!   TCP or SCTP virtual server is not deleted at once: it gets weight 0 (no new connections)
//!   and is deleted by a later diff once its active and inactive connection counts are zero;
//!   the plan lists such draining ones so the mode checks again on its timer
//!   ([`Plan::draining`]). UDP real servers go at once.
//!
//! - [`addresses`]: what to bind to and unbind from `kube-ipvs0`; [`ipset`]: the contents of
//!   upstream's ipsets (`KUBE-CLUSTER-IP`, `KUBE-LOOP-BACK`, `KUBE-NODE-PORT-*`, ...) with
//!   element-level diffs as `ipset restore` text; [`rules`]: the iptables chains that match
//!   those sets (masquerade, NodePort steering, source ranges, the VIP port filter) as
//!   `iptables-restore` text; [`local`]: the `Local` traffic policies' short-circuit (firewall
//!   marks and firewall-mark virtual servers) and drops, which one virtual server per address
//!   cannot say.
//!
//! - [`planner`]: the whole state kept one Service at a time between syncs, so a change
//!   re-plans its Services only and says which virtual servers, set entries and addresses
//!   moved; [`diff_keys`] diffs just those virtual servers against what the kernel holds of
//!   them.
//!
//! Mirrors upstream's `pkg/proxy/ipvs/proxier.go` (`syncService`, `syncEndpoint`) and
//! `graceful_termination.go`, with the difference that upstream re-lists IPVS on every sync
//! and this diff is handed the dump it compares with (the caller decides how fresh).
//!
//! Pure: no I/O, no clock. The kernel's types are `kp_netlink::ipvs`'s.

pub mod addresses;
pub mod ipset;
pub mod local;
pub mod planner;
pub mod rules;

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::frontend::{FrontendKind, Frontends, NoEndpoints, TrafficPolicy};
use kp_core::model::{IpFamily, Protocol as CoreProtocol};
use kp_netlink::ipvs::{abi, Destination, DestinationState, Protocol, Service, ServiceKey};

/// The longest scheduler name the kernel takes (`IP_VS_SCHEDNAME_MAXLEN` less the NUL).
const SCHEDULER_MAX: usize = abi::IP_VS_SCHEDNAME_MAXLEN - 1;

/// What the planner refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A scheduler name the kernel cannot take (empty, too long, not ASCII alphanumeric).
    /// Not retryable: a configuration error.
    #[error("IPVS scheduler {0:?}: 1-15 ASCII letters and digits (rr, wrr, lc, wlc, lblc, lblcr, dh, sh, sed, nq, mh)")]
    Scheduler(String),
}

/// How the mode is configured (`--ipvs-scheduler`, its flags, `--ipvs-exclude-cidrs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    scheduler: String,
    scheduler_flags: u32,
    exclude: Vec<IpNet>,
}

impl Config {
    /// A configuration with scheduler `scheduler` (upstream's default is `rr`), scheduler
    /// flags `scheduler_flags` (`IP_VS_SVC_F_SCHED1..3`, e.g. `sh`'s fallback and port
    /// flags) and virtual servers in `exclude` left alone (`--ipvs-exclude-cidrs`: another
    /// program's).
    pub fn new(
        scheduler: &str,
        scheduler_flags: u32,
        exclude: Vec<IpNet>,
    ) -> Result<Config, Error> {
        let valid = !scheduler.is_empty()
            && scheduler.len() <= SCHEDULER_MAX
            && scheduler.chars().all(|c| c.is_ascii_alphanumeric());
        if !valid {
            return Err(Error::Scheduler(scheduler.to_string()));
        }
        let sched_bits =
            abi::IP_VS_SVC_F_SCHED1 | abi::IP_VS_SVC_F_SCHED2 | abi::IP_VS_SVC_F_SCHED3;
        Ok(Config {
            scheduler: scheduler.to_string(),
            scheduler_flags: scheduler_flags & sched_bits,
            exclude,
        })
    }

    /// Whether a virtual server belongs to another program (its address in an excluded CIDR).
    fn excluded(&self, key: &ServiceKey) -> bool {
        match key {
            ServiceKey::Addr { addr, .. } => self.exclude.iter().any(|n| n.contains(addr)),
            // Only the short-circuit ones are ours (see [`local`]); others are someone else's.
            ServiceKey::Fwmark { mark, .. } => !local::is_short_circuit_mark(*mark),
        }
    }
}

/// A virtual server as planned: the service and its real servers by address and port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VirtualServer {
    /// The service.
    pub service: Service,
    /// Its real servers.
    pub destinations: Reals,
}

/// A virtual server's real servers, one per address and port, sorted, in two boxed slices (a
/// map per virtual server allocates a node of eleven slots however few it holds: at 10,000
/// Services that was 8 MiB of the planner): those the planner makes (masqueraded, weight 1,
/// no thresholds) at an IPv4 address as 6 bytes each (address and port, big-endian, so they
/// sort as the real servers do), any other as its [`Destination`] (32 bytes). Looked up by
/// binary search; read like a map of `(address, port)` to [`Destination`], by value.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Reals {
    packed: Box<[PackedReal]>,
    plain: Box<[Destination]>,
}

/// An IPv4 real server of the planner's kind: address and port.
type PackedReal = [u8; 6];

fn pack_at(addr: &IpAddr, port: u16) -> Option<PackedReal> {
    let IpAddr::V4(a) = addr else {
        return None;
    };
    let [a, b, c, d] = a.octets();
    let [p, q] = port.to_be_bytes();
    Some([a, b, c, d, p, q])
}

fn pack_real(d: &Destination) -> Option<PackedReal> {
    if *d != Destination::masquerade(d.addr, d.port, 1) {
        return None;
    }
    pack_at(&d.addr, d.port)
}

fn unpack_real(p: &PackedReal) -> Destination {
    let addr = IpAddr::from([p[0], p[1], p[2], p[3]]);
    Destination::masquerade(addr, u16::from_be_bytes([p[4], p[5]]), 1)
}

impl Reals {
    /// How many.
    pub fn len(&self) -> usize {
        self.packed.len() + self.plain.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.packed.is_empty() && self.plain.is_empty()
    }

    /// The real server at `at` (address and port).
    pub fn get(&self, at: &(IpAddr, u16)) -> Option<Destination> {
        if let Some(p) = pack_at(&at.0, at.1) {
            if let Ok(i) = self.packed.binary_search(&p) {
                return Some(unpack_real(&self.packed[i]));
            }
        }
        self.plain
            .binary_search_by(|d| (d.addr, d.port).cmp(at))
            .ok()
            .map(|i| self.plain[i])
    }

    /// Whether there is one at `at`.
    pub fn contains_key(&self, at: &(IpAddr, u16)) -> bool {
        self.get(at).is_some()
    }

    /// The real servers, in order of address and port.
    pub fn values(&self) -> Box<dyn Iterator<Item = Destination> + '_> {
        let mut packed = self.packed.iter().map(unpack_real).peekable();
        if self.plain.is_empty() {
            return Box::new(packed);
        }
        let mut plain = self.plain.iter().copied().peekable();
        Box::new(std::iter::from_fn(move || {
            match (packed.peek(), plain.peek()) {
                (Some(a), Some(b)) if (a.addr, a.port) > (b.addr, b.port) => plain.next(),
                (Some(_), _) => packed.next(),
                (None, _) => plain.next(),
            }
        }))
    }

    /// Each with its address and port, in their order.
    pub fn iter(&self) -> impl Iterator<Item = ((IpAddr, u16), Destination)> + '_ {
        self.values().map(|d| ((d.addr, d.port), d))
    }

    /// The addresses and ports, in order.
    pub fn keys(&self) -> impl Iterator<Item = (IpAddr, u16)> + '_ {
        self.values().map(|d| (d.addr, d.port))
    }
}

impl FromIterator<Destination> for Reals {
    /// The real servers of `iter`, the last of each address and port kept.
    fn from_iter<I: IntoIterator<Item = Destination>>(iter: I) -> Reals {
        let mut all: Vec<Destination> = iter.into_iter().collect();
        // Stable: of equal keys the last given ends last, and is the one kept.
        all.sort_by_key(|d| (d.addr, d.port));
        let (mut packed, mut plain) = (Vec::new(), Vec::new());
        for (i, d) in all.iter().enumerate() {
            let next = all.get(i + 1);
            if next.is_some_and(|n| (n.addr, n.port) == (d.addr, d.port)) {
                continue;
            }
            match pack_real(d) {
                Some(p) => packed.push(p),
                None => plain.push(*d),
            }
        }
        Reals {
            packed: packed.into_boxed_slice(),
            plain: plain.into_boxed_slice(),
        }
    }
}

impl<'a> IntoIterator for &'a Reals {
    type Item = ((IpAddr, u16), Destination);
    type IntoIter = Box<dyn Iterator<Item = ((IpAddr, u16), Destination)> + 'a>;

    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

impl std::fmt::Debug for Reals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

/// Where [`diff`] finds the planned virtual servers: a plan made in one go ([`Desired`]) or
/// the running [`planner::Planner`]'s whole state.
pub trait Planned {
    /// The virtual server planned for `key`.
    fn virtual_server(&self, key: &ServiceKey) -> Option<&VirtualServer>;
    /// Every planned virtual server, in key order.
    fn virtual_servers(&self) -> Box<dyn Iterator<Item = (&ServiceKey, &VirtualServer)> + '_>;
}

impl Planned for Desired {
    fn virtual_server(&self, key: &ServiceKey) -> Option<&VirtualServer> {
        self.services.get(key)
    }

    fn virtual_servers(&self) -> Box<dyn Iterator<Item = (&ServiceKey, &VirtualServer)> + '_> {
        Box::new(self.services.iter())
    }
}

/// The IPVS state the frontends ask for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Desired {
    services: BTreeMap<ServiceKey, VirtualServer>,
    bind: BTreeSet<IpAddr>,
    local: local::LocalPolicy,
}

/// A Service port's protocol as IPVS names it.
pub fn protocol(p: CoreProtocol) -> Protocol {
    match p {
        CoreProtocol::Tcp => Protocol::Tcp,
        CoreProtocol::Udp => Protocol::Udp,
        CoreProtocol::Sctp => Protocol::Sctp,
    }
}

/// An IPVS virtual server's protocol as a Service port names it ([`protocol`]'s inverse).
pub fn core_protocol(p: Protocol) -> CoreProtocol {
    match p {
        Protocol::Tcp => CoreProtocol::Tcp,
        Protocol::Udp => CoreProtocol::Udp,
        Protocol::Sctp => CoreProtocol::Sctp,
    }
}

impl Desired {
    /// An empty state.
    pub fn new() -> Desired {
        Desired::default()
    }

    /// Adds the virtual servers of one Service port in one family. `node_addresses` are the
    /// node's addresses NodePorts answer on (the mode reads them from the interfaces, filtered
    /// by `--nodeport-addresses`); those of the frontends' family get a virtual server each.
    ///
    /// `externalTrafficPolicy: Local` adds what one virtual server per address cannot say (see
    /// [`local`]): a firewall-mark virtual server with the cluster-wide endpoints, which the
    /// traffic of pods and of the node itself is marked for (the short-circuit), and, without
    /// local endpoints, a drop of whatever is not short-circuited (`internalTrafficPolicy:
    /// Local` without local endpoints: a drop of everything).
    pub fn add(&mut self, frontends: &Frontends<'_>, node_addresses: &[IpAddr], config: &Config) {
        self.add_with(frontends, node_addresses, config, None);
    }

    /// [`Desired::add`] with the short-circuit marks of `marks` (a running planner's, so that
    /// a plan made in one go can be compared with it: marks depend on the order ports came in).
    pub fn add_marked(
        &mut self,
        frontends: &Frontends<'_>,
        node_addresses: &[IpAddr],
        config: &Config,
        marks: &mut local::LocalPolicy,
    ) {
        self.add_with(frontends, node_addresses, config, Some(marks));
    }

    /// [`Desired::add`], the short-circuit marks given out by `marks` (the whole state's, when
    /// this is one Service's share of it) instead of this state's own policy; this state still
    /// records which marks it uses.
    pub(crate) fn add_with(
        &mut self,
        frontends: &Frontends<'_>,
        node_addresses: &[IpAddr],
        config: &Config,
        mut marks: Option<&mut local::LocalPolicy>,
    ) {
        let family = frontends.family();
        let name = &frontends.port().name;
        for f in frontends.iter() {
            let addresses: Vec<IpAddr> = match (f.kind, f.address) {
                (FrontendKind::NodePort, _) => node_addresses
                    .iter()
                    .filter(|a| IpFamily::of(a) == family)
                    .copied()
                    .collect(),
                (_, Some(a)) => {
                    self.bind.insert(a);
                    vec![a]
                }
                (_, None) => Vec::new(),
            };
            let short_circuit = (f.is_external()
                && f.policy == TrafficPolicy::Local
                && !f.short_circuit.is_empty())
            .then(|| match marks.as_deref_mut() {
                Some(m) => {
                    let mark = m.mark(name);
                    self.local.record(name, mark);
                    mark
                }
                None => self.local.mark(name),
            });
            let drop = f.no_endpoints() == Some(NoEndpoints::Drop);
            if let Some(mark) = short_circuit {
                let key = ServiceKey::Fwmark {
                    mark,
                    ipv6: family == IpFamily::V6,
                };
                let mut service = Service::new(key, &config.scheduler);
                service.flags = config.scheduler_flags;
                if let Some(timeout) = f.affinity {
                    service.flags |= abi::IP_VS_SVC_F_PERSISTENT;
                    service.timeout = timeout;
                }
                let destinations = f
                    .short_circuit
                    .iter()
                    .map(|e| Destination::masquerade(e.ip, e.port, 1))
                    .collect();
                self.services.insert(
                    key,
                    VirtualServer {
                        service,
                        destinations,
                    },
                );
            }
            if short_circuit.is_some() || drop {
                for addr in &addresses {
                    self.local.add(local::LocalRule {
                        family,
                        address: *addr,
                        protocol: f.protocol,
                        port: f.port,
                        mark: short_circuit,
                        drop,
                    });
                }
            }
            for addr in addresses {
                let key = ServiceKey::Addr {
                    addr,
                    protocol: protocol(f.protocol),
                    port: f.port,
                };
                let mut service = Service::new(key, &config.scheduler);
                service.flags = config.scheduler_flags;
                if let Some(timeout) = f.affinity {
                    service.flags |= abi::IP_VS_SVC_F_PERSISTENT;
                    service.timeout = timeout;
                }
                let destinations = f
                    .endpoints
                    .iter()
                    .map(|e| Destination::masquerade(e.ip, e.port, 1))
                    .collect();
                self.services.insert(
                    key,
                    VirtualServer {
                        service,
                        destinations,
                    },
                );
            }
        }
    }

    /// The virtual servers, by key.
    pub fn services(&self) -> &BTreeMap<ServiceKey, VirtualServer> {
        &self.services
    }

    /// The addresses to bind to `kube-ipvs0`: every ClusterIP, external IP and LoadBalancer IP
    /// that has a virtual server (NodePorts use the node's own addresses).
    pub fn bind_addresses(&self) -> &BTreeSet<IpAddr> {
        &self.bind
    }

    /// The short-circuit marks and drops of the `Local` policies.
    pub fn local(&self) -> &local::LocalPolicy {
        &self.local
    }
}

/// One change to the kernel's IPVS state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// `IPVS_CMD_NEW_SERVICE`.
    AddService(Service),
    /// `IPVS_CMD_SET_SERVICE`: scheduler, flags, timeout or netmask differ.
    UpdateService(Service),
    /// `IPVS_CMD_DEL_SERVICE` (its real servers go with it).
    DeleteService(ServiceKey),
    /// `IPVS_CMD_NEW_DEST`.
    AddDestination(ServiceKey, Destination),
    /// `IPVS_CMD_SET_DEST`: weight, forwarding or thresholds differ (weight 0: draining).
    UpdateDestination(ServiceKey, Destination),
    /// `IPVS_CMD_DEL_DEST`.
    DeleteDestination(ServiceKey, IpAddr, u16),
}

/// A real server being drained: weight 0, connections left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Draining {
    /// Its virtual server.
    pub service: ServiceKey,
    /// Its address.
    pub addr: IpAddr,
    /// Its port.
    pub port: u16,
    /// Its active plus inactive connections at the dump.
    pub connections: u32,
}

/// What [`diff`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// The changes, in the order to apply them.
    pub changes: Vec<Change>,
    /// Real servers left in place with weight 0 until their connections end (after this
    /// plan's changes): diff again later to delete them.
    pub draining: Vec<Draining>,
}

impl Plan {
    /// Takes the deletions of whole virtual servers out of the changes, keeping the others in
    /// order: a sync applies the rest first and these last, once the addresses and rules that
    /// send packets to those virtual servers are gone (see the ipvs dataplane's write order).
    pub fn split_off_deletions(&mut self) -> Vec<Change> {
        let (deletions, rest) = std::mem::take(&mut self.changes)
            .into_iter()
            .partition(|c| matches!(c, Change::DeleteService(_)));
        self.changes = rest;
        deletions
    }
}

/// The changes that bring `kernel` (a dump: every virtual server with its real servers) to
/// `desired`. Virtual servers in `config`'s excluded CIDRs, and fwmark ones, are not
/// touched.
pub fn diff(
    desired: &dyn Planned,
    kernel: &[(Service, Vec<DestinationState>)],
    config: &Config,
) -> Plan {
    let current = Dump::index(kernel);
    let mut plan = Plan::default();
    current.diff_into(desired, current.all_keys(desired).iter(), config, &mut plan);
    plan
}

/// [`diff`] for the virtual servers `keys` only (a sync's changed ones): `kernel` holds what
/// the kernel has of those (a virtual server of `keys` missing from it is added), and nothing
/// else is looked at or changed.
pub fn diff_keys(
    desired: &dyn Planned,
    kernel: &[(Service, Vec<DestinationState>)],
    keys: &BTreeSet<ServiceKey>,
    config: &Config,
) -> Plan {
    let current = Dump::index(kernel);
    let mut plan = Plan::default();
    current.diff_into(desired, keys.iter(), config, &mut plan);
    plan
}

/// A dump of the kernel's virtual servers indexed by key, for diffs made a part at a time
/// ([`Dump::diff_into`]): a full sync programs the changes of a few hundred virtual servers
/// at once instead of holding the changes of all of them.
pub struct Dump<'a> {
    current: BTreeMap<ServiceKey, (&'a Service, &'a [DestinationState])>,
}

impl<'a> Dump<'a> {
    /// Indexes `kernel`.
    pub fn index(kernel: &'a [(Service, Vec<DestinationState>)]) -> Dump<'a> {
        Dump {
            current: kernel
                .iter()
                .map(|(s, d)| (s.key, (s, d.as_slice())))
                .collect(),
        }
    }

    /// Every key planned or dumped, in order: what a full diff covers.
    pub fn all_keys(&self, desired: &dyn Planned) -> BTreeSet<ServiceKey> {
        desired
            .virtual_servers()
            .map(|(k, _)| *k)
            .chain(self.current.keys().copied())
            .collect()
    }

    /// Adds to `plan` the changes for the virtual servers `keys` (what the dump holds of
    /// them is what the kernel has): as [`diff_keys`], services and real servers first, then
    /// the deletions of these keys' services.
    pub fn diff_into<'k>(
        &self,
        desired: &dyn Planned,
        keys: impl Iterator<Item = &'k ServiceKey> + Clone,
        config: &Config,
        plan: &mut Plan,
    ) {
        for key in keys.clone() {
            let Some(want) = desired.virtual_server(key) else {
                continue;
            };
            let have_dests: &[DestinationState] = match self.current.get(key) {
                None => {
                    plan.changes.push(Change::AddService(want.service.clone()));
                    &[]
                }
                Some((have, dests)) => {
                    if **have != want.service {
                        plan.changes
                            .push(Change::UpdateService(want.service.clone()));
                    }
                    dests
                }
            };
            let have: BTreeMap<(IpAddr, u16), &DestinationState> = have_dests
                .iter()
                .map(|d| ((d.destination.addr, d.destination.port), d))
                .collect();
            for dest in want.destinations.values() {
                match have.get(&(dest.addr, dest.port)) {
                    None => plan.changes.push(Change::AddDestination(*key, dest)),
                    Some(d) if d.destination != dest => {
                        plan.changes.push(Change::UpdateDestination(*key, dest))
                    }
                    Some(_) => {}
                }
            }
            for (at, d) in &have {
                if want.destinations.contains_key(at) {
                    continue;
                }
                drain(plan, key, d);
            }
        }
        for key in keys {
            if self.current.contains_key(key)
                && desired.virtual_server(key).is_none()
                && !config.excluded(key)
            {
                plan.changes.push(Change::DeleteService(*key));
            }
        }
    }
}

/// A real server no longer wanted: deleted if its virtual server is UDP or it has no
/// connections, else set to weight 0 (once) and listed as draining.
fn drain(plan: &mut Plan, key: &ServiceKey, d: &DestinationState) {
    let udp = matches!(
        key,
        ServiceKey::Addr {
            protocol: Protocol::Udp,
            ..
        }
    );
    let connections = d.active_connections.saturating_add(d.inactive_connections);
    let dest = d.destination;
    if udp || connections == 0 {
        plan.changes
            .push(Change::DeleteDestination(*key, dest.addr, dest.port));
        return;
    }
    if dest.weight != 0 {
        plan.changes.push(Change::UpdateDestination(
            *key,
            Destination { weight: 0, ..dest },
        ));
    }
    plan.draining.push(Draining {
        service: *key,
        addr: dest.addr,
        port: dest.port,
        connections,
    });
}

#[cfg(test)]
mod tests;
