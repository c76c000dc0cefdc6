//! Smoke tests of the harness: the report and plot writer on a small synthetic result, and (as
//! root) a whole run at 50 Services in network namespaces. No timing is asserted anywhere: only
//! that every phase ran and produced its numbers.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kp_bench::cluster::{Cluster, MixOf};
use kp_bench::mode::Rendered;
use kp_bench::proxy::Source;
use kp_bench::report;
use kp_bench::results::{
    Bare, Connect, Datapath, FullSync, Machine, ProxyRun, Results, Run, Settings, Verify, FORMAT,
};
use kp_bench::stats::Summary;

fn summary(p50: f64, p99: f64, n: usize) -> Summary {
    Summary {
        n,
        p50,
        p90: (p50 + p99) / 2.0,
        p99,
        max: p99 * 1.2,
        mean: p50,
    }
}

/// A made-up run: `scale` grows the times with N.
fn run(mode: &str, services: usize, full_s: f64, change_p99_ms: f64) -> Run {
    let connect = |p50: f64| Connect {
        per_second: 10_000.0,
        latency_us: summary(p50, p50 * 2.0, 1000),
        errors: 0,
    };
    Run {
        mode: mode.into(),
        services,
        endpoints_per_service: 10,
        mix: Cluster::new(services, 10).mix(),
        full_sync: Some(FullSync {
            render: Rendered {
                seconds: full_s / 4.0,
                operations: services * 16,
                bytes: services * 700,
            },
            total_s: full_s,
            apply_s: full_s * 0.75,
            samples_s: vec![full_s],
            operations: services * 16,
            input_bytes: services * 700,
        }),
        bare: Some(Bare {
            tool: "nft -f".into(),
            seconds: full_s / 1.2,
            samples_s: vec![full_s / 1.2],
            overhead: 1.2,
            apply_overhead: 0.9,
        }),
        incremental_ms: Some(summary(change_p99_ms / 2.0, change_p99_ms, 100)),
        verify: Some(Verify {
            seconds: 0.1,
            differences: 0,
        }),
        proxy: vec![
            ProxyRun {
                source: "manifests".into(),
                startup_s: full_s * 2.0,
                latency_ms: summary(60.0, 90.0, 100),
                peak_rss_mib: services as f64 / 200.0,
                rss_mib: services as f64 / 250.0,
                ..ProxyRun::default()
            },
            ProxyRun {
                source: "apiserver".into(),
                startup_s: full_s * 2.5,
                latency_ms: summary(5.0, 30.0, 100),
                peak_rss_mib: services as f64 / 150.0,
                rss_mib: services as f64 / 200.0,
                ..ProxyRun::default()
            },
        ],
        datapath: Some(Datapath {
            vip: connect(31.0),
            direct: connect(30.0),
            latency_ratio_p50: 31.0 / 30.0,
            latency_ratio_p99: 31.0 / 30.0,
            rate_ratio: 1.0,
            bulk_vip_gbps: 10.0,
            bulk_direct_gbps: 11.0,
            bulk_ratio: 10.0 / 11.0,
            unloaded: Some(connect(29.0)),
            unloaded_ratio_p50: Some(31.0 / 29.0),
            unloaded_ratio_p99: Some(31.0 / 29.0),
            pinned: true,
        }),
        held: None,
        kernel_memory: None,
        errors: Vec::new(),
        load_average: 1.0,
    }
}

fn synthetic() -> Results {
    Results {
        format: FORMAT,
        started: "2026-01-02T03:04:05Z".into(),
        duration_s: 321.0,
        command: "target/release/bench --sizes 1000,10000,30000".into(),
        machine: Machine {
            kernel: "6.1.0-test".into(),
            cpus: 2,
            cpu_model: "Test CPU".into(),
            memory_gib: 24.0,
            nft: "nftables v1.0.6".into(),
            iptables: "iptables v1.8.9".into(),
            rustc: "rustc 1.95.0".into(),
        },
        settings: Settings {
            modes: vec!["nftables".into(), "other-mode".into()],
            sizes: vec![1000, 10_000, 30_000],
            endpoints: 10,
            changes: 100,
            repeats: 3,
            datapath: true,
            connect_seconds: 5.0,
            bulk_bytes: 1_000_000_000,
            proxy_binary: "target/release/kube-proxy".into(),
            sources: vec!["manifests".into(), "apiserver".into()],
            upstream_binary: String::new(),
            load_average: 1.0,
        },
        runs: vec![
            run("nftables", 1000, 0.2, 10.0),
            run("other-mode", 1000, 0.5, 40.0),
            run("nftables", 10_000, 0.8, 15.0),
            run("other-mode", 10_000, 4.0, 250.0),
            // Misses its full-sync target (≤ 3 s) on purpose.
            run("nftables", 30_000, 3.5, 18.0),
            run("other-mode", 30_000, 14.0, 900.0),
        ],
    }
}

/// Width and height from a PNG's IHDR chunk.
fn png_size(path: &Path) -> (u32, u32) {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(
        &bytes[..8],
        b"\x89PNG\r\n\x1a\n",
        "{} is not a PNG",
        path.display()
    );
    assert_eq!(&bytes[12..16], b"IHDR");
    let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    (be(&bytes[16..20]), be(&bytes[20..24]))
}

fn font_available() -> bool {
    std::env::var_os("KP_BENCH_FONT").is_some()
        || Path::new("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf").exists()
        || Path::new("/usr/share/fonts/dejavu/DejaVuSans.ttf").exists()
        || Path::new("/usr/share/fonts/TTF/DejaVuSans.ttf").exists()
}

#[test]
fn the_report_plots_and_results_file_are_written_from_a_synthetic_result() {
    let dir = tempfile::tempdir().unwrap();
    let results = synthetic();
    let written = report::write_all(dir.path(), &results, true).unwrap();

    // The results file reads back into the same report (floats may lose their last bit).
    let latest = dir.path().join("bench/results/latest.json");
    assert!(written.contains(&latest));
    assert!(dir
        .path()
        .join("bench/results/2026-01-02T03-04-05Z.json")
        .exists());
    let read = report::read_results(&latest).unwrap();
    assert_eq!(read.runs.len(), results.runs.len());
    assert_eq!(read.settings, results.settings);
    assert_eq!(
        report::markdown(&read, &[], &[], None),
        report::markdown(&results, &[], &[], None)
    );

    // Both plots, or (without a font) a report that says why not.
    let md = std::fs::read_to_string(dir.path().join("BENCHMARKS.md")).unwrap();
    for plot in ["bench/sync_time.png", "bench/connect_latency.png"] {
        let path = dir.path().join(plot);
        if font_available() {
            assert_eq!(png_size(&path), (1280, 480), "{plot}");
            assert!(
                md.contains(&format!("]({plot})")),
                "the report embeds {plot}"
            );
        } else {
            assert!(!path.exists());
            assert!(md.contains("fonts-dejavu-core"), "{md}");
        }
    }

    // The report: machine, command, tables with the numbers, targets met and missed.
    for want in [
        "| 6.1.0-test | 2 | Test CPU | 24.0 GiB | nftables v1.0.6 | iptables v1.8.9 |",
        "target/release/bench --sizes 1000,10000,30000",
        "| nftables, 10k × 10: first full sync ≤ 1 s | 0.80 s | met |",
        "| nftables, 30k × 10: first full sync ≤ 3 s | 3.50 s | **missed** |",
        "| nftables, 30k: one-endpoint change p99 ≤ 2× the 1k p99 | 1.80× (18.0 ms vs 10.0 ms) | met |",
        "| iptables-nft, 10k: first full sync ≤ 3 s | not measured | – |",
        "| nftables, 10k, minSyncPeriod 0: programming latency p99 ≤ 50 ms (API server source) | 30.0 ms | met |",
        "| other-mode, 10k × 10: peak RSS of kube-proxy ≤ 64 MiB (larger of the two sources) | 66.7 MiB (apiserver) | **missed** |",
        "| 30,000 | 33,600 | 300,000 | 3,000 | 1,500 | 1,500 | 3,000 |",
        "| other-mode | 10,000 | 1.000 s | 3.000 s | 4.000 s | 3.333 s (`nft -f`) | 1.20× | 125.0 ms | 250.0 ms |",
        // Not spread (no span), no metrics, no API write timed (nor what followed it): dashes.
        "| nftables | 10,000 | apiserver | 2.000 s | 100 | – | – | 5.0 ms | 30.0 ms | 36.0 ms | – | – | 66.7 MiB | 50.0 MiB |",
        "| nftables | 30,000 | 10000 · 10000 · 10000 | 31 · 30 · 29 µs | 62 · 60 · 58 µs | 1.03× · 1.03× | 1.07× · 1.07× | 0 |",
        "| nftables | 30,000 | 10.00 Gbit/s | 11.00 Gbit/s | 0.91× |",
    ] {
        assert!(md.contains(want), "BENCHMARKS.md lacks `{want}`:\n{md}");
    }
    assert!(!md.contains("Failures in this run"));
}

#[test]
fn missed_targets_link_their_recorded_profiles_and_the_report_excerpts_them() {
    let dir = tempfile::tempdir().unwrap();
    let profiles = dir.path().join("bench/profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    std::fs::write(
        profiles.join("nftables-full-30k.txt"),
        "# profile: nftables-full-30k\n# command: measure 30000 10\n#\n\
         # the measurement's own output:\n#   full sync 3.5 s\n\n\
         ## share of samples by program\n    61.00%  nft\n    39.00%  measure\n",
    )
    .unwrap();
    std::fs::write(profiles.join("NOTES.md"), "The kernel is the floor.\n").unwrap();
    report::write_all(dir.path(), &synthetic(), true).unwrap();
    let md = std::fs::read_to_string(dir.path().join("BENCHMARKS.md")).unwrap();
    // The missed 30k full sync links its profile; a missed target without one does not.
    assert!(md.contains(
        "| nftables, 30k × 10: first full sync ≤ 3 s | 3.50 s | **missed**: [profile](bench/profiles/nftables-full-30k.txt) |"
    ), "{md}");
    assert!(md.contains(
        "| other-mode, 10k × 10: peak RSS of kube-proxy ≤ 64 MiB (larger of the two sources) | 66.7 MiB (apiserver) | **missed** |"
    ), "{md}");
    // The section holds the notes and the profile's header and shares, not the tool's output.
    assert!(md.contains("## Where the time goes"));
    assert!(md.contains("The kernel is the floor."));
    assert!(md.contains("### [nftables-full-30k](bench/profiles/nftables-full-30k.txt)"));
    assert!(
        md.contains(
            "# command: measure 30000 10\n## share of samples by program\n    61.00%  nft\n"
        ),
        "{md}"
    );
    assert!(!md.contains("full sync 3.5 s"));
}

#[test]
fn a_missed_data_path_target_links_both_connect_profiles() {
    let dir = tempfile::tempdir().unwrap();
    let profiles = dir.path().join("bench/profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    for t in ["vip", "direct"] {
        std::fs::write(
            profiles.join(format!("nftables-datapath-{t}-30k.txt")),
            format!("# profile: nftables-datapath-{t}-30k\n\n## share of samples by program\n    50.00%  kp-connect\n"),
        )
        .unwrap();
    }
    let mut results = synthetic();
    let run = results
        .runs
        .iter_mut()
        .find(|r| r.mode == "nftables" && r.services == 30_000)
        .unwrap();
    run.datapath.as_mut().unwrap().latency_ratio_p99 = 1.13;
    report::write_all(dir.path(), &results, true).unwrap();
    let md = std::fs::read_to_string(dir.path().join("BENCHMARKS.md")).unwrap();
    assert!(md.contains(
        "| nftables, 30k: connect latency via ClusterIP ≤ 1.10× direct (p99) | 1.13× | **missed**: \
         [nftables-datapath-vip-30k](bench/profiles/nftables-datapath-vip-30k.txt), \
         [nftables-datapath-direct-30k](bench/profiles/nftables-datapath-direct-30k.txt) |"
    ), "{md}");
    // The p50 row is met: no links.
    assert!(
        md.contains(
            "| nftables, 30k: connect latency via ClusterIP ≤ 1.10× direct (p50) | 1.03× | met |"
        ),
        "{md}"
    );
    assert!(md.contains(
        "### [nftables-datapath-direct-30k](bench/profiles/nftables-datapath-direct-30k.txt)"
    ));
}

#[test]
fn a_failed_phase_is_listed_in_the_report() {
    let dir = tempfile::tempdir().unwrap();
    let mut results = synthetic();
    results.runs[0].datapath = None;
    results.runs[0]
        .errors
        .push("data path: the server did not start".into());
    report::write_all(dir.path(), &results, true).unwrap();
    let md = std::fs::read_to_string(dir.path().join("BENCHMARKS.md")).unwrap();
    assert!(md.contains("## Failures in this run"));
    assert!(md.contains("- nftables at 1,000: data path: the server did not start"));
}

#[test]
fn results_of_separate_runs_merge_into_one_report_with_later_runs_winning() {
    let mut a = synthetic();
    a.runs.retain(|r| r.mode == "nftables");
    a.settings.modes = vec!["nftables".into()];
    a.command = "bench --modes nftables".into();
    let mut b = synthetic();
    b.runs
        .retain(|r| r.mode == "other-mode" || r.services == 1000);
    b.runs.iter_mut().for_each(|r| {
        if let Some(f) = r.full_sync.as_mut() {
            f.total_s *= 10.0;
        }
    });
    b.settings.modes = vec!["other-mode".into(), "nftables".into()];
    b.command = "bench --modes other-mode".into();
    let m = Results::merge(vec![a, b]).unwrap();
    assert_eq!(m.modes(), ["nftables", "other-mode"]);
    let order: Vec<(usize, &str)> = m
        .runs
        .iter()
        .map(|r| (r.services, r.mode.as_str()))
        .collect();
    assert_eq!(
        order,
        [
            (1000, "nftables"),
            (1000, "other-mode"),
            (10_000, "nftables"),
            (10_000, "other-mode"),
            (30_000, "nftables"),
            (30_000, "other-mode"),
        ]
    );
    // The second file's 1k nftables run replaced the first's; its 10k one stayed.
    assert_eq!(
        m.run("nftables", 1000)
            .unwrap()
            .full_sync
            .as_ref()
            .unwrap()
            .total_s,
        2.0
    );
    assert_eq!(
        m.run("nftables", 10_000)
            .unwrap()
            .full_sync
            .as_ref()
            .unwrap()
            .total_s,
        0.8
    );
    assert_eq!(
        m.command,
        "bench --modes nftables\nbench --modes other-mode"
    );
    assert!(Results::merge(Vec::new()).is_none());
}

/// The settings every smoke run starts from: `modes` at one `size` of 3 endpoints per Service,
/// 5 changes (3 through the binary), one repeat, a short data path on pinned CPUs, the binary
/// (if built) through the manifest directory and the fake API server, results under `root`.
fn smoke_options(
    modes: &[&str],
    size: usize,
    root: &Path,
    proxy: Option<PathBuf>,
) -> kp_bench::run::Options {
    kp_bench::run::Options {
        modes: modes.iter().map(|m| m.to_string()).collect(),
        sizes: vec![size],
        endpoints: 3,
        changes: 5,
        latency_changes: 3,
        upstream_changes: 3,
        latency_span: None,
        repeats: 1,
        skip_datapath: false,
        skip_proxy: proxy.is_none(),
        skip_sync: false,
        sources: vec![Source::Manifests, Source::ApiServer],
        upstream: None,
        upstream_binary: None,
        connect_seconds: 0.4,
        connect_threads: 1,
        bulk_bytes: 10_000_000,
        bulk_repeats: 1,
        pinning: kp_bench::datapath::Pinning::for_machine(
            std::thread::available_parallelism().map_or(1, |n| n.get()),
        ),
        perf: None,
        proxy_binary: proxy.unwrap_or_default(),
        bench_binary: PathBuf::from(env!("CARGO_BIN_EXE_bench")),
        root: root.to_path_buf(),
        command: format!("bench --modes {} --sizes {size}", modes.join(",")),
    }
}

/// The kube-proxy binary next to the bench binary this test was built with, if it was built.
fn proxy_binary() -> Option<PathBuf> {
    let bench = PathBuf::from(env!("CARGO_BIN_EXE_bench"));
    let p = bench.parent()?.join("kube-proxy");
    p.is_file().then_some(p)
}

/// Control and acknowledgement fifos in `dir` standing in for perf's: every command read is
/// acknowledged, and sent to the receiver with the time it came. The stand-in keeps both fifos
/// open for reading and writing, as perf does, so it never sees an end and no open waits.
fn perf_fifo(
    dir: &Path,
) -> (
    kp_bench::datapath::PerfSwitch,
    std::sync::mpsc::Receiver<(String, std::time::Instant)>,
) {
    use std::io::{BufRead, Write};
    let fifo = |name: &str| {
        let p = dir.join(name);
        assert!(std::process::Command::new("mkfifo")
            .arg(&p)
            .status()
            .unwrap()
            .success());
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        (p, f)
    };
    let ((ctl, ctl_file), (ack, mut ack_file)) = (fifo("perf.ctl"), fifo("perf.ack"));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(ctl_file).lines() {
            let Ok(line) = line else { return };
            let at = std::time::Instant::now();
            // As perf writes it: with the string's NUL.
            if ack_file.write_all(b"ack\n\0").is_err() || tx.send((line, at)).is_err() {
                return;
            }
        }
    });
    let switch = kp_bench::datapath::PerfSwitch {
        fifo: ctl,
        ack: Some(ack),
        event: Some("cpu-clock".into()),
    };
    (switch, rx)
}

/// What came through a [`perf_fifo`]: `expected` commands (waiting up to 5 s for each, as the
/// reader may lag the writer), then any more that arrive within 0.2 s.
fn received(
    rx: &std::sync::mpsc::Receiver<(String, std::time::Instant)>,
    expected: usize,
) -> Vec<(String, std::time::Instant)> {
    let mut got = Vec::new();
    while got.len() < expected {
        match rx.recv_timeout(std::time::Duration::from_secs(5)) {
            Ok(c) => got.push(c),
            Err(_) => break,
        }
    }
    std::thread::sleep(std::time::Duration::from_millis(200));
    got.extend(rx.try_iter());
    got
}

#[test]
fn the_connect_client_turns_perf_on_for_its_measured_seconds_alone() {
    if !kp_test::netns::require_root() {
        return;
    }
    let ns = kp_test::Netns::new("bench-perfctl").unwrap();
    let bench = env!("CARGO_BIN_EXE_bench");
    let mut server = ns
        .spawn(&[
            bench,
            "datapath-server",
            "--connect",
            "127.0.0.1:7001",
            "--bulk",
            "127.0.0.1:7002",
        ])
        .unwrap();
    server
        .wait_for_log(
            kp_bench::datapath::READY,
            std::time::Duration::from_secs(10),
        )
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (perf, commands) = perf_fifo(dir.path());
    let ctl = format!(
        "{},{}",
        perf.fifo.display(),
        perf.ack.as_ref().unwrap().display()
    );
    let began = std::time::Instant::now();
    let out = ns
        .exec(&[
            bench,
            "datapath-client",
            "connect",
            "--target",
            "127.0.0.1:7001",
            "--seconds",
            "0.5",
            "--perf-ctl",
            &ctl,
            "--perf-event",
            "cpu-clock",
        ])
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let samples: kp_bench::datapath::ConnectSamples = serde_json::from_slice(&out.stdout).unwrap();
    assert!(!samples.latency_us.is_empty(), "{:?}", samples.error_kinds);
    let got = received(&commands, 2);
    let names: Vec<&str> = got.iter().map(|(c, _)| c.as_str()).collect();
    assert_eq!(names, ["enable cpu-clock", "disable cpu-clock"]);
    // On after the 0.3 s warm-up, off after the 0.5 s measured.
    let on = got[0].1.duration_since(began);
    let on_for = got[1].1.duration_since(got[0].1);
    assert!(on >= std::time::Duration::from_millis(300), "{on:?}");
    assert!(
        on_for >= std::time::Duration::from_millis(450),
        "{on_for:?}"
    );
}

#[test]
fn a_tiny_run_in_network_namespaces_measures_every_phase() {
    if !kp_test::netns::require_root() {
        return;
    }
    let proxy = proxy_binary();
    if proxy.is_none() {
        let banner = "!".repeat(72);
        eprintln!(
            "\n{banner}\n!! kube-proxy is not built next to {}: the binary phases are SKIPPED.\n!! Build it first: cargo build -p kube-proxy\n{banner}\n",
            env!("CARGO_BIN_EXE_bench")
        );
    }
    let dir = tempfile::tempdir().unwrap();
    // perf samples the ClusterIP's connect runs: two of them, out of six runs in all.
    let (switch, perf_commands) = perf_fifo(dir.path());
    let opts = kp_bench::run::Options {
        latency_changes: 4,
        repeats: 2,
        perf: Some(kp_bench::datapath::PerfControl {
            switch,
            target: kp_bench::datapath::PerfTarget::Connect { vip: true },
        }),
        sources: vec![Source::Manifests, Source::ManifestsYaml, Source::ApiServer],
        // Two changes a second: the run spans two seconds.
        latency_span: Some(Duration::from_secs(2)),
        command: "bench --sizes 50".into(),
        ..smoke_options(&["nftables"], 50, dir.path(), proxy.clone())
    };
    let results = kp_bench::run::run(&opts).unwrap();
    assert_eq!(results.runs.len(), 1);
    let r = &results.runs[0];
    assert!(r.errors.is_empty(), "phases failed: {:#?}", r.errors);
    let full = r.full_sync.as_ref().expect("full sync measured");
    assert_eq!(full.samples_s.len(), 2);
    assert!(full.total_s > 0.0 && full.render.operations > 0 && full.input_bytes > 0);
    let bare = r.bare.as_ref().expect("bare load measured");
    assert!(bare.seconds > 0.0 && bare.overhead > 0.0);
    assert_eq!(r.incremental_ms.expect("changes measured").n, 5);
    assert_eq!(r.verify.as_ref().expect("read back").differences, 0);
    let d = r.datapath.as_ref().expect("data path measured");
    assert!(d.vip.latency_us.n > 0 && d.direct.latency_us.n > 0);
    assert!(d.unloaded.as_ref().is_some_and(|u| u.latency_us.n > 0));
    assert!(d.unloaded_ratio_p50.is_some_and(|v| v > 0.0));
    assert!(d.bulk_vip_gbps > 0.0 && d.bulk_direct_gbps > 0.0);
    let commands: Vec<String> = received(&perf_commands, 4)
        .into_iter()
        .map(|(c, _)| c)
        .collect();
    assert_eq!(
        commands,
        [
            "enable cpu-clock",
            "disable cpu-clock",
            "enable cpu-clock",
            "disable cpu-clock"
        ]
    );
    if proxy.is_some() {
        let sources: Vec<&str> = r.proxy.iter().map(|p| p.source.as_str()).collect();
        assert_eq!(sources, ["manifests", "manifests-yaml", "apiserver"]);
        for p in &r.proxy {
            assert_eq!(p.latency_ms.n, 4, "{}", p.source);
            assert!(
                kp_bench::proxy::periodic_syncs(&p.metrics).is_some(),
                "{}: no full-sync count in {:?}",
                p.source,
                p.metrics
            );
            assert!(p.peak_rss_mib > 0.0 && p.startup_s > 0.0, "{}", p.source);
        }
    }
    assert!(dir.path().join("BENCHMARKS.md").exists());
    assert!(dir.path().join("bench/results/latest.json").exists());
}

#[test]
fn a_tiny_run_of_both_iptables_backends_measures_sync_bare_load_and_the_binary() {
    if !kp_test::netns::require_root() {
        return;
    }
    let proxy = proxy_binary();
    let dir = tempfile::tempdir().unwrap();
    let opts = kp_bench::run::Options {
        endpoints: 2,
        changes: 3,
        skip_datapath: true,
        connect_seconds: 0.0,
        bulk_bytes: 0,
        bulk_repeats: 0,
        command: "bench --sizes 30".into(),
        ..smoke_options(
            &["iptables-nft", "iptables-legacy"],
            30,
            dir.path(),
            proxy.clone(),
        )
    };
    let results = kp_bench::run::run(&opts).unwrap();
    let modes: Vec<&str> = results.runs.iter().map(|r| r.mode.as_str()).collect();
    assert_eq!(modes, ["iptables-nft", "iptables-legacy"]);
    for r in &results.runs {
        assert!(
            r.errors.is_empty(),
            "{}: phases failed: {:#?}",
            r.mode,
            r.errors
        );
        assert!(
            r.full_sync.as_ref().is_some_and(|f| f.total_s > 0.0),
            "{}",
            r.mode
        );
        let bare = r.bare.as_ref().expect("bare load measured");
        assert!(
            bare.tool.starts_with(&format!("{}-restore", r.mode)),
            "{}",
            bare.tool
        );
        assert_eq!(r.incremental_ms.expect("changes measured").n, 3);
        assert_eq!(r.verify.as_ref().expect("read back").differences, 0);
        assert!(r.datapath.is_none());
        if proxy.is_some() {
            assert_eq!(r.proxy.len(), 2, "{}", r.mode);
            assert!(r.proxy.iter().all(|p| p.latency_ms.n == 3));
        }
    }
}

#[test]
fn a_tiny_userspace_run_measures_sync_the_relayed_data_path_memory_per_connection_and_the_binary() {
    if !kp_test::netns::require_root() {
        return;
    }
    let proxy = proxy_binary();
    let dir = tempfile::tempdir().unwrap();
    let opts = kp_bench::run::Options {
        command: "bench --modes userspace --sizes 40".into(),
        ..smoke_options(&["userspace"], 40, dir.path(), proxy.clone())
    };
    let results = kp_bench::run::run(&opts).unwrap();
    let r = &results.runs[0];
    assert_eq!(r.mode, "userspace");
    assert!(r.errors.is_empty(), "phases failed: {:#?}", r.errors);
    let full = r.full_sync.as_ref().expect("full sync measured");
    assert!(full.total_s > 0.0 && full.render.operations > 0);
    assert!(r.bare.as_ref().is_some_and(|b| b.tool == "nft -f -"));
    assert_eq!(r.incremental_ms.expect("changes measured").n, 5);
    assert_eq!(r.verify.as_ref().expect("read back").differences, 0);
    let d = r.datapath.as_ref().expect("data path measured");
    // Every connection through the ClusterIP went through this process's relays.
    assert!(d.vip.latency_us.n > 0 && d.vip.errors == 0, "{d:?}");
    assert!(d.bulk_vip_gbps > 0.0);
    let held = r.held.as_ref().expect("connections held");
    assert_eq!(held.connections, 2000);
    assert!(held.rss_after_mib > 0.0);
    if proxy.is_some() {
        assert_eq!(r.proxy.len(), 2);
        for p in &r.proxy {
            // No kernel read sees an endpoint change in this mode: start-up and memory only.
            assert_eq!(p.latency_ms.n, 0, "{}", p.source);
            assert!(p.peak_rss_mib > 0.0 && p.startup_s > 0.0, "{}", p.source);
        }
    }
    let report = std::fs::read_to_string(dir.path().join("BENCHMARKS.md")).unwrap();
    assert!(report.contains("| userspace | 40 | 2,000 |"), "{report}");
}

/// The ebpf mode's scratch directories (under the temporary directory) and cgroups (under the
/// cgroup v2 root) of process `pid` that exist now.
fn ebpf_scratch_of(pid: u32) -> Vec<PathBuf> {
    let prefix = format!("kp-bench-ebpf-{pid}-");
    let root = kp_ebpf::cgroup::find_cgroup2_root().unwrap().unwrap();
    [std::env::temp_dir(), root]
        .iter()
        .flat_map(|d| std::fs::read_dir(d).unwrap().flatten())
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect()
}

#[test]
fn a_tiny_ebpf_run_measures_sync_the_data_path_from_its_cgroup_and_the_binary_and_cleans_up() {
    if !kp_test::netns::require_root() {
        return;
    }
    let proxy = proxy_binary();
    let dir = tempfile::tempdir().unwrap();
    let opts = kp_bench::run::Options {
        repeats: 2,
        command: "bench --modes ebpf --sizes 40".into(),
        ..smoke_options(&["ebpf"], 40, dir.path(), proxy.clone())
    };
    let results = kp_bench::run::run(&opts).unwrap();
    let r = &results.runs[0];
    assert_eq!(r.mode, "ebpf");
    assert!(r.errors.is_empty(), "phases failed: {:#?}", r.errors);
    let full = r.full_sync.as_ref().expect("full sync measured");
    assert_eq!(full.samples_s.len(), 2);
    assert!(full.total_s > 0.0 && full.render.operations > 0);
    // The sync wrote what the render planned: the same map updates.
    assert_eq!(full.operations, full.render.operations);
    // No kernel tool loads the maps: no bare baseline.
    assert!(r.bare.is_none());
    assert_eq!(r.incremental_ms.expect("changes measured").n, 5);
    assert_eq!(r.verify.as_ref().expect("read back").differences, 0);
    let d = r.datapath.as_ref().expect("data path measured");
    // The node holds no rule for the ClusterIP: only the hooks on the clients' cgroup make it
    // answer.
    assert!(d.vip.latency_us.n > 0 && d.vip.errors == 0, "{d:?}");
    assert!(d.direct.latency_us.n > 0, "{d:?}");
    assert!(d.bulk_vip_gbps > 0.0 && d.bulk_direct_gbps > 0.0);
    if proxy.is_some() {
        let sources: Vec<&str> = r.proxy.iter().map(|p| p.source.as_str()).collect();
        assert_eq!(sources, ["manifests", "apiserver"]);
        for p in &r.proxy {
            assert_eq!(p.latency_ms.n, 3, "{}", p.source);
            assert!(p.peak_rss_mib > 0.0 && p.startup_s > 0.0, "{}", p.source);
        }
    }
    assert_eq!(
        ebpf_scratch_of(std::process::id()),
        Vec::<PathBuf>::new(),
        "left behind"
    );
}

/// The network namespaces `bench` process `pid` has now.
fn namespaces_of(pid: u32) -> Vec<String> {
    let out = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .unwrap();
    let prefix = format!("kpt-{pid}-");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(&prefix))
        .map(str::to_string)
        .collect()
}

#[test]
fn an_interrupted_run_removes_its_namespaces_and_the_processes_in_them() {
    if !kp_test::netns::require_root() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_bench"))
        .args([
            "--modes",
            "nftables",
            "--sizes",
            "50",
            "--endpoints",
            "2",
            "--repeats",
            "1",
            "--skip-proxy",
            "--connect-seconds",
            "30",
            "--root",
        ])
        .arg(dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    // Wait for the data path: its server runs inside one of the run's namespaces.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let inside: Vec<String> = loop {
        let pids: Vec<String> = namespaces_of(pid)
            .iter()
            .filter_map(|n| {
                std::process::Command::new("ip")
                    .args(["netns", "pids", n])
                    .output()
                    .ok()
            })
            .flat_map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .split_whitespace()
                    .map(str::to_string)
                    .collect::<Vec<_>>()
            })
            .collect();
        if !pids.is_empty() {
            break pids;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no process ran in bench's namespaces within 60 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let status = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = child.wait().unwrap();
    assert_eq!(exit.code(), Some(143), "{exit:?}");
    assert!(
        namespaces_of(pid).is_empty(),
        "left behind: {:?}",
        namespaces_of(pid)
    );
    // Nor the logs of what it started in them (the data path's server among them).
    let logs: Vec<String> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("kpt-{pid}-")) && n.ends_with(".log"))
        .collect();
    assert!(logs.is_empty(), "logs left behind: {logs:?}");
    // Killed, then reaped by init once bench is gone.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while inside
        .iter()
        .any(|p| Path::new(&format!("/proc/{p}")).exists())
    {
        assert!(
            std::time::Instant::now() < deadline,
            "processes of the run still alive: {inside:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn an_interrupted_ebpf_run_removes_its_cgroups_and_bpffs_mounts() {
    if !kp_test::netns::require_root() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_bench"))
        .args([
            "--modes",
            "ebpf",
            "--sizes",
            "40",
            "--endpoints",
            "3",
            "--changes",
            "5",
            "--repeats",
            "1",
            "--skip-proxy",
            "--connect-seconds",
            "16",
            "--root",
        ])
        .arg(dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    // Wait for the dataplane's cgroup and bpffs (made after the data path's 16 s without
    // rules), then into the connect runs (a client inside the cgroup, most of the time).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while ebpf_scratch_of(pid).len() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "no ebpf scratch of bench within 60 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    std::thread::sleep(std::time::Duration::from_secs(4));
    let status = std::process::Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = child.wait().unwrap();
    assert_eq!(exit.code(), Some(130), "{exit:?}");
    assert_eq!(ebpf_scratch_of(pid), Vec::<PathBuf>::new(), "left behind");
    assert!(namespaces_of(pid).is_empty(), "{:?}", namespaces_of(pid));
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains(&format!("kp-bench-ebpf-{pid}-")),
        "mounts left behind:\n{mounts}"
    );
}

#[test]
fn a_tiny_run_against_a_real_api_server_measures_our_binary_and_upstreams_side_by_side() {
    if !kp_test::netns::require_root() {
        return;
    }
    if let Some(why) = kp_test::kube_apiserver::unavailable() {
        eprintln!("SKIPPED: no real API server here: {why}");
        return;
    }
    let Some(proxy) = proxy_binary() else {
        eprintln!("SKIPPED: no kube-proxy binary built next to bench");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let opts = kp_bench::run::Options {
        endpoints: 2,
        changes: 3,
        skip_datapath: true,
        skip_proxy: false,
        skip_sync: true,
        sources: vec![Source::KubeApiServer],
        upstream: Some(kp_bench::upstream::UpstreamBackend::Legacy),
        connect_seconds: 0.0,
        bulk_bytes: 0,
        bulk_repeats: 0,
        proxy_binary: proxy,
        command: "bench --modes nftables --sizes 20 --sources kube-apiserver --skip-sync".into(),
        ..smoke_options(&["nftables"], 20, dir.path(), None)
    };
    let results = kp_bench::run::run(&opts).unwrap();
    let modes: Vec<&str> = results.runs.iter().map(|r| r.mode.as_str()).collect();
    assert_eq!(modes, ["nftables", "upstream-iptables-legacy"]);
    for r in &results.runs {
        assert!(
            r.errors.is_empty(),
            "{}: phases failed: {:#?}",
            r.mode,
            r.errors
        );
        // --skip-sync: the binaries alone.
        assert!(r.full_sync.is_none() && r.bare.is_none());
        assert_eq!(r.proxy.len(), 1, "{}", r.mode);
        let p = &r.proxy[0];
        assert_eq!(p.source, "kube-apiserver");
        assert!(p.startup_s > 0.0);
        assert_eq!(p.latency_ms.n, 3, "{}", r.mode);
        assert!(p.peak_rss_mib > 0.0);
        // Both proxies' own metrics were read: at least the first sync and the three changes.
        let syncs = p
            .metrics
            .get("kubeproxy_sync_proxy_rules_duration_seconds_count")
            .copied()
            .unwrap_or_default();
        assert!(syncs >= 1.0, "{}: {:?}", r.mode, p.metrics);
    }
    let md = std::fs::read_to_string(dir.path().join("BENCHMARKS.md")).unwrap();
    assert!(md.contains("upstream-iptables-legacy"), "{md}");
    // No real API server outlives the run.
    assert_eq!(kp_test::kube_apiserver::stop_all(), 0);
}
