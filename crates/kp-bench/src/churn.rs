//! `bench churn`: a churn soak of the real `kube-proxy` binary through its API source.
//!
//! The fake API server (`kp_test::apiserver`) listens on loopback in a fresh network namespace,
//! holding N Services × E endpoints of the benchmark cluster; the binary runs in the same
//! namespace with `--master` pointing at it (started as every binary run of the bench starts it,
//! `proxy::spawn_binary`). After its first full sync, the harness replaces one endpoint
//! of one Service R times a second for D seconds (EndpointSlice updates spread over the
//! Services, [`ChangeStream`]), paced against the clock, and meanwhile:
//!
//! - samples the proxy's `VmRSS` and `VmHWM` every second;
//! - times some of the changes (about `--probes-per-second` of them) from the API server storing
//!   the slice to the new endpoint being read back from the kernel, with the mode's latency probe,
//!   in a thread of its own so the pacing never waits for it.
//!
//! Then it stops changing and waits for quiescence: the last change live in the kernel (watch
//! events arrive in order, so every earlier change has reached the proxy), and the proxy's
//! metrics saying nothing is pending (`kubeproxy_sync_proxy_rules_endpoint_changes_pending` 0,
//! last sync after the last queued change and after the last change). Finally it proves
//! kernel == plan: the mode's own dataplane, with its writes sent to a sink
//! ([`ModeUnderTest::checker`]), plans the final objects in a `ProxyState` of its own, the way
//! the binary planned them (the generated cluster, then the changes replayed: where an endpoint
//! sits is history, see `check_kernel`), and its read-back check (`Dataplane::verify`)
//! compares the kernel the binary programmed with that plan. The API server is checked to hold
//! those same final objects.
//!
//! Output: progress on standard error every [`PROGRESS_EVERY`], `bench/results/churn-<start>.json`
//! and `churn-latest.json`, a plot of memory and latency over time, and one result line
//! ([`ChurnResults::line`]) for scripts. Timing never fails a run: only a dead proxy, a kernel
//! that differs from the plan, or a harness failure does.

use std::collections::{BTreeMap, HashSet};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use kp_core::track::{Kind, SourceEvent};
use kp_test::apiserver::FakeApiServer;
use kp_test::netns::{ChildGuard, Netns};
use serde::{Deserialize, Serialize};

use crate::cluster::{self, ChangeStream, Cluster};
use crate::mode::{wait_live, ModeUnderTest, Probe, ProbeTarget};
use crate::progress::Progress;
use crate::proxy;
use crate::results::Machine;
use crate::stats::Summary;

/// Bumped when a field of [`ChurnResults`] changes meaning.
pub const FORMAT: u32 = 1;

/// How often the soak prints a progress line.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// How often the proxy's memory is sampled.
const SAMPLE_EVERY: Duration = Duration::from_secs(1);

/// The fraction of the run, from its start, left out of the memory slope: the proxy's maps and
/// allocator pools grow to the churn's working set first, which is not a leak.
const WARM_UP: f64 = 0.2;

/// A timed change not live after this long is given up on (counted as unseen). A later change
/// to the same endpoint slot replaces it after N changes (10 s at 10k Services and 1000/s).
const PROBE_TIMEOUT: Duration = Duration::from_secs(30);

/// The rate counts as held when at least this fraction of it was achieved.
const HELD: f64 = 0.99;

/// What the fake API server's history costs this process per endpoint of each changed slice,
/// bytes: it keeps the old and the new object of every change, as `serde_json::Value`s (measured:
/// 2.8 GB for 60,000 changes of 10-endpoint slices).
pub const HISTORY_BYTES_PER_ENDPOINT: f64 = 4200.0;

/// The keys of the result line, in order.
pub const LINE_KEYS: [&str; 12] = [
    "mode",
    "services",
    "seconds",
    "target_rate",
    "achieved_rate",
    "changes",
    "latency_p50_ms",
    "latency_p99_ms",
    "vmhwm_start_mib",
    "vmhwm_end_mib",
    "rss_slope_mib_per_min",
    "kernel_equals_plan",
];

/// What a churn soak runs.
#[derive(Clone, Debug)]
pub struct ChurnOptions {
    /// The mode (`nftables`, `iptables-nft`, `iptables-legacy`).
    pub mode: String,
    /// Services N.
    pub services: usize,
    /// Endpoints per Service E.
    pub endpoints: usize,
    /// Endpoint changes per second R.
    pub rate: u32,
    /// Seconds of churn D.
    pub seconds: u64,
    /// Changes timed per second [default: [`default_probes_per_second`] of the mode].
    pub probes_per_second: Option<f64>,
    /// The binary under test.
    pub proxy_binary: PathBuf,
    /// The repository root: `bench/results/` is written there.
    pub root: PathBuf,
    /// The plot [default: ROOT/[`crate::plot::CHURN`]].
    pub plot: Option<PathBuf>,
    /// The command line to record.
    pub command: String,
}

/// How many changes a second the latency probe times by default: 10 for nftables (a netlink
/// read of a few elements costs tens of microseconds), 2 for the iptables modes (each read is an
/// `iptables -S` process, and iptables-legacy's takes the xtables lock the proxy's restores need).
pub fn default_probes_per_second(mode: &str) -> f64 {
    if mode == "nftables" {
        10.0
    } else {
        2.0
    }
}

/// A churn soak's results: everything the result line, the plot and the JSON file hold.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ChurnResults {
    /// [`FORMAT`].
    pub format: u32,
    /// When the run started (UTC, RFC 3339).
    pub started: String,
    /// How long the whole run took, seconds.
    pub duration_s: f64,
    /// The command that reproduces it.
    pub command: String,
    /// Where it ran.
    pub machine: Machine,
    /// What it was asked to do.
    pub settings: ChurnSettings,
    /// Seconds spent storing the cluster in the fake API server.
    pub load_s: f64,
    /// From starting the binary to its first full sync of the whole cluster.
    pub startup_s: f64,
    /// How the changes were paced.
    pub pace: Pace,
    /// Programming latency of the timed changes, milliseconds: first seen in the kernel
    /// ([`LatencySample::ms`]).
    pub latency_ms: Summary,
    /// The lower bounds of the same latencies ([`LatencySample::absent_ms`]). Far below
    /// `latency_ms` means the probe, sharing the CPUs with the proxy, looked late.
    pub latency_absent_ms: Summary,
    /// Every timed change.
    pub latency_samples: Vec<LatencySample>,
    /// Timed changes never seen live (given up after 30 s, or replaced before the probe saw
    /// them).
    pub latency_unseen: usize,
    /// The first error of the latency probe, if it failed.
    pub probe_error: Option<String>,
    /// The proxy's memory and CPU.
    pub memory: Memory,
    /// Quiescence after the churn, if reached.
    pub quiescence: Option<Quiescence>,
    /// The final kernel check, if it ran.
    pub kernel: Option<KernelCheck>,
    /// What the proxy's own metrics say about the churn.
    pub proxy_metrics: Option<ProxyMetrics>,
    /// How the proxy ended, if it exited before the harness stopped it.
    pub proxy_exit: Option<String>,
    /// Lines the proxy logged at WARN or ERROR during the run (the first few), and how many.
    pub proxy_log_problems: LogProblems,
    /// What failed, if anything did.
    pub errors: Vec<String>,
    /// The result line ([`ChurnResults::line`]).
    pub line: String,
}

/// The run's settings.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ChurnSettings {
    /// The mode.
    pub mode: String,
    /// Services.
    pub services: usize,
    /// Endpoints per Service.
    pub endpoints: usize,
    /// Changes per second asked for.
    pub target_rate: u32,
    /// Seconds of churn asked for.
    pub seconds: u64,
    /// Changes timed per second.
    pub probes_per_second: f64,
    /// The binary under test.
    pub proxy_binary: String,
}

/// The pacing of the changes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Pace {
    /// Changes stored in the API server within the run's D seconds.
    pub changes: usize,
    /// `changes / D`.
    pub achieved_rate: f64,
    /// Whether at least 99% of the target rate was achieved.
    pub held: bool,
    /// Changes stored in each second of the run.
    pub per_second: Vec<u32>,
    /// The fewest changes stored in one second.
    pub slowest_second: u32,
    /// The furthest the harness fell behind its schedule, milliseconds (it catches up by
    /// sending at once).
    pub max_lag_ms: f64,
    /// Mean seconds the harness spent storing one change in the API server, microseconds.
    pub mean_upsert_us: f64,
    /// resourceVersions the API server gave out during the churn: one per change when nothing
    /// was lost between the harness and the server.
    pub api_resource_versions: u64,
}

/// One timed change.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LatencySample {
    /// When the change was stored, seconds after the churn started.
    pub at_s: f64,
    /// From storing it to the probe first seeing it in the kernel, milliseconds: the
    /// programming latency, an upper bound (the probe's own delays are in it).
    pub ms: f64,
    /// From storing it to the last probe request the kernel answered without it, milliseconds
    /// (0 if the first request found it): a lower bound. The kernel took the change somewhere
    /// between this and [`LatencySample::ms`].
    pub absent_ms: f64,
}

/// One sample of the proxy's memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct MemSample {
    /// Seconds after the churn started.
    pub t_s: f64,
    /// `VmRSS`, MiB.
    pub rss_mib: f64,
    /// `VmHWM`, MiB.
    pub hwm_mib: f64,
}

/// The proxy's memory and CPU over the run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Memory {
    /// Every second, from the start of the churn to the end of the kernel check.
    pub samples: Vec<MemSample>,
    /// `VmHWM` when the churn started (after the first full sync), MiB.
    pub vmhwm_start_mib: f64,
    /// `VmHWM` at quiescence (or when the churn ended, if never quiescent), MiB.
    pub vmhwm_end_mib: f64,
    /// `VmRSS` when the churn started, MiB.
    pub rss_start_mib: f64,
    /// `VmRSS` at quiescence, MiB.
    pub rss_end_mib: f64,
    /// Least-squares slope of `VmRSS` over the last 80% of the churn, MiB per minute.
    pub rss_slope_mib_per_min: f64,
    /// The proxy's CPU time during the churn over its wall time, percent of one core.
    pub proxy_cpu_percent: f64,
    /// This harness's own `VmHWM` with the fake API server still up, MiB: the server keeps
    /// every change it was sent (old and new object) for watches to replay, so this grows with
    /// the changes ([`HISTORY_BYTES_PER_ENDPOINT`]).
    pub bench_vmhwm_mib: f64,
}

/// Quiescence after the churn.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Quiescence {
    /// From the last change to its endpoint being live in the kernel, seconds.
    pub last_change_live_s: f64,
    /// From the last change to the metrics saying nothing is pending, seconds.
    pub after_s: f64,
    /// `kubeproxy_sync_proxy_rules_endpoint_changes_pending` then.
    pub endpoint_changes_pending: f64,
    /// `kubeproxy_sync_proxy_rules_last_timestamp_seconds` minus the wall-clock time of the
    /// last change, seconds.
    pub last_sync_after_last_change_s: f64,
}

/// The proxy's metrics over the churn: the difference between a scrape just before it and one
/// at quiescence.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ProxyMetrics {
    /// Syncs (`kubeproxy_sync_proxy_rules_duration_seconds_count`).
    pub syncs: f64,
    /// Endpoint changes the proxy counted (`kubeproxy_sync_proxy_rules_endpoint_changes_total`).
    pub endpoint_changes: f64,
    /// Mean sync duration, milliseconds.
    pub sync_mean_ms: f64,
    /// Mean duration of the conntrack reconciliation after each sync, milliseconds
    /// (`kubeproxy_conntrack_reconciler_sync_duration_seconds`).
    pub conntrack_reconcile_mean_ms: f64,
}

impl ProxyMetrics {
    /// The change between two scrapes of the metrics text.
    pub fn between(before: &str, after: &str) -> ProxyMetrics {
        let delta =
            |name: &str| metric(after, name).unwrap_or(0.0) - metric(before, name).unwrap_or(0.0);
        let mean_ms = |base: &str| {
            let n = delta(&format!("{base}_count"));
            if n > 0.0 {
                delta(&format!("{base}_sum")) / n * 1000.0
            } else {
                0.0
            }
        };
        ProxyMetrics {
            syncs: delta("kubeproxy_sync_proxy_rules_duration_seconds_count"),
            endpoint_changes: delta("kubeproxy_sync_proxy_rules_endpoint_changes_total"),
            sync_mean_ms: mean_ms("kubeproxy_sync_proxy_rules_duration_seconds"),
            conntrack_reconcile_mean_ms: mean_ms(
                "kubeproxy_conntrack_reconciler_sync_duration_seconds",
            ),
        }
    }
}

/// The final comparison of the kernel with the plan of the final objects.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct KernelCheck {
    /// Whether the kernel holds exactly the plan.
    pub equal: bool,
    /// How many differences the mode's read-back check found.
    pub differences: usize,
    /// The first of them.
    pub sample: Vec<String>,
    /// Seconds the check took (planning and reading back).
    pub seconds: f64,
    /// Service ports in the planned state.
    pub service_ports: usize,
    /// Syncs of the replay that made the plan (see `check_kernel`).
    pub replay_syncs: usize,
}

/// WARN and ERROR lines of the proxy's log.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LogProblems {
    /// How many.
    pub count: usize,
    /// The first few.
    pub first: Vec<String>,
}

impl ChurnResults {
    /// The one line scripts parse: `churn: KEY=VALUE …` with [`LINE_KEYS`] in order.
    pub fn line(&self) -> String {
        let s = &self.settings;
        format!(
            "churn: mode={} services={} seconds={} target_rate={} achieved_rate={:.1} changes={} latency_p50_ms={:.2} latency_p99_ms={:.2} vmhwm_start_mib={:.1} vmhwm_end_mib={:.1} rss_slope_mib_per_min={:.3} kernel_equals_plan={}",
            s.mode,
            s.services,
            s.seconds,
            s.target_rate,
            self.pace.achieved_rate,
            self.pace.changes,
            self.latency_ms.p50,
            self.latency_ms.p99,
            self.memory.vmhwm_start_mib,
            self.memory.vmhwm_end_mib,
            self.memory.rss_slope_mib_per_min,
            self.kernel_equals_plan()
        )
    }

    /// Whether the final check found the kernel equal to the plan.
    pub fn kernel_equals_plan(&self) -> bool {
        self.kernel.as_ref().is_some_and(|k| k.equal)
    }

    /// Why the run failed, if it did: the proxy died, the kernel differs from the plan, or a
    /// step of the harness failed. Timing never fails a run.
    pub fn failure(&self) -> Option<String> {
        let mut why = Vec::new();
        if let Some(e) = &self.proxy_exit {
            why.push(format!("kube-proxy exited during the run ({e})"));
        }
        match &self.kernel {
            Some(k) if !k.equal => why.push(format!(
                "the kernel differs from the plan at quiescence ({} differences)",
                k.differences
            )),
            Some(_) => {}
            None => why.push("the kernel was not compared with the plan".into()),
        }
        why.extend(self.errors.iter().cloned());
        (!why.is_empty()).then(|| why.join("; "))
    }
}

/// Parses a result line into its values by key; fails unless it starts with `churn: ` and holds
/// exactly [`LINE_KEYS`], in order, each once.
pub fn parse_line(line: &str) -> anyhow::Result<BTreeMap<String, String>> {
    let rest = line
        .trim_end()
        .strip_prefix("churn: ")
        .ok_or_else(|| anyhow::anyhow!("not a churn result line: {line:?}"))?;
    let mut out = BTreeMap::new();
    let mut keys = Vec::new();
    for field in rest.split(' ') {
        let (k, v) = field
            .split_once('=')
            .ok_or_else(|| anyhow::anyhow!("field {field:?} is not KEY=VALUE"))?;
        keys.push(k.to_string());
        out.insert(k.to_string(), v.to_string());
    }
    if keys != LINE_KEYS {
        anyhow::bail!("keys {keys:?}, expected {LINE_KEYS:?}");
    }
    Ok(out)
}

/// The least-squares slope of `points` (minutes, MiB) in MiB per minute; 0 for fewer than two
/// distinct times.
pub fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if points.len() < 2 {
        return 0.0;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    if sxx <= 0.0 {
        0.0
    } else {
        sxy / sxx
    }
}

/// The `VmRSS` slope of `samples` over the last 80% of a churn of `seconds`, MiB per minute.
pub fn rss_slope(samples: &[MemSample], seconds: f64) -> f64 {
    let points: Vec<(f64, f64)> = samples
        .iter()
        .filter(|s| s.t_s >= seconds * WARM_UP && s.t_s <= seconds)
        .map(|s| (s.t_s / 60.0, s.rss_mib))
        .collect();
    slope(&points)
}

/// The value of the unlabelled metric `name` in a Prometheus text exposition.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?;
        if !rest.starts_with(' ') {
            return None;
        }
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// `GET /metrics` from the proxy in network namespace `netns`, on loopback there. The socket is
/// made by a short-lived thread that enters the namespace; the caller's threads stay put.
pub fn scrape(netns: &str) -> anyhow::Result<String> {
    let addr: SocketAddr = proxy::METRICS_ADDR.parse()?;
    kp_netlink::netns::run_in(
        netns,
        "kp-bench-scrape",
        move || -> anyhow::Result<String> {
            let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            // HTTP/1.0: the server answers with the whole body and closes, so reading to the end
            // is the whole response (no chunked encoding to undo).
            s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
            let mut text = String::new();
            s.read_to_string(&mut text)?;
            if !text.starts_with("HTTP/1.") || text.split(' ').nth(1) != Some("200") {
                anyhow::bail!(
                    "GET /metrics answered {:?}",
                    text.lines().next().unwrap_or_default()
                );
            }
            Ok(text)
        },
    )?
}

/// Where the checker's writes go: a program that reads its input and exits 0 (`nft -f -`,
/// `iptables-restore …`), except for nft's listings (`-j …`), read-only, which it hands to the
/// real nft (the nftables dataplane lists the affinity maps to purge them). Removed on drop.
struct Sink(PathBuf);

/// The sink program.
const SINK: &str = "#!/bin/sh\ncase \"$1\" in -j) exec nft \"$@\" ;; esac\nexec cat >/dev/null\n";

impl Sink {
    fn new() -> anyhow::Result<Sink> {
        let path = std::env::temp_dir().join(format!("kp-bench-{}-sink", std::process::id()));
        kp_test::write_executable(&path, SINK)?;
        Ok(Sink(path))
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The proxy's CPU time so far (user + system), seconds. `/proc/PID/stat` counts in USER_HZ,
/// which is 100 on every Linux ABI.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The name in parentheses may hold spaces: count fields after its closing parenthesis,
    // where the state is field 3 and utime and stime are fields 14 and 15.
    let after = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

/// Samples the proxy's memory every second in a thread of its own.
struct Sampler {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<MemSample>>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    /// Starts sampling `pid`, with times relative to `start`.
    fn start(pid: u32, start: Instant) -> anyhow::Result<Sampler> {
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let (s, out) = (stop.clone(), samples.clone());
        let handle = std::thread::Builder::new()
            .name("kp-bench-memory".into())
            .spawn(move || {
                let mut k = 0u32;
                while !s.load(Ordering::Relaxed) {
                    // On the second ticks, not a second after each read: the series stays on
                    // whole seconds however long a read takes.
                    let due = start + SAMPLE_EVERY * k;
                    let now = Instant::now();
                    if due > now {
                        std::thread::sleep((due - now).min(Duration::from_millis(100)));
                        continue;
                    }
                    k += 1;
                    // A read fails once the process is gone; the main thread notices that.
                    if let Ok((hwm, rss)) = proxy::memory_mib(pid) {
                        out.lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .push(MemSample {
                                t_s: now.duration_since(start).as_secs_f64(),
                                rss_mib: rss,
                                hwm_mib: hwm,
                            });
                    }
                }
            })?;
        Ok(Sampler {
            stop,
            samples,
            handle: Some(handle),
        })
    }

    /// The latest sample.
    fn latest(&self) -> Option<MemSample> {
        self.samples
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .last()
            .copied()
    }

    /// Stops sampling; returns every sample.
    fn finish(mut self) -> Vec<MemSample> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        std::mem::take(&mut *self.samples.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A change to time: stored at `t0`, `at_s` after the churn started; the kernel answered a
/// request made `absent` after `t0` without it.
struct Timed {
    target: ProbeTarget,
    t0: Instant,
    at_s: f64,
    absent: Option<Duration>,
}

/// What the latency thread measured.
#[derive(Default)]
struct Timings {
    samples: Vec<LatencySample>,
    unseen: usize,
    error: Option<String>,
}

/// Times the changes it is sent until `finish` is set and the channel is closed: polls the
/// kernel for every change not yet seen, every `probe.interval()`. Latencies go to `shared` as
/// they are measured (for progress lines); the whole result is returned.
fn time_changes(
    mut probe: Box<dyn Probe>,
    rx: mpsc::Receiver<Timed>,
    shared: Arc<Mutex<Vec<LatencySample>>>,
    finish: Arc<AtomicBool>,
) -> Timings {
    let mut out = Timings::default();
    let mut pending: Vec<Timed> = Vec::new();
    let mut closed = false;
    let interval = probe.interval();
    loop {
        loop {
            match rx.try_recv() {
                Ok(t) => pending.push(t),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    closed = true;
                    break;
                }
            }
        }
        // Set at quiescence: whatever will ever be live is live, so this pass is the last.
        let last_pass = closed && finish.load(Ordering::Relaxed);
        if pending.is_empty() {
            if closed {
                break;
            }
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(t) => pending.push(t),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => closed = true,
            }
            continue;
        }
        let mut i = 0;
        while i < pending.len() {
            let asked = pending[i].t0.elapsed();
            let live = match probe.is_live(&pending[i].target) {
                Ok(l) => l,
                Err(e) => {
                    out.error.get_or_insert_with(|| format!("{e:#}"));
                    false
                }
            };
            if live {
                let t = pending.swap_remove(i);
                let s = LatencySample {
                    at_s: t.at_s,
                    ms: t.t0.elapsed().as_secs_f64() * 1000.0,
                    absent_ms: t.absent.map_or(0.0, |d| d.as_secs_f64() * 1000.0),
                };
                out.samples.push(s);
                shared
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(s);
            } else if last_pass || pending[i].t0.elapsed() > PROBE_TIMEOUT {
                pending.swap_remove(i);
                out.unseen += 1;
            } else {
                pending[i].absent = Some(asked);
                i += 1;
            }
        }
        if last_pass {
            break;
        }
        std::thread::sleep(interval);
    }
    out.samples.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
    out
}

/// Runs the soak. Returns the results, also when the proxy died or the kernel differs from the
/// plan ([`ChurnResults::failure`] says so); fails when the run could not get going (no root,
/// no binary, the first sync never came) or a result could not be written.
///
/// It sets this process's `oom_score_adj` to 1000 (see [`HISTORY_BYTES_PER_ENDPOINT`]): run it
/// in a process of its own (`bench churn`).
pub fn run(opts: &ChurnOptions) -> anyhow::Result<ChurnResults> {
    let p = Progress::new();
    if !kp_test::netns::require_root() {
        anyhow::bail!("the churn soak creates network namespaces: run it as root");
    }
    let mode = crate::modes::by_names(std::slice::from_ref(&opts.mode))?
        .into_iter()
        .next()
        .ok_or_else(|| anyhow::anyhow!("no mode given"))?;
    if let Some(why) = mode.unavailable() {
        anyhow::bail!("mode {}: {why}", mode.name());
    }
    if !opts.proxy_binary.is_file() {
        anyhow::bail!(
            "no kube-proxy binary at {} (build it: cargo build --release -p kube-proxy; or pass --proxy-binary)",
            opts.proxy_binary.display()
        );
    }
    if opts.services == 0 || opts.endpoints == 0 || opts.rate == 0 || opts.seconds == 0 {
        anyhow::bail!("--services, --endpoints, --rate and --seconds must be above 0");
    }
    let probes_per_second = opts
        .probes_per_second
        .unwrap_or_else(|| default_probes_per_second(mode.name()));
    let mut r = ChurnResults {
        format: FORMAT,
        started: crate::machine::utc_now(),
        command: opts.command.clone(),
        machine: crate::machine::describe(),
        settings: ChurnSettings {
            mode: mode.name().into(),
            services: opts.services,
            endpoints: opts.endpoints,
            target_rate: opts.rate,
            seconds: opts.seconds,
            probes_per_second,
            proxy_binary: opts.proxy_binary.display().to_string(),
        },
        ..ChurnResults::default()
    };
    p.say(format!(
        "churn soak: {} at {} Services × {}, {} endpoint changes/s for {} s through the API source, {} timed/s",
        mode.name(),
        opts.services,
        opts.endpoints,
        opts.rate,
        opts.seconds,
        probes_per_second
    ));
    let history_gib = f64::from(opts.rate)
        * opts.seconds as f64
        * opts.endpoints as f64
        * HISTORY_BYTES_PER_ENDPOINT
        / f64::from(1u32 << 30);
    let available_gib = available_memory_gib();
    p.say(format!(
        "  the fake API server keeps every change: about {history_gib:.1} GiB in this process by the end ({available_gib:.1} GiB available now){}",
        if history_gib > 0.8 * available_gib {
            "; THIS MAY NOT FIT: shorten --seconds or lower --rate"
        } else {
            ""
        }
    ));
    // On a shared machine, a soak that outgrows the memory must be what the OOM killer takes,
    // not someone else's work. Raising one's own score needs no privilege.
    if let Err(e) = std::fs::write("/proc/self/oom_score_adj", "1000") {
        p.say(format!("  cannot raise this process's oom_score_adj: {e}"));
    }
    let cluster = Cluster::new(opts.services, opts.endpoints);
    let ns = Netns::new("bench-churn")?;
    let server = FakeApiServer::start_in(&ns)?;
    let t = Instant::now();
    for m in cluster.manifests() {
        let kind = match m["kind"].as_str() {
            Some("Service") => Kind::Service,
            Some("EndpointSlice") => Kind::EndpointSlice,
            _ => Kind::Node,
        };
        server.upsert(kind, m)?;
    }
    r.load_s = t.elapsed().as_secs_f64();
    p.say(format!(
        "  stored {} objects in the fake API server in {:.1} s",
        opts.services * 2 + 1,
        r.load_s
    ));
    for cmd in mode.proxy_setup() {
        let args: Vec<&str> = cmd.iter().map(String::as_str).collect();
        ns.run(&args)?;
    }
    let mut probe = mode.probe(ns.name())?;
    let spawned = Instant::now();
    let mut kube_proxy = proxy::spawn_binary(
        &ns,
        &opts.proxy_binary,
        mode.as_ref(),
        &["--master".into(), server.url().to_string()],
    )?;
    let live = proxy::wait_first_sync(&mut kube_proxy, probe.as_mut(), &cluster, spawned)?;
    r.startup_s = live.duration_since(spawned).as_secs_f64();
    p.say(format!(
        "  first full sync: the whole cluster live {:.2} s after start",
        r.startup_s
    ));

    let soak = Soak {
        opts,
        p: &p,
        mode: mode.as_ref(),
        cluster: &cluster,
        ns: &ns,
        server: &server,
        probes_per_second,
    };
    let outcome = soak.churn(&mut kube_proxy, probe, &mut r);
    if let Err(e) = outcome {
        r.errors.push(format!("{e:#}"));
    }
    if r.proxy_exit.is_none() {
        if let Ok(Some(status)) = kube_proxy.try_wait() {
            r.proxy_exit = Some(status.to_string());
        }
    }
    r.proxy_log_problems = log_problems(&kube_proxy.log());
    if r.proxy_exit.is_some() {
        r.errors.push(format!(
            "kube-proxy's log ends with:\n{}",
            proxy::tail(&kube_proxy.log(), 15)
        ));
    }
    let _ = kube_proxy.terminate(Duration::from_secs(5));
    r.memory.bench_vmhwm_mib = proxy::memory_mib(std::process::id()).map_or(0.0, |m| m.0);
    drop(server);
    drop(ns);
    r.duration_s = p.elapsed();
    r.line = r.line();
    let files = write(opts, &r)?;
    p.say(format!(
        "done in {:.0} s; wrote {}",
        r.duration_s,
        files
            .iter()
            .map(|f| f.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    ));
    Ok(r)
}

/// `MemAvailable` of the machine, GiB (0 if unreadable).
fn available_memory_gib() -> f64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0 / 1024.0)
}

/// The WARN and ERROR lines of a log.
fn log_problems(log: &str) -> LogProblems {
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
        .collect();
    LogProblems {
        count: lines.len(),
        first: lines.iter().take(10).map(|l| l.to_string()).collect(),
    }
}

/// The last change stored: what quiescence waits for.
struct LastChange {
    target: ProbeTarget,
    at: Instant,
    wall: SystemTime,
}

/// What the churn works with, once the proxy runs.
struct Soak<'a> {
    opts: &'a ChurnOptions,
    p: &'a Progress,
    mode: &'a dyn ModeUnderTest,
    cluster: &'a Cluster,
    ns: &'a Netns,
    server: &'a FakeApiServer,
    probes_per_second: f64,
}

/// What the pacing loop did.
struct Paced {
    changes: usize,
    per_second: Vec<u32>,
    max_lag: Duration,
    upserting: Duration,
    last: Option<LastChange>,
}

/// What the pacing loop reports to and reads from while it runs.
struct Watchers<'a> {
    sampler: &'a Sampler,
    timed: mpsc::Sender<Timed>,
    latencies: &'a Mutex<Vec<LatencySample>>,
}

impl Soak<'_> {
    /// The churn itself, quiescence and the kernel check, filling in `r`. An error is a failed
    /// step of the harness; a dead proxy is recorded in `r.proxy_exit` and ends the run early.
    fn churn(
        &self,
        kube_proxy: &mut ChildGuard,
        mut probe: Box<dyn Probe>,
        r: &mut ChurnResults,
    ) -> anyhow::Result<()> {
        let (opts, p) = (self.opts, self.p);
        let pid = kube_proxy.id();
        // The proxy's counters before the churn; a failed scrape only costs the metrics.
        let metrics_before = scrape(self.ns.name());
        let rv_start = self.server.resource_version();
        let start = Instant::now();
        let cpu_start = cpu_seconds(pid);
        let sampler = Sampler::start(pid, start)?;
        let latencies = Arc::new(Mutex::new(Vec::new()));
        let finish = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel::<Timed>();
        let timer = {
            let probe = self.mode.probe(self.ns.name())?;
            let (latencies, finish) = (latencies.clone(), finish.clone());
            std::thread::Builder::new()
                .name("kp-bench-latency".into())
                .spawn(move || time_changes(probe, rx, latencies, finish))?
        };
        let mut stream = ChangeStream::new(self.cluster);
        let watchers = Watchers {
            sampler: &sampler,
            timed: tx,
            latencies: &latencies,
        };
        // `watchers` holds the only sender: the timing thread ends once it is dropped here and
        // `finish` is set.
        let paced = self.pace(kube_proxy, &mut stream, watchers, start, r)?;
        let churned = start.elapsed();
        if let (Some(a), Some(b)) = (cpu_start, cpu_seconds(pid)) {
            r.memory.proxy_cpu_percent = (b - a) / churned.as_secs_f64() * 100.0;
        }
        let rate = f64::from(opts.rate);
        let pace = &mut r.pace;
        pace.changes = paced.changes;
        pace.achieved_rate = paced.changes as f64 / opts.seconds as f64;
        pace.held = pace.achieved_rate >= HELD * rate;
        pace.slowest_second = paced.per_second.iter().copied().min().unwrap_or(0);
        pace.per_second = paced.per_second;
        pace.max_lag_ms = paced.max_lag.as_secs_f64() * 1000.0;
        pace.mean_upsert_us = if paced.changes > 0 {
            paced.upserting.as_secs_f64() * 1e6 / paced.changes as f64
        } else {
            0.0
        };
        pace.api_resource_versions = self.server.resource_version() - rv_start;
        p.say(format!(
            "  churn over: {} changes in {} s, {:.1}/s ({} the target {}/s; slowest second {}, at most {:.0} ms behind schedule, {:.0} µs per store); kube-proxy used {:.0}% of a core",
            paced.changes,
            opts.seconds,
            pace.achieved_rate,
            if pace.held { "held" } else { "BELOW" },
            opts.rate,
            pace.slowest_second,
            pace.max_lag_ms,
            pace.mean_upsert_us,
            r.memory.proxy_cpu_percent
        ));
        if pace.api_resource_versions != paced.changes as u64 {
            r.errors.push(format!(
                "the API server stored {} changes, the harness sent {}",
                pace.api_resource_versions, paced.changes
            ));
        }

        let quiescent = match (&r.proxy_exit, &paced.last) {
            (Some(_), _) => false,
            (None, None) => true,
            (None, Some(last)) => match quiesce(self.cluster, self.ns, probe.as_mut(), last, r) {
                Ok(()) => true,
                Err(e) => {
                    r.errors.push(format!("no quiescence: {e:#}"));
                    false
                }
            },
        };
        if let (Ok(before), Ok(after)) = (&metrics_before, scrape(self.ns.name())) {
            let m = ProxyMetrics::between(before, &after);
            p.say(format!(
                "  kube-proxy's metrics: {:.0} syncs for {:.0} endpoint changes, {:.1} ms per sync on average, of which conntrack reconciliation {:.1} ms",
                m.syncs, m.endpoint_changes, m.sync_mean_ms, m.conntrack_reconcile_mean_ms
            ));
            r.proxy_metrics = Some(m);
        }
        // Memory at quiescence (or now, without it), before the check adds anything.
        if let Ok((hwm, rss)) = proxy::memory_mib(pid) {
            r.memory.vmhwm_end_mib = hwm;
            r.memory.rss_end_mib = rss;
        }
        finish.store(true, Ordering::Relaxed);
        let timings = timer
            .join()
            .map_err(|_| anyhow::anyhow!("the latency thread panicked"))?;
        let ms: Vec<f64> = timings.samples.iter().map(|s| s.ms).collect();
        r.latency_ms = Summary::of(&ms);
        let absent: Vec<f64> = timings.samples.iter().map(|s| s.absent_ms).collect();
        r.latency_absent_ms = Summary::of(&absent);
        r.latency_samples = timings.samples;
        r.latency_unseen = timings.unseen;
        r.probe_error = timings.error;
        p.say(format!(
            "  programming latency over {} timed changes: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms (last seen absent: p50 {:.1} ms, p99 {:.1} ms); {} never seen",
            r.latency_ms.n,
            r.latency_ms.p50,
            r.latency_ms.p99,
            r.latency_ms.max,
            r.latency_absent_ms.p50,
            r.latency_absent_ms.p99,
            r.latency_unseen
        ));

        if r.proxy_exit.is_none() {
            if !quiescent {
                p.say("  not quiescent: comparing the kernel with the plan anyway");
            }
            self.check(paced.changes, r);
            if let Some(status) = kube_proxy.try_wait()? {
                r.proxy_exit = Some(status.to_string());
            }
        }
        let m = &mut r.memory;
        m.samples = sampler.finish();
        let first = m.samples.first().copied().unwrap_or_default();
        m.vmhwm_start_mib = first.hwm_mib;
        m.rss_start_mib = first.rss_mib;
        if m.vmhwm_end_mib == 0.0 {
            let last = m.samples.last().copied().unwrap_or_default();
            m.vmhwm_end_mib = last.hwm_mib;
            m.rss_end_mib = last.rss_mib;
        }
        m.rss_slope_mib_per_min = rss_slope(&m.samples, opts.seconds as f64);
        p.say(format!(
            "  kube-proxy memory: VmHWM {:.1} → {:.1} MiB, VmRSS {:.1} → {:.1} MiB, VmRSS slope over the last 80% {:+.3} MiB/min",
            m.vmhwm_start_mib, m.vmhwm_end_mib, m.rss_start_mib, m.rss_end_mib, m.rss_slope_mib_per_min
        ));
        Ok(())
    }

    /// Sends R changes a second from `start` for D seconds, or until the proxy exits (recorded
    /// in `r.proxy_exit`). Sends every (R / probes per second)-th change to the timing thread
    /// and prints progress every [`PROGRESS_EVERY`].
    fn pace(
        &self,
        kube_proxy: &mut ChildGuard,
        stream: &mut ChangeStream<'_>,
        watchers: Watchers<'_>,
        start: Instant,
        r: &mut ChurnResults,
    ) -> anyhow::Result<Paced> {
        let (opts, p) = (self.opts, self.p);
        let rate = f64::from(opts.rate);
        let every = (rate / self.probes_per_second).round().max(1.0) as usize;
        let end = start + Duration::from_secs(opts.seconds);
        let mut out = Paced {
            changes: 0,
            per_second: vec![0u32; opts.seconds as usize],
            max_lag: Duration::ZERO,
            upserting: Duration::ZERO,
            last: None,
        };
        let mut next_report = start + PROGRESS_EVERY;
        let mut reported = 0usize;
        let mut next_alive_check = start;
        loop {
            // Change n is due n/R seconds after the start; a late one goes at once, so a short
            // stall (the harness's or the machine's) is caught up and only a lasting one lowers
            // the rate achieved.
            let due = start + Duration::from_secs_f64(out.changes as f64 / rate);
            let now = Instant::now();
            if due >= end || now >= end {
                break;
            }
            if due > now {
                std::thread::sleep(due - now);
            } else {
                out.max_lag = out.max_lag.max(now - due);
            }
            let change = stream.next_change();
            let target = proxy::target(self.cluster, change.service, change.new);
            let t0 = Instant::now();
            let wall = SystemTime::now();
            self.server.upsert(Kind::EndpointSlice, change.slice)?;
            let stored = Instant::now();
            out.upserting += stored - t0;
            out.changes += 1;
            let at_s = t0.duration_since(start).as_secs_f64();
            if let Some(c) = out.per_second.get_mut(at_s as usize) {
                *c += 1;
            }
            if out.changes.is_multiple_of(every) {
                // Fails only if the timing thread is gone; its result says why.
                let _ = watchers.timed.send(Timed {
                    target: target.clone(),
                    t0,
                    at_s,
                    absent: None,
                });
            }
            out.last = Some(LastChange {
                target,
                at: t0,
                wall,
            });
            if stored >= next_alive_check {
                next_alive_check = stored + Duration::from_millis(250);
                if let Some(status) = kube_proxy.try_wait()? {
                    r.proxy_exit = Some(status.to_string());
                    p.say(format!(
                        "  kube-proxy exited {at_s:.1} s into the churn ({status})"
                    ));
                    break;
                }
            }
            if stored >= next_report {
                let window = stored
                    .duration_since(next_report - PROGRESS_EVERY)
                    .as_secs_f64();
                let recent: Vec<f64> = watchers
                    .latencies
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .iter()
                    .filter(|s| s.at_s >= at_s - 2.0 * PROGRESS_EVERY.as_secs_f64())
                    .map(|s| s.ms)
                    .collect();
                let lat = Summary::of(&recent);
                let mem = watchers.sampler.latest().unwrap_or_default();
                p.say(format!(
                    "  {at_s:.0} s: {} changes ({:.0}/s lately; {}), kube-proxy VmRSS {:.1} MiB, VmHWM {:.1} MiB; latency p50 {:.1} ms, p99 {:.1} ms over the last {} timed",
                    out.changes,
                    (out.changes - reported) as f64 / window,
                    if out.max_lag > Duration::from_millis(100) {
                        format!("at most {:.0} ms behind schedule", out.max_lag.as_secs_f64() * 1000.0)
                    } else {
                        "on schedule".to_string()
                    },
                    mem.rss_mib,
                    mem.hwm_mib,
                    lat.p50,
                    lat.p99,
                    lat.n
                ));
                reported = out.changes;
                next_report += PROGRESS_EVERY;
            }
        }
        Ok(out)
    }

    /// The kernel check, recorded in `r.kernel` (or `r.errors` if it could not run).
    fn check(&self, changes: usize, r: &mut ChurnResults) {
        match check_kernel(self.mode, self.cluster, self.ns, self.server, changes) {
            Ok(k) => {
                self.p.say(format!(
                    "  kernel check ({:.1} s; {} Service ports planned in {} replayed syncs): {}",
                    k.seconds,
                    k.service_ports,
                    k.replay_syncs,
                    if k.equal {
                        "the kernel equals the plan".to_string()
                    } else {
                        format!("{} DIFFERENCES", k.differences)
                    }
                ));
                for d in &k.sample {
                    self.p.say(format!("    {d}"));
                }
                r.kernel = Some(k);
            }
            Err(e) => r.errors.push(format!("kernel check: {e:#}")),
        }
    }
}

/// Waits for the proxy to be quiescent after `last`: its endpoint live in the kernel, then the
/// metrics saying no endpoint change is pending and the last sync came after the last change
/// queued and after `last`. Records how long that took in `r.quiescence`.
fn quiesce(
    cluster: &Cluster,
    ns: &Netns,
    probe: &mut dyn Probe,
    last: &LastChange,
    r: &mut ChurnResults,
) -> anyhow::Result<()> {
    let timeout = Duration::from_secs(120 + cluster.services as u64 / 100);
    let interval = probe.interval();
    let live = wait_live(probe, &last.target, interval, timeout)?;
    let wall = last
        .wall
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let deadline = Instant::now() + timeout;
    let mut seen: String;
    loop {
        match scrape(ns.name()) {
            Ok(text) => {
                let pending = metric(&text, "kubeproxy_sync_proxy_rules_endpoint_changes_pending");
                let synced = metric(&text, "kubeproxy_sync_proxy_rules_last_timestamp_seconds");
                let queued = metric(
                    &text,
                    "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
                );
                seen = format!("pending {pending:?}, last sync {synced:?}, last queued {queued:?}, last change {wall:.3}");
                if let (Some(pending), Some(synced), Some(queued)) = (pending, synced, queued) {
                    if pending == 0.0 && synced >= queued && synced >= wall {
                        let now = Instant::now();
                        r.quiescence = Some(Quiescence {
                            last_change_live_s: live.duration_since(last.at).as_secs_f64(),
                            after_s: now.duration_since(last.at).as_secs_f64(),
                            endpoint_changes_pending: pending,
                            last_sync_after_last_change_s: synced - wall,
                        });
                        return Ok(());
                    }
                }
            }
            Err(e) => seen = format!("metrics unreadable: {e:#}"),
        }
        if Instant::now() >= deadline {
            anyhow::bail!("the proxy's metrics never said it was done ({seen})");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The endpoint addresses of a stored EndpointSlice, in order.
fn slice_addresses(slice: &serde_json::Value) -> Vec<Ipv4Addr> {
    slice["endpoints"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["addresses"][0].as_str()?.parse().ok())
        .collect()
}

/// Compares the kernel of `ns` with the plan of the final objects, using the mode's own
/// read-back check ([`ModeUnderTest::checker`]).
///
/// The plan is made as the binary made it, because where an endpoint sits is history: an
/// endpoint that stays keeps its slot (nftables) or its place in the chain (iptables), and a
/// newcomer takes a vacated one. So the checker first syncs the objects the binary first synced
/// (the generated cluster), then replays the `changes` the harness made, in rounds in which no
/// Service changes twice (each round one partial sync), as the binary saw each Service's
/// changes one at a time. Its final state is then the final objects: the check also proves the
/// API server holds, for every Service, the slice of the harness's last change to it.
fn check_kernel(
    mode: &dyn ModeUnderTest,
    cluster: &Cluster,
    ns: &Netns,
    server: &FakeApiServer,
    changes: usize,
) -> anyhow::Result<KernelCheck> {
    let t = Instant::now();
    let mut state = cluster::load_state(cluster.manifests())?;
    let sink = Sink::new()?;
    let mut checker = mode.checker(ns.name(), &sink.0);
    checker.sync(&state, &Default::default(), true)?;
    let mut stream = ChangeStream::new(cluster);
    let mut round: HashSet<usize> = HashSet::new();
    let mut syncs = 1;
    for _ in 0..changes {
        let change = stream.next_change();
        if !round.insert(change.service) {
            let round_changes = state.take_changes();
            checker.sync(&state, &round_changes, false)?;
            syncs += 1;
            round.clear();
            round.insert(change.service);
        }
        state
            .apply(SourceEvent::Upsert(cluster::to_object(&change.slice)?))
            .map_err(|e| anyhow::anyhow!("change {}: {e}", change.k))?;
    }
    if !round.is_empty() {
        let round_changes = state.take_changes();
        checker.sync(&state, &round_changes, false)?;
        syncs += 1;
    }
    for i in 0..cluster.services {
        let slice = server
            .get(
                Kind::EndpointSlice,
                cluster::NAMESPACE,
                &Cluster::slice_name(i),
            )
            .ok_or_else(|| anyhow::anyhow!("the API server lost Service {i}'s slice"))?;
        if slice_addresses(&slice) != stream.endpoints(i) {
            anyhow::bail!(
                "the API server's slice of Service {i} is not the harness's last change to it"
            );
        }
    }
    let diffs = checker.verify()?;
    Ok(KernelCheck {
        equal: diffs.is_empty(),
        differences: diffs.len(),
        sample: diffs.iter().take(10).cloned().collect(),
        seconds: t.elapsed().as_secs_f64(),
        service_ports: state.service_port_count(),
        replay_syncs: syncs,
    })
}

/// Writes `bench/results/churn-<start>.json`, `churn-latest.json` and the plot; returns their
/// paths. A plot that cannot be drawn (no font) is reported and skipped.
fn write(opts: &ChurnOptions, r: &ChurnResults) -> anyhow::Result<Vec<PathBuf>> {
    let dir = opts.root.join(crate::report::RESULTS_DIR);
    std::fs::create_dir_all(&dir)?;
    let json = serde_json::to_string_pretty(r)?;
    let file = dir.join(format!("churn-{}.json", r.started.replace(':', "-")));
    let latest = dir.join("churn-latest.json");
    std::fs::write(&file, &json)?;
    std::fs::write(&latest, &json)?;
    let mut out = vec![file, latest];
    let plot = opts
        .plot
        .clone()
        .unwrap_or_else(|| opts.root.join(crate::plot::CHURN));
    match crate::plot::churn(r, &plot) {
        Ok(()) => out.push(plot),
        Err(e) => eprintln!("kp-bench: {} not drawn: {e}", plot.display()),
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_result_line_parses_back_with_every_key_in_order() {
        let mut r = ChurnResults::default();
        r.settings.mode = "nftables".into();
        r.settings.services = 10_000;
        r.settings.seconds = 300;
        r.settings.target_rate = 1000;
        r.pace.achieved_rate = 998.66;
        r.pace.changes = 299_610;
        r.latency_ms.p99 = 12.345;
        r.memory.rss_slope_mib_per_min = -0.01;
        r.kernel = Some(KernelCheck {
            equal: true,
            ..KernelCheck::default()
        });
        let line = r.line();
        assert!(line.starts_with("churn: mode=nftables services=10000 seconds=300 target_rate=1000 achieved_rate=998.7 changes=299610 "), "{line}");
        let v = parse_line(&line).unwrap();
        assert_eq!(v["kernel_equals_plan"], "true");
        assert_eq!(v["latency_p99_ms"], "12.35");
        assert_eq!(v["rss_slope_mib_per_min"], "-0.010");
        assert!(parse_line("churn: mode=nftables").is_err());
        assert!(parse_line(&line.replace("churn: ", "")).is_err());
    }

    #[test]
    fn the_slope_is_mib_per_minute_over_the_last_eighty_percent() {
        // Flat at 50 MiB after a 10 s warm-up climb from 10 MiB, over a 50 s run.
        let samples: Vec<MemSample> = (0..=60)
            .map(|t| MemSample {
                t_s: f64::from(t),
                rss_mib: if t < 10 {
                    10.0 + 4.0 * f64::from(t)
                } else {
                    50.0
                },
                hwm_mib: 50.0,
            })
            .collect();
        assert_eq!(rss_slope(&samples, 50.0), 0.0);
        // 1 MiB per 10 s is 6 MiB per minute.
        let growing: Vec<MemSample> = (0..=50)
            .map(|t| MemSample {
                t_s: f64::from(t),
                rss_mib: 20.0 + f64::from(t) / 10.0,
                hwm_mib: 0.0,
            })
            .collect();
        assert!((rss_slope(&growing, 50.0) - 6.0).abs() < 1e-9);
        assert_eq!(slope(&[(1.0, 5.0)]), 0.0);
    }

    #[test]
    fn metrics_are_read_by_exact_name() {
        let text = "# HELP x\nkubeproxy_sync_proxy_rules_endpoint_changes_pending 3\nkubeproxy_sync_proxy_rules_endpoint_changes_pending_total 9\nkubeproxy_sync_proxy_rules_last_timestamp_seconds 1795250288.25\n";
        assert_eq!(
            metric(text, "kubeproxy_sync_proxy_rules_endpoint_changes_pending"),
            Some(3.0)
        );
        assert_eq!(
            metric(text, "kubeproxy_sync_proxy_rules_last_timestamp_seconds"),
            Some(1_795_250_288.25)
        );
        assert_eq!(metric(text, "kubeproxy_missing"), None);
    }

    #[test]
    fn proxy_metrics_are_the_change_over_the_churn() {
        let before = "kubeproxy_sync_proxy_rules_duration_seconds_sum 1.0\nkubeproxy_sync_proxy_rules_duration_seconds_count 10\nkubeproxy_sync_proxy_rules_endpoint_changes_total 100\n";
        let after = "kubeproxy_sync_proxy_rules_duration_seconds_sum 3.0\nkubeproxy_sync_proxy_rules_duration_seconds_count 110\nkubeproxy_sync_proxy_rules_endpoint_changes_total 1100\nkubeproxy_conntrack_reconciler_sync_duration_seconds_sum 1.5\nkubeproxy_conntrack_reconciler_sync_duration_seconds_count 100\n";
        let m = ProxyMetrics::between(before, after);
        assert_eq!(m.syncs, 100.0);
        assert_eq!(m.endpoint_changes, 1000.0);
        assert!((m.sync_mean_ms - 20.0).abs() < 1e-9);
        assert!((m.conntrack_reconcile_mean_ms - 15.0).abs() < 1e-9);
    }

    #[test]
    fn a_failure_names_what_failed_and_timing_never_does() {
        let mut r = ChurnResults {
            kernel: Some(KernelCheck {
                equal: true,
                ..KernelCheck::default()
            }),
            ..ChurnResults::default()
        };
        r.pace.held = false;
        assert_eq!(r.failure(), None);
        r.proxy_exit = Some("signal: 9 (SIGKILL)".into());
        assert!(r.failure().unwrap().contains("exited"));
        r.proxy_exit = None;
        r.kernel = Some(KernelCheck {
            equal: false,
            differences: 2,
            ..KernelCheck::default()
        });
        assert!(r.failure().unwrap().contains("2 differences"));
    }
}
