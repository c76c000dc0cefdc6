//! The ipvs mode's [`Dataplane`]: `kube-ipvs0` and its addresses, the ipsets, the iptables
//! chains that match them, and the IPVS virtual servers, all planned by `kp-ipvs-plan` from
//! the shared frontend list, with graceful termination on the mode's timer.
//!
//! Each sync plans the whole desired state (pure, cheap) and sends only differences: IPVS is
//! dumped and diffed (as upstream re-lists it; the one-endpoint change is still one add and one
//! delete per virtual server), set elements are diffed against what this dataplane last
//! applied (against `ipset save` on a full sync), addresses against a dump of the interface,
//! and the iptables text, whose rules change only when a set turns empty or non-empty, is
//! restored only when it differs from the last one.
//!
//! A sync reads first (IPVS, the addresses, the sets on a full sync) and then writes in
//! `kp_ipvs_plan::order`'s order: virtual and real servers, sets, addresses bound, chains,
//! addresses unbound, virtual servers deleted. A switch from the iptables mode (whose rules in
//! the shared `KUBE-SERVICES` serve until this mode's chains replace them) refuses no new
//! connection: when the chains stop the iptables mode's DNAT, IPVS and the addresses are
//! ready. The kernel's operations go through [`Kernel`] so a test can record their order.

use std::collections::BTreeSet;
use std::io::Write as _;
use std::net::IpAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kp_core::dataplane::{Dataplane, DataplaneError, SyncReport};
use kp_core::frontend::Frontends;
use kp_core::model::IpFamily;
use kp_core::node::{DetectLocal, NodeContext, NodePortAddresses};
use kp_core::track::{Changes, ProxyState};
use kp_iptables::{Backend, IptablesRunner};
use kp_iptables_plan::PlanConfig;
use kp_ipvs_plan::addresses::{self, DUMMY_INTERFACE};
use kp_ipvs_plan::ipset::{self, Sets};
use kp_ipvs_plan::order::{self, Step, SyncChanges};
use kp_ipvs_plan::{diff, rules, Change, Config, Desired, Draining};
use kp_netlink::ipvs::{DestinationState, Service};

use crate::link::Dummy;
use crate::{Client, Error};

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

/// The kernel operations of a sync, in the order the sync makes them (a trait so that a test
/// can record that order; [`System`] is the real one).
pub(crate) trait Kernel: Send {
    /// Every virtual server with its real servers.
    fn ipvs_dump(&mut self) -> Result<Vec<(Service, Vec<DestinationState>)>, DataplaneError>;
    /// IPVS changes, in order.
    fn ipvs_apply(&mut self, changes: &[Change]) -> Result<(), DataplaneError>;
    /// `kube-ipvs0`'s addresses.
    fn addresses(&mut self) -> Result<BTreeSet<IpAddr>, DataplaneError>;
    /// The node's addresses (every interface's but `kube-ipvs0`'s, loopback, link-local).
    fn node_addresses(&mut self) -> Result<BTreeSet<IpAddr>, DataplaneError>;
    /// Binds an address to `kube-ipvs0`.
    fn bind(&mut self, ip: IpAddr) -> Result<(), DataplaneError>;
    /// Unbinds an address from `kube-ipvs0`.
    fn unbind(&mut self, ip: IpAddr) -> Result<(), DataplaneError>;
    /// `ipset save`.
    fn ipset_save(&mut self) -> Result<String, DataplaneError>;
    /// `ipset restore`.
    fn ipset_restore(&mut self, text: &str) -> Result<(), DataplaneError>;
    /// `iptables-restore --noflush` of one family's chains, then the jumps into them.
    fn restore_rules(&mut self, family: IpFamily, text: &str) -> Result<(), DataplaneError>;
}

/// The real kernel: IPVS over generic netlink, `kube-ipvs0` over rtnetlink, the `ipset` and
/// iptables tools.
struct System {
    ipvs: Client,
    dummy: Dummy,
    iptables: Box<dyn IptablesRunner>,
    backend: Backend,
    netns: Option<String>,
}

/// The ipvs dataplane.
pub struct IpvsDataplane {
    settings: IpvsSettings,
    kernel: Box<dyn Kernel>,
    sets: Vec<Sets>,
    rules: Vec<String>,
    desired: Desired,
    draining: Vec<Draining>,
    next_check: Option<Instant>,
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
        let kernel = System {
            ipvs,
            dummy,
            iptables,
            backend,
            netns: settings.netns.clone(),
        };
        Ok(IpvsDataplane::with_kernel(settings, Box::new(kernel)))
    }

    /// The dataplane over `kernel`, with nothing applied yet.
    pub(crate) fn with_kernel(settings: IpvsSettings, kernel: Box<dyn Kernel>) -> IpvsDataplane {
        let sets = settings.families.iter().map(|f| Sets::new(*f)).collect();
        let rules = vec![String::new(); settings.families.len()];
        IpvsDataplane {
            settings,
            kernel,
            sets,
            rules,
            desired: Desired::new(),
            draining: Vec::new(),
            next_check: None,
        }
    }

    /// The real servers being drained after the last sync or tick.
    pub fn draining(&self) -> &[Draining] {
        &self.draining
    }

    /// What the last sync planned.
    pub fn desired(&self) -> &Desired {
        &self.desired
    }

    /// Keeps `draining` and schedules the next drain check.
    fn drain_later(&mut self, draining: Vec<Draining>, now: Instant) {
        self.draining = draining;
        self.next_check = if self.draining.is_empty() {
            None
        } else {
            Some(now + DRAIN_CHECK)
        };
    }

    /// The drain check: the IPVS diff of the last desired state against a fresh dump, applied
    /// but for virtual-server deletions (a sync makes those, after the addresses and rules
    /// that lead to them are gone).
    fn reconcile_ipvs(&mut self, now: Instant) -> Result<usize, DataplaneError> {
        let kernel = self.kernel.ipvs_dump()?;
        let plan = diff(&self.desired, &kernel, &self.settings.ipvs);
        let changes: Vec<Change> = plan
            .changes
            .into_iter()
            .filter(|c| !matches!(c, Change::DeleteService(_)))
            .collect();
        self.kernel.ipvs_apply(&changes)?;
        self.drain_later(plan.draining, now);
        Ok(changes.len())
    }
}

impl System {
    fn ipset_command(&self, verb: &str) -> Command {
        match &self.netns {
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
}

impl Kernel for System {
    fn ipvs_dump(&mut self) -> Result<Vec<(Service, Vec<DestinationState>)>, DataplaneError> {
        self.ipvs.dump().map_err(dp)
    }

    fn ipvs_apply(&mut self, changes: &[Change]) -> Result<(), DataplaneError> {
        self.ipvs.apply(changes).map_err(dp)
    }

    fn addresses(&mut self) -> Result<BTreeSet<IpAddr>, DataplaneError> {
        self.dummy.addresses().map_err(dp)
    }

    fn node_addresses(&mut self) -> Result<BTreeSet<IpAddr>, DataplaneError> {
        self.dummy.node_addresses().map_err(dp)
    }

    fn bind(&mut self, ip: IpAddr) -> Result<(), DataplaneError> {
        self.dummy.bind(ip).map_err(dp)
    }

    fn unbind(&mut self, ip: IpAddr) -> Result<(), DataplaneError> {
        self.dummy.unbind(ip).map_err(dp)
    }

    fn ipset_save(&mut self) -> Result<String, DataplaneError> {
        let out = self.ipset_command("save").output().map_err(|e| {
            DataplaneError::transient(Error::Tool {
                op: "ipset save".into(),
                detail: e.to_string(),
            })
        })?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn ipset_restore(&mut self, text: &str) -> Result<(), DataplaneError> {
        let tool = |detail: String| {
            DataplaneError::transient(Error::Tool {
                op: "ipset restore".into(),
                detail,
            })
        };
        let mut child = self
            .ipset_command("restore")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| tool(e.to_string()))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(text.as_bytes())
                .map_err(|e| tool(e.to_string()))?;
        }
        let out = child.wait_with_output().map_err(|e| tool(e.to_string()))?;
        if !out.status.success() {
            return Err(tool(String::from_utf8_lossy(&out.stderr).into_owned()));
        }
        Ok(())
    }

    fn restore_rules(&mut self, family: IpFamily, text: &str) -> Result<(), DataplaneError> {
        self.iptables
            .restore(self.backend, family, text)
            .map_err(ipt("iptables-restore"))?;
        self.ensure_jumps(family)
    }
}

impl Dataplane for IpvsDataplane {
    fn mode(&self) -> &'static str {
        "ipvs"
    }

    fn sync(
        &mut self,
        state: &ProxyState,
        _changes: &Changes,
        full: bool,
    ) -> Result<SyncReport, DataplaneError> {
        let (node, node_port_addresses) = match &self.settings.resolve {
            None => (
                self.settings.node.clone(),
                self.settings.node_port_addresses.clone(),
            ),
            Some(r) => {
                let node = NodeContext::resolve(&r.detect_local, &r.node_ports, state);
                let local = self.kernel.node_addresses()?;
                let np = node_port_addresses(&r.node_ports, &node, &local);
                (node, np)
            }
        };
        let mut desired = Desired::new();
        let mut sets: Vec<Sets> = self
            .settings
            .families
            .iter()
            .map(|f| Sets::new(*f))
            .collect();
        for key in state.service_keys() {
            for sps in state.service_state(key) {
                for s in sets.iter_mut() {
                    let frontends = Frontends::of(&sps, s.family());
                    desired.add(&frontends, &node_port_addresses, &self.settings.ipvs);
                    s.add(&frontends, &node_port_addresses, &node);
                }
            }
        }
        // Read everything first: IPVS, the addresses, the sets on a full sync.
        let ipvs = diff(&desired, &self.kernel.ipvs_dump()?, &self.settings.ipvs);
        let current = self.kernel.addresses()?;
        let addresses = addresses::diff(desired.bind_addresses(), &current);
        let saved = if full {
            Some(self.kernel.ipset_save()?)
        } else {
            None
        };
        let mut changes = SyncChanges {
            ipvs: ipvs.changes,
            addresses,
            ..SyncChanges::default()
        };
        for (i, s) in sets.iter().enumerate() {
            let family = s.family();
            let had = match &saved {
                Some(text) => Sets::parse_save(family, text),
                None => self.sets[i].clone(),
            };
            let set_changes = ipset::diff(s, &had);
            if full || !set_changes.is_empty() {
                changes.sets.push((family, set_changes));
            }
            let mut cfg = PlanConfig::new(family);
            cfg.masquerade_bit = self.settings.masquerade_bit;
            cfg.masquerade_all = self.settings.masquerade_all;
            let text = rules::render_with(s, &cfg, &node, Some(desired.local()));
            if full || text != self.rules[i] {
                changes.rules.push((family, text));
            }
        }
        // Then write, in the order that never steers a packet to something not there yet.
        self.desired = desired;
        let mut operations = 0;
        for step in order::steps(changes) {
            match step {
                Step::Ipvs(c) => {
                    self.kernel.ipvs_apply(&c)?;
                    operations += c.len();
                }
                Step::Sets { family, changes } => {
                    self.kernel
                        .ipset_restore(&ipset::restore_text(family, &changes))?;
                    operations += changes.len();
                }
                Step::Bind(ip) => {
                    self.kernel.bind(ip)?;
                    operations += 1;
                }
                Step::Rules { family, text } => {
                    self.kernel.restore_rules(family, &text)?;
                    if let Some(i) = self.settings.families.iter().position(|f| *f == family) {
                        self.rules[i] = text;
                    }
                    operations += 1;
                }
                Step::Unbind(ip) => {
                    self.kernel.unbind(ip)?;
                    operations += 1;
                }
            }
        }
        self.sets = sets;
        self.drain_later(ipvs.draining, Instant::now());
        Ok(SyncReport {
            full,
            operations,
            no_local_endpoints: (0, 0),
        })
    }

    fn verify(&mut self) -> Result<Vec<String>, DataplaneError> {
        let mut out = Vec::new();
        let kernel = self.kernel.ipvs_dump()?;
        for c in diff(&self.desired, &kernel, &self.settings.ipvs).changes {
            out.push(format!("ipvs: {c:?}"));
        }
        let current = self.kernel.addresses()?;
        let a = addresses::diff(self.desired.bind_addresses(), &current);
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
        let saved = self.kernel.ipset_save()?;
        for s in &self.sets {
            for c in ipset::diff(s, &Sets::parse_save(s.family(), &saved)) {
                out.push(format!("ipset: {c:?}"));
            }
        }
        Ok(out)
    }

    fn cleanup(&mut self) -> Result<(), DataplaneError> {
        self.desired = Desired::new();
        // The addresses first (nothing reaches IPVS after), then every virtual server but the
        // excluded ones and others' firewall-mark ones (the diff against nothing), not a flush
        // of the whole namespace.
        for ip in self.kernel.addresses()? {
            self.kernel.unbind(ip)?;
        }
        let kernel = self.kernel.ipvs_dump()?;
        let plan = diff(&self.desired, &kernel, &self.settings.ipvs);
        self.kernel.ipvs_apply(&plan.changes)?;
        self.draining.clear();
        self.next_check = None;
        Ok(())
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.next_check
    }

    fn tick(&mut self, now: Instant) -> Result<(), DataplaneError> {
        if self.next_check.is_some_and(|t| t <= now) {
            self.reconcile_ipvs(now)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
