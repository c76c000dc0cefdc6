//! `kube-proxy status` and `kube-proxy explain`: what the node's kernel does with Service
//! traffic, read from the live rules (not from the proxy's plan), whether or not the proxy is
//! running. Each mode's tracer (`kp-nftables-test`, `kp-iptables-test`, `kp-ebpf-test`,
//! `kp-userspace-test`) is fed the kernel's own state (`nft list table`, `iptables-save`, the
//! ebpf mode's maps opened through their pins); the planner's full plan for the objects the
//! proxy would read is what the live state is compared with.
//!
//! Covered: every mode. nftables, iptables, ipvs (its chains, ipsets, and IPVS's virtual
//! servers over netlink: `kp-ipvs-test`'s tracer), ebpf and userspace (its redirect table from
//! the kernel; where a redirected connection goes, from the balancer synced with the objects,
//! as the proxy's choice).

mod explain;
mod live;
mod snapshot;
mod status;

use std::ffi::OsString;
use std::net::IpAddr;
use std::process::ExitCode;

use kp_core::flow::{Origin, Packet};
use kp_proxy::config::{Config, ProxyMode};

use live::Live;

/// Whether `arg` names one of these subcommands.
pub fn is_subcommand(arg: &str) -> bool {
    matches!(arg, "status" | "explain")
}

const COVERAGE: &str = "\
Modes covered: nftables (reads `nft list table ip|ip6 kube-proxy`), iptables (reads
`iptables-save`/`ip6tables-save` of the backend the node uses, keeping the KUBE-* chains and
the jumps into them; other programs' rules are counted, not traced), ipvs (reads the same
chains and its own in mangle, `ipset save`, and IPVS's virtual servers and real servers over
netlink: a connection a virtual server takes goes to one of its real servers of weight above
zero, as likely as its weight says; one without any is answered with ICMP port unreachable),
ebpf (reads the maps
pinned in --bpf-pin-dir, default /sys/fs/bpf/kube-proxy-rs, without loading or attaching
anything: pass the proxy's --bpf-pin-dir; the node's and its pods' connections meet the socket
hooks, --origin external packets the tc path) and userspace (reads `nft list table inet
kube-proxy-userspace`; a redirected connection's endpoint is the running proxy's choice, so
explain lists the endpoints its balancer picks from only when the proxy flags name the object
source, and a redirect to a port nothing listens on is refused).";

const STATUS_HELP: &str = "\
kube-proxy status: what the running proxy and the kernel say.

Usage: kube-proxy status [-o text|json] [--mode MODE] [NAMESPACE/NAME] [PROXY FLAGS...]

Reports the active mode (the running proxy's /proxyMode, else the rules the kernel holds),
the proxy's /healthz and /livez answers on the configured addresses and its last sync, what
the kernel holds (frontends, endpoints), and, when the proxy's object source is named by the
flags that follow (--config, --kubeconfig, --master or --manifests, exactly as the proxy is
started), whether the kernel's rules equal what the proxy would program (drift), with every
Service port's frontends traced from this node through the live rules.

  -o, --output FORMAT   text (default) or json
      --mode MODE       read this mode's rules, whatever runs
  NAMESPACE/NAME        only this Service in the per-Service list
  PROXY FLAGS           the proxy's own flags (first one starting with --), as it runs

Exit status: 0, or 1 when drift was found, 64 on bad usage.
";

const EXPLAIN_HELP: &str = "\
kube-proxy explain: follow one packet through the live rules of the active mode.

Usage: kube-proxy explain [OPTIONS] PROTO DEST:PORT [PROXY FLAGS...]
       kube-proxy explain [OPTIONS] --to DEST:PORT/PROTO [PROXY FLAGS...]
       kube-proxy explain [OPTIONS] NAMESPACE/NAME[:PORT] [PROXY FLAGS...]

Says which Service and frontend the packet hits, which rules, set or map elements decided,
which endpoints it can reach (with probabilities), whether it is masqueraded, or why it is
dropped or rejected (no endpoints, a source outside loadBalancerSourceRanges, a Local
traffic policy with no local endpoint, an unknown port, an unallocated ClusterIP). Read from
the kernel's own listing, so it works whether or not the proxy runs. The Service form traces
each of the Service's frontends from this node and needs the object source (PROXY FLAGS).

      --from IP         the client's address (default: this node's own address)
      --origin WHERE    node, pod or external (default: node for one of this node's
                        addresses, pod inside --cluster-cidr, else external)
      --to DEST:PORT/PROTO
  -o, --output FORMAT   text (default) or json
      --mode MODE       read this mode's rules, whatever runs
  PROXY FLAGS           the proxy's own flags (first one starting with --): they name the
                        object source, used to name the Service and the reason

Exit status: 0, 1 when the rules cannot be read, 64 on bad usage.
";

/// Options common to both commands.
struct Common {
    json: bool,
    mode: Option<ProxyMode>,
    positional: Vec<String>,
    from: Option<IpAddr>,
    origin: Option<Origin>,
    to: Option<String>,
    proxy_args: Vec<OsString>,
}

/// Writes to stdout; a closed pipe (`| head`) ends the output quietly.
fn out(text: &str) {
    use std::io::Write as _;
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
}

fn usage(cmd: &str, msg: &str) -> ExitCode {
    eprintln!("kube-proxy {cmd}: {msg} (see kube-proxy {cmd} --help)");
    ExitCode::from(64)
}

fn parse(cmd: &str, args: &[OsString]) -> Result<Common, ExitCode> {
    let mut c = Common {
        json: false,
        mode: None,
        positional: Vec::new(),
        from: None,
        origin: None,
        to: None,
        proxy_args: Vec::new(),
    };
    let mut i = 0;
    let strs: Vec<String> = args
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    while i < strs.len() {
        let a = strs[i].as_str();
        let (flag, inline) = match a.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
            _ => (a, None),
        };
        let mut value = |name: &str| -> Result<String, ExitCode> {
            if let Some(v) = &inline {
                return Ok(v.clone());
            }
            i += 1;
            strs.get(i)
                .cloned()
                .ok_or_else(|| usage(cmd, &format!("{name} needs a value")))
        };
        match flag {
            "-h" | "--help" => {
                out(&format!(
                    "{}\n{COVERAGE}\n",
                    if cmd == "status" {
                        STATUS_HELP
                    } else {
                        EXPLAIN_HELP
                    }
                ));
                return Err(ExitCode::SUCCESS);
            }
            "-o" | "--output" => match value(flag)?.as_str() {
                "json" => c.json = true,
                "text" => c.json = false,
                other => return Err(usage(cmd, &format!("unknown output format {other:?}"))),
            },
            "--mode" => {
                let m = value(flag)?;
                c.mode = Some(
                    ProxyMode::ALL
                        .into_iter()
                        .find(|x| x.as_str() == m)
                        .ok_or_else(|| usage(cmd, &format!("unknown mode {m:?}")))?,
                );
            }
            "--from" if cmd == "explain" => {
                let v = value(flag)?;
                c.from = Some(
                    v.parse()
                        .map_err(|_| usage(cmd, &format!("--from {v:?} is not an IP address")))?,
                );
            }
            "--origin" if cmd == "explain" => {
                c.origin = Some(match value(flag)?.as_str() {
                    "node" => Origin::Node,
                    "pod" => Origin::Pod,
                    "external" => Origin::External,
                    other => return Err(usage(cmd, &format!("unknown origin {other:?}"))),
                });
            }
            "--to" if cmd == "explain" => c.to = Some(value(flag)?),
            _ if a.starts_with('-') => {
                // The proxy's own flags, from here on.
                c.proxy_args = args[i..].to_vec();
                break;
            }
            _ => c.positional.push(a.to_string()),
        }
        i += 1;
    }
    Ok(c)
}

fn load_config(cmd: &str, proxy_args: &[OsString]) -> Result<Config, ExitCode> {
    let argv = std::iter::once(OsString::from("kube-proxy")).chain(proxy_args.iter().cloned());
    match kp_proxy::config::load(argv) {
        Ok(l) => Ok(l.config),
        Err(e) => {
            eprintln!("kube-proxy {cmd}: the proxy flags are not valid:");
            e.print();
            Err(ExitCode::from(64))
        }
    }
}

/// Runs `kube-proxy status|explain ARGS`.
pub fn main(cmd: &str, args: &[OsString]) -> ExitCode {
    let c = match parse(cmd, args) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let cfg = match load_config(cmd, &c.proxy_args) {
        Ok(cfg) => cfg,
        Err(code) => return code,
    };
    if cmd == "status" {
        run_status(&c, &cfg)
    } else {
        run_explain(&c, &cfg)
    }
}

fn run_status(c: &Common, cfg: &Config) -> ExitCode {
    if c.positional.len() > 1 {
        return usage("status", "at most one Service (NAMESPACE/NAME)");
    }
    let r = status::report(cfg, c.mode, c.positional.first().map(String::as_str));
    if c.json {
        out(&format!(
            "{}\n",
            serde_json::to_string_pretty(&r.json).unwrap_or_default()
        ));
    } else {
        out(&status::to_text(&r.json));
    }
    if r.drift == Some(true) {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// What `explain` was asked about.
enum Target {
    Packet(kp_core::model::Protocol, IpAddr, u16),
    Service(String, Option<String>),
}

fn target(c: &Common) -> Result<Target, ExitCode> {
    if let Some(to) = &c.to {
        if !c.positional.is_empty() {
            return Err(usage("explain", "--to and a positional target both given"));
        }
        let (dest, proto) = to
            .rsplit_once('/')
            .ok_or_else(|| usage("explain", "--to takes DEST:PORT/PROTO"))?;
        let p = explain::protocol(proto)
            .ok_or_else(|| usage("explain", &format!("unknown protocol {proto:?}")))?;
        let (ip, port) = explain::destination(dest)
            .ok_or_else(|| usage("explain", &format!("{dest:?} is not DEST:PORT")))?;
        return Ok(Target::Packet(p, ip, port));
    }
    match c.positional.as_slice() {
        [proto, dest] => {
            let p = explain::protocol(proto)
                .ok_or_else(|| usage("explain", &format!("unknown protocol {proto:?}")))?;
            let (ip, port) = explain::destination(dest)
                .ok_or_else(|| usage("explain", &format!("{dest:?} is not DEST:PORT")))?;
            Ok(Target::Packet(p, ip, port))
        }
        [svc] if svc.contains('/') => {
            let (name, port) = match svc.split_once(':') {
                Some((n, p)) => (n.to_string(), Some(p.to_string())),
                None => (svc.clone(), None),
            };
            Ok(Target::Service(name, port))
        }
        _ => Err(usage(
            "explain",
            "give PROTO DEST:PORT, --to DEST:PORT/PROTO, or NAMESPACE/NAME[:PORT]",
        )),
    }
}

fn run_explain(c: &Common, cfg: &Config) -> ExitCode {
    let target = match target(c) {
        Ok(t) => t,
        Err(code) => return code,
    };
    let mode = match c.mode.or_else(|| live::detect_mode(cfg)) {
        Some(m) => m,
        None => {
            eprintln!("kube-proxy explain: the kernel holds no kube-proxy rules (no nftables table, no KUBE-SERVICES chain, no ebpf pins in {}); nothing to explain", cfg.bpf_pin_dir.display());
            return ExitCode::FAILURE;
        }
    };
    let local = live::local_addresses();
    let mut live = match live::read(mode, cfg, local.clone()) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("kube-proxy explain: reading the {mode} rules: {e}");
            return ExitCode::FAILURE;
        }
    };
    let need_state = matches!(target, Target::Service(..));
    let state = if status::has_source(cfg) {
        match snapshot::load(cfg) {
            Ok(s) => Some(s),
            Err(e) if need_state => {
                eprintln!("kube-proxy explain: {e}");
                return ExitCode::FAILURE;
            }
            Err(e) => {
                eprintln!("kube-proxy explain: Services not named: {e}");
                None
            }
        }
    } else if need_state {
        eprintln!("kube-proxy explain: explaining a Service needs the proxy's object source: pass its flags (--config, --kubeconfig/--master or --manifests) after the Service");
        return ExitCode::from(64);
    } else {
        None
    };
    if let Some(state) = &state {
        live.with_objects(cfg, state);
    }
    let packets: Vec<Packet> = match &target {
        Target::Packet(proto, dst, port) => {
            let src = c.from.unwrap_or_else(|| explain::node_source(*dst, &local));
            let origin = c.origin.unwrap_or_else(|| match c.from {
                None => Origin::Node,
                Some(f) => explain::infer_origin(f, &local, &cfg.cluster_cidrs),
            });
            vec![Packet {
                origin,
                src,
                protocol: *proto,
                dst: *dst,
                dport: *port,
            }]
        }
        Target::Service(name, port) => {
            let Some(state) = &state else {
                return ExitCode::FAILURE;
            };
            let found: Vec<_> = state
                .service_keys()
                .filter(|k| k.to_string() == *name)
                .cloned()
                .collect();
            if found.is_empty() {
                eprintln!(
                    "kube-proxy explain: no Service {name} in {}",
                    snapshot::source_name(cfg)
                );
                return ExitCode::FAILURE;
            }
            let mut v = Vec::new();
            for key in found {
                for sp in state.service_ports(&key) {
                    if let Some(p) = port {
                        if sp.name.port != *p && sp.port.to_string() != *p {
                            continue;
                        }
                    }
                    let mut dsts: Vec<(IpAddr, u16)> = sp
                        .cluster_ips
                        .iter()
                        .chain(&sp.external_ips)
                        .chain(&sp.load_balancer_ips)
                        .map(|ip| (*ip, sp.port))
                        .collect();
                    if let Some(np) = sp.node_port {
                        dsts.extend(state.node().addresses.iter().map(|ip| (*ip, np)));
                    }
                    for (dst, dport) in dsts {
                        let src = c.from.unwrap_or_else(|| explain::node_source(dst, &local));
                        let origin = c.origin.unwrap_or_else(|| match c.from {
                            None => Origin::Node,
                            Some(f) => explain::infer_origin(f, &local, &cfg.cluster_cidrs),
                        });
                        if src.is_ipv4() != dst.is_ipv4() {
                            continue;
                        }
                        v.push(Packet {
                            origin,
                            src,
                            protocol: sp.name.protocol,
                            dst,
                            dport,
                        });
                    }
                }
            }
            v
        }
    };
    let answers: Vec<explain::Answer> = packets
        .iter()
        .map(|p| explain::trace(&live, p, state.as_ref()))
        .collect();
    let failed = answers.iter().any(|a| a.verdict.is_none());
    if c.json {
        let j: Vec<serde_json::Value> = answers
            .iter()
            .map(|a| {
                let mut v = explain::to_json(a);
                v["mode"] = serde_json::json!(mode.as_str());
                v
            })
            .collect();
        let out_json = match (&target, j.len()) {
            (Target::Packet(..), 1) => j.into_iter().next().unwrap_or_default(),
            _ => serde_json::Value::Array(j),
        };
        out(&format!(
            "{}\n",
            serde_json::to_string_pretty(&out_json).unwrap_or_default()
        ));
    } else {
        let mut text = format!("mode:    {mode} (live rules read from the kernel)\n");
        match &live {
            Live::Iptables { foreign_rules, .. } if *foreign_rules > 0 => {
                text.push_str(&format!("note:    {foreign_rules} rules of other programs in the filter and nat tables are not traced\n"));
            }
            Live::Ipvs { foreign_rules, .. } if *foreign_rules > 0 => {
                text.push_str(&format!("note:    {foreign_rules} rules of other programs in the filter, nat and mangle tables are not traced\n"));
            }
            Live::Ebpf {
                pin_dir,
                hooks,
                tc_links,
                ..
            } => {
                text.push_str(&format!(
                    "maps:    pinned in {}; socket hooks linked: {} of {}; tc links: {}\n",
                    pin_dir.display(),
                    hooks.len(),
                    kp_ebpf::SOCK_PROGRAMS.len(),
                    if tc_links.is_empty() {
                        "none pinned (before Linux 6.6 the tc path lives only while the proxy runs; \
                         else nothing translates traffic from outside)"
                            .to_string()
                    } else {
                        tc_links.join(", ")
                    }
                ));
            }
            Live::Userspace {
                ports, listening, ..
            } => {
                text.push_str(&format!(
                    "proxy:   the table redirects to port(s) {ports:?}; listening: {listening:?}\n"
                ));
            }
            _ => {}
        }
        for (i, a) in answers.iter().enumerate() {
            if i > 0 {
                text.push('\n');
            }
            text.push_str(&explain::to_text(a));
        }
        out(&text);
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
