//! The ipvs mode's [`Dataplane`]: `kube-ipvs0` and its addresses, the ipsets, the iptables
//! chains that match them, and the IPVS virtual servers, all planned by `kp-ipvs-plan` from
//! the shared frontend list, with graceful termination on the mode's timer.
//!
//! A partial sync costs what changed, in this process and in the kernel: the planner
//! (`kp_ipvs_plan::planner`) re-plans the changed Services only and names the virtual servers,
//! set entries and addresses that moved; only the real servers of those virtual servers are
//! read from IPVS (their connection counts decide between deleting a removed one and draining
//! it), and only the set entries that moved are restored. The iptables text, whose rules change
//! only when a set turns empty or non-empty or a `Local` rule changes, is rendered only then
//! and restored only when it differs from the last one. A full sync (the first, the periodic
//! one, and any after a failure or a change of the Node) compares everything with the kernel:
//! an IPVS dump, `ipset save`, the addresses of `kube-ipvs0`, the node's addresses for the
//! NodePorts (read only then: the dump lists every address of `kube-ipvs0` too). Upstream's ipvs
//! proxier re-lists IPVS and the sets on every sync.
//!
//! A sync writes in the order that never steers a packet to something not there yet, nor takes
//! away something a packet is still steered to:
//!
//! 1. IPVS: new virtual servers, their real servers, and the real-server changes of kept ones
//!    (adds, weights, graceful drains, deletions). Nothing sends a packet to a new one yet.
//! 2. The ipsets, which the rules match.
//! 3. New addresses bound to `kube-ipvs0`: only now does a ClusterIP become local, so that IPVS
//!    (which sees packets to local addresses) takes it; its virtual server is ready.
//! 4. The iptables chains. `KUBE-SERVICES` is shared with the iptables mode: on a switch from
//!    it, that mode's DNAT serves every connection until this restore replaces it, and at that
//!    moment the virtual servers, set entries and addresses are all in place. (Written before
//!    the virtual servers, as this mode once did, the restore refused most new connections of
//!    a switch until IPVS caught up.)
//! 5. Addresses unbound: a removed Service's packets are routed from here, and dropped as an
//!    unallocated ClusterIP.
//! 6. Whole virtual servers deleted last, when nothing reaches them.
//!
//! Upstream's ipvs proxier is close: it creates each virtual server, binds its address and adds
//! its real servers Service by Service, restores the sets and chains after, and unbinds and
//! deletes the unused last.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::net::IpAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kp_core::dataplane::{Dataplane, DataplaneError, SyncReport};
use kp_core::model::IpFamily;
use kp_core::node::{DetectLocal, NodeContext, NodePortAddresses};
use kp_core::track::{Changes, ProxyState};
use kp_iptables::{Backend, IptablesRunner};
use kp_iptables_plan::PlanConfig;
use kp_ipvs_plan::addresses::{self, DUMMY_INTERFACE};
use kp_ipvs_plan::ipset;
use kp_ipvs_plan::planner::Planner;
use kp_ipvs_plan::{diff, diff_keys, rules, Change, Config, Draining, Dump, Plan, Planned as _};
use kp_netlink::ipvs::{Service, ServiceKey};

use crate::link::Dummy;
use crate::{Client, Error};

/// A failed ipset run, as the dataplane reports it (retried at the next sync).
fn tool_error(op: &'static str) -> impl Fn(String) -> DataplaneError {
    move |detail| {
        DataplaneError::transient(Error::Tool {
            op: op.into(),
            detail,
        })
    }
}

/// How many virtual servers a full sync diffs and programs at a time.
const FULL_SYNC_PART: usize = 256;

/// How often draining real servers are checked again.
pub const DRAIN_CHECK: Duration = Duration::from_secs(1);

/// The mode's settings.
#[derive(Debug, Clone)]
pub struct IpvsSettings {
    /// The families programmed (one proxier each upstream).
    pub families: Vec<IpFamily>,
    /// Scheduler, its flags, excluded CIDRs.
    pub ipvs: Config,
    /// Mark bit and `masqueradeAll` (the iptables mode's configuration).
    pub masquerade_bit: u32,
    /// `masqueradeAll`.
    pub masquerade_all: bool,
    /// Detect-local CIDRs and the node's addresses.
    pub node: NodeContext,
    /// The addresses NodePorts answer on (a virtual server each).
    pub node_port_addresses: Vec<IpAddr>,
    /// `--ipvs-strict-arp`: `arp_ignore=1`, `arp_announce=2`.
    pub strict_arp: bool,
    /// `--ipvs-tcp-timeout`, `--ipvs-tcpfin-timeout`, `--ipvs-udp-timeout` in seconds, set at
    /// creation; zero leaves the kernel's.
    pub timeouts: crate::Timeouts,
    /// The network namespace programmed (`None`: the proxy's own).
    pub netns: Option<String>,
    /// Where `node` and `node_port_addresses` come from: `None` takes them as given (tests);
    /// `Some` resolves them at every sync against the Node and ServiceCIDRs last seen and the
    /// node's interfaces, as the proxy runs.
    pub resolve: Option<NodeResolve>,
}

/// detect-local and `nodePortAddresses`, as configured, for the mode to resolve at each sync.
#[derive(Debug, Clone)]
pub struct NodeResolve {
    /// How pod traffic is recognised.
    pub detect_local: DetectLocal,
    /// Where NodePorts answer: every address of the node's interfaces (but `kube-ipvs0`,
    /// loopback and IPv6 link-local ones), those inside CIDRs, or the Node's primary ones.
    pub node_ports: NodePortAddresses,
}

/// The addresses NodePorts answer on, given the node's interface addresses `local` (upstream's
/// ipvs mode: a virtual server per local address `nodePortAddresses` admits; the Node's
/// primary addresses with `primary`, none until it reports one).
pub fn node_port_addresses(
    node_ports: &NodePortAddresses,
    node: &NodeContext,
    local: &BTreeSet<IpAddr>,
) -> Vec<IpAddr> {
    match node_ports {
        NodePortAddresses::AllLocal => local.iter().copied().collect(),
        NodePortAddresses::Primary => node.node_ips.clone(),
        NodePortAddresses::Cidrs(_) => local
            .iter()
            .copied()
            .filter(|ip| match node.node_port_networks(IpFamily::of(ip)) {
                None => true,
                Some(nets) => nets.iter().any(|n| n.contains(ip)),
            })
            .collect(),
    }
}

/// `net/ipv4/vs/conn_reuse_mode` for kernel release `release` (`uname -r`), as upstream sets
/// it: 0 from Linux 4.1 to before 5.9, where reusing a connection slot of a removed real server
/// stalled new connections for a second; nothing otherwise (5.9 fixed it; before 4.1 there is
/// no such sysctl).
pub fn conn_reuse_mode(release: &str) -> Option<&'static str> {
    let mut parts = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u32>().ok());
    let major = parts.next()??;
    let minor = parts.next()??;
    ((4, 1) <= (major, minor) && (major, minor) < (5, 9)).then_some("0")
}

/// The ipvs dataplane.
pub struct IpvsDataplane {
    settings: IpvsSettings,
    ipvs: Client,
    dummy: Dummy,
    iptables: Box<dyn IptablesRunner>,
    backend: Backend,
    planner: Planner,
    rules: Vec<String>,
    /// The node context and the NodePort addresses, resolved at the last full sync.
    resolved: Option<(NodeContext, Vec<IpAddr>)>,
    draining: Vec<Draining>,
    next_check: Option<Instant>,
    /// The netlink socket a partial sync's set elements go through (opened at first use,
    /// dropped after an error).
    ipset: Option<crate::ipset::Ipset>,
}

fn dp(e: Error) -> DataplaneError {
    e.into_dataplane()
}

fn ipt(op: &str) -> impl FnOnce(kp_iptables::Error) -> DataplaneError + '_ {
    move |e| {
        DataplaneError::transient(Error::Tool {
            op: op.to_string(),
            detail: e.to_string(),
        })
    }
}

impl IpvsDataplane {
    /// Opens IPVS (the error is [`Error::Unavailable`] where the kernel has none: the caller
    /// falls back to iptables), creates `kube-ipvs0` and sets the sysctls upstream sets.
    pub fn new(
        settings: IpvsSettings,
        iptables: Box<dyn IptablesRunner>,
        backend: Backend,
    ) -> Result<IpvsDataplane, DataplaneError> {
        let ns = settings.netns.as_deref();
        let mut ipvs = Client::open(ns).map_err(dp)?;
        if settings.timeouts != crate::Timeouts::default() {
            ipvs.set_timeouts(settings.timeouts).map_err(dp)?;
        }
        let dummy = Dummy::ensure(ns, DUMMY_INTERFACE).map_err(dp)?;
        let mut sysctls = vec![
            // IPVS keeps conntrack entries for its connections, so iptables' NAT sees them.
            ("net/ipv4/vs/conntrack", "1"),
            // Connections to a deleted real server are dropped, not left hanging.
            ("net/ipv4/vs/expire_nodest_conn", "1"),
            ("net/ipv4/vs/expire_quiescent_template", "1"),
            ("net/ipv4/ip_forward", "1"),
        ];
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        if let Some(v) = conn_reuse_mode(&release) {
            sysctls.push(("net/ipv4/vs/conn_reuse_mode", v));
        }
        if settings.strict_arp {
            sysctls.push(("net/ipv4/conf/all/arp_ignore", "1"));
            sysctls.push(("net/ipv4/conf/all/arp_announce", "2"));
        }
        for (k, v) in sysctls {
            iptables.sysctl(k, v).map_err(ipt(k))?;
        }
        let planner = Planner::new(&settings.families);
        let rules = vec![String::new(); settings.families.len()];
        Ok(IpvsDataplane {
            settings,
            ipvs,
            dummy,
            iptables,
            backend,
            planner,
            rules,
            resolved: None,
            draining: Vec::new(),
            next_check: None,
            ipset: None,
        })
    }

    /// The real servers being drained after the last sync or tick.
    pub fn draining(&self) -> &[Draining] {
        &self.draining
    }

    /// How many virtual servers and real servers this dataplane has read from IPVS.
    pub fn ipvs_entries_read(&self) -> u64 {
        self.ipvs.entries_read()
    }

    /// What the last sync planned.
    pub fn planned(&self) -> &Planner {
        &self.planner
    }

    /// `ipset VERB` in the mode's namespace.
    fn ipset(&self, verb: &str) -> Command {
        match &self.settings.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "ipset", verb]);
                c
            }
            None => {
                let mut c = Command::new("ipset");
                c.arg(verb);
                c
            }
        }
    }

    /// Runs `ipset restore` on what `write` writes (a full sync streams its changes: at 10,000
    /// Services the text alone is 8 MiB).
    fn ipset_restore(
        &self,
        write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
    ) -> Result<(), DataplaneError> {
        let mut cmd = self.ipset("restore");
        let tool = tool_error("ipset restore");
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| tool(e.to_string()))?;
        // A write that fails (ipset stopped reading at a refused line: a broken pipe) is
        // reported with what ipset said, not as the pipe's error.
        let written = match child.stdin.take() {
            Some(stdin) => {
                let mut w = std::io::BufWriter::with_capacity(1 << 16, stdin);
                write(&mut w).and_then(|()| w.flush())
            }
            None => Ok(()),
        };
        let out = child.wait_with_output().map_err(|e| tool(e.to_string()))?;
        if !out.status.success() {
            return Err(tool(
                String::from_utf8_lossy(&out.stderr).trim().to_string(),
            ));
        }
        written.map_err(|e| tool(e.to_string()))?;
        Ok(())
    }

    /// A partial sync's element changes over netlink: no `ipset restore` process (its spawn
    /// was most of a one-endpoint change). The sets exist: a full sync created them.
    fn ipset_elements(
        &mut self,
        family: IpFamily,
        changes: &[ipset::SetChange],
    ) -> Result<(), DataplaneError> {
        let mut client = match self.ipset.take() {
            Some(c) => c,
            None => crate::ipset::Ipset::open(self.settings.netns.as_deref()).map_err(dp)?,
        };
        client.apply(family, changes).map_err(dp)?;
        self.ipset = Some(client);
        Ok(())
    }

    /// `ipset save` read as it comes ([`ipset::Saved`]): a full sync's view of the sets.
    fn ipset_saved(&self) -> Result<ipset::Saved, DataplaneError> {
        let mut cmd = self.ipset("save");
        let tool = tool_error("ipset save");
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| tool(e.to_string()))?;
        let read = match child.stdout.take() {
            Some(out) => ipset::Saved::read(
                &self.settings.families,
                std::io::BufReader::with_capacity(1 << 16, out),
            ),
            None => Ok(ipset::Saved::default()),
        };
        let out = child.wait_with_output().map_err(|e| tool(e.to_string()))?;
        // A failed save is not "no sets": the full sync would re-add every element and never
        // delete a stale one.
        if !out.status.success() {
            return Err(tool(format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        read.map_err(|e| tool(e.to_string()))
    }

    fn ensure_jumps(&self, family: IpFamily) -> Result<(), DataplaneError> {
        for j in rules::jump_rules() {
            let args: Vec<String> = kp_iptables::split_args(&j.args);
            let mut check: Vec<&str> = vec!["-t", j.table, "-C", j.chain];
            check.extend(args.iter().map(String::as_str));
            let out = self
                .iptables
                .run(self.backend, family, &check)
                .map_err(ipt("iptables -C"))?;
            if out.success() {
                continue;
            }
            let mut insert: Vec<&str> = vec!["-t", j.table, "-I", j.chain];
            insert.extend(args.iter().map(String::as_str));
            let out = self
                .iptables
                .run(self.backend, family, &insert)
                .map_err(ipt("iptables -I"))?;
            if !out.success() {
                return Err(DataplaneError::transient(Error::Tool {
                    op: format!("iptables -t {} -I {} {}", j.table, j.chain, j.args),
                    detail: format!("{out:?}"),
                }));
            }
        }
        Ok(())
    }

    /// Applies an IPVS diff of the planned state against a fresh dump but for the deletions of
    /// whole virtual servers, which it returns (the sync applies them last), and schedules the
    /// next drain check.
    fn reconcile_ipvs(&mut self, now: Instant) -> Result<(usize, Vec<Change>), DataplaneError> {
        let held: BTreeMap<ServiceKey, Service> = self
            .ipvs
            .services()
            .map_err(dp)?
            .into_iter()
            .map(|s| (s.key, s))
            .collect();
        let keys: Vec<ServiceKey> = self
            .planner
            .virtual_servers()
            .map(|(k, _)| *k)
            .chain(held.keys().copied())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let mut draining = Vec::new();
        let mut operations = 0;
        let mut deletions = Vec::new();
        // A few hundred virtual servers at a time, their real servers read from the kernel
        // then: the whole dump and the changes of every virtual server (146,300 at 10,000
        // Services) would be held at once for nothing.
        for part in keys.chunks(FULL_SYNC_PART) {
            let mut kernel = Vec::new();
            for key in part {
                if let Some(service) = held.get(key) {
                    let dests = self.ipvs.destinations(key).map_err(dp)?;
                    kernel.push((service.clone(), dests));
                }
            }
            let mut plan = Plan::default();
            Dump::index(&kernel).diff_into(
                &self.planner,
                part.iter(),
                &self.settings.ipvs,
                &mut plan,
            );
            deletions.extend(plan.split_off_deletions());
            self.ipvs.apply(&plan.changes).map_err(dp)?;
            operations += plan.changes.len();
            draining.extend(plan.draining);
        }
        self.draining = draining;
        self.schedule_drain_check(now);
        Ok((operations, deletions))
    }

    /// Applies an IPVS diff of the planned state for the virtual servers `keys` only, each
    /// given with what the kernel holds of it as last programmed (`None`: nothing): their real
    /// servers are read from the kernel, nothing else is. The deletions of whole virtual
    /// servers are returned, not applied (as [`IpvsDataplane::reconcile_ipvs`]).
    fn reconcile_keys(
        &mut self,
        keys: &BTreeMap<ServiceKey, Option<Service>>,
        now: Instant,
    ) -> Result<(usize, Vec<Change>), DataplaneError> {
        if keys.is_empty() {
            return Ok((0, Vec::new()));
        }
        let mut kernel = Vec::new();
        for (key, service) in keys {
            if let Some(service) = service {
                let dests = self.ipvs.destinations(key).map_err(dp)?;
                kernel.push((service.clone(), dests));
            }
        }
        let only: BTreeSet<ServiceKey> = keys.keys().copied().collect();
        let mut plan = diff_keys(&self.planner, &kernel, &only, &self.settings.ipvs);
        let deletions = plan.split_off_deletions();
        self.ipvs.apply(&plan.changes).map_err(dp)?;
        self.draining.retain(|d| !only.contains(&d.service));
        self.draining.extend(plan.draining);
        self.schedule_drain_check(now);
        Ok((plan.changes.len(), deletions))
    }

    fn schedule_drain_check(&mut self, now: Instant) {
        self.next_check = if self.draining.is_empty() {
            None
        } else {
            Some(now + DRAIN_CHECK)
        };
    }

    /// The node context and the NodePort addresses: resolved anew on a full sync, else those of
    /// the last one.
    fn resolve(
        &mut self,
        state: &ProxyState,
        full: bool,
    ) -> Result<(NodeContext, Vec<IpAddr>), DataplaneError> {
        if let (false, Some(resolved)) = (full, &self.resolved) {
            return Ok(resolved.clone());
        }
        let resolved = match &self.settings.resolve {
            None => (
                self.settings.node.clone(),
                self.settings.node_port_addresses.clone(),
            ),
            Some(r) => {
                let node = NodeContext::resolve(&r.detect_local, &r.node_ports, state);
                let local = self.dummy.node_addresses().map_err(dp)?;
                let np = node_port_addresses(&r.node_ports, &node, &local);
                (node, np)
            }
        };
        self.resolved = Some(resolved.clone());
        Ok(resolved)
    }
}

impl Dataplane for IpvsDataplane {
    fn mode(&self) -> &'static str {
        "ipvs"
    }

    fn sync(
        &mut self,
        state: &ProxyState,
        changes: &Changes,
        full: bool,
    ) -> Result<SyncReport, DataplaneError> {
        // A Node change re-plans every Service (its addresses and CIDRs are in every plan).
        let full = full || changes.node_changed || self.resolved.is_none();
        let (node, node_port_addresses) = self.resolve(state, full)?;
        let config = self.settings.ipvs.clone();
        // A full sync compares the whole with the kernel: its delta records nothing.
        let mut delta = if full {
            self.planner.untracked()
        } else {
            self.planner.delta()
        };
        if full {
            self.planner.set_all(
                state.service_keys().map(|k| (k, state.service_state(k))),
                &node_port_addresses,
                &node,
                &config,
                &mut delta,
            );
        } else {
            for key in &changes.services {
                self.planner.set_service(
                    key,
                    &state.service_state(key),
                    &node_port_addresses,
                    &node,
                    &config,
                    &mut delta,
                );
            }
        }
        // The write order is the module's description's.
        // 1. IPVS, but for the deletions of whole virtual servers.
        let now = Instant::now();
        let (mut operations, deletions) = if full {
            self.reconcile_ipvs(now)?
        } else {
            self.reconcile_keys(&delta.virtual_servers, now)?
        };
        let (bind, unbind): (Vec<IpAddr>, Vec<IpAddr>) = if full {
            let current = self.dummy.addresses().map_err(dp)?;
            let a = addresses::diff(self.planner.bind_addresses(), &current);
            (a.bind, a.unbind)
        } else {
            (
                delta.bind.iter().copied().collect(),
                delta.unbind.iter().copied().collect(),
            )
        };
        // 2. The sets, before the rules that match them.
        let saved = if full {
            Some(self.ipset_saved()?)
        } else {
            None
        };
        let mut set_changes = vec![0; self.settings.families.len()];
        for (i, changed) in set_changes.iter_mut().enumerate() {
            let family = self.settings.families[i];
            if let Some(saved) = &saved {
                // Sets made with other options (upstream's maxelem, an older version's)
                // refuse `create -exist`: replaced under their name, then filled again.
                let misfits = ipset::misfits(family, saved.creates());
                for set in &misfits {
                    tracing::warn!(
                        set = set.name(family),
                        "replacing an ipset created with other options than this mode's"
                    );
                }
                let want = &self.planner.sets()[i];
                self.ipset_restore(|w| {
                    w.write_all(ipset::replace_text(family, &misfits).as_bytes())?;
                    let changes = saved.changes(i, want, &misfits);
                    *changed = ipset::write_restore(w, family, changes)?;
                    Ok(())
                })?;
            } else {
                let changes = delta.set_changes(i);
                if !changes.is_empty() {
                    self.ipset_elements(family, &changes)?;
                }
                *changed = changes.len();
            }
            operations += *changed;
        }
        // 3. New addresses: IPVS answers on them once they are local.
        self.dummy.bind_all(&bind).map_err(dp)?;
        // 4. The chains.
        for (i, changed) in set_changes.into_iter().enumerate() {
            if !full && changed == 0 && !delta.local {
                continue;
            }
            let family = self.settings.families[i];
            let mut cfg = PlanConfig::new(family);
            cfg.masquerade_bit = self.settings.masquerade_bit;
            cfg.masquerade_all = self.settings.masquerade_all;
            let text = rules::render_with(
                &self.planner.sets()[i],
                &cfg,
                &node,
                Some(self.planner.local()),
            );
            if full || text != self.rules[i] {
                self.iptables
                    .restore(self.backend, family, &text)
                    .map_err(ipt("iptables-restore"))?;
                self.ensure_jumps(family)?;
                self.rules[i] = text;
                operations += 1;
            }
        }
        // 5. Addresses no longer wanted, then 6. the virtual servers nothing reaches now.
        self.dummy.unbind_all(&unbind).map_err(dp)?;
        operations += bind.len() + unbind.len();
        self.ipvs.apply(&deletions).map_err(dp)?;
        operations += deletions.len();
        Ok(SyncReport {
            full,
            operations,
            no_local_endpoints: (0, 0),
        })
    }

    fn verify(&mut self) -> Result<Vec<String>, DataplaneError> {
        let mut out = Vec::new();
        let kernel = self.ipvs.dump().map_err(dp)?;
        for c in diff(&self.planner, &kernel, &self.settings.ipvs).changes {
            out.push(format!("ipvs: {c:?}"));
        }
        let current = self.dummy.addresses().map_err(dp)?;
        let a = addresses::diff(self.planner.bind_addresses(), &current);
        out.extend(
            a.bind
                .iter()
                .map(|ip| format!("{DUMMY_INTERFACE}: {ip} missing")),
        );
        out.extend(
            a.unbind
                .iter()
                .map(|ip| format!("{DUMMY_INTERFACE}: {ip} extra")),
        );
        let saved = self.ipset_saved()?;
        for (i, s) in self.planner.sets().iter().enumerate() {
            for c in saved.changes(i, s, &[]) {
                out.push(format!("ipset: {c:?}"));
            }
        }
        Ok(out)
    }

    fn cleanup(&mut self) -> Result<(), DataplaneError> {
        self.planner = Planner::new(&self.settings.families);
        self.resolved = None;
        // Every virtual server but the excluded ones and others' firewall-mark ones (the diff
        // against nothing), not a flush of the whole namespace.
        let kernel = self.ipvs.dump().map_err(dp)?;
        let plan = diff(&self.planner, &kernel, &self.settings.ipvs);
        self.ipvs.apply(&plan.changes).map_err(dp)?;
        let bound: Vec<IpAddr> = self.dummy.addresses().map_err(dp)?.into_iter().collect();
        self.dummy.unbind_all(&bound).map_err(dp)?;
        self.draining.clear();
        self.next_check = None;
        Ok(())
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.next_check
    }

    fn tick(&mut self, now: Instant) -> Result<(), DataplaneError> {
        if self.next_check.is_some_and(|t| t <= now) {
            // Only the virtual servers with a draining real server are read again.
            let keys: BTreeMap<ServiceKey, Option<Service>> = self
                .draining
                .iter()
                .map(|d| {
                    let planned = self.planner.virtual_server(&d.service);
                    (d.service, planned.map(|v| v.service.clone()))
                })
                .collect();
            // A virtual server deleted while one of its real servers drained is gone from the
            // plan, its address unbound by that sync: nothing reaches it.
            let (_, deletions) = self.reconcile_keys(&keys, now)?;
            self.ipvs.apply(&deletions).map_err(dp)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
