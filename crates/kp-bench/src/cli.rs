//! The command line.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand};

use crate::run::Options;

/// Scale benchmarks of kube-proxy-rs: sync cost, programming latency, memory and data path.
///
/// Run as root from the repository root after `cargo build --release -p kube-proxy -p kp-bench`.
/// Everything happens inside network namespaces it creates and deletes. It prints progress on
/// standard error and writes bench/results/<time>.json, bench/results/latest.json,
/// bench/sync_time.png, bench/connect_latency.png and BENCHMARKS.md.
///
/// Profiling the data path: with KP_PERF_CTL=CTL[,ACK] (the fifos of a `perf record -D -1
/// --control fifo:CTL[,ACK]` started around this command) and KP_PERF_TARGET=vip (or direct), the
/// connect runs through the ClusterIP (or straight to the pod), with the Services installed, write
/// `enable` to CTL when their measured seconds start and `disable` when they end (waiting for
/// perf's `ack` on ACK), so nothing else is sampled; KP_PERF_TARGET=vip-bulk (or direct-bulk)
/// does the same around each bulk transfer instead; KP_PERF_EVENT=NAME switches that event alone
/// (`enable NAME`), which keeps perf tracking processes started in between. KP_PERF_TARGET=full-sync
/// (or changes) samples the in-process dataplane's first full sync (or its one-endpoint changes)
/// instead. Give one mode and one size (scripts/profile.sh nftables-datapath-vip-30k and
/// nftables-full-100k do).
#[derive(Debug, Parser)]
#[command(name = "bench", version)]
pub struct Cli {
    /// What to do; without a subcommand, run the benchmark.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// The benchmark's settings.
    #[command(flatten)]
    pub run: RunArgs,
}

/// Settings of a benchmark run.
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// Service counts, comma-separated [default: 1000,10000,30000; with --quick: 100,1000].
    #[arg(long, value_delimiter = ',')]
    pub sizes: Option<Vec<usize>>,
    /// Endpoints per Service.
    #[arg(long, default_value_t = 10)]
    pub endpoints: usize,
    /// Modes, comma-separated [default: every mode built in].
    #[arg(long, value_delimiter = ',')]
    pub modes: Option<Vec<String>>,
    /// Single-endpoint changes per measurement [default: 100; with --quick: 20].
    #[arg(long)]
    pub changes: Option<usize>,
    /// Changes per programming-latency run of the binary [default: as --changes]. Fewer keep
    /// runs where each change costs seconds (iptables-legacy at 30k) within reach; the count
    /// is reported beside each latency.
    #[arg(long)]
    pub latency_changes: Option<usize>,
    /// Spread each programming-latency run's changes evenly over at least this many seconds
    /// (at least 20 ms apart), so periodic full syncs (every 30 s by default) fall among them;
    /// how many did is reported [default: one change after another].
    #[arg(long)]
    pub latency_span: Option<f64>,
    /// Changes in upstream kube-proxy's latency run [default: as --latency-changes]; each
    /// costs it seconds at 10k Services.
    #[arg(long)]
    pub upstream_changes: Option<usize>,
    /// First full syncs and bare loads per size, each into a fresh namespace; the median is
    /// reported [default: 3; with --quick: 1].
    #[arg(long)]
    pub repeats: Option<usize>,
    /// Skip the data-path measurements.
    #[arg(long)]
    pub skip_datapath: bool,
    /// Do not pin the data path's client and server to CPUs of their own (by default, on a
    /// machine with two CPUs or more, the client runs on CPU 0 and the server on CPU 1).
    #[arg(long)]
    pub no_pin: bool,
    /// Skip the kube-proxy binary runs (programming latency and memory).
    #[arg(long)]
    pub skip_proxy: bool,
    /// Skip the in-process sync measurements and the bare baseline (to measure the binary
    /// alone; `bench report` merges such a run into earlier results without losing theirs).
    #[arg(long)]
    pub skip_sync: bool,
    /// The binary's sources, comma-separated: manifests, apiserver (the fake API server),
    /// kube-apiserver (a real one, etcd + kube-apiserver v1.28.7 from ../shared/k8s, loaded once
    /// per size) [default: all three; kube-apiserver only where this machine can start it].
    #[arg(long, value_delimiter = ',')]
    pub sources: Option<Vec<String>>,
    /// No upstream kube-proxy v1.28.7 baseline row (it runs by default with the kube-apiserver
    /// source, on the same objects).
    #[arg(long)]
    pub skip_upstream: bool,
    /// Which iptables backend upstream's `iptables` reaches: legacy (a PATH of links to
    /// iptables-legacy*) or nft (the machine's iptables; its first sync at 10k takes over an
    /// hour).
    #[arg(long, default_value = "legacy")]
    pub upstream_backend: String,
    /// Upstream's kube-proxy [default: unpacked from ../shared/k8s/kube-proxy-v1.28.7.xz and
    /// checked against its digest].
    #[arg(long)]
    pub upstream_binary: Option<PathBuf>,
    /// A small smoke run: sizes 100 and 1000, 20 changes, one full sync, 1 s connection runs,
    /// 100 MB bulk.
    #[arg(long)]
    pub quick: bool,
    /// Seconds of new connections per target [default: 5; with --quick: 1].
    #[arg(long)]
    pub connect_seconds: Option<f64>,
    /// Client threads opening connections (one keeps the latency clean of the client's own
    /// contention for the two cores).
    #[arg(long, default_value_t = 1)]
    pub connect_threads: usize,
    /// Bytes per bulk transfer [default: 1000000000; with --quick: 100000000].
    #[arg(long)]
    pub bulk_bytes: Option<u64>,
    /// Bulk transfers per target [default: 3; with --quick: 1].
    #[arg(long)]
    pub bulk_repeats: Option<usize>,
    /// The kube-proxy binary [default: kube-proxy next to this binary].
    #[arg(long)]
    pub proxy_binary: Option<PathBuf>,
    /// Where bench/ and BENCHMARKS.md are written [default: the repository this was built from].
    #[arg(long)]
    pub root: Option<PathBuf>,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Redraw the plots and BENCHMARKS.md from results files (and write their merge as
    /// latest.json).
    Report {
        /// A results file [default: ROOT/bench/results/latest.json]. Given several times, the
        /// runs are merged in order: what a later run of a mode and size measured replaces the
        /// earlier one's (phases it skipped keep the earlier numbers).
        #[arg(long)]
        results: Vec<PathBuf>,
        /// Where bench/ and BENCHMARKS.md are written.
        #[arg(long)]
        root: Option<PathBuf>,
    },
    /// A churn soak of the kube-proxy binary through its API source: N Services × E endpoints
    /// in a fake API server, then R endpoint changes per second for D seconds. Reports the
    /// proxy's VmRSS and VmHWM over time, programming latency of a sample of the changes, and
    /// whether the kernel equals the plan at quiescence. Prints progress on standard error,
    /// writes `bench/results/churn-TIME.json`, `churn-latest.json` and a plot, and ends with one
    /// line on standard output: `churn: mode=… services=… seconds=… target_rate=…
    /// achieved_rate=… changes=… latency_p50_ms=… latency_p99_ms=… vmhwm_start_mib=…
    /// vmhwm_end_mib=… rss_slope_mib_per_min=… kernel_equals_plan=true|false`. Exits 1 if
    /// the proxy died, the kernel differs from the plan, or the harness failed; timing never
    /// fails it.
    Churn(ChurnArgs),
    /// Writes the benchmark's cluster of N Services × E endpoints as the manifest directory
    /// the binary reads (`--manifests DIR`), and prints, one per line, the flags every run of
    /// the binary gets in MODE. For profiling the binary outside the harness
    /// (scripts/profile.sh userspace-memory-10k).
    Manifests {
        /// Services N.
        #[arg(long)]
        services: usize,
        /// Endpoints per Service E.
        #[arg(long, default_value_t = 10)]
        endpoints: usize,
        /// The mode whose flags are printed (as `--modes` names it).
        #[arg(long)]
        mode: String,
        /// The directory to write (created; files of the same names are replaced).
        #[arg(long)]
        out: PathBuf,
        /// The files' format: json (one `List` per file) or yaml (one document per object,
        /// `apiVersion` and `kind` first).
        #[arg(long, default_value = "json")]
        format: String,
    },
    /// Starts a real API server (etcd + kube-apiserver v1.28.7 on loopback) loaded with the
    /// benchmark's cluster of N Services × E endpoints, and a network namespace bridged to it,
    /// for profiling the binary against it outside the harness (scripts/profile.sh
    /// nftables-memory-kube-apiserver-10k). Prints `namespace=NAME` and `kubeconfig=PATH` (the
    /// `system:kube-proxy` user's, valid inside the namespace) once ready, then holds everything
    /// until its standard input closes, and removes it all.
    KubeApiserver {
        /// Services N.
        #[arg(long)]
        services: usize,
        /// Endpoints per Service E.
        #[arg(long, default_value_t = 10)]
        endpoints: usize,
    },
    /// The ipvs mode inside the kp-vm guest (this kernel has no IP_VS) beside nftables in the
    /// same guest and on the host: full sync, one-endpoint changes p50/p99, peak RSS, and the
    /// change applied by a full re-list as upstream does (src/vm.rs).
    Vm(crate::vm::VmArgs),
    /// One measurement of `bench vm`, in this process; prints its result line.
    #[command(hide = true)]
    VmMeasure(crate::vm::MeasureArgs),
    /// The data-path server (runs inside a pod namespace).
    #[command(hide = true)]
    DatapathServer {
        /// Accept-and-reset address.
        #[arg(long)]
        connect: SocketAddr,
        /// Read-to-the-end address.
        #[arg(long)]
        bulk: SocketAddr,
    },
    /// The data-path client (runs inside a pod namespace); prints JSON.
    #[command(hide = true, subcommand)]
    DatapathClient(ClientCommand),
}

/// Settings of a churn soak.
#[derive(Debug, clap::Args)]
pub struct ChurnArgs {
    /// The proxy mode: nftables, iptables-nft or iptables-legacy.
    #[arg(long, visible_alias = "proxy-mode", default_value = "nftables")]
    pub mode: String,
    /// Services N.
    #[arg(long, default_value_t = 10_000)]
    pub services: usize,
    /// Endpoints per Service E.
    #[arg(long, default_value_t = 10)]
    pub endpoints: usize,
    /// Endpoint changes per second R (EndpointSlice updates, one endpoint replaced each).
    #[arg(long, default_value_t = 1000)]
    pub rate: u32,
    /// Seconds of churn D.
    #[arg(long, default_value_t = 300)]
    pub seconds: u64,
    /// Changes timed per second from the API change to the kernel [default: 10 with
    /// nftables, 2 with the iptables modes, whose kernel reads are processes].
    #[arg(long)]
    pub probes_per_second: Option<f64>,
    /// The kube-proxy binary [default: kube-proxy next to this binary].
    #[arg(long)]
    pub proxy_binary: Option<PathBuf>,
    /// Where bench/results/ is written [default: the repository this was built from].
    #[arg(long)]
    pub root: Option<PathBuf>,
    /// The plot [default: ROOT/bench/churn.png].
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

impl ChurnArgs {
    /// The options these arguments ask for. `bench` is this binary; `args` the full command
    /// line (recorded in the results).
    pub fn options(
        &self,
        bench: PathBuf,
        args: &[String],
    ) -> anyhow::Result<crate::churn::ChurnOptions> {
        let root = self.root.clone().unwrap_or_else(default_root);
        crate::modes::by_names(std::slice::from_ref(&self.mode))?;
        if self.services == 0 {
            anyhow::bail!("--services must be above 0");
        }
        if self.endpoints == 0 || self.endpoints > 1000 {
            anyhow::bail!("--endpoints must be between 1 and 1000");
        }
        if self.rate == 0 || self.seconds == 0 {
            anyhow::bail!("--rate and --seconds must be above 0");
        }
        if self
            .probes_per_second
            .is_some_and(|p| !(p > 0.0 && p.is_finite()))
        {
            anyhow::bail!("--probes-per-second must be above 0");
        }
        let proxy_binary = self.proxy_binary.clone().unwrap_or_else(|| {
            bench
                .parent()
                .map(|d| d.join("kube-proxy"))
                .unwrap_or_else(|| PathBuf::from("kube-proxy"))
        });
        Ok(crate::churn::ChurnOptions {
            mode: self.mode.clone(),
            services: self.services,
            endpoints: self.endpoints,
            rate: self.rate,
            seconds: self.seconds,
            probes_per_second: self.probes_per_second,
            proxy_binary,
            plot: self.plot.clone(),
            command: command_line(args, &root),
            root,
        })
    }
}

/// Data-path client measurements.
#[derive(Debug, Subcommand)]
pub enum ClientCommand {
    /// New connections for a while: prints the samples as JSON.
    Connect {
        /// Where to connect.
        #[arg(long)]
        target: SocketAddr,
        /// Seconds to measure (after a 0.3 s warm-up).
        #[arg(long)]
        seconds: f64,
        /// Threads.
        #[arg(long, default_value_t = 1)]
        threads: usize,
        /// perf's control fifo, and its acknowledgement fifo after a comma: `enable` when the
        /// measured seconds start, `disable` when they end.
        #[arg(long)]
        perf_ctl: Option<String>,
        /// The perf event to switch (`enable NAME`) [default: every event].
        #[arg(long)]
        perf_event: Option<String>,
    },
    /// One bulk transfer: prints Gbit/s.
    Bulk {
        /// Where to send.
        #[arg(long)]
        target: SocketAddr,
        /// How many bytes.
        #[arg(long)]
        bytes: u64,
    },
}

/// The repository this binary was built from.
pub fn default_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.ancestors()
        .nth(2)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// The command line as typed, with the program shown relative to `root` when it is inside it.
pub fn command_line(args: &[String], root: &Path) -> String {
    let mut parts: Vec<String> = args.to_vec();
    if let Some(program) = parts.first_mut() {
        let p = Path::new(program.as_str());
        let abs = if p.is_absolute() {
            Some(p.to_path_buf())
        } else {
            std::env::current_dir().ok().map(|d| d.join(p))
        };
        if let Some(rel) = abs.as_deref().and_then(|a| {
            let root = root.canonicalize().ok()?;
            let a = a.canonicalize().ok()?;
            a.strip_prefix(&root).ok().map(Path::to_path_buf)
        }) {
            *program = rel.display().to_string();
        }
    }
    parts.join(" ")
}

impl RunArgs {
    /// The options these arguments ask for. `bench` is this binary; `args` the full command
    /// line (recorded in the results).
    pub fn options(&self, bench: PathBuf, args: &[String]) -> anyhow::Result<Options> {
        let q = self.quick;
        let root = self.root.clone().unwrap_or_else(default_root);
        let sizes = self.sizes.clone().unwrap_or_else(|| {
            if q {
                vec![100, 1000]
            } else {
                vec![1000, 10_000, 30_000]
            }
        });
        if sizes.is_empty() || sizes.contains(&0) {
            anyhow::bail!("--sizes needs Service counts above 0");
        }
        if self.endpoints == 0 || self.endpoints > 1000 {
            anyhow::bail!("--endpoints must be between 1 and 1000");
        }
        let modes = self.modes.clone().unwrap_or_else(|| {
            crate::modes::all()
                .iter()
                .map(|m| m.name().to_string())
                .collect()
        });
        crate::modes::by_names(&modes)?;
        let perf = crate::datapath::PerfControl::from_env()?;
        let proxy_binary = self.proxy_binary.clone().unwrap_or_else(|| {
            bench
                .parent()
                .map(|d| d.join("kube-proxy"))
                .unwrap_or_else(|| PathBuf::from("kube-proxy"))
        });
        let sources = match &self.sources {
            Some(names) => names
                .iter()
                .map(|n| crate::proxy::Source::parse(n))
                .collect::<anyhow::Result<Vec<_>>>()?,
            None => {
                let mut all = crate::proxy::Source::DEFAULT.to_vec();
                if let Some(why) = kp_test::kube_apiserver::unavailable() {
                    eprintln!("bench: no kube-apiserver source (and no upstream baseline): {why}");
                    all.retain(|s| *s != crate::proxy::Source::KubeApiServer);
                }
                all
            }
        };
        let upstream_backend = crate::upstream::UpstreamBackend::parse(&self.upstream_backend)?;
        let upstream = (!self.skip_upstream
            && !self.skip_proxy
            && sources.contains(&crate::proxy::Source::KubeApiServer))
        .then_some(upstream_backend);
        let latency_changes =
            self.latency_changes
                .or(self.changes)
                .unwrap_or(if q { 20 } else { 100 });
        Ok(Options {
            modes,
            sizes,
            sources,
            upstream,
            upstream_binary: self.upstream_binary.clone(),
            skip_sync: self.skip_sync,
            endpoints: self.endpoints,
            changes: self.changes.unwrap_or(if q { 20 } else { 100 }),
            latency_changes,
            upstream_changes: self.upstream_changes.unwrap_or(latency_changes),
            latency_span: self
                .latency_span
                .filter(|s| *s > 0.0)
                .map(std::time::Duration::from_secs_f64),
            repeats: self.repeats.unwrap_or(if q { 1 } else { 3 }).max(1),
            skip_datapath: self.skip_datapath,
            skip_proxy: self.skip_proxy,
            connect_seconds: self.connect_seconds.unwrap_or(if q { 1.0 } else { 5.0 }),
            connect_threads: self.connect_threads.max(1),
            bulk_bytes: self
                .bulk_bytes
                .unwrap_or(if q { 100_000_000 } else { 1_000_000_000 }),
            bulk_repeats: self.bulk_repeats.unwrap_or(if q { 1 } else { 3 }),
            pinning: if self.no_pin {
                None
            } else {
                crate::datapath::Pinning::for_machine(
                    std::thread::available_parallelism().map_or(1, |n| n.get()),
                )
            },
            perf,
            proxy_binary,
            bench_binary: bench,
            command: command_line(args, &root),
            root,
        })
    }
}
