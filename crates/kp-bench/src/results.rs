//! The results file (`bench/results/*.json`): everything the report and the plots are drawn
//! from. Times are seconds unless a field's name says otherwise. A field missing from an older
//! file reads as its default, so `bench report` can redraw old results.

use serde::{Deserialize, Serialize};

use crate::cluster::Mix;
use crate::mode::Rendered;
use crate::stats::Summary;

/// Bumped when a field changes meaning.
pub const FORMAT: u32 = 1;

/// One benchmark run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Results {
    /// [`FORMAT`].
    pub format: u32,
    /// When the run started (UTC, RFC 3339).
    pub started: String,
    /// How long the whole run took.
    pub duration_s: f64,
    /// The command that reproduces it.
    pub command: String,
    /// Where it ran.
    pub machine: Machine,
    /// What it was asked to do.
    pub settings: Settings,
    /// One entry per mode and size, in run order.
    pub runs: Vec<Run>,
}

/// The machine and tools.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Machine {
    /// `uname -r`.
    pub kernel: String,
    /// Online CPUs.
    pub cpus: usize,
    /// `model name` from /proc/cpuinfo.
    pub cpu_model: String,
    /// MemTotal, GiB.
    pub memory_gib: f64,
    /// `nft --version`.
    pub nft: String,
    /// `iptables --version`.
    pub iptables: String,
    /// The compiler that built the bench (`rustc --version` at run time, if found).
    pub rustc: String,
}

/// The run's settings.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Settings {
    /// Modes, in order.
    pub modes: Vec<String>,
    /// Service counts.
    pub sizes: Vec<usize>,
    /// Endpoints per Service.
    pub endpoints: usize,
    /// Single-endpoint changes per measurement.
    pub changes: usize,
    /// Full syncs and bare loads per size (the median counts).
    pub repeats: usize,
    /// Whether the data path was measured.
    pub datapath: bool,
    /// Seconds per connection-rate measurement (per target).
    pub connect_seconds: f64,
    /// Bytes per bulk transfer.
    pub bulk_bytes: u64,
    /// The kube-proxy binary used.
    pub proxy_binary: String,
    /// The binary's sources, in order (empty in older files: manifests and apiserver).
    pub sources: Vec<String>,
    /// Upstream's kube-proxy, when it ran as a baseline row.
    pub upstream_binary: String,
    /// The 1-minute load average when the run started (`/proc/loadavg`): above the CPU count,
    /// the machine was shared.
    pub load_average: f64,
}

/// One mode at one size.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Run {
    /// The mode.
    pub mode: String,
    /// Services.
    pub services: usize,
    /// Endpoints per Service.
    pub endpoints_per_service: usize,
    /// What the cluster held.
    pub mix: Mix,
    /// The first full sync, in-process.
    pub full_sync: Option<FullSync>,
    /// The bare kernel load of the same input.
    pub bare: Option<Bare>,
    /// Single-endpoint changes, in-process (render + apply), milliseconds.
    pub incremental_ms: Option<Summary>,
    /// Read-back check after the changes (the mode's `verify`).
    pub verify: Option<Verify>,
    /// The real binary, one entry per source.
    pub proxy: Vec<ProxyRun>,
    /// The data path.
    pub datapath: Option<Datapath>,
    /// Memory per open connection, for a mode that relays in this process (userspace).
    pub held: Option<Held>,
    /// Kernel memory of the dataplane's own objects after the changes (ebpf: its maps).
    pub kernel_memory: Option<KernelMemory>,
    /// Phases that failed, with why.
    pub errors: Vec<String>,
    /// The 1-minute load average when this mode's run at this size started.
    pub load_average: f64,
}

/// The first full sync through the library.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct FullSync {
    /// Rendering alone (a separate render of the same state with the same settings; the median
    /// of the repeats).
    pub render: Rendered,
    /// The whole sync, render and apply: the median of the repeats.
    pub total_s: f64,
    /// `total_s - render.seconds`: handing the input to the kernel tool and its commit.
    pub apply_s: f64,
    /// Every repeat's whole sync, each a first full sync into a fresh namespace.
    pub samples_s: Vec<f64>,
    /// What the sync reported as its size.
    pub operations: usize,
    /// Bytes sent to the kernel tool.
    pub input_bytes: usize,
}

/// The bare baseline.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Bare {
    /// The tool (`nft -f`).
    pub tool: String,
    /// Seconds the bare load took, in a fresh namespace: the median of the repeats.
    pub seconds: f64,
    /// Every repeat.
    pub samples_s: Vec<f64>,
    /// Our full sync over the bare load: `full_sync.total_s / seconds`.
    pub overhead: f64,
    /// Our apply alone over the bare load: `full_sync.apply_s / seconds`.
    pub apply_overhead: f64,
}

/// The read-back check.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Verify {
    /// Seconds.
    pub seconds: f64,
    /// Differences found (0 when the kernel holds the plan).
    pub differences: usize,
}

/// The `kube-proxy` binary run against one source.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ProxyRun {
    /// `manifests` or `apiserver`.
    pub source: String,
    /// From starting the process to the whole cluster being live in the kernel.
    pub startup_s: f64,
    /// Network programming latency, milliseconds: from the change at the source to the new
    /// endpoint being read back from the kernel.
    pub latency_ms: Summary,
    /// The source's own share of each latency, milliseconds: from handing it the change to its
    /// answer (the API server's write, etcd's commit included; nil for a manifest file).
    pub source_ms: Summary,
    /// What each latency took after the source's answer, milliseconds: latency less the
    /// source's share (watch delivery, the proxy's sync and the kernel; nil where the proxy
    /// saw the change before the API server's answer reached the writer).
    pub after_source_ms: Summary,
    /// How long the timed changes took, seconds (from the first change to the last one live).
    pub changes_s: f64,
    /// Peak resident memory of the proxy (VmHWM), MiB.
    pub peak_rss_mib: f64,
    /// Resident memory at the end (VmRSS), MiB.
    pub rss_mib: f64,
    /// The proxy's own unlabelled `kubeproxy_*` metrics at the end of the run (histogram sums
    /// and counts, gauges), by name; empty when they could not be read.
    pub metrics: std::collections::BTreeMap<String, f64>,
}

/// Connections held open through the ClusterIP by an in-process proxy (userspace mode), and
/// what they cost the process: idle relays, after the data-path runs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Held {
    /// Connections held open at once.
    pub connections: usize,
    /// The process's `VmRSS` before they opened, MiB.
    pub rss_before_mib: f64,
    /// Its `VmRSS` with them all relayed, MiB.
    pub rss_after_mib: f64,
    /// `(after - before) / connections`, KiB. The client ends are sockets in the same process:
    /// their user memory is nil, their kernel memory is not in RSS.
    pub kib_per_connection: f64,
}

/// What a dataplane's own kernel objects hold in memory (ebpf: each map's `memlock` in its
/// fdinfo, which is the map's memory use since Linux 6.5).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct KernelMemory {
    /// All of them, MiB.
    pub total_mib: f64,
    /// Each object by name, MiB, largest first.
    pub objects: Vec<(String, f64)>,
}

impl KernelMemory {
    /// From bytes by object.
    pub fn of(objects: Vec<(String, u64)>) -> KernelMemory {
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        let mut objects: Vec<(String, f64)> =
            objects.into_iter().map(|(n, b)| (n, mib(b))).collect();
        objects.sort_by(|a, b| b.1.total_cmp(&a.1));
        KernelMemory {
            total_mib: objects.iter().map(|(_, m)| m).sum(),
            objects,
        }
    }
}

/// Data-path results.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Datapath {
    /// New connections through the ClusterIP.
    pub vip: Connect,
    /// New connections straight to the pod IP.
    pub direct: Connect,
    /// New connections straight to the pod IP before any rule of ours was loaded: the physical
    /// limit of this lab.
    pub unloaded: Option<Connect>,
    /// `vip.latency_us.p50 / direct.latency_us.p50`.
    pub latency_ratio_p50: f64,
    /// `vip.latency_us.p99 / direct.latency_us.p99`.
    pub latency_ratio_p99: f64,
    /// `vip.per_second / direct.per_second`.
    pub rate_ratio: f64,
    /// `vip.latency_us.p50 / unloaded.latency_us.p50`.
    pub unloaded_ratio_p50: Option<f64>,
    /// `vip.latency_us.p99 / unloaded.latency_us.p99`.
    pub unloaded_ratio_p99: Option<f64>,
    /// Bulk throughput through the ClusterIP, Gbit/s (median of the transfers).
    pub bulk_vip_gbps: f64,
    /// Bulk throughput straight to the pod, Gbit/s.
    pub bulk_direct_gbps: f64,
    /// `bulk_vip_gbps / bulk_direct_gbps`.
    pub bulk_ratio: f64,
    /// Whether the client and the server ran pinned to CPUs of their own.
    pub pinned: bool,
}

impl Datapath {
    /// Records the measurement without rules, and the ClusterIP's latency ratios to it.
    pub fn set_unloaded(&mut self, unloaded: Connect) {
        let ratio = |a: f64, b: f64| (b > 0.0).then(|| a / b);
        self.unloaded_ratio_p50 = ratio(self.vip.latency_us.p50, unloaded.latency_us.p50);
        self.unloaded_ratio_p99 = ratio(self.vip.latency_us.p99, unloaded.latency_us.p99);
        self.unloaded = Some(unloaded);
    }
}

/// One connection-rate measurement.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Connect {
    /// Connections per second (all client threads together).
    pub per_second: f64,
    /// Connect latency, microseconds.
    pub latency_us: Summary,
    /// Connections that failed.
    pub errors: usize,
}

impl Run {
    /// Takes what `later` (a later run of the same mode and size) measured: each phase it has
    /// replaces this one's, each binary run replaces the one of the same source, and its errors
    /// replace this one's; a phase it skipped keeps this one's numbers.
    pub fn take_measured(&mut self, later: Run) {
        let measured_in_process = later.full_sync.is_some() || later.incremental_ms.is_some();
        if measured_in_process {
            self.full_sync = later.full_sync;
            self.bare = later.bare;
            self.incremental_ms = later.incremental_ms;
            self.verify = later.verify;
        }
        if later.datapath.is_some() {
            self.datapath = later.datapath;
        }
        if later.held.is_some() {
            self.held = later.held;
        }
        if later.kernel_memory.is_some() {
            self.kernel_memory = later.kernel_memory;
        }
        for p in later.proxy {
            match self.proxy.iter_mut().find(|q| q.source == p.source) {
                Some(q) => *q = p,
                None => self.proxy.push(p),
            }
        }
        self.errors = later.errors;
        self.load_average = later.load_average;
        self.mix = later.mix;
    }
}

impl Results {
    /// Several results as one report, in the order given: a later run of the same mode and size
    /// replaces what it measured of an earlier one ([`Run::take_measured`]); settings lists are joined; the commands are listed one per line;
    /// the machine is the last one's. `None` for no results.
    pub fn merge(parts: Vec<Results>) -> Option<Results> {
        let mut parts = parts.into_iter();
        let mut out = parts.next()?;
        for p in parts {
            for run in p.runs {
                match out
                    .runs
                    .iter_mut()
                    .find(|r| r.mode == run.mode && r.services == run.services)
                {
                    Some(earlier) => earlier.take_measured(run),
                    None => out.runs.push(run),
                }
            }
            for s in p.settings.sources {
                if !out.settings.sources.contains(&s) {
                    out.settings.sources.push(s);
                }
            }
            if !p.settings.upstream_binary.is_empty() {
                out.settings.upstream_binary = p.settings.upstream_binary;
            }
            out.settings.load_average = out.settings.load_average.max(p.settings.load_average);
            for m in p.settings.modes {
                if !out.settings.modes.contains(&m) {
                    out.settings.modes.push(m);
                }
            }
            for n in p.settings.sizes {
                if !out.settings.sizes.contains(&n) {
                    out.settings.sizes.push(n);
                }
            }
            out.settings.datapath |= p.settings.datapath;
            out.command = format!("{}\n{}", out.command, p.command);
            out.duration_s += p.duration_s;
            out.started = out.started.min(p.started);
            out.machine = p.machine;
        }
        // Sizes in order, modes in their first appearance's order.
        let order = out.settings.modes.clone();
        let rank = |m: &str| order.iter().position(|o| o == m).unwrap_or(usize::MAX);
        out.runs.sort_by_key(|r| (r.services, rank(&r.mode)));
        out.settings.sizes.sort_unstable();
        Some(out)
    }

    /// The run of `mode` at `services`, if there is one.
    pub fn run(&self, mode: &str, services: usize) -> Option<&Run> {
        self.runs
            .iter()
            .find(|r| r.mode == mode && r.services == services)
    }

    /// The modes in run order, without repeats.
    pub fn modes(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for r in &self.runs {
            if !out.contains(&r.mode) {
                out.push(r.mode.clone());
            }
        }
        out
    }
}

/// Each change's latency less the source's share of it (both milliseconds, one per change, in
/// order), floored at zero.
pub fn after_source(latencies: &[f64], taken: &[f64]) -> Summary {
    let after: Vec<f64> = latencies
        .iter()
        .zip(taken)
        .map(|(l, t)| (l - t).max(0.0))
        .collect();
    Summary::of(&after)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn after_source_is_each_latency_less_its_own_source_share_floored_at_zero() {
        // The third change was live before the writer had the API server's answer.
        let s = after_source(&[10.0, 50.0, 5.0], &[4.0, 45.0, 8.0]);
        assert_eq!(s.n, 3);
        assert_eq!(s.max, 6.0);
        assert_eq!(s.p50, 5.0);
        assert_eq!(after_source(&[], &[]).n, 0);
    }
}
