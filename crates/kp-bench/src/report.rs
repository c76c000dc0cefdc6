//! Writes the results file, the plots and `BENCHMARKS.md`, all from a [`Results`].

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::results::{Results, Run};

/// The results directory, relative to the repository root.
pub const RESULTS_DIR: &str = "bench/results";
/// The report, relative to the repository root.
pub const REPORT: &str = "BENCHMARKS.md";
/// Recorded profiles (`scripts/profile.sh`), relative to the repository root.
pub const PROFILES_DIR: &str = "bench/profiles";

/// Writes `bench/results/<started>.json` and `bench/results/latest.json`; returns their paths.
pub fn write_results(root: &Path, results: &Results) -> anyhow::Result<Vec<PathBuf>> {
    let dir = root.join(RESULTS_DIR);
    std::fs::create_dir_all(&dir)?;
    let json = serde_json::to_string_pretty(results)?;
    let stamp = results.started.replace(':', "-");
    let file = dir.join(format!("{stamp}.json"));
    let latest = dir.join("latest.json");
    std::fs::write(&file, &json)?;
    std::fs::write(&latest, &json)?;
    Ok(vec![file, latest])
}

/// Writes the results files (`latest.json` only, unless `timestamped`), both plots and the
/// report; returns every path written. A plot that cannot be drawn (no font) is reported in
/// `BENCHMARKS.md` and on standard error, and the rest is still written.
pub fn write_all(
    root: &Path,
    results: &Results,
    timestamped: bool,
) -> anyhow::Result<Vec<PathBuf>> {
    let mut written = if timestamped {
        write_results(root, results)?
    } else {
        let dir = root.join(RESULTS_DIR);
        std::fs::create_dir_all(&dir)?;
        let latest = dir.join("latest.json");
        std::fs::write(&latest, serde_json::to_string_pretty(results)?)?;
        vec![latest]
    };
    let mut plot_errors = Vec::new();
    for (rel, draw) in [
        (
            crate::plot::SYNC_TIME,
            crate::plot::sync_time as fn(&Results, &Path) -> Result<(), String>,
        ),
        (crate::plot::CONNECT_LATENCY, crate::plot::connect_latency),
        (crate::plot::REAL_APISERVER, crate::plot::real_apiserver),
    ] {
        // No run with the real API server: no plot, and nothing to say about it.
        if rel == crate::plot::REAL_APISERVER && !has_real_apiserver(results) {
            continue;
        }
        let path = root.join(rel);
        match draw(results, &path) {
            Ok(()) => written.push(path),
            Err(e) => {
                eprintln!("kp-bench: {rel} not drawn: {e}");
                plot_errors.push(format!("{rel} not drawn: {e}"));
            }
        }
    }
    let report = root.join(REPORT);
    let (profiles, notes) = read_profiles(root);
    std::fs::write(
        &report,
        markdown(results, &plot_errors, &profiles, notes.as_deref()),
    )?;
    crate::report_vm::update_report(root)?;
    written.push(report);
    Ok(written)
}

/// Whether a run fed the binary from a real API server.
fn has_real_apiserver(r: &Results) -> bool {
    r.runs
        .iter()
        .any(|run| run.proxy.iter().any(|p| p.source == REAL_SOURCE))
}

const REAL_SOURCE: &str = "kube-apiserver";

/// The mean of a histogram metric (`NAME_sum / NAME_count`), if it counted anything.
fn metric_mean(p: &crate::results::ProxyRun, name: &str) -> Option<f64> {
    let sum = p.metrics.get(&format!("{name}_sum"))?;
    let count = p.metrics.get(&format!("{name}_count"))?;
    (*count > 0.0).then(|| sum / count)
}

/// The API server's own share of a run's latencies (its answer to each write), if the source is
/// one.
fn api_write(p: &crate::results::ProxyRun) -> String {
    if p.source_ms.n == 0 || p.source.starts_with("manifests") {
        return "–".into();
    }
    format!("{:.1} · {:.1} ms", p.source_ms.p50, p.source_ms.p99)
}

/// What a run's latencies took after the API server's answer (watch delivery, the proxy's sync
/// and the kernel), if the source is one and the run recorded it.
fn after_api_write(p: &crate::results::ProxyRun) -> String {
    if p.after_source_ms.n == 0 || p.source.starts_with("manifests") {
        return "–".into();
    }
    format!(
        "{:.1} · {:.1} ms",
        p.after_source_ms.p50, p.after_source_ms.p99
    )
}

/// The section comparing our binary with upstream's on the same real API server.
fn upstream_section(o: &mut String, r: &Results) {
    if !has_real_apiserver(r) {
        return;
    }
    let _ = writeln!(
        o,
        "## Against upstream, on a real API server
"
    );
    let _ = writeln!(
        o,
        "One real API server per size (etcd + kube-apiserver v1.28.7 on loopback, `../shared/k8s/apiserver.sh`), loaded once with the cluster above over HTTP (the admin user, 32 requests at once); each binary in turn runs in a network namespace of its own, reaches it through a unix-socket bridge (`socat`) at the same `https://127.0.0.1:PORT`, and reads it with the `system:kube-proxy` user's kubeconfig. Real objects carry `managedFields` and the rest of the metadata the fake API server leaves out. After each run the changed EndpointSlices are put back, so every binary starts from the same objects. Upstream is kube-proxy {} in iptables mode with `--iptables-min-sync-period=0s` ({}), measured by the same probes: *startup* until the last Service's endpoint is read back from the kernel, *latency* from the write of the changed slice sent to the API server to the new endpoint read back, memory as VmHWM. *Sync mean* is each proxy's own `kubeproxy_sync_proxy_rules_duration_seconds` (sum ÷ count over the run), *programming mean* its `kubeproxy_network_programming_duration_seconds`. *×* is upstream's figure over ours (above 1: ours is better). *Load* is the machine's 1-minute load average when the run started ({} CPUs).\n",
        kp_test::kube_apiserver::UPSTREAM_VERSION,
        if r.settings.upstream_binary.is_empty() {
            "not run".to_string()
        } else {
            "the legacy backend: its `iptables*` on PATH are links to `iptables-legacy*`, as the nft backend's first sync at 10k takes over an hour here"
                .to_string()
        },
        r.machine.cpus
    );
    let _ = writeln!(
        o,
        "| binary and mode | Services | startup | × | changes | latency p50 | latency p99 | × p99 | latency max | peak RSS | × | sync mean | programming mean | load |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    let real = |run: &Run| run.proxy.iter().find(|p| p.source == REAL_SOURCE).cloned();
    for run in &r.runs {
        let Some(p) = real(run) else { continue };
        let base = r
            .runs
            .iter()
            .filter(|u| u.services == run.services && crate::upstream::is_upstream(&u.mode))
            .find_map(real);
        let ratio = |ours: f64, theirs: Option<f64>| match theirs {
            Some(t) if ours > 0.0 && !crate::upstream::is_upstream(&run.mode) => {
                format!("{:.1}×", t / ours)
            }
            _ => "–".to_string(),
        };
        let name = if crate::upstream::is_upstream(&run.mode) {
            format!(
                "upstream {} ({})",
                kp_test::kube_apiserver::UPSTREAM_VERSION,
                run.mode.trim_start_matches("upstream-")
            )
        } else {
            format!("kube-proxy-rs ({})", run.mode)
        };
        let _ = writeln!(
            o,
            "| {name} | {} | {} | {} | {} | {:.1} ms | {:.1} ms | {} | {:.1} ms | {:.1} MiB | {} | {} | {} | {:.1} |",
            thousands(run.services),
            fmt_s(p.startup_s),
            ratio(p.startup_s, base.as_ref().map(|b| b.startup_s)),
            p.latency_ms.n,
            p.latency_ms.p50,
            p.latency_ms.p99,
            ratio(p.latency_ms.p99, base.as_ref().map(|b| b.latency_ms.p99)),
            p.latency_ms.max,
            p.peak_rss_mib,
            ratio(p.peak_rss_mib, base.as_ref().map(|b| b.peak_rss_mib)),
            opt(metric_mean(&p, "kubeproxy_sync_proxy_rules_duration_seconds"), |v| fmt_s(v)),
            opt(metric_mean(&p, "kubeproxy_network_programming_duration_seconds"), |v| fmt_s(v)),
            run.load_average
        );
    }
    let _ = writeln!(
        o,
        "\n![Our binary and upstream's on a real API server against N](bench/real_apiserver.png)\n"
    );
}

/// Reads a results file.
pub fn read_results(path: &Path) -> anyhow::Result<Results> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("parsing {}: {e}", path.display()))
}

/// One target of the issue, and how this run did.
#[derive(Clone, Debug, PartialEq)]
pub struct Target {
    /// What is promised.
    pub what: String,
    /// The profiles (`bench/profiles/<name>.txt`) that show where the time or memory goes.
    pub profiles: Vec<String>,
    /// What was measured (or why nothing was).
    pub measured: String,
    /// Whether it was met; `None` when not measured.
    pub met: Option<bool>,
}

fn target(what: impl Into<String>, measured: Option<(f64, String)>, limit: f64) -> Target {
    let what = what.into();
    match measured {
        Some((v, text)) => Target {
            profiles: profiles_for(&what),
            what,
            measured: text,
            met: Some(v <= limit),
        },
        None => Target {
            profiles: profiles_for(&what),
            what,
            measured: "not measured".into(),
            met: None,
        },
    }
}

/// A target met when the measured value is at least `floor`.
fn at_least(what: impl Into<String>, measured: Option<(f64, String)>, floor: f64) -> Target {
    let mut t = target(what, measured.clone(), f64::INFINITY);
    t.met = measured.map(|(v, _)| v >= floor);
    t
}

/// The profiles `scripts/profile.sh` records for a target, named from the target's mode, size
/// and kind (full sync, change, memory; the data path has two, connect runs or bulk transfers
/// through the ClusterIP and straight to the pod, to set side by side).
fn profiles_for(what: &str) -> Vec<String> {
    let mode = what.split(',').next().unwrap_or_default();
    let size = ["100k", "30k", "10k"]
        .into_iter()
        .find(|s| what.contains(s))
        .unwrap_or("10k");
    let datapath = if what.contains("connect latency via ClusterIP") {
        Some("datapath")
    } else if what.contains("bulk throughput via") {
        Some("bulk")
    } else {
        None
    };
    if let Some(runs) = datapath {
        return ["vip", "direct"]
            .iter()
            .map(|t| format!("{mode}-{runs}-{t}-{size}"))
            .collect();
    }
    // The binary's runs on a real API server or YAML manifests have profiles of their own.
    let source = if what.contains("real API server") {
        "-kube-apiserver"
    } else if what.contains("YAML") {
        "-yaml"
    } else {
        ""
    };
    // A YAML edit costs what the start does, per file: parsing (one profile shows both).
    let kind = if what.contains("after start") || source == "-yaml" {
        "startup"
    } else if what.contains("full sync ≤") && !what.contains("bare") {
        "full"
    } else if what.contains("change p99 ≤") {
        "change"
    } else if what.contains("RSS") {
        "memory"
    } else if !source.is_empty() && what.contains("latency") {
        "latency"
    } else {
        return Vec::new();
    };
    vec![format!("{mode}-{kind}{source}-{size}")]
}

/// One recorded profile: `bench/profiles/<name>.txt`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Profile {
    /// The file's stem.
    pub name: String,
    /// Its text.
    pub text: String,
}

/// Reads `bench/profiles/*.txt` and the analysis `bench/profiles/NOTES.md` (if any).
pub fn read_profiles(root: &Path) -> (Vec<Profile>, Option<String>) {
    let dir = root.join(PROFILES_DIR);
    let mut profiles: Vec<Profile> = std::fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let path = e.path();
            let name = path.file_name()?.to_str()?.strip_suffix(".txt")?.to_owned();
            let text = std::fs::read_to_string(&path).ok()?;
            Some(Profile { name, text })
        })
        .collect();
    profiles.sort_by(|a, b| a.name.cmp(&b.name));
    let notes = std::fs::read_to_string(dir.join("NOTES.md")).ok();
    (profiles, notes)
}

/// The lines of a profile worth showing inline: its header and the first `per_section` lines
/// of each section.
fn profile_excerpt(text: &str, per_section: usize) -> String {
    let mut out = String::new();
    let mut in_section = 0usize;
    let mut skipping_output = false;
    for line in text.lines() {
        if line.starts_with("# the measurement's own output") {
            skipping_output = true;
            continue;
        }
        if line.starts_with("## ") || line.starts_with("MOST ") || line.starts_with("PEAK ") {
            skipping_output = false;
            in_section = 0;
            out.push_str(line);
            out.push('\n');
            continue;
        }
        if skipping_output || line.trim().is_empty() || line.trim() == "#" {
            continue;
        }
        if line.starts_with("# ") && !line.starts_with("#   ") {
            out.push_str(line);
            out.push('\n');
            continue;
        }
        if in_section < per_section {
            out.push_str(line);
            out.push('\n');
            in_section += 1;
        }
    }
    out
}

/// The issue's targets, evaluated on `results`.
pub fn targets(results: &Results) -> Vec<Target> {
    let run = |mode: &str, n: usize| results.run(mode, n);
    let full = |mode: &str, n: usize| {
        run(mode, n)
            .and_then(|r| r.full_sync.as_ref())
            .map(|f| (f.total_s, format!("{:.2} s", f.total_s)))
    };
    let p99 = |mode: &str, n: usize| run(mode, n).and_then(|r| r.incremental_ms).map(|s| s.p99);
    let mut t = vec![
        target(
            "nftables, 10k × 10: first full sync ≤ 1 s",
            full("nftables", 10_000),
            1.0,
        ),
        target(
            "nftables, 30k × 10: first full sync ≤ 3 s",
            full("nftables", 30_000),
            3.0,
        ),
        target(
            "nftables, 30k: one-endpoint change p99 ≤ 20 ms",
            p99("nftables", 30_000).map(|v| (v, format!("{v:.1} ms"))),
            20.0,
        ),
        target(
            "nftables, 30k: one-endpoint change p99 ≤ 2× the 1k p99",
            p99("nftables", 30_000)
                .zip(p99("nftables", 1_000))
                .map(|(a, b)| (a / b, format!("{:.2}× ({a:.1} ms vs {b:.1} ms)", a / b))),
            2.0,
        ),
    ];
    for mode in ["iptables-nft", "iptables-legacy"] {
        t.push(target(
            format!("{mode}, 10k: first full sync ≤ 3 s"),
            full(mode, 10_000),
            3.0,
        ));
        t.push(target(
            format!("{mode}, 10k: one-endpoint change p99 ≤ 300 ms"),
            p99(mode, 10_000).map(|v| (v, format!("{v:.1} ms"))),
            300.0,
        ));
    }
    let api = |r: &Run| r.proxy.iter().find(|p| p.source == "apiserver").cloned();
    t.push(target(
        "nftables, 10k, minSyncPeriod 0: programming latency p99 ≤ 50 ms (API server source)",
        run("nftables", 10_000)
            .and_then(api)
            .map(|p| (p.latency_ms.p99, format!("{:.1} ms", p.latency_ms.p99))),
        50.0,
    ));
    for mode in results.modes() {
        if crate::upstream::is_upstream(&mode) {
            continue;
        }
        let rss = run(&mode, 10_000).and_then(|r| {
            r.proxy
                .iter()
                .map(|p| (p.peak_rss_mib, p.source.clone()))
                .max_by(|a, b| a.0.total_cmp(&b.0))
        });
        let from_real_api_server = rss.as_ref().is_some_and(|(_, s)| s == "kube-apiserver");
        let mut row = target(
            format!(
                "{mode}, 10k × 10: peak RSS of kube-proxy ≤ 64 MiB (larger of the two sources)"
            ),
            rss.map(|(v, s)| (v, format!("{v:.1} MiB ({s})"))),
            64.0,
        );
        // The larger peak was the real API server's: its memory profile is the one to read.
        if from_real_api_server {
            row.profiles = vec![format!("{mode}-memory-kube-apiserver-10k")];
        }
        t.push(row);
        // ebpf has no kernel tool to load its maps with alone: no bare baseline.
        if mode == "ebpf" {
            continue;
        }
        let overhead = run(&mode, 10_000)
            .and_then(|r| r.bare.as_ref())
            .map(|b| (b.overhead, format!("{:.2}×", b.overhead)));
        t.push(target(
            format!("{mode}, 10k: full sync over bare kernel load ≤ 1.3×"),
            overhead,
            1.3,
        ));
    }
    // Userspace (#12): endpoints live in the proxy, so a one-endpoint change is the balancer's
    // update alone, flat in N; its data path pays for every byte passing through the process.
    let us = "userspace";
    t.push(target(
        "userspace, 30k: one-endpoint change p99 ≤ 1 ms",
        p99(us, 30_000).map(|v| (v, format!("{v:.3} ms"))),
        1.0,
    ));
    t.push(target(
        "userspace, 30k: one-endpoint change p99 ≤ 2× the 1k p99 (flat in N)",
        p99(us, 30_000)
            .zip(p99(us, 1_000))
            .map(|(a, b)| (a / b, format!("{:.2}× ({a:.3} ms vs {b:.3} ms)", a / b))),
        2.0,
    ));
    let us_datapath = || run(us, 30_000).and_then(|r| r.datapath.as_ref());
    t.push(target(
        "userspace, 30k: connect latency via ClusterIP ≤ 1.5× direct (p50)",
        us_datapath().map(|d| (d.latency_ratio_p50, format!("{:.2}×", d.latency_ratio_p50))),
        1.5,
    ));
    t.push(at_least(
        "userspace, 30k: bulk throughput via ClusterIP ≥ 0.8× direct",
        us_datapath().map(|d| (d.bulk_ratio, format!("{:.2}×", d.bulk_ratio))),
        0.8,
    ));
    for (q, name) in [(0, "p50"), (1, "p99")] {
        t.push(target(
            format!("nftables, 30k: connect latency via ClusterIP ≤ 1.10× direct ({name})"),
            run("nftables", 30_000)
                .and_then(|r| r.datapath.as_ref())
                .map(|d| {
                    let v = if q == 0 {
                        d.latency_ratio_p50
                    } else {
                        d.latency_ratio_p99
                    };
                    (v, format!("{v:.2}×"))
                }),
            1.10,
        ));
    }
    t.extend(ebpf_targets(results));
    t.extend(real_cluster_targets(results));
    t
}

/// The ebpf mode's targets (#14): its map updates are the whole sync, so a full sync at 10k and
/// a one-endpoint change are cheap and flat in N, and a ClusterIP costs what a direct
/// connection does (nothing is translated per packet).
fn ebpf_targets(results: &Results) -> Vec<Target> {
    let ebpf = "ebpf";
    let run = |n: usize| results.run(ebpf, n);
    let p99 = |n: usize| run(n).and_then(|r| r.incremental_ms).map(|s| s.p99);
    vec![
        target(
            format!("{ebpf}, 10k × 10: first full sync ≤ 0.3 s"),
            run(10_000)
                .and_then(|r| r.full_sync.as_ref())
                .map(|f| (f.total_s, format!("{:.2} s", f.total_s))),
            0.3,
        ),
        target(
            format!("{ebpf}, 30k: one-endpoint change p99 ≤ 1 ms"),
            p99(30_000).map(|v| (v, format!("{v:.2} ms"))),
            1.0,
        ),
        target(
            format!("{ebpf}, 30k: one-endpoint change p99 ≤ 2× the 1k p99 (flat in N)"),
            p99(30_000)
                .zip(p99(1_000))
                .map(|(a, b)| (a / b, format!("{:.2}× ({a:.2} ms vs {b:.2} ms)", a / b))),
            2.0,
        ),
        target(
            format!("{ebpf}, 30k: connect latency via ClusterIP ≤ 1.02× direct (p50)"),
            run(30_000)
                .and_then(|r| r.datapath.as_ref())
                .map(|d| (d.latency_ratio_p50, format!("{:.2}×", d.latency_ratio_p50))),
            1.02,
        ),
    ]
}

/// The targets of the binary against a real API server and YAML manifests, at 100k, and of the
/// data path against a node with no rules (the performance issue's).
fn real_cluster_targets(results: &Results) -> Vec<Target> {
    let nft = "nftables";
    let source = |n: usize, name: &str| {
        results
            .run(nft, n)
            .and_then(|r| r.proxy.iter().find(|p| p.source == name).cloned())
    };
    let mut t = Vec::new();
    for (n, label, limit) in [(10_000, "10k", 1.0), (30_000, "30k", 3.0)] {
        t.push(target(
            format!("{nft}, {label} × 10, real API server: cluster live ≤ {limit} s after start (list included)"),
            source(n, REAL_SOURCE).map(|p| (p.startup_s, format!("{:.2} s", p.startup_s))),
            limit,
        ));
    }
    for (n, label, limit) in [(10_000, "10k", 48.0), (30_000, "30k", 128.0)] {
        t.push(target(
            format!("{nft}, {label} × 10, real API server: peak RSS ≤ {limit} MiB"),
            source(n, REAL_SOURCE).map(|p| (p.peak_rss_mib, format!("{:.1} MiB", p.peak_rss_mib))),
            limit,
        ));
    }
    // Decided only over a run that held periodic syncs (two at least).
    let with_periodic = source(10_000, REAL_SOURCE).and_then(|p| {
        let periodic = crate::proxy::periodic_syncs(&p.metrics)?;
        (periodic >= 2).then(|| {
            (
                p.latency_ms.p99,
                format!(
                    "{:.1} ms ({} changes over {}, {periodic} periodic syncs among them){}",
                    p.latency_ms.p99,
                    p.latency_ms.n,
                    fmt_s(p.changes_s),
                    if p.after_source_ms.n > 0 {
                        format!(
                            "; the API server's answer p99 {:.1} ms, after it p99 {:.1} ms",
                            p.source_ms.p99, p.after_source_ms.p99
                        )
                    } else {
                        String::new()
                    }
                ),
            )
        })
    });
    t.push(target(
        format!("{nft}, 10k, real API server: programming latency p99 ≤ 20 ms over periodic syncs"),
        with_periodic,
        20.0,
    ));
    let yaml = source(10_000, "manifests-yaml");
    t.push(target(
        format!("{nft}, 10k × 10 as YAML manifests: cluster live ≤ 1.5 s after start"),
        yaml.as_ref()
            .map(|p| (p.startup_s, format!("{:.2} s", p.startup_s))),
        1.5,
    ));
    t.push(target(
        format!("{nft}, 10k as YAML manifests: programming latency of a file change p50 ≤ 20 ms"),
        yaml.as_ref()
            .map(|p| (p.latency_ms.p50, format!("{:.1} ms", p.latency_ms.p50))),
        20.0,
    ));
    let full = results
        .run(nft, 100_000)
        .and_then(|r| r.full_sync.as_ref())
        .map(|f| (f.total_s, format!("{:.2} s", f.total_s)));
    t.push(target(
        format!("{nft}, 100k × 10: first full sync ≤ 5 s"),
        full,
        5.0,
    ));
    let p99 = |n: usize| {
        results
            .run(nft, n)
            .and_then(|r| r.incremental_ms)
            .map(|s| s.p99)
    };
    t.push(target(
        format!("{nft}, 100k: one-endpoint change p99 ≤ 2× the 1k p99 (flat in N)"),
        p99(100_000)
            .zip(p99(1_000))
            .map(|(a, b)| (a / b, format!("{:.2}× ({a:.1} ms vs {b:.1} ms)", a / b))),
        2.0,
    ));
    t.push(target(
        format!("{nft}, 30k: connect latency via ClusterIP ≤ 1.15× a node with no rules (p50, pinned CPUs)"),
        results
            .run(nft, 30_000)
            .and_then(|r| r.datapath.as_ref())
            .filter(|d| d.pinned)
            .and_then(|d| d.unloaded_ratio_p50)
            .map(|v| (v, format!("{v:.2}×"))),
        1.15,
    ));
    t
}

fn fmt_s(v: f64) -> String {
    if v >= 10.0 {
        format!("{v:.1} s")
    } else {
        format!("{v:.3} s")
    }
}

fn opt<T>(v: Option<T>, f: impl FnOnce(T) -> String) -> String {
    v.map(f).unwrap_or_else(|| "–".into())
}

fn thousands(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `BENCHMARKS.md`.
pub fn markdown(
    r: &Results,
    plot_errors: &[String],
    profiles: &[Profile],
    notes: Option<&str>,
) -> String {
    let mut o = String::new();
    let m = &r.machine;
    let _ = writeln!(o, "# Benchmarks\n");
    let _ = writeln!(
        o,
        "<!-- Generated by `bench` (crates/kp-bench) from bench/results/latest.json. Change the tool, not this file. -->\n"
    );
    let _ = writeln!(
        o,
        "Scale benchmarks of kube-proxy-rs: sync cost, network programming latency, memory and the data path. \
         Measured {} in {:.0} s; the raw numbers are in [`bench/results/latest.json`](bench/results/latest.json). \
         It is a harness, not a test: nothing here gates CI.\n",
        r.started, r.duration_s
    );
    let _ = writeln!(
        o,
        "Reproduce (as root, from the repository root; it works in its own network namespaces):\n"
    );
    let _ = writeln!(
        o,
        "```sh\ncargo build --release -p kube-proxy -p kp-bench\n{}\n```\n",
        r.command
    );
    let _ = writeln!(o, "## Machine\n");
    let _ = writeln!(
        o,
        "| kernel | CPUs | CPU | memory | nft | iptables |\n|---|---|---|---|---|---|"
    );
    let _ = writeln!(
        o,
        "| {} | {} | {} | {:.1} GiB | {} | {} |\n",
        m.kernel, m.cpus, m.cpu_model, m.memory_gib, m.nft, m.iptables
    );
    let busiest = r
        .runs
        .iter()
        .map(|run| run.load_average)
        .fold(r.settings.load_average, f64::max);
    if busiest > m.cpus as f64 {
        let _ = writeln!(
            o,
            "**The machine was shared** with other work (builds and tests) during this run: the 1-minute load \
             average reached {busiest:.1} on {} CPUs (each run's is in the results, and in the upstream table \
             below). Timings are on contended CPUs; ratios measured side by side in the same run are fairer than \
             absolute figures.\n",
            m.cpus
        );
    }

    let _ = writeln!(o, "## Targets\n");
    let _ = writeln!(
        o,
        "Targets are for a 2-core machine. Missed ones are recorded as measured, with the profile that shows \
         where the time or memory goes ([below](#where-the-time-goes)).\n"
    );
    let _ = writeln!(o, "| target | measured | |\n|---|---|---|");
    for t in targets(r) {
        let mark = match t.met {
            Some(true) => "met".to_owned(),
            Some(false) => {
                let recorded: Vec<&String> = t
                    .profiles
                    .iter()
                    .filter(|p| profiles.iter().any(|q| &q.name == *p))
                    .collect();
                // One profile is "profile"; several are told apart by name.
                let links: Vec<String> = recorded
                    .iter()
                    .map(|p| {
                        let text = if recorded.len() == 1 {
                            "profile"
                        } else {
                            p.as_str()
                        };
                        format!("[{text}]({PROFILES_DIR}/{p}.txt)")
                    })
                    .collect();
                if links.is_empty() {
                    "**missed**".to_owned()
                } else {
                    format!("**missed**: {}", links.join(", "))
                }
            }
            None => "–".to_owned(),
        };
        let _ = writeln!(o, "| {} | {} | {mark} |", t.what, t.measured);
    }
    let _ = writeln!(o);

    let _ = writeln!(o, "## Clusters\n");
    let _ = writeln!(
        o,
        "N Services × {} endpoints, fed through the real source paths. Mix: 10% NodePort, 5% LoadBalancer with \
         source ranges, 5% ClientIP affinity, 10% multi-port (2 or 3 ports), one endpoint in 100 on this node \
         (generator: `crates/kp-test/src/cluster.rs`).\n",
        r.settings.endpoints
    );
    let _ = writeln!(o, "| Services | Service ports | endpoints | NodePort | LoadBalancer | affinity | multi-port |\n|---|---|---|---|---|---|---|");
    let mut sizes: Vec<&Run> = Vec::new();
    for run in &r.runs {
        if !sizes.iter().any(|s| s.services == run.services) {
            sizes.push(run);
        }
    }
    for run in &sizes {
        let x = &run.mix;
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {} | {} | {} |",
            thousands(x.services),
            thousands(x.service_ports),
            thousands(x.endpoints),
            thousands(x.node_port),
            thousands(x.load_balancer),
            thousands(x.affinity),
            thousands(x.multi_port)
        );
    }
    let _ = writeln!(o);

    let _ = writeln!(o, "## Sync cost\n");
    let _ = writeln!(
        o,
        "In-process through the mode's library dataplane. *Full sync* is a first full sync into a fresh network \
         namespace (median of {}, each into its own namespace); *render* is the planner alone; *apply* is the rest \
         (handing the input to the kernel tool, and its commit); *bare* loads the identical input with the kernel \
         tool alone into a fresh namespace (median of {}); *overhead* is full sync ÷ bare. A change replaces one \
         endpoint of one Service ({} changes, each timed from handing the state to the dataplane to its return); \
         the read-back check compares the kernel with the plan after them.\n",
        r.settings.repeats,
        r.settings.repeats,
        r.settings.changes
    );
    let _ = writeln!(o, "| mode | Services | render | apply | full sync | bare load | overhead | change p50 | change p99 | read-back check |\n|---|---|---|---|---|---|---|---|---|---|");
    for run in r
        .runs
        .iter()
        .filter(|run| run.full_sync.is_some() || run.bare.is_some() || run.incremental_ms.is_some())
    {
        let f = run.full_sync.as_ref();
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            run.mode,
            thousands(run.services),
            opt(f, |f| fmt_s(f.render.seconds)),
            opt(f, |f| fmt_s(f.apply_s)),
            opt(f, |f| fmt_s(f.total_s)),
            opt(run.bare.as_ref(), |b| format!(
                "{} (`{}`)",
                fmt_s(b.seconds),
                b.tool
            )),
            opt(run.bare.as_ref(), |b| format!("{:.2}×", b.overhead)),
            opt(run.incremental_ms, |s| format!("{:.1} ms", s.p50)),
            opt(run.incremental_ms, |s| format!("{:.1} ms", s.p99)),
            opt(run.verify.as_ref(), |v| format!(
                "{} ({} differences)",
                fmt_s(v.seconds),
                v.differences
            )),
        );
    }
    let kernel: Vec<&Run> = r
        .runs
        .iter()
        .filter(|run| run.kernel_memory.is_some())
        .collect();
    if !kernel.is_empty() {
        let _ = writeln!(
            o,
            "\nKernel memory of the dataplane's own objects after the changes, which the process's RSS does not \
             show (ebpf: its pinned BPF maps, each map's `memlock`; the size of a map is set by the configuration, \
             and hash maps are allocated in full when made).\n\n| mode | Services | kernel memory | largest |\n|---|---|---|---|"
        );
        for run in kernel {
            let Some(k) = &run.kernel_memory else {
                continue;
            };
            let largest: Vec<String> = k
                .objects
                .iter()
                .take(3)
                .map(|(n, m)| format!("`{n}` {m:.1} MiB"))
                .collect();
            let _ = writeln!(
                o,
                "| {} | {} | {:.1} MiB | {} |",
                run.mode,
                thousands(run.services),
                k.total_mib,
                largest.join(", ")
            );
        }
    }
    let _ = writeln!(o, "\n![Sync time against N](bench/sync_time.png)\n");

    let _ = writeln!(o, "## Programming latency and memory\n");
    let _ = writeln!(
        o,
        "The `kube-proxy` binary in a network namespace with `--iptables-min-sync-period=0`, fed by the manifest \
         directory (`--manifests`), by a fake API server (`--master`; *apiserver*) or by a real one (`--kubeconfig`; \
         *kube-apiserver*, [below](#against-upstream-on-a-real-api-server)). *Startup* runs from starting the process to \
         the whole cluster being live in the kernel. *Latency* runs from the change at the source (the rename of the \
         rewritten manifest file; the write of the new EndpointSlice sent to the API server, whose answer, etcd's \
         commit included, is shown apart) to the new endpoint being read back \
         from the kernel (polled every millisecond; every 20 ms with iptables-legacy, whose listing takes the xtables lock the \
         proxy's restores need), one change at a time, at least 20 ms apart (*changes*: how many; `--latency-changes`), spread evenly over \
         `--latency-span` seconds when it is given (*over*: how long the changes took). Periodic full syncs run at the default interval (30 s); *periodic syncs* counts those \
         that fell among the changes (the binary's `kubeproxy_sync_full_proxy_rules_duration_seconds` count, less \
         the first sync; in nftables mode a periodic sync is a read-back off the sync loop). Memory is the process's VmHWM (peak) and VmRSS (at the end).\n"
    );
    let _ = writeln!(o, "| mode | Services | source | startup | changes | over | periodic syncs among them | latency p50 | latency p99 | latency max | of which the API write, p50 · p99 | after the API's answer, p50 · p99 | peak RSS | RSS at end |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for run in &r.runs {
        for p in &run.proxy {
            let _ = writeln!(
                o,
                "| {} | {} | {} | {} | {} | {} | {} | {:.1} ms | {:.1} ms | {:.1} ms | {} | {} | {:.1} MiB | {:.1} MiB |",
                run.mode,
                thousands(run.services),
                p.source,
                fmt_s(p.startup_s),
                p.latency_ms.n,
                if p.changes_s > 0.0 {
                    fmt_s(p.changes_s)
                } else {
                    "–".into()
                },
                opt(crate::proxy::periodic_syncs(&p.metrics), |n| n.to_string()),
                p.latency_ms.p50,
                p.latency_ms.p99,
                p.latency_ms.max,
                api_write(p),
                after_api_write(p),
                p.peak_rss_mib,
                p.rss_mib
            );
        }
    }
    let _ = writeln!(o);

    upstream_section(&mut o, r);

    let _ = writeln!(o, "## Data path\n");
    if r.settings.datapath {
        let _ = writeln!(
            o,
            "A client pod opens new TCP connections to a server pod through the node: through a ClusterIP and straight \
             to the pod IP, with the N Services installed, and straight to the pod IP before any rule was loaded (*no \
             rules*: the physical limit of the lab). The client sends 64 bytes on each new connection, \
             reads the server's echo of them and resets it; latency is SYN to the echo's arrival (the first answer from \
             the pod), one client thread. {:.0} s per target, in two runs each after emptying the \
             node's conntrack table (with rules: two rounds running the targets in opposite orders). Bulk: {} MB \
             streams, median of the alternating transfers. Tail latencies of microsecond operations on a shared \
             2-core machine are noisy; read p99 ratios with that in mind.\n",
            r.settings.connect_seconds,
            r.settings.bulk_bytes / 1_000_000
        );
        let _ = writeln!(
            o,
            "| mode | Services | connections/s: ClusterIP · direct · no rules | p50: ClusterIP · direct · no rules | p99: ClusterIP · direct · no rules | ClusterIP ÷ direct, p50 · p99 | ClusterIP ÷ no rules, p50 · p99 | failed connects |\n|---|---|---|---|---|---|---|---|"
        );
        for run in &r.runs {
            let Some(d) = &run.datapath else { continue };
            let u = d.unloaded.as_ref();
            let _ = writeln!(
                o,
                "| {} | {} | {:.0} · {:.0} · {} | {:.0} · {:.0} · {} µs | {:.0} · {:.0} · {} µs | {:.2}× · {:.2}× | {} · {} | {} |",
                run.mode,
                thousands(run.services),
                d.vip.per_second,
                d.direct.per_second,
                opt(u, |u| format!("{:.0}", u.per_second)),
                d.vip.latency_us.p50,
                d.direct.latency_us.p50,
                opt(u, |u| format!("{:.0}", u.latency_us.p50)),
                d.vip.latency_us.p99,
                d.direct.latency_us.p99,
                opt(u, |u| format!("{:.0}", u.latency_us.p99)),
                d.latency_ratio_p50,
                d.latency_ratio_p99,
                opt(d.unloaded_ratio_p50, |v| format!("{v:.2}×")),
                opt(d.unloaded_ratio_p99, |v| format!("{v:.2}×")),
                d.vip.errors + d.direct.errors + u.map_or(0, |u| u.errors),
            );
        }
        let _ = writeln!(
            o,
            "\n| mode | Services | bulk ClusterIP | bulk direct | ratio |\n|---|---|---|---|---|"
        );
        for run in &r.runs {
            let Some(d) = &run.datapath else { continue };
            let _ = writeln!(
                o,
                "| {} | {} | {:.2} Gbit/s | {:.2} Gbit/s | {:.2}× |",
                run.mode,
                thousands(run.services),
                d.bulk_vip_gbps,
                d.bulk_direct_gbps,
                d.bulk_ratio
            );
        }
        if r.runs.iter().any(|run| run.mode == "userspace") {
            let _ = writeln!(
                o,
                "\nIn userspace mode the client's handshake completes with the proxy's own socket; the latency above \
                 still ends with the pod's echo, so it includes the proxy's accept, its connection to the pod and the \
                 relay both ways."
            );
        }
        let held: Vec<&Run> = r.runs.iter().filter(|run| run.held.is_some()).collect();
        if !held.is_empty() {
            let _ = writeln!(
                o,
                "\nMemory per open connection of a proxy that relays in the harness's process (userspace): \
                 connections opened from the client pod through the ClusterIP and held idle, the process's VmRSS \
                 before and after.\n\n| mode | Services | connections | RSS before | RSS after | per connection |\n|---|---|---|---|---|---|"
            );
            for run in held {
                let Some(h) = &run.held else { continue };
                let _ = writeln!(
                    o,
                    "| {} | {} | {} | {:.1} MiB | {:.1} MiB | {:.1} KiB |",
                    run.mode,
                    thousands(run.services),
                    thousands(h.connections),
                    h.rss_before_mib,
                    h.rss_after_mib,
                    h.kib_per_connection
                );
            }
        }
        let _ = writeln!(
            o,
            "\n![Connect latency against N](bench/connect_latency.png)\n"
        );
    } else {
        let _ = writeln!(o, "Not measured in this run (`--skip-datapath`).\n");
    }

    if notes.is_some() || !profiles.is_empty() {
        let _ = writeln!(o, "## Where the time goes\n");
        let _ = writeln!(
            o,
            "Profiles recorded with `bash scripts/profile.sh` (perf with the cpu-clock event over the process and \
             every child it starts, user and kernel code; heaptrack for memory). Each file in \
             [`{PROFILES_DIR}/`]({PROFILES_DIR}/) holds the full summary; the first lines of each are below.\n"
        );
        if let Some(notes) = notes {
            let _ = writeln!(o, "{}\n", notes.trim_end());
        }
        for p in profiles {
            let _ = writeln!(
                o,
                "### [{}]({PROFILES_DIR}/{}.txt)\n\n```text\n{}```\n",
                p.name,
                p.name,
                profile_excerpt(&p.text, 8)
            );
        }
    }

    let errors: Vec<String> = r
        .runs
        .iter()
        .flat_map(|run| {
            run.errors
                .iter()
                .map(move |e| format!("{} at {}: {e}", run.mode, thousands(run.services)))
        })
        .chain(plot_errors.iter().cloned())
        .collect();
    if !errors.is_empty() {
        let _ = writeln!(o, "## Failures in this run\n");
        for e in errors {
            let first = e.lines().next().unwrap_or_default();
            let _ = writeln!(o, "- {first}");
        }
        let _ = writeln!(o);
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_floor_target_is_met_at_or_above_its_floor_and_missed_below() {
        let met = at_least("x ≥ 0.8×", Some((0.8, "0.80×".into())), 0.8);
        assert_eq!(met.met, Some(true));
        let missed = at_least("x ≥ 0.8×", Some((0.79, "0.79×".into())), 0.8);
        assert_eq!(missed.met, Some(false));
        assert_eq!(missed.measured, "0.79×");
        assert_eq!(at_least("x ≥ 0.8×", None, 0.8).met, None);
    }

    #[test]
    fn userspace_rows_are_judged_from_its_runs() {
        let mut r = Results::default();
        let run = |n: usize, p99: f64, bulk: f64, p50_ratio: f64| Run {
            mode: "userspace".into(),
            services: n,
            incremental_ms: Some(crate::stats::Summary::of(&[p99])),
            datapath: Some(crate::results::Datapath {
                bulk_ratio: bulk,
                latency_ratio_p50: p50_ratio,
                ..Default::default()
            }),
            ..Run::default()
        };
        r.runs.push(run(1_000, 0.02, 0.9, 1.2));
        r.runs.push(run(30_000, 0.05, 0.5, 2.0));
        let t = targets(&r);
        let get = |prefix: &str| {
            t.iter()
                .find(|t| t.what.starts_with(prefix))
                .unwrap_or_else(|| panic!("{prefix}"))
                .met
        };
        assert_eq!(
            get("userspace, 30k: one-endpoint change p99 ≤ 1 ms"),
            Some(true)
        );
        // 0.05 ms against 0.02 ms is 2.5×: not flat.
        assert_eq!(
            get("userspace, 30k: one-endpoint change p99 ≤ 2×"),
            Some(false)
        );
        assert_eq!(get("userspace, 30k: bulk throughput"), Some(false));
        assert_eq!(get("userspace, 30k: connect latency"), Some(false));
    }

    #[test]
    fn each_target_kind_names_the_profiles_recorded_for_it() {
        let cases: [(&str, &[&str]); 14] = [
            ("nftables, 30k × 10: first full sync ≤ 3 s", &["nftables-full-30k"]),
            (
                "iptables-nft, 10k: one-endpoint change p99 ≤ 300 ms",
                &["iptables-nft-change-10k"],
            ),
            (
                "iptables-legacy, 10k × 10: peak RSS of kube-proxy ≤ 64 MiB (larger of the two sources)",
                &["iptables-legacy-memory-10k"],
            ),
            (
                "nftables, 30k: connect latency via ClusterIP ≤ 1.10× direct (p99)",
                &["nftables-datapath-vip-30k", "nftables-datapath-direct-30k"],
            ),
            (
                "nftables, 30k: connect latency via ClusterIP ≤ 1.10× direct (p50)",
                &["nftables-datapath-vip-30k", "nftables-datapath-direct-30k"],
            ),
            ("nftables, 10k: full sync over bare kernel load ≤ 1.3×", &[]),
            (
                "userspace, 30k: bulk throughput via ClusterIP ≥ 0.8× direct",
                &["userspace-bulk-vip-30k", "userspace-bulk-direct-30k"],
            ),
            (
                "userspace, 30k: one-endpoint change p99 ≤ 1 ms",
                &["userspace-change-30k"],
            ),
            (
                "nftables, 10k × 10, real API server: peak RSS ≤ 48 MiB",
                &["nftables-memory-kube-apiserver-10k"],
            ),
            (
                "nftables, 10k × 10, real API server: cluster live ≤ 1 s after start (list included)",
                &["nftables-startup-kube-apiserver-10k"],
            ),
            (
                "nftables, 10k, real API server: programming latency p99 ≤ 20 ms over periodic syncs",
                &["nftables-latency-kube-apiserver-10k"],
            ),
            (
                "nftables, 10k × 10 as YAML manifests: cluster live ≤ 1.5 s after start",
                &["nftables-startup-yaml-10k"],
            ),
            ("nftables, 100k × 10: first full sync ≤ 5 s", &["nftables-full-100k"]),
            (
                "nftables, 10k as YAML manifests: programming latency of a file change p50 ≤ 20 ms",
                &["nftables-startup-yaml-10k"],
            ),
        ];
        for (what, want) in cases {
            assert_eq!(profiles_for(what), want, "{what}");
        }
        // The rows as targets() writes them get the same names.
        let rows: Vec<Target> = targets(&Results::default())
            .into_iter()
            .filter(|t| t.what.starts_with("nftables") && t.what.contains("connect latency"))
            .collect();
        // Two against the direct path, one against a node with no rules.
        assert_eq!(rows.len(), 3);
        for t in rows {
            assert_eq!(
                t.profiles,
                ["nftables-datapath-vip-30k", "nftables-datapath-direct-30k"]
            );
        }
    }
}
