//! `bench vm`'s measurement, on the host (as root) at a small size: it runs, its result line is
//! well-formed JSON that reads back as a run, and the kernel holds the plan after the changes.
//! No timing is asserted. The guest side is the same program started through kp-ipvs's
//! `vm_run`; booting a guest here would make this crate's tests depend on qemu.

use std::process::Command;

use kp_bench::vm::{parse_result, HOST, RESULT_PREFIX};

#[test]
#[ignore = "needs root"]
fn a_measurement_prints_one_result_line_that_reads_back() {
    if !kp_test::netns::require_root() {
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_bench"))
        .args([
            "vm-measure",
            "--mode",
            "nftables",
            "--services",
            "50",
            "--changes",
            "3",
        ])
        .output()
        .expect("bench runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(
        stdout
            .lines()
            .filter(|l| l.starts_with(RESULT_PREFIX))
            .count(),
        1,
        "{stdout}"
    );
    let run = parse_result(&stdout).expect("the result line reads back");
    assert_eq!((run.mode.as_str(), run.place.as_str()), ("nftables", HOST));
    assert_eq!((run.services, run.endpoints_per_service), (50, 10));
    assert_eq!(run.mix.services, 50);
    assert!(run.full_sync_operations > 0, "{run:?}");
    assert_eq!(run.change_ms.n, 3, "{run:?}");
    assert!(run.change_operations_max > 0, "{run:?}");
    assert_eq!(
        run.differences, 0,
        "the kernel differs from the plan: {stderr}"
    );
    assert!(run.peak_rss_mib >= run.state_hwm_mib && run.state_hwm_mib > 0.0);
    // No re-list baseline outside ipvs, and no guest times on the host.
    assert!(run.relist_change_ms.is_none() && run.guest_total_s.is_none());
    assert!(stderr.contains("one-endpoint change: p50"), "{stderr}");
}

#[test]
fn an_unknown_mode_is_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_bench"))
        .args(["vm-measure", "--mode", "iptables", "--services", "5"])
        .output()
        .expect("bench runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("bench vm measures ipvs and nftables"));
}
