//! The data path: new TCP connections per second, connect latency and bulk throughput from one
//! lab pod to another, through the ClusterIP and straight to the pod IP.
//!
//! The server and the client are this binary's hidden `datapath-server` and `datapath-client`
//! subcommands, started inside the pods' namespaces with `ip netns exec`. Every connection-rate
//! socket closes with linger 0 (an RST), so a run leaves no TIME_WAIT behind and never runs out
//! of ports; conntrack on the node sees each connection open and close.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
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

/// Serves until killed: `connect` accepts every connection (and drops it, with a reset, a few
/// thousand connections later), `bulk` reads each connection to its end, then closes it
/// normally.
pub fn serve(connect: SocketAddr, bulk: SocketAddr) -> anyhow::Result<()> {
    let c = listener(connect)?;
    let b = listener(bulk)?;
    eprintln!("{READY} on {connect} and {bulk}");
    std::thread::spawn(move || {
        for s in b.incoming().flatten() {
            std::thread::spawn(move || {
                let mut s = s;
                let mut buf = vec![0u8; CHUNK];
                while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
                // A normal close: the client waits for this FIN to know everything arrived.
            });
        }
    });
    // Accepted connections are kept a while before they are dropped: a server that reset each
    // one at once would often do it before the client's connect() returned, and the client
    // would see ECONNRESET for a connection that was in fact established. By the time one is
    // dropped here its client has long reset it.
    let mut held = std::collections::VecDeque::with_capacity(HELD);
    for s in c.incoming() {
        match s {
            Ok(s) => {
                let _ = SockRef::from(&s).set_linger(Some(Duration::ZERO));
                if held.len() == HELD {
                    held.pop_front();
                }
                held.push_back(s);
            }
            // A connection reset before it was accepted.
            Err(_) => continue,
        }
    }
    Ok(())
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

/// Opens and resets connections to `target` from `threads` threads for `seconds` (after a short
/// warm-up); records each connect's latency (SYN to established).
pub fn connect_run(target: SocketAddr, seconds: f64, threads: usize) -> ConnectSamples {
    let warm_until = Instant::now() + WARMUP;
    let start = warm_until;
    let end = start + Duration::from_secs_f64(seconds);
    let workers: Vec<_> = (0..threads.max(1))
        .map(|_| {
            std::thread::spawn(move || {
                let mut lat = Vec::new();
                let mut errors = std::collections::BTreeMap::<String, usize>::new();
                loop {
                    let t = Instant::now();
                    if t >= end {
                        break;
                    }
                    let r = TcpStream::connect_timeout(&target, CONNECT_TIMEOUT);
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
        .collect();
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
    out
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
}

fn client(ns: &kp_test::Netns, bench: &Path, args: &[String]) -> anyhow::Result<String> {
    let exe = bench.to_string_lossy().into_owned();
    let mut all: Vec<&str> = vec![&exe, "datapath-client"];
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
    target: SocketAddr,
    seconds: f64,
    threads: usize,
) -> anyhow::Result<ConnectSamples> {
    let out = client(
        ns,
        bench,
        &[
            "connect".into(),
            "--target".into(),
            target.to_string(),
            "--seconds".into(),
            seconds.to_string(),
            "--threads".into(),
            threads.to_string(),
        ],
    )?;
    Ok(serde_json::from_str(&out)?)
}

fn bulk_in(
    ns: &kp_test::Netns,
    bench: &Path,
    target: SocketAddr,
    bytes: u64,
) -> anyhow::Result<f64> {
    let out = client(
        ns,
        bench,
        &[
            "bulk".into(),
            "--target".into(),
            target.to_string(),
            "--bytes".into(),
            bytes.to_string(),
        ],
    )?;
    Ok(out.trim().parse()?)
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
            plan.direct_connect,
            half,
            plan.threads,
        )?);
    }
    Ok(summarise(&runs))
}

/// Runs the measurements from `client_ns` (the server must already listen) through `node`:
/// connection rate and latency to both targets in two rounds (direct first, then the ClusterIP
/// first), each run after emptying the node's conntrack table and a second's quiet, then
/// alternating bulk transfers.
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
            if vip_turn {
                vip.push(connect_in(
                    client_ns,
                    bench,
                    plan.vip_connect,
                    half,
                    plan.threads,
                )?);
            } else {
                direct.push(connect_in(
                    client_ns,
                    bench,
                    plan.direct_connect,
                    half,
                    plan.threads,
                )?);
            }
        }
    }
    let (mut bv, mut bd) = (Vec::new(), Vec::new());
    for _ in 0..plan.bulk_repeats.max(1) {
        bd.push(bulk_in(
            client_ns,
            bench,
            plan.direct_bulk,
            plan.bulk_bytes,
        )?);
        bv.push(bulk_in(client_ns, bench, plan.vip_bulk, plan.bulk_bytes)?);
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
    })
}
