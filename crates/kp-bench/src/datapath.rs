//! The data path: new TCP connections per second, connect latency and bulk throughput from one
//! lab pod to another, through the ClusterIP and straight to the pod IP.
//!
//! The server and the client are this binary's hidden `datapath-server` and `datapath-client`
//! subcommands, started inside the pods' namespaces with `ip netns exec`. Every connection-rate
//! socket closes with linger 0 (an RST), so a run leaves no TIME_WAIT behind and never runs out
//! of ports; conntrack on the node sees each connection open and close. The client's connecting
//! threads are named `kp-connect` and the server's accepting thread `kp-accept`, so a system-wide
//! profile tells them apart (both processes are `bench`).
//!
//! # Profiling the connect runs of one target
//!
//! With `KP_PERF_CTL=CTL[,ACK]` (the fifos of `perf record -D -1 --control fifo:CTL[,ACK]`) and
//! `KP_PERF_TARGET=vip` or `direct`, [`measure`] has each connect run of that target (both
//! rounds, with the N Services installed; never the other target's runs, the runs before any
//! rule, the warm-ups or the bulk transfers) write `enable` to CTL when its measured seconds start
//! and `disable` when they end, each time waiting for perf's `ack` on ACK if given, so perf
//! samples those seconds alone. `KP_PERF_EVENT=NAME` writes `enable NAME` / `disable NAME`
//! instead: perf then switches that event alone and keeps its side-band tracking on, so a process
//! started while sampling is off (the second run's client) still has its name and symbols.
//! scripts/profile.sh records `nftables-datapath-vip-30k` and `-direct-30k` this way. Every size
//! and mode of the run is profiled alike: give one of each. The fifo without the target or the
//! other way round, an unknown target, or a path that is not a fifo is refused before anything
//! runs. The same switch serves the sync phase ([`PerfTarget::FullSync`],
//! [`PerfTarget::Changes`]; see `run.rs`).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use socket2::{Domain, SockRef, Socket, Type};

use crate::results::{Connect, Datapath};
use crate::stats::{median, Summary};

/// What the server prints once both ports listen.
pub const READY: &str = "datapath server listening";

/// How long one connect may take before it counts as an error.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Connections made before the measurement starts (warms conntrack, caches, the scheduler).
const WARMUP: Duration = Duration::from_millis(300);
/// Bytes per write and read.
const CHUNK: usize = 256 * 1024;
/// Quiet time after emptying the conntrack table, while the kernel frees what it held.
const SETTLE: Duration = Duration::from_secs(1);
/// Bytes each new connection sends and has echoed before it counts: its latency is to the first
/// answer from the pod (a proxy that relays, as userspace mode does, completes the client's
/// handshake itself, so the handshake alone would time the proxy, not the path to the pod).
const HELLO: usize = 64;
/// Accepted connect-port connections the server keeps before dropping the oldest.
const HELD: usize = 4096;

fn listener(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    s.bind(&addr.into())?;
    // A deep accept queue: a full one drops SYNs, and a dropped SYN costs a 1 s retransmit.
    s.listen(4096)?;
    Ok(s.into())
}

/// Serves until killed: `connect` accepts every connection, echoes its first [`HELLO`] bytes
/// (and drops it, with a reset, a few thousand connections later), `bulk` reads each connection to its end, then closes it
/// normally.
pub fn serve(connect: SocketAddr, bulk: SocketAddr) -> anyhow::Result<()> {
    let c = listener(connect)?;
    let b = listener(bulk)?;
    eprintln!("{READY} on {connect} and {bulk}");
    std::thread::Builder::new()
        .name("kp-bulk".into())
        .spawn(move || {
            for s in b.incoming().flatten() {
                let _ = std::thread::Builder::new()
                    .name("kp-bulk".into())
                    .spawn(move || {
                        let mut s = s;
                        let mut buf = vec![0u8; CHUNK];
                        while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
                        // A normal close: the client waits for this FIN to know everything arrived.
                    });
            }
        })?;
    // Accepted connections are kept a while before they are dropped: a server that reset each
    // one at once would often do it before the client's connect() returned, and the client
    // would see ECONNRESET for a connection that was in fact established. By the time one is
    // dropped here its client has long reset it. The loop runs on a thread of its own only for
    // its name (`kp-accept`) in profiles.
    let accept = std::thread::Builder::new()
        .name("kp-accept".into())
        .spawn(move || {
            let mut held = std::collections::VecDeque::with_capacity(HELD);
            for s in c.incoming() {
                match s {
                    Ok(mut s) => {
                        let _ = SockRef::from(&s).set_linger(Some(Duration::ZERO));
                        // Answer the client's first bytes, so that its latency is to the first
                        // answer from the pod itself (through a relaying proxy too).
                        let _ = s.set_read_timeout(Some(CONNECT_TIMEOUT));
                        let mut hello = [0u8; HELLO];
                        if s.read_exact(&mut hello).is_ok() {
                            let _ = s.write_all(&hello);
                        }
                        if held.len() == HELD {
                            held.pop_front();
                        }
                        held.push_back(s);
                    }
                    // A connection reset before it was accepted.
                    Err(_) => continue,
                }
            }
        })?;
    let _ = accept.join();
    Ok(())
}

/// The environment variable naming perf's control fifo, and optionally its acknowledgement fifo
/// after a comma, as `perf record --control fifo:CTL[,ACK]` takes them.
pub const PERF_CTL_ENV: &str = "KP_PERF_CTL";
/// The environment variable naming the one event to switch (`enable NAME`); without it, every
/// event is switched.
pub const PERF_EVENT_ENV: &str = "KP_PERF_EVENT";
/// The environment variable naming the target whose connect runs perf samples: `vip` or
/// `direct`.
pub const PERF_TARGET_ENV: &str = "KP_PERF_TARGET";

/// How long perf may take to acknowledge a command.
const PERF_ACK_TIMEOUT: Duration = Duration::from_secs(10);

/// How a connect run turns perf's sampling on and off: perf's control fifo, its acknowledgement
/// fifo (each command then waits until perf has carried it out), and the event to switch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PerfSwitch {
    /// perf's control fifo.
    pub fifo: PathBuf,
    /// perf's acknowledgement fifo, if it was given one.
    pub ack: Option<PathBuf>,
    /// The event to switch (`enable NAME`); `None` switches every event, perf's side-band
    /// tracking included, which loses the names and maps of processes started while it is off.
    pub event: Option<String>,
}

fn fifo_path(var: &str, path: &str) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::FileTypeExt;
    let meta = std::fs::metadata(path).map_err(|e| anyhow::anyhow!("{var}: {path}: {e}"))?;
    if !meta.file_type().is_fifo() {
        anyhow::bail!(
            "{var}: {path} is not a fifo (mkfifo it and give it to perf record --control fifo:)"
        );
    }
    Ok(PathBuf::from(path))
}

impl PerfSwitch {
    /// The switch for `CTL[,ACK]` and an event name; both paths must be fifos.
    pub fn parse(ctl: &str, event: Option<&str>) -> anyhow::Result<PerfSwitch> {
        let (fifo, ack) = match ctl.split_once(',') {
            Some((c, a)) => (c, Some(a)),
            None => (ctl, None),
        };
        Ok(PerfSwitch {
            fifo: fifo_path(PERF_CTL_ENV, fifo)?,
            ack: ack.map(|a| fifo_path(PERF_CTL_ENV, a)).transpose()?,
            event: event.filter(|e| !e.is_empty()).map(str::to_owned),
        })
    }

    /// The client's arguments that hand this switch on.
    fn args(&self) -> Vec<String> {
        let mut ctl = self.fifo.display().to_string();
        if let Some(a) = &self.ack {
            ctl = format!("{ctl},{}", a.display());
        }
        let mut args = vec!["--perf-ctl".to_owned(), ctl];
        if let Some(e) = &self.event {
            args.extend(["--perf-event".to_owned(), e.clone()]);
        }
        args
    }

    /// Turns sampling on or off; with an acknowledgement fifo, returns once perf has.
    pub fn set(&self, on: bool) -> anyhow::Result<()> {
        let verb = if on { "enable" } else { "disable" };
        let command = match &self.event {
            Some(e) => format!("{verb} {e}\n"),
            None => format!("{verb}\n"),
        };
        std::fs::write(&self.fifo, &command)
            .map_err(|e| anyhow::anyhow!("perf control fifo {}: {e}", self.fifo.display()))?;
        let Some(ack) = &self.ack else { return Ok(()) };
        // The read runs on a thread of its own so that a perf that never answers is an error,
        // not a hang.
        let (tx, rx) = std::sync::mpsc::channel();
        let path = ack.clone();
        std::thread::spawn(move || {
            let read = || -> std::io::Result<String> {
                let mut f = std::fs::File::open(&path)?;
                let (mut line, mut byte) = (Vec::new(), [0u8; 1]);
                while f.read(&mut byte)? == 1 && byte[0] != b'\n' {
                    line.push(byte[0]);
                }
                Ok(String::from_utf8_lossy(&line).into_owned())
            };
            let _ = tx.send(read());
        });
        match rx.recv_timeout(PERF_ACK_TIMEOUT) {
            // perf ends each `ack\n` with a NUL, which the next read sees first.
            Ok(Ok(reply))
                if reply.trim_matches(|c: char| c == '\0' || c.is_whitespace()) == "ack" =>
            {
                Ok(())
            }
            Ok(Ok(reply)) => anyhow::bail!("perf answered `{}` to `{}`", reply, command.trim()),
            Ok(Err(e)) => anyhow::bail!("perf acknowledgement fifo {}: {e}", ack.display()),
            Err(_) => anyhow::bail!(
                "perf did not acknowledge `{}` within {:?}",
                command.trim(),
                PERF_ACK_TIMEOUT
            ),
        }
    }
}

/// What perf samples: the data path's connect runs or bulk transfers to one target, or the
/// in-process sync phase's first full sync or its one-endpoint changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PerfTarget {
    /// The new-connection runs through the ClusterIP (`vip: true`, `vip`) or straight to the
    /// pod (`direct`).
    Connect {
        /// Through the ClusterIP.
        vip: bool,
    },
    /// The bulk transfers through the ClusterIP (`vip-bulk`) or straight to the pod
    /// (`direct-bulk`).
    Bulk {
        /// Through the ClusterIP.
        vip: bool,
    },
    /// The first full sync of the in-process dataplane (`full-sync`): planning and applying.
    FullSync,
    /// The in-process one-endpoint changes (`changes`), each a partial sync.
    Changes,
}

impl PerfTarget {
    /// The target `KP_PERF_TARGET` names.
    fn parse(name: &str) -> anyhow::Result<PerfTarget> {
        Ok(match name {
            "vip" => PerfTarget::Connect { vip: true },
            "direct" => PerfTarget::Connect { vip: false },
            "vip-bulk" => PerfTarget::Bulk { vip: true },
            "direct-bulk" => PerfTarget::Bulk { vip: false },
            "full-sync" => PerfTarget::FullSync,
            "changes" => PerfTarget::Changes,
            other => anyhow::bail!(
                "{PERF_TARGET_ENV}={other}: expected vip, direct, vip-bulk, direct-bulk, full-sync \
                 or changes"
            ),
        })
    }
}

/// Which runs perf samples, and how they switch it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PerfControl {
    /// The fifos and the event.
    pub switch: PerfSwitch,
    /// What is sampled.
    pub target: PerfTarget,
}

impl PerfControl {
    /// Reads [`PERF_CTL_ENV`], [`PERF_EVENT_ENV`] and [`PERF_TARGET_ENV`]: `None` when neither
    /// the fifo nor the target is set.
    pub fn from_env() -> anyhow::Result<Option<PerfControl>> {
        let var = |name: &str| {
            std::env::var_os(name).map(|v| {
                v.into_string()
                    .map_err(|v| anyhow::anyhow!("{name}={}: not UTF-8", v.to_string_lossy()))
            })
        };
        let ctl = var(PERF_CTL_ENV).transpose()?;
        let event = var(PERF_EVENT_ENV).transpose()?;
        let target = var(PERF_TARGET_ENV).transpose()?;
        Self::parse(ctl.as_deref(), event.as_deref(), target.as_deref())
    }

    /// The control for the three variables' values.
    pub fn parse(
        ctl: Option<&str>,
        event: Option<&str>,
        target: Option<&str>,
    ) -> anyhow::Result<Option<PerfControl>> {
        let (ctl, target) = match (ctl, target) {
            (None, None) => return Ok(None),
            (Some(c), Some(t)) => (c, t),
            (Some(_), None) => {
                anyhow::bail!(
                    "{PERF_CTL_ENV} is set but {PERF_TARGET_ENV} is not (vip, direct, ...)"
                )
            }
            (None, Some(_)) => {
                anyhow::bail!(
                    "{PERF_TARGET_ENV} is set but {PERF_CTL_ENV} (perf's control fifo) is not"
                )
            }
        };
        Ok(Some(PerfControl {
            target: PerfTarget::parse(target)?,
            switch: PerfSwitch::parse(ctl, event)?,
        }))
    }

    /// The switch, when `target` is the one sampled.
    pub fn switch_for(&self, target: PerfTarget) -> Option<&PerfSwitch> {
        (self.target == target).then_some(&self.switch)
    }
}

/// Raw samples of one connection-rate run, as the client prints them.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ConnectSamples {
    /// Seconds measured (after the warm-up).
    pub seconds: f64,
    /// Connect latencies, microseconds.
    pub latency_us: Vec<f64>,
    /// Failed connects.
    pub errors: usize,
    /// Failed connects by error (`Connection refused (os error 111)`, ...).
    pub error_kinds: std::collections::BTreeMap<String, usize>,
}

/// Opens connections to `target` from `threads` threads for `seconds` (after a short warm-up),
/// has [`HELLO`] bytes echoed on each, and resets it; records each one's latency (SYN to the
/// echo's arrival). With `perf`, turns perf's
/// sampling on when the measured seconds start and off when they end; fails only when it cannot.
pub fn connect_run(
    target: SocketAddr,
    seconds: f64,
    threads: usize,
    perf: Option<&PerfSwitch>,
) -> anyhow::Result<ConnectSamples> {
    let warm_until = Instant::now() + WARMUP;
    let start = warm_until;
    let end = start + Duration::from_secs_f64(seconds);
    let workers = (0..threads.max(1))
        .map(|_| {
            std::thread::Builder::new()
                .name("kp-connect".into())
                .spawn(move || {
                    let mut lat = Vec::new();
                    let mut errors = std::collections::BTreeMap::<String, usize>::new();
                    loop {
                        let t = Instant::now();
                        if t >= end {
                            break;
                        }
                        let r = TcpStream::connect_timeout(&target, CONNECT_TIMEOUT)
                            .and_then(|s| first_answer(s));
                        let took = t.elapsed();
                        let measured = t >= start;
                        match r {
                            Ok(s) => {
                                let _ = SockRef::from(&s).set_linger(Some(Duration::ZERO));
                                if measured {
                                    lat.push(took.as_secs_f64() * 1e6);
                                }
                            }
                            Err(e) if measured => *errors.entry(e.to_string()).or_default() += 1,
                            Err(_) => {}
                        }
                    }
                    (lat, errors)
                })
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    if let Some(perf) = perf {
        std::thread::sleep(start.saturating_duration_since(Instant::now()));
        perf.set(true)?;
        std::thread::sleep(end.saturating_duration_since(Instant::now()));
        perf.set(false)?;
    }
    let mut out = ConnectSamples {
        seconds,
        ..ConnectSamples::default()
    };
    for w in workers {
        if let Ok((lat, errors)) = w.join() {
            out.latency_us.extend(lat);
            for (k, n) in errors {
                out.errors += n;
                *out.error_kinds.entry(k).or_default() += n;
            }
        }
    }
    Ok(out)
}

/// Sends [`HELLO`] bytes on a new connection and reads the server's echo of them: the first
/// answer from the pod. Returns the connection for its reset.
pub(crate) fn first_answer(mut s: TcpStream) -> std::io::Result<TcpStream> {
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(CONNECT_TIMEOUT))?;
    let hello = [0x5au8; HELLO];
    s.write_all(&hello)?;
    let mut echo = [0u8; HELLO];
    s.read_exact(&mut echo)?;
    if echo != hello {
        return Err(std::io::Error::other("the echo differs from what was sent"));
    }
    Ok(s)
}

/// Sends `bytes` to `target`, half-closes, and waits for the server to close: Gbit/s.
pub fn bulk_run(target: SocketAddr, bytes: u64) -> anyhow::Result<f64> {
    let start = Instant::now();
    let mut s = TcpStream::connect_timeout(&target, CONNECT_TIMEOUT)?;
    let buf = vec![0x5au8; CHUNK];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(CHUNK as u64) as usize;
        s.write_all(&buf[..n])?;
        left -= n as u64;
    }
    s.shutdown(Shutdown::Write)?;
    let mut rest = [0u8; 64];
    while s.read(&mut rest)? > 0 {}
    let secs = start.elapsed().as_secs_f64();
    Ok(bytes as f64 * 8.0 / secs / 1e9)
}

/// Where to measure, and how long.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The ClusterIP's connect port.
    pub vip_connect: SocketAddr,
    /// The ClusterIP's bulk port.
    pub vip_bulk: SocketAddr,
    /// The pod's connect port.
    pub direct_connect: SocketAddr,
    /// The pod's bulk port.
    pub direct_bulk: SocketAddr,
    /// Seconds of connection-rate measurement per target (split over two alternating rounds).
    pub connect_seconds: f64,
    /// Client threads.
    pub threads: usize,
    /// Bytes per bulk transfer.
    pub bulk_bytes: u64,
    /// Bulk transfers per target (alternating; the median counts).
    pub bulk_repeats: usize,
    /// The connect runs perf samples, if any ([`PerfControl::from_env`]).
    pub perf: Option<PerfControl>,
    /// The cgroup v2 directory every client joins before it runs (its own pid written into
    /// `cgroup.procs` by the shell that then becomes the client), for a mode whose hooks act on
    /// a cgroup ([`crate::mode::SyncTarget::client_cgroup`]); it must be reachable under
    /// `ip netns exec`, which remounts `/sys`.
    pub cgroup: Option<PathBuf>,
    /// The CPU the client runs on (`taskset`), the server on another ([`Pinning`]).
    pub pinning: Option<Pinning>,
}

/// The CPUs the data path's two processes are pinned to, so neither competes with the other
/// for a core and a tail latency measures the path rather than the scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pinning {
    /// The client's CPU.
    pub client: usize,
    /// The server's CPU.
    pub server: usize,
}

impl Pinning {
    /// The client on CPU 0 and the server on CPU 1, on a machine with at least two CPUs.
    pub fn for_machine(cpus: usize) -> Option<Pinning> {
        (cpus >= 2).then_some(Pinning {
            client: 0,
            server: 1,
        })
    }

    /// The command prefix that runs a process on `cpu`.
    pub fn taskset(cpu: usize) -> [String; 3] {
        ["taskset".into(), "-c".into(), cpu.to_string()]
    }
}

fn client(
    ns: &kp_test::Netns,
    bench: &Path,
    plan: &Plan,
    args: &[String],
) -> anyhow::Result<String> {
    let cgroup = plan.cgroup.as_deref();
    let pin = plan.pinning.map(|p| Pinning::taskset(p.client));
    let exe = bench.to_string_lossy().into_owned();
    let procs = cgroup.map(|c| c.join("cgroup.procs").to_string_lossy().into_owned());
    let mut all: Vec<&str> = Vec::new();
    if let Some(procs) = &procs {
        // The shell moves itself into the cgroup, then becomes the client: the client is
        // inside before its first socket exists.
        all.extend([
            "sh",
            "-c",
            "echo $$ > \"$1\" && shift && exec \"$@\"",
            "sh",
            procs,
        ]);
    }
    if let Some(pin) = &pin {
        all.extend(pin.iter().map(String::as_str));
    }
    all.extend([exe.as_str(), "datapath-client"]);
    all.extend(args.iter().map(String::as_str));
    let out = ns.exec(&all)?;
    if !out.status.success() {
        anyhow::bail!(
            "datapath client {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn connect_in(
    ns: &kp_test::Netns,
    bench: &Path,
    plan: &Plan,
    target: SocketAddr,
    seconds: f64,
    perf: Option<&PerfSwitch>,
) -> anyhow::Result<ConnectSamples> {
    let threads = plan.threads;
    let mut args = vec![
        "connect".into(),
        "--target".into(),
        target.to_string(),
        "--seconds".into(),
        seconds.to_string(),
        "--threads".into(),
        threads.to_string(),
    ];
    if let Some(perf) = perf {
        args.extend(perf.args());
    }
    let out = client(ns, bench, plan, &args)?;
    Ok(serde_json::from_str(&out)?)
}

/// One bulk transfer from `ns`; with `perf`, sampled from the client's start to its end.
fn bulk_in(
    ns: &kp_test::Netns,
    bench: &Path,
    plan: &Plan,
    target: SocketAddr,
    perf: Option<&PerfSwitch>,
) -> anyhow::Result<f64> {
    let bytes = plan.bulk_bytes;
    if let Some(perf) = perf {
        perf.set(true)?;
    }
    let out = client(
        ns,
        bench,
        plan,
        &[
            "bulk".into(),
            "--target".into(),
            target.to_string(),
            "--bytes".into(),
            bytes.to_string(),
        ],
    );
    if let Some(perf) = perf {
        perf.set(false)?;
    }
    Ok(out?.trim().parse()?)
}

fn summarise(runs: &[ConnectSamples]) -> Connect {
    let lat: Vec<f64> = runs
        .iter()
        .flat_map(|r| r.latency_us.iter().copied())
        .collect();
    let secs: f64 = runs.iter().map(|r| r.seconds).sum();
    let errors = runs.iter().map(|r| r.errors).sum();
    Connect {
        per_second: if secs > 0.0 {
            lat.len() as f64 / secs
        } else {
            0.0
        },
        latency_us: Summary::of(&lat),
        errors,
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// Empties the node's conntrack table. A connection-rate run leaves tens of thousands of entries
/// behind (closed, kept for 10 s); the next run reuses the same client ports, and a ClusterIP
/// connection whose translated tuple meets a leftover entry of a direct run goes through NAT clash
/// resolution: an artefact of the benchmark, not something a pod's traffic pattern does.
fn flush_conntrack(node: &kp_test::Netns) -> anyhow::Result<()> {
    let out = node.exec(&["conntrack", "-F"])?;
    if !out.status.success() {
        anyhow::bail!(
            "conntrack -F in the node: {} (apt-get install conntrack)",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// New connections straight to the pod, measured like the direct half of [`measure`] (the same
/// seconds, in two runs, each after emptying the conntrack table): for a node that holds no rule
/// of ours yet.
pub fn measure_unloaded(
    client_ns: &kp_test::Netns,
    node: &kp_test::Netns,
    bench: &Path,
    plan: &Plan,
) -> anyhow::Result<Connect> {
    client_ns.sysctl("net.ipv4.ip_local_port_range", "1024 65535")?;
    let half = plan.connect_seconds / 2.0;
    let mut runs = Vec::new();
    for _ in 0..2 {
        flush_conntrack(node)?;
        std::thread::sleep(SETTLE);
        runs.push(connect_in(
            client_ns,
            bench,
            plan,
            plan.direct_connect,
            half,
            None,
        )?);
    }
    Ok(summarise(&runs))
}

/// Runs the measurements from `client_ns` (the server must already listen) through `node`:
/// connection rate and latency to both targets in two rounds (direct first, then the ClusterIP
/// first), each run after emptying the node's conntrack table and a second's quiet, then
/// alternating bulk transfers. With `plan.perf`, the runs of its target turn perf on for their
/// measured seconds.
pub fn measure(
    client_ns: &kp_test::Netns,
    node: &kp_test::Netns,
    bench: &Path,
    plan: &Plan,
) -> anyhow::Result<Datapath> {
    // Ports for a long run at tens of thousands of connections per second.
    client_ns.sysctl("net.ipv4.ip_local_port_range", "1024 65535")?;
    let half = plan.connect_seconds / 2.0;
    let (mut vip, mut direct) = (Vec::new(), Vec::new());
    // Two rounds in opposite orders, so neither target always runs first.
    for round in 0..2 {
        for vip_turn in [round == 1, round == 0] {
            flush_conntrack(node)?;
            std::thread::sleep(SETTLE);
            let perf = plan
                .perf
                .as_ref()
                .and_then(|p| p.switch_for(PerfTarget::Connect { vip: vip_turn }));
            if vip_turn {
                vip.push(connect_in(
                    client_ns,
                    bench,
                    plan,
                    plan.vip_connect,
                    half,
                    perf,
                )?);
            } else {
                direct.push(connect_in(
                    client_ns,
                    bench,
                    plan,
                    plan.direct_connect,
                    half,
                    perf,
                )?);
            }
        }
    }
    let (mut bv, mut bd) = (Vec::new(), Vec::new());
    for _ in 0..plan.bulk_repeats.max(1) {
        for vip_turn in [false, true] {
            let perf = plan
                .perf
                .as_ref()
                .and_then(|p| p.switch_for(PerfTarget::Bulk { vip: vip_turn }));
            let (target, into) = match vip_turn {
                true => (plan.vip_bulk, &mut bv),
                false => (plan.direct_bulk, &mut bd),
            };
            into.push(bulk_in(client_ns, bench, plan, target, perf)?);
        }
    }
    let vip = summarise(&vip);
    let direct = summarise(&direct);
    let (bulk_vip_gbps, bulk_direct_gbps) = (median(&bv), median(&bd));
    Ok(Datapath {
        latency_ratio_p50: ratio(vip.latency_us.p50, direct.latency_us.p50),
        latency_ratio_p99: ratio(vip.latency_us.p99, direct.latency_us.p99),
        rate_ratio: ratio(vip.per_second, direct.per_second),
        bulk_ratio: ratio(bulk_vip_gbps, bulk_direct_gbps),
        bulk_vip_gbps,
        bulk_direct_gbps,
        vip,
        direct,
        unloaded: None,
        unloaded_ratio_p50: None,
        unloaded_ratio_p99: None,
        pinned: plan.pinning.is_some(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perf_control_needs_both_variables_a_known_target_and_fifos() {
        assert_eq!(PerfControl::parse(None, None, None).unwrap(), None);
        let dir = tempfile::tempdir().unwrap();
        let mkfifo = |name: &str| {
            let p = dir.path().join(name);
            let made = std::process::Command::new("mkfifo")
                .arg(&p)
                .status()
                .unwrap();
            assert!(made.success());
            p
        };
        let (ctl, ack) = (mkfifo("ctl"), mkfifo("ack"));
        let c = ctl.to_str().unwrap();
        let vip = PerfControl::parse(Some(c), None, Some("vip"))
            .unwrap()
            .unwrap();
        let plain = PerfSwitch {
            fifo: ctl.clone(),
            ack: None,
            event: None,
        };
        assert_eq!(
            vip.switch_for(PerfTarget::Connect { vip: true }),
            Some(&plain)
        );
        assert_eq!(vip.switch_for(PerfTarget::Connect { vip: false }), None);
        assert_eq!(vip.switch_for(PerfTarget::Bulk { vip: true }), None);
        let bulk = PerfControl::parse(Some(c), None, Some("vip-bulk"))
            .unwrap()
            .unwrap();
        assert_eq!(
            bulk.switch_for(PerfTarget::Bulk { vip: true }),
            Some(&plain)
        );
        assert_eq!(bulk.switch_for(PerfTarget::Connect { vip: true }), None);
        assert_eq!(bulk.switch_for(PerfTarget::Bulk { vip: false }), None);
        assert_eq!(plain.args(), ["--perf-ctl", c]);
        let changes = PerfControl::parse(Some(c), None, Some("changes"))
            .unwrap()
            .unwrap();
        assert_eq!(changes.switch_for(PerfTarget::Changes), Some(&plain));
        assert_eq!(changes.switch_for(PerfTarget::FullSync), None);
        let both = format!("{c},{}", ack.display());
        let direct = PerfControl::parse(Some(&both), Some("cpu-clock"), Some("direct"))
            .unwrap()
            .unwrap();
        assert_eq!(direct.switch_for(PerfTarget::Connect { vip: true }), None);
        let full = direct
            .switch_for(PerfTarget::Connect { vip: false })
            .unwrap();
        assert_eq!(full.ack.as_deref(), Some(ack.as_path()));
        assert_eq!(full.event.as_deref(), Some("cpu-clock"));
        assert_eq!(
            full.args(),
            ["--perf-ctl", both.as_str(), "--perf-event", "cpu-clock"]
        );
        let regular = dir.path().join("regular");
        std::fs::write(&regular, "").unwrap();
        let with_regular_ack = format!("{c},{}", regular.display());
        for (ctl, target, says) in [
            (Some(c), None, "KP_PERF_TARGET is not"),
            (
                None,
                Some("vip"),
                "KP_PERF_CTL (perf's control fifo) is not",
            ),
            (
                Some(c),
                Some("pod"),
                "expected vip, direct, vip-bulk, direct-bulk, full-sync or changes",
            ),
            (Some("/nonexistent/ctl"), Some("vip"), "/nonexistent/ctl"),
            (regular.to_str(), Some("vip"), "is not a fifo"),
            (
                Some(with_regular_ack.as_str()),
                Some("vip"),
                "is not a fifo",
            ),
        ] {
            let e = PerfControl::parse(ctl, None, target)
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{ctl:?} {target:?}: {e}");
        }
    }
}
