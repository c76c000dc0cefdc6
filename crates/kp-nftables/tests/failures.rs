//! A failing `nft`: the error is typed and counted, nothing panics, and the next sync rebuilds.

use std::sync::Arc;

use kp_core::track::Changes;
use kp_metrics::Metrics;
use kp_nftables::{Error, NftCommand, NftablesConfig, NftablesDataplane};

/// A stand-in for nft that fails (like a kernel refusing a transaction) until `ok` exists, and
/// then accepts everything without doing anything.
fn flaky_nft(dir: &std::path::Path) -> std::path::PathBuf {
    let script = dir.join("nft");
    let ok = dir.join("ok");
    kp_test::write_executable(
        &script,
        &format!(
            "#!/bin/sh\ncat >/dev/null\n[ -e {ok} ] && exit 0\necho '-:3:1-10: Error: Could not process rule: No such file or directory' >&2\nexit 1\n",
            ok = ok.display()
        ),
    )
    .unwrap();
    script
}

#[test]
fn a_refused_transaction_is_reported_counted_and_followed_by_a_rebuild() {
    let dir = std::env::temp_dir().join(format!("kp-nft-fail-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let metrics = Arc::new(Metrics::new());
    let nft = NftCommand::new().with_program(flaky_nft(&dir));
    let mut dp = NftablesDataplane::new(NftablesConfig::default(), nft, metrics.clone());
    let state = kp_flows::state();

    let err = dp.sync(&state, &Changes::default(), false).unwrap_err();
    match &err {
        Error::Transaction {
            failing_statement,
            stderr,
            ..
        } => {
            assert!(stderr.contains("No such file"), "{err}");
            // nft pointed at line 3; the error carries that statement for the log.
            assert!(
                failing_statement
                    .as_deref()
                    .is_some_and(|s| s.starts_with("add table")),
                "{err}"
            );
        }
        other => panic!("expected a transaction error, got {other}"),
    }
    assert_eq!(metrics.nftables_sync_failures.get(), 1);

    // Once nft works again, the next sync (even one asked to be partial) rebuilds everything.
    std::fs::write(dir.join("ok"), "").unwrap();
    let report = dp
        .sync(&state, &Changes::default(), false)
        .expect("second sync");
    assert!(
        report.full,
        "a sync after a failure must rebuild the tables"
    );
    assert!(dp.last_transaction().contains("delete table ip kube-proxy"));
    assert_eq!(metrics.nftables_sync_failures.get(), 1);
    let _ = std::fs::remove_dir_all(&dir);
}
