//! What the proxy would program: the cluster's objects, read once from the configured source
//! (the manifest directory, or the API server), and the mode's planner's full plan for them,
//! replayed into the same tracer the live rules are read into, so the two compare.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kp_core::model::IpFamily;
use kp_core::node::{DetectLocal, NodeContext, NodePortAddresses};
use kp_core::track::{Kind, ProxyState, SourceEvent};
use kp_ebpf_test::EbpfTracer;
use kp_iptables_test::IptablesTracer;
use kp_ipvs_test::IpvsTracer;
use kp_metrics::Metrics;
use kp_nftables_test::NftTracer;
use kp_proxy::config::Config;
use tokio::sync::mpsc;

/// How long the objects may take to arrive.
const LOAD_TIMEOUT: Duration = Duration::from_secs(30);
/// How long to wait for ServiceCIDRs once everything else is listed (an API server that does
/// not serve them answers at once; the source then reports them listed, empty).
const SERVICE_CIDR_GRACE: Duration = Duration::from_secs(3);

/// The Node name, as the proxy finds it: `--hostname-override`, else the host name.
pub fn node_name(cfg: &Config) -> String {
    if let Some(h) = &cfg.hostname {
        return h.clone();
    }
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_lowercase())
        .unwrap_or_default()
}

/// Where the objects come from, for messages.
pub fn source_name(cfg: &Config) -> String {
    match &cfg.manifests_dir {
        Some(d) => format!("the manifests in {}", d.display()),
        None => "the API server".into(),
    }
}

/// Lists the objects once from the configured source.
pub fn load(cfg: &Config) -> Result<ProxyState, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    rt.block_on(load_async(cfg))
}

async fn load_async(cfg: &Config) -> Result<ProxyState, String> {
    let node = node_name(cfg);
    let metrics = Arc::new(Metrics::new());
    let (tx, mut rx) = mpsc::channel::<SourceEvent>(4096);
    let api = cfg.manifests_dir.is_none();
    let task = match &cfg.manifests_dir {
        Some(dir) => {
            let dir = dir.clone();
            tokio::spawn(async move {
                if let Err(e) = kp_source::run_manifests(dir, tx, metrics).await {
                    eprintln!("kube-proxy: the manifest source stopped: {e}");
                }
            })
        }
        None => {
            let client = kp_source::client_from(cfg.kubeconfig.as_deref(), cfg.master.as_deref())
                .await
                .map_err(|e| format!("cannot build a Kubernetes client: {e}"))?;
            tokio::spawn(kp_source::run_kubernetes(client, node.clone(), tx, metrics))
        }
    };
    let mut state = ProxyState::new(node);
    state.set_configured_service_cidrs(cfg.service_cidrs.clone());
    let start = Instant::now();
    let mut ready_at: Option<Instant> = None;
    loop {
        if state.ready_to_program() {
            let at = *ready_at.get_or_insert_with(Instant::now);
            if !api || state.synced(Kind::ServiceCidr) || at.elapsed() >= SERVICE_CIDR_GRACE {
                break;
            }
        }
        let left = if ready_at.is_some() {
            SERVICE_CIDR_GRACE.saturating_sub(ready_at.map_or(Duration::ZERO, |a| a.elapsed()))
        } else {
            LOAD_TIMEOUT.saturating_sub(start.elapsed())
        };
        match tokio::time::timeout(left, rx.recv()).await {
            Ok(Some(ev)) => {
                // A bad object is skipped, as the proxy skips it.
                let _ = state.apply(ev);
            }
            Ok(None) => break,
            Err(_) if ready_at.is_some() => break,
            Err(_) => {
                task.abort();
                return Err(format!(
                    "{} did not list Services, EndpointSlices and the Node within {}s",
                    source_name(cfg),
                    LOAD_TIMEOUT.as_secs()
                ));
            }
        }
    }
    task.abort();
    if !state.ready_to_program() {
        return Err(format!(
            "{} stopped before listing everything",
            source_name(cfg)
        ));
    }
    Ok(state)
}

/// The nftables planner's full plan for `state`, replayed into a tracer.
pub fn plan_nftables(
    cfg: &Config,
    state: &ProxyState,
    local: Vec<IpAddr>,
) -> Result<NftTracer, String> {
    let nc = kp_proxy::modes::nftables_config(cfg).map_err(|e| e.to_string())?;
    let node = NodeContext::resolve(&nc.detect_local, &nc.node_ports, state);
    // The links as this machine routes sources, for detect-local by interface.
    let mut tracer = NftTracer::new(local).with_ingress(super::live::node_links());
    for f in &nc.families {
        let mut p = kp_nftables_plan::Planner::new(kp_nftables_plan::PlanConfig {
            family: *f,
            masquerade_mark: 1 << nc.masquerade_bit,
            masquerade_all: nc.masquerade_all,
            detect_local: nc.detect_local != DetectLocal::None,
            local_interface: nc.detect_local.interface(),
            node_ports_restricted: nc.node_ports != NodePortAddresses::AllLocal,
        });
        let tx = p.full(state, &node);
        tracer
            .apply(&tx.text)
            .map_err(|e| format!("replaying the {f:?} plan: {e}"))?;
    }
    Ok(tracer)
}

/// The iptables planner's full plan for `state` (its chains and the jumps into them),
/// replayed into a tracer.
pub fn plan_iptables(
    cfg: &Config,
    state: &ProxyState,
    local: Vec<IpAddr>,
) -> Result<IptablesTracer, String> {
    let ic = kp_proxy::modes::iptables_config(cfg, None).map_err(|e| e.to_string())?;
    let localhost = ic.localhost_node_ports_effective();
    let node = NodeContext::resolve(&ic.detect_local, &ic.node_ports, state);
    // The links as this machine routes sources, for detect-local by interface.
    let mut tracer = IptablesTracer::new(local).with_ingress(super::live::node_links());
    for f in &ic.families {
        let mut pc = kp_iptables_plan::PlanConfig::new(*f);
        pc.masquerade_bit = ic.masquerade_bit;
        pc.masquerade_all = ic.masquerade_all;
        pc.localhost_node_ports = localhost && *f == IpFamily::V4;
        let mut p = kp_iptables_plan::Planner::new(pc);
        let restore = p.full(state, &node);
        tracer
            .apply(*f, &restore.text())
            .map_err(|e| format!("replaying the {f:?} plan: {e}"))?;
        // The jumps into the planner's chains, and the canary the dataplane keeps beside them.
        let mut jumps = String::new();
        for table in ["filter", "nat"] {
            jumps.push_str(&format!("*{table}\n"));
            if kp_iptables::CANARY_TABLES.contains(&table) {
                jumps.push_str(&format!(":{} - [0:0]\n", kp_iptables::CANARY_CHAIN));
            }
            for j in p.jump_rules().iter().filter(|j| j.table == table) {
                jumps.push_str(&format!("-A {} {}\n", j.chain, j.args));
            }
            jumps.push_str("COMMIT\n");
        }
        tracer
            .apply(*f, &jumps)
            .map_err(|e| format!("replaying the {f:?} jumps: {e}"))?;
    }
    Ok(tracer)
}

/// The ebpf planner's full plan for `state` (what a full sync makes the maps hold, with the
/// configured scheduler's Maglev tables), in a tracer over the node's addresses `local`. NodePorts go on the addresses the dataplane finds
/// (`kp_ebpf::local`), as its syncs do.
pub fn plan_ebpf(
    cfg: &Config,
    state: &ProxyState,
    local: Vec<IpAddr>,
) -> Result<EbpfTracer, String> {
    let node_ports = kp_proxy::modes::node_port_addresses(cfg);
    let interfaces = match node_ports {
        NodePortAddresses::Primary => Vec::new(),
        _ => kp_ebpf::local::local_addresses()
            .map_err(|e| format!("reading the node's addresses: {e}"))?,
    };
    // The scheduler decides whether frontends have Maglev tables (`sh`, `mh`), as in the
    // running proxy's plan.
    let scheduler = kp_proxy::modes::ebpf_scheduler(cfg).map_err(|e| e.to_string())?;
    // Endpoints the mode before a switch still answers for are left out of the socket hooks'
    // picks, as the running proxy reads them.
    let ctx = kp_proxy::modes::ModeContext::new(cfg, Arc::new(Metrics::new()));
    let held = kp_proxy::modes::held_backends(&ctx, Some(kp_proxy::config::ProxyMode::Ebpf))
        .map_err(|(mode, e)| format!("reading what the {mode} mode's leftovers answer for: {e}"))?
        .into_iter()
        .map(kp_ebpf_plan::Backend::from)
        .collect();
    let planner = kp_ebpf_plan::plan_state_with(state, &node_ports, &interfaces, scheduler, &held)
        .map_err(|e| format!("planning the maps: {e}"))?;
    Ok(EbpfTracer::new(planner.contents(), local))
}

/// Where the kernel's `inet kube-proxy-userspace` table differs from the redirect planner's
/// full plan for `state` with proxy port `port`: the comparison the mode's own verify makes
/// (`kp_nftables::compare` over the table's JSON listing, rule by rule and element by element).
pub fn userspace_differences(
    cfg: &Config,
    state: &ProxyState,
    port: u16,
) -> Result<Vec<String>, String> {
    use kp_userspace_plan::names::{FAMILY, TABLE};
    let uc = kp_proxy::modes::userspace_config(cfg).map_err(|e| e.to_string())?;
    let node = NodeContext::resolve(&uc.balancer.detect_local, &uc.node_ports, state);
    let mut planner = kp_userspace_plan::RedirectPlanner::new(kp_userspace_plan::RedirectConfig {
        proxy_port: port,
        transparent_mark: uc.routing.mark,
        node_ports_restricted: uc.node_ports != NodePortAddresses::AllLocal,
    });
    planner.full(state, &node);
    let nft = kp_nftables::NftCommand::new();
    let json = match nft.json(&["list", "table", FAMILY, TABLE]) {
        Ok(j) => j,
        Err(kp_nftables::Error::List { .. }) => {
            return Ok(vec![format!("{FAMILY}: table {TABLE} is missing")])
        }
        Err(e) => return Err(format!("nft -j list table {FAMILY} {TABLE}: {e}")),
    };
    let kernel = kp_nftables::parse_table_named(&json, TABLE)
        .map_err(|e| format!("reading table {FAMILY} {TABLE}: {e}"))?;
    Ok(kp_nftables::compare(
        FAMILY,
        &planner.expected_chains(),
        &planner.expected_sets(),
        &kernel,
    ))
}

/// The ipvs planner's full plan for `state` (what a full sync programs: chains, sets, virtual
/// servers and the addresses bound to `kube-ipvs0`), in a tracer over the node's addresses
/// `local`. NodePorts go on the addresses the dataplane finds (every interface's but
/// `kube-ipvs0`'s, loopback and IPv6 link-local, filtered by `nodePortAddresses`), as its syncs
/// do.
pub fn plan_ipvs(
    cfg: &Config,
    state: &ProxyState,
    local: &[IpAddr],
) -> Result<(kp_ipvs_plan::planner::Planner, IpvsTracer), String> {
    use kp_ipvs_plan::addresses::DUMMY_INTERFACE;
    let settings = kp_proxy::modes::ipvs_settings(cfg, None).map_err(|e| e.to_string())?;
    let resolve = settings
        .resolve
        .as_ref()
        .ok_or("the ipvs settings resolve the node at each sync")?;
    let node = NodeContext::resolve(&resolve.detect_local, &resolve.node_ports, state);
    let interfaces = match kp_ipvs::link::Dummy::find(None, DUMMY_INTERFACE) {
        Ok(Some(mut dummy)) => dummy
            .node_addresses()
            .map_err(|e| format!("reading the node's addresses: {e}"))?,
        // No kube-ipvs0: every address is an interface's.
        Ok(None) => local
            .iter()
            .copied()
            .filter(|ip| match ip {
                IpAddr::V4(a) => !a.is_loopback(),
                IpAddr::V6(a) => !a.is_loopback() && (a.segments()[0] & 0xffc0) != 0xfe80,
            })
            .collect(),
        Err(e) => return Err(format!("reading {DUMMY_INTERFACE}: {e}")),
    };
    let node_ports =
        kp_ipvs::dataplane::node_port_addresses(&resolve.node_ports, &node, &interfaces);
    let mut planner = kp_ipvs_plan::planner::Planner::new(&settings.families);
    let mut delta = planner.untracked();
    planner.set_all(
        state.service_keys().map(|k| (k, state.service_state(k))),
        &node_ports,
        &node,
        &settings.ipvs,
        &mut delta,
    );
    let config = |f| {
        let mut pc = kp_iptables_plan::PlanConfig::new(f);
        pc.masquerade_bit = settings.masquerade_bit;
        pc.masquerade_all = settings.masquerade_all;
        pc
    };
    let interfaces: Vec<IpAddr> = interfaces.into_iter().collect();
    let tracer = IpvsTracer::planned(
        &planner,
        &interfaces,
        config,
        &node,
        Some(super::live::node_links()),
    )
    .map_err(|e| format!("replaying the plan: {e}"))?;
    Ok((planner, tracer))
}
