//! The short fuzzing run CI does: a few thousand hostile objects through the whole pipeline,
//! with every invariant checked (see `kp_fuzz::Check`). The long run is the `kp-fuzz` binary
//! (README.md).

/// Objects in the CI run: about 15 s in a debug build on two cores (more when they are busy).
const OBJECTS: u64 = 6_000;

#[test]
fn fuzz_short_run() {
    let report = kp_fuzz::run(0x5eed, OBJECTS);
    println!("{report}");
    assert_eq!(report.objects, OBJECTS);
    // The run did reach every stage: most objects decode, many are accepted and many
    // rejected, and the planners ran.
    assert!(report.decoded > OBJECTS / 2, "{}", report.summary());
    assert!(report.accepted > OBJECTS / 10, "{}", report.summary());
    assert!(report.rejected > OBJECTS / 10, "{}", report.summary());
    assert!(report.plans > 100, "{}", report.summary());
    assert!(report.batch_elements > 0, "{}", report.summary());
    // The later modes' planners ran and had keys to check.
    assert!(report.userspace_elements > 0, "{}", report.summary());
    assert!(report.userspace_picks > 0, "{}", report.summary());
    assert!(report.ipvs_virtual_servers > 0, "{}", report.summary());
    assert!(report.ipset_entries > 0, "{}", report.summary());
    assert!(report.ebpf_ops > 0, "{}", report.summary());
    // Endpoints objects were accepted, served Services, and the precedence flipped.
    assert!(report.endpoints_accepted > 0, "{}", report.summary());
    assert!(report.mirrored_served > 0, "{}", report.summary());
    assert!(report.precedence_flips > 0, "{}", report.summary());
    assert_eq!(report.violation_count(), 0, "{report}");
}

#[test]
fn a_run_is_determined_by_its_seed() {
    let (a, b) = (kp_fuzz::run(7, 600), kp_fuzz::run(7, 600));
    let strip = |r: &kp_fuzz::Report| kp_fuzz::Report {
        elapsed: Default::default(),
        ..r.clone()
    };
    assert_eq!(strip(&a), strip(&b));
    assert_ne!(strip(&a), strip(&kp_fuzz::run(8, 600)));
}
