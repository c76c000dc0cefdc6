//! `bench vm`: the ipvs mode's sync cost, measured where IPVS exists on this machine, inside the
//! kp-vm guest (Debian's kernel under qemu with TCG, no KVM), beside the nftables mode in the
//! same guest, and the nftables mode on the host to state the guest's slowdown.
//!
//! Each measurement is one process of this binary, `bench vm-measure` ([`measure`]), in a
//! network namespace of its own: the cluster (`kp_test::cluster`) loaded into the proxy's state,
//! the mode's dataplane built by the proxy's registry from the binary's own flags (as
//! `kube-proxy --proxy-mode=MODE` builds it), a first full sync into the empty namespace, one-
//! endpoint changes each followed by a partial sync (timed one by one), the read-back check,
//! and the process's peak resident memory (`VmHWM`: the state and the dataplane, as one process).
//! For ipvs, the same changes then go the way upstream's ipvs proxier applies every change: a
//! whole re-list and rewrite. That baseline is our own code doing a full sync per change (the
//! ipsets re-listed with `ipset save` and restored, the whole iptables text restored and the
//! jump rules checked, IPVS dumped and diffed, `kube-ipvs0`'s addresses dumped), not upstream's
//! binary.
//!
//! The host side ([`run`]) starts `vm-measure` for nftables on the host, then for nftables and
//! ipvs in a fresh guest each, through `vm_run` (kp-ipvs's example: kp-bench does not depend on
//! kp-vm), reads each one's result line, and writes `bench/results/ipvs-vm-<time>.json`,
//! `ipvs-vm-latest.json` and the "IPVS in the VM" section of `BENCHMARKS.md`
//! ([`crate::report_vm`]). A measurement, not a test: no timing is judged here.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kp_core::dataplane::Dataplane;
use kp_core::track::SourceEvent;
use kp_proxy::config::{Config, ProxyMode};
use kp_proxy::modes::ModeContext;
use serde::{Deserialize, Serialize};

use crate::cluster::{self, ChangeStream, Cluster, Mix, MixOf};
use crate::progress::Progress;
use crate::results::Machine;
use crate::stats::Summary;

/// Bumped when a field changes meaning.
pub const FORMAT: u32 = 1;

/// The file the report reads, under [`crate::report::RESULTS_DIR`].
pub const LATEST: &str = "ipvs-vm-latest.json";

/// Services in the warm-up before a measurement.
pub const WARM_UP_SERVICES: usize = 10;

/// What starts a measurement's result line on standard output.
pub const RESULT_PREFIX: &str = "KP-BENCH-VM-RESULT ";

/// Where a measurement ran.
pub const HOST: &str = "host";
/// In the kp-vm guest.
pub const GUEST: &str = "guest";

/// A `bench vm` run: every measurement, and where and how it ran.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct VmResults {
    /// [`FORMAT`].
    pub format: u32,
    /// When the run started (UTC, RFC 3339).
    pub started: String,
    /// How long the whole run took, guests included.
    pub duration_s: f64,
    /// The command that reproduces it.
    pub command: String,
    /// The host.
    pub host: Machine,
    /// What it was asked to do.
    pub settings: VmSettings,
    /// One entry per mode, place and size, in run order.
    pub runs: Vec<VmRun>,
    /// Measurements that failed, with why.
    pub errors: Vec<String>,
    /// The host's highest 1-minute load average, read at the start and after each
    /// measurement.
    pub load_average: f64,
}

/// The run's settings.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct VmSettings {
    /// Service counts.
    pub sizes: Vec<usize>,
    /// Endpoints per Service.
    pub endpoints: usize,
    /// One-endpoint changes (partial syncs) per measurement.
    pub changes: usize,
    /// Changes applied the upstream way (a full re-list and rewrite each), ipvs only.
    pub baseline_changes: usize,
    /// Each guest's limit, seconds (boot included).
    pub guest_timeout_s: u64,
}

/// One mode at one size, on the host or in the guest.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct VmRun {
    /// `ipvs` or `nftables`.
    pub mode: String,
    /// [`HOST`] or [`GUEST`].
    pub place: String,
    /// Services.
    pub services: usize,
    /// Endpoints per Service.
    pub endpoints_per_service: usize,
    /// What the cluster held.
    pub mix: Mix,
    /// Where it ran, as seen from inside (the guest's kernel, CPUs and memory).
    pub machine: Machine,
    /// The 1-minute load average where it ran, at its start.
    pub load_average: f64,
    /// Generating the cluster and loading it into the proxy's state.
    pub generate_s: f64,
    /// The untimed warm-up before the rows: [`WARM_UP_SERVICES`] Services synced, changed,
    /// synced in full and read back in a scratch namespace (a fresh guest loads the mode's
    /// kernel modules on first use, through the host's `modprobe` over 9p).
    pub warm_up_s: f64,
    /// The first full sync into an empty namespace.
    pub full_sync_s: f64,
    /// What that sync reported as its size (the mode's own unit).
    pub full_sync_operations: usize,
    /// One-endpoint changes, each a partial sync, milliseconds.
    pub change_ms: Summary,
    /// The most operations one of those syncs reported.
    pub change_operations_max: usize,
    /// One periodic full sync after the changes (everything in place: read back and compared,
    /// nothing to change), seconds; before it the peak misses what a running proxy's periodic
    /// syncs hold. `None` in results from before it was measured.
    pub periodic_sync_s: Option<f64>,
    /// The same kind of change applied as upstream applies every change, by a full sync that
    /// re-lists and rewrites everything (ipvs only), milliseconds.
    pub relist_change_ms: Option<Summary>,
    /// The read-back check after all the changes, seconds.
    pub verify_s: f64,
    /// Differences it found (0: the kernel holds the plan).
    pub differences: usize,
    /// `VmHWM` once the state was loaded, before the dataplane existed, MiB.
    pub state_hwm_mib: f64,
    /// `VmHWM` after the full sync, the partial changes and one periodic full sync (before the
    /// re-list baseline), MiB:
    /// the state and the dataplane, in one process.
    pub peak_rss_mib: f64,
    /// `VmRSS` at that point, MiB.
    pub rss_mib: f64,
    /// `VmHWM` at the end, after the re-list baseline, MiB.
    pub end_hwm_mib: f64,
    /// For a guest run, from starting qemu to the script (as the host timed it).
    pub guest_boot_s: Option<f64>,
    /// For a guest run, from starting qemu to the script's end.
    pub guest_total_s: Option<f64>,
}

impl VmResults {
    /// The run of `mode` at `services` in `place`.
    pub fn run(&self, mode: &str, place: &str, services: usize) -> Option<&VmRun> {
        self.runs
            .iter()
            .find(|r| r.mode == mode && r.place == place && r.services == services)
    }
}

/// The binary's configuration for `mode`, loaded with its own code from the flags every
/// benchmark run of the binary gets (this node's name and cluster CIDR, no minimum sync
/// period): the registry builds the mode from it as `kube-proxy` does.
pub fn binary_config(mode: ProxyMode) -> anyhow::Result<Config> {
    let args = [
        "kube-proxy".to_string(),
        format!("--proxy-mode={}", mode.as_str()),
        format!("--hostname-override={}", cluster::NODE_NAME),
        format!("--cluster-cidr={}", cluster::CLUSTER_CIDR),
        "--iptables-min-sync-period=0".into(),
    ];
    let loaded = kp_proxy::config::load_with(args, |path| {
        Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("no config file here ({})", path.display()),
        ))
    })
    .map_err(|e| anyhow::anyhow!("{}: the flags do not load: {e}", mode.as_str()))?;
    Ok(loaded.config)
}

/// The modes `bench vm` measures.
pub fn parse_mode(name: &str) -> anyhow::Result<ProxyMode> {
    match name {
        "ipvs" => Ok(ProxyMode::Ipvs),
        "nftables" => Ok(ProxyMode::Nftables),
        _ => anyhow::bail!("bench vm measures ipvs and nftables, not {name}"),
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// What one measurement does.
#[derive(Clone, Debug)]
pub struct Measure {
    /// The mode.
    pub mode: ProxyMode,
    /// Services.
    pub services: usize,
    /// Endpoints per Service.
    pub endpoints: usize,
    /// Partial syncs timed.
    pub changes: usize,
    /// Changes applied by a full re-list each (ipvs only; 0: none).
    pub baseline_changes: usize,
    /// [`HOST`] or [`GUEST`].
    pub place: String,
}

/// One measurement in this process (`bench vm-measure`), in a network namespace it creates;
/// progress on standard error.
pub fn measure(m: &Measure) -> anyhow::Result<VmRun> {
    let p = Progress::new();
    if !kp_test::netns::require_root() {
        anyhow::bail!("the measurement creates a network namespace: run it as root");
    }
    let name = m.mode.as_str();
    let mut out = VmRun {
        mode: name.into(),
        place: m.place.clone(),
        services: m.services,
        endpoints_per_service: m.endpoints,
        machine: crate::machine::describe(),
        load_average: crate::run::load_average(),
        ..VmRun::default()
    };
    p.say(format!(
        "{name} ({}) at {} Services × {}, kernel {}, {} CPUs, {:.1} GiB",
        m.place,
        m.services,
        m.endpoints,
        out.machine.kernel,
        out.machine.cpus,
        out.machine.memory_gib
    ));
    let c = Cluster::new(m.services, m.endpoints);
    out.mix = c.mix();
    let t = Instant::now();
    let mut state = cluster::load_state(c.manifests())?;
    out.generate_s = t.elapsed().as_secs_f64();
    out.state_hwm_mib = crate::proxy::memory_mib(std::process::id())?.0;
    p.say(format!(
        "  state loaded in {:.1} s, VmHWM {:.1} MiB",
        out.generate_s, out.state_hwm_mib
    ));

    let config = binary_config(m.mode)?;
    let entry = kp_proxy::modes::find(m.mode)
        .ok_or_else(|| anyhow::anyhow!("{name} is not in the proxy's registry"))?;
    let build = |ns: &str| -> anyhow::Result<Box<dyn Dataplane>> {
        let ctx = ModeContext {
            config: &config,
            netns: Some(ns),
            metrics: Arc::new(kp_metrics::Metrics::new()),
        };
        (entry.build)(&ctx).map_err(|e| anyhow::anyhow!("{name}: building the dataplane: {e}"))
    };

    // A warm-up in a scratch namespace, untimed in the rows: a small cluster synced, changed and
    // read back, so the kernel modules the mode needs are loaded (a fresh guest loads each on
    // first use, through the host's modprobe over 9p) and its tools have been run once, as on
    // a node where the proxy ran before.
    let t = Instant::now();
    {
        let scratch = kp_test::netns::Netns::new("vm-warm")?;
        let small = Cluster::new(WARM_UP_SERVICES, m.endpoints);
        let mut warm_state = cluster::load_state(small.manifests())?;
        let mut dp = build(scratch.name())?;
        dp.sync(&warm_state, &Default::default(), true)?;
        let next = ChangeStream::new(&small).next_change();
        warm_state
            .apply(SourceEvent::Upsert(cluster::to_object(&next.slice)?))
            .map_err(|e| anyhow::anyhow!("warm-up change: {e}"))?;
        let changes = warm_state.take_changes();
        dp.sync(&warm_state, &changes, false)?;
        dp.sync(&warm_state, &Default::default(), true)?;
        dp.verify()?;
    }
    out.warm_up_s = t.elapsed().as_secs_f64();
    p.say(format!(
        "  warm-up ({WARM_UP_SERVICES} Services in a scratch namespace: module loads, first runs of the tools) {:.1} s",
        out.warm_up_s
    ));

    let ns = kp_test::netns::Netns::new("vm-bench")?;
    let mut dp = build(ns.name())?;

    let t = Instant::now();
    let report = dp.sync(&state, &Default::default(), true)?;
    out.full_sync_s = t.elapsed().as_secs_f64();
    out.full_sync_operations = report.operations;
    p.say(format!(
        "  full sync {:.2} s, {} operations",
        out.full_sync_s, report.operations
    ));

    let mut stream = ChangeStream::new(&c);
    let mut change = |state: &mut kp_core::track::ProxyState,
                      dp: &mut Box<dyn Dataplane>,
                      full: bool|
     -> anyhow::Result<(f64, usize)> {
        let next = stream.next_change();
        state
            .apply(SourceEvent::Upsert(cluster::to_object(&next.slice)?))
            .map_err(|e| anyhow::anyhow!("change {}: {e}", next.k))?;
        let changes = state.take_changes();
        let t = Instant::now();
        let r = dp.sync(state, &changes, full)?;
        Ok((ms(t.elapsed()), r.operations))
    };
    let mut times = Vec::with_capacity(m.changes);
    let mut last = Instant::now();
    for done in 0..m.changes {
        p.every(&mut last, || {
            format!("  one-endpoint changes: {done} of {} done", m.changes)
        });
        let (took, ops) = change(&mut state, &mut dp, false)?;
        times.push(took);
        out.change_operations_max = out.change_operations_max.max(ops);
    }
    out.change_ms = Summary::of(&times);
    p.say(format!(
        "  one-endpoint change: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms over {} (at most {} operations)",
        out.change_ms.p50, out.change_ms.p99, out.change_ms.max, out.change_ms.n, out.change_operations_max
    ));
    let t = Instant::now();
    dp.sync(&state, &Default::default(), true)?;
    let periodic = t.elapsed().as_secs_f64();
    out.periodic_sync_s = Some(periodic);
    p.say(format!("  a periodic full sync {periodic:.2} s"));
    let (hwm, rss) = crate::proxy::memory_mib(std::process::id())?;
    out.peak_rss_mib = hwm;
    out.rss_mib = rss;
    p.say(format!("  VmHWM {hwm:.1} MiB, VmRSS {rss:.1} MiB"));

    if m.mode == ProxyMode::Ipvs && m.baseline_changes > 0 {
        let mut times = Vec::with_capacity(m.baseline_changes);
        let mut last = Instant::now();
        for done in 0..m.baseline_changes {
            p.every(&mut last, || {
                format!(
                    "  changes by a full re-list: {done} of {} done",
                    m.baseline_changes
                )
            });
            times.push(change(&mut state, &mut dp, true)?.0);
        }
        let s = Summary::of(&times);
        p.say(format!(
            "  the same change by a full re-list and rewrite (upstream's approach, our code): p50 {:.1} ms, p99 {:.1} ms over {}",
            s.p50, s.p99, s.n
        ));
        out.relist_change_ms = Some(s);
    }

    let t = Instant::now();
    let diffs = dp.verify()?;
    out.verify_s = t.elapsed().as_secs_f64();
    out.differences = diffs.len();
    p.say(format!(
        "  read-back check {:.2} s, {} differences",
        out.verify_s,
        diffs.len()
    ));
    for d in diffs.iter().take(5) {
        p.say(format!("    {d}"));
    }
    out.end_hwm_mib = crate::proxy::memory_mib(std::process::id())?.0;
    // What the dataplane holds goes before its namespace.
    drop(dp);
    drop(ns);
    Ok(out)
}

/// The result line of a measurement's output, parsed.
pub fn parse_result(output: &str) -> anyhow::Result<VmRun> {
    let line = output
        .lines()
        .rev()
        .find_map(|l| {
            l.find(RESULT_PREFIX)
                .map(|at| &l[at + RESULT_PREFIX.len()..])
        })
        .ok_or_else(|| anyhow::anyhow!("no {} line", RESULT_PREFIX.trim()))?;
    Ok(serde_json::from_str(line.trim())?)
}

/// What `bench vm` runs.
#[derive(Clone, Debug)]
pub struct VmOptions {
    /// Service counts.
    pub sizes: Vec<usize>,
    /// Endpoints per Service.
    pub endpoints: usize,
    /// Partial syncs per measurement.
    pub changes: usize,
    /// ipvs changes applied by a full re-list each.
    pub baseline_changes: usize,
    /// Each guest's limit (boot included).
    pub guest_timeout: Duration,
    /// Skip the host's nftables measurement.
    pub skip_host: bool,
    /// This binary (run on the host and, at the same path, in the guest).
    pub bench_binary: PathBuf,
    /// kp-ipvs's `vm_run` example.
    pub runner: PathBuf,
    /// Where `bench/results/` and `BENCHMARKS.md` are written.
    pub root: PathBuf,
    /// The command line to record.
    pub command: String,
    /// Write `BENCHMARKS.md`'s section (off for the smoke test's scratch root).
    pub report: bool,
}

/// The argument list of one `bench vm-measure`.
fn measure_args(o: &VmOptions, mode: &str, place: &str, services: usize) -> Vec<String> {
    vec![
        o.bench_binary.display().to_string(),
        "vm-measure".into(),
        "--mode".into(),
        mode.into(),
        "--place".into(),
        place.into(),
        "--services".into(),
        services.to_string(),
        "--endpoints".into(),
        o.endpoints.to_string(),
        "--changes".into(),
        o.changes.to_string(),
        "--baseline-changes".into(),
        o.baseline_changes.to_string(),
    ]
}

/// `kp-vm: kernel V, boot B s, total T s, status N` from `vm_run`'s standard error.
fn guest_times(stderr: &str) -> (Option<f64>, Option<f64>) {
    let line = stderr.lines().rev().find(|l| l.starts_with("kp-vm: "));
    let field = |name: &str| {
        line.and_then(|l| l.split(", ").find_map(|f| f.strip_prefix(name)))
            .and_then(|v| v.trim_end_matches(" s").trim().parse::<f64>().ok())
    };
    (field("boot "), field("total "))
}

/// One measurement on the host or in a fresh guest; its output is echoed to standard error.
fn one(o: &VmOptions, p: &Progress, mode: &str, place: &str, n: usize) -> anyhow::Result<VmRun> {
    let args = measure_args(o, mode, place, n);
    let mut cmd = if place == GUEST {
        let mut c = Command::new(&o.runner);
        c.args(["--timeout", &o.guest_timeout.as_secs().to_string(), "--"]);
        c.args(&args);
        c
    } else {
        let mut c = Command::new(&args[0]);
        c.args(&args[1..]);
        c
    };
    p.say(format!(
        "{mode} in the {place} at {n} Services × {}",
        o.endpoints
    ));
    let t = Instant::now();
    let output = cmd
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| anyhow::anyhow!("starting {}: {e}", cmd.get_program().to_string_lossy()))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    // The guest's progress arrives with its output, at its end (kp-vm returns it whole).
    for line in stdout.lines().chain(stderr.lines()) {
        if !line.starts_with(RESULT_PREFIX) && !line.trim().is_empty() {
            eprintln!("    | {line}");
        }
    }
    if !output.status.success() {
        anyhow::bail!(
            "{mode} in the {place} at {n}: exit {} after {:.0} s",
            output.status,
            t.elapsed().as_secs_f64()
        );
    }
    let mut run = parse_result(&stdout)?;
    if place == GUEST {
        let (boot, total) = guest_times(&stderr);
        run.guest_boot_s = boot;
        run.guest_total_s = total;
    }
    Ok(run)
}

/// Writes `bench/results/ipvs-vm-<started>.json` and [`LATEST`]; returns their paths.
pub fn write_results(root: &Path, r: &VmResults) -> anyhow::Result<Vec<PathBuf>> {
    let dir = root.join(crate::report::RESULTS_DIR);
    std::fs::create_dir_all(&dir)?;
    let json = serde_json::to_string_pretty(r)?;
    let file = dir.join(format!("ipvs-vm-{}.json", r.started.replace(':', "-")));
    let latest = dir.join(LATEST);
    std::fs::write(&file, &json)?;
    std::fs::write(&latest, &json)?;
    Ok(vec![file, latest])
}

/// The whole `bench vm` run: per size, nftables on the host, then nftables and ipvs in a guest
/// each. Writes the results after each measurement, and the report's section at the end.
pub fn run(o: &VmOptions) -> anyhow::Result<VmResults> {
    let p = Progress::new();
    if !kp_test::netns::require_root() {
        anyhow::bail!("bench vm creates network namespaces (and boots qemu): run it as root");
    }
    if !o.runner.is_file() {
        anyhow::bail!(
            "no guest runner at {} (build it: cargo build --release -p kp-ipvs --example vm_run; or pass --runner)",
            o.runner.display()
        );
    }
    let mut r = VmResults {
        format: FORMAT,
        started: crate::machine::utc_now(),
        command: o.command.clone(),
        host: crate::machine::describe(),
        settings: VmSettings {
            sizes: o.sizes.clone(),
            endpoints: o.endpoints,
            changes: o.changes,
            baseline_changes: o.baseline_changes,
            guest_timeout_s: o.guest_timeout.as_secs(),
        },
        load_average: crate::run::load_average(),
        ..VmResults::default()
    };
    for &n in &o.sizes {
        let mut plan = Vec::new();
        if !o.skip_host {
            plan.push(("nftables", HOST));
        }
        plan.extend([("nftables", GUEST), ("ipvs", GUEST)]);
        for (mode, place) in plan {
            match one(o, &p, mode, place, n) {
                Ok(run) => {
                    p.say(format!(
                        "  {mode} ({place}, {n}): full sync {:.2} s, change p50 {:.1} ms p99 {:.1} ms, VmHWM {:.1} MiB{}{}",
                        run.full_sync_s,
                        run.change_ms.p50,
                        run.change_ms.p99,
                        run.peak_rss_mib,
                        run.relist_change_ms
                            .map(|s| format!(", re-list per change p50 {:.1} ms", s.p50))
                            .unwrap_or_default(),
                        run.guest_total_s
                            .map(|t| format!(", guest {t:.0} s"))
                            .unwrap_or_default()
                    ));
                    r.runs.push(run);
                }
                Err(e) => {
                    p.say(format!("  FAILED: {e:#}"));
                    r.errors.push(format!("{e:#}"));
                }
            }
            r.duration_s = p.elapsed();
            r.load_average = r.load_average.max(crate::run::load_average());
            write_results(&o.root, &r)?;
        }
    }
    for f in write_results(&o.root, &r)? {
        p.say(format!("wrote {}", f.display()));
    }
    if o.report {
        crate::report_vm::update_report(&o.root)?;
        p.say(format!(
            "wrote the IPVS section of {}",
            o.root.join(crate::report::REPORT).display()
        ));
    }
    Ok(r)
}

/// `bench vm`'s command line.
#[derive(Debug, clap::Args)]
pub struct VmArgs {
    /// Service counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1000,10000")]
    pub sizes: Vec<usize>,
    /// Endpoints per Service.
    #[arg(long, default_value_t = 10)]
    pub endpoints: usize,
    /// One-endpoint changes (partial syncs) per measurement.
    #[arg(long, default_value_t = 100)]
    pub changes: usize,
    /// ipvs changes applied the upstream way, by a full re-list and rewrite each (each costs
    /// a full sync).
    #[arg(long, default_value_t = 20)]
    pub baseline_changes: usize,
    /// Seconds each guest may take, boot included, before it is killed.
    #[arg(long, default_value_t = 1800)]
    pub guest_timeout: u64,
    /// No nftables measurement on the host (the guest's slowdown is then not stated).
    #[arg(long)]
    pub skip_host: bool,
    /// kp-ipvs's `vm_run` example [default: examples/vm_run next to this binary].
    #[arg(long)]
    pub runner: Option<PathBuf>,
    /// Where bench/results/ and BENCHMARKS.md are written [default: the repository this was
    /// built from].
    #[arg(long)]
    pub root: Option<PathBuf>,
    /// Do not write BENCHMARKS.md's section (the results files only).
    #[arg(long)]
    pub no_report: bool,
}

impl VmArgs {
    /// The options these arguments ask for. `bench` is this binary; `args` the full command
    /// line (recorded in the results).
    pub fn options(&self, bench: PathBuf, args: &[String]) -> anyhow::Result<VmOptions> {
        if self.sizes.is_empty() || self.sizes.contains(&0) {
            anyhow::bail!("--sizes needs Service counts above 0");
        }
        if self.endpoints == 0 || self.endpoints > 1000 {
            anyhow::bail!("--endpoints must be between 1 and 1000");
        }
        if self.changes == 0 {
            anyhow::bail!("--changes must be above 0");
        }
        let root = self.root.clone().unwrap_or_else(crate::cli::default_root);
        let runner = self.runner.clone().unwrap_or_else(|| {
            bench
                .parent()
                .map(|d| d.join("examples").join("vm_run"))
                .unwrap_or_else(|| PathBuf::from("vm_run"))
        });
        Ok(VmOptions {
            sizes: self.sizes.clone(),
            endpoints: self.endpoints,
            changes: self.changes,
            baseline_changes: self.baseline_changes,
            guest_timeout: Duration::from_secs(self.guest_timeout.max(60)),
            skip_host: self.skip_host,
            bench_binary: bench,
            runner,
            command: crate::cli::command_line(args, &root),
            root,
            report: !self.no_report,
        })
    }
}

/// `bench vm-measure`'s command line: one measurement in this process.
#[derive(Debug, clap::Args)]
pub struct MeasureArgs {
    /// ipvs or nftables.
    #[arg(long)]
    pub mode: String,
    /// Where this runs, as recorded: host or guest.
    #[arg(long, default_value = HOST)]
    pub place: String,
    /// Services.
    #[arg(long)]
    pub services: usize,
    /// Endpoints per Service.
    #[arg(long, default_value_t = 10)]
    pub endpoints: usize,
    /// Partial syncs timed.
    #[arg(long, default_value_t = 100)]
    pub changes: usize,
    /// ipvs changes applied by a full re-list each.
    #[arg(long, default_value_t = 0)]
    pub baseline_changes: usize,
}

impl MeasureArgs {
    /// Runs the measurement and prints its result line on standard output.
    pub fn run(&self) -> anyhow::Result<()> {
        use std::io::Write as _;
        let m = Measure {
            mode: parse_mode(&self.mode)?,
            services: self.services.max(1),
            endpoints: self.endpoints.max(1),
            changes: self.changes.max(1),
            baseline_changes: self.baseline_changes,
            place: self.place.clone(),
        };
        let run = measure(&m)?;
        let line = format!("{RESULT_PREFIX}{}\n", serde_json::to_string(&run)?);
        let mut out = std::io::stdout().lock();
        out.write_all(line.as_bytes())?;
        out.flush()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_result_line_is_found_among_the_guests_console_lines() {
        let run = VmRun {
            mode: "ipvs".into(),
            services: 7,
            ..VmRun::default()
        };
        let out = format!(
            "[    1.0 s] progress\n{RESULT_PREFIX}{}\nEXIT",
            serde_json::to_string(&run).unwrap()
        );
        assert_eq!(parse_result(&out).unwrap(), run);
        assert!(parse_result("nothing here").is_err());
    }

    #[test]
    fn the_runners_times_are_read_from_its_last_line() {
        let (boot, total) =
            guest_times("x\nkp-vm: kernel 6.1.0-56-amd64, boot 11.5 s, total 93.2 s, status 0\n");
        assert_eq!((boot, total), (Some(11.5), Some(93.2)));
        assert_eq!(guest_times("no line"), (None, None));
    }

    #[test]
    fn both_modes_load_the_binarys_flags() {
        for name in ["ipvs", "nftables"] {
            let mode = parse_mode(name).unwrap();
            assert_eq!(binary_config(mode).unwrap().mode, mode);
        }
        assert!(parse_mode("iptables").is_err());
    }
}
