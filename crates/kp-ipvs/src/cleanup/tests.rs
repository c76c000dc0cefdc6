use super::*;

/// What `iptables-save -t nat` shows after an ipvs-mode sync (rules abridged), with a rule
/// of someone else's in a built-in chain.
const NAT: &str = r#"*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-LOAD-BALANCER - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-NODE-PORT - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-SERVICES - [0:0]
:MY-CHAIN - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -j MY-CHAIN
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A KUBE-LOAD-BALANCER -j KUBE-MARK-MASQ
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-SERVICES -m comment --comment "Kubernetes service cluster ip + port for masquerade purpose" -m set --match-set KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ
-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT
-A MY-CHAIN -j KUBE-NODE-PORT
COMMIT
"#;

#[test]
fn an_ipvs_table_loses_the_jumps_the_shared_chains_rules_and_the_own_chains() {
    let (input, deleted) = table_removal("nat", NAT).expect("the ipvs mode's table");
    assert_eq!(deleted, 2);
    let lines: Vec<&str> = input.lines().collect();
    assert_eq!(
        lines,
        [
            "*nat",
            "-D PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
            "-D OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
            "-D POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING",
            // Someone else's jump to a chain being deleted would stop the deletion.
            "-D MY-CHAIN -j KUBE-NODE-PORT",
            ":KUBE-SERVICES - [0:0]",
            ":KUBE-POSTROUTING - [0:0]",
            ":KUBE-MARK-MASQ - [0:0]",
            ":KUBE-NODE-PORT - [0:0]",
            ":KUBE-LOAD-BALANCER - [0:0]",
            "-X KUBE-NODE-PORT",
            "-X KUBE-LOAD-BALANCER",
            "COMMIT",
        ]
    );
    // Someone else's rule and chain stay.
    assert!(!input.contains("-D OUTPUT -j MY-CHAIN"));
    assert!(!input.contains("MY-CHAIN - [0:0]"));
}

#[test]
fn a_table_without_the_ipvs_modes_own_chains_is_left_alone() {
    // The iptables mode's table: shared names, but none only the ipvs mode makes.
    let iptables_mode =
        "*nat\n:OUTPUT ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n\
        -A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\nCOMMIT\n";
    assert_eq!(table_removal("nat", iptables_mode), None);
    assert_eq!(table_removal("filter", ""), None);
}

#[test]
fn a_filter_table_keeps_the_chains_it_did_not_have() {
    let saved = "*filter\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:KUBE-IPVS-FILTER - [0:0]\n\
        -A INPUT -m comment --comment \"kubernetes ipvs access filter\" -j KUBE-IPVS-FILTER\nCOMMIT\n";
    let (input, deleted) = table_removal("filter", saved).expect("ours");
    assert_eq!(deleted, 1);
    assert!(input.contains(
        "-D INPUT -m comment --comment \"kubernetes ipvs access filter\" -j KUBE-IPVS-FILTER\n"
    ));
    assert!(input.contains("-X KUBE-IPVS-FILTER\n"));
    // A chain that is not there is not declared (that would create it).
    assert!(!input.contains("KUBE-FORWARD"), "{input}");
    assert!(!input.contains("KUBE-IPVS-OUT-FILTER"), "{input}");
}

/// The iptables mode runs now and fills `KUBE-SERVICES`, `KUBE-POSTROUTING` and
/// `KUBE-MARK-MASQ` under the same names, with the same jumps from the built-in chains.
fn iptables_mode_running() -> Keep {
    let words = |s: &str| kp_iptables::split_args(s);
    Keep {
        chains: [
            ("nat", "KUBE-SERVICES"),
            ("nat", "KUBE-POSTROUTING"),
            ("nat", "KUBE-MARK-MASQ"),
        ]
        .into_iter()
        .map(|(t, c)| (t.to_string(), c.to_string()))
        .collect(),
        jumps: [
            (
                "PREROUTING",
                "-m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
            ),
            (
                "OUTPUT",
                "-m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
            ),
        ]
        .into_iter()
        .map(|(c, a)| ("nat".to_string(), c.to_string(), words(a)))
        .collect(),
        draining: true,
    }
}

#[test]
fn while_another_mode_fills_the_shared_chains_they_and_its_jumps_stay() {
    let keep = iptables_mode_running();
    let (input, deleted) =
        table_removal_keeping("nat", NAT, &keep).expect("the ipvs mode's own chains are there");
    assert_eq!(deleted, 2);
    let lines: Vec<&str> = input.lines().collect();
    assert_eq!(
        lines,
        [
            "*nat",
            // Not a jump the running mode made (its POSTROUTING jump is not in `keep` here):
            // this mode's, so it goes; the chain it jumps to stays, filled by the running mode.
            "-D POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING",
            "-D MY-CHAIN -j KUBE-NODE-PORT",
            ":KUBE-NODE-PORT - [0:0]",
            ":KUBE-LOAD-BALANCER - [0:0]",
            "-X KUBE-NODE-PORT",
            "-X KUBE-LOAD-BALANCER",
            "COMMIT",
        ]
    );
    // The shared chains are neither flushed nor deleted.
    for c in ["KUBE-SERVICES", "KUBE-MARK-MASQ"] {
        assert!(!input.contains(c), "{c}: {input}");
    }
    // The same removal with nothing kept flushes them (--cleanup, or a mode without them).
    let (all, _) = table_removal("nat", NAT).unwrap();
    assert!(all.contains(":KUBE-SERVICES - [0:0]"));
    assert!(all.contains("-D OUTPUT -m comment"));
}

#[test]
fn the_iptables_modes_own_jumps_and_chains_are_what_the_two_modes_share() {
    let keep = Keep {
        chains: chains_shared_with_iptables_mode(),
        jumps: iptables_mode_jumps(),
        draining: true,
    };
    // The nat jumps both modes make are the same rules: they stay with the running mode.
    let (input, _) = table_removal_keeping("nat", NAT, &keep).unwrap();
    assert!(!input.contains("-D PREROUTING"), "{input}");
    assert!(!input.contains("-D OUTPUT"), "{input}");
    assert!(!input.contains("-D POSTROUTING"), "{input}");
    assert!(!input.contains(":KUBE-POSTROUTING"), "{input}");
    // Every shared chain is one the ipvs mode fills.
    let ipvs = ipvs_mode_chains();
    for c in &keep.chains {
        assert!(ipvs.contains(c), "{c:?}");
    }
    // The ipvs mode's jumps to its firewall chain are its own (the iptables mode's jump there
    // matches new connections only): they go when the iptables mode takes over.
    let filter = "*filter\n:INPUT ACCEPT [0:0]\n:KUBE-IPVS-FILTER - [0:0]\n:KUBE-PROXY-FIREWALL - [0:0]\n\
        -A INPUT -m comment --comment \"kube-proxy firewall rules\" -j KUBE-PROXY-FIREWALL\n\
        -A INPUT -m comment --comment \"kubernetes ipvs access filter\" -j KUBE-IPVS-FILTER\nCOMMIT\n";
    let (input, _) = table_removal_keeping("filter", filter, &keep).unwrap();
    assert!(
        input.contains(
            "-D INPUT -m comment --comment \"kube-proxy firewall rules\" -j KUBE-PROXY-FIREWALL"
        ),
        "{input}"
    );
    assert!(!input.contains(":KUBE-PROXY-FIREWALL"), "{input}");
    assert!(ipvs_mode_jumps()
        .iter()
        .any(|(t, c, _)| t == "filter" && c == "INPUT"));
}
