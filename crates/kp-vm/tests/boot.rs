//! Boots the real kernel under qemu. Marked "needs root" like every kernel test: the guest reads
//! the host's whole root over 9p, and scripts/test.sh installs qemu and the kernel only as root.

use kp_vm::{Error, Vm};

#[test]
#[ignore = "needs root"]
fn the_guest_kernel_has_ipvs_and_runs_the_hosts_tools() {
    if !kp_test::netns::require_root() {
        return;
    }
    let vm = Vm::new().expect("qemu, the kernel and busybox are installed");
    let run = vm
        .run("cat /proc/net/ip_vs; uname -r; ip -V; ls /run")
        .expect("the guest runs the script");
    eprintln!(
        "boot to script: {:?}, total: {:?}\n{}",
        run.boot, run.total, run.output
    );
    assert!(run.success(), "{}", run.console);
    // The IPVS table's header, as the ip_vs module prints it.
    assert!(
        run.output.contains("IP Virtual Server version"),
        "{}",
        run.output
    );
    assert!(run.output.contains(&vm.kernel().version), "{}", run.output);
    assert!(run.output.contains("iproute2"), "{}", run.output);
}

#[test]
#[ignore = "needs root"]
fn a_failing_guest_script_is_reported_with_its_status_and_output() {
    if !kp_test::netns::require_root() {
        return;
    }
    let vm = Vm::new().expect("qemu, the kernel and busybox are installed");
    let run = vm
        .modules(&["ip_vs"])
        .run("echo before; ls /no/such/file; echo after >&2; exit 7")
        .expect("the guest runs the script");
    assert_eq!(run.status, 7, "{}", run.console);
    assert!(!run.success());
    assert_eq!(run.output.lines().next(), Some("before"), "{}", run.output);
    assert!(run.output.contains("No such file"), "{}", run.output);
    assert!(run.output.trim_end().ends_with("after"), "{}", run.output);
}

#[test]
#[ignore = "needs root"]
fn a_module_that_does_not_exist_fails_the_set_up_not_the_script() {
    if !kp_test::netns::require_root() {
        return;
    }
    let vm = Vm::new().expect("qemu, the kernel and busybox are installed");
    let err = vm
        .modules(&["kp_no_such_module"])
        .run("exit 0")
        .expect_err("the set-up fails");
    match err {
        Error::Setup { reason, .. } => assert!(reason.contains("kp_no_such_module"), "{reason}"),
        other => panic!("expected a set-up failure, got {other}"),
    }
}
