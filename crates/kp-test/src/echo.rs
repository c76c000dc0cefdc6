//! Driving the `kp-echo` binary from tests: start a backend, send requests, read outcomes.
//!
//! Both ends run inside lab namespaces through `ip netns exec`; this module only builds the
//! command lines and parses the one-line-per-attempt output documented in `kp-echo --help`.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use crate::netns::{ChildGuard, Netns};
use crate::{Error, Result};

static ECHO_BINARY: OnceLock<PathBuf> = OnceLock::new();

/// How long [`serve`] waits for a backend to bind its ports.
const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// A transport protocol kp-echo speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Proto {
    /// TCP: one connection per attempt, an HTTP/1.1 GET answered with `200 OK`.
    Tcp,
    /// UDP: one datagram per attempt, answered with one datagram.
    Udp,
    /// SCTP: one association per attempt (one-to-one style), answered like TCP. Only where
    /// the kernel has SCTP: see [`sctp_support`].
    Sctp,
}

impl Proto {
    /// The word kp-echo uses on its command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
            Proto::Sctp => "sctp",
        }
    }
}

/// What happened to one request attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// A backend answered.
    Answered {
        /// The backend's `--name`.
        backend: String,
        /// The source address the backend saw (the client's own, or a masquerade address).
        client_seen: IpAddr,
    },
    /// No answer before the timeout (dropped somewhere, or blackholed).
    Timeout,
    /// ECONNREFUSED: a TCP RST or an ICMP port unreachable.
    Refused,
    /// EHOSTUNREACH or ENETUNREACH: no route, or an ICMP host/net unreachable or prohibited.
    Unreachable,
    /// ECONNRESET: the connection was reset after it was established.
    Reset,
    /// Anything else kp-echo reported (another errno, a malformed answer, a failure to run
    /// kp-echo at all), as text.
    Other(String),
}

impl Outcome {
    /// Reads one line of `kp-echo request` output.
    pub fn parse(line: &str) -> Outcome {
        let line = line.trim();
        match line {
            "timeout" => return Outcome::Timeout,
            "refused" => return Outcome::Refused,
            "unreachable" => return Outcome::Unreachable,
            "reset" => return Outcome::Reset,
            _ => {}
        }
        if let Some(message) = line.strip_prefix("error ") {
            return Outcome::Other(message.to_string());
        }
        let mut words = line.split_whitespace();
        match (words.next(), words.next().map(str::parse), words.next()) {
            (Some(backend), Some(Ok(client_seen)), None) => Outcome::Answered {
                backend: backend.to_string(),
                client_seen,
            },
            _ => Outcome::Other(format!("unreadable kp-echo output `{line}`")),
        }
    }

    /// The backend that answered, if one did.
    pub fn backend(&self) -> Option<&str> {
        match self {
            Outcome::Answered { backend, .. } => Some(backend),
            _ => None,
        }
    }

    /// The backend that answered, or the failure's word (`timeout`, `refused`, `unreachable`,
    /// `reset`, `error`): what tests count and compare.
    pub fn label(&self) -> String {
        match self {
            Outcome::Answered { backend, .. } => backend.clone(),
            Outcome::Other(_) => "error".to_string(),
            other => other.to_string(),
        }
    }
}

impl fmt::Display for Outcome {
    /// The same words kp-echo prints, so `Outcome::parse` reads them back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Answered {
                backend,
                client_seen,
            } => write!(f, "{backend} {client_seen}"),
            Outcome::Timeout => f.write_str("timeout"),
            Outcome::Refused => f.write_str("refused"),
            Outcome::Unreachable => f.write_str("unreachable"),
            Outcome::Reset => f.write_str("reset"),
            Outcome::Other(message) => write!(f, "error {message}"),
        }
    }
}

/// Counts outcomes by backend name, and failures by their word (`timeout`, `refused`, ...), to
/// check how requests spread over endpoints.
pub fn tally(outcomes: &[Outcome]) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for outcome in outcomes {
        *counts.entry(outcome.label()).or_insert(0) += 1;
    }
    counts
}

/// One `kp-echo request` invocation: `count` attempts at `ip:port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// TCP or UDP.
    pub proto: Proto,
    /// Where to send (a ClusterIP, a node IP, a pod IP, ...).
    pub ip: IpAddr,
    /// The destination port.
    pub port: u16,
    /// How many attempts; each uses a new socket and so a new source port, unless `src_port`
    /// is set.
    pub count: usize,
    /// Source address to bind (one of the client's aliases, to test source ranges).
    pub src_ip: Option<IpAddr>,
    /// Source port to bind, the same for every attempt (to test affinity or conntrack reuse).
    pub src_port: Option<u16>,
    /// Per attempt, for connecting and reading the answer together.
    pub timeout: Duration,
}

impl Request {
    /// One attempt, from any source, with a 2 s timeout.
    pub fn new(proto: Proto, ip: IpAddr, port: u16) -> Request {
        Request {
            proto,
            ip,
            port,
            count: 1,
            src_ip: None,
            src_port: None,
            timeout: Duration::from_secs(2),
        }
    }

    /// Sets the number of attempts (at least 1).
    pub fn count(mut self, count: usize) -> Request {
        self.count = count.max(1);
        self
    }

    /// Sets the source address.
    pub fn src_ip(mut self, ip: IpAddr) -> Request {
        self.src_ip = Some(ip);
        self
    }

    /// Sets the source port.
    pub fn src_port(mut self, port: u16) -> Request {
        self.src_port = Some(port);
        self
    }

    /// Sets the per-attempt timeout (at least 1 ms).
    pub fn timeout(mut self, timeout: Duration) -> Request {
        self.timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// The kp-echo arguments, after the binary's path.
    fn args(&self) -> Vec<String> {
        let mut args = vec![
            "request".to_string(),
            self.proto.as_str().to_string(),
            self.ip.to_string(),
            self.port.to_string(),
            "--timeout-ms".to_string(),
            self.timeout.as_millis().max(1).to_string(),
            "--count".to_string(),
            self.count.to_string(),
        ];
        if let Some(ip) = self.src_ip {
            args.extend(["--src-ip".to_string(), ip.to_string()]);
        }
        if let Some(port) = self.src_port {
            args.extend(["--src-port".to_string(), port.to_string()]);
        }
        args
    }
}

/// Runs `req` from namespace `from`: one outcome per attempt, in order.
///
/// Never fails: if kp-echo cannot run, every attempt is an [`Outcome::Other`] saying why.
pub fn request(from: &Netns, req: &Request) -> Vec<Outcome> {
    let failed = |why: String| vec![Outcome::Other(why); req.count];
    let binary = match try_echo_binary() {
        Ok(binary) => binary,
        Err(e) => return failed(e.to_string()),
    };
    let binary = binary.to_string_lossy();
    let args = req.args();
    let mut argv: Vec<&str> = vec![&binary];
    argv.extend(args.iter().map(String::as_str));
    let out = match from.exec(&argv) {
        Ok(out) => out,
        Err(e) => return failed(e.to_string()),
    };
    if !out.status.success() {
        return failed(format!(
            "kp-echo {} ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let mut outcomes: Vec<Outcome> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(Outcome::parse)
        .collect();
    outcomes.resize(
        req.count.max(outcomes.len()),
        Outcome::Other("kp-echo printed fewer lines than attempts".to_string()),
    );
    outcomes
}

/// Starts `req` from namespace `from` in the background, making attempts one after another for
/// `duration` (not `req.count` of them); [`finished_requests`] reads the outcomes once it is
/// done. For traffic that must keep flowing while a test does something else (restarts the
/// proxy, switches its mode).
pub fn spawn_requests(from: &Netns, req: &Request, duration: Duration) -> Result<ChildGuard> {
    let binary = try_echo_binary()?;
    let binary = binary.to_string_lossy();
    let mut args = req.args();
    args.extend([
        "--duration-ms".to_string(),
        duration.as_millis().max(1).to_string(),
    ]);
    let mut argv: Vec<&str> = vec![&binary];
    argv.extend(args.iter().map(String::as_str));
    from.spawn(&argv)
}

/// What a [`spawn_requests`] run saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimedOutcomes {
    /// Every attempt's outcome, in order.
    pub outcomes: Vec<Outcome>,
    /// The longest attempt: a connection answered only after its first SYN was lost takes a
    /// second or more (the first retransmission).
    pub slowest: Duration,
}

/// Waits up to `timeout` for a [`spawn_requests`] run to end; its outcomes, in order.
pub fn finished_requests(child: &mut ChildGuard, timeout: Duration) -> Result<TimedOutcomes> {
    wait_exit(child, timeout)?;
    let mut slowest = Duration::ZERO;
    let outcomes = child
        .log()
        .lines()
        .map(|line| {
            let (line, ms) = match line.rsplit_once(" ms=") {
                Some((l, ms)) => (l, ms.trim().parse().unwrap_or(u64::MAX)),
                None => (line, 0),
            };
            slowest = slowest.max(Duration::from_millis(ms));
            Outcome::parse(line)
        })
        .collect();
    Ok(TimedOutcomes { outcomes, slowest })
}

/// Starts `kp-echo resolver` in namespace `from`: one connected UDP socket to `ip:port`, as a
/// DNS resolver keeps one, a query every `interval` (each waits `timeout` for its answer) for
/// `duration`; a new socket only after an error other than a timeout. Read what it saw so far
/// with [`resolver_queries`] of the child's log.
pub fn spawn_resolver(
    from: &Netns,
    ip: IpAddr,
    port: u16,
    interval: Duration,
    timeout: Duration,
    duration: Duration,
) -> Result<ChildGuard> {
    let binary = try_echo_binary()?;
    let binary = binary.to_string_lossy();
    let ms = |d: Duration| d.as_millis().max(1).to_string();
    let (ip, port) = (ip.to_string(), port.to_string());
    let (interval, timeout, duration) = (ms(interval), ms(timeout), ms(duration));
    from.spawn(&[
        &binary,
        "resolver",
        "udp",
        &ip,
        &port,
        "--interval-ms",
        &interval,
        "--timeout-ms",
        &timeout,
        "--duration-ms",
        &duration,
    ])
}

/// The queries of a [`spawn_resolver`] run in its `log`: when each was answered or failed
/// (since the run started), and how.
pub fn resolver_queries(log: &str) -> Vec<(Duration, Outcome)> {
    log.lines()
        .filter_map(|line| {
            let (outcome, at) = line.rsplit_once(" at=")?;
            let at = Duration::from_millis(at.trim().parse().ok()?);
            Some((at, Outcome::parse(outcome)))
        })
        .collect()
}

/// What a `kp-echo stream` run saw: one long-lived TCP connection sending a line every
/// interval, each echoed back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamResult {
    /// The backend that answered.
    pub backend: String,
    /// Lines sent.
    pub sent: u64,
    /// Lines echoed back.
    pub echoed: u64,
    /// The longest time between two echoes.
    pub max_gap: Duration,
    /// Why the connection broke (`reset`, `timeout`, ...), if it did.
    pub failed: Option<String>,
}

/// Starts `kp-echo stream` from `from` to `ip:port` (TCP): one connection sending a line every
/// `interval` for `duration`. [`finished_stream`] reads its result.
pub fn spawn_stream(
    from: &Netns,
    ip: IpAddr,
    port: u16,
    interval: Duration,
    duration: Duration,
) -> Result<ChildGuard> {
    spawn_stream_from_port(from, None, ip, port, interval, duration)
}

/// [`spawn_stream`] from the local port `src_port` when given (bound with `SO_REUSEADDR`), else
/// from one the kernel picks.
pub fn spawn_stream_from_port(
    from: &Netns,
    src_port: Option<u16>,
    ip: IpAddr,
    port: u16,
    interval: Duration,
    duration: Duration,
) -> Result<ChildGuard> {
    let binary = try_echo_binary()?;
    let binary = binary.to_string_lossy();
    let (ip, port) = (ip.to_string(), port.to_string());
    let (interval, duration) = (
        interval.as_millis().max(1).to_string(),
        duration.as_millis().max(1).to_string(),
    );
    let src_port = src_port.map(|p| p.to_string());
    let mut args = vec![
        &*binary,
        "stream",
        "tcp",
        &ip,
        &port,
        "--interval-ms",
        &interval,
        "--duration-ms",
        &duration,
        "--timeout-ms",
        "2000",
    ];
    if let Some(src_port) = &src_port {
        args.extend(["--src-port", src_port]);
    }
    from.spawn(&args)
}

/// Waits up to `timeout` for a [`spawn_stream`] run to end and parses its result line.
pub fn finished_stream(child: &mut ChildGuard, timeout: Duration) -> Result<StreamResult> {
    wait_exit(child, timeout)?;
    let log = child.log();
    let line = log
        .lines()
        .find(|l| l.starts_with("stream "))
        .ok_or_else(|| {
            Error::InvalidArgument(format!("kp-echo stream printed no result:\n{log}"))
        })?;
    let mut words = line.split_whitespace().skip(1);
    let backend = words.next().unwrap_or("-").to_string();
    let mut result = StreamResult {
        backend,
        sent: 0,
        echoed: 0,
        max_gap: Duration::ZERO,
        failed: None,
    };
    for word in words {
        match word.split_once('=') {
            Some(("sent", v)) => result.sent = v.parse().unwrap_or(0),
            Some(("echoed", v)) => result.echoed = v.parse().unwrap_or(0),
            Some(("max_gap_ms", v)) => {
                result.max_gap = Duration::from_millis(v.parse().unwrap_or(u64::MAX))
            }
            Some(("failed", v)) => result.failed = Some(v.to_string()),
            _ => {}
        }
    }
    Ok(result)
}

fn wait_exit(child: &mut ChildGuard, timeout: Duration) -> Result<()> {
    let start = std::time::Instant::now();
    while child.try_wait()?.is_none() {
        if start.elapsed() > timeout {
            return Err(Error::NotReady {
                what: "kp-echo to finish".into(),
                after: start.elapsed(),
                detail: child.log(),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Starts `kp-echo serve --name NAME` in `ns` on the given TCP and UDP ports and waits until it
/// has bound them all.
pub fn serve(ns: &Netns, name: &str, tcp: &[u16], udp: &[u16]) -> Result<ChildGuard> {
    let ports: Vec<(Proto, u16)> = tcp
        .iter()
        .map(|&p| (Proto::Tcp, p))
        .chain(udp.iter().map(|&p| (Proto::Udp, p)))
        .collect();
    serve_on(ns, name, &ports)
}

/// Starts `kp-echo serve --name NAME` in `ns` on the given ports of any protocol and waits until
/// it has bound them all. SCTP ports fail to bind where the kernel lacks SCTP.
pub fn serve_on(ns: &Netns, name: &str, ports: &[(Proto, u16)]) -> Result<ChildGuard> {
    let binary = try_echo_binary()?;
    let binary = binary.to_string_lossy();
    let ports: Vec<(String, String)> = ports
        .iter()
        .map(|(proto, port)| (format!("--{}", proto.as_str()), port.to_string()))
        .collect();
    let mut argv: Vec<&str> = vec![&binary, "serve", "--name", name];
    for (flag, port) in &ports {
        argv.extend([flag.as_str(), port.as_str()]);
    }
    let mut child = ns.spawn(&argv)?;
    child.wait_for_log(&format!("kp-echo {name} ready"), READY_TIMEOUT)?;
    Ok(child)
}

/// Whether this kernel has SCTP, or why not. Asked once per process by opening (and at once
/// closing) an SCTP socket: no address is bound and no packet is sent. Network namespaces share
/// the kernel, so the answer holds inside every lab namespace.
pub fn sctp_support() -> std::result::Result<(), String> {
    static SUPPORT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    SUPPORT
        .get_or_init(|| {
            socket2::Socket::new(
                socket2::Domain::IPV4,
                socket2::Type::STREAM,
                Some(socket2::Protocol::from(IPPROTO_SCTP)),
            )
            .map(drop)
            .map_err(|e| format!("this kernel has no SCTP: socket(AF_INET, SOCK_STREAM, IPPROTO_SCTP) failed: {e}"))
        })
        .clone()
}

/// `IPPROTO_SCTP` from `<netinet/in.h>`.
const IPPROTO_SCTP: i32 = 132;

/// Tells this process which kp-echo to use, ahead of the search in [`echo_binary`]. kp-test's
/// own tests pass `env!("CARGO_BIN_EXE_kp-echo")`. The first call wins.
pub fn use_echo_binary(path: impl Into<PathBuf>) {
    let _ = ECHO_BINARY.set(path.into());
}

/// The kp-echo binary; panics with the reason if it can be neither found nor built.
///
/// See [`try_echo_binary`] for where it looks.
pub fn echo_binary() -> PathBuf {
    match try_echo_binary() {
        Ok(path) => path,
        Err(e) => panic!("{e}"),
    }
}

/// The kp-echo binary, found in this order and remembered for the process:
///
/// 1. the path given to [`use_echo_binary`];
/// 2. `$KP_ECHO`;
/// 3. `kp-echo` beside the running test (`target/<profile>/`, the parent of `deps/`);
/// 4. `target/debug/kp-echo` or `target/release/kp-echo` of this workspace (or of
///    `$CARGO_TARGET_DIR`);
/// 5. built with `cargo build -p kp-test --bin kp-echo` into `target/kp-echo/`: a separate
///    target directory, because the `cargo test` that runs us may hold the lock on the usual
///    one.
pub fn try_echo_binary() -> Result<PathBuf> {
    if let Some(path) = ECHO_BINARY.get() {
        return Ok(path.clone());
    }
    let path = locate_echo_binary()?;
    Ok(ECHO_BINARY.get_or_init(|| path).clone())
}

fn locate_echo_binary() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("KP_ECHO") {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(Error::EchoBinary(format!(
                "$KP_ECHO is {}, which is not a file",
                path.display()
            )))
        };
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace.join("target"));
    let beside_test = std::env::current_exe().ok().and_then(|exe| {
        let dir = exe.parent()?;
        let dir = if dir.ends_with("deps") {
            dir.parent()?
        } else {
            dir
        };
        Some(dir.join("kp-echo"))
    });
    let candidates = beside_test
        .into_iter()
        .chain([target.join("debug/kp-echo"), target.join("release/kp-echo")]);
    for candidate in candidates {
        if candidate.is_file() {
            return Ok(candidate);
        }
    }

    let build_dir = workspace.join("target/kp-echo");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(&cargo)
        .args([
            "build",
            "--quiet",
            "-p",
            "kp-test",
            "--bin",
            "kp-echo",
            "--target-dir",
        ])
        .arg(&build_dir)
        .current_dir(&workspace)
        .status()
        .map_err(|e| Error::EchoBinary(format!("running {}: {e}", cargo.to_string_lossy())))?;
    let built = build_dir.join("debug/kp-echo");
    if status.success() && built.is_file() {
        Ok(built)
    } else {
        Err(Error::EchoBinary(format!(
            "not found, and `cargo build -p kp-test --bin kp-echo` failed ({status})"
        )))
    }
}

#[cfg(test)]
mod tests;
