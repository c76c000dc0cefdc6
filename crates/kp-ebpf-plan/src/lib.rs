//! Plans the eBPF mode's maps (the pure half; the programs and their loader are `kp-ebpf`).
//!
//! Three maps, in Cilium's layout ([`layout`] has the bytes):
//! - **services**: `{address, port, protocol, slot}` → slot 0 holds the frontend's backend
//!   count, slots 1..=count hold backend ids; a program picks a slot at random;
//! - **backends**: backend id → `{address, port, protocol}`;
//! - **reverse NAT**: frontend id → `{address, port}`, what a reply is given back as;
//! - **addresses** (an LPM trie): what a call to an address no frontend matched meets — a
//!   ClusterIP refuses its other ports and protocols, a Service CIDR drops what no Service
//!   holds (upstream nftables' `cluster-ips-check` and unallocated-ClusterIP drop);
//! - **Maglev** (with [`Scheduler::Maglev`], the `sh` and `mh` schedulers): frontend id → its
//!   lookup table ([`maglev`]), the slot each client hash is given.
//!
//! [`frontend_specs`] turns one Service port's [`Frontends`] into the frontends these maps
//! hold; [`Planner`] keeps the ids and slot orders it handed out and returns, for each
//! Service it is told about, the element-level [`Op`]s that bring the maps there. A backend
//! that goes away leaves its slot to the frontend's last backend (one slot rewritten, one
//! deleted, the count rewritten), so a one-endpoint change costs a handful of map updates
//! whatever the number of Services or endpoints. [`Planner::contents`] lists everything the
//! maps should hold, for the periodic read-back, and [`diff`] the updates from what the maps
//! hold (read back, or pinned by a previous run) to that.
//!
//! Mirrors Cilium's `pkg/loadbalancer` / `lbmap` (`Service4Key`, `Backend4Value`,
//! `RevNat4Value`) for the layout and upstream's `pkg/proxy` for which frontends exist.
//!
//! Pure: no I/O, no clock.

mod diff;
pub mod layout;
pub mod maglev;

pub use diff::{diff, diff_into, stale_udp, Wanted};

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};

use kp_core::frontend::{FrontendKind, Frontends, NoEndpoints, TrafficPolicy};
use kp_core::model::{IpFamily, Protocol, ServiceKey as ServiceName};
use kp_core::node::{DetectLocal, NodeContext, NodePortAddresses};
use kp_core::track::ProxyState;

pub use layout::{
    AddrKey, AddrVerdict, Backend, FrontendAddr, MaglevTable, RangeKey, RevNat, Scope, ServiceKey,
    ServiceValue, StaleUdp, FLAG_DROP_EMPTY, FLAG_KEEP_SOURCE, FLAG_MAGLEV, FLAG_SRC_RANGES,
};
pub use maglev::Scheduler;

/// What the planner refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// Every backend id (`u32`) is in use. Not retryable until backends go away.
    #[error("no free backend id")]
    BackendIds,
    /// Every reverse-NAT id (`u16`, 65535 frontends) is in use. Not retryable until frontends
    /// go away.
    #[error("no free reverse-NAT id: more than 65535 frontends")]
    RevNatIds,
    /// A frontend lists more backends than a slot number (`u16`) can count.
    #[error("frontend {0:?} has more than 65535 backends")]
    TooManyBackends(FrontendAddr),
}

/// One frontend as the maps hold it: where clients connect, and the backends in the order the
/// policy selected them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrontendSpec {
    /// Address, port, protocol.
    pub addr: FrontendAddr,
    /// The backends; empty: connections are refused (rejected, or dropped with
    /// [`drop_when_empty`](Self::drop_when_empty)).
    pub backends: Vec<Backend>,
    /// Without backends, drop instead of reject: a `Local` policy whose endpoints are all on
    /// other nodes (upstream's "has no local endpoints").
    pub drop_when_empty: bool,
    /// ClientIP affinity timeout in seconds.
    pub affinity: Option<u32>,
    /// A ClusterIP: calls to its address on a port or protocol no Service uses are rejected.
    pub cluster_ip: bool,
    /// From outside the node (an [`Scope::Outside`] frontend): keep the client's address
    /// instead of masquerading.
    pub keep_source: bool,
    /// From outside the node: the only sources served (an [`Scope::Outside`] LoadBalancer
    /// frontend with `loadBalancerSourceRanges`, those of its family: none when the Service
    /// lists only the other family's); `None`: every source.
    pub source_ranges: Option<Vec<AddrKey>>,
}

/// The frontends of one Service port in one family, as the socket load balancer sees them:
/// traffic that starts on this node or in its pods. ClusterIPs, external IPs and
/// LoadBalancer IPs each give one frontend; a NodePort one per address in `node_addresses` of
/// the family. The backends are the shared frontend list's selection ([`Frontends`]): the
/// policy's endpoint set (`internalTrafficPolicy` for a ClusterIP, with terminating fallback
/// and topology already applied), and for `externalTrafficPolicy: Local` frontends the
/// short-circuit set, every endpoint of the cluster (as upstream sends traffic from pods and
/// the node to all endpoints). Without endpoints a frontend rejects, or drops when its `Local`
/// policy has endpoints elsewhere only.
///
/// For the tc path (traffic from outside the node), an external frontend whose outside clients
/// are treated otherwise gets a second, [`Scope::Outside`] frontend: with
/// `externalTrafficPolicy: Local` its policy's endpoints (the local ones) and the client's
/// address kept; with `loadBalancerSourceRanges`, the ranges. Every other frontend serves
/// outside clients from its [`Scope::Socket`] entry, masqueraded.
pub fn frontend_specs(frontends: &Frontends<'_>, node_addresses: &[IpAddr]) -> Vec<FrontendSpec> {
    let family = frontends.family();
    let mut out = Vec::new();
    for f in frontends.iter() {
        let (endpoints, drop_when_empty) = if f.short_circuit.is_empty() {
            (f.endpoints, f.no_endpoints() == Some(NoEndpoints::Drop))
        } else {
            (f.short_circuit, false)
        };
        let cluster_ip = matches!(f.kind, FrontendKind::ClusterIp);
        let backends: Vec<Backend> = endpoints
            .iter()
            .map(|e| Backend {
                ip: e.ip,
                port: e.port,
                protocol: f.protocol,
            })
            .collect();
        let addresses: Vec<IpAddr> = match (f.kind, f.address) {
            (FrontendKind::NodePort, _) => node_addresses
                .iter()
                .filter(|a| IpFamily::of(a) == family)
                .copied()
                .collect(),
            (_, Some(a)) => vec![a],
            (_, None) => Vec::new(),
        };
        let keep_source = f.is_external() && f.policy == TrafficPolicy::Local;
        let source_ranges: Option<Vec<AddrKey>> = f.source_ranges().map(|r| {
            r.of_family()
                .map(|n| prefix(n.addr(), n.prefix_len()))
                .collect()
        });
        let outside = (keep_source || f.source_ranges().is_some()).then(|| {
            let backends: Vec<Backend> = f
                .endpoints
                .iter()
                .map(|e| Backend {
                    ip: e.ip,
                    port: e.port,
                    protocol: f.protocol,
                })
                .collect();
            (backends, f.no_endpoints() == Some(NoEndpoints::Drop))
        });
        for ip in addresses {
            let addr = FrontendAddr {
                ip,
                port: f.port,
                protocol: f.protocol,
                scope: Scope::Socket,
            };
            out.push(FrontendSpec {
                addr,
                backends: backends.clone(),
                drop_when_empty,
                affinity: f.affinity,
                cluster_ip,
                keep_source: false,
                source_ranges: None,
            });
            if let Some((backends, drop_when_empty)) = &outside {
                out.push(FrontendSpec {
                    addr: FrontendAddr {
                        scope: Scope::Outside,
                        ..addr
                    },
                    backends: backends.clone(),
                    drop_when_empty: *drop_when_empty,
                    affinity: f.affinity,
                    cluster_ip: false,
                    keep_source,
                    source_ranges: source_ranges.clone(),
                });
            }
        }
    }
    out
}

/// Leaves the `held` backends out of each socket-hook frontend in `specs` that has others, so
/// that new connections from the node and its pods go to those: the mode before a switch still
/// answers for the held ones (see `kp_core::dataplane::HeldBackend`), and a connection made
/// straight to one from a client port that mode's state holds would fail. A frontend whose
/// every backend is held keeps them all, as a Service whose endpoints are all terminating does.
/// Outside traffic's frontends keep theirs: the tc path gives their replies the frontend's
/// address back before netfilter sees them.
pub fn hold(specs: &mut [FrontendSpec], held: &BTreeSet<Backend>) {
    if held.is_empty() {
        return;
    }
    for spec in specs.iter_mut().filter(|s| s.addr.scope == Scope::Socket) {
        if spec.backends.iter().any(|b| !held.contains(b)) {
            spec.backends.retain(|b| !held.contains(b));
        }
    }
}

/// The node's addresses NodePorts answer on, given its interface addresses `local`: with
/// `nodePortAddresses: primary` the Node object's addresses; unset, every address in `local`;
/// with CIDRs, those of `local` inside the CIDRs of their family (every one of a family no CIDR
/// names). As upstream's ipvs mode, which also needs one address per NodePort frontend.
pub fn node_port_addresses(
    node_ports: &NodePortAddresses,
    state: &ProxyState,
    local: &[IpAddr],
) -> Vec<IpAddr> {
    let ctx = NodeContext::resolve(&DetectLocal::None, node_ports, state);
    match node_ports {
        NodePortAddresses::Primary => ctx.node_ips,
        NodePortAddresses::AllLocal => local.to_vec(),
        NodePortAddresses::Cidrs(_) => local
            .iter()
            .filter(|ip| match ctx.node_port_networks(IpFamily::of(ip)) {
                None => true,
                Some(nets) => nets.iter().any(|n| n.contains(*ip)),
            })
            .copied()
            .collect(),
    }
}

/// The Service CIDRs as `(address, prefix length)`.
pub fn service_cidrs(state: &ProxyState) -> Vec<(IpAddr, u8)> {
    state
        .service_cidrs()
        .iter()
        .map(|n| (n.addr(), n.prefix_len()))
        .collect()
}

/// Every frontend of `service`, all ports and both families ([`frontend_specs`] of each), with
/// NodePorts on `node_addresses` ([`node_port_addresses`]).
pub fn service_specs(
    state: &ProxyState,
    service: &ServiceName,
    node_addresses: &[IpAddr],
) -> Vec<FrontendSpec> {
    let mut out = Vec::new();
    for sps in state.service_state(service) {
        for family in IpFamily::ALL {
            out.extend(frontend_specs(&Frontends::of(&sps, family), node_addresses));
        }
    }
    out
}

/// [`service_specs`] with the `held` backends left out where [`hold`] leaves them out: what the
/// dataplane programs for `service`.
pub fn service_specs_holding(
    state: &ProxyState,
    service: &ServiceName,
    node_addresses: &[IpAddr],
    held: &BTreeSet<Backend>,
) -> Vec<FrontendSpec> {
    let mut specs = service_specs(state, service, node_addresses);
    hold(&mut specs, held);
    specs
}

/// How many ports of `service` have a `Local` policy with endpoints elsewhere but none on this
/// node, per family (IPv4, IPv6): (internal, external), as upstream counts for
/// `kubeproxy_sync_proxy_rules_no_local_endpoints_total`.
pub fn no_local_endpoints(state: &ProxyState, service: &ServiceName) -> [(u64, u64); 2] {
    let mut out = [(0, 0); 2];
    for sps in state.service_state(service) {
        for (i, family) in IpFamily::ALL.into_iter().enumerate() {
            let frontends = Frontends::of(&sps, family);
            let (mut internal, mut external) = (false, false);
            for f in frontends.iter() {
                if f.no_endpoints().is_some()
                    && f.has_endpoints
                    && f.policy == kp_core::frontend::TrafficPolicy::Local
                {
                    if f.is_external() {
                        external = true;
                    } else {
                        internal = true;
                    }
                }
            }
            out[i].0 += u64::from(internal);
            out[i].1 += u64::from(external);
        }
    }
    out
}

/// A planner holding everything `state` needs (NodePorts on [`node_port_addresses`] of the
/// node's interface addresses `local`): every Service's frontends and the Service CIDRs, as a full sync writes them (its [`Planner::contents`] is what the maps should hold).
pub fn plan_state(
    state: &ProxyState,
    node_ports: &NodePortAddresses,
    local: &[IpAddr],
) -> Result<Planner, Error> {
    plan_state_with(
        state,
        node_ports,
        local,
        Scheduler::Random,
        &BTreeSet::new(),
    )
}

/// [`plan_state`] for the programs' pick `scheduler` (with [`Scheduler::Maglev`], every
/// frontend with backends has a Maglev table), with the `held` backends left out where
/// [`hold`] leaves them out.
pub fn plan_state_with(
    state: &ProxyState,
    node_ports: &NodePortAddresses,
    local: &[IpAddr],
    scheduler: Scheduler,
    held: &BTreeSet<Backend>,
) -> Result<Planner, Error> {
    let node_addresses = node_port_addresses(node_ports, state, local);
    let mut planner = Planner::with_scheduler(scheduler);
    for service in state.service_keys() {
        let specs = service_specs_holding(state, service, &node_addresses, held);
        planner.set_service(service, &specs)?;
    }
    // In key order, each claimant of a shared address comes after the one it displaces:
    // nothing is handed off.
    debug_assert!(planner.handoffs.is_empty());
    planner.set_service_cidrs(&service_cidrs(state));
    Ok(planner)
}

/// One map update, in the order the planner returns them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Write a backend.
    UpsertBackend(u32, Backend),
    /// Write a reverse-NAT entry.
    UpsertRevNat(u16, RevNat),
    /// Write a services entry.
    UpsertService(ServiceKey, ServiceValue),
    /// Write a source-range entry.
    UpsertRange(RangeKey),
    /// Delete a source-range entry.
    DeleteRange(RangeKey),
    /// Write an address entry.
    UpsertAddr(AddrKey, AddrVerdict),
    /// Delete an address entry.
    DeleteAddr(AddrKey),
    /// Delete a services entry.
    DeleteService(ServiceKey),
    /// Write a frontend's Maglev table (by its reverse-NAT id).
    UpsertMaglev(u16, MaglevTable),
    /// Delete a frontend's Maglev table.
    DeleteMaglev(u16),
    /// Delete a reverse-NAT entry.
    DeleteRevNat(u16),
    /// Delete a backend.
    DeleteBackend(u32),
}

impl Op {
    /// Where this kind of operation goes in a batch: new backends and frontend ids first, so
    /// no slot ever points at a missing backend; backend slots before the count that makes
    /// them reachable; the count (or, for a frontend that goes, its slot 0) before the slots
    /// it stops covering are deleted; backends last, once no slot points at them. A Maglev
    /// table is written after the slots it names and before the count and flag that make it
    /// used, and deleted after them: while a count and its table disagree (a backend added),
    /// the programs take a table slot beyond the count for none and pick at random.
    fn rank(&self) -> u8 {
        match self {
            Op::UpsertBackend(..) => 0,
            Op::UpsertRevNat(..) => 1,
            // A frontend's ranges are written before its count's flag makes them checked, and
            // deleted once it is gone.
            Op::UpsertRange(..) => 2,
            Op::UpsertService(k, _) if k.slot != 0 => 3,
            Op::UpsertMaglev(..) => 4,
            Op::UpsertService(..) => 5,
            // Address entries only act where no frontend matches: after the frontends come,
            // before they go.
            Op::UpsertAddr(..) => 6,
            Op::DeleteAddr(..) => 7,
            Op::DeleteService(k) if k.slot == 0 => 8,
            Op::DeleteService(..) => 9,
            Op::DeleteMaglev(..) => 10,
            Op::DeleteRange(..) => 11,
            Op::DeleteRevNat(..) => 12,
            Op::DeleteBackend(..) => 13,
        }
    }
}

/// The deletions that empty the address and services maps of a stopped ebpf mode when another
/// mode takes the node over (`kp_ebpf::hand_over`), in batch order: the addresses, then the
/// frontends' heads, then their backend slots. The kernel detaches the socket hooks an RCU grace
/// period and a work item after their pins go, so the hooks may meet every state this passes
/// through: in each, a call to a frontend is translated whole (its head and slots are all
/// there) or let through untouched to the other mode's rules (no head, no address), never
/// refused or dropped by a head without its slots or an address without its frontend.
pub fn hand_over_deletions(
    addrs: impl IntoIterator<Item = AddrKey>,
    services: impl IntoIterator<Item = ServiceKey>,
) -> Vec<Op> {
    let mut ops: Vec<Op> = addrs
        .into_iter()
        .map(Op::DeleteAddr)
        .chain(services.into_iter().map(Op::DeleteService))
        .collect();
    ops.sort_by_key(Op::rank);
    ops
}

/// What one frontend holds: its reverse-NAT id and its backends' ids by slot (index 0 is
/// slot 1).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Programmed {
    rev_nat: u16,
    slots: Vec<u32>,
    affinity: u32,
    flags: u8,
    ranges: BTreeSet<AddrKey>,
}

impl Programmed {
    /// Whether the frontend has a Maglev table ([`FLAG_MAGLEV`]).
    fn maglev(&self) -> bool {
        self.flags & FLAG_MAGLEV != 0
    }

    fn head(&self) -> ServiceValue {
        ServiceValue {
            backend_id: 0,
            count: u16::try_from(self.slots.len()).unwrap_or(u16::MAX),
            rev_nat: self.rev_nat,
            affinity: self.affinity,
            flags: self.flags,
        }
    }
}

/// Everything the maps should hold, for comparing with what they do.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Contents {
    /// Services map entries.
    pub services: BTreeMap<ServiceKey, ServiceValue>,
    /// Backends map entries.
    pub backends: BTreeMap<u32, Backend>,
    /// Reverse-NAT map entries.
    pub rev_nat: BTreeMap<u16, RevNat>,
    /// Address map entries.
    pub addrs: BTreeMap<AddrKey, AddrVerdict>,
    /// Source-range map entries.
    pub ranges: BTreeSet<RangeKey>,
    /// Maglev map entries, by reverse-NAT id.
    pub maglev: BTreeMap<u16, MaglevTable>,
}

impl Contents {
    /// Applies one map update as the loader writes it: a model of the maps after `op`.
    pub fn apply(&mut self, op: &Op) {
        match op {
            Op::UpsertBackend(id, b) => {
                self.backends.insert(*id, *b);
            }
            Op::UpsertRevNat(id, r) => {
                self.rev_nat.insert(*id, *r);
            }
            Op::UpsertService(k, v) => {
                self.services.insert(*k, *v);
            }
            Op::UpsertAddr(k, v) => {
                self.addrs.insert(*k, *v);
            }
            Op::UpsertRange(k) => {
                self.ranges.insert(*k);
            }
            Op::DeleteRange(k) => {
                self.ranges.remove(k);
            }
            Op::DeleteAddr(k) => {
                self.addrs.remove(k);
            }
            Op::DeleteService(k) => {
                self.services.remove(k);
            }
            Op::DeleteRevNat(id) => {
                self.rev_nat.remove(id);
            }
            Op::DeleteBackend(id) => {
                self.backends.remove(id);
            }
            Op::UpsertMaglev(id, t) => {
                self.maglev.insert(*id, t.clone());
            }
            Op::DeleteMaglev(id) => {
                self.maglev.remove(id);
            }
        }
    }
}

/// Keeps the ids and slot orders already programmed, and plans each change against them.
#[derive(Debug, Clone, Default)]
pub struct Planner {
    frontends: HashMap<FrontendAddr, Programmed>,
    /// Each Service's frontend addresses, programmed or waiting (see `contested`).
    owners: HashMap<ServiceName, Vec<FrontendAddr>>,
    /// Addresses two or more Services claim (two Services may list the same external IP and
    /// port: nothing allocates externalIPs), with the claimants in key order. The last one is
    /// programmed, as a full plan (every Service in key order, each writing over the one
    /// before) has it; the others wait for their turn.
    contested: HashMap<FrontendAddr, Vec<ServiceName>>,
    /// Services whose turn came: the claimant programmed at an address left it, and the next
    /// one must be planned again ([`Planner::take_handoffs`]).
    handoffs: BTreeSet<ServiceName>,
    backend_ids: HashMap<Backend, (u32, usize)>,
    backends: HashMap<u32, Backend>,
    next_backend: u32,
    free_backends: Vec<u32>,
    /// Ids released by the batch being planned: a batch's deletes go last, so an id is free
    /// for another backend only from the next batch on.
    released_backends: Vec<u32>,
    rev_nat_used: BTreeSet<u16>,
    next_rev_nat: u16,
    free_rev_nat: Vec<u16>,
    /// Reverse-NAT ids released by the batch being planned, free from the next batch on (as
    /// `released_backends`).
    released_rev_nat: Vec<u16>,
    /// Each Service's ClusterIPs, and how many Services hold each one.
    service_ips: HashMap<ServiceName, Vec<IpAddr>>,
    ip_refs: HashMap<IpAddr, usize>,
    /// The Service CIDRs.
    cidrs: BTreeSet<AddrKey>,
    /// How the programs pick a backend: with [`Scheduler::Maglev`], frontends get tables.
    scheduler: Scheduler,
    /// UDP frontend and backend pairs the batches since the last
    /// [`Planner::take_stale_udp`] took apart.
    stale_udp: Vec<StaleUdp>,
}

impl Planner {
    /// A planner for empty maps, whose programs pick backends at random.
    pub fn new() -> Planner {
        Planner::with_scheduler(Scheduler::Random)
    }

    /// A planner for empty maps whose programs pick as `scheduler` says.
    pub fn with_scheduler(scheduler: Scheduler) -> Planner {
        Planner {
            next_backend: 1,
            next_rev_nat: 1,
            scheduler,
            ..Planner::default()
        }
    }

    /// How the programs pick.
    pub fn scheduler(&self) -> Scheduler {
        self.scheduler
    }

    /// The Maglev table over the backends in `slots` (ids by slot, each programmed): for each
    /// entry, the slot of the backend [`maglev::table`] names there. `None` where the frontend
    /// has none (no backends, or more than the table has entries).
    fn maglev_table(&self, slots: &[u32]) -> Option<MaglevTable> {
        let backends: Vec<Backend> = slots
            .iter()
            .map(|id| self.backends.get(id).copied())
            .collect::<Option<_>>()?;
        let entries = maglev::table(&backends);
        MaglevTable::new(
            entries
                .into_iter()
                // Slot numbers fit: a frontend has at most u16::MAX backends, and a table
                // at most MAGLEV_M.
                .map(|i| u16::try_from(i + 1).unwrap_or(0))
                .collect(),
        )
    }

    /// Makes `service`'s frontends `specs` (every port and family of the Service; empty once
    /// it is deleted) and returns the map updates, ordered so the maps are consistent after
    /// each one. Costs O(the Service's frontends and backends), whatever else is programmed.
    /// After an error the planner is no longer a record of the maps: start a new one and sync
    /// everything.
    pub fn set_service(
        &mut self,
        service: &ServiceName,
        specs: &[FrontendSpec],
    ) -> Result<Vec<Op>, Error> {
        let mut ops = Vec::new();
        let old: BTreeSet<FrontendAddr> = self
            .owners
            .remove(service)
            .unwrap_or_default()
            .into_iter()
            .collect();
        let wanted: BTreeSet<FrontendAddr> = specs.iter().map(|s| s.addr).collect();
        for addr in old.difference(&wanted) {
            self.leave(service, addr, &mut ops);
        }
        // One spec per address, the last one given (as planning them in turn would leave it):
        // two specs for one address in one batch would have the second one's writes and the
        // first one's deletes both in it, and the deletes go last.
        let mut last = HashMap::with_capacity(specs.len());
        for (i, spec) in specs.iter().enumerate() {
            last.insert(spec.addr, i);
        }
        for (_, spec) in specs
            .iter()
            .enumerate()
            .filter(|(i, s)| last.get(&s.addr) == Some(i))
        {
            if self.claim(service, spec.addr, old.contains(&spec.addr)) {
                self.set_frontend(spec, &mut ops)?;
            }
        }
        if !specs.is_empty() {
            self.owners
                .insert(service.clone(), wanted.into_iter().collect());
        }
        let mut ips: Vec<IpAddr> = specs
            .iter()
            .filter(|s| s.cluster_ip)
            .map(|s| s.addr.ip)
            .collect();
        ips.sort();
        ips.dedup();
        let old_ips = self.service_ips.remove(service).unwrap_or_default();
        if old_ips != ips {
            let touched: BTreeSet<AddrKey> = old_ips
                .iter()
                .chain(&ips)
                .map(|ip| AddrKey::host(*ip))
                .collect();
            let before: Vec<Option<AddrVerdict>> =
                touched.iter().map(|k| self.addr_verdict(k)).collect();
            for ip in &old_ips {
                if let Some(n) = self.ip_refs.get_mut(ip) {
                    *n -= 1;
                    if *n == 0 {
                        self.ip_refs.remove(ip);
                    }
                }
            }
            for ip in &ips {
                *self.ip_refs.entry(*ip).or_insert(0) += 1;
            }
            self.addr_ops(touched.iter().zip(before), &mut ops);
        }
        if !ips.is_empty() {
            self.service_ips.insert(service.clone(), ips);
        }
        self.free_backends.append(&mut self.released_backends);
        self.free_rev_nat.append(&mut self.released_rev_nat);
        ops.sort_by_key(Op::rank);
        Ok(ops)
    }

    /// The Services to plan again with [`Planner::set_service`] (in the same batch) because an
    /// address they claim was left by the Service programmed there: until they are, the
    /// address keeps the old claimant's backends.
    pub fn take_handoffs(&mut self) -> Vec<ServiceName> {
        std::mem::take(&mut self.handoffs).into_iter().collect()
    }

    /// Records that `service` claims `addr` (`held`: it did before this call) and says whether
    /// it is the claimant to program there.
    fn claim(&mut self, service: &ServiceName, addr: FrontendAddr, held: bool) -> bool {
        if let Some(claimants) = self.contested.get_mut(&addr) {
            if let Err(at) = claimants.binary_search(service) {
                claimants.insert(at, service.clone());
            }
            return claimants.last() == Some(service);
        }
        if held || !self.frontends.contains_key(&addr) {
            return true;
        }
        // Programmed for another Service: a contest begins. Finding that Service walks every
        // Service's addresses, which only a new contest (rare) pays for.
        let Some(other) = self
            .owners
            .iter()
            .find(|(_, addrs)| addrs.contains(&addr))
            .map(|(other, _)| other.clone())
        else {
            return true;
        };
        let mut claimants = vec![other, service.clone()];
        claimants.sort();
        let programmed = claimants.last() == Some(service);
        self.contested.insert(addr, claimants);
        programmed
    }

    /// `service` no longer claims `addr`: removes the frontend if nobody else does, or hands
    /// it to the next claimant if `service` was the one programmed.
    fn leave(&mut self, service: &ServiceName, addr: &FrontendAddr, ops: &mut Vec<Op>) {
        let Some(claimants) = self.contested.get_mut(addr) else {
            self.remove_frontend(addr, ops);
            return;
        };
        let programmed = claimants.last() == Some(service);
        claimants.retain(|c| c != service);
        let next = claimants.last().cloned();
        if claimants.len() < 2 {
            self.contested.remove(addr);
        }
        match next {
            None => self.remove_frontend(addr, ops),
            Some(next) if programmed => {
                self.handoffs.insert(next);
            }
            Some(_) => {}
        }
    }

    /// Makes the Service CIDRs `cidrs` (address and prefix length; host bits are cleared) and
    /// returns the address map updates: calls to an address inside them that no frontend and
    /// no ClusterIP matches are dropped.
    pub fn set_service_cidrs(&mut self, cidrs: &[(IpAddr, u8)]) -> Vec<Op> {
        let wanted: BTreeSet<AddrKey> = cidrs.iter().map(|(ip, len)| prefix(*ip, *len)).collect();
        if wanted == self.cidrs {
            return Vec::new();
        }
        let touched: BTreeSet<AddrKey> = self.cidrs.union(&wanted).copied().collect();
        let before: Vec<Option<AddrVerdict>> =
            touched.iter().map(|k| self.addr_verdict(k)).collect();
        self.cidrs = wanted;
        let mut ops = Vec::new();
        self.addr_ops(touched.iter().zip(before), &mut ops);
        ops.sort_by_key(Op::rank);
        ops
    }

    /// What the address map should hold at `key`: a ClusterIP rejects, a Service CIDR drops.
    fn addr_verdict(&self, key: &AddrKey) -> Option<AddrVerdict> {
        if *key == AddrKey::host(key.ip) && self.ip_refs.contains_key(&key.ip) {
            Some(AddrVerdict::Reject)
        } else if self.cidrs.contains(key) {
            Some(AddrVerdict::Drop)
        } else {
            None
        }
    }

    fn addr_ops<'k>(
        &self,
        changed: impl Iterator<Item = (&'k AddrKey, Option<AddrVerdict>)>,
        ops: &mut Vec<Op>,
    ) {
        for (key, before) in changed {
            match (before, self.addr_verdict(key)) {
                (b, Some(v)) if b != Some(v) => ops.push(Op::UpsertAddr(*key, v)),
                (Some(_), None) => ops.push(Op::DeleteAddr(*key)),
                _ => {}
            }
        }
    }

    /// Makes one frontend `spec`. Backend ids it releases are not handed out again within
    /// the same batch (see `released_backends`): the batch is sorted with backend deletes
    /// last, so an id freed by one frontend and taken by another (a multi-port Service whose
    /// endpoint moves: `a:8080` goes on one port, `b:8443` comes on the next) would be
    /// written, then deleted.
    fn set_frontend(&mut self, spec: &FrontendSpec, ops: &mut Vec<Op>) -> Result<(), Error> {
        if spec.backends.len() > usize::from(u16::MAX) {
            return Err(Error::TooManyBackends(spec.addr));
        }
        let mut wanted_ids = Vec::with_capacity(spec.backends.len());
        let mut seen = BTreeSet::new();
        for b in &spec.backends {
            if seen.insert(*b) {
                wanted_ids.push(self.take_backend(*b, ops)?);
            }
        }
        let (rev_nat, old_slots, old_head) = match self.frontends.get(&spec.addr) {
            Some(p) => (p.rev_nat, p.slots.clone(), Some(p.head())),
            None => {
                let id = self.take_rev_nat()?;
                ops.push(Op::UpsertRevNat(
                    id,
                    RevNat {
                        ip: spec.addr.ip,
                        port: spec.addr.port,
                    },
                ));
                (id, Vec::new(), None)
            }
        };
        let new_slots = reslot(&old_slots, &wanted_ids);
        let key = |slot: usize| ServiceKey {
            frontend: spec.addr,
            // Bounded by the length check above.
            slot: u16::try_from(slot).unwrap_or(u16::MAX),
        };
        for (i, id) in new_slots.iter().enumerate() {
            if old_slots.get(i) != Some(id) {
                ops.push(Op::UpsertService(
                    key(i + 1),
                    ServiceValue::slot(*id, rev_nat),
                ));
            }
        }
        for i in new_slots.len()..old_slots.len() {
            ops.push(Op::DeleteService(key(i + 1)));
        }
        let ranges: BTreeSet<AddrKey> = spec.source_ranges.iter().flatten().copied().collect();
        let old_ranges = self
            .frontends
            .get(&spec.addr)
            .map(|p| p.ranges.clone())
            .unwrap_or_default();
        for r in ranges.difference(&old_ranges) {
            ops.push(Op::UpsertRange(RangeKey {
                rev_nat,
                prefix: *r,
            }));
        }
        for r in old_ranges.difference(&ranges) {
            ops.push(Op::DeleteRange(RangeKey {
                rev_nat,
                prefix: *r,
            }));
        }
        let mut flags = 0;
        if spec.drop_when_empty {
            flags |= FLAG_DROP_EMPTY;
        }
        if spec.keep_source {
            flags |= FLAG_KEEP_SOURCE;
        }
        if spec.source_ranges.is_some() {
            flags |= FLAG_SRC_RANGES;
        }
        // The table follows the set of backends, which slots encode: it is computed again only
        // when they change (one update for the frontend, whatever else moved).
        let had_table = self
            .frontends
            .get(&spec.addr)
            .is_some_and(Programmed::maglev);
        let table = match self.scheduler {
            Scheduler::Maglev if !had_table || old_slots != new_slots => {
                self.maglev_table(&new_slots)
            }
            _ => None,
        };
        let has_table = match (table, self.scheduler) {
            (Some(t), _) => {
                ops.push(Op::UpsertMaglev(rev_nat, t));
                true
            }
            (None, Scheduler::Maglev) if had_table && old_slots == new_slots => true,
            _ => {
                if had_table {
                    ops.push(Op::DeleteMaglev(rev_nat));
                }
                false
            }
        };
        if has_table {
            flags |= FLAG_MAGLEV;
        }
        let programmed = Programmed {
            rev_nat,
            slots: new_slots,
            affinity: spec.affinity.unwrap_or(0),
            flags,
            ranges,
        };
        let head = programmed.head();
        if old_head != Some(head) {
            ops.push(Op::UpsertService(key(0), head));
        }
        if spec.addr.is_socket_udp() {
            let kept: HashSet<u32> = programmed.slots.iter().copied().collect();
            self.note_stale_udp(&spec.addr, old_slots.iter().filter(|id| !kept.contains(id)));
        }
        // References from the old slots go last, so a backend kept is never released.
        for id in &old_slots {
            self.release_backend(*id, ops);
        }
        self.frontends.insert(spec.addr, programmed);
        Ok(())
    }

    fn remove_frontend(&mut self, addr: &FrontendAddr, ops: &mut Vec<Op>) {
        let Some(p) = self.frontends.remove(addr) else {
            return;
        };
        for slot in (0..=p.slots.len()).rev() {
            ops.push(Op::DeleteService(ServiceKey {
                frontend: *addr,
                slot: u16::try_from(slot).unwrap_or(u16::MAX),
            }));
        }
        if addr.is_socket_udp() {
            self.note_stale_udp(addr, p.slots.iter());
        }
        for id in &p.slots {
            self.release_backend(*id, ops);
        }
        for r in &p.ranges {
            ops.push(Op::DeleteRange(RangeKey {
                rev_nat: p.rev_nat,
                prefix: *r,
            }));
        }
        if p.maglev() {
            ops.push(Op::DeleteMaglev(p.rev_nat));
        }
        self.rev_nat_used.remove(&p.rev_nat);
        // Not reusable in this batch: its delete is sorted after every write.
        self.released_rev_nat.push(p.rev_nat);
        ops.push(Op::DeleteRevNat(p.rev_nat));
    }

    /// Records that UDP frontend `addr` no longer has the backends `gone` (ids still
    /// programmed).
    fn note_stale_udp<'a>(&mut self, addr: &FrontendAddr, gone: impl Iterator<Item = &'a u32>) {
        for id in gone {
            if let Some(b) = self.backends.get(id) {
                self.stale_udp.push(StaleUdp {
                    frontend: addr.socket_addr(),
                    backend: SocketAddr::new(b.ip, b.port),
                });
            }
        }
    }

    /// The UDP frontends (of the socket hooks) and backends the batches planned since the last
    /// call took apart, and that are still apart: the connected sockets the hooks sent to such
    /// a backend for such a frontend talk to an endpoint that left it. A pair taken apart and
    /// made again (an endpoint that left and came back) is not in it.
    pub fn take_stale_udp(&mut self) -> Vec<StaleUdp> {
        let mut out = std::mem::take(&mut self.stale_udp);
        out.sort();
        out.dedup();
        out.retain(|pair| !self.serves_udp(pair));
        out
    }

    /// Whether UDP frontend `pair.frontend` has backend `pair.backend`.
    fn serves_udp(&self, pair: &StaleUdp) -> bool {
        let frontend = FrontendAddr {
            ip: pair.frontend.ip(),
            port: pair.frontend.port(),
            protocol: Protocol::Udp,
            scope: Scope::Socket,
        };
        let backend = Backend {
            ip: pair.backend.ip(),
            port: pair.backend.port(),
            protocol: Protocol::Udp,
        };
        match (
            self.frontends.get(&frontend),
            self.backend_ids.get(&backend),
        ) {
            (Some(p), Some((id, _))) => p.slots.contains(id),
            _ => false,
        }
    }

    fn take_backend(&mut self, b: Backend, ops: &mut Vec<Op>) -> Result<u32, Error> {
        if let Some((id, refs)) = self.backend_ids.get_mut(&b) {
            *refs += 1;
            return Ok(*id);
        }
        let id = match self.free_backends.pop() {
            Some(id) => id,
            None => {
                let id = self.next_backend;
                self.next_backend = id.checked_add(1).ok_or(Error::BackendIds)?;
                id
            }
        };
        self.backend_ids.insert(b, (id, 1));
        self.backends.insert(id, b);
        ops.push(Op::UpsertBackend(id, b));
        Ok(id)
    }

    fn release_backend(&mut self, id: u32, ops: &mut Vec<Op>) {
        let Some(b) = self.backends.get(&id).copied() else {
            return;
        };
        let gone = match self.backend_ids.get_mut(&b) {
            Some((_, refs)) => {
                *refs -= 1;
                *refs == 0
            }
            None => false,
        };
        if gone {
            self.backend_ids.remove(&b);
            self.backends.remove(&id);
            self.released_backends.push(id);
            // A backend written in this batch and released again cancels out.
            if let Some(pos) = ops
                .iter()
                .position(|op| matches!(op, Op::UpsertBackend(i, _) if *i == id))
            {
                ops.remove(pos);
            } else {
                ops.push(Op::DeleteBackend(id));
            }
        }
    }

    fn take_rev_nat(&mut self) -> Result<u16, Error> {
        let id = match self.free_rev_nat.pop() {
            Some(id) => id,
            None => {
                let id = self.next_rev_nat;
                if id == u16::MAX {
                    return Err(Error::RevNatIds);
                }
                self.next_rev_nat = id + 1;
                id
            }
        };
        self.rev_nat_used.insert(id);
        Ok(id)
    }

    /// The Services this planner has frontends for.
    pub fn services(&self) -> impl Iterator<Item = &ServiceName> + '_ {
        self.owners.keys()
    }

    /// Everything the maps should hold now.
    pub fn contents(&self) -> Contents {
        let mut c = Contents::default();
        for (addr, p) in &self.frontends {
            c.rev_nat.insert(
                p.rev_nat,
                RevNat {
                    ip: addr.ip,
                    port: addr.port,
                },
            );
            c.services.insert(
                ServiceKey {
                    frontend: *addr,
                    slot: 0,
                },
                p.head(),
            );
            c.ranges.extend(p.ranges.iter().map(|r| RangeKey {
                rev_nat: p.rev_nat,
                prefix: *r,
            }));
            if p.maglev() {
                if let Some(t) = self.maglev_table(&p.slots) {
                    c.maglev.insert(p.rev_nat, t);
                }
            }
            for (i, id) in p.slots.iter().enumerate() {
                c.services.insert(
                    ServiceKey {
                        frontend: *addr,
                        slot: u16::try_from(i + 1).unwrap_or(u16::MAX),
                    },
                    ServiceValue::slot(*id, p.rev_nat),
                );
            }
        }
        c.backends = self.backends.iter().map(|(k, v)| (*k, *v)).collect();
        for key in &self.cidrs {
            c.addrs.insert(*key, AddrVerdict::Drop);
        }
        for ip in self.ip_refs.keys() {
            c.addrs.insert(AddrKey::host(*ip), AddrVerdict::Reject);
        }
        c
    }
}

/// The prefix `ip/len` with its host bits cleared (a length beyond the family's is the whole
/// address).
fn prefix(ip: IpAddr, len: u8) -> AddrKey {
    match ip {
        IpAddr::V4(v4) => {
            let len = len.min(32);
            let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
            AddrKey {
                ip: IpAddr::V4((u32::from(v4) & mask).into()),
                len,
            }
        }
        IpAddr::V6(v6) => {
            let len = len.min(128);
            let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
            AddrKey {
                ip: IpAddr::V6((u128::from(v6) & mask).into()),
                len,
            }
        }
    }
}

/// The new slot order: backends kept stay in their slot; a slot whose backend went takes the
/// last kept backend; new backends are appended. So removing one backend rewrites at most one
/// slot and deletes one, and adding one writes one.
fn reslot(old: &[u32], wanted: &[u32]) -> Vec<u32> {
    let keep: BTreeSet<u32> = wanted.iter().copied().collect();
    let mut slots: Vec<u32> = old.to_vec();
    let mut i = 0;
    while i < slots.len() {
        if keep.contains(&slots[i]) {
            i += 1;
        } else {
            slots.swap_remove(i);
        }
    }
    let present: BTreeSet<u32> = slots.iter().copied().collect();
    slots.extend(wanted.iter().filter(|id| !present.contains(id)));
    slots
}

#[cfg(test)]
mod tests;
