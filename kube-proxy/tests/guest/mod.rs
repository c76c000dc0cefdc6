//! Running a test in the kp-vm guest (`crates/kp-vm`): Debian's kernel, which has IPVS, under
//! qemu with TCG. On the host, [`in_guest`] boots the guest and re-runs the named test of the
//! same test binary there (`KP_VM_GUEST` set), where it runs for real; the host then only
//! checks that it passed. The guest mounts the host's root read-only; its `/tmp` is its own
//! (so `common::temp_dir` works there).

#![allow(dead_code, reason = "each test binary uses part of it")]

use std::time::Duration;

/// Whether this process runs in the kp-vm guest.
pub fn is_guest() -> bool {
    kp_vm::is_guest()
}

/// On the host, runs test `name` of this binary in the kp-vm guest (8 minutes at most) and
/// checks it passed there. Returns whether this is the guest (go on with the test) or not.
pub fn in_guest(name: &str) -> bool {
    kp_vm::in_guest(name, Duration::from_secs(480))
}
