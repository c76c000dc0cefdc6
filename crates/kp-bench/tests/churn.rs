//! Smoke test of `bench churn` (as root): a tiny churn soak of the real binary through the fake
//! API server, in network namespaces the harness creates. Nothing about timing is asserted: only
//! that the soak ran, its result line parses, the kernel equals the plan at quiescence, and the
//! results file and plot were written.
//!
//! Needs the kube-proxy binary built next to the bench binary (`cargo build -p kube-proxy`):
//! `cargo test -p kp-bench --locked -- --include-ignored`.

use std::path::PathBuf;

use kp_bench::churn::{parse_line, ChurnResults, LINE_KEYS};

/// The kube-proxy binary next to the bench binary this test was built with.
fn proxy_binary() -> PathBuf {
    let bench = PathBuf::from(env!("CARGO_BIN_EXE_bench"));
    let p = bench
        .parent()
        .map(|d| d.join("kube-proxy"))
        .unwrap_or_default();
    assert!(
        p.is_file(),
        "no kube-proxy at {}: build it first (cargo build -p kube-proxy)",
        p.display()
    );
    p
}

/// Runs `bench churn ARGS` with its results under `root`; returns its exit status, its standard
/// output and its standard error.
fn churn(root: &std::path::Path, args: &[&str]) -> (std::process::ExitStatus, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_bench"))
        .arg("churn")
        .args(args)
        .arg("--proxy-binary")
        .arg(proxy_binary())
        .arg("--root")
        .arg(root)
        .output()
        .unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
#[ignore = "needs root"]
fn a_tiny_churn_ends_with_the_kernel_equal_to_the_plan_and_one_parsable_line() {
    assert!(
        kp_test::netns::require_root(),
        "this test needs root (network namespaces)"
    );
    let dir = tempfile::tempdir().unwrap();
    let (status, stdout, stderr) = churn(
        dir.path(),
        &["--services", "200", "--rate", "50", "--seconds", "5"],
    );
    assert!(status.success(), "{status}\n{stdout}\n{stderr}");
    // The result line is the only line on standard output; progress goes to standard error.
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "{stdout}");
    let v = parse_line(lines[0]).unwrap();
    assert_eq!(v.len(), LINE_KEYS.len());
    assert_eq!(v["mode"], "nftables");
    assert_eq!(v["services"], "200");
    assert_eq!(v["seconds"], "5");
    assert_eq!(v["target_rate"], "50");
    assert_eq!(v["kernel_equals_plan"], "true", "{stderr}");
    for key in &LINE_KEYS[4..11] {
        let n: f64 = v[*key].parse().unwrap_or_else(|e| panic!("{key}: {e}"));
        assert!(n.is_finite(), "{key}");
    }
    assert!(v["changes"].parse::<usize>().unwrap() > 0);
    assert!(v["latency_p99_ms"].parse::<f64>().unwrap() > 0.0);
    assert!(v["vmhwm_end_mib"].parse::<f64>().unwrap() > 0.0);
    assert!(stderr.contains("the kernel equals the plan"), "{stderr}");

    let json = dir.path().join("bench/results/churn-latest.json");
    let r: ChurnResults = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(r.line, lines[0]);
    assert!(r.errors.is_empty(), "{:#?}", r.errors);
    assert!(r.proxy_exit.is_none());
    assert_eq!(r.pace.api_resource_versions, r.pace.changes as u64);
    assert!(r.quiescence.is_some());
    let k = r.kernel.as_ref().unwrap();
    assert!(
        k.equal && k.differences == 0 && k.replay_syncs >= 2,
        "{k:?}"
    );
    // One sample a second over 5 s of churn, and more until the check ended.
    assert!(r.memory.samples.len() >= 5, "{:?}", r.memory.samples);
    assert!(r.latency_ms.n > 0 && r.latency_samples.len() == r.latency_ms.n);
    // The plot needs a font; without one the run says so and still passes.
    let plot = dir.path().join(kp_bench::plot::CHURN);
    assert!(
        plot.exists() || stderr.contains("not drawn"),
        "no plot at {} and no reason given:\n{stderr}",
        plot.display()
    );
}

#[test]
fn bad_settings_exit_64_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    for args in [
        &["--rate", "0"][..],
        &["--services", "0"],
        &["--mode", "ipvs"],
        &["--probes-per-second", "0"],
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_bench"))
            .arg("churn")
            .args(args)
            .arg("--root")
            .arg(dir.path())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(64), "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}
