//! 10k concurrent relays, as the issue asks, in the kp-vm guest: this machine's hard open-file
//! limit (20000, and no `CAP_SYS_RESOURCE` to raise it) holds the host test to about 4.5k,
//! while in the guest the test is root of its own kernel and raises the limit. The test binary
//! boots the guest and runs itself there (`KP_VM_GUEST` set); the guest is stopped when the
//! run returns, whatever happened (kp-vm kills qemu on a timeout, an error or a drop).

use std::time::{Duration, Instant};

mod common;

/// The count.
const CONCURRENT: usize = 10_000;

/// The guest's open-file limit: client, server and proxy share the test process, four
/// descriptors per idle connection and two more per pipe in flight, plus the runtime's own.
const OPEN_FILES: u64 = 65_536;

/// What the guest loads up front: the redirect table's expressions and the lab's links (the
/// kernel would load the rest on demand through kp-vm's modprobe helper).
const MODULES: &[&str] = &[
    "nf_conntrack",
    "nf_nat",
    "nf_tables",
    "nft_chain_nat",
    "nft_redir",
    "nft_fib_inet",
    "nft_socket",
    "nft_reject_inet",
    "veth",
];

/// How long the guest may take, boot included (TCG: no KVM on this machine); runs took 55-97 s.
const GUEST_TIMEOUT: Duration = Duration::from_secs(300);

/// On the host, runs test `name` of this binary in the guest and checks it passed there.
/// Returns whether this is the guest (go on with the test) or not (done).
fn in_guest(name: &str) -> bool {
    if std::env::var_os("KP_VM_GUEST").is_some() {
        return true;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let script = format!(
        "{} --exact {name} --include-ignored --nocapture --test-threads 1",
        exe.display()
    );
    let vm = kp_vm::Vm::new()
        .expect("qemu, the kernel and busybox are installed")
        .modules(MODULES)
        .timeout(GUEST_TIMEOUT);
    let run = vm.run(&script).expect("the guest runs the test");
    eprintln!(
        "guest: boot {:?}, total {:?}\n{}",
        run.boot, run.total, run.output
    );
    assert!(
        run.success(),
        "the test failed in the guest (exit {}):\n{}",
        run.status,
        run.output
    );
    assert!(run.output.contains("1 passed"), "{}", run.output);
    false
}

#[test]
#[ignore = "needs root"]
fn ten_thousand_concurrent_connections_are_relayed_at_once_in_the_guest() {
    if !kp_test::netns::require_root() {
        return;
    }
    if !in_guest("ten_thousand_concurrent_connections_are_relayed_at_once_in_the_guest") {
        return;
    }
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    // Root of the guest's kernel: the hard limit goes up too (up to fs.nr_open).
    setrlimit(Resource::RLIMIT_NOFILE, OPEN_FILES, OPEN_FILES)
        .expect("raise the open-file limit in the guest");
    eprintln!(
        "open-file limit {soft}/{hard} raised to {OPEN_FILES}; {CONCURRENT} concurrent connections"
    );
    let t = Instant::now();
    // Patient: TCG runs the guest's handshakes many times slower than the host.
    let phases = common::relay_concurrently(CONCURRENT, Duration::from_secs(120));
    eprintln!("{phases:?}, {:?} in all", t.elapsed());
}
