//! The `ebpf` mode as a [`Dataplane`]: loads and attaches the socket load balancer at start,
//! plans each changed Service's frontends with `kp-ebpf-plan` and writes the element-level
//! updates; a full sync plans everything afresh and writes only the difference from what the
//! maps hold (so maps pinned by a previous run are adopted, not flushed).
//!
//! Besides the frontends, each sync writes the address map: every ClusterIP refuses its other
//! ports, and every Service CIDR drops what no Service holds.
//!
//! With a pin directory, the programs' links are pinned beside the maps: they stay attached
//! when the proxy exits, and a restart swaps in its own links without a gap.
//!
//! With [`Config::tc`], the tc path for traffic from outside the node is attached at start, in
//! the calling thread's network namespace: `kp_tc_outside` on the interfaces outside traffic
//! arrives on, `kp_tc_reply` on the others; interfaces that appear later (a new pod's veth) are
//! picked up at each full sync when the reply interfaces are discovered ([`TcDevices::Discover`]).

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use kp_core::dataplane::{Dataplane, DataplaneError, HeldBackend, SyncReport};
use kp_core::model::ServiceKey as ServiceName;
use kp_core::node::NodePortAddresses;
use kp_core::track::{Changes, ProxyState};
use kp_ebpf_plan::{
    diff, diff_into, no_local_endpoints, node_port_addresses, service_cidrs, service_specs_holding,
    Backend, FrontendSpec, Planner, Scheduler, StaleUdp,
};

use crate::nat_hooks::NatHooks;
use crate::{Error, MapSizes, Resized, SocketLb};

/// How the mode is set up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// The cgroup v2 directory the hooks attach to: the hierarchy's root in a real node
    /// ([`crate::cgroup::find_cgroup2_root`]), a cgroup of their own in tests.
    pub cgroup: PathBuf,
    /// Where the maps are pinned (a bpffs directory); `None`: not pinned.
    pub pin_dir: Option<PathBuf>,
    /// Map sizes.
    pub sizes: MapSizes,
    /// The table that keeps netfilter's NAT hooks registered ([`NatHooks`]): made at start,
    /// made again by each full sync if it went, checked by `verify`, removed by `cleanup`.
    /// `None`: not kept (tests of the programs alone).
    pub nat_hooks: Option<NatHooks>,
    /// Where NodePorts answer: of the node's addresses (its Node object's), those this leaves.
    pub node_ports: NodePortAddresses,
    /// The tc path for traffic from outside the node; `None`: socket load balancing only.
    pub tc: Option<TcDevices>,
    /// Who hears of a full map and of pinned maps recreated at a new size (the registry: a log
    /// line and a metric; this crate neither logs nor counts).
    pub events: Events,
    /// How a new connection's backend is picked (`ipvs.scheduler`): at random, or by the
    /// client's hash in each frontend's Maglev table (`sh`, `mh`). A change takes effect with
    /// the first full sync (the tables are written or deleted, the frontends' flags follow).
    pub scheduler: Scheduler,
}

impl Config {
    /// Hooks on `cgroup`, nothing else: maps unpinned at the default sizes, no NAT-hooks table,
    /// NodePorts on the node's primary addresses, no tc path, no event receiver, a random pick.
    /// Set the rest with struct update syntax.
    pub fn new(cgroup: PathBuf) -> Config {
        Config {
            cgroup,
            pin_dir: None,
            sizes: MapSizes::default(),
            nat_hooks: None,
            node_ports: NodePortAddresses::Primary,
            tc: None,
            events: Events::default(),
            scheduler: Scheduler::default(),
        }
    }
}

/// What the dataplane reports besides its errors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A sync stopped because map `name` had no room for another entry (it also returns
    /// [`Error::Full`]); the maps hold a prefix of the sync's updates until sizes change.
    Full {
        /// The map.
        name: &'static str,
        /// Its size.
        max_entries: u32,
    },
    /// At start, a pinned map whose size was not the configured one was unpinned and created
    /// afresh at the configured size (empty until the first full sync).
    Resized(Resized),
    /// A sync took backends from UDP frontends (`pairs` of them) and destroyed the connected
    /// sockets the hooks had sent there, one pair per socket in `destroyed`.
    StaleUdp {
        /// Frontend and backend pairs taken apart.
        pairs: usize,
        /// The sockets destroyed, by pair.
        destroyed: Vec<StaleUdp>,
    },
    /// Stale UDP sockets cannot be destroyed: at start, because the kernel lacks what it takes
    /// (reported once); at a sync, what failed (those sockets stay connected to the backend).
    StaleUdpFailed(String),
}

/// What [`Events`] calls.
type Receiver = Arc<dyn Fn(&Event) + Send + Sync>;

/// The receiver of [`Event`]s; none by default.
#[derive(Clone, Default)]
pub struct Events(Option<Receiver>);

impl Events {
    /// Calls `f` with every event.
    pub fn new(f: impl Fn(&Event) + Send + Sync + 'static) -> Events {
        Events(Some(Arc::new(f)))
    }

    /// Hands `event` to the receiver, if any (the dataplane does; so may a test of a receiver).
    pub fn emit(&self, event: Event) {
        if let Some(f) = &self.0 {
            f(&event);
        }
    }
}

impl std::fmt::Debug for Events {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Events(..)"
        } else {
            "Events(none)"
        })
    }
}

/// The same receiver (or none on both sides).
impl PartialEq for Events {
    fn eq(&self, other: &Events) -> bool {
        match (&self.0, &other.0) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        }
    }
}

impl Eq for Events {}

/// Which interfaces the tc programs go on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TcDevices {
    /// These: `outside` get `kp_tc_outside`, `replies` get `kp_tc_reply`.
    Named {
        /// Where traffic from outside the node arrives.
        outside: Vec<String>,
        /// Where backends' replies arrive (pod veths, links to other nodes).
        replies: Vec<String>,
    },
    /// `outside` as named; every other interface of the namespace but loopback gets the reply
    /// program, those that appear later at the next full sync.
    Discover {
        /// Where traffic from outside the node arrives.
        outside: Vec<String>,
    },
}

impl TcDevices {
    fn resolve(&self) -> std::io::Result<(Vec<String>, Vec<String>)> {
        match self {
            TcDevices::Named { outside, replies } => Ok((outside.clone(), replies.clone())),
            TcDevices::Discover { outside } => {
                let replies = crate::local::interfaces()?
                    .into_iter()
                    .filter(|d| d != "lo" && !outside.contains(d))
                    .collect();
                Ok((outside.clone(), replies))
            }
        }
    }
}

/// The eBPF dataplane.
pub struct EbpfDataplane {
    config: Config,
    lb: Option<SocketLb>,
    planner: Planner,
    /// Per Service, its ports with a Local policy and no local endpoint, per family.
    no_local: HashMap<ServiceName, [(u64, u64); 2]>,
    /// Endpoints the mode before a switch still answers for: left out of the socket hooks'
    /// picks where a frontend has others ([`Dataplane::hold_backends`]).
    held: BTreeSet<Backend>,
}

impl EbpfDataplane {
    /// A dataplane that loads and attaches nothing until [`Dataplane::start`].
    pub fn new(config: Config) -> EbpfDataplane {
        EbpfDataplane {
            lb: None,
            planner: Planner::with_scheduler(config.scheduler),
            no_local: HashMap::new(),
            held: BTreeSet::new(),
            config,
        }
    }

    /// `service`'s frontends as this dataplane writes them: held backends left out.
    fn specs(
        &self,
        state: &ProxyState,
        service: &ServiceName,
        node_addresses: &[std::net::IpAddr],
    ) -> Vec<FrontendSpec> {
        service_specs_holding(state, service, node_addresses, &self.held)
    }

    /// Makes the NAT hooks' table again unless it is there as it should be.
    fn keep_nat_hooks(&self) -> Result<(), DataplaneError> {
        match &self.config.nat_hooks {
            Some(hooks) => hooks
                .ensure()
                .map(|_| ())
                .map_err(kp_nftables::Error::into_dataplane),
            None => Ok(()),
        }
    }

    /// Destroys the connected UDP sockets of the cgroup's processes that the hooks sent to a
    /// backend of `pairs` for its frontend. Reported as an event, not as a sync error: the maps
    /// are written, and the sockets would stay as they are on a retry as well.
    fn destroy_stale_udp(&mut self, pairs: &[StaleUdp]) {
        if pairs.is_empty() {
            return;
        }
        let events = self.config.events.clone();
        let cgroup = self.config.cgroup.clone();
        let Some(lb) = self.lb.as_mut() else {
            return;
        };
        // Reported once, at start.
        if lb.stale_udp_support().is_err() {
            return;
        }
        let result = crate::cgroup::network_namespaces(&cgroup)
            .map_err(|e| Error::StaleUdp(format!("listing {}: {e}", cgroup.display())))
            .and_then(|namespaces| lb.destroy_stale_udp(pairs, namespaces));
        events.emit(match result {
            Ok(destroyed) => Event::StaleUdp {
                pairs: pairs.len(),
                destroyed,
            },
            Err(e) => Event::StaleUdpFailed(e.to_string()),
        });
    }

    fn lb(&mut self) -> Result<&mut SocketLb, DataplaneError> {
        self.lb
            .as_mut()
            .ok_or_else(|| DataplaneError::permanent(Error::Missing("loaded program (start)")))
    }
}

/// Map updates a full sync writes at a time.
const BATCH: usize = 4096;

/// Writes `ops` in order; a full map is also reported as an [`Event::Full`].
fn write(
    lb: &mut SocketLb,
    events: &Events,
    ops: &[kp_ebpf_plan::Op],
) -> Result<(), DataplaneError> {
    lb.apply(ops).map_err(|e| {
        if let Error::Full { name, max_entries } = &e {
            events.emit(Event::Full {
                name,
                max_entries: *max_entries,
            });
        }
        dataplane_error(e)
    })
}

fn dataplane_error(e: Error) -> DataplaneError {
    match e {
        Error::Map { .. } | Error::Unreadable(_) | Error::Full { .. } | Error::StaleUdp(_) => {
            DataplaneError::transient(e)
        }
        Error::Load(_)
        | Error::Program { .. }
        | Error::Missing(_)
        | Error::Cgroup { .. }
        | Error::PinDir { .. }
        | Error::Pin { .. } => DataplaneError::permanent(e),
    }
}

impl Dataplane for EbpfDataplane {
    fn mode(&self) -> &'static str {
        "ebpf"
    }

    fn start(&mut self) -> Result<(), DataplaneError> {
        self.keep_nat_hooks()?;
        if let Some(dir) = &self.config.pin_dir {
            // On bpffs (a directory of bpffs is one too); a missing one is made here.
            std::fs::create_dir_all(dir).map_err(|source| {
                dataplane_error(Error::PinDir {
                    path: dir.clone(),
                    source,
                })
            })?;
        }
        let mut lb = SocketLb::load(self.config.sizes, self.config.pin_dir.as_deref())
            .map_err(dataplane_error)?;
        for r in lb.resized() {
            self.config.events.emit(Event::Resized(r.clone()));
        }
        if let Err(why) = lb.stale_udp_support() {
            self.config
                .events
                .emit(Event::StaleUdpFailed(why.to_string()));
        }
        lb.attach(&self.config.cgroup).map_err(dataplane_error)?;
        if let Some(tc) = &self.config.tc {
            let (outside, replies) = tc.resolve().map_err(DataplaneError::transient)?;
            lb.attach_tc(&outside, &replies).map_err(dataplane_error)?;
        }
        if let Some(dir) = &self.config.pin_dir {
            lb.pin_links(dir).map_err(dataplane_error)?;
            lb.pin_tc_links(dir).map_err(dataplane_error)?;
        }
        self.lb = Some(lb);
        Ok(())
    }

    fn sync(
        &mut self,
        state: &ProxyState,
        changes: &Changes,
        full: bool,
    ) -> Result<SyncReport, DataplaneError> {
        let plan_error = |e| DataplaneError::transient(e);
        // Read at each sync: an address that comes or goes without a Service change is
        // picked up by the next full sync.
        let local = match self.config.node_ports {
            NodePortAddresses::Primary => Vec::new(),
            _ => crate::local::local_addresses().map_err(DataplaneError::transient)?,
        };
        let node_addresses = node_port_addresses(&self.config.node_ports, state, &local);
        if full {
            self.keep_nat_hooks()?;
        }
        if let (true, Some(tc @ TcDevices::Discover { .. })) = (full, self.config.tc.clone()) {
            let (outside, replies) = tc.resolve().map_err(DataplaneError::transient)?;
            let pin_dir = self.config.pin_dir.clone();
            let lb = self.lb()?;
            lb.attach_tc(&outside, &replies).map_err(dataplane_error)?;
            if let Some(dir) = pin_dir {
                lb.pin_tc_links(&dir).map_err(dataplane_error)?;
            }
        }
        let stale: Vec<StaleUdp>;
        let operations = if full {
            let planner = kp_ebpf_plan::plan_state_with(
                state,
                &self.config.node_ports,
                &local,
                self.config.scheduler,
                &self.held,
            )
            .map_err(plan_error)?;
            let have = self.lb()?.read_back().map_err(dataplane_error)?;
            stale = kp_ebpf_plan::stale_udp(&have, &planner);
            // Written as they are found, a batch at a time: a list of them all would hold an
            // entry per map element at a first sync, beside the planner.
            let events = self.config.events.clone();
            let lb = self.lb()?;
            let mut batch = Vec::with_capacity(BATCH);
            let mut written = 0;
            diff_into(&have, &planner, |op| {
                batch.push(op);
                if batch.len() == BATCH {
                    write(lb, &events, &batch)?;
                    written += batch.len();
                    batch.clear();
                }
                Ok(())
            })?;
            write(lb, &events, &batch)?;
            written += batch.len();
            self.planner = planner;
            self.no_local = state
                .service_keys()
                .map(|k| (k.clone(), no_local_endpoints(state, k)))
                .filter(|(_, n)| *n != [(0, 0); 2])
                .collect();
            written
        } else {
            let mut ops = Vec::new();
            // A node change may move the NodePort addresses: every Service is planned again
            // (the planner writes only what differs), and so is every changed one, which
            // includes a Service deleted in the same batch (no longer in the state).
            let services: Vec<&ServiceName> = if changes.node_changed {
                let all: BTreeSet<&ServiceName> =
                    state.service_keys().chain(&changes.services).collect();
                all.into_iter().collect()
            } else {
                changes.services.iter().collect()
            };
            for service in services {
                match no_local_endpoints(state, service) {
                    [(0, 0), (0, 0)] => self.no_local.remove(service),
                    n => self.no_local.insert(service.clone(), n),
                };
                let specs = self.specs(state, service, &node_addresses);
                ops.extend(
                    self.planner
                        .set_service(service, &specs)
                        .map_err(plan_error)?,
                );
            }
            // A Service that left an address it shared with another (an external IP two
            // Services list) hands it over: the other is planned again, writing its backends
            // there. That writes nothing new, so no more hand-offs follow.
            for service in self.planner.take_handoffs() {
                let specs = self.specs(state, &service, &node_addresses);
                ops.extend(
                    self.planner
                        .set_service(&service, &specs)
                        .map_err(plan_error)?,
                );
            }
            // A handful of entries, compared in place: ServiceCIDR objects and the node come
            // and go without naming a Service.
            ops.extend(self.planner.set_service_cidrs(&service_cidrs(state)));
            stale = self.planner.take_stale_udp();
            let events = self.config.events.clone();
            write(self.lb()?, &events, &ops)?;
            ops.len()
        };
        // Once no slot names them any more: a socket connected from now on gets a backend the
        // frontend has.
        self.destroy_stale_udp(&stale);
        Ok(SyncReport {
            full,
            operations,
            // Per family, summed over Services; the larger family's, as upstream's per-family
            // proxiers each report theirs and the metric keeps the last.
            no_local_endpoints: (0..2)
                .map(|i| {
                    self.no_local
                        .values()
                        .fold((0, 0), |(a, b), n| (a + n[i].0, b + n[i].1))
                })
                .fold((0, 0), |a, b| (a.0.max(b.0), a.1.max(b.1))),
        })
    }

    /// Socket load balancing connects clients straight to backends, which an IPVS entry of the
    /// mode before would answer for with the virtual server's address: held backends leave the
    /// hooks' picks (see [`kp_ebpf_plan::hold`]) until the set says otherwise.
    fn hold_backends(&mut self, held: &BTreeSet<HeldBackend>) -> bool {
        let held: BTreeSet<Backend> = held.iter().map(|&h| Backend::from(h)).collect();
        let changed = held != self.held;
        self.held = held;
        changed
    }

    fn verify(&mut self) -> Result<Vec<String>, DataplaneError> {
        let have = self.lb()?.read_back().map_err(dataplane_error)?;
        let mut out: Vec<String> = diff(&have, &self.planner)
            .into_iter()
            .map(|op| format!("maps differ from the plan: needs {op:?}"))
            .collect();
        if let Some(hooks) = &self.config.nat_hooks {
            out.extend(hooks.check().map_err(kp_nftables::Error::into_dataplane)?);
        }
        Ok(out)
    }

    fn cleanup(&mut self) -> Result<(), DataplaneError> {
        // Dropping the loader detaches every program whose link is not pinned and closes the
        // maps; removing the pins detaches the rest.
        self.lb = None;
        self.planner = Planner::with_scheduler(self.config.scheduler);
        self.no_local.clear();
        if let Some(dir) = &self.config.pin_dir {
            crate::remove_pins(dir).map_err(DataplaneError::transient)?;
        }
        if let Some(hooks) = &self.config.nat_hooks {
            hooks.remove().map_err(kp_nftables::Error::into_dataplane)?;
        }
        Ok(())
    }
}
