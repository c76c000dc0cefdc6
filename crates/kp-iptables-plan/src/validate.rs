//! Render-time validation: every rule the planner renders is checked against what both
//! `iptables-restore` backends accept and print back unchanged, before it can reach a restore.
//!
//! A rule iptables-nft refuses fails the whole restore input (every chain of that table in it);
//! one that is accepted but printed back differently makes every read-back find a difference and
//! rebuild. Both used to reach users: ClusterIPs from two unrelated Service ranges made the
//! early `RETURN` of filter `KUBE-SERVICES` `! -d 0.0.0.0/0`, which iptables-legacy accepts and
//! iptables-nft refuses (`RULE_APPEND failed (Invalid argument)`), so filter never synced again.
//! The planner passes every rule of every Service through [`rule`] when it records the Service,
//! and leaves out a Service whose rules fail ([`PlanError`]); the fixed and
//! shared chains go through it too, and a plan whose shared rules fail sends nothing.
//!
//! The validator is strict: it knows exactly the arguments, matches, targets and option orders
//! the renderer emits (in `iptables-save` form, see [`crate::render`]) and calls anything else
//! [`Problem::Unvetted`], so a new rule shape must be added here, and tried on both backends,
//! before it can be planned. `tests/kernel.rs` feeds every restore input of a broad generated set
//! of plans to both backends, which proves the other direction: what passes here loads.
//!
//! # What the backends do
//!
//! Found with `iptables-nft-restore` and `iptables-legacy-restore` 1.8.9 (and the `ip6tables`
//! ones), kernel 6.x, each rule alone in a chain of a fresh namespace; `tests/kernel.rs` checks
//! these rows again on every run.
//!
//! | input | iptables-nft | iptables-legacy | here |
//! |---|---|---|---|
//! | `! -d 0.0.0.0/0`, `! -s ::/0` | refused: `RULE_APPEND failed (Invalid argument)` | accepted (matches nothing) | [`Problem::RefusedByNft`] |
//! | `-d 0.0.0.0/0` | accepted, saved without `-d` | same | [`Problem::NotCanonical`] (render leaves it out) |
//! | `-d 10.0.0.1/8` (host bits set) | saved as `10.0.0.0/8` | same | not canonical |
//! | `-d 10.0.0.0/33`, `/129`, an IPv6 address in `iptables` | refused: `invalid mask`, `host/network not found` | same | [`Problem::Refused`] |
//! | `-d ::102:304/128` (IPv4-compatible IPv6) | saved as `::1.2.3.4/128` (glibc's form) | same | not canonical |
//! | chain name of 29+ characters | refused: `too long (must be under 29 chars)` | refused: `(28 chars max)` | refused |
//! | chain named `ACCEPT`, or empty | refused: `may not clash with target name` | refused (`File exists`, policy error) | refused |
//! | chain named `-X` | refused: `not allowed to start with '-'` | accepted | refused by iptables-nft |
//! | `--comment` of 256+ bytes | accepted, silently cut to 255 bytes | same | not canonical |
//! | `--comment ""` | accepted, saved as `""` | same | accepted |
//! | `--comment "abc -j RETURN` (quote left open) | accepted: the rest of the line is the comment | same | meaningless (the rule loses its target) |
//! | `--dport 0`; `DNAT --to-destination IP:0` | accepted | same | [`Problem::Meaningless`] |
//! | `--dport 65536` | refused: `invalid port/service` | same | refused |
//! | `-m udp` without `-p udp`; DNAT with a port and no `-p` | refused: `requires '-p udp'`, `Need TCP, UDP, SCTP or DCCP` | refused | refused |
//! | `--probability` below 0 or above 1 | refused: `out of range (0-1)` | same | refused |
//! | `--probability 0` / `1`; any value | accepted; saved as `round(2^31 p) / 2^31` with 11 decimals | same | 0 and 1 meaningless; other spellings not canonical |
//! | `recent --name` of 200+ bytes | accepted, silently cut to 199 bytes: two names that share 199 bytes share one list | same | not canonical |
//! | `recent --name` empty, `.`, `..`, with `/` | refused: `Invalid argument` | refused | refused |
//! | `--seconds 0`, or above 4294967295 | refused: `out of range (1-4294967295)` | same | refused |
//! | `--seconds` 2147483648 to 4294967295 | accepted, saved negative (`-1`) | same | not canonical |
//! | `--reap` without `--seconds` | refused | refused | refused |
//! | `recent --mask` of the other family | refused: `getaddrinfo: Address family … not supported` | same | refused |
//! | `--set-xmark 0x100000000/…` | refused: `out of range` | same | refused |
//! | `--reject-with icmp6-port-unreachable` in `iptables` (and the reverse) | refused: `unknown reject type` | same | refused |
//! | `REJECT` in nat, `DNAT` or `MASQUERADE` in filter | refused | refused | refused |
//! | a line of 10240+ bytes | refused: cut at the 10240-byte line buffer, the rest parsed as another line | same | refused |
//! | `-i NAME` / `-i PREFIX+` of 16+ bytes (the `+` counted) | refused: `must be shorter than IFNAMSIZ (16)` | same | refused (the renderer writes a 15-byte prefix as the name itself, which is all it can match) |
//! | 249+ arguments after `-A CHAIN` | refused: `Parser cannot handle more arguments` | same | refused (above [`MAX_ARGS`]: unvetted) |
//!
//! Both accept negating a prefix of 1 or more (`! -d 0.0.0.0/1`), `--comment` with `"`, `\`, `'`
//! (escaped as the renderer does), UTF-8 and tabs, `--seconds` up to 2147483647, recent names
//! with `.` and `_`, and marks up to `0x80000000`. The restore tools check the table of
//! `DNAT`/`REJECT`/`MASQUERADE` when the rule is added; the kernel checks the hook a chain is
//! reached from at commit, which `kp-iptables-test` models (the validator sees one rule).

use std::borrow::Cow;
use std::fmt;
use std::net::{IpAddr, Ipv6Addr};

use kp_core::model::{IpFamily, ServiceKey};

use crate::render::Table;

/// A rule the planner rendered and this module refused, so that no restore carries it (a rule
/// iptables-nft refuses fails the whole input; one printed back differently makes every
/// read-back rebuild). Reported in [`crate::Restore::errors`]; the caller logs and counts it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// A rule of one Service: the Service is left out of this family's tables, as if it had no
    /// ClusterIP of the family (its chains deleted, its ClusterIP not rejected), until a plan
    /// renders it valid. Every other Service is planned as usual.
    #[error("{} Service {service} left out: {} {chain}: {error}\n  rule: {rule}", .family.as_str(), .table.as_str())]
    Service {
        /// The Service.
        service: ServiceKey,
        /// The family of the planner.
        family: IpFamily,
        /// The rule's table.
        table: Table,
        /// The rule's chain.
        chain: String,
        /// The rule (after `-A CHAIN `; empty if the chain name itself failed).
        rule: String,
        /// Why it failed.
        error: RuleError,
    },
    /// A rule of a fixed or shared chain, not of one Service (the configuration or the node's
    /// addresses made it): no restore of this family could load, so the plan is empty and the
    /// next one is full.
    #[error("{} {} {chain}: {error}\n  rule: {rule}; nothing is sent", .family.as_str(), .table.as_str())]
    Shared {
        /// The family of the planner.
        family: IpFamily,
        /// The rule's table.
        table: Table,
        /// The rule's chain.
        chain: String,
        /// The rule.
        rule: String,
        /// Why it failed.
        error: RuleError,
    },
}

/// Longest chain name both backends accept (`XT_EXTENSION_MAXNAMELEN` - 1).
pub const MAX_CHAIN_NAME: usize = 28;
/// Longest `--comment` kept whole (`XT_MAX_COMMENT_LEN` - 1); longer ones are cut.
pub const MAX_COMMENT: usize = 255;
/// Longest `-m recent --name` kept whole (`XT_RECENT_NAME_LEN` - 1); longer ones are cut.
pub const MAX_RECENT_NAME: usize = 199;
/// Largest `-m recent --seconds` printed back as written (larger ones print negative).
pub const MAX_RECENT_SECONDS: u64 = i32::MAX as u64;
/// Longest restore line (`-A CHAIN ARGS`, without its newline): the tools read lines into a
/// 10240-byte buffer.
pub const MAX_LINE: usize = 10239;
/// Most arguments after `-A CHAIN` accepted here (the tools refuse 249 and more; the renderer
/// writes fewer than 40).
pub const MAX_ARGS: usize = 128;

/// What kind of trouble a rule would meet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Problem {
    /// Both backends refuse it: the restore input fails.
    Refused,
    /// iptables-nft refuses it; iptables-legacy accepts it.
    RefusedByNft,
    /// Accepted, but `iptables-save` prints it differently (cut, reformatted, left out), so the
    /// read-back finds a difference on every check and rebuilds.
    NotCanonical,
    /// Accepted and printed back as written, but never what a rule means (a DNAT to port 0, a
    /// random choice with probability 0, a comment that swallows the target).
    Meaningless,
    /// An argument, match, target or option the renderer is not known to emit, so not tried on
    /// the backends: add it here (and to the findings above) before rendering it.
    Unvetted,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Problem::Refused => "refused by iptables-nft and iptables-legacy",
            Problem::RefusedByNft => "refused by iptables-nft",
            Problem::NotCanonical => "printed back differently by iptables-save",
            Problem::Meaningless => "accepted but meaningless",
            Problem::Unvetted => "not vetted against the iptables backends",
        })
    }
}

/// Why a rule or chain name fails validation.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{problem}: {detail}")]
pub struct RuleError {
    /// The kind of trouble.
    pub problem: Problem,
    /// What exactly, naming the argument.
    pub detail: String,
}

fn fail<T>(problem: Problem, detail: impl Into<String>) -> Result<T, RuleError> {
    Err(RuleError {
        problem,
        detail: detail.into(),
    })
}

/// Targets and chain names iptables reserves: a chain of that name is refused.
const RESERVED: &[&str] = &["ACCEPT", "DROP", "RETURN", "QUEUE"];

/// Extension targets iptables knows (the renderer uses `REJECT`, `DNAT`, `MARK`, `MASQUERADE`):
/// a chain named like one would make `-j NAME` ambiguous.
const TARGETS: &[&str] = &[
    "REJECT",
    "DNAT",
    "SNAT",
    "MARK",
    "MASQUERADE",
    "REDIRECT",
    "NETMAP",
    "LOG",
    "NFLOG",
    "TRACE",
    "CT",
    "NOTRACK",
    "CONNMARK",
    "TPROXY",
    "NFQUEUE",
    "AUDIT",
    "CHECKSUM",
    "SET",
    "TEE",
];

/// Checks a chain name: 1 to [`MAX_CHAIN_NAME`] letters, digits, `-` and `_`, not starting with
/// `-`, and not a target's name.
pub fn chain_name(name: &str) -> Result<(), RuleError> {
    if name.is_empty() {
        return fail(Problem::Refused, "an empty chain name");
    }
    if name.starts_with('-') {
        return fail(
            Problem::RefusedByNft,
            format!("chain name {name}: iptables-nft refuses a leading '-'"),
        );
    }
    if name.len() > MAX_CHAIN_NAME {
        return fail(
            Problem::Refused,
            format!(
                "chain name {name} is {} bytes; the limit is {MAX_CHAIN_NAME}",
                name.len()
            ),
        );
    }
    if RESERVED.contains(&name) {
        return fail(
            Problem::Refused,
            format!("chain name {name} is a built-in target"),
        );
    }
    if TARGETS.contains(&name) {
        return fail(
            Problem::Unvetted,
            format!("chain name {name} is a target's name"),
        );
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return fail(
            Problem::Unvetted,
            format!("chain name {name:?}: only letters, digits, '-' and '_' are vetted"),
        );
    }
    Ok(())
}

/// Checks one rule, `args` being what follows `-A CHAIN ` in a restore input for `chain` of
/// `table` in `family`'s tables (`iptables` or `ip6tables`). The rule must be in the form
/// `iptables-save` prints: `-s`, `-d`, `-p`, the matches, `-j`, one space apart.
pub fn rule(family: IpFamily, table: Table, chain: &str, args: &str) -> Result<(), RuleError> {
    chain_name(chain)?;
    let line = "-A ".len() + chain.len() + 1 + args.len();
    if line > MAX_LINE {
        return fail(
            Problem::Refused,
            format!("the rule's line is {line} bytes; the limit is {MAX_LINE}"),
        );
    }
    let tokens = tokenize(args)?;
    if tokens.is_empty() {
        return fail(Problem::Meaningless, "an empty rule");
    }
    if tokens.len() > MAX_ARGS {
        // The tools' parser stops at 249 ("Parser cannot handle more arguments").
        let problem = if tokens.len() >= 249 {
            Problem::Refused
        } else {
            Problem::Unvetted
        };
        return fail(
            problem,
            format!("{} arguments; at most {MAX_ARGS} are vetted", tokens.len()),
        );
    }
    Parser {
        family,
        table,
        tokens,
        at: 0,
        proto: None,
    }
    .run()
}

/// One argument as written: `raw` is its text in the rule (with its quotes, if `quoted`).
#[derive(Clone, Copy, Debug)]
struct Token<'a> {
    raw: &'a str,
    quoted: bool,
}

impl<'a> Token<'a> {
    /// The argument's value: a quoted one without its quotes and escapes.
    fn value(&self) -> Cow<'a, str> {
        if !self.quoted {
            return Cow::Borrowed(self.raw);
        }
        let inner = &self.raw[1..self.raw.len() - 1];
        if !inner.contains('\\') {
            return Cow::Borrowed(inner);
        }
        let mut out = String::with_capacity(inner.len());
        let mut chars = inner.chars();
        while let Some(c) = chars.next() {
            if c == '\\' {
                if let Some(n) = chars.next() {
                    out.push(n);
                }
            } else {
                out.push(c);
            }
        }
        Cow::Owned(out)
    }
}

/// Splits a rule into arguments, one space apart, as `iptables-save` prints them: a quoted
/// argument (a comment) runs to its closing `"` (`\` escapes the next character), any other
/// holds no quote or backslash.
fn tokenize(args: &str) -> Result<Vec<Token<'_>>, RuleError> {
    if let Some(c) = args.chars().find(|c| c.is_control() && *c != '\t') {
        // A newline or carriage return ends the restore line, the rest is parsed as a line of
        // its own; a NUL ends the line for the tools' parser.
        return fail(
            Problem::Refused,
            format!("control character {c:?} in the rule"),
        );
    }
    let bytes = args.as_bytes();
    let mut out = Vec::with_capacity(24);
    let mut i = 0;
    while i < bytes.len() {
        let start = i;
        if bytes[i] == b'"' {
            i += 1;
            loop {
                match bytes.get(i) {
                    None => {
                        let rest = &args[start..];
                        let detail = format!("unterminated quote in {rest}: it swallows the rest");
                        return fail(Problem::Meaningless, detail);
                    }
                    Some(b'\\') => i += 2,
                    Some(b'"') => break,
                    Some(_) => i += 1,
                }
            }
            i += 1;
            out.push(Token {
                raw: &args[start..i.min(bytes.len())],
                quoted: true,
            });
        } else {
            while i < bytes.len() && bytes[i] != b' ' {
                i += 1;
            }
            let raw = &args[start..i];
            if raw.is_empty() || raw.contains(['"', '\\', '\t']) {
                return fail(
                    Problem::NotCanonical,
                    format!("argument {raw:?}: iptables-save separates arguments by one space and quotes only comments"),
                );
            }
            out.push(Token { raw, quoted: false });
        }
        match bytes.get(i) {
            None => {}
            Some(b' ') if i + 1 < bytes.len() => i += 1,
            Some(_) => {
                return fail(
                    Problem::NotCanonical,
                    format!(
                        "{:?}: iptables-save separates arguments by one space",
                        &args[start..]
                    ),
                )
            }
        }
    }
    Ok(out)
}

/// Where a rule is, in `iptables-save`'s order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Stage {
    Start,
    Source,
    Destination,
    InInterface,
    Protocol,
    Matches,
}

struct Parser<'a> {
    family: IpFamily,
    table: Table,
    tokens: Vec<Token<'a>>,
    at: usize,
    proto: Option<&'a str>,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<&'a str> {
        self.tokens.get(self.at).map(|t| t.raw)
    }

    /// The next argument, which `after` requires.
    fn next(&mut self, after: &str) -> Result<Token<'a>, RuleError> {
        let t = self.tokens.get(self.at).copied();
        self.at += 1;
        match t {
            Some(t) if !t.quoted => Ok(t),
            Some(t) => fail(
                Problem::NotCanonical,
                format!("{after} {}: only comments are quoted", t.raw),
            ),
            None => fail(Problem::Refused, format!("{after} requires a value")),
        }
    }

    /// The next argument, which must be `word`.
    fn expect(&mut self, word: &str, shape: &str) -> Result<(), RuleError> {
        match self.peek() {
            Some(w) if w == word => {
                self.at += 1;
                Ok(())
            }
            other => fail(
                Problem::Unvetted,
                format!(
                    "{shape}: expected {word}, found {}",
                    other.unwrap_or("the end")
                ),
            ),
        }
    }

    /// Takes a `!` if there is one.
    fn negation(&mut self) -> bool {
        let neg = self.peek() == Some("!");
        if neg {
            self.at += 1;
        }
        neg
    }

    fn run(mut self) -> Result<(), RuleError> {
        let mut stage = Stage::Start;
        while self.at < self.tokens.len() {
            let neg = self.negation();
            let Some(flag) = self.peek() else {
                return fail(Problem::Refused, "a rule ends in !");
            };
            self.at += 1;
            let (now, what) = match flag {
                "-s" => (Stage::Source, "-s"),
                "-d" => (Stage::Destination, "-d"),
                "-i" => (Stage::InInterface, "-i"),
                "-p" => (Stage::Protocol, "-p"),
                "-m" => (Stage::Matches, "-m"),
                "-j" => {
                    if neg {
                        return fail(Problem::Refused, "! -j");
                    }
                    return self.target();
                }
                other => {
                    return fail(Problem::Unvetted, format!("argument {other}"));
                }
            };
            if now == stage && now != Stage::Matches {
                return fail(Problem::Refused, format!("{what} given twice"));
            }
            if now < stage {
                return fail(
                    Problem::NotCanonical,
                    format!("{what} out of place: iptables-save prints -s, -d, -i, -p, the matches, -j in that order"),
                );
            }
            stage = now;
            match now {
                Stage::Source | Stage::Destination => {
                    let value = self.next(what)?;
                    self.address(what, neg, value.raw)?;
                }
                Stage::InInterface => {
                    let value = self.next("-i")?.raw;
                    let name = value.strip_suffix('+').unwrap_or(value);
                    if value.len() > kp_core::node::InterfaceName::MAX_LEN {
                        return fail(
                            Problem::Refused,
                            format!("-i {value}: longer than 15 bytes"),
                        );
                    }
                    if kp_core::node::InterfaceName::new(name).is_err() {
                        return fail(Problem::Unvetted, format!("-i {value}"));
                    }
                }
                Stage::Protocol => {
                    let value = self.next("-p")?.raw;
                    if neg || !matches!(value, "tcp" | "udp" | "sctp") {
                        return fail(
                            Problem::Unvetted,
                            format!("{}-p {value}", if neg { "! " } else { "" }),
                        );
                    }
                    self.proto = Some(value);
                }
                Stage::Matches => {
                    if neg {
                        return fail(Problem::Refused, "! -m");
                    }
                    let name = self.next("-m")?.raw;
                    self.module(name)?;
                }
                Stage::Start => {}
            }
        }
        Ok(())
    }

    /// `-s`/`-d NET`: the family's network, with its prefix length and host bits cleared.
    fn address(&self, flag: &str, neg: bool, text: &str) -> Result<(), RuleError> {
        // Error text only when there is an error: this runs for most rules of a plan.
        let shown = || format!("{}{flag} {text}", if neg { "! " } else { "" });
        let Some((addr, len)) = text.split_once('/') else {
            return fail(
                Problem::NotCanonical,
                format!("{}: iptables-save prints the prefix length", shown()),
            );
        };
        let ip = parse_ip(shown, addr, self.family)?;
        let max = match self.family {
            IpFamily::V4 => 32,
            IpFamily::V6 => 128,
        };
        let canonical_len = !len.starts_with('0') || len == "0";
        let prefix: u8 = match len.parse::<u8>() {
            Ok(p) if p <= max && canonical_len => p,
            Ok(p) if p <= max => {
                return fail(Problem::NotCanonical, format!("{}: prefix length", shown()))
            }
            Ok(_) => return fail(Problem::Refused, format!("{}: invalid mask", shown())),
            Err(_) if len.parse::<IpAddr>().is_ok() => {
                return fail(
                    Problem::NotCanonical,
                    format!(
                        "{}: iptables-save prints a contiguous mask as a prefix length",
                        shown()
                    ),
                )
            }
            Err(_) => return fail(Problem::Refused, format!("{}: invalid mask", shown())),
        };
        if prefix == 0 {
            return if neg {
                fail(
                    Problem::RefusedByNft,
                    format!("{}: a negated zero-length prefix (RULE_APPEND failed (Invalid argument)); it matches nothing", shown()),
                )
            } else {
                fail(
                    Problem::NotCanonical,
                    format!("{}: a zero-length prefix matches every address and is printed as no {flag} at all", shown()),
                )
            };
        }
        let net = ipnet::IpNet::new(ip, prefix).map_err(|_| RuleError {
            problem: Problem::Refused,
            detail: format!("{}: invalid mask", shown()),
        })?;
        if net.trunc().addr() != ip {
            return fail(
                Problem::NotCanonical,
                format!("{}: host bits are cleared when it is printed back", shown()),
            );
        }
        Ok(())
    }

    fn module(&mut self, name: &'a str) -> Result<(), RuleError> {
        match name {
            "comment" => {
                self.expect("--comment", "-m comment")?;
                let Some(t) = self.tokens.get(self.at).copied() else {
                    return fail(Problem::Refused, "--comment requires a value");
                };
                self.at += 1;
                comment(&t)
            }
            "tcp" | "udp" | "sctp" => {
                if self.proto != Some(name) {
                    return fail(Problem::Refused, format!("-m {name} requires -p {name}"));
                }
                self.negation();
                self.expect("--dport", "-m tcp/udp/sctp")?;
                let port = self.next("--dport")?.raw;
                port_number("--dport", port)
            }
            "addrtype" => {
                let mut seen = 0;
                for opt in ["--src-type", "--dst-type"] {
                    let save = self.at;
                    self.negation();
                    if self.peek() != Some(opt) {
                        self.at = save;
                        continue;
                    }
                    self.at += 1;
                    let t = self.next(opt)?.raw;
                    if t != "LOCAL" {
                        return fail(Problem::Unvetted, format!("{opt} {t}"));
                    }
                    seen += 1;
                }
                if seen == 0 {
                    return fail(
                        Problem::Unvetted,
                        "-m addrtype without --src-type or --dst-type",
                    );
                }
                Ok(())
            }
            "statistic" => {
                self.expect("--mode", "-m statistic")?;
                self.expect("random", "-m statistic --mode")?;
                self.expect("--probability", "-m statistic --mode random")?;
                let p = self.next("--probability")?.raw;
                probability(p)
            }
            "recent" => self.recent(),
            "mark" => {
                self.negation();
                self.expect("--mark", "-m mark")?;
                let v = self.next("--mark")?.raw;
                mark("--mark", v)
            }
            "conntrack" => {
                self.negation();
                self.expect("--ctstate", "-m conntrack")?;
                let v = self.next("--ctstate")?.raw;
                ctstate(v)
            }
            other => fail(Problem::Unvetted, format!("-m {other}")),
        }
    }

    /// `-m recent`: `--set --name N --mask M --rsource`, or `--rcheck`/`--update --seconds T
    /// --reap --name N --mask M --rsource`, as `iptables-save` prints the renderer's rules.
    fn recent(&mut self) -> Result<(), RuleError> {
        const SHAPE: &str = "-m recent";
        match self.next(SHAPE)?.raw {
            "--set" => {}
            "--rcheck" | "--update" => {
                self.expect("--seconds", SHAPE)?;
                let t = self.next("--seconds")?.raw;
                seconds(t)?;
                self.expect("--reap", SHAPE)?;
            }
            other => return fail(Problem::Unvetted, format!("-m recent {other}")),
        }
        self.expect("--name", SHAPE)?;
        let name = self.next("--name")?.raw;
        recent_name(name)?;
        self.expect("--mask", SHAPE)?;
        let mask = self.next("--mask")?.raw;
        let want = match self.family {
            IpFamily::V4 => "255.255.255.255",
            IpFamily::V6 => "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        };
        if mask != want {
            let other_family = mask
                .parse::<IpAddr>()
                .is_ok_and(|m| IpFamily::of(&m) != self.family);
            let problem = if other_family {
                Problem::Refused
            } else {
                Problem::Unvetted
            };
            return fail(problem, format!("--mask {mask}"));
        }
        self.expect("--rsource", SHAPE)
    }

    /// `-j TARGET [OPTIONS]`: the rest of the rule.
    fn target(&mut self) -> Result<(), RuleError> {
        let target = self.next("-j")?.raw;
        match target {
            "ACCEPT" | "DROP" | "RETURN" => {}
            "REJECT" => {
                if self.table != Table::Filter {
                    return fail(
                        Problem::Refused,
                        format!("REJECT in the {} table", self.table.as_str()),
                    );
                }
                self.expect("--reject-with", "-j REJECT")?;
                let with = self.next("--reject-with")?.raw;
                let (ours, theirs) = match self.family {
                    IpFamily::V4 => ("icmp-port-unreachable", "icmp6-port-unreachable"),
                    IpFamily::V6 => ("icmp6-port-unreachable", "icmp-port-unreachable"),
                };
                if with == theirs {
                    return fail(
                        Problem::Refused,
                        format!("--reject-with {with} is the other family's"),
                    );
                }
                if with != ours {
                    return fail(Problem::Unvetted, format!("--reject-with {with}"));
                }
            }
            "DNAT" => {
                if self.table != Table::Nat {
                    return fail(
                        Problem::Refused,
                        format!("DNAT in the {} table", self.table.as_str()),
                    );
                }
                if self.proto.is_none() {
                    return fail(Problem::Refused, "DNAT to a port needs -p tcp, udp or sctp");
                }
                self.expect("--to-destination", "-j DNAT")?;
                let to = self.next("--to-destination")?.raw;
                self.dnat(to)?;
            }
            "MARK" => {
                self.expect("--set-xmark", "-j MARK")?;
                let v = self.next("--set-xmark")?.raw;
                mark("--set-xmark", v)?;
            }
            "MASQUERADE" => {
                if self.table != Table::Nat {
                    return fail(
                        Problem::Refused,
                        format!("MASQUERADE in the {} table", self.table.as_str()),
                    );
                }
                if self.peek() == Some("--random-fully") {
                    self.at += 1;
                }
            }
            chain => {
                chain_name(chain).map_err(|e| RuleError {
                    problem: e.problem,
                    detail: format!("-j {chain}: {}", e.detail),
                })?;
            }
        }
        match self.peek() {
            None => Ok(()),
            Some(extra) => fail(
                Problem::Refused,
                format!("-j {target}: unexpected {extra} (Bad argument)"),
            ),
        }
    }

    /// `--to-destination IP:PORT` (`[IPv6]:PORT`).
    fn dnat(&self, to: &str) -> Result<(), RuleError> {
        let shown = || format!("--to-destination {to}");
        let (addr, port) = match self.family {
            IpFamily::V4 => to.split_once(':'),
            IpFamily::V6 => to.strip_prefix('[').and_then(|r| r.split_once("]:")),
        }
        .ok_or_else(|| RuleError {
            problem: Problem::Unvetted,
            detail: format!(
                "{}: only ADDRESS:PORT ([ADDRESS]:PORT for IPv6) is vetted",
                shown()
            ),
        })?;
        parse_ip(shown, addr, self.family)?;
        port_number("--to-destination", port)
    }
}

/// An address of `family`, in the form `iptables-save` prints (glibc's `inet_ntop`); `shown`
/// names the argument in an error.
fn parse_ip(shown: impl Fn() -> String, text: &str, family: IpFamily) -> Result<IpAddr, RuleError> {
    let Ok(ip) = text.parse::<IpAddr>() else {
        return fail(
            Problem::Unvetted,
            format!(
                "{}: not an address (the tools would look it up as a host name)",
                shown()
            ),
        );
    };
    if IpFamily::of(&ip) != family {
        return fail(
            Problem::Refused,
            format!("{}: not an {} address", shown(), family.as_str()),
        );
    }
    if let IpAddr::V6(v6) = ip {
        // Rust's IPv4 parser takes only the dotted quad it prints; IPv6 has many spellings.
        if ip.to_string() != text {
            return fail(
                Problem::NotCanonical,
                format!("{}: printed back as {ip}", shown()),
            );
        }
        if glibc_prints_dotted(&v6) {
            return fail(
                Problem::NotCanonical,
                format!(
                    "{}: glibc prints this IPv4-compatible address in dotted form",
                    shown()
                ),
            );
        }
    }
    Ok(ip)
}

/// Whether glibc's `inet_ntop` prints `a` as `::a.b.c.d` where Rust (RFC 5952) prints hex: an
/// IPv4-compatible address (six zero groups, then a non-zero seventh). IPv4-mapped addresses
/// (`::ffff:a.b.c.d`) are dotted in both.
fn glibc_prints_dotted(a: &Ipv6Addr) -> bool {
    let s = a.segments();
    s[..6].iter().all(|g| *g == 0) && s[6] != 0
}

/// A comment: at most [`MAX_COMMENT`] bytes, quoted exactly as `iptables-save` quotes it.
fn comment(t: &Token<'_>) -> Result<(), RuleError> {
    let value = t.value();
    if value.len() > MAX_COMMENT {
        return fail(
            Problem::NotCanonical,
            format!(
                "--comment of {} bytes: cut to {MAX_COMMENT} when it is loaded",
                value.len()
            ),
        );
    }
    if !saved_as(&value, t) {
        return fail(
            Problem::NotCanonical,
            format!(
                "--comment {}: iptables-save prints it as {}",
                t.raw,
                crate::render::save_string(&value)
            ),
        );
    }
    Ok(())
}

/// Whether `t` is `value` as `iptables-save` writes a string ([`crate::render::save_string`]):
/// bare if it is only letters, digits, `-` and `_`, else quoted with `"`, `\` and `'`
/// escaped. (Compared without building the string: most rules have a comment.)
fn saved_as(value: &str, t: &Token<'_>) -> bool {
    let bare = !value.is_empty()
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if bare || !t.quoted {
        return bare && !t.quoted && t.raw == value;
    }
    let mut chars = t.raw[1..t.raw.len() - 1].chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' if !matches!(chars.next(), Some('"' | '\\' | '\'')) => return false,
            '"' | '\'' => return false,
            _ => {}
        }
    }
    true
}

/// A decimal number as the tools print it: digits without leading zeros.
fn decimal(text: &str) -> Option<u64> {
    let canonical = !text.is_empty()
        && text.len() <= 19
        && text.bytes().all(|b| b.is_ascii_digit())
        && (text == "0" || !text.starts_with('0'));
    canonical.then(|| text.parse().ok()).flatten()
}

/// A port: 1 to 65535.
fn port_number(opt: &str, text: &str) -> Result<(), RuleError> {
    match decimal(text) {
        Some(0) => fail(
            Problem::Meaningless,
            format!("{opt} port 0: no connection has it"),
        ),
        Some(p) if p <= u64::from(u16::MAX) => Ok(()),
        Some(_) => fail(Problem::Refused, format!("{opt} {text}: invalid port")),
        None => fail(
            Problem::Unvetted,
            format!("{opt} {text}: only a port number is vetted"),
        ),
    }
}

/// `--probability P`: strictly between 0 and 1, spelled as the kernel's 31-bit fraction with
/// 11 decimals (see [`crate::render::probability`]).
fn probability(text: &str) -> Result<(), RuleError> {
    let Ok(p) = text.parse::<f64>() else {
        return fail(Problem::Refused, format!("--probability {text}"));
    };
    if !(0.0..=1.0).contains(&p) {
        return fail(
            Problem::Refused,
            format!("--probability {text}: out of range (0-1)"),
        );
    }
    const SCALE: f64 = 2_147_483_648.0;
    let stored = (p * SCALE).round();
    if stored <= 0.0 || stored >= SCALE {
        return fail(
            Problem::Meaningless,
            format!("--probability {text}: the rule always or never matches"),
        );
    }
    let printed = format!("{:.11}", stored / SCALE);
    if printed != text {
        return fail(
            Problem::NotCanonical,
            format!("--probability {text}: printed back as {printed}"),
        );
    }
    Ok(())
}

/// `--seconds T`: 1 to [`MAX_RECENT_SECONDS`].
fn seconds(text: &str) -> Result<(), RuleError> {
    match decimal(text) {
        Some(0) => fail(Problem::Refused, "--seconds 0: out of range (1-4294967295)"),
        Some(s) if s <= MAX_RECENT_SECONDS => Ok(()),
        Some(s) if s <= u64::from(u32::MAX) => fail(
            Problem::NotCanonical,
            format!("--seconds {s}: printed back as a negative number"),
        ),
        Some(_) => fail(
            Problem::Refused,
            format!("--seconds {text}: out of range (1-4294967295)"),
        ),
        None => fail(Problem::Refused, format!("--seconds {text}")),
    }
}

/// `-m recent --name N`: 1 to [`MAX_RECENT_NAME`] bytes the kernel takes for a file name in
/// `/proc/net/xt_recent`.
fn recent_name(name: &str) -> Result<(), RuleError> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') {
        return fail(
            Problem::Refused,
            format!("--name {name}: not a file name (Invalid argument)"),
        );
    }
    if name.len() > MAX_RECENT_NAME {
        return fail(
            Problem::NotCanonical,
            format!(
                "--name of {} bytes: cut to {MAX_RECENT_NAME}, so names sharing those bytes share one list",
                name.len()
            ),
        );
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return fail(
            Problem::Unvetted,
            format!("--name {name}: only letters, digits, '-', '_' and '.' are vetted"),
        );
    }
    Ok(())
}

/// `VALUE/MASK`, each a 32-bit number in lower-case hex without leading zeros.
fn mark(opt: &str, text: &str) -> Result<(), RuleError> {
    let part = |p: &str| -> Option<u64> {
        let hex = p.strip_prefix("0x")?;
        let ok = !hex.is_empty()
            && hex.len() <= 9
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
            && (hex == "0" || !hex.starts_with('0'));
        ok.then(|| u64::from_str_radix(hex, 16).ok()).flatten()
    };
    let Some((v, m)) = text.split_once('/') else {
        return fail(
            Problem::NotCanonical,
            format!("{opt} {text}: iptables-save prints VALUE/MASK"),
        );
    };
    match (part(v), part(m)) {
        (Some(v), Some(m)) if v <= u64::from(u32::MAX) && m <= u64::from(u32::MAX) => Ok(()),
        (Some(_), Some(_)) => fail(Problem::Refused, format!("{opt} {text}: out of range")),
        _ => fail(
            Problem::NotCanonical,
            format!("{opt} {text}: iptables-save prints lower-case hex"),
        ),
    }
}

/// `--ctstate S,S,…` in the order `iptables-save` prints states.
fn ctstate(text: &str) -> Result<(), RuleError> {
    const ORDER: [&str; 7] = [
        "INVALID",
        "NEW",
        "RELATED",
        "ESTABLISHED",
        "UNTRACKED",
        "SNAT",
        "DNAT",
    ];
    let mut last = None;
    for s in text.split(',') {
        let Some(i) = ORDER.iter().position(|o| *o == s) else {
            return fail(
                Problem::Refused,
                format!("--ctstate {text}: unknown state {s}"),
            );
        };
        if last.is_some_and(|l| l >= i) {
            return fail(
                Problem::NotCanonical,
                format!(
                    "--ctstate {text}: printed back in the order {}",
                    ORDER.join(",")
                ),
            );
        }
        last = Some(i);
    }
    Ok(())
}

#[cfg(test)]
mod tests;
