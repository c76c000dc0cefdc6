//! The whole benchmark: for each size and mode, the in-process sync measurements, the data path,
//! the bare baseline and the binary runs; then the results file, the plots and the report.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kp_core::track::SourceEvent;
use kp_test::lab::Lab;
use kp_test::netns::Netns;

use crate::cluster::{self, ChangeStream, Cluster, MixOf};
use crate::datapath::{self, PerfTarget};
use crate::mode::{bare_load, KernelInput, ModeUnderTest, Rendered};
use crate::progress::Progress;
use crate::proxy::{self, Source};
use crate::results::{Bare, FullSync, KernelMemory, Results, Run, Settings, Verify, FORMAT};
use crate::stats::{median, Summary};
use crate::upstream::UpstreamBackend;
use kp_test::kube_apiserver::KubeApiServer;

/// What to run.
#[derive(Clone, Debug)]
pub struct Options {
    /// Mode names, in order.
    pub modes: Vec<String>,
    /// Service counts.
    pub sizes: Vec<usize>,
    /// Endpoints per Service.
    pub endpoints: usize,
    /// Single-endpoint changes per measurement.
    pub changes: usize,
    /// Changes per programming-latency run of the binary.
    pub latency_changes: usize,
    /// Changes in upstream's run (each costs it seconds at 10k).
    pub upstream_changes: usize,
    /// The shortest time the binary's changes are spread over, so periodic syncs fall among
    /// them; `None`: one after another.
    pub latency_span: Option<Duration>,
    /// Full syncs and bare loads per size (the median counts).
    pub repeats: usize,
    /// Skip the data path.
    pub skip_datapath: bool,
    /// Skip the binary runs (programming latency, memory).
    pub skip_proxy: bool,
    /// Skip the in-process sync measurements and the bare baseline.
    pub skip_sync: bool,
    /// The binary's sources, in order.
    pub sources: Vec<Source>,
    /// Upstream's kube-proxy as a baseline row on the real API server, on this backend.
    pub upstream: Option<UpstreamBackend>,
    /// Upstream's binary [default: unpacked from the shared directory].
    pub upstream_binary: Option<PathBuf>,
    /// Seconds of connection-rate measurement per target.
    pub connect_seconds: f64,
    /// Client threads for the connection rate.
    pub connect_threads: usize,
    /// Bytes per bulk transfer.
    pub bulk_bytes: u64,
    /// Bulk transfers per target.
    pub bulk_repeats: usize,
    /// The CPUs the data path's client and server are pinned to, if any.
    pub pinning: Option<datapath::Pinning>,
    /// What perf samples (`KP_PERF_CTL`, `KP_PERF_TARGET`), if anything.
    pub perf: Option<datapath::PerfControl>,
    /// The kube-proxy binary.
    pub proxy_binary: PathBuf,
    /// This binary (the data-path server and client run as its subcommands).
    pub bench_binary: PathBuf,
    /// The repository root: `bench/` and `BENCHMARKS.md` are written there.
    pub root: PathBuf,
    /// The command line to record.
    pub command: String,
}

/// Runs everything in `opts` and writes the results, plots and report. Returns the results.
pub fn run(opts: &Options) -> anyhow::Result<Results> {
    let p = Progress::new();
    if !kp_test::netns::require_root() {
        anyhow::bail!("the benchmark creates network namespaces: run it as root");
    }
    let modes = crate::modes::by_names(&opts.modes)?;
    for m in &modes {
        if let Some(why) = m.unavailable() {
            anyhow::bail!("mode {}: {why}", m.name());
        }
    }
    if !opts.skip_proxy && !opts.proxy_binary.is_file() {
        anyhow::bail!(
            "no kube-proxy binary at {} (build it: cargo build --release -p kube-proxy; or pass --proxy-binary, or --skip-proxy)",
            opts.proxy_binary.display()
        );
    }
    let mut results = Results {
        format: FORMAT,
        started: crate::machine::utc_now(),
        command: opts.command.clone(),
        machine: crate::machine::describe(),
        settings: Settings {
            modes: opts.modes.clone(),
            sizes: opts.sizes.clone(),
            endpoints: opts.endpoints,
            changes: opts.changes,
            repeats: opts.repeats,
            datapath: !opts.skip_datapath,
            connect_seconds: opts.connect_seconds,
            bulk_bytes: opts.bulk_bytes,
            proxy_binary: if opts.skip_proxy {
                String::new()
            } else {
                opts.proxy_binary.display().to_string()
            },
            sources: opts.sources.iter().map(|s| s.name().to_string()).collect(),
            upstream_binary: String::new(),
            load_average: load_average(),
        },
        ..Results::default()
    };
    p.say(format!(
        "kp-bench: modes {}, sizes {:?} × {} endpoints, {} changes, data path {}, on {} CPUs ({})",
        opts.modes.join(","),
        opts.sizes,
        opts.endpoints,
        opts.changes,
        if opts.skip_datapath { "skipped" } else { "on" },
        results.machine.cpus,
        results.machine.cpu_model
    ));
    let upstream_binary = match (&opts.upstream, &opts.upstream_binary) {
        (None, _) => None,
        (Some(_), Some(b)) => Some(b.clone()),
        (Some(_), None) => Some(kp_test::kube_apiserver::upstream_kube_proxy()?),
    };
    if let Some(b) = &upstream_binary {
        results.settings.upstream_binary = format!(
            "{} (kube-proxy {})",
            b.display(),
            kp_test::kube_apiserver::UPSTREAM_VERSION
        );
    }
    for &n in &opts.sizes {
        let cluster = Cluster::new(n, opts.endpoints);
        let needs_kube = !opts.skip_proxy
            && (opts.sources.contains(&Source::KubeApiServer) || opts.upstream.is_some());
        let kube = if needs_kube {
            match start_kube(&p, &cluster) {
                Ok(k) => Ok(Some(k)),
                Err(e) => Err(format!("{e:#}")),
            }
        } else {
            Ok(None)
        };
        let kube_ref = kube.as_ref().ok().and_then(Option::as_ref);
        for mode in &modes {
            p.say(format!(
                "{} at {n} Services × {}",
                mode.name(),
                opts.endpoints
            ));
            let mut run = run_one(opts, &p, mode.as_ref(), &cluster, kube_ref);
            if let Err(e) = &kube {
                run.errors.push(format!("real API server: {e}"));
            }
            for e in &run.errors {
                p.say(format!("  FAILED: {e}"));
            }
            results.runs.push(run);
            results.duration_s = p.elapsed();
            // Keep what is done on disk, in case a later size fails badly.
            crate::report::write_results(&opts.root, &results)?;
        }
        if let (Some(backend), Some(binary)) = (opts.upstream, &upstream_binary) {
            p.say(format!(
                "{} (kube-proxy {}) at {n} Services × {}",
                backend.mode_name(),
                kp_test::kube_apiserver::UPSTREAM_VERSION,
                opts.endpoints
            ));
            let mut run = Run {
                mode: backend.mode_name().into(),
                services: cluster.services,
                endpoints_per_service: cluster.per,
                mix: cluster.mix(),
                load_average: load_average(),
                ..Run::default()
            };
            match &kube {
                Ok(Some(server)) => {
                    let setup = proxy::Setup {
                        binary,
                        cluster: &cluster,
                        changes: opts.upstream_changes,
                        span: opts.latency_span,
                        progress: &p,
                        kube: Some(server),
                    };
                    match crate::upstream::run(&setup, server, binary, backend) {
                        Ok(r) => run.proxy.push(r),
                        Err(e) => run.errors.push(format!("upstream kube-proxy: {e:#}")),
                    }
                }
                Ok(None) => {}
                Err(e) => run.errors.push(format!("real API server: {e}")),
            }
            for e in &run.errors {
                p.say(format!("  FAILED: {e}"));
            }
            results.runs.push(run);
            results.duration_s = p.elapsed();
            crate::report::write_results(&opts.root, &results)?;
        }
    }
    results.duration_s = p.elapsed();
    let files = crate::report::write_all(&opts.root, &results, true)?;
    p.say(format!(
        "done in {:.0} s; wrote {}",
        results.duration_s,
        files
            .iter()
            .map(|f| f.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    ));
    Ok(results)
}

/// The 1-minute load average (`/proc/loadavg`), 0 when unreadable.
pub fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

/// A real API server holding `cluster` (before any change), loaded over HTTP.
fn start_kube(p: &Progress, cluster: &Cluster) -> anyhow::Result<KubeApiServer> {
    let t = Instant::now();
    let server = KubeApiServer::start()?;
    p.say(format!(
        "real API server {} up in {:.1} s; loading {} objects",
        server.url(),
        t.elapsed().as_secs_f64(),
        cluster.services * 2 + 2
    ));
    let loaded = server.load_cluster(cluster)?;
    p.say(format!(
        "  loaded {} objects ({} statuses) in {:.1} s",
        loaded.objects, loaded.statuses, loaded.seconds
    ));
    Ok(server)
}

/// One mode at one size. A failing phase is recorded in `errors` and the next one runs.
pub fn run_one(
    opts: &Options,
    p: &Progress,
    mode: &dyn ModeUnderTest,
    cluster: &Cluster,
    kube: Option<&KubeApiServer>,
) -> Run {
    let mut run = Run {
        mode: mode.name().into(),
        services: cluster.services,
        endpoints_per_service: cluster.per,
        mix: cluster.mix(),
        load_average: load_average(),
        ..Run::default()
    };
    let inputs = if opts.skip_sync {
        None
    } else {
        match in_process(opts, p, mode, cluster, &mut run) {
            Ok(inputs) => Some(inputs),
            Err(e) => {
                run.errors.push(format!("in-process sync: {e:#}"));
                None
            }
        }
    };
    match inputs {
        // A mode loaded by no kernel tool (ebpf: map writes) has no bare baseline.
        Some(inputs) if inputs.is_empty() => p.say(format!(
            "  no bare baseline: {} mode is loaded by no kernel tool",
            mode.name()
        )),
        Some(inputs) => {
            if let Err(e) = bare(p, &inputs, opts.repeats, &mut run) {
                run.errors.push(format!("bare load: {e:#}"));
            }
        }
        None => {}
    }
    if !opts.skip_proxy {
        let setup = proxy::Setup {
            binary: &opts.proxy_binary,
            cluster,
            changes: opts.latency_changes,
            span: opts.latency_span,
            progress: p,
            kube,
        };
        for &source in &opts.sources {
            match proxy::run(&setup, mode, source) {
                Ok(r) => run.proxy.push(r),
                Err(e) => run
                    .errors
                    .push(format!("kube-proxy with {} source: {e:#}", source.name())),
            }
        }
    }
    run
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Full sync, changes and (unless skipped) the data path, in a lab whose node is programmed by
/// the mode's dataplane in this process. Returns the full sync's kernel inputs, as rendered.
fn in_process(
    opts: &Options,
    p: &Progress,
    mode: &dyn ModeUnderTest,
    cluster: &Cluster,
    run: &mut Run,
) -> anyhow::Result<Vec<KernelInput>> {
    let t = Instant::now();
    let mut state = cluster::load_state(cluster.manifests())?;
    p.say(format!(
        "  generated {} Services ({} ports, {} endpoints) in {:.1} s",
        run.mix.services,
        run.mix.service_ports,
        run.mix.endpoints,
        t.elapsed().as_secs_f64()
    ));
    let mut renders: Vec<Rendered> = Vec::new();
    let mut inputs = Vec::new();
    for _ in 0..opts.repeats.max(1) {
        let (r, i) = mode.render_full(&state);
        renders.push(r);
        inputs = i;
    }
    // Pods only when the data path runs; the node alone otherwise.
    let lab = if opts.skip_datapath {
        None
    } else {
        Some(Lab::new(2)?)
    };
    let plain;
    let node: &Netns = match &lab {
        Some(l) => l.node(),
        None => {
            plain = Netns::new("bench-node")?;
            &plain
        }
    };
    // The data path's server starts, and the pod's direct connections are measured, before any
    // rule of ours exists: the physical limit.
    let datapath_lab = lab.as_ref().map(|l| DatapathLab::start(opts, cluster, l));
    let mut unloaded = None;
    match &datapath_lab {
        Some(Ok(dl)) => match dl.unloaded(opts, p) {
            Ok(c) => unloaded = Some(c),
            Err(e) => run.errors.push(format!("data path without rules: {e:#}")),
        },
        Some(Err(e)) => run.errors.push(format!("data path server: {e:#}")),
        None => {}
    }
    let mut dp = mode.dataplane(node.name());
    let sampled = |target| opts.perf.as_ref().and_then(|p| p.switch_for(target));
    let full_switch = sampled(PerfTarget::FullSync);
    if let Some(s) = full_switch {
        s.set(true)?;
    }
    let t = Instant::now();
    let report = dp.sync(&state, &Default::default(), true);
    let mut totals = vec![t.elapsed().as_secs_f64()];
    if let Some(s) = full_switch {
        s.set(false)?;
    }
    let report = report?;
    // More first full syncs, each into a fresh namespace with a fresh dataplane.
    for _ in 1..opts.repeats.max(1) {
        let ns = Netns::new("bench-full")?;
        let mut fresh = mode.dataplane(ns.name());
        let t = Instant::now();
        fresh.sync(&state, &Default::default(), true)?;
        totals.push(t.elapsed().as_secs_f64());
    }
    let render = Rendered {
        seconds: median(&renders.iter().map(|r| r.seconds).collect::<Vec<_>>()),
        ..renders[0]
    };
    let total = median(&totals);
    let full = FullSync {
        render,
        total_s: total,
        apply_s: (total - render.seconds).max(0.0),
        samples_s: totals,
        operations: report.operations,
        input_bytes: inputs.iter().map(|i| i.text.len()).sum(),
    };
    p.say(format!(
        "  full sync {:.3} s (render {:.3} s, apply {:.3} s; median of {}), {} operations, {:.1} MB",
        full.total_s,
        full.render.seconds,
        full.apply_s,
        full.samples_s.len(),
        full.operations,
        full.input_bytes as f64 / 1e6
    ));
    run.full_sync = Some(full);

    let mut stream = ChangeStream::new(cluster);
    let mut times = Vec::with_capacity(opts.changes);
    let mut reported = Instant::now();
    // Only the partial syncs are sampled, not building each change.
    let change_switch = sampled(PerfTarget::Changes);
    for done in 0..opts.changes {
        p.every(&mut reported, || {
            format!("  one-endpoint changes: {done} of {} done", opts.changes)
        });
        let change = stream.next_change();
        let object = cluster::to_object(&change.slice)?;
        state
            .apply(SourceEvent::Upsert(object))
            .map_err(|e| anyhow::anyhow!("change {}: {e}", change.k))?;
        let changes = state.take_changes();
        if let Some(s) = change_switch {
            s.set(true)?;
        }
        let t = Instant::now();
        let synced = dp.sync(&state, &changes, false);
        times.push(ms(t.elapsed()));
        if let Some(s) = change_switch {
            s.set(false)?;
        }
        synced?;
    }
    let inc = Summary::of(&times);
    p.say(format!(
        "  one-endpoint change: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms over {}",
        inc.p50, inc.p99, inc.max, inc.n
    ));
    run.incremental_ms = Some(inc);
    match dp.kernel_memory() {
        Ok(Some(objects)) => {
            let memory = KernelMemory::of(objects);
            p.say(format!(
                "  kernel memory of the dataplane's objects: {:.1} MiB",
                memory.total_mib
            ));
            run.kernel_memory = Some(memory);
        }
        Ok(None) => {}
        Err(e) => run.errors.push(format!("kernel memory: {e:#}")),
    }
    let t = Instant::now();
    let diffs = dp.verify()?;
    run.verify = Some(Verify {
        seconds: t.elapsed().as_secs_f64(),
        differences: diffs.len(),
    });
    p.say(format!(
        "  read-back check {:.3} s, {} differences",
        t.elapsed().as_secs_f64(),
        diffs.len()
    ));
    for d in diffs.iter().take(5) {
        p.say(format!("    {d}"));
    }
    if !diffs.is_empty() {
        run.errors.push(format!(
            "the kernel differs from the plan after the changes ({} differences)",
            diffs.len()
        ));
    }

    if let Some(Ok(dl)) = &datapath_lab {
        match dl.install(cluster, &mut state, dp.as_mut()) {
            Err(e) => run.errors.push(format!("data path: {e:#}")),
            Ok(()) => {
                // Held connections first, before the connect runs have grown this process's
                // heap, so that the growth measured is theirs.
                if mode.relays_in_process() {
                    match dl.held(p, HELD_CONNECTIONS) {
                        Ok(h) => run.held = Some(h),
                        Err(e) => run.errors.push(format!("connections held open: {e:#}")),
                    }
                }
                match dl.loaded(opts, p, cluster, unloaded, dp.client_cgroup()) {
                    Ok(d) => run.datapath = Some(d),
                    Err(e) => run.errors.push(format!("data path: {e:#}")),
                }
            }
        }
    }
    Ok(inputs)
}

/// Connections held open at once to measure an in-process proxy's memory per connection: below
/// the data-path server's 4096 kept connections, and three descriptors each (client, proxy's
/// two) within a container's usual hard limit.
const HELD_CONNECTIONS: usize = 2000;

/// The data-path server in pod 0 of a lab, and where the client in pod 1 connects.
struct DatapathLab<'a> {
    lab: &'a Lab,
    plan: datapath::Plan,
    server_ip: Ipv4Addr,
    _server: kp_test::netns::ChildGuard,
}

impl<'a> DatapathLab<'a> {
    /// Starts the server and waits until it listens.
    fn start(opts: &Options, cluster: &Cluster, lab: &'a Lab) -> anyhow::Result<Self> {
        let server_ip = match lab.pod_ip(0) {
            std::net::IpAddr::V4(ip) => ip,
            std::net::IpAddr::V6(_) => anyhow::bail!("the lab's pod 0 has no IPv4 address"),
        };
        let bench = opts.bench_binary.display().to_string();
        let connect = SocketAddr::V4(SocketAddrV4::new(
            server_ip,
            cluster::DATAPATH_CONNECT_TARGET,
        ));
        let bulk = SocketAddr::V4(SocketAddrV4::new(server_ip, cluster::DATAPATH_BULK_TARGET));
        let pin = opts
            .pinning
            .map(|p| datapath::Pinning::taskset(p.server))
            .into_iter()
            .flatten();
        let mut argv: Vec<String> = pin.collect();
        argv.extend([
            bench,
            "datapath-server".into(),
            "--connect".into(),
            connect.to_string(),
            "--bulk".into(),
            bulk.to_string(),
        ]);
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        let mut server = lab.pod(0).spawn(&argv)?;
        server.wait_for_log(datapath::READY, Duration::from_secs(10))?;
        let vip = cluster.datapath_ip();
        Ok(DatapathLab {
            lab,
            plan: datapath::Plan {
                vip_connect: SocketAddr::V4(SocketAddrV4::new(vip, cluster::DATAPATH_CONNECT_PORT)),
                vip_bulk: SocketAddr::V4(SocketAddrV4::new(vip, cluster::DATAPATH_BULK_PORT)),
                direct_connect: connect,
                direct_bulk: bulk,
                connect_seconds: opts.connect_seconds,
                threads: opts.connect_threads,
                bulk_bytes: opts.bulk_bytes,
                bulk_repeats: opts.bulk_repeats,
                perf: opts.perf.clone(),
                cgroup: None,
                pinning: opts.pinning,
            },
            server_ip,
            _server: server,
        })
    }

    /// New connections straight to the pod while the node holds no rule of ours.
    fn unloaded(&self, opts: &Options, p: &Progress) -> anyhow::Result<crate::results::Connect> {
        let c = datapath::measure_unloaded(
            self.lab.pod(1),
            self.lab.node(),
            &opts.bench_binary,
            &self.plan,
        )?;
        p.say(format!(
            "  data path before any rule: {:.0} connections/s to the pod, p50 {:.0} µs, p99 {:.0} µs",
            c.per_second, c.latency_us.p50, c.latency_us.p99
        ));
        Ok(c)
    }

    /// Opens `n` connections from pod 1 through the ClusterIP and holds them while this
    /// process's resident memory is read: the cost per connection of a proxy relaying in this
    /// process.
    fn held(&self, p: &Progress, n: usize) -> anyhow::Result<crate::results::Held> {
        let (_, before) = proxy::memory_mib(std::process::id())?;
        let to = self.plan.vip_connect;
        let streams = kp_netlink::netns::run_in(
            self.lab.pod(1).name(),
            "kp-bench-hold",
            move || -> anyhow::Result<Vec<std::net::TcpStream>> {
                (0..n)
                    .map(|i| {
                        // Each has its first bytes echoed by the pod, as the connect runs'
                        // connections: the server accepts it, and the relay is up.
                        std::net::TcpStream::connect_timeout(&to, Duration::from_secs(2))
                            .and_then(datapath::first_answer)
                            .map_err(|e| anyhow::anyhow!("connection {i} to {to}: {e}"))
                    })
                    .collect()
            },
        )??;
        // The proxy connects to the endpoint after accepting: wait until the server holds
        // every relayed connection.
        let port = format!("( sport = :{} )", cluster::DATAPATH_CONNECT_TARGET);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let listing = self
                .lab
                .pod(0)
                .run(&["ss", "-Htn", "state", "established", &port])?;
            let relayed = listing.lines().filter(|l| !l.trim().is_empty()).count();
            if relayed >= n {
                break;
            }
            if std::time::Instant::now() > deadline {
                anyhow::bail!("{relayed} of {n} held connections reached the server");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let (_, after) = proxy::memory_mib(std::process::id())?;
        drop(streams);
        let h = crate::results::Held {
            connections: n,
            rss_before_mib: before,
            rss_after_mib: after,
            kib_per_connection: (after - before).max(0.0) * 1024.0 / n as f64,
        };
        p.say(format!(
            "  {n} connections held open through the ClusterIP: RSS {before:.1} → {after:.1} MiB, {:.1} KiB each",
            h.kib_per_connection
        ));
        Ok(h)
    }

    /// Adds the data-path Service (its endpoint is the server) and syncs.
    fn install(
        &self,
        cluster: &Cluster,
        state: &mut kp_core::track::ProxyState,
        dp: &mut dyn crate::mode::SyncTarget,
    ) -> anyhow::Result<()> {
        for m in cluster.datapath_json(self.server_ip) {
            state
                .apply(SourceEvent::Upsert(cluster::to_object(&m)?))
                .map_err(|e| anyhow::anyhow!("data-path object: {e}"))?;
        }
        let changes = state.take_changes();
        dp.sync(state, &changes, false)?;
        Ok(())
    }

    /// Measures the data path through the installed Service ([`DatapathLab::install`]).
    fn loaded(
        &self,
        opts: &Options,
        p: &Progress,
        cluster: &Cluster,
        unloaded: Option<crate::results::Connect>,
        cgroup: Option<PathBuf>,
    ) -> anyhow::Result<crate::results::Datapath> {
        let plan = datapath::Plan {
            cgroup,
            ..self.plan.clone()
        };
        p.say(format!(
            "  data path: {:.0} s of new connections and {} × {} MB each way, pod → {} vs pod → {}",
            opts.connect_seconds * 2.0,
            opts.bulk_repeats,
            opts.bulk_bytes / 1_000_000,
            cluster.datapath_ip(),
            self.server_ip
        ));
        let mut d = datapath::measure(self.lab.pod(1), self.lab.node(), &opts.bench_binary, &plan)?;
        if let Some(u) = unloaded {
            d.set_unloaded(u);
        }
        p.say(format!(
            "  connect via ClusterIP: {:.0}/s, p50 {:.0} µs, p99 {:.0} µs; direct: {:.0}/s, p50 {:.0} µs, p99 {:.0} µs (p99 ratio {:.2})",
            d.vip.per_second,
            d.vip.latency_us.p50,
            d.vip.latency_us.p99,
            d.direct.per_second,
            d.direct.latency_us.p50,
            d.direct.latency_us.p99,
            d.latency_ratio_p99
        ));
        p.say(format!(
            "  bulk via ClusterIP {:.2} Gbit/s, direct {:.2} Gbit/s (ratio {:.2})",
            d.bulk_vip_gbps, d.bulk_direct_gbps, d.bulk_ratio
        ));
        if d.vip.latency_us.n == 0 || d.direct.latency_us.n == 0 {
            anyhow::bail!(
                "no connection succeeded (ClusterIP errors {}, direct errors {})",
                d.vip.errors,
                d.direct.errors
            );
        }
        Ok(d)
    }
}

/// The bare kernel load of `input`, each repeat in a fresh namespace.
fn bare(p: &Progress, inputs: &[KernelInput], repeats: usize, run: &mut Run) -> anyhow::Result<()> {
    let mut samples = Vec::new();
    for _ in 0..repeats.max(1) {
        let ns = Netns::new("bench-bare")?;
        samples.push(bare_load(ns.name(), inputs)?.as_secs_f64());
    }
    let took = median(&samples);
    let full = run.full_sync.as_ref();
    let total = full.map_or(0.0, |f| f.total_s);
    let apply = full.map_or(0.0, |f| f.apply_s);
    let b = Bare {
        tool: inputs
            .first()
            .map(|i| i.command.join(" "))
            .unwrap_or_default(),
        seconds: took,
        samples_s: samples,
        overhead: if took > 0.0 { total / took } else { 0.0 },
        apply_overhead: if took > 0.0 { apply / took } else { 0.0 },
    };
    p.say(format!(
        "  bare `{}` of the same input: {:.3} s (median of {}); our full sync is {:.2}× that (apply alone {:.2}×)",
        b.tool,
        b.seconds,
        b.samples_s.len(),
        b.overhead,
        b.apply_overhead
    ));
    run.bare = Some(b);
    Ok(())
}
