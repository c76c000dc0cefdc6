//! IPVS's schedulers, every real server weighing 1, as `ipvs.scheduler` names them.
//!
//! Mirrors the kernel's `net/netfilter/ipvs/ip_vs_{rr,lc,sh,dh,sed,nq}.c`: each scheduler looks
//! at the endpoints in the route's order and picks one; ties go to the first in that order, as
//! the kernel's list walks do. Only active connections are counted (the kernel's `lc` adds
//! inactive ones at 1/256 of the weight; a relay has no inactive state).

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

/// IPVS scheduler names, as `ipvs.scheduler` / `--ipvs-scheduler` (shared with ipvs mode).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Scheduler {
    /// `rr`: each endpoint in turn (the default, as upstream's userspace proxy).
    #[default]
    RoundRobin,
    /// `lc`: the endpoint with the fewest active connections.
    LeastConnection,
    /// `sh`: a hash of the client's address, so one client keeps its endpoint.
    SourceHashing,
    /// `dh`: a hash of the destination (the frontend address).
    DestinationHashing,
    /// `sed`: the smallest expected delay, (active + 1) / weight.
    ShortestExpectedDelay,
    /// `nq`: an idle endpoint if there is one, else as `sed`.
    NeverQueue,
}

impl Scheduler {
    /// Every scheduler, in the order the names list them.
    pub const ALL: [Scheduler; 6] = [
        Scheduler::RoundRobin,
        Scheduler::LeastConnection,
        Scheduler::SourceHashing,
        Scheduler::DestinationHashing,
        Scheduler::ShortestExpectedDelay,
        Scheduler::NeverQueue,
    ];

    /// The IPVS name (`rr`, `lc`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Scheduler::RoundRobin => "rr",
            Scheduler::LeastConnection => "lc",
            Scheduler::SourceHashing => "sh",
            Scheduler::DestinationHashing => "dh",
            Scheduler::ShortestExpectedDelay => "sed",
            Scheduler::NeverQueue => "nq",
        }
    }
}

impl fmt::Display for Scheduler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Scheduler {
    type Err = String;

    /// Parses an IPVS name; the empty string is `rr`, as upstream's default.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() {
            return Ok(Scheduler::RoundRobin);
        }
        Scheduler::ALL
            .into_iter()
            .find(|sch| sch.as_str() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Scheduler::ALL.iter().map(|s| s.as_str()).collect();
                format!(
                    "unknown scheduler {s:?}: the userspace mode supports {}",
                    names.join(", ")
                )
            })
    }
}

/// What a scheduler may look at for one pick.
pub(crate) struct Candidates<'a> {
    /// Active connections of each endpoint, in route order.
    pub active: &'a [u32],
    /// Whether each endpoint is healthy (not quarantined).
    pub healthy: &'a [bool],
    /// The client's address (`sh`).
    pub client: IpAddr,
    /// The frontend address the client connected to (`dh`).
    pub destination: IpAddr,
}

impl Scheduler {
    /// The index of the chosen endpoint among healthy ones (every one when none is healthy);
    /// `rr` is the route's round-robin position, advanced past the choice. `None` only for no
    /// endpoints.
    pub(crate) fn choose(self, c: &Candidates<'_>, rr: &mut usize) -> Option<usize> {
        let n = c.active.len();
        if n == 0 {
            return None;
        }
        let any_healthy = c.healthy.iter().any(|h| *h);
        let usable = |i: usize| !any_healthy || c.healthy[i];
        // The first usable endpoint at or after `start`, in route order (wrapping): where the
        // kernel's hashing schedulers go when the hashed server is unavailable.
        let from = |start: usize| (0..n).map(|k| (start + k) % n).find(|i| usable(*i));
        let least = |cost: &dyn Fn(u32) -> u64| {
            (0..n)
                .filter(|i| usable(*i))
                .min_by_key(|i| (cost(c.active[*i]), *i))
        };
        match self {
            Scheduler::RoundRobin => {
                let i = from(*rr % n)?;
                *rr = (i + 1) % n;
                Some(i)
            }
            Scheduler::LeastConnection => least(&|a| u64::from(a)),
            Scheduler::ShortestExpectedDelay => least(&|a| u64::from(a) + 1),
            Scheduler::NeverQueue => (0..n)
                .find(|i| usable(*i) && c.active[*i] == 0)
                .or_else(|| least(&|a| u64::from(a) + 1)),
            Scheduler::SourceHashing => from(bucket(c.client) % n),
            Scheduler::DestinationHashing => from(bucket(c.destination) % n),
        }
    }
}

/// The kernel's hashing schedulers map an address to one of 256 buckets, filled with the real
/// servers in turn; bucket `b` holds server `b mod n`. The hash is FNV-1a over the address
/// bytes (stable across runs and platforms).
fn bucket(ip: IpAddr) -> usize {
    let bytes: Vec<u8> = match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    };
    let mut h: u32 = 0x811c_9dc5;
    for b in bytes {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    (h & 0xff) as usize
}
