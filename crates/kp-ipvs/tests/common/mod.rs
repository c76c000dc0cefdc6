//! What the VM test files share.

/// On the host, runs test `name` of this binary in the kp-vm guest (5 minutes at most) and
/// checks it passed there. Returns whether this is the guest (go on with the test) or not.
pub fn in_guest(name: &str) -> bool {
    kp_vm::in_guest(name, std::time::Duration::from_secs(300))
}
