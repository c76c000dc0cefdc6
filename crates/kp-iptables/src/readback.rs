//! Reading `iptables-save` output back: parsing it, putting rules in one canonical spelling,
//! and comparing the chains we own with the planner's.
//!
//! `iptables-save` prints a rule in its own order and spelling, whatever the input was: the
//! address, interface and protocol options first (`! -s`, `-d`, `-i`, `-o`, `-p`) with a mask
//! on every address, every comment in double quotes, a statistic probability as the kernel's
//! 31-bit fraction printed with 11 decimals (`0.3333333333` comes back as `0.33333333349`),
//! `MARK --or-mark X` as `--set-xmark X/X`, `--xor-mark X` as `--set-xmark X/0x0`, and `REJECT`
//! with its default `--reject-with`. [`canonical`] maps both sides to one spelling, so a
//! comparison finds only real differences. (Captured with iptables 1.8.9, both backends print
//! identically.)

use std::collections::{BTreeMap, BTreeSet};

use kp_core::model::IpFamily;

use crate::Error;

/// One table as `iptables-save -t TABLE` printed it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SavedTable {
    /// Every chain, built-in or not, with its rules as the arguments after `-A CHAIN `, in
    /// order.
    pub chains: BTreeMap<String, Vec<String>>,
    /// The built-in chains (those with a policy).
    pub builtin: BTreeSet<String>,
}

/// Parses `iptables-save` output. With `table`, only that table's section is read (the tools
/// print nothing else when asked for one table, but a full dump holds several).
pub fn parse_save(text: &str, table: &str) -> Result<SavedTable, Error> {
    let mut out = SavedTable::default();
    let mut inside = false;
    for (i, line) in text.lines().enumerate() {
        if let Some(t) = line.strip_prefix('*') {
            inside = t.trim() == table;
            continue;
        }
        if !inside || line.is_empty() || line.starts_with('#') || line == "COMMIT" {
            continue;
        }
        if let Some(decl) = line.strip_prefix(':') {
            let mut words = decl.split_whitespace();
            let name = words.next().unwrap_or_default();
            if words.next().is_some_and(|policy| policy != "-") {
                out.builtin.insert(name.to_string());
            }
            out.chains.entry(name.to_string()).or_default();
        } else if let Some(rule) = line.strip_prefix("-A ") {
            let (chain, args) = rule.split_once(' ').unwrap_or((rule, ""));
            out.chains
                .entry(chain.to_string())
                .or_default()
                .push(args.to_string());
        } else {
            return Err(Error::Parse(format!(
                "iptables-save line {}: unexpected `{}`",
                i + 1,
                line.chars().take(200).collect::<String>()
            )));
        }
    }
    Ok(out)
}

/// Splits rule arguments as a shell would for the simple quoting iptables uses: words
/// separated by spaces, `"…"` or `'…'` grouping words, backslash escaping the next character.
pub fn split_args(args: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut quote: Option<char> = None;
    let mut chars = args.chars();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some('"'), '\\') | (None, '\\') => {
                if let Some(n) = chars.next() {
                    word.push(n);
                }
                in_word = true;
            }
            (Some(_), c) => word.push(c),
            (None, '"' | '\'') => {
                quote = Some(c);
                in_word = true;
            }
            (None, c) if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            (None, c) => {
                word.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        words.push(word);
    }
    words
}

/// Joins words back, double-quoting those that need it, as `iptables-save` does.
fn join_args(words: &[String]) -> String {
    let mut out = String::new();
    for (i, w) in words.iter().enumerate() {
        if i > 0 {
            out.push(' ');
        }
        if w.is_empty()
            || w.chars()
                .any(|c| c.is_whitespace() || c == '"' || c == '\'')
        {
            out.push('"');
            for c in w.chars() {
                if c == '"' || c == '\\' {
                    out.push('\\');
                }
                out.push(c);
            }
            out.push('"');
        } else {
            out.push_str(w);
        }
    }
    out
}

/// The options `iptables-save` prints first, in its order, with their long spellings.
const BASE_OPTIONS: [(&str, &str); 5] = [
    ("-s", "--source"),
    ("-d", "--destination"),
    ("-i", "--in-interface"),
    ("-o", "--out-interface"),
    ("-p", "--protocol"),
];

/// A statistic probability as the kernel holds it: `round(p · 2³¹)`, printed back the way
/// `iptables-save` prints it.
fn canonical_probability(p: &str) -> Option<String> {
    let v: f64 = p.parse().ok()?;
    if !(0.0..=1.0).contains(&v) {
        return None;
    }
    let fraction = (v * 2_147_483_648.0).round();
    Some(format!("{:.11}", fraction / 2_147_483_648.0))
}

/// Adds the full-length mask `iptables-save` prints to a bare address.
fn with_mask(addr: &str, family: IpFamily) -> String {
    if addr.contains('/') {
        return addr.to_string();
    }
    match family {
        IpFamily::V4 => format!("{addr}/32"),
        IpFamily::V6 => format!("{addr}/128"),
    }
}

/// One spelling for a rule (the arguments after `-A CHAIN `), whichever of ours or
/// `iptables-save`'s it was written in. Two rules the kernel holds identically map to the same
/// string; what this does not know it leaves as it is.
pub fn canonical(rule: &str, family: IpFamily) -> String {
    let words = split_args(rule);
    let mut base: [Option<(bool, String)>; 5] = Default::default();
    let mut rest: Vec<String> = Vec::with_capacity(words.len());
    let mut i = 0;
    while i < words.len() {
        let negated = words[i] == "!";
        let at = if negated { i + 1 } else { i };
        let slot = words.get(at).and_then(|w| {
            BASE_OPTIONS
                .iter()
                .position(|(short, long)| w == short || w == long)
        });
        if let (Some(slot), Some(value)) = (slot, words.get(at + 1)) {
            let value = match slot {
                0 | 1 => with_mask(value, family),
                4 => value.to_ascii_lowercase(),
                _ => value.clone(),
            };
            base[slot] = Some((negated, value));
            i = at + 2;
            continue;
        }
        rest.push(words[i].clone());
        i += 1;
    }

    let mut out: Vec<String> = Vec::with_capacity(words.len() + 2);
    for (slot, b) in base.iter().enumerate() {
        if let Some((negated, value)) = b {
            if *negated {
                out.push("!".into());
            }
            out.push(BASE_OPTIONS[slot].0.into());
            out.push(value.clone());
        }
    }
    let mut target: Option<String> = None;
    let mut has_reject_with = false;
    let mut j = 0;
    while j < rest.len() {
        let w = rest[j].as_str();
        let next = rest.get(j + 1);
        match (w, next) {
            ("-j", Some(t)) => {
                target = Some(t.clone());
                out.push(rest[j].clone());
                out.push(t.clone());
                j += 2;
            }
            ("--probability", Some(p)) => {
                out.push(rest[j].clone());
                out.push(canonical_probability(p).unwrap_or_else(|| p.clone()));
                j += 2;
            }
            ("--or-mark", Some(m)) if target.as_deref() == Some("MARK") => {
                out.push("--set-xmark".into());
                out.push(format!("{m}/{m}"));
                j += 2;
            }
            ("--xor-mark", Some(m)) if target.as_deref() == Some("MARK") => {
                out.push("--set-xmark".into());
                out.push(format!("{m}/0x0"));
                j += 2;
            }
            ("--set-mark", Some(m)) if target.as_deref() == Some("MARK") && !m.contains('/') => {
                out.push("--set-xmark".into());
                out.push(format!("{m}/0xffffffff"));
                j += 2;
            }
            _ => {
                has_reject_with |= w == "--reject-with";
                out.push(rest[j].clone());
                j += 1;
            }
        }
    }
    if target.as_deref() == Some("REJECT") && !has_reject_with {
        out.push("--reject-with".into());
        out.push(
            match family {
                IpFamily::V4 => "icmp-port-unreachable",
                IpFamily::V6 => "icmp6-port-unreachable",
            }
            .into(),
        );
    }
    join_args(&out)
}

/// Compares the chains we own in one table with the plan. `expected` holds every chain we
/// planned in this table; `present` the chains we own that the kernel holds (planned or
/// leftover); `kernel` the rules of those whose content was read (all of them, or a sample when
/// reading everything would cost too much). Returns one line per difference.
pub fn compare(
    label: &str,
    expected: &BTreeMap<String, Vec<String>>,
    present: &BTreeSet<String>,
    kernel: &BTreeMap<String, Vec<String>>,
    family: IpFamily,
) -> Vec<String> {
    let mut diffs = Vec::new();
    for (chain, want) in expected {
        if !present.contains(chain) {
            diffs.push(format!("{label}: chain {chain} is missing"));
            continue;
        }
        if let Some(have) = kernel.get(chain) {
            if let Some(d) = compare_rules(want, have, family) {
                diffs.push(format!("{label}: chain {chain}: {d}"));
            }
        }
    }
    for chain in present.iter().filter(|c| !expected.contains_key(*c)) {
        diffs.push(format!(
            "{label}: chain {chain} is not planned (a leftover)"
        ));
    }
    diffs
}

pub(crate) fn compare_rules(want: &[String], have: &[String], family: IpFamily) -> Option<String> {
    let n = want.len().max(have.len());
    for i in 0..n {
        if want.get(i) == have.get(i) {
            continue;
        }
        let w = want.get(i).map(|r| canonical(r, family));
        let h = have.get(i).map(|r| canonical(r, family));
        if w != h {
            return Some(format!(
                "rule {} differs ({} planned, {} in the kernel)\n    planned: {}\n    kernel:  {}",
                i + 1,
                want.len(),
                have.len(),
                w.as_deref().unwrap_or("(none)"),
                h.as_deref().unwrap_or("(none)"),
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `iptables-nft-save -t nat` after restoring upstream-style rules (iptables 1.8.9, kernel
    /// 6.18, scratch namespace; iptables-legacy-save printed the same lines).
    const SAVED: &str = r#"# Generated by iptables-nft-save v1.8.9 (nf_tables) on Sat Nov 21 08:37:45 2026
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-SVC-X - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0
-A KUBE-SVC-X ! -s 10.0.0.0/8 -d 172.30.0.41/32 -p tcp -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp --dport 80 -j KUBE-MARK-MASQ
-A KUBE-SVC-X -m comment --comment "ns1/svc1:p80 -> 10.180.0.1:80" -m statistic --mode random --probability 0.10000000009 -j KUBE-SEP-Y
-A KUBE-SVC-X -m comment --comment "ns1/svc1:p80" -j KUBE-SEP-Z
COMMIT
# Completed on Sat Nov 21 08:37:45 2026
"#;

    #[test]
    fn save_output_parses_into_chains_and_rules() {
        let t = parse_save(SAVED, "nat").unwrap();
        assert_eq!(t.builtin.len(), 4);
        assert!(t.builtin.contains("PREROUTING"));
        assert_eq!(t.chains["KUBE-SVC-X"].len(), 3);
        assert_eq!(
            t.chains["KUBE-POSTROUTING"],
            ["-j MARK --set-xmark 0x4000/0x0"]
        );
        assert_eq!(t.chains.len(), 7);
        // Another table's section is not this one.
        assert!(parse_save(SAVED, "filter").unwrap().chains.is_empty());
        assert!(parse_save("*nat\nbogus\nCOMMIT\n", "nat").is_err());
    }

    #[test]
    fn our_spelling_and_the_saved_one_are_the_same_rule() {
        let t = parse_save(SAVED, "nat").unwrap();
        let ours = [
            "-m comment --comment \"ns1/svc1:p80 cluster IP\" -m tcp -p tcp -d 172.30.0.41 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ",
            "-m comment --comment \"ns1/svc1:p80 -> 10.180.0.1:80\" -m statistic --mode random --probability 0.1000000000 -j KUBE-SEP-Y",
            "-m comment --comment ns1/svc1:p80 -j KUBE-SEP-Z",
        ];
        // Base options move first, but the matches keep their order: this one is spelled
        // like save except for the base options.
        let saved: Vec<String> = t.chains["KUBE-SVC-X"]
            .iter()
            .map(|r| canonical(r, IpFamily::V4))
            .collect();
        assert_eq!(canonical(ours[1], IpFamily::V4), saved[1]);
        assert_eq!(canonical(ours[2], IpFamily::V4), saved[2]);
        assert_eq!(
            canonical(
                "! -s 10.0.0.0/8 -d 172.30.0.41 -p TCP -m comment --comment \"ns1/svc1:p80 cluster IP\" -m tcp --dport 80 -j KUBE-MARK-MASQ",
                IpFamily::V4
            ),
            saved[0]
        );
        assert_eq!(
            canonical("-j MARK --or-mark 0x4000", IpFamily::V4),
            canonical(&t.chains["KUBE-MARK-MASQ"][0], IpFamily::V4)
        );
        assert_eq!(
            canonical("-j MARK --xor-mark 0x4000", IpFamily::V4),
            canonical(&t.chains["KUBE-POSTROUTING"][0], IpFamily::V4)
        );
        assert_eq!(
            canonical("-d fd00::1 -p tcp -m tcp --dport 80 -j REJECT", IpFamily::V6),
            canonical(
                "-d fd00::1/128 -p tcp -m tcp --dport 80 -j REJECT --reject-with icmp6-port-unreachable",
                IpFamily::V6
            )
        );
    }

    #[test]
    fn real_differences_survive_canonicalisation() {
        let f = IpFamily::V4;
        let pairs = [
            ("-d 10.0.0.1/32 -j X", "-d 10.0.0.2/32 -j X"),
            ("! -s 10.0.0.0/8 -j X", "-s 10.0.0.0/8 -j X"),
            (
                "-m statistic --mode random --probability 0.5000000000 -j X",
                "-m statistic --mode random --probability 0.3333333333 -j X",
            ),
            (
                "-m comment --comment \"a b\" -j X",
                "-m comment --comment \"a  b\" -j X",
            ),
            ("-j MARK --or-mark 0x4000", "-j MARK --or-mark 0x8000"),
            ("-j REJECT", "-j REJECT --reject-with tcp-reset"),
            (
                "-j DNAT --to-destination 10.0.0.1:80",
                "-j DNAT --to-destination 10.0.0.1:81",
            ),
        ];
        for (a, b) in pairs {
            assert_ne!(canonical(a, f), canonical(b, f), "{a} vs {b}");
        }
    }

    #[test]
    fn probabilities_compare_as_the_kernel_stores_them() {
        // Rule i of n uses 1/(n-i) printed with 10 decimals; iptables stores
        // lround(value * 2^31) of the printed value, and save prints that fraction with 11.
        for n in 2..200u32 {
            let ours = format!("{:.10}", 1.0 / f64::from(n));
            let parsed: f64 = ours.parse().unwrap();
            let stored = (parsed * 2_147_483_648.0).round() / 2_147_483_648.0;
            let saved = format!("{stored:.11}");
            assert_eq!(
                canonical_probability(&ours),
                canonical_probability(&saved),
                "1/{n}"
            );
        }
        assert_eq!(
            canonical_probability("0.3333333333").unwrap(),
            "0.33333333349"
        );
        assert_eq!(canonical_probability("2"), None);
    }

    #[test]
    fn quoting_round_trips() {
        let words =
            split_args(r#"-m comment --comment "ns/a:b -> 1.2.3.4:80" -m x --y 'single q' -j Z"#);
        assert_eq!(
            words,
            [
                "-m",
                "comment",
                "--comment",
                "ns/a:b -> 1.2.3.4:80",
                "-m",
                "x",
                "--y",
                "single q",
                "-j",
                "Z"
            ]
        );
        assert_eq!(split_args(join_args(&words).as_str()), words);
        assert_eq!(split_args(r#"--comment "say \"hi\"""#)[1], "say \"hi\"");
        assert_eq!(split_args(r#"--comment """#), ["--comment", ""]);
        assert!(split_args("   ").is_empty());
    }

    #[test]
    fn comparison_reports_missing_changed_and_leftover_chains() {
        let chains = |v: &[(&str, &[&str])]| -> BTreeMap<String, Vec<String>> {
            v.iter()
                .map(|(c, r)| (c.to_string(), r.iter().map(|s| s.to_string()).collect()))
                .collect()
        };
        let want = chains(&[
            ("KUBE-SVC-A", &["-j KUBE-SEP-A"]),
            (
                "KUBE-SEP-A",
                &["-p tcp -j DNAT --to-destination 10.0.0.1:80"],
            ),
            ("KUBE-MARK-MASQ", &["-j MARK --or-mark 0x4000"]),
        ]);
        let have = chains(&[
            ("KUBE-SVC-A", &["-j KUBE-SEP-A", "-j KUBE-SEP-B"]),
            ("KUBE-SEP-B", &[]),
            ("KUBE-MARK-MASQ", &["-j MARK --set-xmark 0x4000/0x4000"]),
        ]);
        let names =
            |m: &BTreeMap<String, Vec<String>>| -> BTreeSet<String> { m.keys().cloned().collect() };
        let d = compare("ip nat", &want, &names(&have), &have, IpFamily::V4);
        assert_eq!(d.len(), 3, "{d:#?}");
        assert!(d[0].contains("KUBE-SEP-A is missing"), "{d:#?}");
        assert!(
            d[1].contains("KUBE-SVC-A: rule 2 differs (1 planned, 2 in the kernel)"),
            "{d:#?}"
        );
        assert!(d[2].contains("KUBE-SEP-B is not planned"), "{d:#?}");
        assert!(compare("ip nat", &want, &names(&want), &want, IpFamily::V4).is_empty());
        // A chain whose content was not read (outside a sample) is only checked for presence.
        let mut partial = have.clone();
        partial.remove("KUBE-SVC-A");
        let d = compare("ip nat", &want, &names(&have), &partial, IpFamily::V4);
        assert_eq!(d.len(), 2, "{d:#?}");
    }
}
