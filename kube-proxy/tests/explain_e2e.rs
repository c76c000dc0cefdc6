//! `kube-proxy explain` and `kube-proxy status` over the live rules: the binary programs a lab
//! node from the flow fixture's manifests (nftables, iptables and ebpf mode, one test each),
//! and the two subcommands, run inside the node's namespace, must name for every flow row the
//! outcome the row expects (as the mode declares it: ebpf's rows as its own flow test runs
//! them), report the running proxy and its health, find the kernel equal to the plan, and find
//! the drift a test makes by deleting an element, a rule or a map entry behind the proxy's back
//! (after it stopped, so no sync repairs it first).
//!
//! ebpf mode runs on a cgroup and a bpffs of the test's own (`ebpf_lab`); `status` and
//! `explain` are given its `--bpf-pin-dir` with the proxy's other flags.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use kp_core::flow::{Origin, Verdict};
use kp_test::lab::Lab;

mod common;
mod ebpf_lab;
mod guest;
use common::{temp_dir, write_atomically, PROGRAMMED};
use kp_flows::Support;

/// The flags `common::spawn_proxy_in_mode` starts the proxy with, and the manifests: what an
/// operator passes after `status`/`explain` so they read the same objects.
/// `extra` are the mode's own flags (ebpf: the sandbox's cgroup and pin directory).
fn proxy_flags(mode: &str, dir: &Path, extra: &[String]) -> Vec<String> {
    let mut flags: Vec<String> = [
        format!("--proxy-mode={mode}"),
        "--hostname-override".into(),
        kp_flows::NODE.into(),
        "--cluster-cidr=10.244.0.0/16,fd00:10:244::/48".into(),
        "--nodeport-addresses=primary".into(),
        "--healthz-bind-address=127.0.0.1:10256".into(),
        "--metrics-bind-address=127.0.0.1:10249".into(),
        "--manifests".into(),
        dir.display().to_string(),
    ]
    .into();
    flags.extend(extra.iter().cloned());
    flags
}

/// Runs the binary with `args` in the node namespace: exit code and stdout.
fn run(lab: &Lab, args: &[String]) -> (i32, String) {
    let mut cmd = std::process::Command::new("ip");
    cmd.args([
        "netns",
        "exec",
        lab.node().name(),
        env!("CARGO_BIN_EXE_kube-proxy"),
    ]);
    cmd.args(args);
    let out = cmd.output().expect("run kube-proxy");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        eprintln!(
            "kube-proxy {args:?} exited {:?}: {}",
            out.status.code(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    (out.status.code().unwrap_or(-1), stdout)
}

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}):\n{text}"))
}

fn origin(o: Origin) -> &'static str {
    match o {
        Origin::Node => "node",
        Origin::Pod => "pod",
        Origin::External => "external",
    }
}

/// The verdict an `explain -o json` answer names, in flow terms.
fn verdict_of(j: &serde_json::Value) -> Option<Verdict> {
    Some(match j["verdict"].as_str()? {
        "dnat" => Verdict::Dnat {
            endpoints: j["endpoints"]
                .as_array()?
                .iter()
                .map(|e| {
                    (
                        e["ip"].as_str().unwrap().parse::<IpAddr>().unwrap(),
                        e["port"].as_u64().unwrap() as u16,
                    )
                })
                .collect::<BTreeSet<_>>(),
            masquerade: j["masquerade"].as_bool()?,
            affinity: j["affinitySeconds"].as_u64().map(|s| s as u32),
        },
        "untouched" => Verdict::Untouched,
        "drop" => Verdict::Drop,
        "reject" => Verdict::Reject,
        _ => return None,
    })
}

/// The IPv4 address of fixture pod `name` (the backend name kp-echo answers with).
fn pod_v4(name: &str) -> &'static str {
    kp_flows::pods()
        .into_iter()
        .find(|p| p.name == name)
        .map(|p| p.v4)
        .unwrap_or_else(|| panic!("no fixture pod {name}"))
}

fn explain_args(case: &kp_flows::Case) -> Vec<String> {
    let p = &case.packet;
    let dest = match p.dst {
        IpAddr::V4(_) => format!("{}:{}", p.dst, p.dport),
        IpAddr::V6(_) => format!("[{}]:{}", p.dst, p.dport),
    };
    vec![
        "explain".into(),
        "-o".into(),
        "json".into(),
        "--origin".into(),
        origin(p.origin).into(),
        "--from".into(),
        p.src.to_string(),
        p.protocol.as_lower().into(),
        dest,
    ]
}

/// Every flow row, as the mode declares it (`support`), through `explain` given the mode's
/// own flags `extra`; one message per row whose answer is not the row's.
fn explain_every_row(lab: &Lab, support: Support, extra: &[String]) -> Vec<String> {
    let mut failures = Vec::new();
    for row in kp_flows::cases() {
        let case = row.for_mode(support);
        // As the real-packet harness does: the node sends from its LoadBalancer IP only where
        // that IP is local.
        let lb_ip = (case.from == kp_flows::NODE_FROM_LB_IP).then(|| {
            let cidr = format!(
                "{}/{}",
                case.packet.src,
                if case.packet.src.is_ipv4() { 32 } else { 128 }
            );
            lab.node().add_addr("lo", &cidr).expect("LB IP on lo");
            cidr
        });
        let mut args = explain_args(&case);
        args.extend(extra.iter().cloned());
        let (code, out) = run(lab, &args);
        if let Some(cidr) = lb_ip {
            let _ = lab.node().ip(&["addr", "del", &cidr, "dev", "lo"]);
        }
        let want = kp_flows::expected_verdict(&case);
        let got = (code == 0).then(|| verdict_of(&json(&out))).flatten();
        if got.as_ref() != Some(&want) {
            let declared = if row.changed_for(support) {
                format!(" (row as declared for this mode: {})", support.reason)
            } else {
                String::new()
            };
            failures.push(format!(
                "{}{declared}: {}\n    want {want:?}\n    got  {got:?} (exit {code})\n{out}",
                case.name, case.packet
            ));
        }
    }
    failures
}

fn start(lab: &Lab, mode: &str, dir: &Path, extra: &[String]) -> kp_test::netns::ChildGuard {
    let mut source = vec!["--manifests", dir.to_str().unwrap()];
    source.extend(extra.iter().map(String::as_str));
    let mut proxy = common::spawn_proxy_in_mode(lab, mode, &[], &source);
    proxy
        // ipvs mode runs in the TCG guest, where its first sync takes several seconds.
        .wait_for_log(PROGRAMMED, Duration::from_secs(180))
        .expect("first sync");
    proxy
}

/// The whole check for one mode; `break_rule` deletes one element or rule of the mode's.
fn check_mode(mode: &str, break_rule: &[&str], broken: &str) {
    let lab = kp_test::flows::lab().expect("lab");
    check_mode_in(
        &lab,
        mode,
        Support::ALL,
        &[],
        &|lab: &Lab| {
            lab.node().run(break_rule).expect("delete behind the proxy");
        },
        broken,
    );
}

/// [`check_mode`] in `lab`, for a mode that declares `support` of the flow table and takes the
/// flags `extra` besides the common ones; `break_rule` breaks one of its elements, rules or
/// map entries, and the drift must then name `broken`.
fn check_mode_in(
    lab: &Lab,
    mode: &str,
    support: Support,
    extra: &[String],
    break_rule: &dyn Fn(&Lab),
    broken: &str,
) {
    let dir = temp_dir(&format!("explain-{mode}"));
    write_atomically(&dir.0.join("cluster.json"), &kp_flows::manifest_list());
    let mut proxy = start(lab, mode, &dir.0, extra);
    let flags = proxy_flags(mode, &dir.0, extra);

    // explain names every row's outcome. In userspace mode the endpoint of a redirected
    // connection is the proxy's choice, which explain reads from the objects: it is given
    // the proxy's flags with the object source.
    let row_flags = if mode == "userspace" {
        flags.clone()
    } else {
        extra.to_vec()
    };
    let failures = explain_every_row(lab, support, &row_flags);
    assert!(
        failures.is_empty(),
        "{mode}: {} of {} rows explained wrongly:\n{}",
        failures.len(),
        kp_flows::cases().len(),
        failures.join("\n")
    );

    // With the object source named, explain names the Service and why it rejects.
    let mut args: Vec<String> = [
        "explain",
        "-o",
        "json",
        "--from",
        "10.244.1.14",
        "tcp",
        "10.96.0.20:80",
    ]
    .map(String::from)
    .into();
    args.extend(flags.iter().cloned());
    let (code, out) = run(lab, &args);
    assert_eq!(code, 0, "{out}");
    let j = json(&out);
    assert_eq!(j["verdict"], "reject", "{out}");
    assert_eq!(j["packet"]["origin"], "pod", "{out}");
    let services = j["services"].to_string();
    assert!(services.contains("ClusterIP"), "{out}");
    assert!(
        j["reason"].as_str().unwrap_or("").contains("no endpoints"),
        "{out}"
    );
    // The text form says the same for an operator.
    let mut text_args: Vec<String> = ["explain", "--from", "10.244.1.14", "tcp", "10.96.0.20:80"]
        .map(String::from)
        .into();
    text_args.extend(flags.iter().cloned());
    let (_, text) = run(lab, &text_args);
    assert!(
        text.contains("REJECTED") && text.contains("no endpoints"),
        "{text}"
    );

    // status: the running proxy, its health, what the kernel holds, no drift.
    let mut status: Vec<String> = ["status", "-o", "json"].map(String::from).into();
    status.extend(flags.iter().cloned());
    let (code, out) = run(lab, &status);
    let j = json(&out);
    assert_eq!(code, 0, "{out}");
    assert_eq!(j["mode"], mode, "{out}");
    assert_eq!(j["runningProxyMode"], mode, "{out}");
    assert_eq!(j["kernelRulesOf"], mode, "{out}");
    assert_eq!(j["health"]["healthz"]["status"], 200, "{out}");
    assert_eq!(j["health"]["livez"]["status"], 200, "{out}");
    assert!(j["health"]["lastUpdated"].is_string(), "{out}");
    assert_eq!(j["drift"]["matches"], true, "{out}");
    let web = j["services"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| {
            s["service"]
                .as_str()
                .is_some_and(|n| n.starts_with("default/web"))
        })
        .unwrap_or_else(|| panic!("no default/web in {out}"));
    let cluster_ip = web["frontends"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["packet"]["to"] == "10.96.0.10")
        .unwrap_or_else(|| panic!("no ClusterIP frontend in {web}"));
    assert_eq!(cluster_ip["verdict"], "dnat", "{web}");
    assert_eq!(
        cluster_ip["endpoints"].as_array().unwrap().len(),
        3,
        "{web}"
    );
    // The node's own connections to a ClusterIP are masqueraded.
    assert_eq!(cluster_ip["masquerade"], true, "{web}");
    let (_, text) = run(lab, &{
        let mut a: Vec<String> = vec!["status".into(), "default/web".into()];
        a.extend(flags.iter().cloned());
        a
    });
    assert!(text.contains("drift:       none"), "{text}");
    assert!(text.contains("default/web"), "{text}");

    // Stopped, the proxy leaves its rules; a deleted element or rule is drift.
    proxy.terminate(Duration::from_secs(5)).unwrap();
    break_rule(lab);
    let (code, out) = run(lab, &status);
    let j = json(&out);
    assert_eq!(code, 1, "drift must fail the status: {out}");
    assert_eq!(
        j["mode"], mode,
        "the mode comes from the kernel once the proxy is gone: {out}"
    );
    assert!(j["runningProxyMode"].is_null(), "{out}");
    assert_eq!(
        j["health"]["healthz"]["status"],
        serde_json::Value::Null,
        "{out}"
    );
    assert_eq!(j["drift"]["matches"], false, "{out}");
    let diffs = j["drift"]["differences"].to_string();
    assert!(
        diffs.contains(broken),
        "the drift must name {broken}: {out}"
    );
}

#[test]
#[ignore = "needs root"]
fn explain_and_status_read_the_live_nftables_rules() {
    if !kp_test::netns::require_root() {
        return;
    }
    check_mode(
        "nftables",
        &[
            "nft",
            "delete",
            "element",
            "ip",
            "kube-proxy",
            "cluster-ips",
            "{ 10.96.0.10 }",
        ],
        "cluster-ips",
    );
}

#[test]
#[ignore = "needs root"]
fn explain_and_status_read_the_live_iptables_rules() {
    if !kp_test::netns::require_root() {
        return;
    }
    check_mode(
        "iptables",
        &["iptables", "-t", "nat", "-F", "KUBE-SERVICES"],
        "KUBE-SERVICES",
    );
}

/// ebpf mode: the maps read through the pins in the sandbox's pin directory, the rows as the
/// mode declares them (its socket hooks for the node and its pods, its tc path from outside:
/// there a reject is a drop and SCTP is left alone), and a services-map entry deleted through
/// its pin (the web ClusterIP's head) is drift.
#[test]
#[ignore = "needs root"]
fn explain_and_status_read_the_live_ebpf_maps() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let sandbox = ebpf_lab::Sandbox::new("explain");
    sandbox.admit(&lab);
    check_mode_in(
        &lab,
        "ebpf",
        kp_ebpf_test::SUPPORT,
        &sandbox.flags(),
        &|_: &Lab| {
            sandbox.delete_map_entry(
                kp_ebpf::names::SERVICES,
                &ebpf_lab::tcp_frontend_head("10.96.0.10".parse().unwrap(), 80),
            )
        },
        "kp_services: frontend 10.96.0.10:80/tcp (socket hooks) is missing from the kernel",
    );
    // Unpinning connect4's link detaches it (the proxy is stopped, nothing else holds it):
    // a pod's IPv4 TCP connection then meets no program, whatever the maps hold, and the
    // missing link is drift.
    std::fs::remove_file(sandbox.pins.join(kp_ebpf::names::link("kp_connect4"))).expect("unpin");
    let mut args: Vec<String> = [
        "explain",
        "-o",
        "json",
        "--origin",
        "pod",
        "--from",
        "10.244.1.14",
        "tcp",
        "10.96.0.20:80",
    ]
    .map(String::from)
    .into();
    args.extend(sandbox.flags());
    let (code, out) = run(&lab, &args);
    let j = json(&out);
    assert_eq!(code, 0, "{out}");
    assert_eq!(j["verdict"], "untouched", "{out}");
    assert!(
        j["reason"]
            .as_str()
            .unwrap_or("")
            .contains("kp_connect4_link"),
        "{out}"
    );
}

/// ebpf mode with `--ipvs-scheduler=sh`: the live maps hold a Maglev table per frontend, and
/// `status` plans them as the running proxy does, so it finds no drift; told the default
/// scheduler instead, it plans no tables and finds every one of them. `explain` names the
/// endpoint the table gives a client outside the node, the one its real connection reaches.
#[test]
#[ignore = "needs root"]
fn status_and_explain_follow_the_ebpf_maglev_tables_of_the_sh_scheduler() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let sandbox = ebpf_lab::Sandbox::new("maglev");
    sandbox.admit(&lab);
    let mut extra = sandbox.flags();
    extra.push("--ipvs-scheduler=sh".into());
    let dir = temp_dir("explain-ebpf-sh");
    write_atomically(&dir.0.join("cluster.json"), &kp_flows::manifest_list());
    let _proxy = start(&lab, "ebpf", &dir.0, &extra);
    let mut status: Vec<String> = ["status", "-o", "json"].map(String::from).into();
    status.extend(proxy_flags("ebpf", &dir.0, &extra));
    let (code, out) = run(&lab, &status);
    assert_eq!(code, 0, "{out}");
    assert_eq!(json(&out)["drift"]["matches"], true, "{out}");
    let default_scheduler: Vec<String> = status
        .iter()
        .filter(|a| !a.starts_with("--ipvs-scheduler"))
        .cloned()
        .collect();
    let (_, out) = run(&lab, &default_scheduler);
    assert_eq!(json(&out)["drift"]["matches"], false, "{out}");
    assert!(out.contains("maglev"), "{out}");

    // From outside, explain names the endpoint the NodePort's table gives each client address
    // (probability 1), and a real connection from that address through the tc path reaches it.
    // The lab's client stands for another host: outside the sandbox's cgroup, so no socket hook
    // meets its connections.
    let _echo = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    lab.client().place_in_cgroup(None);
    let node_port = format!("{}:30080", kp_flows::NODE_IP);
    let mut picked = BTreeSet::new();
    for i in 0..4u8 {
        let client: IpAddr = format!("192.0.2.{}", 120 + i).parse().unwrap();
        lab.client()
            .add_addr("eth0", &format!("{client}/24"))
            .expect("client alias");
        let mut args: Vec<String> = ["explain", "-o", "json", "--origin", "external", "--from"]
            .map(String::from)
            .into();
        args.extend([client.to_string(), "tcp".into(), node_port.clone()]);
        args.extend(proxy_flags("ebpf", &dir.0, &extra));
        let (code, out) = run(&lab, &args);
        assert_eq!(code, 0, "{out}");
        let j = json(&out);
        let first: Vec<&str> = j["endpoints"]
            .as_array()
            .expect("endpoints")
            .iter()
            .filter(|e| e["probability"].as_f64() == Some(1.0))
            .map(|e| e["ip"].as_str().unwrap())
            .collect();
        assert_eq!(first.len(), 1, "one endpoint is the table's: {out}");
        let req = kp_test::echo::Request::new(
            kp_test::echo::Proto::Tcp,
            kp_flows::NODE_IP.parse().unwrap(),
            30080,
        )
        .src_ip(client);
        let reached = match lab.send(lab.client(), &req).first() {
            Some(kp_test::echo::Outcome::Answered { backend, .. }) => backend.clone(),
            other => panic!("{client}: {other:?}"),
        };
        let reached_ip = pod_v4(&reached);
        assert_eq!(
            first[0], reached_ip,
            "{client}: explain named {} but the tc path sent it to {reached}",
            first[0]
        );
        picked.insert(reached_ip);
    }
    eprintln!("the outside clients' endpoints: {picked:?}");
}

/// userspace mode: the redirect table read from the kernel, the endpoints a redirected
/// connection may reach from the balancer synced with the objects (the proxy's choice), SCTP
/// rejected (the proxy has no SCTP socket), and a redirect element deleted behind the stopped
/// proxy's back is drift.
#[test]
#[ignore = "needs root"]
fn explain_and_status_read_the_live_userspace_table() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    check_mode_in(
        &lab,
        "userspace",
        Support::NO_SCTP,
        &[],
        &|lab: &Lab| {
            lab.node()
                .run(common::DELETE_USERSPACE_WEB_REDIRECT)
                .expect("delete behind the proxy");
        },
        "redirect-vips-v4",
    );
    // The proxy stopped, its rules stay: a connection they redirect meets no listener and is
    // refused, which explain says rather than naming endpoints nobody connects to.
    let row = kp_flows::cases()
        .into_iter()
        .map(|row| row.for_mode(Support::NO_SCTP))
        .find(|c| {
            c.packet.origin == Origin::Pod
                && c.packet.dst.to_string() != "10.96.0.10"
                && matches!(c.expect, kp_flows::Expect::Pods { .. })
        })
        .expect("a redirected row from a pod");
    let (code, out) = run(&lab, &explain_args(&row));
    let j = json(&out);
    assert_eq!(code, 0, "{out}");
    assert_eq!(j["verdict"], "reject", "{}: {out}", row.name);
    assert!(
        j["reason"]
            .as_str()
            .unwrap_or("")
            .contains("nothing listens"),
        "{out}"
    );
}

/// userspace mode with detect-local by interface (`InterfaceNamePrefix` `veth`, the lab's pods'
/// side): the table redirects what arrives on a pod's veth to the pod port, where the proxy
/// listens too, so explain names every row as with the cluster CIDRs (a pod's ClusterIP
/// connection keeps its source), status plans both ports and finds no drift, and the pod
/// port's redirect rule deleted behind the stopped proxy's back is drift.
#[test]
#[ignore = "needs root"]
fn explain_and_status_read_the_live_userspace_table_with_detect_local_by_interface() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let extra: Vec<String> = [
        "--detect-local-mode=InterfaceNamePrefix",
        "--pod-interface-name-prefix=veth",
    ]
    .map(String::from)
    .into();
    check_mode_in(
        &lab,
        "userspace",
        Support::NO_SCTP,
        &extra,
        &|lab: &Lab| {
            lab.node()
                .delete_nft_rule(
                    "inet",
                    "kube-proxy-userspace",
                    "services",
                    "redirect-pod-vips-v4",
                )
                .expect("delete behind the proxy");
        },
        "redirect-pod-vips-v4",
    );
}

/// userspace mode with the `sh` scheduler (`--ipvs-scheduler=sh`): the proxy's first choice
/// is a hash of the client's address, so `explain` names it (probability 1, the others listed
/// at 0 as fallbacks), and a real connection from that client reaches that very endpoint.
#[test]
#[ignore = "needs root"]
fn explain_names_the_endpoint_the_userspace_source_hashing_scheduler_picks() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let _echo = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    let dir = temp_dir("explain-userspace-sh");
    write_atomically(&dir.0.join("cluster.json"), &kp_flows::manifest_list());
    let extra = vec!["--ipvs-scheduler=sh".to_string()];
    let mut proxy = start(&lab, "userspace", &dir.0, &extra);
    let flags = proxy_flags("userspace", &dir.0, &extra);
    let mut picked = BTreeSet::new();
    for pod in kp_flows::pods()
        .into_iter()
        .filter(|p| p.node == kp_flows::NODE)
    {
        let mut args: Vec<String> = ["explain", "-o", "json", "--from", pod.v4, "tcp"]
            .map(String::from)
            .into();
        args.push("10.96.0.10:80".into());
        args.extend(flags.iter().cloned());
        let (code, out) = run(&lab, &args);
        assert_eq!(code, 0, "{out}");
        let j = json(&out);
        let endpoints = j["endpoints"].as_array().expect("endpoints");
        assert_eq!(endpoints.len(), 3, "{out}");
        let first: Vec<&str> = endpoints
            .iter()
            .filter(|e| e["probability"].as_f64() == Some(1.0))
            .map(|e| e["ip"].as_str().unwrap())
            .collect();
        assert_eq!(first.len(), 1, "one endpoint is the scheduler's: {out}");
        assert!(
            j["reason"].as_str().unwrap_or("").contains("sh hashes"),
            "{out}"
        );
        // The real connection from that client, through the running proxy.
        let index: usize = pod
            .name
            .trim_start_matches("pod-")
            .parse()
            .expect("pod index");
        let reached = match lab.request(
            lab.pod(index),
            kp_test::echo::Proto::Tcp,
            "10.96.0.10".parse().unwrap(),
            80,
        ) {
            kp_test::echo::Outcome::Answered { backend, .. } => backend,
            other => panic!("{}: {other}", pod.name),
        };
        let reached_ip = pod_v4(&reached);
        assert_eq!(
            first[0], reached_ip,
            "{}: explain named {} but the proxy connected to {reached}",
            pod.name, first[0]
        );
        picked.insert(reached_ip);
    }
    proxy.terminate(Duration::from_secs(5)).unwrap();
    eprintln!("the clients' endpoints: {picked:?}");
}

/// ipvs mode, in the kp-vm guest (Debian's kernel has IPVS; this machine's has not): its
/// chains, ipsets and IPVS's virtual servers read into its tracer, every row explained as it
/// goes with real packets (`ipvs_vm_e2e`), and a virtual server deleted behind the stopped
/// proxy's back is drift.
#[test]
#[ignore = "needs root"]
fn explain_and_status_read_the_live_ipvs_state() {
    if !kp_test::netns::require_root() {
        return;
    }
    if !guest::in_guest("explain_and_status_read_the_live_ipvs_state") {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    check_mode_in(
        &lab,
        "ipvs",
        Support::ALL,
        &[],
        &|lab: &Lab| {
            lab.node()
                .run(&["ipvsadm", "-D", "-t", "10.96.0.10:80"])
                .expect("delete behind the proxy");
        },
        "virtual server TCP 10.96.0.10:80 is missing from the kernel",
    );
}

#[test]
#[ignore = "needs root"]
fn with_nothing_programmed_explain_says_so_and_fails() {
    if !kp_test::netns::require_root() {
        return;
    }
    let lab = kp_test::flows::lab().expect("lab");
    let (code, _) = run(&lab, &["explain", "tcp", "10.96.0.10:80"].map(String::from));
    assert_eq!(code, 1);
}
