//! Cleanup and backend detection against real kernels, in scratch namespaces, with rules
//! written by hand in the shapes kube-proxy and kubelet leave behind.

use kp_core::model::IpFamily;
use kp_iptables::{cleanup_all, detect_backend, parse_save, Backend, IptablesCommand};
use kp_test::netns::Netns;

/// What an iptables-mode kube-proxy and a kubelet leave on a node, plus a chain of somebody
/// else's that jumps into ours.
const LEFTOVERS: &str = r#"*mangle
:KUBE-PROXY-CANARY - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-IPTABLES-HINT - [0:0]
COMMIT
*filter
:KUBE-SERVICES - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:MY-CHAIN - [0:0]
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A INPUT -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A INPUT -j KUBE-FIREWALL
-A INPUT -j MY-CHAIN
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -j KUBE-FIREWALL
-A KUBE-SERVICES -d 10.96.0.20/32 -p tcp -m comment --comment "default/none:http has no endpoints" -m tcp --dport 80 -j REJECT --reject-with icmp-port-unreachable
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment "block incoming localnet connections" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
-A MY-CHAIN -s 10.1.2.3/32 -j ACCEPT
-A MY-CHAIN -j KUBE-SERVICES
COMMIT
*nat
:KUBE-SERVICES - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-MARK-DROP - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-SVC-AAAAAAAAAAAAAAAA - [0:0]
:KUBE-SEP-BBBBBBBBBBBBBBBB - [0:0]
:KUBE-EXT-AAAAAAAAAAAAAAAA - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:MY-NAT - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A POSTROUTING -j MY-NAT
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-MARK-DROP -j MARK --set-xmark 0x8000/0x8000
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-AAAAAAAAAAAAAAAA
-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-NODEPORTS -p tcp -m tcp --dport 30080 -j KUBE-EXT-AAAAAAAAAAAAAAAA
-A KUBE-EXT-AAAAAAAAAAAAAAAA -j KUBE-MARK-MASQ
-A KUBE-EXT-AAAAAAAAAAAAAAAA -j KUBE-SVC-AAAAAAAAAAAAAAAA
-A KUBE-SVC-AAAAAAAAAAAAAAAA -j KUBE-SEP-BBBBBBBBBBBBBBBB
-A KUBE-SEP-BBBBBBBBBBBBBBBB -p tcp -m tcp -j DNAT --to-destination 10.244.1.11:8080
-A MY-NAT -s 10.9.0.0/16 -j MASQUERADE
COMMIT
"#;

fn v6(text: &str) -> String {
    text.replace("10.96.0.20/32", "fd00:10:96::20/128")
        .replace("10.96.0.10/32", "fd00:10:96::10/128")
        .replace("10.1.2.3/32", "fd00::1:2:3/128")
        .replace("10.9.0.0/16", "fd00:9::/32")
        .replace("10.244.1.11:8080", "[fd00:10:244:1::11]:8080")
        .replace("! -s 127.0.0.0/8 -d 127.0.0.0/8 ", "")
        .replace("icmp-port-unreachable", "icmp6-port-unreachable")
}

fn chains(cmd: &IptablesCommand, backend: Backend, family: IpFamily, table: &str) -> Vec<String> {
    let text = cmd.save(backend, family, Some(table)).expect("save");
    let saved = parse_save(&text, table).expect("parse");
    saved
        .chains
        .into_keys()
        .filter(|c| !saved.builtin.contains(c))
        .collect()
}

fn rules(cmd: &IptablesCommand, backend: Backend, family: IpFamily) -> String {
    let mut out = String::new();
    for t in ["mangle", "filter", "nat"] {
        out.push_str(&cmd.save(backend, family, Some(t)).expect("save"));
    }
    out.lines()
        .filter(|l| l.starts_with("-A ") || l.starts_with(':'))
        .map(|l| format!("{l}\n"))
        .collect()
}

#[test]
#[ignore = "needs root"]
fn cleanup_removes_our_chains_from_both_backends_and_keeps_everyone_elses() {
    if !kp_test::netns::require_root() {
        return;
    }
    let ns = Netns::new("ipt-cleanup").expect("netns");
    let cmd = IptablesCommand::in_netns(ns.name()).with_wait_seconds(60);
    for backend in Backend::ALL {
        for family in IpFamily::ALL {
            let input = match family {
                IpFamily::V4 => LEFTOVERS.to_string(),
                IpFamily::V6 => v6(LEFTOVERS),
            };
            cmd.restore(backend, family, &input)
                .unwrap_or_else(|e| panic!("{backend} {family:?}: {e}"));
        }
    }

    cleanup_all(Some(ns.name())).expect("cleanup");

    for backend in Backend::ALL {
        for family in IpFamily::ALL {
            let what = format!("{backend} {family:?}");
            let all = rules(&cmd, backend, family);
            assert_eq!(
                chains(&cmd, backend, family, "mangle"),
                ["KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY"],
                "{what}"
            );
            assert_eq!(
                chains(&cmd, backend, family, "filter"),
                ["KUBE-KUBELET-CANARY", "MY-CHAIN"],
                "{what}:\n{all}"
            );
            assert_eq!(
                chains(&cmd, backend, family, "nat"),
                ["KUBE-KUBELET-CANARY", "KUBE-MARK-DROP", "MY-NAT"],
                "{what}:\n{all}"
            );
            // Everyone else's rules are untouched, ours and every jump to ours are gone.
            let expected_rules = [
                "-A INPUT -j MY-CHAIN",
                "-A MY-CHAIN -s ",
                "-A POSTROUTING -j MY-NAT",
                "-A KUBE-MARK-DROP -j MARK --set-xmark 0x8000/0x8000",
                "-A MY-NAT -s ",
            ];
            let left: Vec<&str> = all.lines().filter(|l| l.starts_with("-A ")).collect();
            assert_eq!(left.len(), expected_rules.len(), "{what}:\n{all}");
            for r in expected_rules {
                assert!(
                    left.iter().any(|l| l.starts_with(r)),
                    "{what}: {r} missing:\n{all}"
                );
            }
        }
    }

    // A second cleanup finds nothing to do and does not fail.
    cleanup_all(Some(ns.name())).expect("second cleanup");
}

#[test]
#[ignore = "needs root"]
fn cleanup_of_a_clean_namespace_creates_no_legacy_tables() {
    if !kp_test::netns::require_root() {
        return;
    }
    let ns = Netns::new("ipt-clean").expect("netns");
    cleanup_all(Some(ns.name())).expect("cleanup");
    let names = ns
        .run(&["cat", "/proc/net/ip_tables_names"])
        .unwrap_or_default();
    assert!(names.trim().is_empty(), "legacy tables appeared: {names}");
    let tables = ns.run(&["nft", "list", "tables"]).unwrap();
    assert!(tables.trim().is_empty(), "nft tables appeared: {tables}");
}

#[test]
#[ignore = "needs root"]
fn the_backend_follows_kubelets_hint_then_the_rule_count() {
    if !kp_test::netns::require_root() {
        return;
    }
    // A fresh node: nothing anywhere, nft wins the tie.
    let fresh = Netns::new("ipt-detect1").expect("netns");
    assert_eq!(detect_backend(Some(fresh.name())), Backend::Nft);

    // Rules only in legacy: legacy.
    let legacy = Netns::new("ipt-detect2").expect("netns");
    let cmd = IptablesCommand::in_netns(legacy.name()).with_wait_seconds(60);
    cmd.run_ok(
        Backend::Legacy,
        IpFamily::V4,
        &[
            "-t", "filter", "-A", "INPUT", "-s", "10.0.0.1", "-j", "ACCEPT",
        ],
    )
    .expect("legacy rule");
    assert_eq!(detect_backend(Some(legacy.name())), Backend::Legacy);

    // More legacy rules, but kubelet's hint chain in nft: nft.
    cmd.run_ok(
        Backend::Nft,
        IpFamily::V6,
        &["-t", "mangle", "-N", "KUBE-IPTABLES-HINT"],
    )
    .expect("nft hint");
    assert_eq!(detect_backend(Some(legacy.name())), Backend::Nft);

    // A hint in legacy only, with more nft rules: legacy.
    let hinted = Netns::new("ipt-detect3").expect("netns");
    let cmd = IptablesCommand::in_netns(hinted.name()).with_wait_seconds(60);
    cmd.run_ok(
        Backend::Legacy,
        IpFamily::V4,
        &["-t", "mangle", "-N", "KUBE-KUBELET-CANARY"],
    )
    .expect("legacy hint");
    for i in 1..4 {
        cmd.run_ok(
            Backend::Nft,
            IpFamily::V4,
            &["-A", "INPUT", "-s", &format!("10.0.0.{i}"), "-j", "ACCEPT"],
        )
        .expect("nft rule");
    }
    assert_eq!(detect_backend(Some(hinted.name())), Backend::Legacy);
}
