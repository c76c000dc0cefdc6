//! The eBPF dataplane's I/O half: the BPF programs (C under `bpf/`, compiled with clang by
//! `build.rs`), loading them with aya, attaching them to a cgroup v2 directory, and writing
//! the map updates `kp-ebpf-plan` computes.
//!
//! - [`SocketLb::load`] loads the socket load balancer (`bpf/sock.c`: cgroup
//!   `connect4/6`, `sendmsg4/6`, `recvmsg4/6`, `getpeername4/6`), its maps optionally pinned
//!   under a bpffs directory so a restart finds them;
//! - [`cgroup::find_cgroup2_root`] finds where the cgroup v2 hierarchy is mounted;
//! - [`SocketLb::attach`] attaches every program to one cgroup v2 directory (the proxy: the
//!   hierarchy's root; tests: a cgroup of their own); dropping the [`SocketLb`] detaches them;
//! - [`SocketLb::apply`] writes [`kp_ebpf_plan::Op`]s, [`SocketLb::read_back`] reads the maps
//!   into the planner's [`kp_ebpf_plan::Contents`] to compare.
//!
//! [`dataplane::EbpfDataplane`] puts these together as the mode's `Dataplane`, with
//! [`nat_hooks::NatHooks`]: an empty nftables table that keeps netfilter's NAT hooks, so the
//! connections another mode translated before a switch go on being translated.
//!
//! - [`SocketLb::attach_tc`] attaches the tc path for traffic from outside the node
//!   (`bpf/tc.c`) to interfaces of the calling thread's network namespace;
//! - [`MapSizes`] sizes the maps (from the configuration); a pinned map of another size is made
//!   afresh ([`SocketLb::resized`]), an insert into a full map is [`Error::Full`].
//!
//! - [`SocketLb::destroy_stale_udp`] destroys the connected UDP sockets the hooks sent to a
//!   backend a frontend no longer has ([`stale_udp`]: a socket iterator, Linux 6.5).
//!
//! No unsafe code: aya makes the `bpf()` calls.

pub mod cgroup;
pub mod dataplane;
pub mod local;
pub mod nat_hooks;
pub mod stale_udp;

use std::borrow::Borrow;
use std::fs::File;
use std::path::{Path, PathBuf};

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{HashMap, Map, MapData};
use aya::programs::cgroup_sock_addr::CgroupSockAddrLinkId;
use aya::programs::links::FdLink;
use aya::programs::tc::SchedClassifierLinkId;
use aya::programs::{CgroupAttachMode, CgroupSockAddr, SchedClassifier, TcAttachType};
use aya::util::KernelVersion;
use aya::{Ebpf, EbpfLoader};
use kp_ebpf_plan::layout::{
    ADDR_DATA_SIZE, BACKEND_SIZE, CT_KEY_SIZE, CT_VALUE_SIZE, MAGLEV_VALUE_SIZE, RANGE_DATA_SIZE,
    REV_NAT_SIZE, SERVICE_KEY_SIZE, SERVICE_VALUE_SIZE,
};
use kp_ebpf_plan::{
    AddrKey, AddrVerdict, Backend, Contents, MaglevTable, Op, RangeKey, RevNat, ServiceKey,
    ServiceValue,
};

/// How the programs pick a backend (`ipvs.scheduler`): the planner's, for the registry.
pub use kp_ebpf_plan::Scheduler;

/// The socket load balancer's object file, built by `build.rs`.
pub static SOCK_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/sock.o"));

/// The same built without `bpf_set_retval`, for kernels before 5.18: what it refuses fails
/// with `EPERM` instead of `ECONNREFUSED` or `ETIMEDOUT`.
pub static SOCK_OBJECT_COMPAT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/sock_compat.o"));

/// The tc programs (`bpf/tc.c`, in the same object): the one for interfaces outside traffic
/// arrives on, and the one that only gives replies their frontend back.
pub const TC_OUTSIDE: &str = "kp_tc_outside";
/// See [`TC_OUTSIDE`].
pub const TC_REPLY: &str = "kp_tc_reply";

/// The socket load balancer's programs, by function name in `bpf/sock.c`.
pub const SOCK_PROGRAMS: [&str; 8] = [
    "kp_connect4",
    "kp_connect6",
    "kp_sendmsg4",
    "kp_sendmsg6",
    "kp_recvmsg4",
    "kp_recvmsg6",
    "kp_getpeername4",
    "kp_getpeername6",
];

/// The maps the planner fills, by name in `bpf/maps.h`.
pub mod names {
    /// `{frontend, slot}` → count or backend id.
    pub const SERVICES: &str = "kp_services";
    /// Backend id → address, port, protocol.
    pub const BACKENDS: &str = "kp_backends";
    /// Frontend id → address and port.
    pub const REV_NAT: &str = "kp_rev_nat";
    /// `{socket cookie, backend}` → frontend: what recvmsg and getpeername give back (LRU).
    pub const SK_REV: &str = "kp_sk_rev";
    /// Prefix → reject (a ClusterIP's other ports) or drop (a Service CIDR) (LPM trie).
    pub const ADDRS: &str = "kp_addrs";
    /// `{client netns, frontend}` → the backend it sticks to (LRU), written by the socket
    /// hooks.
    pub const AFFINITY: &str = "kp_affinity";
    /// `{client address, frontend}` → the backend it sticks to (LRU), written by the tc path for
    /// clients outside the node. Sized as [`AFFINITY`] (`MapSizes::affinity`).
    pub const AFFINITY_OUTSIDE: &str = "kp_affinity_out";
    /// `{frontend id, source prefix}`: the sources a LoadBalancer frontend admits from outside
    /// (LPM trie).
    pub const SRC_RANGES: &str = "kp_src_ranges";
    /// The tc path's connection table (LRU), written by the programs.
    pub const CT: &str = "kp_ct";
    /// Frontend id → its Maglev lookup table (`sh`/`mh`; allocated as filled). Sized as
    /// [`REV_NAT`] (`MapSizes::rev_nat`): one per frontend at most.
    pub const MAGLEV: &str = "kp_maglev";
    /// Every map, for pinning.
    pub const ALL: [&str; 10] = [
        SERVICES,
        BACKENDS,
        REV_NAT,
        SK_REV,
        ADDRS,
        AFFINITY,
        AFFINITY_OUTSIDE,
        SRC_RANGES,
        CT,
        MAGLEV,
    ];

    /// The pin name of the link that attaches `program` (one of [`super::SOCK_PROGRAMS`]).
    pub fn link(program: &str) -> String {
        format!("{program}_link")
    }

    /// The prefix of a tc link's pin name; the interface's name follows.
    pub const TC_LINK_PREFIX: &str = "kp_tc_link_";

    /// The pin name of the tc link on interface `dev`.
    pub fn tc_link(dev: &str) -> String {
        format!("{TC_LINK_PREFIX}{dev}")
    }
}

/// What failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// aya could not load the object or create its maps (the verifier's log is in the
    /// detail). Not retryable: the programs or the kernel must change.
    #[error("loading the BPF object: {0}")]
    Load(#[from] aya::EbpfError),
    /// A program was refused by the verifier or could not be attached. Not retryable.
    #[error("program {name}: {source}")]
    Program {
        /// The program.
        name: &'static str,
        /// aya's error.
        source: aya::programs::ProgramError,
    },
    /// A program or map the object should contain is missing. Not retryable: a build error.
    #[error("the BPF object has no {0}")]
    Missing(&'static str),
    /// A map could not be opened, read or written. Retryable (a full map may drain).
    #[error("map {name}: {source}")]
    Map {
        /// The map.
        name: &'static str,
        /// aya's error.
        source: aya::maps::MapError,
    },
    /// A map is full: an update needed one more entry than its configured size. Retryable (a
    /// sync that removes entries makes room), but it takes a larger size in the configuration
    /// to hold the Services.
    #[error(
        "map {name} is full ({max_entries} entries): the Services need more; raise its size in \
         the configuration (ebpf.*MapMax, --bpf-*-map-max)"
    )]
    Full {
        /// The map.
        name: &'static str,
        /// Its size.
        max_entries: u32,
    },
    /// A map held bytes this version never writes. Retryable: a full sync rewrites them.
    #[error("map {0} holds an entry this version cannot read")]
    Unreadable(&'static str),
    /// A program's link could not be pinned. Not retryable.
    #[error("pinning the link of {name}: {detail}")]
    Pin {
        /// The program.
        name: &'static str,
        /// What failed.
        detail: String,
    },
    /// The pin directory could not be made. Not retryable (bpffs is not mounted there, or no
    /// permission).
    #[error("pin directory {path}: {source}")]
    PinDir {
        /// The directory.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// Stale UDP sockets could not be destroyed: the kernel cannot (before 6.5), or a
    /// namespace could not be entered or read.
    #[error("destroying stale UDP sockets: {0}")]
    StaleUdp(String),
    /// The cgroup directory could not be opened. Not retryable.
    #[error("cgroup {path}: {source}")]
    Cgroup {
        /// The directory.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// Removes the program links pinned under `dir` (which detaches the programs: the socket
/// hooks' and the tc links, `kp_tc_link_*`) and the maps (every name in [`names::ALL`]), then `dir` itself if that leaves it empty and it is no
/// mount point. What is not there is no error; nothing else
/// in `dir` is touched.
pub fn remove_pins(dir: &Path) -> std::io::Result<()> {
    let mut links: Vec<String> = SOCK_PROGRAMS.map(names::link).into();
    match std::fs::read_dir(dir) {
        Ok(entries) => {
            for entry in entries {
                let name = entry?.file_name().to_string_lossy().into_owned();
                if name.starts_with(names::TC_LINK_PREFIX) {
                    links.push(name);
                }
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    }
    // Links first: unpinning the last reference detaches the program.
    for name in links.iter().map(String::as_str).chain(names::ALL) {
        match std::fs::remove_file(dir.join(name)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    match std::fs::remove_dir(dir) {
        Ok(()) => Ok(()),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound
                    | std::io::ErrorKind::DirectoryNotEmpty
                    | std::io::ErrorKind::ResourceBusy
            ) =>
        {
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// What [`hand_over`] left under the pin directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandOver {
    /// Nothing of the mode's.
    Gone,
    /// The tc programs and the maps they read, for connections they made from outside the node
    /// that were used within the idle time.
    Carrying {
        /// Connection-table entries used within the idle time (two per connection: its
        /// client's tuple and its backend's reply tuple).
        entries: usize,
        /// How long ago the most recently used one was.
        last_used: std::time::Duration,
    },
}

/// Hands the node over from a stopped ebpf mode (its pins under `dir`) to another mode, which
/// calls this after its own first sync and again, while [`HandOver::Carrying`], until
/// [`HandOver::Gone`]. The socket hooks are detached at once (connections they made went
/// straight to their backends and need nothing more), and the frontends and addresses the tc
/// programs look new connections up in are emptied, so every new connection meets the other
/// mode's rules. The tc programs stay attached while a connection they made from outside has
/// been used within `idle` (they translate its packets from their connection table, frontend or
/// not, as conntrack carries an established flow); after that, or with no tc link pinned (no
/// tcx before Linux 6.6), everything goes as [`remove_pins`] removes it. A directory that is
/// not there is [`HandOver::Gone`].
pub fn hand_over(dir: &Path, idle: std::time::Duration) -> Result<HandOver, Error> {
    let pin_err = |source| Error::PinDir {
        path: dir.to_path_buf(),
        source,
    };
    let has_tc = match std::fs::read_dir(dir) {
        Ok(entries) => entries.filter_map(Result::ok).any(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(names::TC_LINK_PREFIX)
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HandOver::Gone),
        Err(e) => return Err(pin_err(e)),
    };
    if !has_tc || idle.is_zero() {
        remove_pins(dir).map_err(pin_err)?;
        return Ok(HandOver::Gone);
    }
    for name in SOCK_PROGRAMS.map(names::link) {
        match std::fs::remove_file(dir.join(&name)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(pin_err(e)),
            _ => {}
        }
    }
    let open = |name| open_pinned(dir, name);
    let err = |name: &'static str| move |source| Error::Map { name, source };
    // The socket hooks are still attached for a while after their pins go (the kernel frees
    // a link after an RCU grace period and a work item): the maps are emptied in the order
    // that never refuses a call they meet meanwhile (`hand_over_deletions`). Emptied in the
    // hash map's order, a head outlived its slots once and refused a new connection (stop 34's
    // CI, ebpf -> userspace). Every key is read before any goes: a hash map's iteration
    // restarts when the key it stands on goes.
    let mut addrs: LpmTrie<MapData, [u8; ADDR_DATA_SIZE], u8> =
        typed(names::ADDRS, open(names::ADDRS)?)?;
    let mut services: HashMap<MapData, [u8; SERVICE_KEY_SIZE], [u8; SERVICE_VALUE_SIZE]> =
        typed(names::SERVICES, open(names::SERVICES)?)?;
    let addr_keys: Vec<Key<[u8; ADDR_DATA_SIZE]>> = addrs
        .keys()
        .collect::<Result<_, _>>()
        .map_err(err(names::ADDRS))?;
    let service_keys: Vec<[u8; SERVICE_KEY_SIZE]> = services
        .keys()
        .collect::<Result<_, _>>()
        .map_err(err(names::SERVICES))?;
    // A key this build cannot read (it writes none) goes last, as it is.
    let (mut readable_addrs, mut odd_addrs) = (Vec::new(), Vec::new());
    for k in addr_keys {
        match AddrKey::from_trie(k.prefix_len(), k.data()) {
            Some(a) => readable_addrs.push(a),
            None => odd_addrs.push(k),
        }
    }
    let (mut readable_services, mut odd_services) = (Vec::new(), Vec::new());
    for k in service_keys {
        match ServiceKey::from_bytes(&k) {
            Some(s) => readable_services.push(s),
            None => odd_services.push(k),
        }
    }
    let ops = kp_ebpf_plan::hand_over_deletions(readable_addrs, readable_services);
    for op in &ops {
        match op {
            Op::DeleteAddr(k) => addrs
                .remove(&Key::new(k.trie_len(), k.data()))
                .map_err(err(names::ADDRS))?,
            Op::DeleteService(k) => services
                .remove(&k.to_bytes())
                .map_err(err(names::SERVICES))?,
            _ => {}
        }
    }
    remove_all(names::ADDRS, &odd_addrs, |k| addrs.remove(k))?;
    remove_all(names::SERVICES, &odd_services, |k| services.remove(k))?;
    let ct: HashMap<MapData, [u8; CT_KEY_SIZE], [u8; CT_VALUE_SIZE]> =
        typed(names::CT, open(names::CT)?)?;
    let (mut entries, mut last_used) = (0, None::<std::time::Duration>);
    for entry in ct.iter() {
        let (_, v) = entry.map_err(err(names::CT))?;
        // The clock is read after the entry: the walk of a large table takes a while, and a
        // connection the programs carry stamps its entries all along (a clock read once before
        // the walk found a live connection's stamps a unit ahead, took them for 20 hours old,
        // and removed the programs under it).
        let age = kp_ebpf_plan::layout::ct_idle(&v, monotonic_ns().map_err(pin_err)?);
        if age < idle {
            entries += 1;
            last_used = Some(last_used.map_or(age, |l| l.min(age)));
        }
    }
    match last_used {
        Some(last_used) => Ok(HandOver::Carrying { entries, last_used }),
        None => {
            remove_pins(dir).map_err(pin_err)?;
            Ok(HandOver::Gone)
        }
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds: the clock the programs read (`bpf_ktime_get_ns`), which
/// stamps the connection table's entries (`kp_ebpf_plan::layout::ct_clock`).
pub fn monotonic_ns() -> std::io::Result<u64> {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)?;
    // Non-negative: the monotonic clock counts from boot.
    Ok(u64::try_from(now.tv_sec()).unwrap_or(0) * 1_000_000_000
        + u64::try_from(now.tv_nsec()).unwrap_or(0))
}

/// Removes `keys` (map `name`'s, as read) with `remove`.
fn remove_all<K>(
    name: &'static str,
    keys: &[K],
    mut remove: impl FnMut(&K) -> Result<(), aya::maps::MapError>,
) -> Result<(), Error> {
    for k in keys {
        remove(k).map_err(|source| Error::Map { name, source })?;
    }
    Ok(())
}

/// Sizes of the maps, from the configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapSizes {
    /// Services map entries: one per frontend plus one per backend slot.
    pub services: u32,
    /// Backends map entries.
    pub backends: u32,
    /// Reverse-NAT entries: one per frontend. The Maglev map (a table per frontend under
    /// `sh`/`mh`, allocated as filled) has as many.
    pub rev_nat: u32,
    /// Socket reverse entries (LRU): one per live load-balanced socket and backend.
    pub sockets: u32,
    /// Address entries: one per ClusterIP and Service CIDR.
    pub addrs: u32,
    /// Affinity entries (LRU), of each of the two affinity maps: one per client network
    /// namespace and sticky frontend (the socket hooks'), one per client address and sticky
    /// frontend reached from outside the node (the tc path's).
    pub affinity: u32,
    /// Source-range entries: one per LoadBalancer frontend and source range.
    pub src_ranges: u32,
    /// Connection-table entries (LRU): two per connection from outside the node.
    pub connections: u32,
}

impl MapSizes {
    /// The size of map `name` (one of [`names::ALL`]).
    pub fn of(&self, name: &str) -> Option<u32> {
        Some(match name {
            names::SERVICES => self.services,
            names::BACKENDS => self.backends,
            names::REV_NAT | names::MAGLEV => self.rev_nat,
            names::SK_REV => self.sockets,
            names::ADDRS => self.addrs,
            names::AFFINITY | names::AFFINITY_OUTSIDE => self.affinity,
            names::SRC_RANGES => self.src_ranges,
            names::CT => self.connections,
            _ => return None,
        })
    }
}

impl MapSizes {
    /// The sizes of the maps pinned under `dir`, the default for those not pinned there: what a
    /// tool that attaches programs over a running proxy's maps (`kp-tc-attach`) loads with, so
    /// that it adopts them whatever sizes the proxy was configured with.
    pub fn from_pins(dir: &Path) -> Result<MapSizes, Error> {
        let mut sizes = MapSizes::default();
        for name in names::ALL {
            let path = dir.join(name);
            if !path.exists() {
                continue;
            }
            let info = aya::maps::MapInfo::from_pin(&path)
                .map_err(|source| Error::Map { name, source })?;
            let n = info.max_entries();
            match name {
                names::SERVICES => sizes.services = n,
                names::BACKENDS => sizes.backends = n,
                names::REV_NAT => sizes.rev_nat = n,
                names::SK_REV => sizes.sockets = n,
                names::ADDRS => sizes.addrs = n,
                // Both sized by one setting; the socket hooks' map (pinned by every version)
                // decides when they differ.
                names::AFFINITY => sizes.affinity = n,
                names::AFFINITY_OUTSIDE => {
                    if !dir.join(names::AFFINITY).exists() {
                        sizes.affinity = n;
                    }
                }
                names::SRC_RANGES => sizes.src_ranges = n,
                // Sized as the reverse-NAT map, which decides.
                names::MAGLEV => {
                    if !dir.join(names::REV_NAT).exists() {
                        sizes.rev_nat = n;
                    }
                }
                _ => sizes.connections = n,
            }
        }
        Ok(sizes)
    }
}

/// A pinned map whose size is not the configured one, unpinned by [`unpin_resized`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resized {
    /// The map.
    pub name: &'static str,
    /// Its pinned size.
    pub pinned: u32,
    /// The configured size.
    pub wanted: u32,
}

/// Unpins every map under `dir` whose size differs from `sizes`, so the next load creates it
/// afresh at the configured size instead of adopting it (the kernel cannot resize a map). The
/// programs still attached keep the old map until they are replaced; the new one is filled by
/// the next full sync. Returns what was unpinned, for the caller to log.
pub fn unpin_resized(dir: &Path, sizes: &MapSizes) -> Result<Vec<Resized>, Error> {
    let mut out = Vec::new();
    for name in names::ALL {
        let path = dir.join(name);
        if !path.exists() {
            continue;
        }
        let info =
            aya::maps::MapInfo::from_pin(&path).map_err(|source| Error::Map { name, source })?;
        let pinned = info.max_entries();
        let wanted = sizes.of(name).unwrap_or(pinned);
        if pinned != wanted {
            std::fs::remove_file(&path).map_err(|source| Error::PinDir {
                path: path.clone(),
                source,
            })?;
            out.push(Resized {
                name,
                pinned,
                wanted,
            });
        }
    }
    Ok(out)
}

impl Default for MapSizes {
    fn default() -> Self {
        MapSizes {
            services: 65536,
            backends: 65536,
            rev_nat: 65535,
            sockets: 262144,
            addrs: 65536,
            affinity: 65536,
            src_ranges: 16384,
            connections: 262144,
        }
    }
}

/// Pins `link`, program `name`'s, at `path` (on bpffs), replacing what a previous run pinned
/// there: unpinning the old link detaches it once the new one already runs beside it. What
/// [`SocketLb::pin_links`] and [`SocketLb::pin_tc_links`] do for each link.
fn replace_pin<L>(name: &'static str, link: L, path: &Path) -> Result<(), Error>
where
    L: TryInto<FdLink>,
    L::Error: std::fmt::Display,
{
    let pin_error = |detail: String| Error::Pin { name, detail };
    let fd = link.try_into().map_err(|e| pin_error(e.to_string()))?;
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(pin_error(e.to_string())),
    }
    fd.pin(path).map_err(|e| pin_error(e.to_string()))?;
    Ok(())
}

/// Whether the kernel has tcx links (Linux 6.6), which aya's tc attach then uses.
fn has_tcx() -> bool {
    KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0))
}

/// How the loaded programs refuse a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// `ECONNREFUSED` where upstream rejects, `ETIMEDOUT` where it drops (Linux 5.18+).
    Errno,
    /// `EPERM` for both (the compat object, on older kernels).
    Eperm,
}

/// The socket load balancer, loaded; attached once [`SocketLb::attach`] is called.
pub struct SocketLb {
    ebpf: Ebpf,
    refusal: Refusal,
    links: Vec<(&'static str, CgroupSockAddrLinkId)>,
    tc_devices: Vec<(&'static str, String)>,
    /// tc links not pinned yet.
    tc_links: Vec<(&'static str, String, SchedClassifierLinkId)>,
    /// Pinned maps the load unpinned and created afresh because their size changed.
    resized: Vec<Resized>,
    /// Whether the stale UDP socket iterator is loaded; if not, why.
    stale_udp: Result<(), String>,
}

type ByteMap<'a, const K: usize, const V: usize> = HashMap<&'a mut MapData, [u8; K], [u8; V]>;

impl SocketLb {
    /// Loads the object and every program into the kernel (the verifier runs here). With
    /// `pin_dir`, each map is pinned there under its name, or the pinned one is reused. A
    /// kernel whose verifier refuses the programs (before 5.18: no `bpf_set_retval`) gets the
    /// compat object, which refuses with `EPERM`.
    pub fn load(sizes: MapSizes, pin_dir: Option<&Path>) -> Result<SocketLb, Error> {
        // Before either object: the first one's load pins the new maps even when the verifier
        // then refuses its programs.
        let resized = match pin_dir {
            Some(dir) => unpin_resized(dir, &sizes)?,
            None => Vec::new(),
        };
        let mut lb = match SocketLb::load_as(Refusal::Errno, sizes, pin_dir) {
            Err(first @ Error::Program { .. }) => {
                SocketLb::load_as(Refusal::Eperm, sizes, pin_dir).map_err(|_| first)
            }
            other => other,
        }?;
        lb.resized.extend(resized);
        Ok(lb)
    }

    /// [`SocketLb::load`] of one object: the one that refuses as `refusal` says.
    pub fn load_as(
        refusal: Refusal,
        sizes: MapSizes,
        pin_dir: Option<&Path>,
    ) -> Result<SocketLb, Error> {
        let object = match refusal {
            Refusal::Errno => SOCK_OBJECT,
            Refusal::Eperm => SOCK_OBJECT_COMPAT,
        };
        let resized = match pin_dir {
            Some(dir) => unpin_resized(dir, &sizes)?,
            None => Vec::new(),
        };
        let (ebpf, stale_udp) = SocketLb::load_object(object, sizes, pin_dir)?;
        Ok(SocketLb {
            ebpf,
            refusal,
            links: Vec::new(),
            tc_devices: Vec::new(),
            tc_links: Vec::new(),
            resized,
            stale_udp,
        })
    }

    /// The pinned maps this load found at another size than the configured one: unpinned and
    /// created afresh (empty until the next full sync fills them), for the caller to log.
    pub fn resized(&self) -> &[Resized] {
        &self.resized
    }

    /// Loads `object` and its socket programs; the stale UDP iterator too where the kernel has
    /// what it needs (otherwise the second value says why).
    fn load_object(
        object: &[u8],
        sizes: MapSizes,
        pin_dir: Option<&Path>,
    ) -> Result<(Ebpf, Result<(), String>), Error> {
        let (object, btf) = stale_udp::prepare(object);
        let mut loader = EbpfLoader::new();
        loader
            .map_max_entries(names::SERVICES, sizes.services)
            .map_max_entries(names::BACKENDS, sizes.backends)
            .map_max_entries(names::REV_NAT, sizes.rev_nat)
            .map_max_entries(names::SK_REV, sizes.sockets)
            .map_max_entries(names::ADDRS, sizes.addrs)
            .map_max_entries(names::AFFINITY, sizes.affinity)
            .map_max_entries(names::AFFINITY_OUTSIDE, sizes.affinity)
            .map_max_entries(names::SRC_RANGES, sizes.src_ranges)
            .map_max_entries(names::CT, sizes.connections)
            .map_max_entries(names::MAGLEV, sizes.rev_nat);
        if let Some(dir) = pin_dir {
            for name in names::ALL {
                loader.map_pin_path(name, dir.join(name));
            }
        }
        let mut ebpf = loader.load(object.bytes())?;
        for name in SOCK_PROGRAMS {
            let prog: &mut CgroupSockAddr = ebpf
                .program_mut(name)
                .ok_or(Error::Missing(name))?
                .try_into()
                .map_err(|source| Error::Program { name, source })?;
            prog.load()
                .map_err(|source| Error::Program { name, source })?;
        }
        let stale_udp = btf.and_then(|btf| stale_udp::load_iterator(&mut ebpf, &btf));
        Ok((ebpf, stale_udp))
    }

    /// How the loaded programs refuse.
    pub fn refusal(&self) -> Refusal {
        self.refusal
    }

    /// Attaches every program to the cgroup v2 directory `cgroup`, alongside programs others
    /// attached there. They stay attached until this value is dropped, or, once
    /// [`SocketLb::pin_links`] pinned them, until their pins are removed.
    pub fn attach(&mut self, cgroup: &Path) -> Result<(), Error> {
        let dir = File::open(cgroup).map_err(|source| Error::Cgroup {
            path: cgroup.to_path_buf(),
            source,
        })?;
        for name in SOCK_PROGRAMS {
            let prog: &mut CgroupSockAddr = self
                .ebpf
                .program_mut(name)
                .ok_or(Error::Missing(name))?
                .try_into()
                .map_err(|source| Error::Program { name, source })?;
            // Through a BPF link (Linux 5.7+), which always runs beside other programs on the
            // cgroup and refuses any attach flag: the mode must be `Single` (no flag).
            let id = prog
                .attach(&dir, CgroupAttachMode::Single)
                .map_err(|source| Error::Program { name, source })?;
            self.links.push((name, id));
        }
        Ok(())
    }

    /// Pins the links [`SocketLb::attach`] made under `dir` (a bpffs directory), so that the
    /// programs stay attached after this value is dropped and the process exits: a restarted
    /// proxy leaves no gap without load balancing. A link a previous run pinned there is
    /// unpinned, which detaches it, once the new one runs beside it (both at once are
    /// harmless: the second sees a backend, no frontend). [`remove_pins`] detaches them.
    pub fn pin_links(&mut self, dir: &Path) -> Result<(), Error> {
        for (name, id) in std::mem::take(&mut self.links) {
            let prog: &mut CgroupSockAddr = self
                .ebpf
                .program_mut(name)
                .ok_or(Error::Missing(name))?
                .try_into()
                .map_err(|source| Error::Program { name, source })?;
            let link = prog
                .take_link(id)
                .map_err(|source| Error::Program { name, source })?;
            replace_pin(name, link, &dir.join(names::link(name)))?;
        }
        Ok(())
    }

    /// Pins the tc links [`SocketLb::attach_tc`] made since the last call under `dir`
    /// (`kp_tc_link_DEV`), as [`SocketLb::pin_links`] does for the socket hooks: they stay
    /// attached after this value is dropped, a pin of a previous run is replaced. tcx links only
    /// (Linux 6.6+); on older kernels the programs stay attached only while this value lives.
    pub fn pin_tc_links(&mut self, dir: &Path) -> Result<(), Error> {
        if !has_tcx() {
            return Ok(());
        }
        for (name, dev, id) in std::mem::take(&mut self.tc_links) {
            let prog: &mut SchedClassifier = self
                .ebpf
                .program_mut(name)
                .ok_or(Error::Missing(name))?
                .try_into()
                .map_err(|source| Error::Program { name, source })?;
            let link = prog
                .take_link(id)
                .map_err(|source| Error::Program { name, source })?;
            replace_pin(name, link, &dir.join(names::tc_link(&dev)))?;
        }
        Ok(())
    }

    fn map<const K: usize, const V: usize>(
        &mut self,
        name: &'static str,
    ) -> Result<ByteMap<'_, K, V>, Error> {
        let map = self.ebpf.map_mut(name).ok_or(Error::Missing(name))?;
        HashMap::try_from(map).map_err(|source| Error::Map { name, source })
    }

    /// Writes `ops` in order (the planner's order keeps every reachable slot valid after
    /// each one). Stops at the first error: the maps then hold a prefix of `ops`, and the
    /// caller resyncs in full. A map that is full is [`Error::Full`].
    pub fn apply(&mut self, ops: &[Op]) -> Result<(), Error> {
        for op in ops {
            if let Err(e) = self.apply_one(op) {
                return Err(self.full_or(e));
            }
        }
        Ok(())
    }

    /// `e`, or [`Error::Full`] when it is an insert the kernel refused for want of room
    /// (`E2BIG` from a hash map, `ENOSPC` from an LPM trie).
    fn full_or(&self, e: Error) -> Error {
        const E2BIG: i32 = 7;
        const ENOSPC: i32 = 28;
        if let Error::Map {
            name,
            source: aya::maps::MapError::SyscallError(ref sys),
        } = e
        {
            if matches!(sys.io_error.raw_os_error(), Some(E2BIG | ENOSPC)) {
                let max_entries = self
                    .ebpf
                    .map(name)
                    .and_then(|m| match m {
                        aya::maps::Map::HashMap(d) | aya::maps::Map::LpmTrie(d) => {
                            d.info().ok().map(|i| i.max_entries())
                        }
                        _ => None,
                    })
                    .unwrap_or(0);
                return Error::Full { name, max_entries };
            }
        }
        e
    }

    fn apply_one(&mut self, op: &Op) -> Result<(), Error> {
        let err = |name: &'static str| move |source| Error::Map { name, source };
        match op {
            Op::UpsertBackend(id, b) => self
                .map::<4, BACKEND_SIZE>(names::BACKENDS)?
                .insert(id.to_ne_bytes(), b.to_bytes(), 0)
                .map_err(err(names::BACKENDS)),
            Op::DeleteBackend(id) => self
                .map::<4, BACKEND_SIZE>(names::BACKENDS)?
                .remove(&id.to_ne_bytes())
                .map_err(err(names::BACKENDS)),
            Op::UpsertRevNat(id, r) => self
                .map::<2, REV_NAT_SIZE>(names::REV_NAT)?
                .insert(id.to_ne_bytes(), r.to_bytes(), 0)
                .map_err(err(names::REV_NAT)),
            Op::DeleteRevNat(id) => self
                .map::<2, REV_NAT_SIZE>(names::REV_NAT)?
                .remove(&id.to_ne_bytes())
                .map_err(err(names::REV_NAT)),
            Op::UpsertService(k, v) => self
                .map::<SERVICE_KEY_SIZE, SERVICE_VALUE_SIZE>(names::SERVICES)?
                .insert(k.to_bytes(), v.to_bytes(), 0)
                .map_err(err(names::SERVICES)),
            Op::DeleteService(k) => self
                .map::<SERVICE_KEY_SIZE, SERVICE_VALUE_SIZE>(names::SERVICES)?
                .remove(&k.to_bytes())
                .map_err(err(names::SERVICES)),
            Op::UpsertAddr(k, v) => self
                .addrs()?
                .insert(&Key::new(k.trie_len(), k.data()), v.to_byte(), 0)
                .map_err(err(names::ADDRS)),
            Op::DeleteAddr(k) => self
                .addrs()?
                .remove(&Key::new(k.trie_len(), k.data()))
                .map_err(err(names::ADDRS)),
            Op::UpsertRange(k) => self
                .ranges()?
                .insert(&Key::new(k.trie_len(), k.data()), 1, 0)
                .map_err(err(names::SRC_RANGES)),
            Op::DeleteRange(k) => self
                .ranges()?
                .remove(&Key::new(k.trie_len(), k.data()))
                .map_err(err(names::SRC_RANGES)),
            Op::UpsertMaglev(id, t) => self
                .map::<2, MAGLEV_VALUE_SIZE>(names::MAGLEV)?
                .insert(id.to_ne_bytes(), t.to_bytes(), 0)
                .map_err(err(names::MAGLEV)),
            Op::DeleteMaglev(id) => self
                .map::<2, MAGLEV_VALUE_SIZE>(names::MAGLEV)?
                .remove(&id.to_ne_bytes())
                .map_err(err(names::MAGLEV)),
        }
    }

    fn ranges(&mut self) -> Result<LpmTrie<&mut MapData, [u8; RANGE_DATA_SIZE], u8>, Error> {
        let map = self
            .ebpf
            .map_mut(names::SRC_RANGES)
            .ok_or(Error::Missing(names::SRC_RANGES))?;
        LpmTrie::try_from(map).map_err(|source| Error::Map {
            name: names::SRC_RANGES,
            source,
        })
    }

    /// Loads the tc programs (the verifier runs here) and attaches them with tcx (Linux 6.6+;
    /// a clsact qdisc before) at the ingress of the calling thread's network namespace's
    /// interfaces: [`TC_OUTSIDE`] on `outside` (where traffic from outside the node arrives),
    /// [`TC_REPLY`] on `replies` (where backends' replies arrive: pod veths, links to other
    /// nodes). An interface already attached is skipped, so a later call adds new ones. They
    /// stay attached until this value is dropped.
    pub fn attach_tc(&mut self, outside: &[String], replies: &[String]) -> Result<usize, Error> {
        let mut added = 0;
        for (name, devices) in [(TC_OUTSIDE, outside), (TC_REPLY, replies)] {
            let prog: &mut SchedClassifier = self
                .ebpf
                .program_mut(name)
                .ok_or(Error::Missing(name))?
                .try_into()
                .map_err(|source| Error::Program { name, source })?;
            if prog.fd().is_err() {
                prog.load()
                    .map_err(|source| Error::Program { name, source })?;
            }
            for dev in devices {
                if self.tc_devices.iter().any(|(_, d)| d == dev) {
                    continue;
                }
                if !has_tcx() {
                    // Before tcx: netlink attach needs the clsact qdisc (EEXIST is fine).
                    let _ = aya::programs::tc::qdisc_add_clsact(dev);
                }
                let id = prog
                    .attach(dev, TcAttachType::Ingress)
                    .map_err(|source| Error::Program { name, source })?;
                self.tc_devices.push((name, dev.clone()));
                self.tc_links.push((name, dev.clone(), id));
                added += 1;
            }
        }
        Ok(added)
    }

    /// The interfaces the tc programs are attached to, with the program.
    pub fn tc_devices(&self) -> &[(&'static str, String)] {
        &self.tc_devices
    }

    fn addrs(&mut self) -> Result<LpmTrie<&mut MapData, [u8; ADDR_DATA_SIZE], u8>, Error> {
        let map = self
            .ebpf
            .map_mut(names::ADDRS)
            .ok_or(Error::Missing(names::ADDRS))?;
        LpmTrie::try_from(map).map_err(|source| Error::Map {
            name: names::ADDRS,
            source,
        })
    }

    /// Reads the maps the planner fills back: services, backends, reverse NAT, source
    /// ranges, addresses and Maglev tables.
    pub fn read_back(&self) -> Result<Contents, Error> {
        let open = |name: &'static str| self.ebpf.map(name).ok_or(Error::Missing(name));
        read_contents(
            &typed(names::SERVICES, open(names::SERVICES)?)?,
            &typed(names::BACKENDS, open(names::BACKENDS)?)?,
            &typed(names::REV_NAT, open(names::REV_NAT)?)?,
            &typed(names::SRC_RANGES, open(names::SRC_RANGES)?)?,
            &typed(names::ADDRS, open(names::ADDRS)?)?,
            &typed(names::MAGLEV, open(names::MAGLEV)?)?,
        )
    }
}

/// Reads the planner's maps pinned under `dir` (a running or stopped proxy's `--bpf-pin-dir`)
/// into [`Contents`], as [`SocketLb::read_back`] reads a loaded object's: nothing is loaded or
/// attached, each map is opened by its pin. A map that is not pinned there is
/// [`Error::Map`] (`BPF_OBJ_GET` failing with `ENOENT`).
pub fn read_pinned(dir: &Path) -> Result<Contents, Error> {
    let open = |name| open_pinned(dir, name);
    read_contents(
        &typed(names::SERVICES, open(names::SERVICES)?)?,
        &typed(names::BACKENDS, open(names::BACKENDS)?)?,
        &typed(names::REV_NAT, open(names::REV_NAT)?)?,
        &typed(names::SRC_RANGES, open(names::SRC_RANGES)?)?,
        &typed(names::ADDRS, open(names::ADDRS)?)?,
        &typed(names::MAGLEV, open(names::MAGLEV)?)?,
    )
}

/// Map `name` pinned under `dir`, opened by its pin (nothing loaded or attached).
fn open_pinned(dir: &Path, name: &'static str) -> Result<Map, Error> {
    MapData::from_pin(dir.join(name))
        .and_then(Map::from_map_data)
        .map_err(|source| Error::Map { name, source })
}

/// Map `name`, opened (owned or borrowed), as the typed map it is.
fn typed<M, T>(name: &'static str, map: M) -> Result<T, Error>
where
    T: TryFrom<M, Error = aya::maps::MapError>,
{
    T::try_from(map).map_err(|source| Error::Map { name, source })
}

/// The six maps the planner fills, read into [`Contents`]: what [`SocketLb::read_back`] and
/// [`read_pinned`] share.
fn read_contents<T: Borrow<MapData>>(
    services: &HashMap<T, [u8; SERVICE_KEY_SIZE], [u8; SERVICE_VALUE_SIZE]>,
    backends: &HashMap<T, [u8; 4], [u8; BACKEND_SIZE]>,
    rev_nat: &HashMap<T, [u8; 2], [u8; REV_NAT_SIZE]>,
    ranges: &LpmTrie<T, [u8; RANGE_DATA_SIZE], u8>,
    addrs: &LpmTrie<T, [u8; ADDR_DATA_SIZE], u8>,
    maglev: &HashMap<T, [u8; 2], [u8; MAGLEV_VALUE_SIZE]>,
) -> Result<Contents, Error> {
    let mut c = Contents::default();
    let err = |name: &'static str| move |source| Error::Map { name, source };
    for entry in services.iter() {
        let (k, v) = entry.map_err(err(names::SERVICES))?;
        let k = ServiceKey::from_bytes(&k).ok_or(Error::Unreadable(names::SERVICES))?;
        let v = ServiceValue::from_bytes(&v).ok_or(Error::Unreadable(names::SERVICES))?;
        c.services.insert(k, v);
    }
    for entry in backends.iter() {
        let (k, v) = entry.map_err(err(names::BACKENDS))?;
        let v = Backend::from_bytes(&v).ok_or(Error::Unreadable(names::BACKENDS))?;
        c.backends.insert(u32::from_ne_bytes(k), v);
    }
    for entry in rev_nat.iter() {
        let (k, v) = entry.map_err(err(names::REV_NAT))?;
        let v = RevNat::from_bytes(&v).ok_or(Error::Unreadable(names::REV_NAT))?;
        c.rev_nat.insert(u16::from_ne_bytes(k), v);
    }
    for entry in ranges.iter() {
        let (k, _) = entry.map_err(err(names::SRC_RANGES))?;
        let k = RangeKey::from_trie(k.prefix_len(), k.data())
            .ok_or(Error::Unreadable(names::SRC_RANGES))?;
        c.ranges.insert(k);
    }
    for entry in addrs.iter() {
        let (k, v) = entry.map_err(err(names::ADDRS))?;
        let k =
            AddrKey::from_trie(k.prefix_len(), k.data()).ok_or(Error::Unreadable(names::ADDRS))?;
        let v = AddrVerdict::from_byte(v).ok_or(Error::Unreadable(names::ADDRS))?;
        c.addrs.insert(k, v);
    }
    for entry in maglev.iter() {
        let (k, v) = entry.map_err(err(names::MAGLEV))?;
        let v = MaglevTable::from_bytes(&v).ok_or(Error::Unreadable(names::MAGLEV))?;
        c.maglev.insert(u16::from_ne_bytes(k), v);
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    /// maps.h and layout.rs agree on the Maglev table's size (the loader would refuse a value
    /// of another size only when the map is first written).
    #[test]
    fn the_maglev_table_size_is_the_same_in_maps_h_and_layout_rs() {
        let header = include_str!("../bpf/maps.h");
        let m: Vec<usize> = header
            .lines()
            .filter_map(|l| l.strip_prefix("#define KP_MAGLEV_M "))
            .map(|v| v.trim().parse().expect("a number"))
            .collect();
        assert_eq!(m, vec![kp_ebpf_plan::layout::MAGLEV_M]);
        let m = m[0];
        assert!(
            m > 2
                && (2..m)
                    .take_while(|d| d * d <= m)
                    .all(|d| !m.is_multiple_of(d)),
            "{m}: not a prime"
        );
        assert!(header.contains("__u16 slots[KP_MAGLEV_M];"));
        assert_eq!(kp_ebpf_plan::layout::MAGLEV_VALUE_SIZE, 2 * m);
    }
}
