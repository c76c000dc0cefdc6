//! Replaying nft transactions into a model of one table: the part of a tracer that is the
//! same whatever rules the table holds. [`crate::NftTracer`] (the nftables mode's `ip`/`ip6`
//! tables) and `kp-userspace-test`'s tracer (the userspace mode's `inet` table) both read
//! their transactions with [`statements`] and keep each table as a [`Table`] of their own rule
//! model ([`RuleModel`]); they differ only in the rule shapes they know and in how they walk a
//! packet through them.

use std::collections::HashMap;

use crate::elements::{apply_elements, split_name, ElementTextError, Elements};

/// Why a tracer refused a transaction.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TraceError {
    /// A statement or rule shape the tracer does not know.
    #[error("line {line}: unsupported {what}: {text}")]
    Unsupported {
        /// 1-based line in the transaction.
        line: usize,
        /// What kind of thing.
        what: &'static str,
        /// The offending text.
        text: String,
    },
    /// A statement refers to an object that does not exist, or changes an element wrongly.
    #[error("line {line}: {reason}")]
    Invalid {
        /// 1-based line in the transaction (0: found after the whole transaction).
        line: usize,
        /// What is wrong.
        reason: String,
    },
}

/// One statement of a transaction: `VERB WHAT FAMILY TABLE REST`.
#[derive(Clone, Copy, Debug)]
pub struct Statement<'a> {
    /// 1-based line in the transaction.
    pub line: usize,
    /// The whole statement, trimmed.
    pub text: &'a str,
    /// `add`, `delete`, …
    pub verb: &'a str,
    /// `table`, `chain`, `set`, `map`, `element`, `rule`, …
    pub what: &'a str,
    /// The table's family as written (`ip`, `ip6`, `inet`).
    pub family: &'a str,
    /// The table's name.
    pub table: &'a str,
    /// Everything after the table's name.
    pub rest: &'a str,
}

impl Statement<'_> {
    /// The statement holds a `what` the tracer does not know.
    pub fn unsupported(&self, what: &'static str) -> TraceError {
        TraceError::Unsupported {
            line: self.line,
            what,
            text: self.text.to_string(),
        }
    }

    /// The statement is wrong for the table it changes.
    pub fn invalid(&self, reason: String) -> TraceError {
        TraceError::Invalid {
            line: self.line,
            reason,
        }
    }

    /// The comment of an `add table … { comment "…"; }`.
    pub fn table_comment(&self) -> Option<&str> {
        self.rest
            .split_once("comment \"")
            .and_then(|(_, c)| c.split_once('"'))
            .map(|(c, _)| c)
    }
}

/// The statements of a transaction, blank lines skipped.
pub fn statements(text: &str) -> impl Iterator<Item = Statement<'_>> {
    text.lines().enumerate().filter_map(|(i, raw)| {
        let text = raw.trim();
        if text.is_empty() {
            return None;
        }
        let mut words = text.splitn(5, ' ');
        let mut next = || words.next().unwrap_or("");
        Some(Statement {
            line: i + 1,
            text,
            verb: next(),
            what: next(),
            family: next(),
            table: next(),
            rest: next(),
        })
    })
}

/// A netfilter hook a base chain is attached to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Hook {
    /// `prerouting`
    Prerouting,
    /// `input`
    Input,
    /// `forward`
    Forward,
    /// `output`
    Output,
    /// `postrouting`
    Postrouting,
}

/// What makes a chain a base chain: `(nat, hook, priority)`.
pub type Base = (bool, Hook, i32);

/// Parses a base chain's declaration, `type nat hook prerouting priority dstnat - 10; policy
/// accept;` (named priorities as nft spells them). A policy other than `accept` is refused:
/// no planner of ours drops by policy.
pub fn parse_base(body: &str) -> Option<Base> {
    let mut parts = body.split(';').map(str::trim).filter(|p| !p.is_empty());
    let w: Vec<&str> = parts.next()?.split_whitespace().collect();
    match parts.next() {
        None | Some("policy accept") => {}
        Some(_) => return None,
    }
    if parts.next().is_some() || w.len() < 6 || (w[0], w[2], w[4]) != ("type", "hook", "priority") {
        return None;
    }
    let nat = match w[1] {
        "nat" => true,
        "filter" => false,
        _ => return None,
    };
    let hook = match w[3] {
        "prerouting" => Hook::Prerouting,
        "input" => Hook::Input,
        "forward" => Hook::Forward,
        "output" => Hook::Output,
        "postrouting" => Hook::Postrouting,
        _ => return None,
    };
    // The standard priority names nft prints for the `ip`/`ip6` families (a listing may name
    // any of them, with an offset, for a numeric priority near it).
    let named = match w[5] {
        "raw" => -300,
        "mangle" => -150,
        "dstnat" => -100,
        "srcnat" => 100,
        "filter" => 0,
        "security" => 50,
        n => n.parse().ok()?,
    };
    let priority = match (w.get(6), w.get(7), w.len()) {
        (Some(&"+"), Some(n), 8) => named + n.parse::<i32>().ok()?,
        (Some(&"-"), Some(n), 8) => named - n.parse::<i32>().ok()?,
        (None, None, 6) => named,
        _ => return None,
    };
    Some((nat, hook, priority))
}

/// A tracer's model of one rule: how it is parsed, and what it refers to.
pub trait RuleModel: Sized {
    /// Parses a rule's body (after `add rule FAMILY TABLE CHAIN `, its comment taken off);
    /// `None` for a shape the tracer does not know.
    fn parse(body: &str, comment: Option<&str>) -> Option<Self>;
    /// The sets and maps the rule looks up or updates.
    fn sets(&self) -> Vec<&str>;
    /// The chains the rule jumps or goes to.
    fn chains(&self) -> Vec<&str>;
    /// Whether the tracer knows a set (`map` false) or map declared with `body`.
    fn knows_set(_map: bool, _body: &str) -> bool {
        true
    }
}

/// A chain as replayed.
#[derive(Clone, Debug)]
pub struct Chain<R> {
    /// What makes it a base chain, if it is one.
    pub base: Option<Base>,
    /// Its rules, in order.
    pub rules: Vec<R>,
}

/// A set or map as replayed.
#[derive(Clone, Debug)]
pub struct SetModel {
    /// A map (elements have values) or a set.
    pub map: bool,
    /// The `timeout` the set was declared with, in seconds.
    pub timeout: Option<u32>,
    /// Its elements, spelled as the kernel's read-back spells them.
    pub elements: Elements,
}

/// A table as replayed.
#[derive(Clone, Debug)]
pub struct Table<R> {
    /// Its chains by name.
    pub chains: HashMap<String, Chain<R>>,
    /// Its sets and maps by name.
    pub sets: HashMap<String, SetModel>,
    /// The table's comment, from `add table … { comment "…"; }`.
    pub comment: Option<String>,
}

impl<R> Default for Table<R> {
    fn default() -> Self {
        Table {
            chains: HashMap::new(),
            sets: HashMap::new(),
            comment: None,
        }
    }
}

impl<R: RuleModel> Table<R> {
    /// Applies a statement that changes the table's content (chains, sets, elements, rules);
    /// `add table`/`delete table` are the caller's, which knows how its tables are keyed.
    pub fn apply(&mut self, st: &Statement<'_>) -> Result<(), TraceError> {
        match (st.verb, st.what) {
            ("add", "chain") => {
                let (name, body) = split_name(st.rest);
                let base = match body {
                    None => None,
                    Some(b) => Some(parse_base(b).ok_or_else(|| st.unsupported("chain"))?),
                };
                self.chains.entry(name.to_string()).or_insert(Chain {
                    base,
                    rules: Vec::new(),
                });
            }
            ("add", "set") | ("add", "map") => {
                let map = st.what == "map";
                let (name, body) = split_name(st.rest);
                let body = body.ok_or_else(|| st.unsupported("set"))?;
                if !R::knows_set(map, body) {
                    return Err(st.unsupported("set"));
                }
                let timeout = body
                    .split(';')
                    .map(str::trim)
                    .find_map(|p| p.strip_prefix("timeout "))
                    .and_then(|t| t.trim_end_matches('s').parse().ok());
                self.sets.entry(name.to_string()).or_insert(SetModel {
                    map,
                    timeout,
                    elements: Elements::new(),
                });
            }
            ("add", "element") | ("delete", "element") => {
                let (name, body) = split_name(st.rest);
                let set = self
                    .sets
                    .get_mut(name)
                    .ok_or_else(|| st.invalid(format!("no set {name}")))?;
                apply_elements(
                    &mut set.elements,
                    set.map,
                    st.verb == "add",
                    body.unwrap_or(""),
                )
                .map_err(|e| match e {
                    ElementTextError::Unsupported(what) => st.unsupported(what),
                    e => st.invalid(format!("{name}: {e}")),
                })?;
            }
            ("add", "rule") => {
                let (chain, body) = st
                    .rest
                    .split_once(' ')
                    .ok_or_else(|| st.unsupported("rule"))?;
                let (body, comment) = match body.rsplit_once(" comment \"") {
                    Some((b, c)) => (b, Some(c.trim_end_matches('"'))),
                    None => (body, None),
                };
                let rule = R::parse(body, comment).ok_or_else(|| st.unsupported("rule"))?;
                self.chains
                    .get_mut(chain)
                    .ok_or_else(|| st.invalid(format!("no chain {chain}")))?
                    .rules
                    .push(rule);
            }
            _ => return Err(st.unsupported("statement")),
        }
        Ok(())
    }

    /// Every chain and set a rule names must exist (checked after a whole transaction, as
    /// the kernel checks at commit).
    pub fn check_references(&self) -> Result<(), TraceError> {
        let invalid = |reason: String| Err(TraceError::Invalid { line: 0, reason });
        for r in self.chains.values().flat_map(|c| &c.rules) {
            if let Some(s) = r.sets().into_iter().find(|s| !self.sets.contains_key(*s)) {
                return invalid(format!("rule refers to missing set {s}"));
            }
            if let Some(c) = r
                .chains()
                .into_iter()
                .find(|c| !self.chains.contains_key(*c))
            {
                return invalid(format!("rule jumps to missing chain {c}"));
            }
        }
        Ok(())
    }

    /// The base chains attached to `hook`, in the order the kernel runs them (priority, then
    /// name), each with whether it is a nat chain.
    pub fn base_chains(&self, hook: Hook) -> Vec<(bool, &str)> {
        let mut v: Vec<(i32, bool, &str)> = self
            .chains
            .iter()
            .filter_map(|(n, c)| match c.base {
                Some((nat, h, prio)) if h == hook => Some((prio, nat, n.as_str())),
                _ => None,
            })
            .collect();
        v.sort();
        v.into_iter().map(|(_, nat, n)| (nat, n)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_chains_parse_named_and_numeric_priorities() {
        let p = |s| parse_base(s);
        assert_eq!(
            p("type nat hook prerouting priority dstnat - 10; policy accept;"),
            Some((true, Hook::Prerouting, -110))
        );
        assert_eq!(
            p("type filter hook output priority 5"),
            Some((false, Hook::Output, 5))
        );
        assert_eq!(
            p("type nat hook postrouting priority srcnat + 3; policy accept;"),
            Some((true, Hook::Postrouting, 103))
        );
        assert_eq!(
            p("type filter hook input priority filter + 10; policy accept;"),
            Some((false, Hook::Input, 10))
        );
        assert_eq!(
            p("type filter hook prerouting priority mangle + 40; policy accept;"),
            Some((false, Hook::Prerouting, -110))
        );
        assert_eq!(p("type filter hook input priority 0; policy drop;"), None);
        assert_eq!(p("type route hook output priority 0;"), None);
        assert_eq!(p("type nat hook prerouting priority dstnat -"), None);
        assert_eq!(p("type nat hook ingress priority 0"), None);
    }

    #[test]
    fn statements_split_verb_object_family_table_and_rest() {
        let text = "\nadd table ip t { comment \"x\"; }\n  add rule ip t c tcp dport 80 accept\n";
        let v: Vec<Statement<'_>> = statements(text).collect();
        assert_eq!(v.len(), 2);
        assert_eq!((v[0].line, v[0].verb, v[0].what), (2, "add", "table"));
        assert_eq!(v[0].table_comment(), Some("x"));
        assert_eq!((v[1].line, v[1].family, v[1].table), (3, "ip", "t"));
        assert_eq!(v[1].rest, "c tcp dport 80 accept");
        assert_eq!(v[1].table_comment(), None);
    }
}
