//! What the harness needs from a dataplane mode. A mode of the proxy's registry
//! ([`kp_proxy::modes::MODES`]) joins the benchmark by implementing [`ModeUnderTest`] and
//! returning its adapters from [`crate::modes::adapters`].

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use kp_core::dataplane::{Dataplane, SyncReport};
use kp_core::track::{Changes, ProxyState};
use kp_proxy::config::ProxyMode;

/// A mode's dataplane, driven in-process by the harness (as the binary's sync loop drives it).
pub trait SyncTarget {
    /// One sync, as [`kp_core::dataplane::Dataplane::sync`].
    fn sync(
        &mut self,
        state: &ProxyState,
        changes: &Changes,
        full: bool,
    ) -> anyhow::Result<SyncReport>;

    /// Reads the kernel back and lists the differences from the plan.
    fn verify(&mut self) -> anyhow::Result<Vec<String>>;

    /// The cgroup v2 directory the data-path clients must join before they connect, for a
    /// dataplane whose hooks act on a cgroup rather than a namespace (ebpf); a path they can
    /// reach from inside `ip netns exec` (which remounts `/sys`).
    fn client_cgroup(&self) -> Option<std::path::PathBuf> {
        None
    }

    /// What the dataplane's own kernel objects hold in memory, by object, in bytes, for a mode
    /// whose state lives in objects it made (ebpf: its BPF maps); `None` where the state is
    /// netfilter's, in the namespace's rules.
    fn kernel_memory(&self) -> anyhow::Result<Option<Vec<(String, u64)>>> {
        Ok(None)
    }
}

/// Every dataplane is a sync target: the harness drives it as the binary does.
impl<D: Dataplane> SyncTarget for D {
    fn sync(
        &mut self,
        state: &ProxyState,
        changes: &Changes,
        full: bool,
    ) -> anyhow::Result<SyncReport> {
        Ok(Dataplane::sync(self, state, changes, full)?)
    }

    fn verify(&mut self) -> anyhow::Result<Vec<String>> {
        Ok(Dataplane::verify(self)?)
    }
}

/// The time and size of rendering a full ruleset without applying it.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Rendered {
    /// Seconds spent rendering.
    pub seconds: f64,
    /// Statements, rules or elements rendered (the mode's own unit, as `SyncReport::operations`).
    pub operations: usize,
    /// Bytes of text.
    pub bytes: usize,
}

/// One run of a kernel tool: the command and what it reads on standard input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelInput {
    /// The command (`nft -f -`, `iptables-nft-restore -w 5 --noflush --counters`).
    pub command: Vec<String>,
    /// Its input.
    pub text: String,
}

/// Loads `inputs` with the bare kernel tools into `netns`, one tool run per input, in order;
/// returns how long the runs took together. Each input is read from a file written
/// beforehand, so the time is the tool's and the kernel's alone.
pub fn bare_load(netns: &str, inputs: &[KernelInput]) -> anyhow::Result<Duration> {
    let mut total = Duration::ZERO;
    for (i, input) in inputs.iter().enumerate() {
        let file = TempInput::new(&format!("{netns}-{i}.input"), &input.text)?;
        let command: Vec<&str> = input.command.iter().map(String::as_str).collect();
        total += timed_in_netns(netns, &command, Some(file.path()))?;
    }
    Ok(total)
}

/// One endpoint whose presence in the kernel the latency probe waits for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeTarget {
    /// The Service's namespace.
    pub namespace: String,
    /// The Service's name.
    pub service: String,
    /// The port's name.
    pub port_name: String,
    /// The Service's ClusterIP.
    pub vip: Ipv4Addr,
    /// Its TCP port.
    pub port: u16,
    /// The endpoint address.
    pub endpoint: Ipv4Addr,
    /// The endpoint's port.
    pub target_port: u16,
    /// How many ready endpoints the Service has (after the change).
    pub endpoints: usize,
}

/// Reads the kernel to tell whether an endpoint is live.
pub trait Probe: Send {
    /// Whether the kernel forwards `target.vip:port` to `target.endpoint` (among others).
    fn is_live(&mut self, target: &ProbeTarget) -> anyhow::Result<bool>;

    /// How long to wait between two reads: as short as the read allows without slowing the
    /// proxy down.
    fn interval(&self) -> Duration;
}

/// A dataplane mode under benchmark.
pub trait ModeUnderTest {
    /// The name in results and plots (`nftables`, `iptables-nft`, `iptables-legacy`): the
    /// registry mode's name, then the variant if the mode has several.
    fn name(&self) -> &'static str;

    /// The registry mode this adapter measures ([`kp_proxy::modes::MODES`]).
    fn mode(&self) -> ProxyMode;

    /// Why this mode cannot run here (a missing tool), if it cannot.
    fn unavailable(&self) -> Option<String>;

    /// Renders the full ruleset for `state` without applying it, with the settings
    /// [`ModeUnderTest::dataplane`] uses. Returns the time it took and the kernel tool's inputs,
    /// in order, exactly as a first full sync into an empty namespace sends them (not counting
    /// the mode's own small commands around them): the bare baseline loads these.
    fn render_full(&self, state: &ProxyState) -> (Rendered, Vec<KernelInput>);

    /// A dataplane that programs network namespace `netns` and has programmed nothing yet.
    fn dataplane(&self, netns: &str) -> Box<dyn SyncTarget>;

    /// A dataplane that plans exactly as [`ModeUnderTest::dataplane`] (and the binary) does but
    /// writes nothing: every program it would run to load rules is `sink` (which reads its
    /// input and exits 0). Its [`SyncTarget::verify`] still reads the kernel of `netns`, so after
    /// a full sync of a state it compares what someone else (the binary) programmed there with
    /// the plan of that state, with the mode's own read-back check. The iptables checker reads
    /// whole tables whatever their size.
    fn checker(&self, netns: &str, sink: &std::path::Path) -> Box<dyn SyncTarget>;

    /// A probe that reads the kernel of `netns`.
    fn probe(&self, netns: &str) -> anyhow::Result<Box<dyn Probe>>;

    /// The `kube-proxy` flags that select this mode: `--proxy-mode` with the registry mode's
    /// name.
    fn proxy_args(&self) -> Vec<String> {
        vec![format!("--proxy-mode={}", self.mode().as_str())]
    }

    /// Whether [`ModeUnderTest::probe`] sees an endpoint change in the kernel. A mode that keeps
    /// endpoints in the proxy process (userspace) says no: its binary runs measure start-up and
    /// memory, not programming latency.
    fn probe_sees_endpoints(&self) -> bool {
        true
    }

    /// Whether [`ModeUnderTest::dataplane`] relays connections in this process (userspace), so
    /// that this process's memory with connections held open is the proxy's per-connection
    /// cost.
    fn relays_in_process(&self) -> bool {
        false
    }

    /// What one run of the binary needs outside its namespace, made before it starts and
    /// removed when the returned guard drops, after the binary has stopped (ebpf: the cgroup
    /// and bpffs its [`ModeUnderTest::proxy_args`] name).
    fn binary_scratch(&self) -> anyhow::Result<Option<Box<dyn std::any::Any>>> {
        Ok(None)
    }

    /// Commands to run in the proxy's namespace before it starts, so that it picks this mode's
    /// variant (the iptables backend, which kube-proxy detects from what the node holds).
    fn proxy_setup(&self) -> Vec<Vec<String>>;
}

/// Runs `program args…` inside `netns` and times it, with `stdin` as its standard input (a file
/// is read the way the tool reads a pipe). Fails, with what it printed, if it fails.
pub fn timed_in_netns(
    netns: &str,
    program: &[&str],
    stdin: Option<&std::path::Path>,
) -> anyhow::Result<Duration> {
    let mut cmd = std::process::Command::new("ip");
    cmd.args(["netns", "exec", netns]).args(program);
    cmd.stdout(std::process::Stdio::null());
    cmd.stderr(std::process::Stdio::piped());
    match stdin {
        Some(path) => cmd.stdin(std::fs::File::open(path)?),
        None => cmd.stdin(std::process::Stdio::null()),
    };
    let start = Instant::now();
    let out = cmd.output()?;
    let took = start.elapsed();
    if !out.status.success() {
        anyhow::bail!(
            "{} failed: {}",
            program.join(" "),
            String::from_utf8_lossy(&out.stderr)
                .chars()
                .take(500)
                .collect::<String>()
        );
    }
    Ok(took)
}

/// Writes `text` to a temporary file that is removed when the guard drops.
pub struct TempInput(std::path::PathBuf);

impl TempInput {
    /// Writes it (and syncs, so the timed run reads from the page cache, not a dirty write).
    pub fn new(tag: &str, text: &str) -> anyhow::Result<TempInput> {
        use std::io::Write;
        let path = std::env::temp_dir().join(format!("kp-bench-{}-{tag}", std::process::id()));
        let mut f = std::fs::File::create(&path)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        Ok(TempInput(path))
    }

    /// Its path.
    pub fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempInput {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Polls `probe` every `interval` until `target` is live; returns when it was first seen, or an
/// error after `timeout`.
pub fn wait_live(
    probe: &mut dyn Probe,
    target: &ProbeTarget,
    interval: Duration,
    timeout: Duration,
) -> anyhow::Result<Instant> {
    let start = Instant::now();
    loop {
        if probe.is_live(target)? {
            return Ok(Instant::now());
        }
        if start.elapsed() > timeout {
            anyhow::bail!(
                "{}/{}: {}:{} → {}:{} not live after {:.1} s",
                target.namespace,
                target.service,
                target.vip,
                target.port,
                target.endpoint,
                target.target_port,
                start.elapsed().as_secs_f64()
            );
        }
        std::thread::sleep(interval);
    }
}
