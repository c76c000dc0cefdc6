//! Reads what the kernel prints for a table (`nft list table FAMILY NAME`) back into the
//! transaction text the tracers replay, so `kube-proxy explain` and `status` run the tracers
//! over the live rules instead of over a plan.
//!
//! A listing is one `table FAMILY NAME { … }` block holding `set`, `map` and `chain` blocks.
//! It becomes `add table`, then every `add chain` (a base chain with its `type … hook …
//! priority …; policy …;` line), `add set`/`add map` with the declaration lines, `add element`
//! with the elements, and last the `add rule` lines, in the order the chain lists them. What
//! the kernel adds to what we wrote is taken off on the way: the `timeout`/`expires` of
//! elements in dynamic sets, and durations are turned back into seconds (`3h` is `10800s`).
//! Anything else the listing holds (flowtables, stateful objects, a second table) is refused, so
//! a table that is not what a planner renders is reported rather than traced wrongly.

use std::fmt::Write as _;

/// Why a listing could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ListingError {
    /// The listing holds something this reader does not know (1-based line and its text).
    /// Not retryable: the table is not one a planner of ours renders.
    #[error("line {line}: unsupported in a listing: {text}")]
    Unsupported {
        /// 1-based line in the listing.
        line: usize,
        /// The line.
        text: String,
    },
    /// A block is not closed, or the listing holds no table. Not retryable.
    #[error("truncated listing: {0}")]
    Truncated(String),
}

/// The transaction that re-creates the table `listing` shows (`nft list table FAMILY NAME`).
/// An empty listing (no such table) gives an empty transaction.
pub fn transaction(listing: &str) -> Result<String, ListingError> {
    let lines: Vec<(usize, &str)> = listing
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim()))
        .filter(|(_, l)| !l.is_empty())
        .collect();
    let mut out = Transaction::default();
    let mut i = 0;
    let mut tables = 0;
    while i < lines.len() {
        let (n, l) = lines[i];
        let Some(head) = block_head(l, "table") else {
            return Err(unsupported(n, l));
        };
        tables += 1;
        if tables > 1 {
            return Err(unsupported(n, l));
        }
        let mut words = head.split_whitespace();
        let (Some(family), Some(name), None) = (words.next(), words.next(), words.next()) else {
            return Err(unsupported(n, l));
        };
        let prefix = format!("{family} {name}");
        i = read_table(&lines, i + 1, &prefix, &mut out)?;
    }
    Ok(out.text())
}

/// The statements, kept apart so they come out in an order every one of them can apply in.
#[derive(Default)]
struct Transaction {
    table: String,
    chains: Vec<String>,
    sets: Vec<String>,
    elements: Vec<String>,
    rules: Vec<String>,
}

impl Transaction {
    fn text(self) -> String {
        let mut s = String::new();
        for l in std::iter::once(self.table)
            .chain(self.chains)
            .chain(self.sets)
            .chain(self.elements)
            .chain(self.rules)
            .filter(|l| !l.is_empty())
        {
            s.push_str(&l);
            s.push('\n');
        }
        s
    }
}

fn unsupported(line: usize, text: &str) -> ListingError {
    ListingError::Unsupported {
        line,
        text: text.to_string(),
    }
}

/// `KEYWORD REST {` → `REST`.
fn block_head<'a>(l: &'a str, keyword: &str) -> Option<&'a str> {
    l.strip_prefix(keyword)?
        .strip_prefix(' ')?
        .strip_suffix('{')
        .map(str::trim)
}

/// Reads the body of a table from `lines[i..]`; returns the index after its closing brace.
fn read_table(
    lines: &[(usize, &str)],
    mut i: usize,
    prefix: &str,
    out: &mut Transaction,
) -> Result<usize, ListingError> {
    let mut comment = None;
    while i < lines.len() {
        let (n, l) = lines[i];
        if l == "}" {
            out.table = match comment {
                Some(c) => format!("add table {prefix} {{ comment {c}; }}"),
                None => format!("add table {prefix}"),
            };
            return Ok(i + 1);
        }
        if let Some(c) = l.strip_prefix("comment ") {
            comment = Some(c.to_string());
            i += 1;
        } else if l.starts_with("flags ") {
            // Table flags (`owner`, `persist`) change nothing a packet meets.
            i += 1;
        } else if let Some(name) = block_head(l, "chain") {
            i = read_chain(lines, i + 1, prefix, name, out)?;
        } else if let Some(name) = block_head(l, "set") {
            i = read_set(lines, i + 1, prefix, "set", name, out)?;
        } else if let Some(name) = block_head(l, "map") {
            i = read_set(lines, i + 1, prefix, "map", name, out)?;
        } else {
            return Err(unsupported(n, l));
        }
    }
    Err(ListingError::Truncated(format!("table {prefix}")))
}

fn read_chain(
    lines: &[(usize, &str)],
    mut i: usize,
    prefix: &str,
    name: &str,
    out: &mut Transaction,
) -> Result<usize, ListingError> {
    let mut base = None;
    while i < lines.len() {
        let (_, l) = lines[i];
        i += 1;
        if l == "}" {
            out.chains.push(match base {
                Some(b) => format!("add chain {prefix} {name} {{ {b} }}"),
                None => format!("add chain {prefix} {name}"),
            });
            return Ok(i);
        }
        if l.starts_with("type ") && base.is_none() {
            base = Some(l.to_string());
        } else if l.starts_with("comment \"") {
            // A chain's own comment changes nothing a packet meets.
        } else {
            out.rules
                .push(format!("add rule {prefix} {name} {}", normalize_rule(l)));
        }
    }
    Err(ListingError::Truncated(format!("chain {name}")))
}

fn read_set(
    lines: &[(usize, &str)],
    mut i: usize,
    prefix: &str,
    what: &str,
    name: &str,
    out: &mut Transaction,
) -> Result<usize, ListingError> {
    let mut decl: Vec<String> = Vec::new();
    let mut elements: Option<String> = None;
    while i < lines.len() {
        let (n, l) = lines[i];
        i += 1;
        if l == "}" {
            out.sets.push(format!(
                "add {what} {prefix} {name} {{ {} }}",
                decl.iter()
                    .map(|d| format!("{d};"))
                    .collect::<Vec<_>>()
                    .join(" ")
            ));
            if let Some(e) = elements {
                if !e.trim().is_empty() {
                    out.elements
                        .push(format!("add element {prefix} {name} {{ {e} }}"));
                }
            }
            return Ok(i);
        }
        if let Some(rest) = l.strip_prefix("elements = {") {
            // Elements run over lines until the closing brace.
            let mut text = rest.to_string();
            let mut last = n;
            while !text.trim_end().ends_with('}') {
                let Some((m, more)) = lines.get(i) else {
                    return Err(ListingError::Truncated(format!("elements of {name}")));
                };
                i += 1;
                last = *m;
                text.push(' ');
                text.push_str(more);
            }
            let body = text.trim_end().trim_end_matches('}');
            elements = Some(normalize_elements(body).ok_or_else(|| unsupported(last, l))?);
        } else {
            decl.push(normalize_declaration(l));
        }
    }
    Err(ListingError::Truncated(format!("{what} {name}")))
}

/// One declaration line of a set; a `timeout` is spelled in seconds.
fn normalize_declaration(l: &str) -> String {
    match l.strip_prefix("timeout ") {
        Some(d) => match seconds(d) {
            Some(s) => format!("timeout {s}s"),
            None => l.to_string(),
        },
        None => l.to_string(),
    }
}

/// A duration as nft prints one (`3h`, `1d2h`, `10800s`, `1h30m0s`), in whole seconds.
pub fn seconds(d: &str) -> Option<u64> {
    let mut total = 0u64;
    let mut num = String::new();
    let mut chars = d.chars().peekable();
    let mut any = false;
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() {
            num.push(c);
            continue;
        }
        let n: u64 = num.parse().ok()?;
        num.clear();
        let unit = match c {
            'd' => 86_400,
            'h' => 3_600,
            'm' if chars.peek() == Some(&'s') => {
                chars.next();
                0
            }
            'm' => 60,
            's' => 1,
            _ => return None,
        };
        total += n * unit;
        any = true;
    }
    if !num.is_empty() {
        return None;
    }
    any.then_some(total)
}

/// A set's elements, `a, b : c, …`, with what the kernel adds per element (`timeout T`,
/// `expires E`, per-element `counter` or `comment`) taken off; whitespace as the tracer reads it.
fn normalize_elements(body: &str) -> Option<String> {
    let words: Vec<&str> = body.split_whitespace().collect();
    let mut kept: Vec<&str> = Vec::new();
    let mut i = 0;
    while i < words.len() {
        match words[i] {
            "timeout" | "expires" => {
                // The value may end the element (`…expires 2h59m,`): keep its comma.
                let v = words.get(i + 1)?;
                if v.ends_with(',') {
                    attach_comma(&mut kept);
                }
                i += 2;
            }
            w => {
                kept.push(w);
                i += 1;
            }
        }
    }
    let text = kept.join(" ");
    Some(text.replace(" ,", ","))
}

fn attach_comma(kept: &mut Vec<&str>) {
    kept.push(",");
}

/// A rule as the kernel prints it, in the planner's spelling where the two differ: mark
/// arithmetic (`|`, `^` for `or`, `xor`), a zero mark test (`== 0x00000000`), and a
/// `meta l4proto P` match followed by `th dport`, which the kernel keeps as one protocol
/// payload match and prints as `P dport` (without the `meta l4proto P`).
fn normalize_rule(l: &str) -> String {
    let mut words: Vec<&str> = l.split_whitespace().collect();
    let mut proto = None;
    for i in 0..words.len().saturating_sub(1) {
        let w = words[i];
        if matches!(w, "tcp" | "udp" | "sctp")
            && words[i + 1] == "dport"
            && (i == 0 || words[i - 1] != "l4proto")
        {
            proto = Some(w);
            words[i] = "th";
        }
    }
    let prefix = match proto {
        Some(p) if !l.contains(&format!("meta l4proto {p}")) => format!("meta l4proto {p} "),
        _ => String::new(),
    };
    let mut out = prefix;
    for (i, w) in words.iter().enumerate() {
        let prev = if i > 0 { words[i - 1] } else { "" };
        let prev2 = if i > 1 { words[i - 2] } else { "" };
        let w = match *w {
            "|" if prev == "mark" => "or",
            "^" if prev == "mark" => "xor",
            z if prev == "==" && prev2.starts_with("0x") && is_zero_hex(z) => "0",
            other => other,
        };
        if i > 0 {
            out.push(' ');
        }
        let _ = write!(out, "{w}");
    }
    out
}

fn is_zero_hex(s: &str) -> bool {
    s.strip_prefix("0x")
        .is_some_and(|h| !h.is_empty() && h.bytes().all(|b| b == b'0'))
}

#[cfg(test)]
mod tests;
