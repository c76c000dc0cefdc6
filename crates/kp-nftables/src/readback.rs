//! Reading our table back from the kernel (`nft -j list table`) into the planner's terms, so it
//! can be compared with what the planner believes the kernel holds.
//!
//! [`KernelTable`] and [`canonical`] are the planner's (it adopts a table read back); they are
//! re-exported here for the readers' callers.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::model::Protocol;
pub use kp_nftables_plan::element::canonical;
use kp_nftables_plan::element::{Atom, NoEndpointVerdict, Tuple};
pub use kp_nftables_plan::KernelTable;
use serde_json::Value;

use crate::Error;

fn atom(v: &Value) -> Result<Vec<Atom>, Error> {
    let bad = || Error::Parse(format!("unexpected element component {v}"));
    Ok(match v {
        Value::Number(n) => {
            let n = n.as_u64().ok_or_else(bad)?;
            vec![u16::try_from(n)
                .map(Atom::Port)
                .unwrap_or(Atom::Slot(n as u32))]
        }
        Value::String(s) => {
            if let Some(p) = Protocol::ALL.iter().find(|p| p.as_lower() == s) {
                vec![Atom::Proto(*p)]
            } else {
                vec![Atom::Ip(s.parse::<IpAddr>().map_err(|_| bad())?)]
            }
        }
        Value::Object(o) => {
            if let Some(c) = o.get("concat").and_then(Value::as_array) {
                let mut out = Vec::new();
                for part in c {
                    out.extend(atom(part)?);
                }
                out
            } else if let Some(p) = o.get("prefix") {
                let addr: IpAddr = p["addr"]
                    .as_str()
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(bad)?;
                let len = p["len"].as_u64().ok_or_else(bad)? as u8;
                vec![Atom::Net(IpNet::new(addr, len).map_err(|_| bad())?)]
            } else if let Some(r) = o.get("range").and_then(Value::as_array) {
                let lo: IpAddr = r
                    .first()
                    .and_then(Value::as_str)
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(bad)?;
                let hi: IpAddr = r
                    .get(1)
                    .and_then(Value::as_str)
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(bad)?;
                vec![Atom::Net(range_to_net(lo, hi).ok_or_else(bad)?)]
            } else if let Some(e) = o.get("elem") {
                // An element with attributes (timeout, expires, comment).
                atom(&e["val"])?
            } else if o.contains_key("drop") {
                vec![Atom::Verdict(NoEndpointVerdict::Drop)]
            } else if o.get("goto").and_then(|g| g["target"].as_str())
                == Some(kp_nftables_plan::names::REJECT_PACKET)
            {
                vec![Atom::Verdict(NoEndpointVerdict::Reject)]
            } else {
                return Err(bad());
            }
        }
        _ => return Err(bad()),
    })
}

/// The network that spans exactly `lo..=hi`, if there is one.
fn range_to_net(lo: IpAddr, hi: IpAddr) -> Option<IpNet> {
    let (lo_n, hi_n, bits) = match (lo, hi) {
        (IpAddr::V4(a), IpAddr::V4(b)) => (u128::from(u32::from(a)), u128::from(u32::from(b)), 32),
        (IpAddr::V6(a), IpAddr::V6(b)) => (u128::from(a), u128::from(b), 128),
        _ => return None,
    };
    let span = hi_n.checked_sub(lo_n)?.checked_add(1)?;
    if !span.is_power_of_two() || lo_n % span != 0 {
        return None;
    }
    IpNet::new(lo, (bits - span.trailing_zeros()) as u8).ok()
}

fn tuple(v: &Value) -> Result<Tuple, Error> {
    Ok(canonical(&Tuple::new(atom(v)?)))
}

/// Parses `nft -j list table …` output of the `kube-proxy` table.
pub fn parse_table(json: &str) -> Result<KernelTable, Error> {
    parse_table_named(json, kp_nftables_plan::names::TABLE)
}

/// Parses `nft -j list table …` output, keeping the sets of table `table` (another mode's
/// table read with the same reader: the userspace mode's `kube-proxy-userspace`).
pub fn parse_table_named(json: &str, table: &str) -> Result<KernelTable, Error> {
    let doc: Value = serde_json::from_str(json).map_err(|e| Error::Parse(e.to_string()))?;
    let items = doc["nftables"]
        .as_array()
        .ok_or_else(|| Error::Parse("no nftables array".into()))?;
    let mut t = KernelTable::default();
    for item in items {
        if let Some(table) = item.get("table") {
            // nft 1.0.6 leaves the comment out; later versions print it.
            if let Some(c) = table["comment"].as_str() {
                t.comment = Some(c.to_string());
            }
        } else if let Some(c) = item.get("chain") {
            let name = c["name"].as_str().unwrap_or_default().to_string();
            t.chains.entry(name).or_default();
        } else if let Some(r) = item.get("rule") {
            let chain = r["chain"].as_str().unwrap_or_default().to_string();
            let id = r["comment"]
                .as_str()
                .unwrap_or("<rule without comment>")
                .to_string();
            t.chains.entry(chain).or_default().push(id);
        } else if let Some(s) = item.get("set").or_else(|| item.get("map")) {
            if s["table"].as_str().is_some_and(|t| t != table) {
                continue;
            }
            let name = s["name"].as_str().unwrap_or_default().to_string();
            let mut els = BTreeMap::new();
            for e in s["elem"].as_array().into_iter().flatten() {
                match e {
                    Value::Array(kv) if kv.len() == 2 => {
                        els.insert(tuple(&kv[0])?, Some(tuple(&kv[1])?));
                    }
                    other => {
                        els.insert(tuple(other)?, None);
                    }
                }
            }
            t.sets.insert(name, els);
        }
    }
    Ok(t)
}

/// Differences between what we expect and what the kernel holds, one line each.
pub fn compare(
    family: &str,
    expected_chains: &BTreeMap<String, Vec<String>>,
    expected_sets: &BTreeMap<String, Option<BTreeMap<Tuple, Option<Tuple>>>>,
    kernel: &KernelTable,
) -> Vec<String> {
    let mut diffs = Vec::new();
    let names = |m: &BTreeMap<String, Vec<String>>| m.keys().cloned().collect::<BTreeSet<_>>();
    for c in names(expected_chains).symmetric_difference(&names(&kernel.chains)) {
        diffs.push(format!(
            "{family}: chain {c} is only in the {}",
            if expected_chains.contains_key(c) {
                "plan"
            } else {
                "kernel"
            }
        ));
    }
    for (c, rules) in expected_chains {
        if let Some(k) = kernel.chains.get(c) {
            if k != rules {
                diffs.push(format!(
                    "{family}: chain {c} holds rules {k:?}, expected {rules:?}"
                ));
            }
        }
    }
    let want: BTreeSet<&String> = expected_sets.keys().collect();
    let have: BTreeSet<&String> = kernel.sets.keys().collect();
    for s in want.symmetric_difference(&have) {
        diffs.push(format!(
            "{family}: set {s} is only in the {}",
            if want.contains(s) { "plan" } else { "kernel" }
        ));
    }
    for (name, expected) in expected_sets {
        let (Some(expected), Some(actual)) = (expected, kernel.sets.get(name)) else {
            continue;
        };
        let expected: BTreeMap<Tuple, Option<Tuple>> = expected
            .iter()
            .map(|(k, v)| (canonical(k), v.as_ref().map(canonical)))
            .collect();
        if &expected != actual {
            let missing = expected
                .iter()
                .filter(|(k, v)| actual.get(*k) != Some(v))
                .count();
            let extra = actual.keys().filter(|k| !expected.contains_key(*k)).count();
            let sample = expected
                .iter()
                .find(|(k, v)| actual.get(*k) != Some(v))
                .map(|(k, _)| format!(" (e.g. {k})"))
                .or_else(|| {
                    actual
                        .keys()
                        .find(|k| !expected.contains_key(*k))
                        .map(|k| format!(" (e.g. extra {k})"))
                })
                .unwrap_or_default();
            diffs.push(format!(
                "{family}: set {name}: {missing} missing or different, {extra} unexpected{sample}"
            ));
        }
    }
    diffs
}
