//! Guards shared by the root tests: a cgroup and a bpffs of the test's own, removed on drop.

use std::path::{Path, PathBuf};
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

/// This process's cgroup v2 directory (`0::PATH` in /proc/self/cgroup).
fn own_cgroup() -> PathBuf {
    let text = std::fs::read_to_string("/proc/self/cgroup").expect("reading /proc/self/cgroup");
    let path = text
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .expect("this process is in no cgroup v2");
    cgroup2_root().join(path.trim_start_matches('/'))
}

fn move_pid(pid: u32, cgroup: &Path) -> std::io::Result<()> {
    std::fs::write(cgroup.join("cgroup.procs"), pid.to_string())
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

/// A cgroup of the test's own; its processes are killed and it is removed on drop (this
/// process, if it is still inside, is moved back out first).
pub struct Cgroup {
    /// The cgroup's directory.
    pub path: PathBuf,
    /// Where this process was before [`Cgroup::enter`].
    home: PathBuf,
}

/// This test process inside a [`Cgroup`], so that every process it starts (the clients) is
/// too; dropping it moves the process back where it was.
pub struct Inside<'a> {
    cgroup: &'a Cgroup,
}

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        self.cgroup.leave();
    }
}

impl Cgroup {
    /// Creates it.
    pub fn new() -> Cgroup {
        let path = cgroup2_root().join(unique("cg"));
        std::fs::create_dir(&path).expect("creating a test cgroup");
        Cgroup {
            path,
            home: own_cgroup(),
        }
    }

    /// Moves this process (every thread of it) into the cgroup until the guard is dropped.
    #[allow(dead_code)] // not every test binary enters
    pub fn enter(&self) -> Inside<'_> {
        move_pid(std::process::id(), &self.path).expect("moving the test into its cgroup");
        Inside { cgroup: self }
    }

    fn leave(&self) {
        if let Err(e) = move_pid(std::process::id(), &self.home) {
            eprintln!("cannot move the test back to {}: {e}", self.home.display());
        }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let me = std::process::id().to_string();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let procs = std::fs::read_to_string(self.path.join("cgroup.procs")).unwrap_or_default();
            if procs.split_whitespace().any(|p| p == me) {
                // Never kill the test itself: move it out, or leave the cgroup behind.
                self.leave();
                if Instant::now() > deadline {
                    eprintln!("test cgroup {} left behind", self.path.display());
                    break;
                }
                continue;
            }
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
