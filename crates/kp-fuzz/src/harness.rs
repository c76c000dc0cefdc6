//! The pipeline every generated object goes through, and the checks after each stage.
//!
//! Per object: decode into its k8s-openapi type; parse it as a JSON manifest (and, one in
//! three, as YAML) with the manifest source's parser and compare; apply it to the
//! [`ProxyState`]. Every few objects, parse a multi-document file of recent objects, a `List`
//! and garbled text. Every batch of objects (a random size around
//! [`Options::plan_every`]), plan the accumulated state with both nftables planners (text and
//! netlink-batch forms, both families) and both iptables planners, partially as a running
//! proxy does, feed the text to the tracers, and check it; every eighth plan, also compare the
//! partially-built tables with a fresh full plan. Every 32 plans the planners start over with
//! another configuration (detect-local, `nodePortAddresses`, `masqueradeAll`, the mark bit).

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::IpAddr;
use std::panic::{self, AssertUnwindSafe};
use std::path::Path;
use std::sync::Once;
use std::time::{Duration, Instant};

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Endpoints, Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kp_core::model::{IpFamily, Protocol, ServiceKey};
use kp_core::node::{DetectLocal, NodeContext, NodePortAddresses};
use kp_core::track::{Changes, Kind, Object, ObjectKey, ProxyState, SourceEvent};
use kp_iptables_plan as ipt;
use kp_nftables_plan as nft;
use serde_json::{json, Value};

use crate::generate::{self, Generator, NAMESPACES};
use crate::hostile::{self, smuggled, smuggled_bytes};
use crate::modes;
use crate::precedence;
use crate::report::{short, Check, Report};
use crate::rng::Rng;

/// How a run goes.
#[derive(Clone, Debug)]
pub struct Options {
    /// The seed: the same seed makes the same objects and the same plans.
    pub seed: u64,
    /// How many objects to generate.
    pub objects: u64,
    /// Average objects between plans.
    pub plan_every: u64,
}

impl Options {
    /// `objects` objects from `seed`, planned every 200 or so.
    pub fn new(seed: u64, objects: u64) -> Self {
        Options {
            seed,
            objects,
            plan_every: 200,
        }
    }
}

/// Runs the pipeline over `opts.objects` generated objects, calling `progress` with the report
/// so far about every `every` of wall-clock time.
pub fn run_with(opts: &Options, every: Duration, mut progress: impl FnMut(&Report)) -> Report {
    install_quiet_hook();
    let start = Instant::now();
    let mut h = Harness::new(opts);
    let mut last = Instant::now();
    for i in 0..opts.objects {
        h.object(i);
        if h.until_plan == 0 || i + 1 == opts.objects {
            h.plan(i);
        }
        if last.elapsed() >= every {
            last = Instant::now();
            h.report.elapsed = start.elapsed();
            progress(&h.report);
        }
    }
    h.report.elapsed = start.elapsed();
    h.report
}

/// A planner configuration, fixed for one epoch of plans.
#[derive(Clone, Debug)]
struct Setup {
    /// Detect-local (which sources are pods).
    detect_local: DetectLocal,
    /// `nodePortAddresses`.
    node_ports: NodePortAddresses,
    /// `masqueradeAll`.
    masquerade_all: bool,
    /// The masquerade mark bit (0-31).
    masquerade_bit: u32,
    /// iptables' `localhostNodePorts` (IPv4 only).
    localhost_node_ports: bool,
    /// Chains per iptables-restore input.
    step: usize,
    /// The userspace, ipvs and ebpf modes' settings.
    modes: modes::ModeSetup,
}

impl Setup {
    /// A configuration drawn from `r`.
    fn random(r: &mut Rng) -> Setup {
        let cidr = |s: &str| s.parse::<IpNet>().ok();
        let cluster: Vec<IpNet> = [kp_flows::CLUSTER_CIDR, kp_flows::CLUSTER_CIDR6]
            .into_iter()
            .filter_map(cidr)
            .collect();
        let node_port_cidrs: Vec<IpNet> = ["192.0.2.0/24", "2001:db8::/64", "0.0.0.0/0"]
            .into_iter()
            .filter_map(cidr)
            .collect();
        Setup {
            detect_local: match r.below(3) {
                0 => DetectLocal::None,
                1 => DetectLocal::ClusterCidr(cluster),
                _ => DetectLocal::NodeCidr,
            },
            node_ports: match r.below(3) {
                0 => NodePortAddresses::AllLocal,
                1 => NodePortAddresses::Primary,
                _ => NodePortAddresses::Cidrs(node_port_cidrs),
            },
            masquerade_all: r.chance(1, 3),
            masquerade_bit: if r.chance(1, 2) {
                14
            } else {
                r.below(32) as u32
            },
            localhost_node_ports: r.chance(1, 3),
            step: 1 + r.below(40),
            modes: modes::ModeSetup {
                proxy_port: 1 + r.below(65535) as u16,
                transparent_mark: 1 << r.below(32),
                scheduler: r.pick::<&str>(modes::SCHEDULERS),
            },
        }
    }

    /// The nftables planner's configuration for `family`.
    fn nft(&self, family: IpFamily) -> nft::PlanConfig {
        let mut c = nft::PlanConfig::new(family);
        c.masquerade_all = self.masquerade_all;
        c.masquerade_mark = 1 << self.masquerade_bit;
        c.detect_local = self.detect_local != DetectLocal::None;
        c.node_ports_restricted = self.node_ports != NodePortAddresses::AllLocal;
        c
    }

    /// The iptables planner's configuration for `family`.
    fn ipt(&self, family: IpFamily) -> ipt::PlanConfig {
        let mut c = ipt::PlanConfig::new(family);
        c.masquerade_all = self.masquerade_all;
        c.masquerade_bit = self.masquerade_bit;
        c.localhost_node_ports = self.localhost_node_ports && family == IpFamily::V4;
        c
    }
}

/// The planners of one epoch and the tracers fed with what they rendered.
struct Planners {
    /// The configuration.
    setup: Setup,
    /// nftables, all as text (per family), replayed into `nft_tracer`.
    nft_text: Vec<nft::Planner>,
    /// nftables, elements as netlink batches (per family).
    nft_split: Vec<nft::Planner>,
    /// Holds what `nft_text` sent, both families.
    nft_tracer: kp_nftables_test::NftTracer,
    /// iptables (per family), replayed into `ipt_tracer`.
    ipt: Vec<ipt::Planner>,
    /// Holds what `ipt` sent, both families.
    ipt_tracer: kp_iptables_test::IptablesTracer,
    /// The userspace, ipvs and ebpf planners.
    modes: modes::ModePlanners,
    /// Plans made in this epoch.
    plans: u32,
}

/// Plans per epoch.
const EPOCH: u32 = 32;
/// Every how many plans the partially-built tables are compared with a full plan.
const CONVERGE_EVERY: u32 = 8;

/// A run in progress.
struct Harness {
    /// The run's options.
    opts: Options,
    /// The objects.
    gen: Generator,
    /// The pipeline's own choices (YAML or not, deletions, batch sizes, configurations), on a
    /// stream apart from the generator's.
    rng: Rng,
    /// Everything accepted so far, as the proxy holds it.
    state: ProxyState,
    /// The current epoch's planners; `None` starts a new epoch at the next plan.
    planners: Option<Planners>,
    /// YAML documents of recent objects, for multi-document files.
    recent: Vec<String>,
    /// Recent objects as JSON, for lists.
    recent_json: Vec<Value>,
    /// Objects left before the next plan.
    until_plan: u64,
    /// Which endpoints each Service should have (own slices, else mirrored Endpoints).
    model: precedence::Model,
    report: Report,
}

impl Harness {
    /// A run of `opts` with an empty state whose initial lists are complete.
    fn new(opts: &Options) -> Harness {
        let mut gen = Generator::new(opts.seed);
        let rng = gen.fork();
        let mut state = ProxyState::new(kp_flows::NODE);
        for k in [
            Kind::Service,
            Kind::EndpointSlice,
            Kind::Node,
            Kind::ServiceCidr,
        ] {
            let _ = state.apply(SourceEvent::Synced(k));
        }
        Harness {
            opts: opts.clone(),
            gen,
            rng,
            state,
            planners: None,
            recent: Vec::new(),
            recent_json: Vec::new(),
            until_plan: 1,
            model: precedence::Model::new(kp_flows::NODE),
            report: Report {
                seed: opts.seed,
                ..Report::default()
            },
        }
    }

    /// One generated object through decoding, the manifest parser and validation.
    fn object(&mut self, i: u64) {
        self.report.objects += 1;
        self.until_plan = self.until_plan.saturating_sub(1);
        let value = self.gen.object();
        let kind = value
            .get("kind")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        // A kind the proxy does not read is decoded as one it does, picked at random: type
        // confusion is one more way in.
        let as_kind = match kind.as_str() {
            "Service" | "EndpointSlice" | "Node" | "ServiceCIDR" | "Endpoints" => kind.clone(),
            _ => (*self.rng.pick(&[
                "Service",
                "EndpointSlice",
                "Node",
                "ServiceCIDR",
                "Endpoints",
            ]))
            .into(),
        };
        let typed = match guard(|| decode(&as_kind, &value)) {
            Ok(t) => t,
            Err(p) => {
                self.report
                    .violation(Check::Panic, i, &format!("decoding {as_kind}: {p}"));
                None
            }
        };
        if typed.is_some() {
            self.report.decoded += 1;
        }

        let text = value.to_string();
        let hostile = smuggled(&text);
        if hostile {
            self.report.hostile += 1;
        }
        let from_manifest = self.manifests(i, &value, &text, typed.as_ref());
        if let Some(obj) = from_manifest.or(typed) {
            if self.apply(i, obj) && hostile {
                self.report.hostile_accepted += 1;
            }
        }
        if self.rng.chance(1, 30) {
            self.delete(i);
        }
    }

    /// The object through the manifest parser: as JSON always, as YAML one in three, and every
    /// 16th object a multi-document file, a list and garbled text of recent ones. Returns what
    /// the JSON manifest decoded to, which is what the manifest source would apply.
    fn manifests(
        &mut self,
        i: u64,
        value: &Value,
        text: &str,
        typed: Option<&Object>,
    ) -> Option<Object> {
        let supported = is_supported(value);
        let parsed = self.parse(i, "obj.json", text);
        if supported {
            let want = typed.filter(|o| !o.key().name.is_empty()).map(object_json);
            let got = match &parsed {
                Some(objs) if objs.len() == 1 => Some(object_json(&objs[0])),
                _ => None,
            };
            if want != got {
                self.report.violation(
                    Check::ManifestDiffers,
                    i,
                    &format!(
                        "from_value: {want:?}\nmanifest: {got:?}\ninput: {}",
                        short(text, 300)
                    ),
                );
            }
        }
        if self.rng.chance(1, 3) {
            if let Ok(yaml) = serde_saphyr::to_string(value) {
                let from_yaml = self.parse(i, "obj.yaml", &yaml);
                if supported {
                    let want = parsed.as_ref().and_then(|o| o.first()).map(object_json);
                    let got = from_yaml.as_ref().and_then(|o| o.first()).map(object_json);
                    if want != got {
                        self.report.yaml_differs += 1;
                    }
                }
                self.recent.push(yaml);
                self.recent_json.push(value.clone());
                if self.recent.len() > 8 {
                    self.recent.remove(0);
                    self.recent_json.remove(0);
                }
            }
        }
        if i % 16 == 15 {
            self.files(i);
        }
        parsed.and_then(|mut o| o.pop())
    }

    /// Multi-document YAML, lists and garbled text made of recent objects.
    fn files(&mut self, i: u64) {
        let multi = self.recent.join("---\n");
        self.parse(i, "multi.yaml", &multi);
        let list = json!({"apiVersion": "v1", "kind": "List", "items": self.recent_json});
        self.parse(i, "list.json", &list.to_string());
        if let Ok(yaml) = serde_saphyr::to_string(&list) {
            self.parse(i, "list.yaml", &yaml);
        }
        // A typed list's items may leave out apiVersion and kind.
        let items: Vec<Value> = self
            .recent_json
            .iter()
            .map(|v| {
                let mut v = v.clone();
                if let Value::Object(m) = &mut v {
                    m.remove("apiVersion");
                    m.remove("kind");
                }
                v
            })
            .collect();
        let (api, kind) = *self.rng.pick(&[
            ("v1", "ServiceList"),
            ("discovery.k8s.io/v1", "EndpointSliceList"),
            ("v1", "NodeList"),
            ("networking.k8s.io/v1", "ServiceCIDRList"),
            ("v1", "EndpointsList"),
        ]);
        let typed = json!({"apiVersion": api, "kind": kind, "items": items});
        self.parse(i, "typed.json", &typed.to_string());
        let garbled = generate::garble(&mut self.rng, &multi);
        self.parse(i, "garbled.yaml", &garbled);
        let garbled = generate::garble(&mut self.rng, &list.to_string());
        self.parse(i, "garbled.json", &garbled);
        // Refusing it takes the parser a while (its node budget), so once early in the run
        // and then rarely.
        if i % 262_144 == 15 {
            self.parse(i, "bomb.yaml", &generate::alias_bomb());
        }
    }

    /// Parses one manifest text; the objects, or `None` if it fails (or panics).
    fn parse(&mut self, i: u64, name: &str, text: &str) -> Option<Vec<Object>> {
        self.report.manifests += 1;
        // In files of several objects, ask for some ordinals only, as the source does when it
        // re-reads a file for a few objects: the others are syntax-checked and skipped.
        let skip = !name.starts_with("obj.") && self.rng.chance(1, 4);
        let mut pick = self.rng.fork();
        let result = guard(AssertUnwindSafe(|| {
            let mut objects = Vec::new();
            let r = kp_source::manifests::parse::for_each_object(
                Path::new(name),
                text,
                &mut |_| !skip || pick.chance(1, 2),
                &mut |_, o| objects.push(o),
            );
            r.map(|()| objects).map_err(|e| e.to_string())
        }));
        match result {
            Ok(Ok(objects)) => Some(objects),
            Ok(Err(e)) => {
                self.report.manifest_errors += 1;
                if e.chars().any(char::is_control) {
                    self.report.manifest_errors_with_controls += 1;
                }
                None
            }
            Err(p) => {
                self.report.violation(
                    Check::Panic,
                    i,
                    &format!(
                        "manifest parser on {name}: {p}\ninput: {}",
                        short(text, 300)
                    ),
                );
                None
            }
        }
    }

    /// Applies an object; whether it was accepted.
    fn apply(&mut self, i: u64, obj: Object) -> bool {
        let pending = self.model.prepare(&obj);
        let kind = obj.kind();
        let state = &mut self.state;
        match guard(AssertUnwindSafe(|| state.apply(SourceEvent::Upsert(obj)))) {
            Ok(Ok(_)) => {
                self.report.accepted += 1;
                if kind == Kind::Endpoints {
                    self.report.endpoints_accepted += 1;
                }
                match self.model.accepted(pending) {
                    Ok(touched) => self.check_precedence(i, &touched),
                    Err(why) => self.report.violation(
                        Check::InvalidEndpointsAccepted,
                        i,
                        &format!("an Endpoints with {why} was accepted"),
                    ),
                }
                return true;
            }
            Ok(Err(rejected)) => {
                self.report.rejected += 1;
                let line = rejected.to_string();
                if line.chars().any(char::is_control) {
                    self.report.violation(Check::ControlInLog, i, &line);
                }
            }
            Err(p) => self
                .report
                .violation(Check::Panic, i, &format!("ProxyState::apply: {p}")),
        }
        false
    }

    /// Deletes an object of the pool (or one with a hostile key).
    fn delete(&mut self, i: u64) {
        let r = &mut self.rng;
        let kind = *r.pick(&[
            Kind::Service,
            Kind::EndpointSlice,
            Kind::Node,
            Kind::ServiceCidr,
            Kind::Endpoints,
        ]);
        let name = if r.chance(1, 10) {
            hostile::string(r)
        } else {
            match kind {
                Kind::Service => format!("svc-{}", r.below(48)),
                Kind::EndpointSlice => format!("svc-{}-{}", r.below(48), r.below(3)),
                Kind::Node => kp_flows::NODE.to_string(),
                Kind::ServiceCidr => (*r.pick(&["kubernetes", "extra", "second-range"])).into(),
                Kind::Endpoints => format!("svc-{}", r.below(48)),
            }
        };
        let namespace = match kind {
            Kind::Node | Kind::ServiceCidr => String::new(),
            _ => (*r.pick(NAMESPACES)).to_string(),
        };
        let key = ObjectKey { namespace, name };
        let state = &mut self.state;
        let k = key.clone();
        match guard(AssertUnwindSafe(|| {
            state.apply(SourceEvent::Delete(kind, k))
        })) {
            Ok(_) => {
                self.report.deletes += 1;
                let touched = self.model.deleted(kind, &key);
                self.check_precedence(i, &touched);
            }
            Err(p) => {
                self.report
                    .violation(Check::Panic, i, &format!("ProxyState::apply(Delete): {p}"))
            }
        }
    }

    /// Whether the endpoints of `services` are what the precedence model says.
    fn check_precedence(&mut self, i: u64, services: &[ServiceKey]) {
        for s in services {
            self.report.precedence_checks += 1;
            if let Err(e) = self.model.check(&self.state, s) {
                self.report.violation(Check::Precedence, i, &e);
            }
        }
    }

    /// Plans what accumulated since the last plan, with every planner, and checks it.
    fn plan(&mut self, i: u64) {
        let avg = self.opts.plan_every.max(1);
        self.until_plan = 1 + self.rng.below(2 * avg as usize) as u64;
        let changes = self.state.take_changes();
        // Every Service against the precedence model, and every one whose endpoints changed
        // since the last plan among the changes the planners are given.
        self.report.mirrored_served += self.model.mirrored_served(&self.state);
        self.report.precedence_flips = self.model.flips;
        for e in self.model.check_all(&self.state) {
            self.report.violation(Check::Precedence, i, &e);
        }
        for s in self.model.unrecorded(&self.state, &changes.services) {
            self.report.violation(
                Check::Precedence,
                i,
                &format!("{s}: its endpoints changed since the last plan, but not in Changes"),
            );
        }
        let mut planners = match self.planners.take() {
            Some(p) if p.plans < EPOCH => p,
            _ => {
                let setup = Setup::random(&mut self.rng);
                match self.start_epoch(i, setup) {
                    Some(p) => p,
                    None => return,
                }
            }
        };
        planners.plans += 1;
        let converge = planners.plans % CONVERGE_EVERY == 0;
        let (state, report) = (&self.state, &mut self.report);
        let outcome = guard(AssertUnwindSafe(|| {
            partial(&mut planners, state, &changes, converge, i, report)
                && (!converge || converged(&planners, state, i, report))
        }));
        match outcome {
            // Keep the planners for the next plan.
            Ok(true) => self.planners = Some(planners),
            // A broken invariant leaves the tracers out of step: start over with new planners
            // rather than report the same thing at every plan.
            Ok(false) => {}
            Err(p) => self
                .report
                .violation(Check::Panic, i, &format!("planning: {p}")),
        }
    }

    /// New planners and tracers for `setup`, fed a full plan of the current state.
    fn start_epoch(&mut self, i: u64, setup: Setup) -> Option<Planners> {
        let state = &self.state;
        let report = &mut self.report;
        let outcome = guard(AssertUnwindSafe(|| {
            let mut p = Planners {
                nft_text: IpFamily::ALL
                    .map(|f| nft::Planner::new(setup.nft(f)))
                    .into(),
                nft_split: IpFamily::ALL
                    .map(|f| nft::Planner::new(setup.nft(f)))
                    .into(),
                nft_tracer: kp_nftables_test::NftTracer::new(kp_flows::node_addresses()),
                ipt: IpFamily::ALL
                    .map(|f| ipt::Planner::new(setup.ipt(f)))
                    .into(),
                ipt_tracer: kp_iptables_test::IptablesTracer::new(kp_flows::node_addresses()),
                modes: modes::ModePlanners::new(
                    setup.modes.clone(),
                    setup.masquerade_all,
                    setup.detect_local.clone(),
                    setup.node_ports != NodePortAddresses::AllLocal,
                ),
                setup: setup.clone(),
                plans: 0,
            };
            full(&mut p, state, i, report).then_some(p)
        }));
        match outcome {
            Ok(p) => p,
            Err(p) => {
                report.violation(Check::Panic, i, &format!("full plan: {p}"));
                None
            }
        }
    }
}

/// Whether `kind` and `apiVersion` name an object the manifest parser decodes whole.
fn is_supported(v: &Value) -> bool {
    let api = v.get("apiVersion").and_then(Value::as_str);
    let kind = v.get("kind").and_then(Value::as_str);
    matches!(
        (api, kind),
        (Some("v1"), Some("Service"))
            | (Some("discovery.k8s.io/v1"), Some("EndpointSlice"))
            | (Some("v1"), Some("Node"))
            | (Some("networking.k8s.io/v1"), Some("ServiceCIDR"))
            | (Some("v1"), Some("Endpoints"))
    )
}

/// `serde_json::from_value` into the k8s-openapi type of `kind`.
fn decode(kind: &str, v: &Value) -> Option<Object> {
    let v = v.clone();
    Some(match kind {
        "Service" => Object::Service(Box::new(serde_json::from_value::<Service>(v).ok()?)),
        "EndpointSlice" => {
            Object::EndpointSlice(Box::new(serde_json::from_value::<EndpointSlice>(v).ok()?))
        }
        "Node" => Object::Node(Box::new(serde_json::from_value::<Node>(v).ok()?)),
        "Endpoints" => Object::Endpoints(Box::new(serde_json::from_value::<Endpoints>(v).ok()?)),
        _ => Object::ServiceCidr(Box::new(serde_json::from_value::<ServiceCIDR>(v).ok()?)),
    })
}

/// An object back as JSON, to compare two decodings.
fn object_json(o: &Object) -> Value {
    let v = match o {
        Object::Service(s) => serde_json::to_value(s),
        Object::EndpointSlice(s) => serde_json::to_value(s),
        Object::Node(n) => serde_json::to_value(n),
        Object::ServiceCidr(c) => serde_json::to_value(c),
        Object::Endpoints(e) => serde_json::to_value(e),
    };
    v.unwrap_or(Value::Null)
}

/// The node settings of `setup`, resolved against the state as a sync does.
fn node_context(setup: &Setup, state: &ProxyState) -> NodeContext {
    NodeContext::resolve(&setup.detect_local, &setup.node_ports, state)
}

/// Checks one rendered text: no marker, no control character but line breaks. False if
/// anything was wrong.
pub(crate) fn check_text(what: &str, text: &str, i: u64, report: &mut Report) -> bool {
    report.bytes += text.len() as u64;
    let mut ok = true;
    if smuggled(text) {
        let line = text.lines().find(|l| smuggled(l)).unwrap_or_default();
        report.violation(Check::Smuggled, i, &format!("{what}: {line}"));
        ok = false;
    }
    // Split at `\n` only: `str::lines` would also swallow a `\r` before it.
    if let Some(line) = text.split('\n').find(|l| l.chars().any(char::is_control)) {
        report.violation(Check::ControlInRules, i, &format!("{what}: {line}"));
        ok = false;
    }
    ok
}

/// Checks a netlink element batch: encodable, and no marker in its bytes.
fn check_batch(what: &str, batch: nft::ElementBatch, i: u64, report: &mut Report) -> bool {
    let mut ok = true;
    report.batch_elements += batch.elements() as u64;
    if let Some(e) = batch.errors().first() {
        report.violation(Check::EncodeError, i, &format!("{what}: {e}"));
        ok = false;
    }
    if let Some(encoded) = batch.finish() {
        report.bytes += encoded.bytes.len() as u64;
        if smuggled_bytes(&encoded.bytes) {
            report.violation(Check::Smuggled, i, &format!("{what}: in the netlink batch"));
            ok = false;
        }
    }
    ok
}

/// Checks an iptables restore: its errors, every input it is cut into, fed to the tracer.
fn check_restore(
    p: &mut Planners,
    family: IpFamily,
    restore: &ipt::Restore<'_>,
    i: u64,
    report: &mut Report,
) -> bool {
    let mut ok = true;
    for e in &restore.errors {
        let text = e.to_string();
        if smuggled(&text) {
            report.violation(Check::Smuggled, i, &format!("iptables plan error: {text}"));
            ok = false;
        }
        match e {
            ipt::PlanError::Service { .. } => {
                report.iptables_left_out += 1;
                let example = short(&text, 400);
                if report.left_out_examples.len() < 5
                    && !report.left_out_examples.contains(&example)
                {
                    report.left_out_examples.push(example);
                }
            }
            ipt::PlanError::Shared { .. } => {
                report.violation(Check::SharedRuleRefused, i, &text);
                ok = false;
            }
        }
    }
    for input in restore.steps(p.setup.step) {
        ok &= check_text("iptables-restore input", &input, i, report);
        if let Err(e) = p.ipt_tracer.apply(family, &input) {
            report.violation(
                Check::TracerRefused,
                i,
                &format!("iptables {family:?}: {e}\n{}", short(&input, 300)),
            );
            return false;
        }
    }
    ok
}

/// The first plan of an epoch: full, with every planner.
fn full(p: &mut Planners, state: &ProxyState, i: u64, report: &mut Report) -> bool {
    let node = node_context(&p.setup, state);
    let mut ok = true;
    for k in 0..p.nft_text.len() {
        let tx = p.nft_text[k].full(state, &node);
        report.plans += 1;
        ok &= check_text("nft full", &tx.text, i, report);
        if let Err(e) = p.nft_tracer.apply(&tx.text) {
            report.violation(Check::TracerRefused, i, &format!("nft full: {e}"));
            return false;
        }
        let mut batch = nft::ElementBatch::new();
        let tx = p.nft_split[k].full_split(state, &node, &mut batch);
        report.plans += 1;
        ok &= check_text("nft full_split", &tx.text, i, report);
        ok &= check_batch("nft full_split", batch, i, report);
    }
    for k in 0..p.ipt.len() {
        let family = p.ipt[k].config().family;
        let restore = p.ipt[k].full(state, &node).materialize();
        report.plans += 1;
        ok &= check_restore(p, family, &restore, i, report);
        // The jumps from the built-in chains, which the applier inserts.
        for j in p.ipt[k].jump_rules() {
            ok &= check_text("iptables jump rule", &j.args, i, report);
        }
    }
    let ipt = p.setup.ipt(IpFamily::V4);
    ok & p.modes.sync(
        state,
        &node,
        &p.setup.node_ports,
        &ipt,
        None,
        false,
        i,
        report,
    )
}

/// A partial plan of `changes`, with every planner.
fn partial(
    p: &mut Planners,
    state: &ProxyState,
    changes: &Changes,
    converge: bool,
    i: u64,
    report: &mut Report,
) -> bool {
    let node = node_context(&p.setup, state);
    let (services, node_changed) = (&changes.services, changes.node_changed);
    let mut ok = true;
    for k in 0..p.nft_text.len() {
        let tx = p.nft_text[k].partial(state, services, &node, node_changed);
        report.plans += 1;
        ok &= check_text("nft partial", &tx.text, i, report);
        if let Err(e) = p.nft_tracer.apply(&tx.text) {
            report.violation(
                Check::TracerRefused,
                i,
                &format!("nft partial: {e}\n{}", short(&tx.text, 300)),
            );
            return false;
        }
        let mut batch = nft::ElementBatch::new();
        let tx = p.nft_split[k].partial_split(state, services, &node, node_changed, &mut batch);
        report.plans += 1;
        ok &= check_text("nft partial_split", &tx.text, i, report);
        ok &= check_batch("nft partial_split", batch, i, report);
    }
    for k in 0..p.ipt.len() {
        let family = p.ipt[k].config().family;
        let restore = p.ipt[k].partial(state, services, &node, node_changed);
        report.plans += 1;
        ok &= check_restore(p, family, &restore, i, report);
    }
    let ipt = p.setup.ipt(IpFamily::V4);
    ok & p.modes.sync(
        state,
        &node,
        &p.setup.node_ports,
        &ipt,
        Some(changes),
        converge,
        i,
        report,
    )
}

/// What a divergence note says when every differing element's key is wanted by more than one
/// Service port: how the nftables planner's shared-owner defect showed (fixed; a test in
/// `tests/known_defects.rs`), kept to tell such a divergence at a glance.
pub const CONTESTED: &str = "every differing key is claimed by several Service ports";

/// A dispatch key: address (none for NodePorts), protocol, port.
type VipKey = (Option<IpAddr>, Option<Protocol>, Option<u16>);

/// The dispatch key an element's key starts with: its address if it has one, then its
/// protocol and port.
fn vip_key(t: &nft::element::Tuple) -> VipKey {
    let atoms = t.atoms();
    let ip = match atoms.first() {
        Some(nft::element::Atom::Ip(ip)) => Some(*ip),
        _ => None,
    };
    let rest = &atoms[usize::from(ip.is_some()).min(atoms.len())..];
    let proto = match rest.first() {
        Some(nft::element::Atom::Proto(p)) => Some(*p),
        _ => None,
    };
    let port = match rest.get(1) {
        Some(nft::element::Atom::Port(p)) => Some(*p),
        _ => None,
    };
    (ip, proto, port)
}

/// Dispatch keys of `family` that more than one Service port wants: an external or
/// LoadBalancer IP (which no one allocates) shared by two Services, or one of them equal to
/// another Service's ClusterIP, on the same protocol and port; or one NodePort twice.
fn contested_keys(state: &ProxyState, family: IpFamily) -> HashSet<VipKey> {
    let mut claims: HashMap<VipKey, u32> = HashMap::new();
    for key in state.service_keys() {
        for port in state.service_ports(key) {
            let proto = Some(port.name.protocol);
            let mut mine: HashSet<VipKey> = port
                .cluster_ips
                .iter()
                .chain(&port.external_ips)
                .chain(&port.load_balancer_ips)
                .filter(|ip| IpFamily::of(ip) == family)
                .map(|ip| (Some(*ip), proto, Some(port.port)))
                .collect();
            if let Some(np) = port.node_port {
                mine.insert((None, proto, Some(np)));
            }
            for k in mine {
                *claims.entry(k).or_default() += 1;
            }
        }
    }
    claims
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .map(|(k, _)| k)
        .collect()
}

/// A set's elements by entry: for an endpoint map, the entry key (without its slot) and the
/// endpoints of its slots, sorted; for any other set, each key and its value.
type Entries = BTreeMap<nft::element::Tuple, Vec<Option<nft::element::Tuple>>>;

/// `elements` of `set` by entry. Which endpoint holds which slot depends on history, by design
/// (an endpoint that stays keeps its slot, so replacing one rewrites one element), so two
/// tables that dispatch an entry to the same endpoints are equal whatever their slot order.
fn by_entry(
    set: nft::SetId,
    elements: BTreeMap<nft::element::Tuple, Option<nft::element::Tuple>>,
) -> Entries {
    let mut out: Entries = BTreeMap::new();
    for (k, v) in elements {
        let key = match (set, k.atoms().split_last()) {
            (nft::SetId::ClassEndpoints(..), Some((nft::element::Atom::Slot(_), entry))) => {
                nft::element::Tuple::new(entry.to_vec())
            }
            _ => k,
        };
        out.entry(key).or_default().push(v);
    }
    for values in out.values_mut() {
        values.sort();
    }
    out
}

/// Whether the partially-built tables are what a fresh full plan of `state` builds: the
/// nftables planners' element records (text and split alike) and the tracer's element counts,
/// and every iptables chain the tracer holds.
fn converged(p: &Planners, state: &ProxyState, i: u64, report: &mut Report) -> bool {
    let node = node_context(&p.setup, state);
    let mut ok = true;
    for (text, split) in p.nft_text.iter().zip(&p.nft_split) {
        let family = text.config().family;
        let mut fresh = nft::Planner::new(text.config().clone());
        fresh.full(state, &node);
        let sets: BTreeSet<nft::SetId> = fresh
            .all_sets()
            .into_iter()
            .chain(text.all_sets())
            .collect();
        let contested = contested_keys(state, family);
        for set in sets {
            let want = by_entry(set, fresh.expected_elements(set));
            let text_elements = text.expected_elements(set);
            let text_len = text_elements.len();
            let text_got = by_entry(set, text_elements);
            let split_got = by_entry(set, split.expected_elements(set));
            for (what, got) in [("text", &text_got), ("split", &split_got)] {
                if *got == want {
                    continue;
                }
                let differing: Vec<&nft::element::Tuple> = got
                    .iter()
                    .filter(|(k, v)| want.get(*k) != Some(*v))
                    .chain(want.iter().filter(|(k, v)| got.get(*k) != Some(*v)))
                    .map(|(k, _)| k)
                    .collect();
                let note = if differing.iter().all(|k| contested.contains(&vip_key(k))) {
                    format!(" ({CONTESTED})")
                } else {
                    String::new()
                };
                let show = |a: &Entries, b: &Entries| -> Vec<String> {
                    a.iter()
                        .filter(|(k, v)| b.get(*k) != Some(*v))
                        .take(3)
                        .map(|(k, v)| {
                            let values: Vec<String> = v
                                .iter()
                                .map(|v| v.as_ref().map(ToString::to_string).unwrap_or_default())
                                .collect();
                            format!("{k} : {}", values.join(", "))
                        })
                        .collect()
                };
                report.violation(
                    Check::Diverged,
                    i,
                    &format!(
                        "nft {family:?} {what} planner, {}: only partial {:?}, only full {:?}{note}",
                        set.name(),
                        show(got, &want),
                        show(&want, got),
                    ),
                );
                ok = false;
            }
            // The tracer replayed what the text planner sent: it holds what that planner
            // records (the kernel's own affinity entries aside).
            let traced = p.nft_tracer.element_count(family, &set.name());
            if !set.is_dynamic() && traced != text_len {
                report.violation(
                    Check::Diverged,
                    i,
                    &format!(
                        "nft {family:?} tracer holds {traced} elements in {}, the planner {}",
                        set.name(),
                        text_len
                    ),
                );
                ok = false;
            }
        }
    }
    for planner in &p.ipt {
        let family = planner.config().family;
        let mut fresh = ipt::Planner::new(planner.config().clone());
        fresh.full(state, &node);
        let want = fresh.expected(state);
        if planner.expected(state) != want {
            report.violation(
                Check::Diverged,
                i,
                &format!("iptables {family:?}: planner record differs from a full plan"),
            );
            ok = false;
        }
        for ((table, chain), rules) in &want {
            if p.ipt_tracer.chain(family, *table, chain) != Some(rules.as_slice()) {
                report.violation(
                    Check::Diverged,
                    i,
                    &format!(
                        "iptables {family:?} {} {chain}: tracer differs",
                        table.as_str()
                    ),
                );
                ok = false;
                break;
            }
        }
    }
    ok
}

thread_local! {
    /// Whether a panic on this thread is expected and caught by [`guard`].
    static GUARDED: Cell<bool> = const { Cell::new(false) };
    /// The message and place of the last caught panic.
    static LAST_PANIC: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Installs (once per process) a panic hook that stays quiet for panics [`guard`] catches,
/// remembering their message and location instead, and hands every other panic to the hook
/// that was there before (so tests still print theirs).
fn install_quiet_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if GUARDED.with(Cell::get) {
                LAST_PANIC.with(|l| *l.borrow_mut() = info.to_string());
            } else {
                previous(info);
            }
        }));
    });
}

/// Runs `f`, turning a panic into `Err` with its message and location.
fn guard<T>(f: impl FnOnce() -> T + panic::UnwindSafe) -> Result<T, String> {
    GUARDED.with(|g| g.set(true));
    let r = panic::catch_unwind(f);
    GUARDED.with(|g| g.set(false));
    r.map_err(|_| LAST_PANIC.with(|l| l.borrow().clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_checks_catch_the_marker_and_control_characters() {
        let mut report = Report::default();
        assert!(check_text(
            "t",
            "add rule ip kube-proxy x\nCOMMIT\n",
            0,
            &mut report
        ));
        assert!(!check_text(
            "t",
            &format!("ok\n-A X {}\n", hostile::MARKER),
            0,
            &mut report
        ));
        assert!(!check_text("t", "ok\r\nCOMMIT\n", 0, &mut report));
        assert!(!check_text("t", "a\u{1b}[2J\n", 0, &mut report));
        assert_eq!(report.counts.get(&Check::Smuggled), Some(&1));
        assert_eq!(report.counts.get(&Check::ControlInRules), Some(&2));
    }

    #[test]
    fn endpoint_slots_compare_by_entry_and_contested_keys_are_found() {
        use nft::element::{Atom, Tuple};
        let ip = |s: &str| Atom::Ip(s.parse().unwrap());
        let entry = |slot| {
            Tuple::new(vec![
                ip("10.96.0.1"),
                Atom::Proto(Protocol::Tcp),
                Atom::Port(80),
                Atom::Slot(slot),
            ])
        };
        let ep = |s: &str| Some(Tuple::new(vec![ip(s), Atom::Port(8080)]));
        let set = nft::SetId::ClassEndpoints(nft::Route::Vips, 2);
        let a = BTreeMap::from([(entry(0), ep("10.0.0.1")), (entry(1), ep("10.0.0.2"))]);
        let b = BTreeMap::from([(entry(0), ep("10.0.0.2")), (entry(1), ep("10.0.0.1"))]);
        assert_ne!(a, b);
        assert_eq!(by_entry(set, a.clone()), by_entry(set, b));
        let key = vip_key(&entry(0));
        assert_eq!(key.2, Some(80));

        let mut state = ProxyState::new("node-a");
        for name in ["a", "b"] {
            let svc: Service = serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"clusterIP": if name == "a" { "10.96.0.1" } else { "10.96.0.2" },
                         "externalIPs": ["10.96.0.1"], "ports": [{"port": 80}]},
            }))
            .unwrap();
            state
                .apply(SourceEvent::Upsert(Object::Service(Box::new(svc))))
                .unwrap();
        }
        assert_eq!(contested_keys(&state, IpFamily::V4), HashSet::from([key]));
    }
}
