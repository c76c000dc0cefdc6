//! `kube-proxy status`: what the running proxy and the kernel say, and whether the kernel holds
//! what the proxy would program.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::IpAddr;

use kp_core::flow::{Origin, Packet};
use kp_core::model::IpFamily;
use kp_core::track::ProxyState;
use kp_iptables_plan::Table;
use kp_proxy::config::{Config, ProxyMode};
use serde_json::{json, Value};

use super::explain;
use super::live::{self, Live};
use super::snapshot;

/// One HTTP endpoint of the running proxy, as asked.
pub struct Probe {
    /// The URL asked.
    pub url: String,
    /// The status code, or why there was none.
    pub answer: Result<u16, String>,
    /// The body.
    pub body: String,
}

fn probe(addr: std::net::SocketAddr, path: &str) -> Probe {
    let a = live::reachable(addr);
    let url = match a {
        std::net::SocketAddr::V4(v) => format!("http://{v}{path}"),
        std::net::SocketAddr::V6(v) => format!("http://[{}]:{}{path}", v.ip(), v.port()),
    };
    match live::http_get(addr, path) {
        Ok((code, body)) => Probe {
            url,
            answer: Ok(code),
            body,
        },
        Err(e) => Probe {
            url,
            answer: Err(e),
            body: String::new(),
        },
    }
}

/// What the kernel holds, counted.
pub fn counts(live: &Live) -> Value {
    match live {
        Live::Nftables { tracer, .. } => {
            let mut frontends = BTreeSet::new();
            let mut endpoints = BTreeSet::new();
            let mut no_endpoints = BTreeSet::new();
            for f in IpFamily::ALL {
                for name in tracer.set_names(f) {
                    let Some(els) = tracer.elements(f, &name) else {
                        continue;
                    };
                    let frontend_set = name.starts_with("vips-")
                        || name.starts_with("nodeports-")
                        || name.starts_with("local-source-")
                        || (name.starts_with("affinity-")
                            && (name.ends_with("-vips") || name.ends_with("-nodeports")));
                    if name.ends_with("-endpoints") {
                        for v in els.values().flatten() {
                            endpoints.insert(format!("{v:?}"));
                        }
                    } else if name.starts_with("no-endpoint-") {
                        for k in els.keys() {
                            no_endpoints.insert(format!("{k:?}"));
                        }
                    } else if frontend_set {
                        for k in els.keys() {
                            frontends.insert(format!("{k:?}"));
                        }
                    }
                }
            }
            json!({
                "frontendsWithEndpoints": frontends.len(),
                "frontendsWithoutEndpoints": no_endpoints.len(),
                "endpoints": endpoints.len(),
            })
        }
        Live::Iptables {
            tracer,
            foreign_rules,
            backend,
        } => {
            let mut svc = 0;
            let mut sep = 0;
            let mut ext = 0;
            for f in IpFamily::ALL {
                for c in tracer.chain_names(f, Table::Nat) {
                    if c.starts_with("KUBE-SVC-") || c.starts_with("KUBE-SVL-") {
                        svc += 1;
                    } else if c.starts_with("KUBE-SEP-") {
                        sep += 1;
                    } else if c.starts_with("KUBE-EXT-") || c.starts_with("KUBE-FW-") {
                        ext += 1;
                    }
                }
            }
            json!({
                "servicePortChains": svc,
                "externalChains": ext,
                "endpointChains": sep,
                "otherProgramsRules": foreign_rules,
                "iptablesBackend": backend.as_str(),
            })
        }
        Live::Ipvs {
            tracer,
            foreign_rules,
            backend,
        } => {
            let vs = tracer.node().virtual_servers();
            let reals = |d: &[kp_ipvs_test::Destination]| d.iter().filter(|d| d.weight > 0).count();
            let entries: usize = tracer
                .node()
                .sets()
                .iter()
                .flat_map(|s| kp_ipvs_plan::ipset::SetName::ALL.map(|n| s.get(n).len()))
                .sum();
            json!({
                "virtualServersWithRealServers": vs.values().filter(|(_, d)| reals(d) > 0).count(),
                "virtualServersWithoutRealServers": vs.values().filter(|(_, d)| reals(d) == 0).count(),
                "realServers": vs.values().map(|(_, d)| d.len()).sum::<usize>(),
                "ipsetEntries": entries,
                "otherProgramsRules": foreign_rules,
                "iptablesBackend": backend.as_str(),
            })
        }
        Live::Userspace {
            tracer,
            ports,
            listening,
            ..
        } => {
            let count = |prefix: &str| {
                tracer
                    .set_names()
                    .iter()
                    .filter(|n| n.starts_with(prefix))
                    .filter_map(|n| tracer.elements(n))
                    .map(|e| e.len())
                    .sum::<usize>()
            };
            json!({
                "redirectedFrontends": count("redirect-"),
                "rejectedFrontends": count("no-endpoint"),
                "proxyPorts": ports,
                "proxyListening": listening,
            })
        }
        Live::Ebpf {
            tracer,
            pin_dir,
            hooks,
            tc_links,
        } => {
            let maps = tracer.maps();
            let heads = || maps.services.iter().filter(|(k, _)| k.slot == 0);
            json!({
                "frontendsWithEndpoints": heads().filter(|(_, v)| v.count > 0).count(),
                "frontendsWithoutEndpoints": heads().filter(|(_, v)| v.count == 0).count(),
                "endpoints": maps.backends.len(),
                "addressEntries": maps.addrs.len(),
                "pinDir": pin_dir.display().to_string(),
                "socketHooksPinned": hooks.len(),
                "tcLinksPinned": tc_links,
            })
        }
    }
}

/// The drift check: the kernel against the plan for `state`, one line per difference.
pub fn drift(
    cfg: &Config,
    live: &Live,
    state: &ProxyState,
    local: &[IpAddr],
) -> Result<Vec<String>, String> {
    match live {
        Live::Nftables { tracer, .. } => {
            let planned = snapshot::plan_nftables(cfg, state, local.to_vec())?;
            Ok(IpFamily::ALL
                .into_iter()
                .flat_map(|f| tracer.differences(&planned, f))
                .collect())
        }
        Live::Iptables { tracer, .. } => {
            let planned = snapshot::plan_iptables(cfg, state, local.to_vec())?;
            Ok(IpFamily::ALL
                .into_iter()
                .flat_map(|f| tracer.differences(&planned, f))
                .collect())
        }
        Live::Ipvs { tracer, .. } => {
            let (planner, planned) = snapshot::plan_ipvs(cfg, state, local)?;
            Ok(ipvs_differences(tracer, &planned, &planner))
        }
        Live::Userspace { ports, .. } => {
            // The plan for the port the table redirects to (the running proxy's, a free one
            // it took at start), as the mode's own verify compares it. With detect-local by
            // interface the table redirects to the pod port too, the proxy port's sibling
            // above it, which the plan for the proxy port holds: the lowest is the proxy's.
            let Some(port) = ports.first() else {
                return Ok(vec![format!(
                    "table inet {}: no rule redirects to a proxy port (the table is missing or \
                     empty)",
                    kp_userspace_plan::names::TABLE
                )]);
            };
            snapshot::userspace_differences(cfg, state, *port)
        }
        Live::Ebpf { tracer, hooks, .. } => {
            let planned = snapshot::plan_ebpf(cfg, state, local.to_vec())?;
            let mut out = tracer.differences(&planned);
            // Pinned with every start, so they hold while no proxy runs: one gone is a hook
            // nothing translates at.
            out.extend(
                kp_ebpf::SOCK_PROGRAMS
                    .into_iter()
                    .filter(|p| !hooks.contains(p))
                    .map(|p| {
                        format!(
                            "link {} is not pinned: {p} is not attached",
                            kp_ebpf::names::link(p)
                        )
                    }),
            );
            // The table that keeps netfilter's NAT hooks on, as the dataplane's verify checks.
            let hooks_table = kp_ebpf::nat_hooks::NatHooks::new(None)
                .check()
                .map_err(|e| format!("reading table inet {}: {e}", kp_ebpf::nat_hooks::TABLE))?;
            out.extend(hooks_table);
            Ok(out)
        }
    }
}

/// Where the ipvs mode's live state differs from the plan: virtual servers and their real
/// servers (draining ones, weight 0, are the mode's and not counted), the addresses bound to
/// `kube-ipvs0`, the ipsets' entries and the chains.
fn ipvs_differences(
    live: &kp_ipvs_test::IpvsTracer,
    planned: &kp_ipvs_test::IpvsTracer,
    planner: &kp_ipvs_plan::planner::Planner,
) -> Vec<String> {
    use kp_ipvs_plan::addresses::DUMMY_INTERFACE;
    let mut out = Vec::new();
    let (kernel, plan) = (
        live.node().virtual_servers(),
        planned.node().virtual_servers(),
    );
    let serving = |d: &[kp_ipvs_test::Destination]| -> BTreeSet<String> {
        d.iter()
            .filter(|d| d.weight > 0)
            .map(|d| {
                format!(
                    "{} weight {}",
                    std::net::SocketAddr::new(d.addr, d.port),
                    d.weight
                )
            })
            .collect()
    };
    for key in kernel.keys().chain(plan.keys()).collect::<BTreeSet<_>>() {
        match (kernel.get(key), plan.get(key)) {
            (Some(_), None) => out.push(format!(
                "ipvs: virtual server {key} is in the kernel but not planned"
            )),
            (None, Some(_)) => out.push(format!(
                "ipvs: virtual server {key} is missing from the kernel"
            )),
            (Some((ks, kd)), Some((ps, pd))) => {
                if ks != ps {
                    out.push(format!(
                        "ipvs: virtual server {key}: the kernel has {ks:?}, the plan {ps:?}"
                    ));
                }
                let (kd, pd) = (serving(kd), serving(pd));
                for d in kd.difference(&pd) {
                    out.push(format!(
                        "ipvs: {key}: real server {d} is in the kernel but not planned"
                    ));
                }
                for d in pd.difference(&kd) {
                    out.push(format!(
                        "ipvs: {key}: real server {d} is missing from the kernel"
                    ));
                }
            }
            (None, None) => {}
        }
    }
    let bound: BTreeSet<IpAddr> = match kp_ipvs::link::Dummy::find(None, DUMMY_INTERFACE) {
        Ok(Some(mut d)) => d.addresses().unwrap_or_default(),
        _ => BTreeSet::new(),
    };
    let a = kp_ipvs_plan::addresses::diff(planner.bind_addresses(), &bound);
    out.extend(
        a.bind
            .iter()
            .map(|ip| format!("{DUMMY_INTERFACE}: {ip} is missing")),
    );
    out.extend(
        a.unbind
            .iter()
            .map(|ip| format!("{DUMMY_INTERFACE}: {ip} is bound but not planned")),
    );
    for (want, have) in planned.node().sets().iter().zip(live.node().sets()) {
        for c in kp_ipvs_plan::ipset::diff(want, have) {
            out.push(format!("ipset: the kernel needs {c:?}"));
        }
    }
    let ours = |c: &str| {
        kp_iptables_test::save::is_kube_chain(c) || kp_ipvs_plan::rules::is_owned_chain(c)
    };
    for f in IpFamily::ALL {
        out.extend(live.iptables().differences_of(planned.iptables(), f, &ours));
    }
    out
}

/// Every frontend of the Services in `state` (those of `only`, if given), traced from this node
/// through the live rules.
pub fn services(
    live: &Live,
    state: &ProxyState,
    local: &[IpAddr],
    only: Option<&str>,
) -> Vec<Value> {
    let mut out = Vec::new();
    let mut keys: Vec<_> = state.service_keys().cloned().collect();
    keys.sort();
    for key in keys {
        if only.is_some_and(|o| o != key.to_string()) {
            continue;
        }
        for st in state.service_state(&key) {
            let sp = &st.port;
            let mut frontends: Vec<(String, IpAddr, u16)> = Vec::new();
            for ip in &sp.cluster_ips {
                frontends.push(("ClusterIP".into(), *ip, sp.port));
            }
            for ip in &sp.external_ips {
                frontends.push(("external IP".into(), *ip, sp.port));
            }
            for ip in &sp.load_balancer_ips {
                frontends.push(("LoadBalancer IP".into(), *ip, sp.port));
            }
            if let Some(np) = sp.node_port {
                for ip in state.node().addresses.iter().take(2) {
                    frontends.push(("NodePort".into(), *ip, np));
                }
            }
            let traced: Vec<Value> = frontends
                .iter()
                .map(|(kind, ip, port)| {
                    let p = Packet {
                        origin: Origin::Node,
                        src: explain::node_source(*ip, local),
                        protocol: sp.name.protocol,
                        dst: *ip,
                        dport: *port,
                    };
                    let a = explain::trace(live, &p, None);
                    let mut v = explain::to_json(&a);
                    v["frontend"] = json!(kind);
                    v
                })
                .collect();
            out.push(json!({
                "service": sp.name.to_string(),
                "protocol": sp.name.protocol.as_lower(),
                "internalTrafficPolicy": if sp.internal_traffic_local { "Local" } else { "Cluster" },
                "externalTrafficPolicy": if sp.external_traffic_local { "Local" } else { "Cluster" },
                "sessionAffinitySeconds": sp.session_affinity_timeout,
                "endpointsInObjects": state.endpoints(&sp.name).iter().filter(|e| e.ready).count(),
                "frontends": traced,
            }));
        }
    }
    out
}

/// Everything `status` reports.
pub struct Report {
    /// As JSON.
    pub json: Value,
    /// Whether the kernel differs from the plan (`None`: not checked).
    pub drift: Option<bool>,
}

/// Builds the report. `forced` is `--mode`.
pub fn report(cfg: &Config, forced: Option<ProxyMode>, only: Option<&str>) -> Report {
    let health = cfg
        .healthz_bind_address
        .map(|a| (probe(a, "/healthz"), probe(a, "/livez")));
    let running = cfg
        .metrics_bind_address
        .map(|a| probe(a, "/proxyMode"))
        .filter(|p| p.answer == Ok(200))
        .map(|p| p.body.trim().to_string());
    let in_kernel = live::detect_mode(cfg);
    let mode = forced
        .or_else(|| {
            running
                .as_deref()
                .and_then(|r| ProxyMode::ALL.into_iter().find(|m| m.as_str() == r))
        })
        .or(in_kernel);
    let mut j = json!({
        "mode": mode.map(ProxyMode::as_str),
        "runningProxyMode": running,
        "kernelRulesOf": in_kernel.map(ProxyMode::as_str),
    });
    if let Some((h, l)) = &health {
        let body: Value = serde_json::from_str(&h.body).unwrap_or(Value::Null);
        j["health"] = json!({
            "healthz": {"url": h.url, "status": h.answer.as_ref().ok(), "error": h.answer.as_ref().err(), "body": body},
            "livez": {"url": l.url, "status": l.answer.as_ref().ok(), "error": l.answer.as_ref().err()},
            "lastUpdated": body.get("lastUpdated").cloned(),
        });
    }
    let mut drift_flag = None;
    let Some(mode) = mode else {
        j["error"] =
            json!("no kube-proxy rules in the kernel and no running proxy answering /proxyMode");
        return Report {
            json: j,
            drift: None,
        };
    };
    let local = live::local_addresses();
    let mut live = match live::read(mode, cfg, local.clone()) {
        Ok(l) => l,
        Err(e) => {
            j["error"] = json!(format!("reading the {mode} rules: {e}"));
            return Report {
                json: j,
                drift: None,
            };
        }
    };
    j["programmed"] = counts(&live);
    let state = if has_source(cfg) {
        match snapshot::load(cfg) {
            Ok(s) => Some(s),
            Err(e) => {
                j["drift"] = json!({"checked": false, "why": e});
                None
            }
        }
    } else {
        j["drift"] = json!({"checked": false, "why": "no object source named: pass the proxy's own flags (--config, --kubeconfig/--master or --manifests) after the status arguments"});
        None
    };
    if let Some(state) = &state {
        live.with_objects(cfg, state);
        match drift(cfg, &live, state, &local) {
            Ok(d) => {
                drift_flag = Some(!d.is_empty());
                j["drift"] = json!({
                    "checked": true,
                    "against": snapshot::source_name(cfg),
                    "matches": d.is_empty(),
                    "differences": d,
                });
            }
            Err(e) => j["drift"] = json!({"checked": false, "why": e}),
        }
        j["services"] = Value::Array(services(&live, state, &local, only));
    }
    Report {
        json: j,
        drift: drift_flag,
    }
}

/// Whether the configuration names where the objects come from.
pub fn has_source(cfg: &Config) -> bool {
    cfg.manifests_dir.is_some() || cfg.kubeconfig.is_some() || cfg.master.is_some()
}

/// The report for an operator.
pub fn to_text(j: &Value) -> String {
    let mut s = String::new();
    let str_of = |v: &Value| v.as_str().map(str::to_string);
    let _ = writeln!(
        s,
        "mode:        {} (running proxy: {}; kernel holds rules of: {})",
        str_of(&j["mode"]).unwrap_or_else(|| "unknown".into()),
        str_of(&j["runningProxyMode"]).unwrap_or_else(|| "not answering".into()),
        str_of(&j["kernelRulesOf"]).unwrap_or_else(|| "no mode".into()),
    );
    if let Some(h) = j.get("health") {
        let status = |v: &Value| match (v["status"].as_u64(), v["error"].as_str()) {
            (Some(c), _) => format!("{c}"),
            (None, Some(e)) => format!("no answer ({e})"),
            _ => "no answer".into(),
        };
        let _ = writeln!(
            s,
            "health:      /healthz {} at {}, /livez {}",
            status(&h["healthz"]),
            h["healthz"]["url"].as_str().unwrap_or(""),
            status(&h["livez"])
        );
        if let Some(t) = h["lastUpdated"].as_str() {
            let _ = writeln!(s, "last sync:   {t}");
        }
    }
    if let Some(e) = j["error"].as_str() {
        let _ = writeln!(s, "error:       {e}");
    }
    if let Some(p) = j.get("programmed").and_then(Value::as_object) {
        let parts: Vec<String> = p.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let _ = writeln!(s, "programmed:  {}", parts.join(", "));
    }
    if let Some(d) = j.get("drift") {
        if d["checked"].as_bool() == Some(true) {
            let diffs = d["differences"].as_array().cloned().unwrap_or_default();
            if diffs.is_empty() {
                let _ = writeln!(
                    s,
                    "drift:       none: the kernel holds what the proxy would program from {}",
                    d["against"].as_str().unwrap_or("")
                );
            } else {
                let _ = writeln!(
                    s,
                    "drift:       {} difference(s) from the plan:",
                    diffs.len()
                );
                for x in diffs {
                    let _ = writeln!(s, "  {}", x.as_str().unwrap_or(""));
                }
            }
        } else {
            let _ = writeln!(
                s,
                "drift:       not checked: {}",
                d["why"].as_str().unwrap_or("")
            );
        }
    }
    if let Some(svcs) = j.get("services").and_then(Value::as_array) {
        let _ = writeln!(
            s,
            "services (traced from this node through the live rules):"
        );
        for sv in svcs {
            let _ = writeln!(
                s,
                "  {} {} (internal {}, external {}{})",
                sv["service"].as_str().unwrap_or(""),
                sv["protocol"].as_str().unwrap_or(""),
                sv["internalTrafficPolicy"].as_str().unwrap_or(""),
                sv["externalTrafficPolicy"].as_str().unwrap_or(""),
                sv["sessionAffinitySeconds"]
                    .as_u64()
                    .map(|t| format!(", ClientIP affinity {t}s"))
                    .unwrap_or_default(),
            );
            for f in sv["frontends"].as_array().into_iter().flatten() {
                let eps: Vec<String> = f["endpoints"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|e| {
                        format!(
                            "{}:{} {:.0}%",
                            e["ip"].as_str().unwrap_or(""),
                            e["port"],
                            e["probability"].as_f64().unwrap_or(0.0) * 100.0
                        )
                    })
                    .collect();
                let what = match f["verdict"].as_str() {
                    Some("dnat") => format!(
                        "-> {}{}",
                        eps.join(", "),
                        if f["masquerade"].as_bool() == Some(true) {
                            " (masqueraded)"
                        } else {
                            ""
                        }
                    ),
                    Some(v) => format!(
                        "{v}{}",
                        f["reason"]
                            .as_str()
                            .map(|r| format!(": {r}"))
                            .unwrap_or_default()
                    ),
                    None => format!("unknown: {}", f["error"].as_str().unwrap_or("")),
                };
                let _ = writeln!(
                    s,
                    "    {:<16} {}:{} {what}",
                    f["frontend"].as_str().unwrap_or(""),
                    f["packet"]["to"].as_str().unwrap_or(""),
                    f["packet"]["port"],
                );
            }
        }
    }
    s
}
