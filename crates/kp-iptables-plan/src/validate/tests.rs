//! The findings of the module docs, one input each, and every shape the renderer emits.

use super::*;
use crate::planner::{PlanConfig, Planner};

const V4: IpFamily = IpFamily::V4;
const V6: IpFamily = IpFamily::V6;

fn check(family: IpFamily, table: Table, args: &str) -> Result<(), Problem> {
    rule(family, table, "KUBE-TEST", args).map_err(|e| e.problem)
}

#[track_caller]
fn refused(family: IpFamily, table: Table, args: &str, want: Problem) {
    match rule(family, table, "KUBE-TEST", args) {
        Err(e) => assert_eq!(e.problem, want, "{args}: {e}"),
        Ok(()) => panic!("{args}: accepted, want {want:?}"),
    }
}

#[track_caller]
fn accepted(family: IpFamily, table: Table, args: &str) {
    if let Err(e) = rule(family, table, "KUBE-TEST", args) {
        panic!("{args}: {e}");
    }
}

#[test]
fn zero_length_prefixes_are_refused_negated_and_not_canonical_otherwise() {
    use Problem::*;
    let filter = Table::Filter;
    // What the two-range ClusterIP cover used to render.
    let ret = "-m comment --comment \"not addressed to a ClusterIP\" -j RETURN";
    refused(V4, filter, &format!("! -d 0.0.0.0/0 {ret}"), RefusedByNft);
    refused(V6, filter, &format!("! -d ::/0 {ret}"), RefusedByNft);
    refused(V4, filter, "! -s 0.0.0.0/0 -j RETURN", RefusedByNft);
    refused(V4, filter, "-s 0.0.0.0/0 -j RETURN", NotCanonical);
    refused(V6, filter, "-d ::/0 -j RETURN", NotCanonical);
    accepted(V4, filter, &format!("! -d 0.0.0.0/1 {ret}"));
    accepted(V4, filter, &format!("! -d 10.96.0.0/22 {ret}"));
    accepted(V6, filter, &format!("! -d fd00:10:96::10/128 {ret}"));
}

#[test]
fn addresses_must_be_networks_of_the_family_as_save_prints_them() {
    use Problem::*;
    let f = Table::Filter;
    refused(V4, f, "-d 10.0.0.1/8 -j RETURN", NotCanonical);
    refused(V4, f, "-d 10.0.0.1 -j RETURN", NotCanonical);
    refused(V4, f, "-d 10.0.0.0/255.0.0.0 -j RETURN", NotCanonical);
    refused(V4, f, "-d 10.0.0.0/08 -j RETURN", NotCanonical);
    refused(V4, f, "-d 10.0.0.0/33 -j RETURN", Refused);
    refused(V6, f, "-d fd00::/129 -j RETURN", Refused);
    refused(V4, f, "-d fd00::1/128 -j RETURN", Refused);
    refused(V6, f, "-d 10.0.0.1/32 -j RETURN", Refused);
    refused(V4, f, "-d foo.invalid/32 -j RETURN", Unvetted);
    refused(V6, f, "-d FD00::1/128 -j RETURN", NotCanonical);
    refused(V6, f, "-d fd00:0::1/128 -j RETURN", NotCanonical);
    // glibc prints IPv4-compatible addresses dotted (`::1.2.3.4`), Rust in hex.
    refused(V6, f, "-d ::102:304/128 -j RETURN", NotCanonical);
    accepted(V6, f, "-d ::ffff:10.0.0.1/128 -j RETURN");
    accepted(V6, f, "-d ::1/128 -j RETURN");
    accepted(V6, f, "-d 2001:db8::1:0:0:1/128 -j RETURN");
    assert_eq!(
        check(V4, f, "! -s 10.0.0.0/8 -d 10.96.0.10/32 -j RETURN"),
        Ok(())
    );
}

#[test]
fn arguments_must_come_in_save_order_one_space_apart() {
    use Problem::*;
    let f = Table::Filter;
    refused(V4, f, "-d 10.0.0.0/8 -s 10.0.0.0/8 -j RETURN", NotCanonical);
    refused(V4, f, "-d 10.0.0.0/8 -d 10.0.0.0/8 -j RETURN", Refused);
    refused(V4, f, "-p tcp -d 10.0.0.0/8 -j RETURN", NotCanonical);
    refused(
        V4,
        f,
        "-m comment --comment x -d 10.0.0.0/8 -j RETURN",
        NotCanonical,
    );
    refused(V4, f, "-j RETURN ", NotCanonical);
    refused(V4, f, " -j RETURN", NotCanonical);
    refused(V4, f, "-d  10.0.0.0/8 -j RETURN", NotCanonical);
    refused(V4, f, "-j RETURN -d 10.0.0.0/8", Refused);
    refused(V4, f, "", Meaningless);
    refused(V4, f, "-o eth0 -j RETURN", Unvetted);
    // Detect-local by interface: `-i` after `-d`, before `-p`; 15 bytes at most, `+` counted.
    accepted(V4, f, "-i eth0 -j RETURN");
    accepted(
        V4,
        f,
        "-d 10.0.0.0/8 ! -i veth+ -p tcp -m tcp --dport 80 -j RETURN",
    );
    accepted(V4, f, "-i abcdefghijklmn+ -j RETURN");
    refused(V4, f, "-p tcp -i eth0 -j RETURN", NotCanonical);
    refused(V4, f, "-i eth0 -d 10.0.0.0/8 -j RETURN", NotCanonical);
    refused(V4, f, "-i abcdefghijklmno+ -j RETURN", Refused);
    refused(V4, f, "-i eth0 -i eth1 -j RETURN", Refused);
    refused(V4, f, "-i a/b -j RETURN", Unvetted);
    refused(V4, f, "-i + -j RETURN", Unvetted);
    refused(V4, f, "! -p tcp -j RETURN", Unvetted);
    refused(V4, f, "-p icmp -j RETURN", Unvetted);
    refused(V4, f, "-j RETURN\n-A INPUT -j DROP", Refused);
}

#[test]
fn comments_up_to_255_bytes_quoted_as_save_quotes_them() {
    use Problem::*;
    let f = Table::Filter;
    let long = "a".repeat(MAX_COMMENT);
    accepted(V4, f, &format!("-m comment --comment {long} -j RETURN"));
    refused(
        V4,
        f,
        &format!("-m comment --comment {long}a -j RETURN"),
        NotCanonical,
    );
    // Multi-byte characters count in bytes.
    let wide = "é".repeat(128);
    refused(
        V4,
        f,
        &format!("-m comment --comment \"{wide}\" -j RETURN"),
        NotCanonical,
    );
    accepted(V4, f, "-m comment --comment \"\" -j RETURN");
    accepted(V4, f, "-m comment --comment \"a\\\"b\\\\c\\'d\" -j RETURN");
    accepted(
        V4,
        f,
        "-m comment --comment \"ns/svc:p80 -> 10.0.0.1:80\" -j RETURN",
    );
    accepted(V4, f, "-m comment --comment \"é ü\" -j RETURN");
    refused(
        V4,
        f,
        "-m comment --comment \"plain\" -j RETURN",
        NotCanonical,
    );
    refused(V4, f, "-m comment --comment a/b -j RETURN", NotCanonical);
    refused(
        V4,
        f,
        "-m comment --comment \"a'b\" -j RETURN",
        NotCanonical,
    );
    // An open quote swallows the target into the comment.
    refused(V4, f, "-m comment --comment \"abc -j RETURN", Meaningless);
    refused(V4, f, "-m comment --comment \"a\"b -j RETURN", NotCanonical);
    refused(V4, f, "-m comment", Unvetted);
}

#[test]
fn ports_need_their_protocol_and_a_number_from_1_to_65535() {
    use Problem::*;
    let f = Table::Filter;
    accepted(V4, f, "-p tcp -m tcp --dport 80 -j RETURN");
    accepted(V4, f, "-p udp -m udp --dport 65535 -j RETURN");
    accepted(V6, f, "-p sctp -m sctp --dport 3868 -j RETURN");
    accepted(V4, f, "-p tcp -m tcp ! --dport 80 -j RETURN");
    refused(V4, f, "-p tcp -m tcp --dport 0 -j RETURN", Meaningless);
    refused(V4, f, "-p tcp -m tcp --dport 65536 -j RETURN", Refused);
    refused(V4, f, "-p tcp -m tcp --dport 080 -j RETURN", Unvetted);
    refused(V4, f, "-p tcp -m tcp --dport http -j RETURN", Unvetted);
    refused(V4, f, "-p tcp -m tcp --dport 80:90 -j RETURN", Unvetted);
    refused(V4, f, "-p tcp -m udp --dport 80 -j RETURN", Refused);
    refused(V4, f, "-m tcp --dport 80 -j RETURN", Refused);
    refused(V4, f, "-p tcp -m tcp --sport 80 -j RETURN", Unvetted);
}

#[test]
fn dnat_needs_nat_a_protocol_and_a_real_port() {
    use Problem::*;
    let nat = Table::Nat;
    accepted(V4, nat, "-p tcp -j DNAT --to-destination 10.0.0.1:80");
    accepted(V6, nat, "-p udp -j DNAT --to-destination [fd00::1]:53");
    refused(
        V4,
        nat,
        "-p tcp -j DNAT --to-destination 10.0.0.1:0",
        Meaningless,
    );
    refused(
        V6,
        nat,
        "-p tcp -j DNAT --to-destination [fd00::1]:0",
        Meaningless,
    );
    refused(V4, nat, "-j DNAT --to-destination 10.0.0.1:80", Refused);
    refused(
        V4,
        Table::Filter,
        "-p tcp -j DNAT --to-destination 10.0.0.1:80",
        Refused,
    );
    refused(
        V4,
        nat,
        "-p tcp -j DNAT --to-destination 10.0.0.1",
        Unvetted,
    );
    refused(
        V6,
        nat,
        "-p tcp -j DNAT --to-destination [10.0.0.1]:80",
        Refused,
    );
    refused(
        V6,
        nat,
        "-p tcp -j DNAT --to-destination [::102:304]:80",
        NotCanonical,
    );
    refused(V4, nat, "-p tcp -j DNAT", Unvetted);
}

#[test]
fn probabilities_strictly_between_0_and_1_as_the_kernel_keeps_them() {
    use Problem::*;
    let f = Table::Nat;
    let p = |v: &str| format!("-m statistic --mode random --probability {v} -j RETURN");
    for n in 2..200 {
        accepted(V4, f, &p(&crate::render::probability(n)));
    }
    accepted(V4, f, &p("0.33333333349"));
    refused(V4, f, &p("0.3333333333"), NotCanonical);
    refused(V4, f, &p("0.5"), NotCanonical);
    refused(V4, f, &p("0.00000000000"), Meaningless);
    refused(V4, f, &p("1.00000000000"), Meaningless);
    refused(V4, f, &p("0.99999999999"), Meaningless);
    refused(V4, f, &p("1.5"), Refused);
    refused(V4, f, &p("-0.1"), Refused);
    refused(V4, f, &p("NaN"), Refused);
    refused(
        V4,
        f,
        "-m statistic --mode nth --every 2 -j RETURN",
        Unvetted,
    );
}

#[test]
fn recent_lists_names_seconds_and_masks() {
    use Problem::*;
    let nat = Table::Nat;
    let m4 = "--mask 255.255.255.255 --rsource";
    let m6 = "--mask ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff --rsource";
    let set = |name: &str| format!("-m recent --set --name {name} {m4} -j RETURN");
    let check = |verb: &str, t: &str| {
        format!("-m recent {verb} --seconds {t} --reap --name KUBE-SEP-X {m4} -j RETURN")
    };
    accepted(V4, nat, &set("KUBE-SEP-ABCDEFGHIJKLMNOP"));
    accepted(
        V6,
        nat,
        &format!("-m recent --set --name KUBE-SEP-X {m6} -j RETURN"),
    );
    accepted(V4, nat, &set(&"A".repeat(MAX_RECENT_NAME)));
    refused(
        V4,
        nat,
        &set(&"A".repeat(MAX_RECENT_NAME + 1)),
        NotCanonical,
    );
    refused(V4, nat, &set("."), Refused);
    refused(V4, nat, &set(".."), Refused);
    refused(V4, nat, &set("a/b"), Refused);
    accepted(V4, nat, &set(".a"));
    refused(V4, nat, &set("a:b"), Unvetted);
    for verb in ["--rcheck", "--update"] {
        accepted(V4, nat, &check(verb, "1"));
        accepted(V4, nat, &check(verb, "10800"));
        accepted(V4, nat, &check(verb, "2147483647"));
        refused(V4, nat, &check(verb, "0"), Refused);
        refused(V4, nat, &check(verb, "2147483648"), NotCanonical);
        refused(V4, nat, &check(verb, "4294967295"), NotCanonical);
        refused(V4, nat, &check(verb, "4294967296"), Refused);
        refused(V4, nat, &check(verb, "-1"), Refused);
    }
    refused(
        V4,
        nat,
        &format!("-m recent --rcheck --reap --name KUBE-SEP-X {m4} -j RETURN"),
        Unvetted,
    );
    refused(
        V4,
        nat,
        &format!("-m recent --set --name KUBE-SEP-X {m6} -j RETURN"),
        Refused,
    );
    refused(
        V4,
        nat,
        "-m recent --set --name KUBE-SEP-X --mask 255.0.255.0 --rsource -j RETURN",
        Unvetted,
    );
    refused(
        V4,
        nat,
        "-m recent --set --name KUBE-SEP-X -j RETURN",
        Unvetted,
    );
}

#[test]
fn marks_states_and_targets() {
    use Problem::*;
    let (f, nat) = (Table::Filter, Table::Nat);
    accepted(V4, nat, "-m mark ! --mark 0x4000/0x4000 -j RETURN");
    accepted(V4, nat, "-j MARK --set-xmark 0x80000000/0x80000000");
    accepted(V4, nat, "-j MARK --set-xmark 0x4000/0x0");
    refused(
        V4,
        nat,
        "-j MARK --set-xmark 0x100000000/0x100000000",
        Refused,
    );
    refused(V4, nat, "-j MARK --set-xmark 0x4000", NotCanonical);
    refused(V4, nat, "-j MARK --set-xmark 0x04000/0x4000", NotCanonical);
    refused(V4, nat, "-j MARK --set-xmark 0X4000/0x4000", NotCanonical);
    refused(V4, nat, "-j MARK --or-mark 0x4000", Unvetted);
    accepted(
        V4,
        f,
        "-m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP",
    );
    accepted(V4, f, "-m conntrack --ctstate INVALID -j DROP");
    refused(
        V4,
        f,
        "-m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
        NotCanonical,
    );
    refused(V4, f, "-m conntrack --ctstate BOGUS -j ACCEPT", Refused);
    accepted(V4, f, "-j REJECT --reject-with icmp-port-unreachable");
    accepted(V6, f, "-j REJECT --reject-with icmp6-port-unreachable");
    refused(
        V4,
        f,
        "-j REJECT --reject-with icmp6-port-unreachable",
        Refused,
    );
    refused(
        V6,
        f,
        "-j REJECT --reject-with icmp-port-unreachable",
        Refused,
    );
    refused(V4, f, "-j REJECT", Unvetted);
    refused(V4, f, "-j REJECT --reject-with tcp-reset", Unvetted);
    refused(
        V4,
        nat,
        "-j REJECT --reject-with icmp-port-unreachable",
        Refused,
    );
    accepted(V4, nat, "-j MASQUERADE --random-fully");
    refused(V4, f, "-j MASQUERADE --random-fully", Refused);
    accepted(
        V4,
        nat,
        "! -d 127.0.0.0/8 -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS",
    );
    accepted(V4, nat, "-m addrtype --src-type LOCAL -j KUBE-MARK-MASQ");
    refused(
        V4,
        nat,
        "-m addrtype --dst-type UNICAST -j RETURN",
        Unvetted,
    );
    refused(V4, nat, "-m addrtype -j RETURN", Unvetted);
    refused(V4, f, "-j ACCEPT --now", Refused);
    refused(V4, f, "! -j ACCEPT", Refused);
    refused(V4, f, "-m owner --uid-owner 0 -j ACCEPT", Unvetted);
    refused(V4, f, "-j LOG", Unvetted);
    // A rule without a target (the last rule of a KUBE-FW chain) is fine.
    accepted(V4, nat, "-m comment --comment \"other traffic\"");
}

#[test]
fn chain_names_up_to_28_characters_not_named_like_targets() {
    use Problem::*;
    let name = |n: &str| chain_name(n).map_err(|e| e.problem);
    assert_eq!(name("KUBE-SVC-ABCDEFGHIJKLMNOPQRS"), Ok(()));
    assert_eq!(name("KUBE-SVC-ABCDEFGHIJKLMNOPQRST"), Err(Refused));
    assert_eq!(name(""), Err(Refused));
    assert_eq!(name("-X"), Err(RefusedByNft));
    assert_eq!(name("ACCEPT"), Err(Refused));
    assert_eq!(name("DNAT"), Err(Unvetted));
    assert_eq!(name("a b"), Err(Unvetted));
    assert_eq!(name("KUBE-!X"), Err(Unvetted));
    // Jump targets and the chain a rule is added to are checked too.
    refused(V4, Table::Nat, "-j KUBE-SVC-ABCDEFGHIJKLMNOPQRST", Refused);
    assert_eq!(
        rule(V4, Table::Nat, "KUBE-SVC-ABCDEFGHIJKLMNOPQRST", "-j RETURN").map_err(|e| e.problem),
        Err(Refused)
    );
}

#[test]
fn lines_and_argument_counts_stay_within_what_the_tools_parse() {
    use Problem::*;
    let f = Table::Filter;
    let comments = |n: usize, len: usize| {
        let c = "a".repeat(len);
        let mut r: String = (0..n)
            .map(|_| format!("-m comment --comment {c} "))
            .collect();
        r.push_str("-j RETURN");
        r
    };
    // Four arguments a comment, two for the target.
    accepted(V4, f, &comments(31, 1));
    refused(V4, f, &comments(32, 1), Unvetted);
    refused(V4, f, &comments(62, 1), Refused);
    accepted(V4, f, &comments(31, 250));
    let long = comments(40, 255);
    assert!(long.len() > MAX_LINE);
    assert_eq!(
        rule(V4, f, "KUBE-TEST", &long).map_err(|e| e.detail),
        Err(format!(
            "the rule's line is {} bytes; the limit is {MAX_LINE}",
            long.len() + "-A KUBE-TEST ".len()
        ))
    );
}

/// Every rule the planner renders for the flow fixture and 120 synthetic Services, with every
/// option, both families, and the applier's jump rules: all pass.
#[test]
fn every_shape_the_renderer_emits_passes() {
    let mut objects = kp_flows::objects();
    objects.extend(kp_flows::synthetic::cluster(120, 10));
    let state = kp_flows::load(kp_flows::NODE, objects);
    let mut node = kp_flows::node_context();
    for (all, localhost, bit, ports) in [
        (false, false, 14, vec![]),
        (
            true,
            true,
            0,
            vec!["192.0.2.0/24", "127.0.0.1/32", "2001:db8::/64"],
        ),
        (true, false, 31, vec!["0.0.0.0/0", "::/0"]),
    ] {
        node.node_port_addresses = ports.iter().map(|p| p.parse().unwrap()).collect();
        for family in [V4, V6] {
            let mut cfg = PlanConfig::new(family);
            cfg.masquerade_all = all;
            cfg.localhost_node_ports = localhost;
            cfg.masquerade_bit = bit;
            let mut planner = Planner::new(cfg);
            let r = planner.full(&state, &node).materialize();
            assert_eq!(r.errors, [], "{family:?}");
            for ((table, chain), rules) in planner.expected(&state) {
                for r in rules {
                    rule(family, table, &chain, &r)
                        .unwrap_or_else(|e| panic!("{family:?} {chain}: {r}: {e}"));
                }
            }
            for j in planner.jump_rules() {
                let table = if j.table == "nat" {
                    Table::Nat
                } else {
                    Table::Filter
                };
                rule(family, table, j.chain, &j.args)
                    .unwrap_or_else(|e| panic!("jump {}: {}: {e}", j.chain, j.args));
            }
        }
    }
}
