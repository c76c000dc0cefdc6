//! Uniquely named network namespaces that clean up after themselves.
//!
//! A [`Netns`] is named `kpt-<pid>-<counter>-<role>`, so parallel tests in one process and
//! parallel test processes never collide, and a namespace left behind by a killed process can
//! be recognised: [`sweep_stale`] removes those whose process is gone (it runs once per
//! process, before the first namespace is created). Dropping a `Netns` kills whatever still
//! runs inside it and deletes it, also while a test panics.
//!
//! Everything here works through iproute2 (`ip netns`, `ip -n`), the same commands a person
//! would type, so a failing step can be replayed by hand. Nothing touches the namespace the
//! tests run in: links are created inside a lab namespace and their peers are created directly
//! in the other one.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Once, PoisonError};
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// The first word of every namespace name this crate creates.
const PREFIX: &str = "kpt";

/// Numbers namespaces and process logs within this process.
static COUNTER: AtomicU64 = AtomicU64::new(0);

static SWEEP: Once = Once::new();

/// Whether this process still creates namespaces ([`stop_creating`]); held while one is being
/// created, so stopping waits for a creation in progress.
static CREATING: Mutex<bool> = Mutex::new(true);

/// Stops this process from creating namespaces: returns once no creation is in progress, and
/// every [`Netns::new`] after it fails with [`Error::Stopping`], so that no new one appears
/// behind [`remove_own`]'s back.
fn stop_creating() {
    *CREATING.lock().unwrap_or_else(PoisonError::into_inner) = false;
}

/// A network namespace owned by a test; deleted, with everything running in it, on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
    /// The cgroup v2 directory every process started inside joins first
    /// ([`Netns::place_in_cgroup`]).
    cgroup: Mutex<Option<PathBuf>>,
}

impl Netns {
    /// Creates a namespace named `kpt-<pid>-<n>-<role>` and brings its loopback up.
    ///
    /// `role` (`node`, `pod0`, ...) only helps a person reading `ip netns list`: at most 20
    /// ASCII letters, digits and dashes.
    pub fn new(role: &str) -> Result<Netns> {
        let valid = !role.is_empty()
            && role.len() <= 20
            && role.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
        if !valid {
            return Err(Error::InvalidArgument(format!(
                "namespace role `{role}`: use 1-20 ASCII letters, digits or dashes"
            )));
        }
        SWEEP.call_once(sweep_stale);
        let creating = CREATING.lock().unwrap_or_else(PoisonError::into_inner);
        if !*creating {
            return Err(Error::Stopping);
        }
        let pid = std::process::id();
        for _ in 0..100 {
            let name = format!("{PREFIX}-{pid}-{}-{role}", next_number());
            match run(Command::new("ip").args(["netns", "add", &name])) {
                Ok(_) => {
                    // From here on, Drop deletes it whatever fails next.
                    let ns = Netns {
                        name,
                        cgroup: Mutex::new(None),
                    };
                    ns.ip(&["link", "set", "lo", "up"])?;
                    return Ok(ns);
                }
                // Left by an earlier process that had our pid; take the next number.
                Err(Error::Command { stderr, .. }) if stderr.contains("exists") => continue,
                Err(e) => return Err(e),
            }
        }
        Err(Error::InvalidArgument(format!(
            "no free namespace name for role `{role}` after 100 tries"
        )))
    }

    /// The namespace's name, as `ip netns list` shows it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `ip netns exec NAME args...` and returns its output, whatever its exit status.
    ///
    /// Fails only if the command cannot be started; use [`Netns::run`] to also require success.
    pub fn exec(&self, args: &[&str]) -> Result<Output> {
        let mut cmd = self.command(args);
        cmd.stdin(Stdio::null());
        cmd.output().map_err(|source| Error::Spawn {
            command: describe(&cmd),
            source,
        })
    }

    /// Runs `ip netns exec NAME args...`, requires exit status 0 and returns standard output.
    pub fn run(&self, args: &[&str]) -> Result<String> {
        run(&mut self.command(args))
    }

    /// Deletes the rule of nftables chain `family table chain` whose comment is `comment`
    /// (found by its handle in `nft -a list chain`), as something behind the proxy's back
    /// would. [`Error::InvalidArgument`] when the chain holds no such rule.
    pub fn delete_nft_rule(
        &self,
        family: &str,
        table: &str,
        chain: &str,
        comment: &str,
    ) -> Result<()> {
        let listing = self.run(&["nft", "-a", "list", "chain", family, table, chain])?;
        let quoted = format!("comment \"{comment}\"");
        let handle = listing
            .lines()
            .find(|l| l.contains(&quoted))
            .and_then(|l| l.rsplit_once("# handle "))
            .map(|(_, h)| h.trim().to_string())
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "no rule commented {comment:?} in {family} {table} {chain}:\n{listing}"
                ))
            })?;
        self.run(&[
            "nft", "delete", "rule", family, table, chain, "handle", &handle,
        ])?;
        Ok(())
    }

    /// Runs `ip -n NAME args...` (iproute2 inside this namespace) and returns standard output.
    pub fn ip(&self, args: &[&str]) -> Result<String> {
        run(Command::new("ip").args(["-n", &self.name]).args(args))
    }

    /// Starts `args` inside the namespace in the background.
    ///
    /// Its standard output and error go to a log file ([`ChildGuard::log`]); the returned guard
    /// kills and reaps the process when dropped.
    pub fn spawn(&self, args: &[&str]) -> Result<ChildGuard> {
        let program = args.first().map_or("process", |p| {
            Path::new(p)
                .file_name()
                .and_then(|f| f.to_str())
                .unwrap_or("process")
        });
        let log_path =
            std::env::temp_dir().join(format!("{}-{}-{program}.log", self.name, next_number()));
        let io_error = |source| Error::Io {
            what: format!("creating log file {}", log_path.display()),
            source,
        };
        let log = File::create(&log_path).map_err(io_error)?;
        let log_err = log.try_clone().map_err(io_error)?;
        let mut cmd = self.command(args);
        cmd.stdin(Stdio::null()).stdout(log).stderr(log_err);
        let command = describe(&cmd);
        match cmd.spawn() {
            Ok(child) => Ok(ChildGuard {
                child,
                command,
                log_path,
            }),
            Err(source) => {
                let _ = std::fs::remove_file(&log_path);
                Err(Error::Spawn { command, source })
            }
        }
    }

    /// Sets a sysctl inside the namespace (`sysctl -w key=value`); `net.*` keys are per
    /// namespace, so this never changes the machine's own settings.
    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        self.run(&["sysctl", "-q", "-w", &format!("{key}={value}")])
            .map(drop)
    }

    /// Adds an address (`10.0.0.1/24`, `fd00::1/64`) to `dev`. IPv6 addresses skip duplicate
    /// address detection (`nodad`), so they are usable at once instead of after ~2 s.
    pub fn add_addr(&self, dev: &str, cidr: &str) -> Result<()> {
        let mut args = vec!["addr", "add", cidr, "dev", dev];
        if cidr.contains(':') {
            args.push("nodad");
        }
        self.ip(&args).map(drop)
    }

    /// Adds a route to `dest` (`default`, `10.96.0.0/16`, `fd00::/64`) through the gateway `via`.
    pub fn add_route(&self, dest: &str, via: &str) -> Result<()> {
        let family = if via.contains(':') { "-6" } else { "-4" };
        self.ip(&[family, "route", "add", dest, "via", via])
            .map(drop)
    }

    /// Adds a route to `dest` straight out of `dev` (on-link, no gateway).
    pub fn add_route_dev(&self, dest: &str, dev: &str) -> Result<()> {
        let family = if dest.contains(':') { "-6" } else { "-4" };
        self.ip(&[family, "route", "add", dest, "dev", dev])
            .map(drop)
    }

    /// Sets `dev` up.
    pub fn link_up(&self, dev: &str) -> Result<()> {
        self.ip(&["link", "set", dev, "up"]).map(drop)
    }

    /// The processes running in the namespace (`ip netns pids`).
    pub fn pids(&self) -> Vec<u32> {
        pids(&self.name)
    }

    /// From now on, every process started inside the namespace ([`Netns::exec`],
    /// [`Netns::run`], [`Netns::spawn`]; not the `ip -n` commands) first moves itself into the
    /// cgroup v2 directory `cgroup` (`None`: stays where the test is). For tests whose
    /// programs act on a cgroup (ebpf mode's socket hooks): only the lab's processes join it,
    /// never the test process, whose other tests' children would join too.
    pub fn place_in_cgroup(&self, cgroup: Option<&Path>) {
        *self.cgroup.lock().unwrap_or_else(PoisonError::into_inner) = cgroup.map(Path::to_path_buf);
    }

    fn command(&self, args: &[&str]) -> Command {
        let cgroup = self.cgroup.lock().unwrap_or_else(PoisonError::into_inner);
        let mut cmd = match cgroup.as_ref() {
            // The shell writes its own pid, then becomes `ip netns exec`.
            Some(dir) => {
                let mut cmd = Command::new("sh");
                cmd.args(["-c", "echo $$ > \"$0\" && exec \"$@\""])
                    .arg(dir.join("cgroup.procs"))
                    .arg("ip");
                cmd
            }
            None => Command::new("ip"),
        };
        cmd.args(["netns", "exec", &self.name]).args(args);
        cmd
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = delete(&self.name) {
            eprintln!(
                "kp-test: could not delete network namespace {}: {e}",
                self.name
            );
        }
    }
}

/// Kills everything in namespace `name`, then deletes it.
fn delete(name: &str) -> Result<()> {
    // Twice, in case something forked while we were killing it.
    for _ in 0..2 {
        let pids = pids(name);
        if pids.is_empty() {
            break;
        }
        let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
        let _ = Command::new("kill")
            .arg("-KILL")
            .args(&pids)
            .stderr(Stdio::null())
            .status();
    }
    run(Command::new("ip").args(["netns", "delete", name])).map(drop)
}

fn pids(name: &str) -> Vec<u32> {
    Command::new("ip")
        .args(["netns", "pids", name])
        .stderr(Stdio::null())
        .output()
        .map(|out| {
            String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// One end of a veth pair for [`veth`].
#[derive(Debug, Clone, Copy)]
pub struct VethEnd<'a> {
    /// The namespace this end lives in.
    pub ns: &'a Netns,
    /// The interface name inside that namespace (at most 15 bytes; it only has to be unique
    /// within the namespace).
    pub dev: &'a str,
    /// Addresses to add, as `ADDR/PREFIX`, IPv4 or IPv6.
    pub addrs: &'a [&'a str],
}

/// Creates a veth pair from `a` to `b`, adds each end's addresses and sets both ends up.
///
/// iproute2: `ip -n A link add A_DEV type veth peer name B_DEV netns B`. The peer is created in
/// `b` directly, so no interface ever exists in the namespace the tests run in.
pub fn veth(a: VethEnd<'_>, b: VethEnd<'_>) -> Result<()> {
    a.ns.ip(&[
        "link",
        "add",
        a.dev,
        "type",
        "veth",
        "peer",
        "name",
        b.dev,
        "netns",
        b.ns.name(),
    ])?;
    for end in [a, b] {
        for addr in end.addrs {
            end.ns.add_addr(end.dev, addr)?;
        }
        end.ns.link_up(end.dev)?;
    }
    Ok(())
}

/// A background process in a namespace; killed and reaped when dropped.
///
/// If the test is panicking at that moment, the end of the process's log is printed first,
/// since it usually explains the failure. The log file is removed either way.
#[derive(Debug)]
pub struct ChildGuard {
    child: Child,
    command: String,
    log_path: PathBuf,
}

impl ChildGuard {
    /// The process id (the program itself: `ip netns exec` execs it in place).
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Where its standard output and error go.
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// Everything it has printed so far.
    pub fn log(&self) -> String {
        std::fs::read(&self.log_path)
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
            .unwrap_or_default()
    }

    /// Whether it has exited, and how.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        self.child.try_wait().map_err(|source| Error::Io {
            what: format!("waiting for `{}`", self.command),
            source,
        })
    }

    /// Waits until its log contains `needle` (a readiness line), failing early if it exits.
    pub fn wait_for_log(&mut self, needle: &str, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            if self.log().contains(needle) {
                return Ok(());
            }
            let detail = match self.try_wait()? {
                Some(status) => format!("it exited ({status})"),
                None if start.elapsed() >= timeout => "timed out".to_string(),
                None => {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            return Err(Error::NotReady {
                what: format!("`{needle}` from `{}`", self.command),
                after: start.elapsed(),
                detail: format!("{detail}; log ends with:\n{}", tail(&self.log(), 20)),
            });
        }
    }

    /// Kills it at once with SIGKILL (`kill -9`: no cleanup of its own runs) and waits for it.
    pub fn kill_now(&mut self) -> Result<ExitStatus> {
        if let Some(status) = self.try_wait()? {
            return Ok(status);
        }
        let _ = self.child.kill();
        self.child.wait().map_err(|source| Error::Io {
            what: format!("waiting for `{}`", self.command),
            source,
        })
    }

    /// Asks it to stop with SIGTERM, waits up to `grace`, then kills it. Returns how it exited.
    pub fn terminate(&mut self, grace: Duration) -> Result<ExitStatus> {
        if let Some(status) = self.try_wait()? {
            return Ok(status);
        }
        let _ = Command::new("kill")
            .args(["-TERM", &self.id().to_string()])
            .stderr(Stdio::null())
            .status();
        let start = Instant::now();
        while start.elapsed() < grace {
            if let Some(status) = self.try_wait()? {
                return Ok(status);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        self.child.wait().map_err(|source| Error::Io {
            what: format!("waiting for `{}`", self.command),
            source,
        })
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "kp-test: log of `{}` (last 40 lines):\n{}",
                self.command,
                tail(&self.log(), 40)
            );
        }
        let _ = std::fs::remove_file(&self.log_path);
    }
}

/// Whether this process runs as root. If not, prints a loud SKIPPED banner and returns false;
/// root-only tests call it first and return when it is false.
pub fn require_root() -> bool {
    // Effective uid: the second number of the `Uid:` line.
    let euid = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|ids| ids.split_whitespace().nth(1))
                .and_then(|id| id.parse::<u32>().ok())
        });
    if euid == Some(0) {
        return true;
    }
    let banner = "!".repeat(72);
    eprintln!(
        "\n{banner}\n!! SKIPPED: needs root. This test creates network namespaces.\n!! Run as root: cargo test -- --include-ignored\n{banner}\n"
    );
    false
}

/// The names in `ip netns list`.
pub fn list() -> Result<Vec<String>> {
    let out = run(Command::new("ip").args(["netns", "list"]))?;
    // Lines read `NAME` or `NAME (id: N)`.
    Ok(out
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect())
}

/// The process that created namespace `name` (`kpt-<pid>-…`), if this crate named it.
fn owner(name: &str) -> Option<u32> {
    name.strip_prefix(PREFIX)?
        .strip_prefix('-')?
        .split('-')
        .next()?
        .parse()
        .ok()
}

/// Deletes namespaces this crate created in processes that no longer exist (a test killed by
/// a signal cannot run its Drop guards), and the logs of what they spawned. Namespaces of live
/// processes are left alone.
pub fn sweep_stale() {
    let me = std::process::id();
    let dead = |pid: u32| pid != me && !Path::new(&format!("/proc/{pid}")).exists();
    for name in list().unwrap_or_default() {
        let Some(pid) = owner(&name) else {
            continue;
        };
        if dead(pid) {
            if let Err(e) = delete(&name) {
                eprintln!("kp-test: could not delete stale namespace {name}: {e}");
            }
        }
    }
    remove_spawn_logs(dead);
}

/// Deletes the logs [`Netns::spawn`] wrote (`<namespace>-<n>-<program>.log` in the temporary
/// directory) for namespaces of the processes `whose` picks: a process that exits on a signal
/// drops no [`ChildGuard`], which would have deleted them.
fn remove_spawn_logs(whose: impl Fn(u32) -> bool) {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.filter_map(std::result::Result::ok) {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".log") && owner(&name).is_some_and(&whose) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// For a process about to exit on a signal, whose Drop guards will not run: stops it creating
/// namespaces (waiting for a creation in progress; every later [`Netns::new`] fails with
/// [`Error::Stopping`]), then kills everything in each namespace it created and deletes them,
/// and the logs of what it spawned in them. Returns how many namespaces it deleted.
pub fn remove_own() -> usize {
    stop_creating();
    let me = std::process::id();
    let mut removed = 0;
    for name in list().unwrap_or_default() {
        if owner(&name) != Some(me) {
            continue;
        }
        match delete(&name) {
            Ok(()) => removed += 1,
            Err(e) => eprintln!("kp-test: could not delete namespace {name}: {e}"),
        }
    }
    remove_spawn_logs(|pid| pid == me);
    removed
}

fn next_number() -> u64 {
    COUNTER.fetch_add(1, Ordering::Relaxed)
}

/// Runs a command, requires success, returns standard output.
fn run(cmd: &mut Command) -> Result<String> {
    let command = describe(cmd);
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|source| Error::Spawn {
            command: command.clone(),
            source,
        })?;
    if !out.status.success() {
        return Err(Error::Command {
            command,
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
