//! What ebpf mode needs in the flow lab, all of the test's own: a cgroup v2 directory its
//! socket hooks attach to (`--bpf-cgroup-root`), which every process the lab starts joins
//! ([`Sandbox::admit`]), and a bpffs mounted on a fresh directory for its pins
//! (`--bpf-pin-dir`). Nothing is attached to the machine's own cgroups or pinned on its bpffs;
//! dropping the sandbox kills what is left in the cgroup, removes it (which detaches the
//! programs) and unmounts the bpffs.
//!
//! The test process itself never joins: the other tests of its binary run as threads of the
//! same process, and their children would land in the cgroup too, under our programs and then
//! under the sandbox's final kill (which once killed another test's `ip route add`).
//!
//! The proxy runs in the lab's node through `ip netns exec`, which mounts a sysfs of the
//! namespace's own over /sys: the cgroup hierarchy under /sys/fs/cgroup is not visible there.
//! So the hierarchy is mounted once more on a directory of the test's (the same hierarchy:
//! the cgroup made under /sys/fs/cgroup appears there too), and the proxy is given that path.

#![allow(dead_code)] // each test binary uses part of it

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Where the cgroup v2 hierarchy is mounted, from /proc/self/mountinfo.
fn cgroup2_root() -> PathBuf {
    let text = std::fs::read_to_string("/proc/self/mountinfo").expect("reading mountinfo");
    text.lines()
        .find_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let point = left.split_whitespace().nth(4)?;
            (right.split_whitespace().next() == Some("cgroup2")).then(|| PathBuf::from(point))
        })
        .expect("no cgroup v2 hierarchy is mounted")
}

/// How long ebpf mode's tc programs carry idle connections from outside after another mode
/// took over (`--bpf-handover-idle`, 60 s by default), in every mode the lab starts: a mode
/// taking over removes them this long after their last packet (and its next recheck, 10 s).
pub const HANDOVER_IDLE: std::time::Duration = std::time::Duration::from_secs(2);

/// A cgroup and a bpffs of the test's own.
pub struct Sandbox {
    /// The cgroup (`--bpf-cgroup-root`).
    pub cgroup: PathBuf,
    /// The pin directory on the bpffs (`--bpf-pin-dir`).
    pub pins: PathBuf,
    /// The cgroup under /sys/fs/cgroup, which the lab's processes join.
    real: PathBuf,
    /// The test's directory: the bpffs and the second cgroup2 mount under it.
    dir: PathBuf,
}

fn mount(fs: &str, at: &Path) {
    std::fs::create_dir(at).expect("creating a mount point");
    let status = Command::new("mount")
        .args(["-t", fs, fs])
        .arg(at)
        .status()
        .expect("running mount");
    assert!(status.success(), "mount -t {fs} failed");
}

impl Sandbox {
    /// Creates both.
    pub fn new(tag: &str) -> Sandbox {
        let name = format!("kpt-h-{}-{tag}", std::process::id());
        let root = cgroup2_root();
        let real = root.join(&name);
        std::fs::create_dir(&real).expect("creating a test cgroup");
        let dir = std::env::temp_dir().join(&name);
        std::fs::create_dir(&dir).expect("creating the test's directory");
        let sandbox = Sandbox {
            pins: dir.join("bpffs").join("kube-proxy-rs"),
            cgroup: dir.join("cgroup2").join(&name),
            real,
            dir,
        };
        mount("bpf", &sandbox.dir.join("bpffs"));
        mount("cgroup2", &sandbox.dir.join("cgroup2"));
        assert!(
            sandbox.cgroup.is_dir(),
            "the second cgroup2 mount shows the test cgroup"
        );
        sandbox
    }

    /// Every process started in `lab` from now on (the proxy, the clients) joins the cgroup.
    pub fn admit(&self, lab: &kp_test::lab::Lab) {
        lab.place_in_cgroup(Some(&self.real));
    }

    /// The flags that point ebpf mode at this sandbox.
    pub fn flags(&self) -> Vec<String> {
        vec![
            format!("--bpf-cgroup-root={}", self.cgroup.display()),
            format!("--bpf-pin-dir={}", self.pins.display()),
            format!("--bpf-handover-idle={}s", HANDOVER_IDLE.as_secs()),
        ]
    }

    /// Deletes one entry from a pinned map behind the proxy's back (the `bpf` syscall through
    /// Python's ctypes: no bpftool here, and the workspace forbids `unsafe`).
    pub fn delete_map_entry(&self, map: &str, key: &[u8]) {
        const SCRIPT: &str = r#"
import ctypes, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
SYS_BPF, OBJ_GET, DELETE = 321, 7, 3
path = ctypes.create_string_buffer(sys.argv[1].encode())
attr = ctypes.create_string_buffer(struct.pack("QII", ctypes.addressof(path), 0, 0), 16)
fd = libc.syscall(SYS_BPF, OBJ_GET, attr, 16)
if fd < 0:
    sys.exit("BPF_OBJ_GET: errno %d" % ctypes.get_errno())
key = ctypes.create_string_buffer(bytes.fromhex(sys.argv[2]), len(sys.argv[2]) // 2)
attr = ctypes.create_string_buffer(struct.pack("IIQQQ", fd, 0, ctypes.addressof(key), 0, 0), 32)
if libc.syscall(SYS_BPF, DELETE, attr, 32) != 0:
    sys.exit("BPF_MAP_DELETE_ELEM: errno %d" % ctypes.get_errno())
"#;
        assert_eq!(
            std::env::consts::ARCH,
            "x86_64",
            "the bpf syscall number is x86_64's"
        );
        let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
        let out = Command::new("python3")
            .args(["-c", SCRIPT])
            .arg(self.pins.join(map))
            .arg(&hex)
            .output()
            .expect("running python3");
        assert!(
            out.status.success(),
            "deleting {hex} from {map}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Sandbox {
    /// What ebpf mode has in the kernel for this sandbox, one line each: the entries of the
    /// pin directory (maps and links), the programs attached to the cgroup (its eight socket
    /// address hooks) and the tcx programs on the interfaces of the lab's node (`BPF_PROG_QUERY`
    /// through Python's ctypes, as [`Sandbox::delete_map_entry`]). Empty: nothing is left.
    pub fn state(&self, lab: &kp_test::lab::Lab) -> Vec<String> {
        assert_eq!(
            std::env::consts::ARCH,
            "x86_64",
            "the bpf syscall number is x86_64's"
        );
        let mut out: Vec<String> = match std::fs::read_dir(&self.pins) {
            Ok(entries) => entries
                .map(|e| format!("pinned {:?}", e.expect("a pin").file_name()))
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => panic!("reading {}: {e}", self.pins.display()),
        };
        // The cgroup from the test's process (the second mount is visible here); the
        // interfaces from inside the node's namespace.
        let cgroup = Command::new("python3")
            .args(["-c", PROG_QUERY, "cgroup"])
            .arg(&self.real)
            .output()
            .expect("running python3");
        assert!(
            cgroup.status.success(),
            "querying the cgroup's programs: {}",
            String::from_utf8_lossy(&cgroup.stderr)
        );
        out.extend(
            String::from_utf8_lossy(&cgroup.stdout)
                .lines()
                .map(String::from),
        );
        let tc = lab
            .node()
            .run(&["python3", "-c", PROG_QUERY, "tcx"])
            .expect("querying the node's tcx programs");
        out.extend(tc.lines().map(String::from));
        out
    }
}

impl Sandbox {
    /// All of ebpf mode's state: [`Sandbox::state`], and in the node's namespace the table
    /// that keeps the NAT hooks (`kp_ebpf::nat_hooks`). Empty: nothing is left.
    pub fn mode_state(&self, lab: &kp_test::lab::Lab) -> Vec<String> {
        let mut state = self.state(lab);
        let tables = lab
            .node()
            .run(&["nft", "list", "tables"])
            .unwrap_or_default();
        if tables.lines().any(|l| l == "table inet kube-proxy-ebpf") {
            state.push("table inet kube-proxy-ebpf (the NAT hooks)".into());
        }
        state
    }
}

/// `cgroup DIR`: the programs attached to DIR at each socket address hook ebpf mode uses
/// (connect, sendmsg, recvmsg, getpeername; IPv4 and IPv6); `tcx`: the programs attached with
/// tcx to each interface of the namespace, ingress and egress. One line per attach point that
/// holds any.
const PROG_QUERY: &str = r#"
import ctypes, os, socket, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
SYS_BPF, PROG_QUERY = 321, 16
def count(target, attach_type):
    attr = ctypes.create_string_buffer(struct.pack("IIIIQI", target, attach_type, 0, 0, 0, 0), 64)
    if libc.syscall(SYS_BPF, PROG_QUERY, attr, 64) != 0:
        sys.exit("BPF_PROG_QUERY %d on %d: errno %d" % (attach_type, target, ctypes.get_errno()))
    return struct.unpack_from("I", attr.raw, 24)[0]
if sys.argv[1] == "cgroup":
    fd = os.open(sys.argv[2], os.O_RDONLY | os.O_DIRECTORY)
    for name, t in [("connect4", 10), ("connect6", 11), ("sendmsg4", 14), ("sendmsg6", 15),
                    ("recvmsg4", 19), ("recvmsg6", 20), ("getpeername4", 29), ("getpeername6", 30)]:
        n = count(fd, t)
        if n:
            print("cgroup %s: %d program(s)" % (name, n))
else:
    for dev in sorted(os.listdir("/sys/class/net")):
        for name, t in [("ingress", 46), ("egress", 47)]:
            n = count(socket.if_nametoindex(dev), t)
            if n:
                print("tcx %s %s: %d program(s)" % (dev, name, n))
"#;

/// A services map key (kp-ebpf-plan's layout): the IPv4 frontend `ip:port`, TCP, the socket
/// scope, slot 0 (the frontend's head: its backend count).
pub fn tcp_frontend_head(ip: std::net::Ipv4Addr, port: u16) -> Vec<u8> {
    let mut key = ip.to_ipv6_mapped().octets().to_vec();
    key.extend(port.to_be_bytes());
    key.extend(0u16.to_ne_bytes());
    key.extend([6, 0, 0, 0]);
    key
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let procs = std::fs::read_to_string(self.real.join("cgroup.procs")).unwrap_or_default();
            for pid in procs.split_whitespace() {
                let _ = Command::new("kill").args(["-9", pid]).status();
            }
            if std::fs::remove_dir(&self.real).is_ok() || Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        for fs in ["cgroup2", "bpffs"] {
            let at = self.dir.join(fs);
            let _ = Command::new("umount").arg(&at).status();
            let _ = std::fs::remove_dir(&at);
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}
