//! kp-alloc's settings as a process allocating with mimalloc sees them (`kp-alloc-probe`, run
//! in a child process so that each run starts mimalloc afresh with the environment it is given).

use std::process::Command;

const PROBE: &str = env!("CARGO_BIN_EXE_kp-alloc-probe");

/// Runs the probe with `args` and only `env` of mimalloc's variables; returns its output.
fn probe(args: &[&str], env: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(PROBE);
    cmd.args(args);
    for (name, _) in std::env::vars() {
        if name.starts_with("MIMALLOC_") {
            cmd.env_remove(name);
        }
    }
    cmd.envs(env.iter().copied());
    let out = cmd.output().expect("run kp-alloc-probe");
    assert!(
        out.status.success(),
        "kp-alloc-probe {args:?} failed: {out:?}"
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

/// `returned_kib` over `grown_kib` of the probe's churn line `label`.
fn returned_share(churn: &str, label: &str) -> f64 {
    let line = churn
        .lines()
        .find(|l| l.starts_with(&format!("{label}:")))
        .unwrap_or_else(|| panic!("no {label} line in {churn:?}"));
    let field = |name: &str| -> f64 {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {line:?}"))
    };
    let grown = field("grown_kib=");
    assert!(
        grown >= 32.0 * 1024.0,
        "{label}: the probe's 64 MiB did not show: {line:?}"
    );
    field("returned_kib=") / grown
}

#[test]
fn without_the_environment_arenas_commit_on_demand_and_freed_pages_are_purged_at_once() {
    assert_eq!(
        probe(&["settings"], &[]).trim(),
        "arena_eager_commit=0 purge_delay_ms=0"
    );
}

#[test]
fn the_operators_environment_still_wins_and_names_the_same_options() {
    // Also checks the option numbers: mimalloc reads these two variables into exactly the
    // options the crate sets and reports.
    let out = probe(
        &["settings"],
        &[
            ("MIMALLOC_ARENA_EAGER_COMMIT", "1"),
            ("MIMALLOC_PURGE_DELAY", "123"),
        ],
    );
    assert_eq!(out.trim(), "arena_eager_commit=1 purge_delay_ms=123");
}

#[test]
fn freed_memory_leaves_the_resident_set_at_once() {
    let ours = probe(&["churn"], &[]);
    for label in ["large", "small"] {
        let share = returned_share(&ours, label);
        assert!(
            share >= 0.9,
            "{label}: freeing gave back {share:.2} of the growth: {ours}"
        );
    }
    // mimalloc's own defaults (eager arenas, purge after 1 s) keep it: what the settings change.
    let defaults = probe(
        &["churn"],
        &[
            ("MIMALLOC_ARENA_EAGER_COMMIT", "2"),
            ("MIMALLOC_PURGE_DELAY", "1000"),
        ],
    );
    let share = returned_share(&defaults, "large");
    assert!(
        share < 0.5,
        "mimalloc's defaults gave back {share:.2}: {defaults}"
    );
}
