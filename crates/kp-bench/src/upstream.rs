//! Upstream's kube-proxy v1.28.7 as the baseline row: run on the same objects, in the same run,
//! against the same real API server ([`kp_test::kube_apiserver`]) as our binary's
//! `kube-apiserver` source, and measured the same way where it can be observed from outside:
//!
//! - **startup**: from starting the process to the last Service's first endpoint read back from
//!   the kernel by the iptables probe (upstream's `KUBE-SVC-…`/`KUBE-SEP-…` chain names are the
//!   ones our iptables mode uses, so the probe is the iptables adapter's); with the legacy
//!   backend a restore is one commit, so the last Service live is the whole cluster live;
//! - **programming latency**: from the API server storing the changed EndpointSlice to the new
//!   endpoint read back, one change at a time, as for ours;
//! - **memory**: the process's VmHWM and VmRSS;
//! - its own metrics at the end (`kubeproxy_sync_proxy_rules_duration_seconds`,
//!   `kubeproxy_network_programming_duration_seconds`, …), in the results beside ours.
//!
//! Only in a network namespace the bench creates (with the API server bridged into it), iptables
//! mode, `--iptables-min-sync-period=0s` as ours, conntrack sysctls left alone (they are not
//! the namespace's to set). Upstream calls plain `iptables`, which is the nft backend on this
//! machine and took over an hour for its first sync at 10k; by default the run puts a directory
//! of `iptables*` links to the legacy tools first on its PATH ([`UpstreamBackend::Legacy`]).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kp_iptables::Backend;
use kp_test::kube_apiserver::KubeApiServer;
use kp_test::netns::Netns;

use crate::cluster::{self, NODE_NAME};
use crate::iptables::Iptables;
use crate::mode::{wait_live, ModeUnderTest, Probe};
use crate::proxy::{
    memory_mib, replace_timed, restore, tail, target, time_changes, Setup, METRICS_ADDR,
};
use crate::results::ProxyRun;
use crate::stats::Summary;

/// Which iptables backend upstream's `iptables` calls reach.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpstreamBackend {
    /// `iptables-legacy` (a PATH of links): finishes at 10k.
    Legacy,
    /// The machine's `iptables` (the nft backend here): slow past a few thousand Services.
    Nft,
}

impl UpstreamBackend {
    /// From `legacy` or `nft`.
    pub fn parse(s: &str) -> anyhow::Result<Self> {
        match s {
            "legacy" => Ok(UpstreamBackend::Legacy),
            "nft" => Ok(UpstreamBackend::Nft),
            other => anyhow::bail!("--upstream-backend {other:?}: legacy or nft"),
        }
    }

    /// The row's mode name in the results.
    pub fn mode_name(self) -> &'static str {
        match self {
            UpstreamBackend::Legacy => "upstream-iptables-legacy",
            UpstreamBackend::Nft => "upstream-iptables-nft",
        }
    }

    fn backend(self) -> Backend {
        match self {
            UpstreamBackend::Legacy => Backend::Legacy,
            UpstreamBackend::Nft => Backend::Nft,
        }
    }
}

/// True for a results row of upstream's binary (no in-process phases, not one of our modes).
pub fn is_upstream(mode: &str) -> bool {
    mode.starts_with("upstream-")
}

/// The source name of upstream's rows.
pub const SOURCE: &str = "kube-apiserver";

/// A directory of `iptables`, `iptables-save`, `iptables-restore` (and the `ip6tables` ones)
/// linked to the legacy tools; removed on drop.
struct LegacyPath(PathBuf);

impl LegacyPath {
    fn new() -> anyhow::Result<LegacyPath> {
        let dir = std::env::temp_dir().join(format!("kp-bench-legacy-path-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        for base in ["iptables", "ip6tables"] {
            for suffix in ["", "-save", "-restore"] {
                let tool = format!("{base}-legacy{suffix}");
                let found = which(&tool).ok_or_else(|| {
                    anyhow::anyhow!("{tool} is not installed (Debian's iptables)")
                })?;
                std::os::unix::fs::symlink(found, dir.join(format!("{base}{suffix}")))?;
            }
        }
        Ok(LegacyPath(dir))
    }
}

impl Drop for LegacyPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn which(tool: &str) -> Option<PathBuf> {
    ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
        .iter()
        .map(|d| Path::new(d).join(tool))
        .find(|p| p.is_file())
}

/// The flags upstream gets: iptables mode, this node, the kube-proxy kubeconfig, no minimum
/// sync period, health and metrics on loopback as ours, and no conntrack sysctls.
pub fn flags(kubeconfig: &Path) -> Vec<String> {
    vec![
        format!("--kubeconfig={}", kubeconfig.display()),
        "--proxy-mode=iptables".into(),
        format!("--hostname-override={NODE_NAME}"),
        format!("--cluster-cidr={}", cluster::CLUSTER_CIDR),
        "--iptables-min-sync-period=0s".into(),
        "--healthz-bind-address=127.0.0.1:10256".into(),
        format!("--metrics-bind-address={METRICS_ADDR}"),
        // 0 leaves the machine's conntrack table size and timeouts alone.
        "--conntrack-max-per-core=0".into(),
        "--conntrack-tcp-timeout-established=0s".into(),
        "--conntrack-tcp-timeout-close-wait=0s".into(),
    ]
}

/// The unlabelled `kubeproxy_*` samples of a metrics text (gauges, counters and the sums and
/// counts of histograms), by name.
pub fn proxy_metrics(text: &str) -> std::collections::BTreeMap<String, f64> {
    text.lines()
        .filter(|l| l.starts_with("kubeproxy_") && !l.contains('{'))
        .filter_map(|l| {
            let mut parts = l.split_whitespace();
            let name = parts.next()?;
            let value: f64 = parts.next()?.parse().ok()?;
            Some((name.to_string(), value))
        })
        .collect()
}

/// Runs upstream's `binary` against `server` (which holds the cluster before any change) in a
/// fresh namespace.
pub fn run(
    setup: &Setup<'_>,
    server: &KubeApiServer,
    binary: &Path,
    backend: UpstreamBackend,
) -> anyhow::Result<ProxyRun> {
    let cluster = setup.cluster;
    let p = setup.progress;
    let ns = Netns::new("bench-upstream")?;
    let _bridge = server.bridge_into(&ns)?;
    let mode = Iptables {
        backend: backend.backend(),
    };
    let legacy = match backend {
        UpstreamBackend::Legacy => Some(LegacyPath::new()?),
        UpstreamBackend::Nft => None,
    };
    let path = match &legacy {
        Some(l) => format!("PATH={}:/usr/sbin:/usr/bin:/sbin:/bin", l.0.display()),
        None => "PATH=/usr/sbin:/usr/bin:/sbin:/bin".into(),
    };
    let mut probe: Box<dyn Probe> = mode.probe(ns.name())?;
    let binary = binary.display().to_string();
    let mut args: Vec<String> = vec![
        "env".into(),
        "-u".into(),
        "KUBECONFIG".into(),
        "-u".into(),
        "KUBERNETES_SERVICE_HOST".into(),
        "-u".into(),
        "KUBERNETES_SERVICE_PORT".into(),
        "HOME=/nonexistent".into(),
        path,
        binary,
    ];
    args.extend(flags(&server.kube_proxy_kubeconfig()));
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let spawned = Instant::now();
    let mut proxy = ns.spawn(&argv)?;
    let last = cluster.services - 1;
    let startup_timeout = Duration::from_secs(60 + cluster.services as u64 / 50);
    let live = wait_live(
        probe.as_mut(),
        &target(cluster, last, cluster::endpoint_ip(last, 0, cluster.per)),
        Duration::from_millis(10),
        startup_timeout,
    )
    .map_err(|e| {
        let exited = proxy.try_wait().ok().flatten();
        anyhow::anyhow!(
            "{e}; upstream kube-proxy {}; its log ends with:\n{}",
            exited.map_or("still runs".to_string(), |s| format!("exited ({s})")),
            tail(&proxy.log(), 15)
        )
    })?;
    let startup_s = live.duration_since(spawned).as_secs_f64();
    p.say(format!(
        "  upstream kube-proxy ({}): cluster live {startup_s:.2} s after start",
        backend.mode_name()
    ));
    let mut latencies = Vec::with_capacity(setup.changes);
    let mut taken = Vec::with_capacity(setup.changes);
    let changes_started = Instant::now();
    let result = time_changes(
        setup,
        "upstream",
        probe.as_mut(),
        &proxy,
        setup.changes,
        Duration::from_secs(60),
        &mut |_, change| replace_timed(server, &change.slice),
        &mut latencies,
        &mut taken,
    );
    let changes_s = changes_started.elapsed().as_secs_f64();
    // The next run starts from the generated cluster again, whatever happened.
    let restored = restore(server, cluster, latencies.len() + 1);
    result?;
    restored?;
    let metrics = crate::churn::scrape(ns.name())
        .map(|t| proxy_metrics(&t))
        .unwrap_or_default();
    let (peak_rss_mib, rss_mib) = memory_mib(proxy.id())?;
    if let Ok(Some(status)) = proxy.try_wait() {
        anyhow::bail!("upstream kube-proxy exited during the run ({status})");
    }
    let _ = proxy.terminate(Duration::from_secs(5));
    let latency_ms = Summary::of(&latencies);
    p.say(format!(
        "  upstream: programming latency p50 {:.1} ms, p99 {:.1} ms over {} changes; peak RSS {:.1} MiB",
        latency_ms.p50, latency_ms.p99, latency_ms.n, peak_rss_mib
    ));
    Ok(ProxyRun {
        source: SOURCE.into(),
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
