//! Running a test in the kp-vm guest (`crates/kp-vm`): Debian's kernel, which has IPVS, under
//! qemu with TCG. On the host, [`in_guest`] boots the guest and re-runs the named test of the
//! same test binary there (`KP_VM_GUEST` set), where it runs for real; the host then only
//! checks that it passed. The guest mounts the host's root read-only; its `/tmp` is its own
//! (so `common::temp_dir` works there).

#![allow(dead_code, reason = "each test binary uses part of it")]

use std::time::Duration;

/// Whether this process runs in the kp-vm guest.
pub fn is_guest() -> bool {
    std::env::var_os("KP_VM_GUEST").is_some()
}

/// On the host, runs test `name` of this binary in the kp-vm guest and checks it passed there.
/// Returns whether this is the guest (go on with the test) or not (done).
pub fn in_guest(name: &str) -> bool {
    if is_guest() {
        return true;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    // kp-echo is found (or built) here, where cargo is; the guest's file system is read-only.
    let echo = kp_test::echo_binary();
    let script = format!(
        "KP_ECHO={} {} --exact {name} --include-ignored --nocapture --test-threads 1",
        echo.display(),
        exe.display()
    );
    let run = kp_vm::Vm::new()
        .expect("qemu, the kernel and busybox are installed")
        .timeout(Duration::from_secs(480))
        .run(&script)
        .expect("the guest runs the test");
    eprintln!(
        "guest: boot {:?}, total {:?}\n{}",
        run.boot, run.total, run.output
    );
    assert!(
        run.success(),
        "the test failed in the guest:\n{}",
        run.output
    );
    assert!(run.output.contains("1 passed"), "{}", run.output);
    false
}
