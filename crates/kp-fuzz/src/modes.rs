//! The renderers of the modes that came after the fuzzer: userspace (the redirect table's nft
//! text, replayed into `UserspaceTracer`, and the balancer's routes), ipvs (virtual servers,
//! ipset entries and their `ipset restore` text, the iptables-restore input of its chains) and
//! ebpf (map updates and their bytes). Each is planned as its mode plans a sync, on the same
//! accumulated state as the nftables and iptables planners, and checked for:
//!
//! - no panic (the caller runs all of this under `guard`);
//! - no marker and no control character in any rendered text, nor the marker in any map
//!   entry's bytes;
//! - every key built from a validated address or port ([`Allowed`]): a frontend is one of a
//!   Service port's ClusterIPs, external or LoadBalancer IPs with that port and protocol, or a
//!   node address with its NodePort; a backend or real server is an endpoint address and port
//!   of the state; a network is a Service CIDR, a source range, a pod or NodePort network of
//!   the node's context;
//! - what the mode reads back equals what it wrote: the userspace tracer holds the planner's
//!   elements; ipset restore text parses back into the sets; ebpf map entries decode from
//!   their bytes to themselves; partial plans (ebpf's element updates, ipvs's diff against
//!   the last state) end where a fresh full plan does.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use ipnet::IpNet;
use kp_core::frontend::Frontends;
use kp_core::model::{IpFamily, Protocol, ServiceKey as ServiceName};
use kp_core::node::{NodeContext, NodePortAddresses};
use kp_core::track::{Changes, ProxyState};
use kp_ebpf_plan as ebpf;
use kp_ipvs_plan as ipvs;
use kp_ipvs_plan::Planned as _;
use kp_netlink::ipvs as nl;
use kp_userspace_plan as us;

use crate::hostile::{smuggled, smuggled_bytes};
use crate::report::{Check, Report};

/// The validated addresses and ports of a state: what keys may be made of.
#[derive(Debug, Default)]
pub struct Allowed {
    /// `(address, protocol, port)` of every ClusterIP, external IP and LoadBalancer IP.
    vips: HashSet<(IpAddr, Protocol, u16)>,
    /// The addresses alone.
    vip_ips: HashSet<IpAddr>,
    /// `(protocol, NodePort)`.
    node_ports: HashSet<(Protocol, u16)>,
    /// Health check node ports.
    health_ports: HashSet<u16>,
    /// The node's addresses (interfaces and the Node object's).
    node_ips: HashSet<IpAddr>,
    /// Every endpoint's `(address, port)`.
    endpoints: HashSet<(IpAddr, u16)>,
    /// Networks: Service CIDRs, source ranges, the node context's pod and NodePort networks
    /// (host bits cleared).
    nets: HashSet<IpNet>,
}

impl Allowed {
    /// What `state` validated, with the node's `context` and interface addresses `local`.
    pub fn of(state: &ProxyState, context: &NodeContext, local: &[IpAddr]) -> Allowed {
        let mut a = Allowed::default();
        for key in state.service_keys() {
            for port in state.service_ports(key) {
                let proto = port.name.protocol;
                for ip in port
                    .cluster_ips
                    .iter()
                    .chain(&port.external_ips)
                    .chain(&port.load_balancer_ips)
                {
                    a.vips.insert((*ip, proto, port.port));
                    a.vip_ips.insert(*ip);
                }
                if let Some(np) = port.node_port {
                    a.node_ports.insert((proto, np));
                }
                if let Some(hc) = port.health_check_node_port {
                    a.health_ports.insert(hc);
                }
                a.nets
                    .extend(port.load_balancer_source_ranges.iter().map(IpNet::trunc));
                for e in state.endpoints(&port.name) {
                    a.endpoints.insert((e.ip, e.port));
                }
            }
        }
        a.node_ips.extend(local.iter().copied());
        a.node_ips.extend(context.node_ips.iter().copied());
        a.nets.extend(
            state
                .service_cidrs()
                .iter()
                .chain(&context.service_cidrs)
                .chain(&context.local_cidrs)
                .chain(&context.node_port_addresses)
                .map(IpNet::trunc),
        );
        a
    }

    /// A frontend: a Service address with its port, or a node address with a NodePort.
    fn frontend(&self, ip: IpAddr, proto: Protocol, port: u16) -> bool {
        self.vips.contains(&(ip, proto, port))
            || (self.node_ips.contains(&ip) && self.node_ports.contains(&(proto, port)))
    }

    /// A network: a validated one, or one Service address alone.
    fn net(&self, net: &IpNet) -> bool {
        let net = net.trunc();
        self.nets.contains(&net)
            || (net.prefix_len() == net.max_prefix_len() && self.vip_ips.contains(&net.addr()))
    }

    /// The NodePorts and Service ports of the state, for probes.
    fn ports(&self) -> BTreeSet<u16> {
        self.vips
            .iter()
            .map(|(_, _, p)| *p)
            .chain(self.node_ports.iter().map(|(_, p)| *p))
            .collect()
    }
}

/// Records a key built from something validation did not vouch for.
fn unvalidated(report: &mut Report, i: u64, what: &str, detail: impl std::fmt::Debug) -> bool {
    report.violation(Check::KeyNotValidated, i, &format!("{what}: {detail:?}"));
    false
}

/// Checks rendered text for the marker and control characters (the harness's own check).
fn text(what: &str, t: &str, i: u64, report: &mut Report) -> bool {
    crate::harness::check_text(what, t, i, report)
}

/// How the three modes are configured for one epoch.
#[derive(Clone, Debug)]
pub struct ModeSetup {
    /// The userspace proxy port.
    pub proxy_port: u16,
    /// The userspace transparent mark.
    pub transparent_mark: u32,
    /// The scheduler (userspace's balancer and ipvs both take IPVS's names).
    pub scheduler: &'static str,
}

/// Schedulers both the balancer and IPVS know.
pub const SCHEDULERS: &[&str] = &["rr", "lc", "sh", "dh", "sed", "nq"];

/// The planners of the three modes for one epoch, with what they believe the kernel holds.
pub struct ModePlanners {
    /// The redirect table planner.
    redirect: us::RedirectPlanner,
    /// Replays the redirect table and holds the balancer.
    tracer: kp_userspace_test::UserspaceTracer,
    /// The ipvs configuration.
    ipvs_config: ipvs::Config,
    /// The last ipvs state planned: virtual servers as the kernel holds them after the last
    /// sync, and each family's sets.
    ipvs_kernel: Vec<(nl::Service, Vec<nl::DestinationState>)>,
    ipvs_sets: Vec<ipvs::ipset::Sets>,
    /// The running mode's planner (kept one Service at a time, as kp-ipvs's dataplane keeps
    /// it) and the virtual servers as the kernel holds them after its deltas.
    ipvs_planner: ipvs::planner::Planner,
    ipvs_incremental: Vec<(nl::Service, Vec<nl::DestinationState>)>,
    /// The ebpf planner (element updates per changed Service) and the maps it wrote.
    ebpf: Option<ebpf::Planner>,
    ebpf_maps: ebpf::Contents,
    /// How many frontend specs of which Services the ebpf planner was given for each frontend,
    /// and the frontends one Service listed twice at some time (see [`EBPF_CONTESTED`]).
    ebpf_claims: HashMap<ebpf::FrontendAddr, BTreeMap<ServiceName, usize>>,
    ebpf_shared: HashSet<ebpf::FrontendAddr>,
}

impl ModePlanners {
    /// Planners of `setup`; nothing programmed yet.
    pub fn new(
        setup: ModeSetup,
        masquerade_all: bool,
        detect_local: kp_core::node::DetectLocal,
        node_ports_restricted: bool,
    ) -> ModePlanners {
        let scheduler: us::Scheduler = setup.scheduler.parse().unwrap_or_default();
        let balancer = us::Balancer::new(us::BalancerConfig {
            scheduler,
            masquerade_all,
            detect_local,
            quarantine: Duration::from_secs(10),
        });
        // A scheduler name from the list above: valid.
        let ipvs_config = ipvs::Config::new(setup.scheduler, 0, Vec::new())
            .unwrap_or_else(|_| ipvs::Config::new("rr", 0, Vec::new()).expect("rr is valid"));
        ModePlanners {
            redirect: us::RedirectPlanner::new(us::RedirectConfig {
                proxy_port: setup.proxy_port,
                transparent_mark: setup.transparent_mark,
                node_ports_restricted,
            }),
            tracer: kp_userspace_test::UserspaceTracer::new(kp_flows::node_addresses(), balancer),
            ipvs_config,
            ipvs_kernel: Vec::new(),
            ipvs_sets: IpFamily::ALL.map(ipvs::ipset::Sets::new).into(),
            ipvs_planner: ipvs::planner::Planner::new(&IpFamily::ALL),
            ipvs_incremental: Vec::new(),
            ebpf: None,
            ebpf_maps: ebpf::Contents::default(),
            ebpf_claims: HashMap::new(),
            ebpf_shared: HashSet::new(),
        }
    }

    /// A sync of every mode: full when `changes` is `None` (the epoch's first), else partial
    /// for the Services `changes` names. `converge`: also compare with fresh full plans.
    #[allow(clippy::too_many_arguments)]
    pub fn sync(
        &mut self,
        state: &ProxyState,
        node: &NodeContext,
        node_ports: &NodePortAddresses,
        ipt: &kp_iptables_plan::PlanConfig,
        changes: Option<&Changes>,
        converge: bool,
        i: u64,
        report: &mut Report,
    ) -> bool {
        let local = kp_flows::node_addresses();
        let allowed = Allowed::of(state, node, &local);
        let mut ok = self.userspace(state, node, changes, &allowed, i, report);
        ok &= self.ipvs(
            state, node, node_ports, ipt, &local, changes, &allowed, i, report,
        );
        ok &= self.ebpf(
            state, node_ports, &local, changes, converge, &allowed, i, report,
        );
        ok
    }

    /// The redirect table (text through the tracer, elements checked) and the balancer's routes.
    fn userspace(
        &mut self,
        state: &ProxyState,
        node: &NodeContext,
        changes: Option<&Changes>,
        allowed: &Allowed,
        i: u64,
        report: &mut Report,
    ) -> bool {
        let empty = Changes::default();
        let (ch, full) = match changes {
            Some(c) => (c, false),
            None => (&empty, true),
        };
        let tx = self.redirect.sync(state, node, ch, full);
        report.userspace_plans += 1;
        let mut ok = text("userspace redirect table", &tx.text, i, report);
        if let Err(e) = self.tracer.apply(&tx.text) {
            report.violation(
                Check::TracerRefused,
                i,
                &format!("userspace: {e}\n{}", crate::report::short(&tx.text, 300)),
            );
            return false;
        }
        for set in us::SetId::all() {
            let want = self.redirect.expected_elements(set);
            report.userspace_elements += want.len() as u64;
            for (k, v) in &want {
                ok &= redirect_element(allowed, &set.name(), k, v.as_ref(), i, report);
            }
            let traced = self.tracer.elements(&set.name()).map_or(0, |e| e.len());
            if traced != want.len() {
                report.violation(
                    Check::Diverged,
                    i,
                    &format!(
                        "userspace tracer holds {traced} elements in {}, the planner {}",
                        set.name(),
                        want.len()
                    ),
                );
                ok = false;
            }
        }
        let balancer = self.tracer.balancer_mut();
        balancer.sync(state, node, ch, full);
        ok & routes(balancer, allowed, i, report)
    }

    /// The ipvs mode's sync: virtual servers diffed against the last ones, ipset changes as
    /// restore text, the chains' iptables-restore input; and the running mode's planner, whose
    /// partial syncs must end where the plan made in one go does.
    #[allow(clippy::too_many_arguments)]
    fn ipvs(
        &mut self,
        state: &ProxyState,
        node: &NodeContext,
        node_ports: &NodePortAddresses,
        ipt: &kp_iptables_plan::PlanConfig,
        local: &[IpAddr],
        changes: Option<&Changes>,
        allowed: &Allowed,
        i: u64,
        report: &mut Report,
    ) -> bool {
        let node_addresses = ebpf::node_port_addresses(node_ports, state, local);
        let mut ok = self.ipvs_incremental(state, node, &node_addresses, changes, i, report);
        // The plan in one go, with the running planner's marks (which depend on the order
        // ports came in, not on the state).
        let mut marks = self.ipvs_planner.local().clone();
        let mut desired = ipvs::Desired::new();
        let mut sets: Vec<ipvs::ipset::Sets> = IpFamily::ALL.map(ipvs::ipset::Sets::new).into();
        for key in state.service_keys() {
            for sps in state.service_state(key) {
                for s in sets.iter_mut() {
                    let frontends = Frontends::of(&sps, s.family());
                    desired.add_marked(&frontends, &node_addresses, &self.ipvs_config, &mut marks);
                    s.add(&frontends, &node_addresses, node);
                }
            }
        }
        report.ipvs_plans += 1;
        let whole = &self.ipvs_planner;
        let same_rules = IpFamily::ALL
            .iter()
            .all(|f| whole.local().rules(*f).eq(desired.local().rules(*f)));
        if !whole.virtual_servers().eq(desired.services().iter())
            || whole.bind_addresses() != desired.bind_addresses()
            || !same_rules
            || self.ipvs_planner.sets() != sets.as_slice()
        {
            let differing = desired
                .services()
                .iter()
                .find(|(k, v)| whole.virtual_server(k) != Some(*v))
                .map(|(k, _)| k.to_string())
                .unwrap_or_default();
            report.violation(
                Check::Diverged,
                i,
                &format!("ipvs: the running planner differs from a plan in one go (first virtual server: {differing})"),
            );
            ok = false;
        }
        report.ipvs_virtual_servers += desired.services().len() as u64;
        for (key, vs) in desired.services() {
            ok &= virtual_server(allowed, key, vs, i, report);
        }
        for ip in desired.bind_addresses() {
            if !allowed.vip_ips.contains(ip) {
                ok &= unvalidated(report, i, "ipvs bind address", ip);
            }
        }
        for (s, had) in sets.iter().zip(&self.ipvs_sets) {
            let family = s.family();
            for set in ipvs::ipset::SetName::ALL {
                for e in s.get(set) {
                    report.ipset_entries += 1;
                    ok &= ipset_entry(allowed, set, &e, i, report);
                }
            }
            let changes = ipvs::ipset::diff(s, had);
            ok &= text(
                "ipset restore",
                &ipvs::ipset::restore_text(family, &changes),
                i,
                report,
            );
            // Everything written from nothing reads back as the sets.
            let whole = ipvs::ipset::restore_text(
                family,
                &ipvs::ipset::diff(s, &ipvs::ipset::Sets::new(family)),
            );
            if ipvs::ipset::Sets::parse_save(family, &whole) != *s {
                report.violation(
                    Check::Diverged,
                    i,
                    &format!("ipset {family:?}: restore text does not read back as the sets"),
                );
                ok = false;
            }
            let mut cfg = ipt.clone();
            cfg.family = family;
            let rules = ipvs::rules::render_with(s, &cfg, node, Some(desired.local()));
            ok &= text("ipvs iptables-restore input", &rules, i, report);
            // The chains and jumps as the mode loads them, replayed into the ipvs tracer's
            // iptables model: what it refuses, iptables-restore or the kernel would.
            let input = kp_ipvs_test::restore_input(s, &cfg, node, desired.local());
            if let Err(e) = kp_iptables_test::IptablesTracer::new(Vec::new()).apply(family, &input)
            {
                report.violation(
                    Check::TracerRefused,
                    i,
                    &format!(
                        "ipvs {family:?}: {e}\n{}",
                        crate::report::short(&input, 300)
                    ),
                );
                ok = false;
            }
        }
        for j in ipvs::rules::jump_rules() {
            ok &= text("ipvs jump rule", &j.args, i, report);
        }
        // The diff from the last sync's virtual servers, applied as the kernel would, must
        // leave what a diff against nothing would.
        let plan = ipvs::diff(&desired, &self.ipvs_kernel, &self.ipvs_config);
        let kernel = apply_ipvs(&self.ipvs_kernel, &plan.changes);
        let again = ipvs::diff(&desired, &kernel, &self.ipvs_config);
        if !again.changes.is_empty() {
            report.violation(
                Check::Diverged,
                i,
                &format!(
                    "ipvs: after the diff's {} changes, {} more: {:?}",
                    plan.changes.len(),
                    again.changes.len(),
                    again.changes.first()
                ),
            );
            ok = false;
        }
        self.ipvs_kernel = kernel;
        self.ipvs_sets = sets;
        ok
    }

    /// The running ipvs planner's sync, as kp-ipvs's dataplane makes it: the changed Services
    /// (every one on a full sync or a node change), then a diff of only the virtual servers the
    /// delta names against what the model kernel holds of them. Checked: the delta's record of
    /// each virtual server is what the kernel holds, and afterwards a diff of everything finds
    /// nothing left to do.
    fn ipvs_incremental(
        &mut self,
        state: &ProxyState,
        node: &NodeContext,
        node_addresses: &[IpAddr],
        changes: Option<&Changes>,
        i: u64,
        report: &mut Report,
    ) -> bool {
        let planner = &mut self.ipvs_planner;
        let mut delta = planner.delta();
        match changes {
            Some(c) if !c.node_changed => {
                for key in &c.services {
                    let ports = state.service_state(key);
                    planner.set_service(
                        key,
                        &ports,
                        node_addresses,
                        node,
                        &self.ipvs_config,
                        &mut delta,
                    );
                }
            }
            _ => planner.set_all(
                state.service_keys().map(|k| (k, state.service_state(k))),
                node_addresses,
                node,
                &self.ipvs_config,
                &mut delta,
            ),
        }
        let mut ok = true;
        let held: BTreeMap<nl::ServiceKey, &nl::Service> = self
            .ipvs_incremental
            .iter()
            .map(|(s, _)| (s.key, s))
            .collect();
        for (key, before) in &delta.virtual_servers {
            if held.get(key).copied() != before.as_ref() {
                report.violation(
                    Check::Diverged,
                    i,
                    &format!("ipvs: the delta's record of {key} is not what the kernel holds"),
                );
                ok = false;
            }
        }
        let keys: BTreeSet<nl::ServiceKey> = delta.virtual_servers.keys().copied().collect();
        let subset: Vec<_> = self
            .ipvs_incremental
            .iter()
            .filter(|(s, _)| keys.contains(&s.key))
            .cloned()
            .collect();
        let plan = ipvs::diff_keys(planner, &subset, &keys, &self.ipvs_config);
        self.ipvs_incremental = apply_ipvs(&self.ipvs_incremental, &plan.changes);
        let left = ipvs::diff(planner, &self.ipvs_incremental, &self.ipvs_config);
        if !left.changes.is_empty() {
            report.violation(
                Check::Diverged,
                i,
                &format!(
                    "ipvs: after a partial sync's {} changes, a full diff finds {} more: {:?}",
                    plan.changes.len(),
                    left.changes.len(),
                    left.changes.first()
                ),
            );
            ok = false;
        }
        ok
    }

    /// The ebpf mode's map updates: per changed Service on the running planner, checked entry
    /// by entry and applied to a model of the maps; on `converge`, those maps against a fresh
    /// full plan's.
    #[allow(clippy::too_many_arguments)]
    fn ebpf(
        &mut self,
        state: &ProxyState,
        node_ports: &NodePortAddresses,
        local: &[IpAddr],
        changes: Option<&Changes>,
        converge: bool,
        allowed: &Allowed,
        i: u64,
        report: &mut Report,
    ) -> bool {
        let node_addresses = ebpf::node_port_addresses(node_ports, state, local);
        let mut ok = true;
        let mut ops = Vec::new();
        let services: Vec<_> = match (changes, self.ebpf.is_some()) {
            // A node change may move the NodePort addresses, so every Service is planned again
            // (the planner writes only what differs), and those the batch deleted too. The
            // mode (kp-ebpf's dataplane) plans only the Services still in the state there, so
            // a Service deleted in the same batch as a node change stays in its maps until the
            // next full sync; planning it the mode's way here shows that as a divergence.
            (Some(c), true) if c.node_changed => state
                .service_keys()
                .chain(&c.services)
                .cloned()
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect(),
            (Some(c), true) => c.services.iter().cloned().collect(),
            _ => {
                self.ebpf = Some(ebpf::Planner::new());
                self.ebpf_maps = ebpf::Contents::default();
                self.ebpf_claims.clear();
                self.ebpf_shared.clear();
                state.service_keys().cloned().collect()
            }
        };
        let Some(planner) = self.ebpf.as_mut() else {
            return true;
        };
        // As the mode: the changed Services, then those a Service handed a shared address to
        // (`take_handoffs`), in the same batch.
        let mut queue: std::collections::VecDeque<ServiceName> = services.into();
        let mut handed_off = false;
        while let Some(svc) = queue.pop_front() {
            let svc = &svc;
            let specs = ebpf::service_specs(state, svc, &node_addresses);
            for owners in self.ebpf_claims.values_mut() {
                owners.remove(svc);
            }
            for spec in &specs {
                let owners = self.ebpf_claims.entry(spec.addr).or_default();
                let mine = owners.entry(svc.clone()).or_default();
                *mine += 1;
                if *mine > 1 {
                    self.ebpf_shared.insert(spec.addr);
                }
            }
            match planner.set_service(svc, &specs) {
                Ok(o) => ops.extend(o),
                Err(_) => {
                    // Out of ids: the mode starts over with a full sync; so does this.
                    report.ebpf_errors += 1;
                    self.ebpf = None;
                    return ok;
                }
            }
            if queue.is_empty() && !handed_off {
                // Planned once, after every changed Service: they write nothing new, so no
                // more hand-offs follow (the mode does the same).
                handed_off = true;
                queue.extend(planner.take_handoffs());
            }
        }
        ops.extend(planner.set_service_cidrs(&ebpf::service_cidrs(state)));
        report.ebpf_plans += 1;
        report.ebpf_ops += ops.len() as u64;
        for op in &ops {
            ok &= ebpf_op(allowed, &self.ebpf_maps, op, i, report);
            self.ebpf_maps.apply(op);
        }
        let want = planner.contents();
        if self.ebpf_maps != want {
            let missing = ebpf::diff(&self.ebpf_maps, &want);
            let (a, b) = (canonical(&self.ebpf_maps), canonical(&want));
            let differing: BTreeSet<ebpf::FrontendAddr> =
                a.0.iter()
                    .filter(|(k, v)| b.0.get(*k) != Some(*v))
                    .chain(b.0.iter().filter(|(k, v)| a.0.get(*k) != Some(*v)))
                    .map(|(k, _)| *k)
                    .collect();
            report.violation(
                Check::Diverged,
                i,
                &format!(
                    "ebpf: the updates left maps other than the planner's record: {:?}{}",
                    missing.iter().take(3).collect::<Vec<_>>(),
                    contested_note(&self.ebpf_shared, &differing)
                ),
            );
            ok = false;
        }
        // Every slot points at a backend; every frontend has its reverse-NAT entry.
        for (k, v) in &want.services {
            if k.slot != 0 && !want.backends.contains_key(&v.backend_id) {
                report.violation(
                    Check::Diverged,
                    i,
                    &format!("ebpf: slot {k:?} -> missing backend {}", v.backend_id),
                );
                ok = false;
            }
            if !want.rev_nat.contains_key(&v.rev_nat) {
                report.violation(
                    Check::Diverged,
                    i,
                    &format!("ebpf: {k:?} -> missing reverse NAT {}", v.rev_nat),
                );
                ok = false;
            }
        }
        if converge {
            match ebpf::plan_state(state, node_ports, local) {
                Ok(fresh) => {
                    let (a, b) = (canonical(&want), canonical(&fresh.contents()));
                    if a != b {
                        let differing: BTreeSet<ebpf::FrontendAddr> =
                            a.0.iter()
                                .filter(|(k, v)| b.0.get(*k) != Some(*v))
                                .chain(b.0.iter().filter(|(k, v)| a.0.get(*k) != Some(*v)))
                                .map(|(k, _)| *k)
                                .collect();
                        let addrs = a.1 != b.1;
                        report.violation(
                            Check::Diverged,
                            i,
                            &format!(
                                "ebpf: partial updates differ from a full plan in {:?}{}{}",
                                differing.iter().take(3).collect::<Vec<_>>(),
                                if addrs { " and the address map" } else { "" },
                                if addrs {
                                    String::new()
                                } else {
                                    contested_note(&self.ebpf_shared, &differing)
                                }
                            ),
                        );
                        ok = false;
                    }
                }
                Err(_) => report.ebpf_errors += 1,
            }
        }
        ok
    }
}

/// One frontend as the ebpf maps serve it, without the ids a planner's history hands out:
/// the head's count, affinity and flags; its backends (sorted: slot order is history); its
/// reverse-NAT target; its source ranges.
type EbpfFrontend = (
    u16,
    u32,
    u8,
    Vec<ebpf::Backend>,
    Option<ebpf::RevNat>,
    Vec<ebpf::AddrKey>,
);

/// What the ebpf maps serve, ids resolved: each frontend, and the address entries.
type Canonical = (
    BTreeMap<ebpf::FrontendAddr, EbpfFrontend>,
    BTreeMap<ebpf::AddrKey, ebpf::AddrVerdict>,
);

/// The maps by frontend, ids resolved.
fn canonical(c: &ebpf::Contents) -> Canonical {
    let mut out = BTreeMap::new();
    for (k, head) in c.services.iter().filter(|(k, _)| k.slot == 0) {
        let mut backends: Vec<ebpf::Backend> = (1..=head.count)
            .filter_map(|slot| {
                let v = c.services.get(&ebpf::ServiceKey {
                    frontend: k.frontend,
                    slot,
                })?;
                c.backends.get(&v.backend_id).copied()
            })
            .collect();
        backends.sort();
        let ranges: Vec<ebpf::AddrKey> = c
            .ranges
            .iter()
            .filter(|r| r.rev_nat == head.rev_nat)
            .map(|r| r.prefix)
            .collect();
        out.insert(
            k.frontend,
            (
                head.count,
                head.affinity,
                head.flags,
                backends,
                c.rev_nat.get(&head.rev_nat).copied(),
                ranges,
            ),
        );
    }
    (out, c.addrs.clone())
}

/// What an ebpf divergence note says when every frontend that differs was listed twice by one
/// Service (two port names, one port and protocol; see the known defect of the same name).
pub const EBPF_CONTESTED: &str = "every differing ebpf frontend was listed twice by one Service";

/// The note for a divergence in `frontends`: [`EBPF_CONTESTED`] when one Service listed each
/// of them twice at some time in this epoch.
fn contested_note(
    shared: &HashSet<ebpf::FrontendAddr>,
    frontends: &BTreeSet<ebpf::FrontendAddr>,
) -> String {
    if !frontends.is_empty() && frontends.iter().all(|f| shared.contains(f)) {
        format!(" ({EBPF_CONTESTED})")
    } else {
        String::new()
    }
}

/// A redirect table element: every address, port and network in it validated.
fn redirect_element(
    allowed: &Allowed,
    set: &str,
    key: &us::redirect::Tuple,
    value: Option<&us::redirect::Tuple>,
    i: u64,
    report: &mut Report,
) -> bool {
    use us::redirect::Atom;
    let atoms = key.atoms();
    let ip = atoms.iter().find_map(|a| match a {
        Atom::Ip(ip) => Some(*ip),
        _ => None,
    });
    let proto = atoms.iter().find_map(|a| match a {
        Atom::Proto(p) => Some(*p),
        _ => None,
    });
    let port = atoms.iter().find_map(|a| match a {
        Atom::Port(p) => Some(*p),
        _ => None,
    });
    let mut ok = match (ip, proto, port) {
        (Some(ip), Some(proto), Some(port)) => allowed.vips.contains(&(ip, proto, port)),
        (None, Some(proto), Some(port)) => allowed.node_ports.contains(&(proto, port)),
        (Some(ip), None, None) => allowed.vip_ips.contains(&ip),
        (None, None, None) => true,
        _ => false,
    };
    for a in atoms {
        if let Atom::Net(n) = a {
            ok &= allowed.net(n);
        }
    }
    // Values are verdicts only.
    if let Some(v) = value {
        ok &= v.atoms().iter().all(|a| matches!(a, Atom::Verdict(_)));
    }
    ok || unvalidated(
        report,
        i,
        &format!("userspace {set}"),
        (key.to_string(), value.map(ToString::to_string)),
    )
}

/// The balancer's routes: every validated frontend asked for a connection gets only endpoints
/// of the state; addresses and ports no Service has get no route.
fn routes(b: &mut us::Balancer, allowed: &Allowed, i: u64, report: &mut Report) -> bool {
    let now = Instant::now();
    let mut ok = true;
    let client = |ip: &IpAddr| -> SocketAddr {
        match ip {
            IpAddr::V4(_) => "203.0.113.9:40000".parse().expect("literal"),
            IpAddr::V6(_) => "[2001:db8:ffff::9]:40000".parse().expect("literal"),
        }
    };
    let mut targets: Vec<(Protocol, SocketAddr)> = allowed
        .vips
        .iter()
        .map(|(ip, p, port)| (*p, SocketAddr::new(*ip, *port)))
        .collect();
    for (p, port) in &allowed.node_ports {
        for ip in &allowed.node_ips {
            targets.push((*p, SocketAddr::new(*ip, *port)));
        }
    }
    targets.sort();
    for (proto, dst) in &targets {
        report.userspace_picks += 1;
        if let us::Pick::Connect { attempts, .. } =
            b.pick(*proto, *dst, client(&dst.ip()), false, now)
        {
            for a in attempts {
                if !allowed
                    .endpoints
                    .contains(&(a.endpoint.ip(), a.endpoint.port()))
                {
                    ok &= unvalidated(report, i, &format!("userspace route for {dst}"), a.endpoint);
                }
            }
        }
    }
    // A port no Service or NodePort uses, on every address: nothing.
    let ports = allowed.ports();
    if let Some(free) = (1..=u16::MAX).find(|p| !ports.contains(p)) {
        let probes: Vec<IpAddr> = allowed
            .vip_ips
            .iter()
            .chain(&allowed.node_ips)
            .copied()
            .chain([
                "198.51.100.77".parse().expect("literal"),
                "2001:db8:77::1".parse().expect("literal"),
            ])
            .collect();
        for ip in probes {
            for proto in [Protocol::Tcp, Protocol::Udp, Protocol::Sctp] {
                let dst = SocketAddr::new(ip, free);
                if b.pick(proto, dst, client(&ip), false, now) != us::Pick::NotAService {
                    ok &= unvalidated(report, i, "userspace route for no Service", (proto, dst));
                }
            }
        }
    }
    ok
}

fn core_protocol(p: nl::Protocol) -> Protocol {
    match p {
        nl::Protocol::Tcp => Protocol::Tcp,
        nl::Protocol::Udp => Protocol::Udp,
        nl::Protocol::Sctp => Protocol::Sctp,
    }
}

/// An IPVS virtual server: a validated frontend (or a short-circuit mark) with endpoints.
fn virtual_server(
    allowed: &Allowed,
    key: &nl::ServiceKey,
    vs: &ipvs::VirtualServer,
    i: u64,
    report: &mut Report,
) -> bool {
    let mut ok = match key {
        nl::ServiceKey::Addr {
            addr,
            protocol,
            port,
        } => allowed.frontend(*addr, core_protocol(*protocol), *port),
        nl::ServiceKey::Fwmark { mark, .. } => ipvs::local::is_short_circuit_mark(*mark),
    };
    ok &= vs.service.key == *key && !smuggled(&vs.service.scheduler);
    for ((ip, port), d) in &vs.destinations {
        ok &= allowed.endpoints.contains(&(ip, port)) && d.addr == ip && d.port == port;
    }
    ok || unvalidated(report, i, "ipvs virtual server", (key, &vs.destinations))
}

/// An ipset entry: validated addresses, ports and networks for its set.
fn ipset_entry(
    allowed: &Allowed,
    set: ipvs::ipset::SetName,
    e: &ipvs::ipset::Entry,
    i: u64,
    report: &mut Report,
) -> bool {
    use ipvs::ipset::Entry;
    let ok = match *e {
        Entry::Port(p) => {
            allowed.health_ports.contains(&p) || allowed.node_ports.iter().any(|(_, np)| *np == p)
        }
        Entry::Ip(ip) => allowed.vip_ips.contains(&ip),
        Entry::IpPort(ip, p, port) => allowed.frontend(ip, p, port),
        // KUBE-LOOP-BACK (an endpoint and itself) or a LoadBalancer IP allowed from itself.
        Entry::IpPortIp(a, p, port, b) => {
            a == b
                && (allowed.endpoints.contains(&(a, port)) || allowed.vips.contains(&(a, p, port)))
        }
        Entry::IpPortNet(ip, p, port, net) => {
            allowed.vips.contains(&(ip, p, port)) && allowed.net(&net)
        }
    };
    ok || unvalidated(report, i, &format!("ipset {set:?}"), e)
}

/// An ebpf map update: validated keys and values (a deletion: of an entry the maps hold, whose
/// writing was checked), and bytes that decode to themselves.
fn ebpf_op(
    allowed: &Allowed,
    maps: &ebpf::Contents,
    op: &ebpf::Op,
    i: u64,
    report: &mut Report,
) -> bool {
    use ebpf::Op;
    let frontend = |f: &ebpf::FrontendAddr| allowed.frontend(f.ip, f.protocol, f.port);
    let prefix = |k: &ebpf::AddrKey| IpNet::new(k.ip, k.len).is_ok_and(|n| allowed.net(&n));
    let (valid, round_trip, bytes): (bool, bool, Vec<u8>) = match op {
        Op::UpsertBackend(_, b) => {
            let bytes = b.to_bytes();
            (
                allowed.endpoints.contains(&(b.ip, b.port)),
                ebpf::Backend::from_bytes(&bytes) == Some(*b),
                bytes.to_vec(),
            )
        }
        Op::UpsertRevNat(_, r) => {
            let bytes = r.to_bytes();
            (
                allowed
                    .vips
                    .iter()
                    .any(|(ip, _, p)| (*ip, *p) == (r.ip, r.port))
                    || (allowed.node_ips.contains(&r.ip)
                        && allowed.node_ports.iter().any(|(_, p)| *p == r.port)),
                ebpf::RevNat::from_bytes(&bytes) == Some(*r),
                bytes.to_vec(),
            )
        }
        Op::UpsertService(k, v) => {
            let (kb, vb) = (k.to_bytes(), v.to_bytes());
            (
                frontend(&k.frontend),
                ebpf::ServiceKey::from_bytes(&kb) == Some(*k)
                    && ebpf::ServiceValue::from_bytes(&vb) == Some(*v),
                [kb.as_slice(), vb.as_slice()].concat(),
            )
        }
        Op::DeleteService(k) => {
            let kb = k.to_bytes();
            (
                maps.services.contains_key(k),
                ebpf::ServiceKey::from_bytes(&kb) == Some(*k),
                kb.to_vec(),
            )
        }
        Op::UpsertRange(k) => (
            prefix(&k.prefix),
            ebpf::RangeKey::from_trie(k.trie_len(), k.data()) == Some(*k),
            k.data().to_vec(),
        ),
        Op::DeleteRange(k) => (
            maps.ranges.contains(k),
            ebpf::RangeKey::from_trie(k.trie_len(), k.data()) == Some(*k),
            k.data().to_vec(),
        ),
        Op::UpsertAddr(k, _) => (
            prefix(k),
            ebpf::AddrKey::from_trie(k.trie_len(), k.data()) == Some(*k),
            k.data().to_vec(),
        ),
        Op::DeleteAddr(k) => (
            maps.addrs.contains_key(k),
            ebpf::AddrKey::from_trie(k.trie_len(), k.data()) == Some(*k),
            k.data().to_vec(),
        ),
        Op::DeleteRevNat(id) => (maps.rev_nat.contains_key(id), true, Vec::new()),
        Op::DeleteBackend(id) => (maps.backends.contains_key(id), true, Vec::new()),
        // Maglev tables (sh/mh only; the fuzzer plans random picks): a table of a frontend
        // the maps hold, whose bytes read back as itself.
        Op::UpsertMaglev(id, t) => {
            let bytes = t.to_bytes();
            (
                maps.rev_nat.contains_key(id),
                ebpf::MaglevTable::from_bytes(&bytes).as_ref() == Some(t),
                bytes.to_vec(),
            )
        }
        Op::DeleteMaglev(id) => (maps.maglev.contains_key(id), true, Vec::new()),
    };
    report.bytes += bytes.len() as u64;
    let mut ok = true;
    if !valid {
        ok &= unvalidated(report, i, "ebpf map update", op);
    }
    if !round_trip {
        report.violation(
            Check::Diverged,
            i,
            &format!("ebpf: {op:?} does not read back from its bytes"),
        );
        ok = false;
    }
    if smuggled_bytes(&bytes) {
        report.violation(Check::Smuggled, i, &format!("ebpf: {op:?}"));
        ok = false;
    }
    ok
}

/// Virtual servers with their real servers by address and port.
type IpvsKernel =
    BTreeMap<nl::ServiceKey, (nl::Service, BTreeMap<(IpAddr, u16), nl::DestinationState>)>;

/// The kernel's virtual servers after `changes` (connections none: deletions are immediate).
fn apply_ipvs(
    kernel: &[(nl::Service, Vec<nl::DestinationState>)],
    changes: &[ipvs::Change],
) -> Vec<(nl::Service, Vec<nl::DestinationState>)> {
    use ipvs::Change;
    let mut k: IpvsKernel = kernel
        .iter()
        .map(|(s, d)| {
            let dests = d
                .iter()
                .map(|d| ((d.destination.addr, d.destination.port), *d))
                .collect();
            (s.key, (s.clone(), dests))
        })
        .collect();
    let state = |destination: nl::Destination| nl::DestinationState {
        destination,
        active_connections: 0,
        inactive_connections: 0,
        persistent_connections: 0,
    };
    for c in changes {
        match c {
            Change::AddService(s) | Change::UpdateService(s) => {
                let dests = k.remove(&s.key).map(|(_, d)| d).unwrap_or_default();
                k.insert(s.key, (s.clone(), dests));
            }
            Change::DeleteService(key) => {
                k.remove(key);
            }
            Change::AddDestination(key, d) | Change::UpdateDestination(key, d) => {
                if let Some((_, dests)) = k.get_mut(key) {
                    dests.insert((d.addr, d.port), state(*d));
                }
            }
            Change::DeleteDestination(key, ip, port) => {
                if let Some((_, dests)) = k.get_mut(key) {
                    dests.remove(&(*ip, *port));
                }
            }
        }
    }
    k.into_values()
        .map(|(s, d)| (s, d.into_values().collect()))
        .collect()
}
