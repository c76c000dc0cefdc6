//! The fake against what the tools do (as captured in `kp-iptables`'s kernel tests and the
//! tracer's own kernel check): table-by-table commits, save and listing forms, exit codes.

use kp_iptables::{parse_save, Error};

use super::*;

const V4: IpFamily = IpFamily::V4;
const NFT: Backend = Backend::Nft;

const NAT: &str = "*nat
:KUBE-SERVICES - [0:0]
:KUBE-SVC-A - [0:0]
-A KUBE-SERVICES -d 10.96.0.1/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-A
-A KUBE-SVC-A -p tcp -m recent --rcheck --seconds 60 --reap --name KUBE-SEP-A --mask 255.255.255.255 --rsource -j DNAT --to-destination 10.244.1.2:80
-A KUBE-SVC-A -p tcp -m recent --set --name KUBE-SEP-A --mask 255.255.255.255 --rsource -j DNAT --to-destination 10.244.1.2:80
-I PREROUTING -j KUBE-SERVICES
COMMIT
";

fn restore(fake: &FakeIptables, input: &str) -> Result<(), Error> {
    IptablesRunner::restore(fake, NFT, V4, input)
}

#[test]
fn save_prints_what_was_restored_as_iptables_save_does() {
    let fake = FakeIptables::default();
    assert_eq!(fake.save(NFT, V4), "", "no tables before the first write");
    restore(&fake, NAT).unwrap();
    let text = fake.save(NFT, V4);
    let nat = parse_save(&text, "nat").unwrap();
    assert!(nat.builtin.contains("PREROUTING"));
    assert_eq!(nat.chains["PREROUTING"], ["-j KUBE-SERVICES"]);
    assert_eq!(nat.chains["KUBE-SVC-A"].len(), 2);
    assert_eq!(
        nat.chains["KUBE-SERVICES"],
        ["-d 10.96.0.1/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-A"]
    );
    // The other family and the other backend are apart.
    assert!(!fake.save(NFT, IpFamily::V6).contains("KUBE-SVC-A"));
    assert_eq!(fake.save(Backend::Legacy, V4), "");
    // One table asked for, one table printed.
    let mut lines = Vec::new();
    fake.save_lines(NFT, V4, Some("filter"), &mut |l| {
        lines.push(l.to_string());
        Ok(())
    })
    .unwrap();
    assert!(lines.contains(&"*filter".to_string()));
    assert!(!lines.iter().any(|l| l == "*nat"));
}

#[test]
fn a_refused_table_changes_nothing_of_itself_and_tables_committed_before_it_stay() {
    let fake = FakeIptables::default();
    let input =
        format!("{NAT}*filter\n:KUBE-FORWARD - [0:0]\n-A KUBE-FORWARD -j KUBE-MISSING\nCOMMIT\n");
    let err = restore(&fake, &input).unwrap_err();
    match err {
        Error::Restore {
            line, failing_line, ..
        } => {
            // The tracer names the COMMIT line for a jump to a missing chain, as the kernel
            // refuses it at commit.
            let at = line.expect("a line");
            assert_eq!(at, input.lines().count());
            assert_eq!(failing_line.as_deref(), Some("COMMIT"));
        }
        other => panic!("expected a restore error, got {other:?}"),
    }
    assert!(fake.chain(NFT, V4, Table::Nat, "KUBE-SVC-A").is_some());
    assert!(fake.chain(NFT, V4, Table::Filter, "KUBE-FORWARD").is_none());
}

#[test]
fn a_restore_told_to_fail_changes_nothing_and_the_next_one_applies() {
    let fake = FakeIptables::default();
    fake.fail_restore_after(1);
    restore(&fake, "*filter\n:KUBE-FORWARD - [0:0]\nCOMMIT\n").unwrap();
    let err = restore(&fake, NAT).unwrap_err();
    assert!(matches!(err, Error::Restore { line: None, .. }), "{err:?}");
    assert!(fake.chain(NFT, V4, Table::Nat, "KUBE-SVC-A").is_none());
    restore(&fake, NAT).unwrap();
    assert!(fake.chain(NFT, V4, Table::Nat, "KUBE-SVC-A").is_some());
    assert_eq!(fake.restores(), 3);
}

#[test]
fn listing_and_creating_a_chain_answer_with_the_tools_exit_codes() {
    let fake = FakeIptables::default();
    let run = |args: &[&str]| fake.run(NFT, V4, args).unwrap();
    // Before anything is written there is no table.
    assert_eq!(run(&["-t", "nat", "-S", "PREROUTING"]).status, Some(1));
    restore(&fake, NAT).unwrap();
    let out = run(&["-t", "nat", "-S", "PREROUTING"]);
    assert_eq!(out.status, Some(0));
    assert_eq!(
        out.stdout,
        "-P PREROUTING ACCEPT\n-A PREROUTING -j KUBE-SERVICES\n"
    );
    let out = run(&["-t", "nat", "-S", "KUBE-SERVICES"]);
    assert!(out
        .stdout
        .starts_with("-N KUBE-SERVICES\n-A KUBE-SERVICES -d"));
    assert_eq!(run(&["-t", "nat", "-S", "KUBE-NOPE"]).status, Some(1));
    // The mangle canary: created once, then "already exists".
    assert_eq!(
        run(&["-t", "mangle", "-S", "KUBE-PROXY-CANARY"]).status,
        Some(1)
    );
    assert_eq!(
        run(&["-t", "mangle", "-N", "KUBE-PROXY-CANARY"]).status,
        Some(0)
    );
    let again = run(&["-t", "mangle", "-N", "KUBE-PROXY-CANARY"]);
    assert_eq!(again.status, Some(1));
    assert!(again.stderr.contains("already exists"));
    assert_eq!(
        run(&["-t", "mangle", "-S", "KUBE-PROXY-CANARY"]).stdout,
        "-N KUBE-PROXY-CANARY\n"
    );
    assert!(fake.save(NFT, V4).contains(":KUBE-PROXY-CANARY - [0:0]"));
    // What the fake does not model fails loudly.
    assert_eq!(run(&["-t", "nat", "-L"]).status, Some(2));
    // A restore deletes a mangle chain; deleting a missing one is refused.
    restore(&fake, "*mangle\n-X KUBE-PROXY-CANARY\nCOMMIT\n").unwrap();
    assert!(restore(&fake, "*mangle\n-X KUBE-PROXY-CANARY\nCOMMIT\n").is_err());
}

#[test]
fn the_nft_listing_names_every_chain_and_marks_the_built_in_ones() {
    let fake = FakeIptables::default();
    restore(&fake, NAT).unwrap();
    let mut lines = Vec::new();
    fake.nft_chain_lines(V4, &mut |l| {
        lines.push(l.to_string());
        Ok(())
    })
    .unwrap();
    let text = lines.join("\n");
    assert!(text.contains("table ip nat {"), "{text}");
    let at = |needle: &str| {
        lines
            .iter()
            .position(|l| l.trim() == needle)
            .unwrap_or_else(|| panic!("{needle} not in\n{text}"))
    };
    let pre = at("chain PREROUTING {");
    assert!(
        lines[pre + 1].contains("type nat hook prerouting"),
        "{text}"
    );
    let svc = at("chain KUBE-SVC-A {");
    assert_eq!(lines[svc + 1].trim(), "}");
    // Only the nft backend is listed by nft.
    let legacy = FakeIptables::default();
    IptablesRunner::restore(&legacy, Backend::Legacy, V4, NAT).unwrap();
    let mut seen = 0;
    legacy
        .nft_chain_lines(V4, &mut |_| {
            seen += 1;
            Ok(())
        })
        .unwrap();
    assert_eq!(seen, 0);
}

#[test]
fn a_recent_list_is_purged_with_the_last_rule_that_names_it() {
    let fake = FakeIptables::default();
    restore(&fake, NAT).unwrap();
    assert!(fake.take_purged_recent().is_empty());
    // Rewritten in one commit: the list is named throughout, nothing is purged.
    restore(&fake, NAT).unwrap();
    assert!(fake.take_purged_recent().is_empty());
    // Flushed: its last rules went.
    restore(&fake, "*nat\n:KUBE-SVC-A - [0:0]\nCOMMIT\n").unwrap();
    assert_eq!(fake.take_purged_recent(), [(V4, "KUBE-SEP-A".to_string())]);
}

#[test]
fn sysctls_are_recorded() {
    let fake = FakeIptables::default();
    assert_eq!(fake.sysctl_value("net.ipv4.conf.all.route_localnet"), None);
    IptablesRunner::sysctl(&fake, "net.ipv4.conf.all.route_localnet", "1").unwrap();
    assert_eq!(
        fake.sysctl_value("net.ipv4.conf.all.route_localnet")
            .as_deref(),
        Some("1")
    );
}
