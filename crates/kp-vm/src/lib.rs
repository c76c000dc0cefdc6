//! A real Linux kernel for tests that need what this machine's kernel lacks (IPVS): Debian's
//! `linux-image-amd64` booted under `qemu-system-x86_64` with TCG (no KVM), a busybox initramfs
//! built per run, and the host's root directory mounted read-only over 9p, so the guest runs the
//! host's tools (`ip`, `modprobe`) and the binaries under `target/` at the same paths.
//!
//! [`Vm::run`] boots the guest, loads the requested modules with the host's `modprobe` (which
//! orders them by their dependencies), runs one shell script as root in a fresh tmpfs root
//! (`/usr`, `/etc`, `/var`, the workspace ... bound read-only from the host; `/tmp`, `/run`,
//! `/proc`, `/sys` with cgroup v2 at `/sys/fs/cgroup`, `/dev` new), and returns what the
//! script printed and its exit status. The guest is always stopped: it powers itself off after
//! the script, and the host kills qemu on a timeout, on an error, and when the run is dropped
//! (a panicking test included).
//!
//! Installs nothing: the packages are `qemu-system-x86`, `linux-image-amd64` and
//! `busybox-static` (`scripts/test.sh` installs them). Under TCG a boot to the script takes about
//! 10 s on this machine's kind; keep guest work small.

mod cpio;
mod init;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub use init::load_order;

/// How many times [`Vm::run`] boots a guest whose kernel crashed before the script started.
pub const BOOT_ATTEMPTS: u32 = 3;

/// How many times [`Vm::run`] runs a script whose guest kernel met the emulator's race (see
/// [`Vm::run`]) while the script ran: once more, as a whole run can take twenty minutes.
pub const RACE_ATTEMPTS: u32 = 2;

/// Why a guest run should be made again, if it should: its console ends in a kernel panic
/// either before the init's ready marker (the script never started), or on an `int3` the
/// kernel did not place in a BPF program (the emulator's race in the kernel's own live code
/// patching: see [`Vm::run`]). Any other crash is the script's to report.
fn crash_to_rerun(console: &str) -> Option<Crash> {
    if !console.contains("Kernel panic") {
        return None;
    }
    if !console.lines().any(|l| l.trim_end() == init::READY) {
        return Some(Crash::WhileBooting);
    }
    let int3 = console.contains("Oops: int3");
    // Where the breakpoint was met: a JITed BPF program's padding is int3 too, and that would
    // be a program's fault, never the emulator's.
    let in_bpf = console
        .lines()
        .filter(|l| l.contains("RIP: 0010:"))
        .any(|l| l.contains("bpf_prog_"));
    (int3 && !in_bpf).then_some(Crash::PatchingRace)
}

/// A guest kernel crash [`Vm::run`] runs again after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Crash {
    /// Before the script started.
    WhileBooting,
    /// On a breakpoint of the kernel's own live code patching, while the script ran.
    PatchingRace,
}

/// The packages a VM test needs, for messages (Debian names).
pub const PACKAGES: &str = "qemu-system-x86 linux-image-amd64 busybox-static";

/// The modules an IPVS test loads: IPVS with every scheduler kube-proxy offers, conntrack,
/// nf_tables, ipsets, SCTP (the flow table's SCTP rows: left to load on the first SCTP socket,
/// over 9p under TCG, it once took longer than the row's connect timeout), and the links a
/// test topology uses.
pub const IPVS_MODULES: &[&str] = &[
    "ip_vs",
    "ip_vs_rr",
    "ip_vs_wrr",
    "ip_vs_lc",
    "ip_vs_wlc",
    "ip_vs_lblc",
    "ip_vs_lblcr",
    "ip_vs_sh",
    "ip_vs_dh",
    "ip_vs_sed",
    "ip_vs_nq",
    "ip_vs_mh",
    "nf_conntrack",
    "nf_tables",
    "nft_compat",
    "ip_set",
    "ip_set_hash_ip",
    "ip_set_hash_ipport",
    "ip_set_hash_ipportip",
    "ip_set_hash_ipportnet",
    "ip_set_hash_net",
    "ip_set_bitmap_port",
    "sctp",
    "veth",
    "dummy",
];

/// The modules the initramfs itself loads to reach the host's root (virtio PCI and 9p); their
/// dependencies come first ([`load_order`]).
const BOOT_MODULES: &[&str] = &["virtio_pci", "9pnet_virtio", "9p"];

/// The host's top-level directories bound into the guest's root (read-only), besides the one
/// holding the workspace. `/proc`, `/sys`, `/dev`, `/tmp` and `/run` are the guest's own.
const HOST_DIRS: &[&str] = &["usr", "etc", "var", "opt", "root", "home", "srv"];

/// What can go wrong around a guest (not the script's own failure, which is [`Run::status`]).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A package is not installed (qemu, the kernel, busybox). Not retryable: install it.
    #[error("{what} not found ({detail}); install the Debian packages {PACKAGES}")]
    Missing {
        /// What is missing.
        what: &'static str,
        /// Where it was looked for.
        detail: String,
    },
    /// Reading the host's files or modules, or writing the initramfs, failed. Not retryable.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// `modinfo` could not describe a module, or its file is not one the guest can load. Not
    /// retryable.
    #[error("module {module}: {detail}")]
    Module {
        /// The module (its name, or its file).
        module: String,
        /// What `modinfo` said, or what is wrong with the file.
        detail: String,
    },
    /// The guest did not reach the script: a module failed to load or the 9p mount failed.
    /// Not retryable.
    #[error("the guest's set-up failed: {reason}\n--- console ---\n{console}")]
    Setup {
        /// The step that failed.
        reason: String,
        /// Everything the guest printed.
        console: String,
    },
    /// The guest did not finish in time; it was killed. Retryable on a slower machine with a
    /// longer timeout.
    #[error("the guest did not finish within {after:?}; killed\n--- console ---\n{console}")]
    Timeout {
        /// The timeout.
        after: Duration,
        /// Everything the guest printed.
        console: String,
    },
    /// qemu exited before the script's exit status was printed (a kernel panic, a bad option).
    /// Not retryable.
    #[error("qemu exited ({status}) before the script finished\n--- console ---\n{console}")]
    Exited {
        /// qemu's exit status.
        status: String,
        /// Everything the guest printed, and qemu's own error output.
        console: String,
    },
}

/// A result of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An installed kernel: its image and its modules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kernel {
    /// `uname -r` of it (`6.1.0-56-amd64`).
    pub version: String,
    /// `/boot/vmlinuz-VERSION`.
    pub image: PathBuf,
    /// `/lib/modules/VERSION`.
    pub modules: PathBuf,
}

impl Kernel {
    /// The newest `/boot/vmlinuz-*` whose `/lib/modules/VERSION` has IPVS (`ip_vs.ko`).
    pub fn find() -> Result<Kernel> {
        let boot = Path::new("/boot");
        let entries = std::fs::read_dir(boot).map_err(|source| Error::Io {
            what: "reading /boot".into(),
            source,
        })?;
        let mut found: Vec<Kernel> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let version = name.strip_prefix("vmlinuz-")?.to_string();
                let modules = Path::new("/lib/modules").join(&version);
                let has_ipvs = ["ip_vs.ko", "ip_vs.ko.xz", "ip_vs.ko.zst"]
                    .iter()
                    .any(|f| modules.join("kernel/net/netfilter/ipvs").join(f).exists());
                has_ipvs.then(|| Kernel {
                    image: e.path(),
                    version,
                    modules,
                })
            })
            .collect();
        found.sort_by_key(|k| version_key(&k.version));
        found.pop().ok_or_else(|| Error::Missing {
            what: "a kernel with IPVS modules",
            detail: "no /boot/vmlinuz-VERSION with /lib/modules/VERSION/kernel/net/netfilter/ipvs/ip_vs.ko".into(),
        })
    }

    /// The file of module `name` (`None` when it is built into the kernel) and the modules it
    /// needs, from `modinfo`.
    fn modinfo(&self, name: &str) -> Result<(Option<PathBuf>, Vec<String>)> {
        let field = |f: &str| -> Result<String> {
            let out = Command::new("modinfo")
                .args(["-k", &self.version, "-F", f, name])
                .output()
                .map_err(|e| Error::Module {
                    module: name.into(),
                    detail: format!("cannot run modinfo: {e}"),
                })?;
            if !out.status.success() {
                return Err(Error::Module {
                    module: name.into(),
                    detail: format!("modinfo: {}", String::from_utf8_lossy(&out.stderr).trim()),
                });
            }
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        };
        let file = field("filename")?;
        if file == "(builtin)" {
            return Ok((None, Vec::new()));
        }
        let depends = field("depends")?
            .split(',')
            .filter(|d| !d.is_empty())
            .map(str::to_string)
            .collect();
        Ok((Some(PathBuf::from(file)), depends))
    }
}

/// A host file's contents.
fn read(file: &Path) -> Result<Vec<u8>> {
    std::fs::read(file).map_err(|source| Error::Io {
        what: format!("reading {}", file.display()),
        source,
    })
}

/// A module file's contents, uncompressed: busybox's `insmod` in the initramfs takes a plain
/// `.ko`, and Debian's newer kernels ship `.ko.xz` (decompressed with the host's `xz`; `.ko.zst`
/// with `zstd`).
fn read_module(file: &Path) -> Result<Vec<u8>> {
    let name = file.to_string_lossy();
    let tool = if name.ends_with(".ko") {
        return read(file);
    } else if name.ends_with(".ko.xz") {
        "xz"
    } else if name.ends_with(".ko.zst") {
        "zstd"
    } else {
        return Err(Error::Module {
            module: name.into_owned(),
            detail: "a file busybox insmod cannot load: neither .ko, .ko.xz nor .ko.zst".into(),
        });
    };
    let out = Command::new(tool)
        .args(["-d", "-c", "-q"])
        .arg(file)
        .output()
        .map_err(|source| Error::Io {
            what: format!("running {tool} -d on {name}"),
            source,
        })?;
    if !out.status.success() {
        return Err(Error::Io {
            what: format!("{tool} -d {name}"),
            source: std::io::Error::other(String::from_utf8_lossy(&out.stderr).trim().to_string()),
        });
    }
    Ok(out.stdout)
}

/// Numbers compare as numbers, so 6.10 sorts after 6.9.
fn version_key(v: &str) -> Vec<(u64, String)> {
    v.split(['.', '-'])
        .map(|p| (p.parse().unwrap_or(0), p.to_string()))
        .collect()
}

/// How to boot a guest. Build it with [`Vm::new`], adjust, then [`Vm::run`] scripts (each run is
/// a fresh boot).
#[derive(Debug, Clone)]
pub struct Vm {
    kernel: Kernel,
    modules: Vec<String>,
    timeout: Duration,
    memory_mib: u32,
    cpus: u32,
    busybox: PathBuf,
    qemu: PathBuf,
}

/// What a script did in the guest.
#[derive(Debug, Clone)]
pub struct Run {
    /// What it printed, standard output and error interleaved as printed.
    pub output: String,
    /// Its exit status (as `sh` reports it: 128+N for a signal).
    pub status: i32,
    /// Everything on the guest's console (kernel, set-up, script), for diagnosis.
    pub console: String,
    /// From starting qemu to the script's start (boot, 9p mount, module loads).
    pub boot: Duration,
    /// From starting qemu to the script's exit status.
    pub total: Duration,
}

impl Run {
    /// Whether the script exited 0.
    pub fn success(&self) -> bool {
        self.status == 0
    }
}

impl Vm {
    /// A guest of the newest kernel with IPVS, loading [`IPVS_MODULES`], with 2 GiB, 2 CPUs and
    /// a 5-minute timeout. Fails if qemu, the kernel or busybox is missing.
    pub fn new() -> Result<Vm> {
        let kernel = Kernel::find()?;
        let busybox = ["/usr/bin/busybox", "/bin/busybox"]
            .iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
            .ok_or_else(|| Error::Missing {
                what: "busybox",
                detail: "/usr/bin/busybox".into(),
            })?;
        let qemu = PathBuf::from("/usr/bin/qemu-system-x86_64");
        if !qemu.exists() {
            return Err(Error::Missing {
                what: "qemu-system-x86_64",
                detail: qemu.display().to_string(),
            });
        }
        Ok(Vm {
            kernel,
            modules: IPVS_MODULES.iter().map(|m| m.to_string()).collect(),
            timeout: Duration::from_secs(300),
            memory_mib: 2048,
            cpus: 2,
            busybox,
            qemu,
        })
    }

    /// The kernel it boots.
    pub fn kernel(&self) -> &Kernel {
        &self.kernel
    }

    /// Loads these modules (by name, with `modprobe`) before the script, instead of
    /// [`IPVS_MODULES`].
    pub fn modules(mut self, modules: &[&str]) -> Vm {
        self.modules = modules.iter().map(|m| m.to_string()).collect();
        self
    }

    /// Kills the guest if the script has not finished this long after qemu starts.
    pub fn timeout(mut self, timeout: Duration) -> Vm {
        self.timeout = timeout;
        self
    }

    /// Boots a guest, runs `script` with `/bin/sh` as root inside it (working directory `/`,
    /// `PATH` the usual one, `KP_VM_GUEST=1` set), and returns its output and exit status. The
    /// guest is stopped when this returns, whatever happened.
    ///
    /// One guest at a time per process: two TCG guests on a 2-core machine starve each other
    /// (and the tests' own timing bars) for nothing, and a starved vCPU thread is what lets the
    /// emulator's race below happen. Multi-threaded TCG does not make one vCPU's code patching
    /// visible to the other at once, and now and then a guest kernel meets a breakpoint its
    /// own live patching (a static key turned on or off) has already removed: "Oops: int3",
    /// seen in `sched_clock_cpu` 1.6 s into a boot, and once in `__netif_receive_skb_core`
    /// when tc programs were attached 12 minutes into ipvs_vm_e2e's switching test. A guest
    /// whose kernel crashed before the script started is booted again, at most
    /// [`BOOT_ATTEMPTS`] times; one that met that breakpoint while the script ran runs the
    /// script again, at most [`RACE_ATTEMPTS`] times; either with the crash printed loudly.
    /// Any other crash once the script runs is reported as it is.
    pub fn run(&self, script: &str) -> Result<Run> {
        static ONE_GUEST: std::sync::Mutex<()> = std::sync::Mutex::new(());
        // A test that panicked while its guest ran leaves the lock poisoned; the next runs anyway.
        let _one = ONE_GUEST
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (mut boots, mut races) = (1, 1);
        loop {
            match self.boot(script) {
                Err(Error::Exited { status, console }) => match crash_to_rerun(&console) {
                    Some(Crash::WhileBooting) if boots < BOOT_ATTEMPTS => {
                        eprintln!(
                            "kp-vm: WARNING: the guest kernel crashed before the script \
                             started (boot {boots} of {BOOT_ATTEMPTS}, qemu {status}); booting \
                             again. Its console:\n{console}"
                        );
                        boots += 1;
                    }
                    Some(Crash::PatchingRace) if races < RACE_ATTEMPTS => {
                        eprintln!(
                            "kp-vm: WARNING: the guest kernel met a breakpoint of its own live \
                             code patching while the script ran (the emulator's race; run \
                             {races} of {RACE_ATTEMPTS}, qemu {status}); running the script \
                             again in a new guest. Its console:\n{console}"
                        );
                        races += 1;
                    }
                    _ => return Err(Error::Exited { status, console }),
                },
                other => return other,
            }
        }
    }

    fn boot(&self, script: &str) -> Result<Run> {
        let dir = TempDir::new()?;
        let initrd = dir.0.join("initrd.cpio");
        let archive = self.initramfs(script)?;
        std::fs::write(&initrd, archive).map_err(|source| Error::Io {
            what: format!("writing {}", initrd.display()),
            source,
        })?;
        let started = Instant::now();
        let mut command = Command::new(&self.qemu);
        command
            .args(["-machine", "q35", "-accel", "tcg", "-cpu", "max"])
            .args(["-m", &self.memory_mib.to_string()])
            .args(["-smp", &self.cpus.to_string()])
            .args(["-nodefaults", "-no-user-config", "-display", "none"])
            .args(["-no-reboot", "-serial", "stdio", "-monitor", "none"])
            .arg("-kernel")
            .arg(&self.kernel.image)
            .arg("-initrd")
            .arg(&initrd)
            .args([
                "-append",
                "console=ttyS0 rdinit=/init panic=-1 quiet",
                "-fsdev",
                "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap",
                "-device",
                "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let child = command.spawn().map_err(|source| Error::Io {
            what: format!("starting {}", self.qemu.display()),
            source,
        })?;
        let mut guest = Guest(child);
        let lines = guest.lines();
        let mut console = String::new();
        let mut output: Option<String> = None;
        let mut boot = None;
        let deadline = started + self.timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = match lines.recv_timeout(left) {
                Ok(line) => line,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    guest.kill();
                    return Err(Error::Timeout {
                        after: self.timeout,
                        console,
                    });
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = guest.wait();
                    console.push_str(&guest.stderr());
                    return Err(Error::Exited { status, console });
                }
            };
            console.push_str(&line);
            console.push('\n');
            if let Some(reason) = line.strip_prefix(init::SETUP_FAILED) {
                guest.kill();
                return Err(Error::Setup {
                    reason: reason.trim().to_string(),
                    console,
                });
            }
            if line.trim_end() == init::READY {
                boot = Some(started.elapsed());
                output = Some(String::new());
                continue;
            }
            let Some(out) = output.as_mut() else { continue };
            if let Some(at) = line.find(init::EXIT) {
                let status = line[at + init::EXIT.len()..].trim().parse().unwrap_or(-1);
                out.push_str(&line[..at]);
                // The guest printed a newline before the marker, in case the output had none.
                if out.ends_with('\n') {
                    out.pop();
                }
                let total = started.elapsed();
                guest.finish();
                return Ok(Run {
                    output: output.unwrap_or_default(),
                    status,
                    console,
                    boot: boot.unwrap_or(total),
                    total,
                });
            }
            out.push_str(&line);
            out.push('\n');
        }
    }

    /// The initramfs: static busybox, the boot modules in dependency order, the init script,
    /// the kernel's modprobe helper, and the test's script.
    fn initramfs(&self, script: &str) -> Result<Vec<u8>> {
        let mut info = std::collections::BTreeMap::new();
        let order = load_order(BOOT_MODULES, |m| {
            let (file, depends) = self.kernel.modinfo(m)?;
            info.insert(m.to_string(), file);
            Ok(depends)
        })?;
        let mut a = cpio::Archive::default();
        for d in [
            "bin", "sbin", "modules", "dev", "proc", "sys", "host", "newroot",
        ] {
            a.dir(d);
        }
        a.file("bin/busybox", 0o755, &read(&self.busybox)?);
        let mut boot_modules = Vec::new();
        for m in &order {
            let Some(file) = &info[m] else {
                continue;
            };
            let name = format!("{m}.ko");
            a.file(&format!("modules/{name}"), 0o644, &read_module(file)?);
            boot_modules.push(name);
        }
        let binds = host_binds()?;
        let links = host_links()?;
        a.file(
            "init",
            0o755,
            init::script(&boot_modules, &binds, &links, &self.modules).as_bytes(),
        );
        a.file("sbin/kp-modprobe", 0o755, init::MODPROBE.as_bytes());
        a.file("script.sh", 0o644, script.as_bytes());
        Ok(a.finish())
    }
}

/// The host directories bound into the guest: [`HOST_DIRS`] that exist, and where this
/// workspace, the current directory and the running program are (so `target/` is there): their
/// top-level directory, or for one below `/tmp` or `/run` (fresh in the guest) its first two
/// levels. Relative to `/`.
fn host_binds() -> Result<Vec<String>> {
    let mut dirs: Vec<String> = HOST_DIRS
        .iter()
        .filter(|d| Path::new("/").join(d).is_dir())
        .map(|d| d.to_string())
        .collect();
    let here = std::env::current_dir().map_err(|source| Error::Io {
        what: "the current directory".into(),
        source,
    })?;
    let exe = std::env::current_exe().unwrap_or_default();
    for p in [here, PathBuf::from(env!("CARGO_MANIFEST_DIR")), exe] {
        let parts: Vec<String> = p
            .components()
            .filter_map(|c| match c {
                std::path::Component::Normal(n) => Some(n.to_string_lossy().to_string()),
                _ => None,
            })
            .collect();
        let bind = match parts.first().map(String::as_str) {
            None | Some("proc" | "sys" | "dev") => continue,
            Some("tmp" | "run") if parts.len() >= 2 => format!("{}/{}", parts[0], parts[1]),
            Some("tmp" | "run") => continue,
            Some(top) => top.to_string(),
        };
        let covered = dirs
            .iter()
            .any(|d| bind == *d || bind.starts_with(&format!("{d}/")));
        if !covered {
            dirs.push(bind);
        }
    }
    Ok(dirs)
}

/// The host's top-level symbolic links (`bin -> usr/bin` on a merged-/usr system), made again
/// in the guest's root.
fn host_links() -> Result<Vec<(String, String)>> {
    let entries = std::fs::read_dir("/").map_err(|source| Error::Io {
        what: "reading /".into(),
        source,
    })?;
    let mut links = Vec::new();
    for e in entries.filter_map(|e| e.ok()) {
        let Ok(target) = std::fs::read_link(e.path()) else {
            continue;
        };
        let name = e.file_name().to_string_lossy().to_string();
        // Only the usual ones (bin, lib, lib64, sbin, ...), not a machine's odd links.
        if target.is_relative() && target.starts_with("usr") {
            links.push((name, target.to_string_lossy().to_string()));
        }
    }
    links.sort();
    Ok(links)
}

/// qemu, killed and reaped when dropped.
struct Guest(Child);

impl Guest {
    /// The console's lines (as text, carriage returns removed), read on a thread of their own.
    fn lines(&mut self) -> mpsc::Receiver<String> {
        let (tx, rx) = mpsc::channel();
        if let Some(stdout) = self.0.stdout.take() {
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stdout);
                let mut line = Vec::new();
                loop {
                    line.clear();
                    match reader.read_until(b'\n', &mut line) {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {
                            let text = String::from_utf8_lossy(&line);
                            let text = text.trim_end_matches(['\n', '\r']).replace('\r', "");
                            if tx.send(text).is_err() {
                                break;
                            }
                        }
                    }
                }
            });
        }
        rx
    }

    /// Gives the guest a few seconds to power off after the script, then kills it.
    fn finish(&mut self) {
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.kill();
    }

    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }

    fn wait(&mut self) -> String {
        match self.0.wait() {
            Ok(s) => s.to_string(),
            Err(e) => e.to_string(),
        }
    }

    fn stderr(&mut self) -> String {
        let mut text = String::new();
        if let Some(mut err) = self.0.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut err, &mut text);
        }
        text
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A directory under the system's temporary directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Result<TempDir> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "kp-vm-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).map_err(|source| Error::Io {
            what: format!("creating {}", path.display()),
            source,
        })?;
        Ok(TempDir(path))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Whether this process runs in a kp-vm guest ([`Vm::run`] sets `KP_VM_GUEST`).
pub fn is_guest() -> bool {
    std::env::var_os("KP_VM_GUEST").is_some()
}

/// For a test that needs the guest's kernel: on the host, boots a guest (killed after
/// `timeout`) and runs test `name` of the current test binary there, alone, with ignored tests
/// included (kp-echo found or built here first: the guest's file system is the host's,
/// read-only), and panics unless it passed there. The guests of one test binary run one at a
/// time ([`Vm::run`]). Returns whether this is the guest (go on with the test) or the host
/// (done).
pub fn in_guest(name: &str, timeout: Duration) -> bool {
    if is_guest() {
        return true;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let echo = kp_test::echo_binary();
    let script = format!(
        "KP_ECHO={} {} --exact {name} --include-ignored --nocapture --test-threads 1",
        echo.display(),
        exe.display()
    );
    let run = Vm::new()
        .expect("qemu, the kernel and busybox are installed")
        .timeout(timeout)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_before_the_script_or_on_the_kernels_own_int3_is_run_again() {
        let oops = "[    1.658098] Oops: int3: 0000 [#1] PREEMPT SMP NOPTI\n\
                    [    1.660001] RIP: 0010:sched_clock_cpu+0x12/0x1d0\n\
                    [    1.661946] Kernel panic - not syncing: Fatal exception in interrupt\n";
        assert_eq!(crash_to_rerun(oops), Some(Crash::WhileBooting));
        // Any panic before the script started.
        let bug = "[    1.0] kernel BUG at mm/slub.c:1\n[    1.1] Kernel panic - not syncing: x\n";
        assert_eq!(crash_to_rerun(bug), Some(Crash::WhileBooting));
        // While the script ran: the kernel's own breakpoint only.
        let ready = format!("{}\n", init::READY);
        assert_eq!(
            crash_to_rerun(&format!("{ready}{oops}")),
            Some(Crash::PatchingRace)
        );
        assert_eq!(crash_to_rerun(&format!("{ready}{bug}")), None);
        let in_a_program = oops.replace("sched_clock_cpu", "bpf_prog_6deef7357e7b4530_kp_tc_reply");
        assert_eq!(crash_to_rerun(&format!("{ready}{in_a_program}")), None);
        // qemu ended without a panic (killed, or failed to start): nothing to run again.
        assert_eq!(crash_to_rerun("[    0.000000] Linux version 6.12\n"), None);
        assert_eq!(crash_to_rerun(&ready), None);
    }
}
