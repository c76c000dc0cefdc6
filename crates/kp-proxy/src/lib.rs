//! kube-proxy-rs as a library: the configuration, the mode registry and the running proxy
//! (sources feeding the state, the sync loop driving one dataplane, the HTTP servers). The
//! `kube-proxy` binary only sets up logging and calls [`run`]; tests drive [`SyncLoop`] with a
//! fake dataplane. Mirrors upstream `cmd/kube-proxy/app/server.go` (`ProxyServer.Run`).
//!
//! What it leaves to others: each mode's kernel programming (its crates, reached through
//! [`modes::MODES`]), the object sources (`kp-source`), the servers (`kp-serve`).

pub mod config;
pub mod modes;
mod sync_loop;

use std::collections::BTreeSet;
use std::sync::Arc;

use kp_core::dataplane::{DataplaneError, HeldBackend};
use kp_core::model::IpFamily;
use kp_core::sync::SyncSchedule;
use kp_core::track::{ProxyState, SourceEvent};
use kp_metrics::Metrics;
use kp_serve::{ProxyHealth, SharedHealth};
use tokio::sync::mpsc;

use crate::config::{Config, Loaded};
use crate::modes::ModeContext;
pub use crate::sync_loop::{ConntrackCleanup, SyncLoop};

/// Why the proxy stopped.
#[derive(Debug, thiserror::Error)]
pub enum Fatal {
    /// The configuration cannot be served (exit code 64).
    #[error("{0}")]
    Config(String),
    /// The dataplane failed in a way no retry can cure (no permission, a missing kernel
    /// module or tool). The rules already in the kernel stay in place.
    #[error("{mode} mode cannot program this node: {error}")]
    Dataplane {
        /// The mode.
        mode: &'static str,
        /// What failed.
        error: DataplaneError,
    },
    /// The Service/EndpointSlice/Node source ended (it retries on its own; this means it
    /// stopped for good).
    #[error("the object source stopped")]
    SourceStopped,
    /// A start-up step failed.
    #[error("{what}: {source}")]
    Start {
        /// The step.
        what: String,
        /// Why.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl Fatal {
    fn start(
        what: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Fatal::Start {
            what: what.into(),
            source: source.into(),
        }
    }
}

fn node_name(cfg: &Config) -> Result<String, Fatal> {
    match &cfg.hostname {
        Some(h) => Ok(h.clone()),
        None => {
            let h = hostname::get().map_err(|e| Fatal::start("reading the hostname", e))?;
            Ok(h.to_string_lossy().trim().to_lowercase())
        }
    }
}

/// Applies `oomScoreAdj` and the conntrack table size, as upstream does at start. Failures are
/// logged, not fatal: inside a network namespace, for example, `nf_conntrack_max` is read-only.
fn apply_process_settings(cfg: &Config) {
    if let Err(e) = std::fs::write("/proc/self/oom_score_adj", cfg.oom_score_adj.to_string()) {
        tracing::warn!(error = %e, value = cfg.oom_score_adj, "cannot set oom_score_adj");
    }
    apply_conntrack_timeouts(&cfg.conntrack);
    let per_core = u64::from(cfg.conntrack.max_per_core);
    if per_core == 0 {
        return;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
    let want = (per_core * cores).max(u64::from(cfg.conntrack.min));
    let path = "/proc/sys/net/netfilter/nf_conntrack_max";
    let current = std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok());
    match current {
        Some(c) if c >= want => {}
        _ => match std::fs::write(path, want.to_string()) {
            Ok(()) => tracing::info!(value = want, "set nf_conntrack_max"),
            Err(e) => tracing::warn!(error = %e, value = want, "cannot set nf_conntrack_max"),
        },
    }
}

/// The conntrack timeouts and `tcpBeLiberal`, written to their sysctls as upstream's
/// `conntracker` does; unset (zero) timeouts leave the kernel's value.
fn apply_conntrack_timeouts(c: &config::Conntrack) {
    let dir = "/proc/sys/net/netfilter";
    let timeouts = [
        (
            "nf_conntrack_tcp_timeout_established",
            c.tcp_established_timeout,
        ),
        (
            "nf_conntrack_tcp_timeout_close_wait",
            c.tcp_close_wait_timeout,
        ),
        ("nf_conntrack_udp_timeout", c.udp_timeout),
        ("nf_conntrack_udp_timeout_stream", c.udp_stream_timeout),
    ];
    let liberal = c
        .tcp_be_liberal
        .then_some(("nf_conntrack_tcp_be_liberal", 1));
    let writes = timeouts
        .into_iter()
        .filter_map(|(name, d)| d.map(|d| (name, d.as_secs())))
        .chain(liberal);
    for (name, value) in writes {
        let path = format!("{dir}/{name}");
        let current = std::fs::read_to_string(&path).ok();
        if current.as_deref().map(str::trim) == Some(value.to_string().as_str()) {
            continue;
        }
        match std::fs::write(&path, value.to_string()) {
            Ok(()) => tracing::info!(sysctl = name, value, "set conntrack sysctl"),
            Err(e) => {
                tracing::warn!(error = %e, sysctl = name, value, "cannot set conntrack sysctl")
            }
        }
    }
}

/// SIGTERM or SIGINT.
async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}

/// Runs the proxy until SIGTERM/SIGINT: `--write-config-to` and `--cleanup` end at once;
/// otherwise the configured mode runs, and every other mode's leftovers are removed once its
/// first sync has succeeded.
pub async fn run(loaded: Loaded) -> Result<(), Fatal> {
    let cfg = &loaded.config;
    if let Some(path) = &cfg.write_config_to {
        let yaml =
            crate::config::to_yaml(&loaded.effective).map_err(|e| Fatal::Config(e.to_string()))?;
        std::fs::write(path, yaml)
            .map_err(|e| Fatal::start(format!("writing {}", path.display()), e))?;
        tracing::info!(path = %path.display(), "wrote the effective configuration");
        return Ok(());
    }
    if cfg.init_only {
        // Upstream's --init-only: the steps that need full privileges, then exit.
        apply_process_settings(cfg);
        tracing::info!("--init-only: start-up settings applied, exiting");
        return Ok(());
    }
    let metrics = Arc::new(Metrics::new());
    let ctx = ModeContext::new(cfg, metrics.clone());
    if cfg.cleanup {
        return cleanup_all(&ctx);
    }
    let mode = match modes::fallback(&ctx) {
        Some(fb) => {
            tracing::warn!(
                configured = fb.from.as_str(),
                running = fb.to.as_str(),
                reason = %fb.why,
                "{} mode cannot run on this node: {}; running {} mode instead, as older kube-proxy releases did",
                fb.from.as_str(),
                fb.why,
                fb.to.as_str()
            );
            metrics.mode_fallback(fb.from.as_str(), fb.to.as_str());
            modes::require(fb.to)?
        }
        None => modes::require(cfg.mode)?,
    };
    // Switching modes: the other modes' leftovers serve until this mode's first sync and are
    // removed after it (see `remove_leftovers_after_first_sync`), so there is no instant
    // without rules.
    let dataplane = (mode.build)(&ctx)?;
    let conntrack = mode.reconciles_conntrack.then(ConntrackCleanup::new);
    // What the other modes' leftovers still answer for, before this mode's first sync: that
    // sync already sends no new connection where they would break it.
    let held = modes::held_backends(&ctx, Some(mode.mode)).unwrap_or_else(|(name, e)| {
        tracing::warn!(error = %e, mode = name, "cannot read what another mode's leftovers still answer for; the removal of its leftovers reads it again");
        Default::default()
    });
    let (held_tx, held_rx) = tokio::sync::watch::channel(held);
    let leftovers = tokio::spawn(remove_leftovers_after_first_sync(
        cfg.clone(),
        metrics.clone(),
        mode.mode,
        held_tx,
    ));
    let result = run_mode(&loaded, metrics, dataplane, conntrack, held_rx).await;
    leftovers.abort();
    result
}

/// How often the removal of other modes' leftovers is retried while some of them still carry
/// connections (ipvs virtual servers) or the removal failed.
const LEFTOVER_RETRY: std::time::Duration = std::time::Duration::from_secs(10);

/// How often the first successful sync is looked for.
const FIRST_SYNC_POLL: std::time::Duration = std::time::Duration::from_millis(20);

/// Waits for the running mode's first successful sync (the sync loop sets
/// `kubeproxy_sync_proxy_rules_last_timestamp_seconds` after each one, and only then), then
/// removes every other mode's leftovers, leaving what the running mode uses; retries while
/// some stay (connections still use them) or the removal fails.
async fn remove_leftovers_after_first_sync(
    cfg: Config,
    metrics: Arc<Metrics>,
    running: config::ProxyMode,
    held: tokio::sync::watch::Sender<BTreeSet<HeldBackend>>,
) {
    while metrics.last_sync_timestamp.get() <= 0.0 {
        tokio::time::sleep(FIRST_SYNC_POLL).await;
    }
    let cfg = Arc::new(cfg);
    let mut failures_logged = false;
    loop {
        let (c, m) = (cfg.clone(), metrics.clone());
        let left = tokio::task::spawn_blocking(move || {
            let ctx = ModeContext::new(&c, m);
            modes::remove_leftovers(&ctx, Some(running))
        })
        .await;
        let left = match left {
            Ok(left) => left,
            Err(e) => {
                tracing::error!(error = %e, "removing other modes' leftovers panicked");
                return;
            }
        };
        // Unread (a failure, listed below): the last set stays.
        if let Some(now_held) = left.held.clone() {
            held.send_if_modified(|h| {
                let changed = *h != now_held;
                *h = now_held;
                changed
            });
        }
        if left.done() {
            tracing::info!(
                mode = running.as_str(),
                "first sync done; no other mode's rules are left"
            );
            return;
        }
        for (name, e) in &left.failed {
            // The running mode's own name: its take-over step failed (`Mode::take_over`).
            let what = if *name == running.as_str() {
                "cannot take the node over from the mode before"
            } else {
                "cannot remove another mode's leftovers"
            };
            if failures_logged {
                tracing::debug!(error = %e, mode = name, "still {what}");
            } else {
                tracing::warn!(error = %e, mode = name, "{what}; retrying every {LEFTOVER_RETRY:?}");
            }
        }
        failures_logged |= !left.failed.is_empty();
        for (name, what) in &left.draining {
            tracing::info!(
                mode = name,
                "{what}: kept until they end, rechecked every {LEFTOVER_RETRY:?}"
            );
        }
        tokio::time::sleep(LEFTOVER_RETRY).await;
    }
}

/// `--cleanup`: removes what every mode may have left behind, and nothing else.
fn cleanup_all(ctx: &ModeContext<'_>) -> Result<(), Fatal> {
    let failed = modes::remove_leftovers(ctx, None).failed;
    for m in modes::MODES {
        if !failed.iter().any(|(name, _)| *name == m.name()) {
            tracing::info!(mode = m.name(), "removed {}", m.leftovers);
        }
    }
    match failed.into_iter().next() {
        None => Ok(()),
        Some((mode, error)) => Err(Fatal::Dataplane { mode, error }),
    }
}

/// Runs the proxy with one dataplane until SIGTERM/SIGINT.
async fn run_mode(
    loaded: &Loaded,
    metrics: Arc<Metrics>,
    dataplane: Box<dyn kp_core::dataplane::Dataplane>,
    conntrack: Option<ConntrackCleanup>,
    held: tokio::sync::watch::Receiver<BTreeSet<HeldBackend>>,
) -> Result<(), Fatal> {
    let cfg = &loaded.config;
    let mode = dataplane.mode();
    let node = node_name(cfg)?;
    tracing::info!(mode, node = %node, "starting kube-proxy-rs");
    apply_process_settings(cfg);

    let health = SharedHealth::new(ProxyHealth::new(
        kp_serve::health_timeout(cfg.sync_period),
        IpFamily::ALL,
    ));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    if let Some(addr) = cfg.healthz_bind_address {
        let listener = kp_serve::bind(addr)
            .await
            .map_err(|e| Fatal::start("binding the health server", e))?;
        let h = health.clone();
        let stop = stopped(stop_rx.clone());
        tokio::spawn(async move {
            if let Err(e) = kp_serve::serve_health(listener, h, stop).await {
                tracing::error!(error = %e, "health server failed");
            }
        });
        tracing::info!(%addr, "serving /healthz and /livez");
    }
    if let Some(addr) = cfg.metrics_bind_address {
        let listener = kp_serve::bind(addr)
            .await
            .map_err(|e| Fatal::start("binding the metrics server", e))?;
        let configz = serde_json::to_value(&loaded.effective).unwrap_or_default();
        let server = kp_serve::serve_metrics(
            listener,
            metrics.clone(),
            mode,
            configz,
            stopped(stop_rx.clone()),
        );
        tokio::spawn(async move {
            if let Err(e) = server.await {
                tracing::error!(error = %e, "metrics server failed");
            }
        });
        tracing::info!(%addr, "serving /metrics, /proxyMode and /configz");
    }

    let (tx, rx) = mpsc::channel::<SourceEvent>(4096);
    match &cfg.manifests_dir {
        Some(dir) => {
            tracing::info!(dir = %dir.display(), "reading Services, EndpointSlices and Nodes from manifests");
            let (dir, m) = (dir.clone(), metrics.clone());
            tokio::spawn(async move {
                if let Err(e) = kp_source::run_manifests(dir, tx, m).await {
                    tracing::error!(error = %e, "manifest source stopped");
                }
            });
        }
        None => {
            let client = kp_source::client_from(cfg.kubeconfig.as_deref(), cfg.master.as_deref())
                .await
                .map_err(|e| Fatal::Config(format!("cannot build a Kubernetes client: {e}")))?;
            let (node, m) = (node.clone(), metrics.clone());
            tokio::spawn(kp_source::run_kubernetes(client, node, tx, m));
        }
    }

    let mut state = ProxyState::new(node);
    state.set_configured_service_cidrs(cfg.service_cidrs.clone());
    let mut sync_loop = SyncLoop::new(
        state,
        SyncSchedule::new(cfg.min_sync_period, cfg.sync_period),
        dataplane,
        metrics,
        health,
        conntrack,
    )
    .with_held_backends(held);
    // The health and metrics servers stop with the signal, before the dataplane's own stop:
    // a userspace proxy serves on while its rules still reach it (`--userspace-drain-timeout`),
    // and the proxy that takes over on this node must be able to bind the same ports.
    let stop = async {
        shutdown_signal().await;
        let _ = stop_tx.send(true);
    };
    sync_loop.run(rx, stop).await
}
