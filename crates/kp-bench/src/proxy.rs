//! The real `kube-proxy` binary in a network namespace, fed through each of its sources: the
//! standalone manifest directory, a fake Kubernetes API server, and a real one (etcd +
//! kube-apiserver v1.28.7 on loopback, bridged into the namespace; [`kp_test::kube_apiserver`]). Measures how long it takes
//! to program the whole cluster, the network programming latency of single-endpoint changes
//! (from the change at the source to the new endpoint read back from the kernel), and its peak
//! memory.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kp_core::track::Kind;
use kp_test::apiserver::FakeApiServer;
use kp_test::kube_apiserver::{Bridge, KubeApiServer};
use kp_test::netns::{ChildGuard, Netns};
use serde_json::{json, Value};

use crate::cluster::{self, Change, ChangeStream, Cluster, CLUSTER_CIDR, NODE_NAME};
use crate::mode::{wait_live, ModeUnderTest, Probe, ProbeTarget};
use crate::progress::Progress;
use crate::results::ProxyRun;
use crate::stats::Summary;

/// Pause between two changes, so one change's sync never overlaps the next change.
const GAP: Duration = Duration::from_millis(20);

/// A source the binary can read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// `--manifests DIR` of JSON files (one `List` per file).
    Manifests,
    /// `--manifests DIR` of YAML files, one document per object as people write them
    /// (`apiVersion` and `kind` first), separated by `---`: the embedded default's usual input.
    ManifestsYaml,
    /// `--master URL` of a fake API server in the node namespace.
    ApiServer,
    /// `--kubeconfig` (user `system:kube-proxy`) of a real API server on loopback, bridged into
    /// the node namespace; one per size, loaded once and shared by every mode and upstream's
    /// baseline.
    KubeApiServer,
}

impl Source {
    /// All, in report order.
    pub const ALL: [Source; 4] = [
        Source::Manifests,
        Source::ManifestsYaml,
        Source::ApiServer,
        Source::KubeApiServer,
    ];

    /// What runs when no `--sources` is given: all but the YAML directory, which differs
    /// from the JSON one only in its parsing (asked for by name).
    pub const DEFAULT: [Source; 3] = [Source::Manifests, Source::ApiServer, Source::KubeApiServer];

    /// The name in results and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Source::Manifests => "manifests",
            Source::ManifestsYaml => "manifests-yaml",
            Source::ApiServer => "apiserver",
            Source::KubeApiServer => "kube-apiserver",
        }
    }

    /// The source called `name`.
    pub fn parse(name: &str) -> anyhow::Result<Source> {
        Source::ALL
            .into_iter()
            .find(|s| s.name() == name)
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "unknown source {name:?}: manifests, manifests-yaml, apiserver or kube-apiserver"
                )
            })
    }
}

/// How one binary run is done.
pub struct Setup<'a> {
    /// The binary.
    pub binary: &'a Path,
    /// The cluster.
    pub cluster: &'a Cluster,
    /// Changes to time.
    pub changes: usize,
    /// The shortest time the changes are spread over (`--latency-span`).
    pub span: Option<Duration>,
    /// Progress lines.
    pub progress: &'a Progress,
    /// The real API server holding `cluster`, for the `kube-apiserver` source.
    pub kube: Option<&'a KubeApiServer>,
}

/// Where the changes go.
enum Feed<'a> {
    Dir {
        dir: PathBuf,
        format: Format,
    },
    Server(FakeApiServer),
    Real {
        server: &'a KubeApiServer,
        _bridge: Bridge,
    },
}

impl Drop for Feed<'_> {
    fn drop(&mut self) {
        if let Feed::Dir { dir, .. } = self {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// How a manifest directory's files are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// One JSON `List` per file.
    Json,
    /// One YAML document per object.
    Yaml,
}

impl Format {
    /// The format called `name` (`json` or `yaml`).
    pub fn parse(name: &str) -> anyhow::Result<Format> {
        match name {
            "json" => Ok(Format::Json),
            "yaml" => Ok(Format::Yaml),
            _ => anyhow::bail!("unknown manifest format {name:?}: json or yaml"),
        }
    }

    /// Services per file: a thousand in a JSON `List` (a machine's output); a hundred in YAML,
    /// as people split manifests, so an edit re-reads a file of about 110 kB.
    pub fn services_per_file(self) -> usize {
        match self {
            Format::Json => 1000,
            Format::Yaml => 100,
        }
    }

    fn extension(self) -> &'static str {
        match self {
            Format::Json => "json",
            Format::Yaml => "yaml",
        }
    }

    /// `objects` as one file's text.
    fn file(self, objects: &[Value]) -> anyhow::Result<String> {
        match self {
            Format::Json => {
                Ok(json!({"apiVersion": "v1", "kind": "List", "items": objects}).to_string())
            }
            Format::Yaml => {
                let mut text = String::new();
                for object in objects {
                    text.push_str("---\n");
                    text.push_str(&serde_saphyr::to_string(&KindFirst(object))?);
                }
                Ok(text)
            }
        }
    }
}

/// A JSON object serialized with `apiVersion` and `kind` first, as `kubectl` and people write
/// manifests (and as the manifest source reads them in one pass); the rest in key order.
struct KindFirst<'a>(&'a Value);

impl serde::Serialize for KindFirst<'_> {
    fn serialize<S: serde::Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let Value::Object(map) = self.0 else {
            return self.0.serialize(ser);
        };
        let mut out = ser.serialize_map(Some(map.len()))?;
        const FIRST: [&str; 2] = ["apiVersion", "kind"];
        for key in FIRST {
            if let Some(v) = map.get(key) {
                out.serialize_entry(key, v)?;
            }
        }
        for (k, v) in map.iter().filter(|(k, _)| !FIRST.contains(&k.as_str())) {
            out.serialize_entry(k, v)?;
        }
        out.end()
    }
}

fn chunk_text(
    cluster: &Cluster,
    c: usize,
    format: Format,
    endpoints: &dyn Fn(usize) -> Vec<std::net::Ipv4Addr>,
) -> anyhow::Result<String> {
    let from = c * format.services_per_file();
    let to = (from + format.services_per_file()).min(cluster.services);
    let items: Vec<Value> = (from..to)
        .flat_map(|i| {
            [
                cluster.service_json(i),
                cluster.slice_json(i, &endpoints(i)),
            ]
        })
        .collect();
    format.file(&items)
}

fn chunk_path(dir: &Path, c: usize, format: Format) -> PathBuf {
    dir.join(format!("services-{c:04}.{}", format.extension()))
}

/// Writes `text` to `path` atomically (a hidden temporary file renamed over it); returns the
/// instant of the rename, when the change becomes visible.
fn publish(path: &Path, text: &str) -> anyhow::Result<Instant> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    std::fs::write(&tmp, text)?;
    let t0 = Instant::now();
    std::fs::rename(&tmp, path)?;
    Ok(t0)
}

/// Writes `cluster`, before any change, as the manifest directory `dir` (created) in
/// `format`: the Node, then the Services and their slices,
/// [`Format::services_per_file`] Services per file.
pub fn write_manifests(dir: &Path, cluster: &Cluster, format: Format) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(
        dir.join(format!("node.{}", format.extension())),
        format.file(&[Cluster::node_json()])?,
    )?;
    for c in 0..cluster.services.div_ceil(format.services_per_file()) {
        std::fs::write(
            chunk_path(dir, c, format),
            chunk_text(cluster, c, format, &|i| cluster.initial_endpoints(i))?,
        )?;
    }
    Ok(())
}

/// Replaces `manifest` on the real `server`; returns when the write was sent and when it was
/// answered (etcd had stored it).
pub(crate) fn replace_timed(
    server: &KubeApiServer,
    manifest: &Value,
) -> anyhow::Result<(Instant, Instant)> {
    let t0 = Instant::now();
    server.replace(manifest)?;
    Ok((t0, Instant::now()))
}

/// Puts back the generated EndpointSlices of the Services the first `changes` changes of a
/// [`ChangeStream`] touched, so the next run on `server` starts from the same objects.
pub fn restore(server: &KubeApiServer, cluster: &Cluster, changes: usize) -> anyhow::Result<()> {
    let mut touched: Vec<usize> = (0..changes)
        .map(|k| (k * 7919) % cluster.services.max(1))
        .collect();
    touched.sort_unstable();
    touched.dedup();
    for i in touched {
        server.replace(&cluster.slice_json(i, &cluster.initial_endpoints(i)))?;
    }
    Ok(())
}

impl<'a> Feed<'a> {
    fn new(
        source: Source,
        ns: &Netns,
        cluster: &Cluster,
        kube: Option<&'a KubeApiServer>,
    ) -> anyhow::Result<Feed<'a>> {
        match source {
            Source::Manifests | Source::ManifestsYaml => {
                let format = if source == Source::ManifestsYaml {
                    Format::Yaml
                } else {
                    Format::Json
                };
                let dir = std::env::temp_dir().join(format!(
                    "kp-bench-manifests-{}-{}",
                    std::process::id(),
                    ns.name()
                ));
                write_manifests(&dir, cluster, format)?;
                Ok(Feed::Dir { dir, format })
            }
            Source::ApiServer => {
                let server = FakeApiServer::start_in(ns)?;
                for m in cluster.manifests() {
                    let kind = match m["kind"].as_str() {
                        Some("Service") => Kind::Service,
                        Some("EndpointSlice") => Kind::EndpointSlice,
                        _ => Kind::Node,
                    };
                    server.upsert(kind, m)?;
                }
                Ok(Feed::Server(server))
            }
            Source::KubeApiServer => {
                let server = kube.ok_or_else(|| anyhow::anyhow!("no real API server started"))?;
                Ok(Feed::Real {
                    server,
                    _bridge: server.bridge_into(ns)?,
                })
            }
        }
    }

    fn source_args(&self) -> Vec<String> {
        match self {
            Feed::Dir { dir, .. } => vec!["--manifests".into(), dir.display().to_string()],
            Feed::Server(s) => vec!["--master".into(), s.url().to_string()],
            Feed::Real { server, .. } => vec![
                "--kubeconfig".into(),
                server.kube_proxy_kubeconfig().display().to_string(),
            ],
        }
    }

    /// Publishes `change`; returns when it was handed to the source (a file renamed into place,
    /// a write sent to the API server) and when the source had it (the write answered).
    fn publish(
        &self,
        cluster: &Cluster,
        stream: &ChangeStream<'_>,
        change: &Change,
    ) -> anyhow::Result<(Instant, Instant)> {
        match self {
            Feed::Dir { dir, format } => {
                let c = change.service / format.services_per_file();
                let text = chunk_text(cluster, c, *format, &|i| stream.endpoints(i))?;
                let t0 = publish(&chunk_path(dir, c, *format), &text)?;
                Ok((t0, t0))
            }
            Feed::Server(s) => {
                let t0 = Instant::now();
                s.upsert(Kind::EndpointSlice, change.slice.clone())?;
                Ok((t0, Instant::now()))
            }
            Feed::Real { server, .. } => replace_timed(server, &change.slice),
        }
    }
}

/// `VmHWM` and `VmRSS` of `pid`, MiB.
pub fn memory_mib(pid: u32) -> anyhow::Result<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|kb| kb.parse::<f64>().ok())
            .map(|kb| kb / 1024.0)
            .ok_or_else(|| anyhow::anyhow!("no {name} in /proc/{pid}/status"))
    };
    Ok((field("VmHWM:")?, field("VmRSS:")?))
}

fn spawn(
    ns: &Netns,
    setup: &Setup<'_>,
    mode: &dyn ModeUnderTest,
    feed: &Feed<'_>,
) -> anyhow::Result<ChildGuard> {
    spawn_binary(ns, setup.binary, mode, &feed.source_args())
}

/// Starts `binary` in `ns` in `mode`, as every run of the binary starts it: this node's name and
/// cluster CIDR, no minimum sync period, health and metrics on loopback (127.0.0.1:10256 and
/// :10249 inside `ns`), and `source_args` (`--master URL` or `--manifests DIR`).
pub(crate) fn spawn_binary(
    ns: &Netns,
    binary: &Path,
    mode: &dyn ModeUnderTest,
    source_args: &[String],
) -> anyhow::Result<ChildGuard> {
    let binary = binary.display().to_string();
    let mut args: Vec<String> = vec![
        // Nothing but the flags finds a cluster: no kubeconfig, no in-cluster environment.
        "env".into(),
        "-u".into(),
        "KUBECONFIG".into(),
        "-u".into(),
        "KUBERNETES_SERVICE_HOST".into(),
        "-u".into(),
        "KUBERNETES_SERVICE_PORT".into(),
        "HOME=/nonexistent".into(),
        binary,
    ];
    args.extend(binary_flags(mode));
    args.extend(source_args.iter().cloned());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Ok(ns.spawn(&args)?)
}

/// The flags every run of the binary gets in `mode`, before its source's: the mode's own
/// ([`ModeUnderTest::proxy_args`]), this node's name and cluster CIDR, no minimum sync period,
/// health and metrics on loopback.
pub fn binary_flags(mode: &dyn ModeUnderTest) -> Vec<String> {
    let mut args = mode.proxy_args();
    args.extend([
        format!("--hostname-override={NODE_NAME}"),
        format!("--cluster-cidr={CLUSTER_CIDR}"),
        // Every change syncs at once: the latency measured is the proxy's, not a rate limit's.
        "--iptables-min-sync-period=0".into(),
        "--healthz-bind-address=127.0.0.1:10256".into(),
        format!("--metrics-bind-address={METRICS_ADDR}"),
    ]);
    args
}

/// The configuration the binary resolves from [`binary_flags`] (there is no config file), with
/// the binary's own loading code. The adapters derive their mode's settings from it through the
/// registry's functions, so they plan as the binary plans.
pub fn binary_config(mode: &dyn ModeUnderTest) -> anyhow::Result<kp_proxy::config::Config> {
    let args = std::iter::once("kube-proxy".to_string()).chain(binary_flags(mode));
    let loaded = kp_proxy::config::load_with(args, |path| {
        Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!(
                "the bench gives the binary no config file ({})",
                path.display()
            ),
        ))
    })
    .map_err(|e| anyhow::anyhow!("{}: the binary's flags do not load: {e}", mode.name()))?;
    Ok(loaded.config)
}

/// Where the binary serves its metrics, inside its namespace.
pub const METRICS_ADDR: &str = "127.0.0.1:10249";

/// The probe target for `endpoint` of Service `service`'s first port.
pub(crate) fn target(
    cluster: &Cluster,
    service: usize,
    endpoint: std::net::Ipv4Addr,
) -> ProbeTarget {
    ProbeTarget {
        namespace: cluster::NAMESPACE.into(),
        service: Cluster::service_name(service),
        port_name: cluster::SERVICE_PORT_NAME.into(),
        vip: cluster::cluster_ip(service),
        port: cluster::SERVICE_PORT,
        endpoint,
        target_port: cluster::TARGET_PORT,
        endpoints: cluster.per,
    }
}

/// What the binary logs when a full sync has programmed the whole cluster.
const PROGRAMMED: &str = "programmed the kernel";

/// Waits until the proxy's log holds `line`; returns when it was first seen.
fn wait_logged(proxy: &ChildGuard, line: &str, deadline: Instant) -> anyhow::Result<Instant> {
    loop {
        if proxy.log().contains(line) {
            return Ok(Instant::now());
        }
        if Instant::now() >= deadline {
            anyhow::bail!("kube-proxy did not log {line:?} in time");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until the binary started at `spawned` has programmed the whole cluster: the last
/// Service's first endpoint is live in the kernel and the binary logged the end of its first
/// full sync. Returns when both held.
pub(crate) fn wait_first_sync(
    proxy: &mut ChildGuard,
    probe: &mut dyn Probe,
    cluster: &Cluster,
    spawned: Instant,
) -> anyhow::Result<Instant> {
    let last = cluster.services - 1;
    let startup_timeout = Duration::from_secs(60 + cluster.services as u64 / 100);
    let live = wait_live(
        probe,
        &target(cluster, last, cluster::endpoint_ip(last, 0, cluster.per)),
        Duration::from_millis(10),
        startup_timeout,
    );
    let live = match live {
        Ok(t) => t,
        Err(e) => {
            let exited = proxy.try_wait().ok().flatten();
            anyhow::bail!(
                "{e}; kube-proxy {}; its log ends with:\n{}",
                exited.map_or("still runs".to_string(), |s| format!("exited ({s})")),
                tail(&proxy.log(), 15)
            );
        }
    };
    // The last Service being live is not the whole cluster when the mode loads it in steps
    // (iptables-nft: chains in sorted-name order); the binary logs the end of its first full
    // sync.
    let live = wait_logged(proxy, PROGRAMMED, spawned + startup_timeout)
        .map_err(|e| anyhow::anyhow!("{e}; its log ends with:\n{}", tail(&proxy.log(), 15)))?
        .max(live);
    Ok(live)
}

/// Runs the binary in `mode` against `source` in a fresh namespace.
pub fn run(
    setup: &Setup<'_>,
    mode: &dyn ModeUnderTest,
    source: Source,
) -> anyhow::Result<ProxyRun> {
    let cluster = setup.cluster;
    let p = setup.progress;
    let ns = Netns::new("bench-proxy")?;
    p.say(format!(
        "  {} source: writing {} objects",
        source.name(),
        cluster.services * 2 + 1
    ));
    let feed = Feed::new(source, &ns, cluster, setup.kube)?;
    for cmd in mode.proxy_setup() {
        let args: Vec<&str> = cmd.iter().map(String::as_str).collect();
        ns.run(&args)?;
    }
    // Dropped after the binary (declared before it).
    let _scratch = mode.binary_scratch()?;
    let mut probe: Box<dyn Probe> = mode.probe(ns.name())?;
    let spawned = Instant::now();
    let mut proxy = spawn(&ns, setup, mode, &feed)?;
    let live = wait_first_sync(&mut proxy, probe.as_mut(), cluster, spawned)?;
    let startup_s = live.duration_since(spawned).as_secs_f64();
    p.say(format!(
        "  {} source: cluster live {startup_s:.2} s after start",
        source.name()
    ));

    let mut latencies = Vec::with_capacity(setup.changes);
    let mut taken = Vec::with_capacity(setup.changes);
    // A mode whose endpoints live in the proxy process has no kernel state to time a change by.
    let changes = if mode.probe_sees_endpoints() {
        setup.changes
    } else {
        p.say(format!(
            "  {} source: no programming latency in {} mode (endpoints live in the proxy, not the kernel)",
            source.name(),
            mode.name()
        ));
        0
    };
    let changes_started = Instant::now();
    let result = time_changes(
        setup,
        &format!("{} source", source.name()),
        probe.as_mut(),
        &proxy,
        changes,
        Duration::from_secs(30),
        &mut |stream, change| feed.publish(cluster, stream, change),
        &mut latencies,
        &mut taken,
    );
    let changes_s = changes_started.elapsed().as_secs_f64();
    if let Feed::Real { server, .. } = &feed {
        // The next run on this server starts from the generated cluster again.
        restore(server, cluster, latencies.len() + 1)?;
    }
    result?;
    let metrics = crate::churn::scrape(ns.name())
        .map(|t| crate::upstream::proxy_metrics(&t))
        .unwrap_or_default();
    let (peak_rss_mib, rss_mib) = memory_mib(proxy.id())?;
    if let Ok(Some(status)) = proxy.try_wait() {
        anyhow::bail!("kube-proxy exited during the run ({status})");
    }
    let _ = proxy.terminate(Duration::from_secs(5));
    let latency_ms = Summary::of(&latencies);
    p.say(format!(
        "  {} source: programming latency p50 {:.1} ms, p99 {:.1} ms over {} changes ({} periodic syncs among them); peak RSS {:.1} MiB",
        source.name(),
        latency_ms.p50,
        latency_ms.p99,
        latency_ms.n,
        periodic_syncs(&metrics).map_or("?".to_string(), |n| n.to_string()),
        peak_rss_mib
    ));
    drop(feed);
    Ok(ProxyRun {
        source: source.name().into(),
        startup_s,
        latency_ms,
        source_ms: Summary::of(&taken),
        after_source_ms: crate::results::after_source(&latencies, &taken),
        changes_s,
        peak_rss_mib,
        rss_mib,
        metrics,
    })
}

/// The full syncs after the first (periodic ones, and drift checks that found nothing) in a
/// run's metrics: `kubeproxy_sync_full_proxy_rules_duration_seconds` counts the first sync and
/// every periodic one.
pub fn periodic_syncs(metrics: &std::collections::BTreeMap<String, f64>) -> Option<u64> {
    metrics
        .get("kubeproxy_sync_full_proxy_rules_duration_seconds_count")
        .map(|n| (*n as u64).saturating_sub(1))
}

/// Publishes `changes` changes of a fresh [`ChangeStream`] one at a time through `publish`
/// (which returns when the change was handed to the source and when the source had taken it:
/// the API server answered its write), and times each until `probe` reads it back from the
/// kernel (giving up after `timeout`): the latencies go to `latencies`, the source's own share
/// (handed to taken) to `taken`. With `setup.span`, the changes are spread evenly over it.
/// `label` names the run in progress lines.
#[allow(clippy::too_many_arguments)]
pub(crate) fn time_changes(
    setup: &Setup<'_>,
    label: &str,
    probe: &mut dyn Probe,
    proxy: &ChildGuard,
    changes: usize,
    timeout: Duration,
    publish: &mut dyn FnMut(&ChangeStream<'_>, &Change) -> anyhow::Result<(Instant, Instant)>,
    latencies: &mut Vec<f64>,
    taken: &mut Vec<f64>,
) -> anyhow::Result<()> {
    let (cluster, p) = (setup.cluster, setup.progress);
    let mut stream = ChangeStream::new(cluster);
    let mut reported = Instant::now();
    let started = Instant::now();
    for n in 0..changes {
        if let Some(span) = setup.span {
            // Evenly over the span: change n is due at n/changes of it.
            let due = started + span.mul_f64(n as f64 / changes as f64);
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
        }
        p.every(&mut reported, || {
            format!("  {label}: {n} of {changes} changes live")
        });
        let change = stream.next_change();
        let (t0, stored) = publish(&stream, &change)?;
        taken.push(stored.duration_since(t0).as_secs_f64() * 1000.0);
        let interval = probe.interval();
        let t1 = wait_live(
            probe,
            &target(cluster, change.service, change.new),
            interval,
            timeout,
        )
        .map_err(|e| {
            anyhow::anyhow!(
                "change {n}: {e}; log ends with:\n{}",
                tail(&proxy.log(), 10)
            )
        })?;
        latencies.push(t1.duration_since(t0).as_secs_f64() * 1000.0);
        std::thread::sleep(GAP);
    }
    Ok(())
}

/// The last `lines` lines of `text`.
pub(crate) fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_files_write_every_object_as_a_document_with_api_version_and_kind_first() {
        let cluster = Cluster::new(3, 2);
        let text = chunk_text(&cluster, 0, Format::Yaml, &|i| cluster.initial_endpoints(i))
            .expect("serializes");
        let documents: Vec<&str> = text
            .split("---\n")
            .filter(|d| !d.trim().is_empty())
            .collect();
        // A Service and its slice per Service.
        assert_eq!(documents.len(), 6, "{text}");
        for d in documents {
            let mut lines = d.lines();
            assert!(lines.next().unwrap().starts_with("apiVersion: "), "{d}");
            assert!(lines.next().unwrap().starts_with("kind: "), "{d}");
        }
        // The same objects as the JSON list.
        let json: Value = serde_json::from_str(
            &chunk_text(&cluster, 0, Format::Json, &|i| cluster.initial_endpoints(i)).unwrap(),
        )
        .unwrap();
        assert_eq!(json["items"].as_array().map(Vec::len), Some(6));
    }
}
