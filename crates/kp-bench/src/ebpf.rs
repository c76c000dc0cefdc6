//! The ebpf mode under benchmark: `kp_ebpf::dataplane::EbpfDataplane` in-process, its socket
//! hooks attached to a cgroup of the harness's own and its maps (and links) pinned on a bpffs
//! the harness mounts; the planner alone (`kp_ebpf_plan::plan_state`) for render timing; a
//! lookup in the pinned maps for the binary's latency probe.
//!
//! # Where the hooks act
//!
//! The mode's hooks act on a cgroup, not on a network namespace: attached to the cgroup v2
//! root they would rewrite the connections of every process on the machine. Every dataplane
//! this adapter makes, and every run of the binary, gets a [`Scratch`] of its own:
//!
//! - a child cgroup `kp-bench-ebpf-<pid>-<n>-<what>` of the cgroup v2 root (never the root
//!   itself), bind-mounted on `<tmp>/kp-bench-ebpf-<pid>-<n>-<what>/cgroup`;
//! - a bpffs mounted on `<tmp>/kp-bench-ebpf-<pid>-<n>-<what>/bpf`, the pins under `pins/`.
//!
//! Both live under the temporary directory because `ip netns exec` remounts `/sys` in the
//! namespace it enters: the binary (started in its namespace that way) and the data-path
//! clients (which write their own pid into the cgroup before they run, see
//! [`crate::datapath::Plan::cgroup`]) see them there. The guard removes the pins (which
//! detaches the links), kills what is left in the cgroup, unmounts both and removes the
//! directories; [`remove_own`] does the same for every scratch of this process when a run is
//! interrupted.
//!
//! # What is measured
//!
//! - The full sync and the one-endpoint changes: the dataplane's sync, started (loaded,
//!   attached, links pinned) beforehand as the binary starts it. Its settings are the
//!   registry's ([`kp_proxy::modes::ebpf_settings`] of the binary's configuration) except the
//!   map sizes: the binary's defaults ([`kp_ebpf::MapSizes::default`], 65,536 services-map
//!   entries: a frontend and one slot per endpoint each) hold about 5,000 Services × 10
//!   endpoints, so the in-process maps are sized for 30,000 ([`IN_PROCESS_SIZES`]).
//! - No bare baseline: there is no kernel tool to load the maps with. [`ModeUnderTest::render_full`]
//!   returns no kernel input; the apply part of the full sync (full − render) is the map
//!   writes through `kp-ebpf` (and the read-back of the empty maps the full sync diffs with).
//! - The data path: the clients in the cgroup, straight to the pod as well as to the
//!   ClusterIP, so both pass the hooks.
//! - The binary: `--bpf-cgroup-root` and `--bpf-pin-dir` name the run's scratch; its probe
//!   reads the Service's slots and backends from the pinned maps.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aya::maps::{HashMap, Map, MapData};
use kp_core::dataplane::{Dataplane, SyncReport};
use kp_core::model::Protocol;
use kp_core::track::{Changes, ProxyState};
use kp_ebpf::dataplane::EbpfDataplane;
use kp_ebpf::MapSizes;
use kp_ebpf_plan::layout::{BACKEND_SIZE, SERVICE_KEY_SIZE, SERVICE_VALUE_SIZE};
use kp_ebpf_plan::{Backend, Contents, FrontendAddr, ServiceKey, ServiceValue};
use kp_metrics::Metrics;
use kp_proxy::config::ProxyMode;
use kp_proxy::modes::ModeContext;

use crate::mode::{KernelInput, ModeUnderTest, Probe, ProbeTarget, Rendered, SyncTarget};

/// The in-process maps' sizes: 30,000 Services × 10 endpoints with the bench's mix (about
/// 1.3 frontends per Service: extra ports, NodePorts, load-balancer IPs) is about 430,000
/// services-map entries and 300,000 backends.
pub const IN_PROCESS_SIZES: MapSizes = MapSizes {
    services: 1 << 20,
    backends: 1 << 19,
    rev_nat: 65535,
    sockets: 262_144,
    addrs: 1 << 17,
    affinity: 65536,
    src_ranges: 16384,
    connections: 262_144,
};

/// What the names of this process's scratch directories and cgroups start with.
fn own_prefix() -> String {
    format!("kp-bench-ebpf-{}-", std::process::id())
}

static NEXT: AtomicU32 = AtomicU32::new(0);

/// Set once [`remove_own`] ran: no scratch is made after it.
static CLOSED: Mutex<bool> = Mutex::new(false);

/// The cgroup v2 hierarchy's root.
fn cgroup2_root() -> anyhow::Result<PathBuf> {
    kp_ebpf::cgroup::find_cgroup2_root()?
        .ok_or_else(|| anyhow::anyhow!("no cgroup v2 hierarchy is mounted (/proc/self/mountinfo)"))
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let out = cmd.output()?;
    if !out.status.success() {
        anyhow::bail!("{cmd:?}: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// A cgroup and a bpffs of the harness's own (module docs), removed on drop.
pub struct Scratch {
    /// `<tmp>/<name>`: `cgroup` (the bind mount) and `bpf` (the bpffs) inside.
    base: PathBuf,
    /// The cgroup's own directory under the cgroup v2 root.
    cgroup_dir: PathBuf,
}

impl Scratch {
    /// The scratch named `kp-bench-ebpf-<pid>-<what>`, made now.
    fn create(what: &str) -> anyhow::Result<Scratch> {
        let closed = CLOSED.lock().unwrap_or_else(|e| e.into_inner());
        if *closed {
            anyhow::bail!("the run is being interrupted");
        }
        let name = format!("{}{what}", own_prefix());
        let root = cgroup2_root()?;
        let scratch = Scratch {
            base: std::env::temp_dir().join(&name),
            cgroup_dir: root.join(&name),
        };
        // A child of the root, never the root itself.
        assert!(scratch.cgroup_dir.parent() == Some(root.as_path()) && scratch.cgroup_dir != root);
        let made = (|| {
            std::fs::create_dir(&scratch.cgroup_dir)?;
            std::fs::create_dir(&scratch.base)?;
            std::fs::create_dir(scratch.base.join("cgroup"))?;
            std::fs::create_dir(scratch.base.join("bpf"))?;
            run(Command::new("mount")
                .arg("--bind")
                .arg(&scratch.cgroup_dir)
                .arg(scratch.base.join("cgroup")))?;
            run(Command::new("mount")
                .args(["-t", "bpf", "bpf"])
                .arg(scratch.base.join("bpf")))?;
            Ok::<_, anyhow::Error>(())
        })();
        drop(closed);
        // On failure the guard removes what was made.
        made.map(|()| scratch)
    }

    /// A fresh one for one dataplane.
    fn fresh(what: &str) -> anyhow::Result<Scratch> {
        Scratch::create(&format!("{}-{what}", NEXT.fetch_add(1, Ordering::Relaxed)))
    }

    /// The cgroup as the hooks and the processes in namespaces see it (the bind mount).
    pub fn cgroup(&self) -> PathBuf {
        self.base.join("cgroup")
    }

    /// The pin directory, on the scratch's bpffs.
    pub fn pins(&self) -> PathBuf {
        self.base.join("bpf").join("pins")
    }

    /// Removes everything; each step runs whatever the previous ones did.
    fn remove(&self) {
        if let Err(e) = kp_ebpf::remove_pins(&self.pins()) {
            eprintln!("bench: removing the pins in {}: {e}", self.pins().display());
        }
        let me = std::process::id().to_string();
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut umounted = false;
        loop {
            let procs =
                std::fs::read_to_string(self.cgroup_dir.join("cgroup.procs")).unwrap_or_default();
            // The harness never enters its cgroups; were it inside, it would not kill itself.
            for pid in procs.split_whitespace().filter(|p| *p != me) {
                let _ = Command::new("kill").args(["-9", pid]).status();
            }
            if !umounted {
                for dir in ["bpf", "cgroup"] {
                    let _ = Command::new("umount")
                        .arg(self.base.join(dir))
                        .stderr(std::process::Stdio::null())
                        .status();
                }
                umounted = true;
            }
            match std::fs::remove_dir(&self.cgroup_dir) {
                Ok(()) => break,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                Err(e) if Instant::now() > deadline => {
                    eprintln!(
                        "bench: cgroup {} left behind: {e}",
                        self.cgroup_dir.display()
                    );
                    break;
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
        for dir in [
            self.base.join("bpf"),
            self.base.join("cgroup"),
            self.base.clone(),
        ] {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        self.remove();
    }
}

/// Removes every scratch of this process (an interrupted run) and refuses new ones; returns
/// how many it removed.
pub fn remove_own() -> usize {
    let mut closed = CLOSED.lock().unwrap_or_else(|e| e.into_inner());
    *closed = true;
    let prefix = own_prefix();
    let mut names = std::collections::BTreeSet::new();
    let dirs = [Some(std::env::temp_dir()), cgroup2_root().ok()];
    for dir in dirs.iter().flatten() {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(&prefix) {
                names.insert(name);
            }
        }
    }
    let Ok(root) = cgroup2_root() else {
        return 0;
    };
    for name in &names {
        // Dropped at once: removes it.
        let _ = Scratch {
            base: std::env::temp_dir().join(name),
            cgroup_dir: root.join(name),
        };
    }
    names.len()
}

/// The ebpf mode, configured as the binary is from the bench's flags (with its cgroup and pin
/// directory the run's scratch).
#[derive(Clone, Debug, Default)]
pub struct Ebpf;

/// The name of the binary runs' scratch (one run at a time).
const BINARY_SCRATCH: &str = "proxy";

impl Ebpf {
    /// The binary runs' scratch paths: (cgroup, pin directory).
    fn binary_paths() -> (PathBuf, PathBuf) {
        let base = std::env::temp_dir().join(format!("{}{BINARY_SCRATCH}", own_prefix()));
        (base.join("cgroup"), base.join("bpf").join("pins"))
    }

    /// The in-process dataplane's settings: the registry's of the binary's configuration,
    /// with `scratch`'s cgroup and pins, and [`IN_PROCESS_SIZES`].
    fn settings(
        &self,
        netns: &str,
        scratch: &Scratch,
    ) -> anyhow::Result<kp_ebpf::dataplane::Config> {
        let mut config = crate::proxy::binary_config(self)?;
        config.bpf_cgroup_root = Some(scratch.cgroup());
        config.bpf_pin_dir = scratch.pins();
        let ctx = ModeContext {
            netns: Some(netns),
            ..ModeContext::new(&config, Arc::new(Metrics::new()))
        };
        let settings = kp_proxy::modes::ebpf_settings(&ctx)
            .map_err(|e| anyhow::anyhow!("ebpf: the binary's settings: {e}"))?;
        Ok(kp_ebpf::dataplane::Config {
            sizes: IN_PROCESS_SIZES,
            ..settings
        })
    }

    fn attached(&self, netns: &str) -> anyhow::Result<Attached> {
        let scratch = Scratch::fresh("dp")?;
        let mut dataplane = EbpfDataplane::new(self.settings(netns, &scratch)?);
        dataplane
            .start()
            .map_err(|e| anyhow::anyhow!("ebpf: load and attach: {e}"))?;
        Ok(Attached {
            dataplane: Some(dataplane),
            scratch,
        })
    }
}

/// The dataplane, started (programs loaded and attached to its scratch cgroup, links and maps
/// pinned) when made, as the binary starts it before its first sync.
struct Attached {
    dataplane: Option<EbpfDataplane>,
    scratch: Scratch,
}

impl Drop for Attached {
    fn drop(&mut self) {
        // Detach and unpin before the scratch goes.
        if let Some(mut dp) = self.dataplane.take() {
            let _ = dp.cleanup();
        }
    }
}

impl SyncTarget for Attached {
    fn sync(
        &mut self,
        state: &ProxyState,
        changes: &Changes,
        full: bool,
    ) -> anyhow::Result<SyncReport> {
        let dp = self.dataplane.as_mut().expect("dataplane");
        Ok(Dataplane::sync(dp, state, changes, full)?)
    }

    fn verify(&mut self) -> anyhow::Result<Vec<String>> {
        let dp = self.dataplane.as_mut().expect("dataplane");
        Ok(Dataplane::verify(dp)?)
    }

    fn client_cgroup(&self) -> Option<PathBuf> {
        Some(self.scratch.cgroup())
    }

    fn kernel_memory(&self) -> anyhow::Result<Option<Vec<(String, u64)>>> {
        pinned_map_memory(&self.scratch.pins()).map(Some)
    }
}

/// Each map pinned under `pins` and the memory the kernel charges for it: `memlock` in the
/// fdinfo of a descriptor of it (the map's own accounting of its memory use, Linux 6.5+).
pub fn pinned_map_memory(pins: &Path) -> anyhow::Result<Vec<(String, u64)>> {
    use std::os::fd::{AsFd, AsRawFd};
    let mut out = Vec::new();
    for name in kp_ebpf::names::ALL {
        let path = pins.join(name);
        if !path.exists() {
            continue;
        }
        let map = MapData::from_pin(&path)
            .map_err(|e| anyhow::anyhow!("opening {}: {e}", path.display()))?;
        let fd = map.fd().as_fd().as_raw_fd();
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))?;
        let bytes = info
            .lines()
            .find_map(|l| l.strip_prefix("memlock:"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .ok_or_else(|| anyhow::anyhow!("no memlock in the fdinfo of {name}"))?;
        out.push((name.to_string(), bytes));
    }
    Ok(out)
}

/// A dataplane that could not be made: every sync says why.
struct Failed(String);

impl SyncTarget for Failed {
    fn sync(&mut self, _: &ProxyState, _: &Changes, _: bool) -> anyhow::Result<SyncReport> {
        anyhow::bail!("{}", self.0)
    }

    fn verify(&mut self) -> anyhow::Result<Vec<String>> {
        anyhow::bail!("{}", self.0)
    }
}

/// Reads the binary's pinned maps: the Service's slot 0 (the count), its slots, their
/// backends. Opens the maps once the binary has pinned them.
struct PinnedProbe {
    pins: PathBuf,
    maps: Option<PinnedMaps>,
}

type Services = HashMap<MapData, [u8; SERVICE_KEY_SIZE], [u8; SERVICE_VALUE_SIZE]>;
type Backends = HashMap<MapData, [u8; 4], [u8; BACKEND_SIZE]>;

struct PinnedMaps {
    services: Services,
    backends: Backends,
}

fn open_pinned<T: TryFrom<Map, Error = aya::maps::MapError>>(path: &Path) -> anyhow::Result<T> {
    let data = MapData::from_pin(path)?;
    Ok(T::try_from(Map::from_map_data(data)?)?)
}

impl PinnedProbe {
    fn maps(&mut self) -> anyhow::Result<Option<&PinnedMaps>> {
        if self.maps.is_none() {
            let services = self.pins.join(kp_ebpf::names::SERVICES);
            let backends = self.pins.join(kp_ebpf::names::BACKENDS);
            if !services.exists() || !backends.exists() {
                return Ok(None);
            }
            self.maps = Some(PinnedMaps {
                services: open_pinned(&services)?,
                backends: open_pinned(&backends)?,
            });
        }
        Ok(self.maps.as_ref())
    }
}

fn lookup<const K: usize, const V: usize>(
    map: &HashMap<MapData, [u8; K], [u8; V]>,
    key: &[u8; K],
) -> anyhow::Result<Option<[u8; V]>> {
    match map.get(key, 0) {
        Ok(v) => Ok(Some(v)),
        Err(aya::maps::MapError::KeyNotFound) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

impl Probe for PinnedProbe {
    fn interval(&self) -> Duration {
        // A handful of map lookups, each a system call.
        Duration::from_millis(1)
    }

    fn is_live(&mut self, t: &ProbeTarget) -> anyhow::Result<bool> {
        let Some(maps) = self.maps()? else {
            return Ok(false);
        };
        let frontend = FrontendAddr {
            ip: IpAddr::V4(t.vip),
            port: t.port,
            protocol: Protocol::Tcp,
            scope: kp_ebpf_plan::Scope::Socket,
        };
        let key = |slot| ServiceKey { frontend, slot }.to_bytes();
        let Some(head) = lookup(&maps.services, &key(0))? else {
            return Ok(false);
        };
        let count = ServiceValue::from_bytes(&head).map_or(0, |v| v.count);
        for slot in 1..=count {
            let Some(v) = lookup(&maps.services, &key(slot))? else {
                continue;
            };
            let Some(id) = ServiceValue::from_bytes(&v).map(|v| v.backend_id) else {
                continue;
            };
            let Some(b) = lookup(&maps.backends, &id.to_ne_bytes())? else {
                continue;
            };
            if Backend::from_bytes(&b)
                .is_some_and(|b| b.ip == IpAddr::V4(t.endpoint) && b.port == t.target_port)
            {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

impl ModeUnderTest for Ebpf {
    fn name(&self) -> &'static str {
        "ebpf"
    }

    fn mode(&self) -> ProxyMode {
        ProxyMode::Ebpf
    }

    fn unavailable(&self) -> Option<String> {
        match cgroup2_root() {
            Ok(_) => None,
            Err(e) => Some(format!("{e:#}")),
        }
    }

    fn render_full(&self, state: &ProxyState) -> (Rendered, Vec<KernelInput>) {
        let config = crate::proxy::binary_config(self).unwrap_or_else(|e| panic!("{e:#}"));
        let node_ports =
            kp_proxy::modes::ebpf_settings(&ModeContext::new(&config, Arc::new(Metrics::new())))
                .unwrap_or_else(|e| panic!("ebpf: the binary's settings: {e}"))
                .node_ports;
        let start = Instant::now();
        // As the dataplane's full sync into empty maps: the node's addresses (as its sync reads
        // them, for NodePorts on every local address), the plan, the diff with nothing.
        let local = match node_ports {
            kp_core::node::NodePortAddresses::Primary => Vec::new(),
            _ => kp_ebpf::local::local_addresses().unwrap_or_default(),
        };
        let operations = kp_ebpf_plan::plan_state(state, &node_ports, &local)
            .map(|planner| kp_ebpf_plan::diff(&Contents::default(), &planner.contents()).len())
            .unwrap_or_else(|e| panic!("ebpf: planning: {e}"));
        let rendered = Rendered {
            seconds: start.elapsed().as_secs_f64(),
            operations,
            bytes: 0,
        };
        (rendered, Vec::new())
    }

    fn dataplane(&self, netns: &str) -> Box<dyn SyncTarget> {
        match self.attached(netns) {
            Ok(a) => Box::new(a),
            Err(e) => Box::new(Failed(format!("{e:#}"))),
        }
    }

    fn checker(&self, _netns: &str, _sink: &Path) -> Box<dyn SyncTarget> {
        Box::new(Failed(
            "the churn soak's kernel check is not built for ebpf mode (its dataplane writes maps, \
             not through a program that could be a sink)"
                .into(),
        ))
    }

    fn probe(&self, _netns: &str) -> anyhow::Result<Box<dyn Probe>> {
        Ok(Box::new(PinnedProbe {
            pins: Ebpf::binary_paths().1,
            maps: None,
        }))
    }

    fn proxy_args(&self) -> Vec<String> {
        let (cgroup, pins) = Ebpf::binary_paths();
        vec![
            format!("--proxy-mode={}", self.mode().as_str()),
            "--bpf-cgroup-root".into(),
            cgroup.display().to_string(),
            "--bpf-pin-dir".into(),
            pins.display().to_string(),
        ]
    }

    fn binary_scratch(&self) -> anyhow::Result<Option<Box<dyn std::any::Any>>> {
        Ok(Some(Box::new(Scratch::create(BINARY_SCRATCH)?)))
    }

    fn proxy_setup(&self) -> Vec<Vec<String>> {
        Vec::new()
    }
}
