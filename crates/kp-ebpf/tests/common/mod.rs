//! Guards shared by the root tests: a cgroup and a bpffs of the test's own, removed on drop;
//! and the frontends they plan.

#![allow(dead_code)] // each test binary uses part of it

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Where the cgroup v2 hierarchy is mounted (`/sys/fs/cgroup/unified` on the development
/// machines).
fn cgroup2_root() -> PathBuf {
    kp_ebpf::cgroup::find_cgroup2_root()
        .expect("reading /proc/self/mountinfo")
        .expect("no cgroup v2 hierarchy is mounted")
}

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A name no other test (or test process) uses.
pub fn unique(what: &str) -> String {
    format!(
        "kpt-ebpf-{}-{}-{what}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// kp-sockpeer run from network namespace `ns` inside `cgroup`: the command, its own arguments
/// still to add (`.args(...)`).
pub fn sockpeer(cgroup: &Cgroup, ns: &kp_test::netns::Netns) -> Command {
    let script = format!(
        "echo $$ > {}/cgroup.procs && exec ip netns exec {} {} \"$@\"",
        cgroup.path.display(),
        ns.name(),
        env!("CARGO_BIN_EXE_kp-sockpeer")
    );
    let mut command = Command::new("sh");
    command.args(["-c", &script, "kp-sockpeer"]);
    command
}

/// A cgroup of the test's own; its processes are killed and it is removed on drop. The test
/// process never joins it (its other tests' children would too): a test's clients join it
/// themselves (`echo $$ > cgroup.procs`, or `Lab::place_in_cgroup`).
pub struct Cgroup {
    /// The cgroup's directory.
    pub path: PathBuf,
}

impl Cgroup {
    /// Creates it.
    pub fn new() -> Cgroup {
        let path = cgroup2_root().join(unique("cg"));
        std::fs::create_dir(&path).expect("creating a test cgroup");
        Cgroup { path }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let procs = std::fs::read_to_string(self.path.join("cgroup.procs")).unwrap_or_default();
            for pid in procs.split_whitespace() {
                let _ = Command::new("kill").args(["-9", pid]).status();
            }
            if std::fs::remove_dir(&self.path).is_ok() || Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A bpffs of the test's own, mounted on a fresh directory, unmounted and removed on drop.
pub struct Bpffs {
    /// The mount point.
    pub path: PathBuf,
}

impl Bpffs {
    /// Mounts it.
    pub fn new() -> Bpffs {
        let path = std::env::temp_dir().join(unique("bpffs"));
        std::fs::create_dir(&path).expect("creating the bpffs mount point");
        let fs = Bpffs { path };
        let status = Command::new("mount")
            .args(["-t", "bpf", "bpf"])
            .arg(&fs.path)
            .status()
            .expect("running mount");
        assert!(status.success(), "mount -t bpf failed");
        fs
    }
}

impl Drop for Bpffs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.path).status();
        let _ = std::fs::remove_dir(&self.path);
    }
}

/// An address literal.
pub fn ip(s: &str) -> IpAddr {
    s.parse().expect("address")
}

/// ebpf mode's configuration as a proxy in this process's namespace would run it, over the
/// test's own cgroup (the socket hooks) and bpffs (the pins). No tc path: not in the machine's
/// own namespace; a tc test attaches it in a lab's node namespace.
pub fn pinned_config(cgroup: &Cgroup, bpffs: &Bpffs) -> kp_ebpf::dataplane::Config {
    kp_ebpf::dataplane::Config {
        pin_dir: Some(bpffs.path.clone()),
        ..kp_ebpf::dataplane::Config::new(cgroup.path.clone())
    }
}

/// A dataplane of `config`, loaded, attached and fully synced with `state`.
pub fn started(
    config: kp_ebpf::dataplane::Config,
    state: &kp_core::track::ProxyState,
) -> kp_ebpf::dataplane::EbpfDataplane {
    use kp_core::dataplane::Dataplane;
    let mut dp = kp_ebpf::dataplane::EbpfDataplane::new(config);
    dp.start().expect("load and attach");
    dp.sync(state, &kp_core::track::Changes::default(), true)
        .expect("full sync");
    dp
}

/// A ClusterIP frontend `vip:port` of the socket hooks with `backends` (address, port).
pub fn spec(
    vip: &str,
    port: u16,
    protocol: kp_core::model::Protocol,
    backends: &[(&str, u16)],
) -> kp_ebpf_plan::FrontendSpec {
    kp_ebpf_plan::FrontendSpec {
        addr: kp_ebpf_plan::FrontendAddr {
            ip: ip(vip),
            port,
            protocol,
            scope: kp_ebpf_plan::Scope::Socket,
        },
        backends: backends
            .iter()
            .map(|(a, p)| kp_ebpf_plan::Backend {
                ip: ip(a),
                port: *p,
                protocol,
            })
            .collect(),
        drop_when_empty: false,
        affinity: None,
        cluster_ip: true,
        keep_source: false,
        source_ranges: None,
    }
}
