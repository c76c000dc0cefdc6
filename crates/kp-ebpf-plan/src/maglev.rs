//! Maglev consistent hashing for the `sh` and `mh` schedulers: a frontend's lookup table of
//! [`MAGLEV_M`] entries, each naming one of its backends, filled as the Maglev paper's
//! population step does (Eisenbud et al., "Maglev: A Fast and Reliable Software Network Load
//! Balancer", NSDI 2016, section 3.4):
//!
//! - each backend has a preference list, a permutation of the entries: from two hashes of its
//!   name (address and port, never an id or slot), `offset = h1 % M` and
//!   `skip = h2 % (M - 1) + 1`, its j-th preference is `(offset + j * skip) % M` (a
//!   permutation as M is prime);
//! - the backends take turns, each claiming its next preferred entry not yet claimed, until
//!   every entry is.
//!
//! Turns go in the order of the backends' names, so the table depends only on the set of
//! backends; each backend ends with `floor(M/N)` or `ceil(M/N)` entries, and removing one
//! backend moves its own entries and few others (each remaining backend keeps most of its
//! preferences).
//!
//! The programs pick entry `hash % M` for a client's hash ([`crate::layout::client_hash`]).

use crate::layout::{addr_bytes, Backend, MAGLEV_M};

/// Which backend a new connection is given.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Scheduler {
    /// A random backend slot (`rr` and the schedulers that need connection counts or weights,
    /// which the programs do not keep).
    #[default]
    Random,
    /// The client's hash in the frontend's Maglev table ([`table`]): `sh` and `mh`.
    Maglev,
}

impl Scheduler {
    /// The pick for an IPVS scheduler name (`ipvs.scheduler`, `--ipvs-scheduler`): `sh` and
    /// `mh` hash the client (Maglev); blank and `rr` are random, and so are `wrr`, `lc`, `wlc`,
    /// `lblc`, `lblcr`, `sed` and `nq` (their counts and weights are not kept: every endpoint
    /// weighs the same) and `dh` (it hashes the destination, the frontend itself, which would
    /// send every client to one endpoint). `None` for a name upstream does not know.
    pub fn from_ipvs(name: &str) -> Option<Scheduler> {
        match name {
            "sh" | "mh" => Some(Scheduler::Maglev),
            "" | "rr" | "wrr" | "lc" | "wlc" | "lblc" | "lblcr" | "dh" | "sed" | "nq" => {
                Some(Scheduler::Random)
            }
            _ => None,
        }
    }
}

/// The first hash's seed, mixed into FNV-1a's offset basis.
const SEED_OFFSET: u64 = 0;
/// The second hash's.
const SEED_SKIP: u64 = 0x9e37_79b9_7f4a_7c15;

/// FNV-1a (64 bits) over `bytes` from a seeded basis, then MurmurHash3's 64-bit finalizer
/// so that names differing in one byte differ everywhere.
fn hash64(bytes: &[u8], seed: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// A backend's stable name: its address (16 bytes, IPv4-mapped) and port (network order).
fn name(b: &Backend) -> [u8; 18] {
    let mut n = [0u8; 18];
    n[..16].copy_from_slice(&addr_bytes(b.ip));
    n[16..].copy_from_slice(&b.port.to_be_bytes());
    n
}

/// The lookup table over `backends` (distinct): for each of the [`MAGLEV_M`] entries, the
/// index in `backends` of the backend it names. Empty without backends, and with more backends
/// than entries (not every one could be named: the frontend is then picked at random).
pub fn table(backends: &[Backend]) -> Vec<usize> {
    let n = backends.len();
    if n == 0 || n > MAGLEV_M {
        return Vec::new();
    }
    let m = MAGLEV_M as u64;
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| backends[i]);
    // Per backend in turn order: the next entry of its permutation to try, and its skip. Both
    // below M (they fit usize: M is small).
    let mut next = Vec::with_capacity(n);
    let mut skip = Vec::with_capacity(n);
    for &i in &order {
        let name = name(&backends[i]);
        next.push((hash64(&name, SEED_OFFSET) % m) as usize);
        skip.push((hash64(&name, SEED_SKIP) % (m - 1) + 1) as usize);
    }
    // `(c + skip) % M` for c, skip < M, without a division: the fill tries about M ln M
    // entries.
    let step = |c: usize, skip: usize| {
        let c = c + skip;
        if c >= MAGLEV_M {
            c - MAGLEV_M
        } else {
            c
        }
    };
    let mut entries = vec![usize::MAX; MAGLEV_M];
    let mut filled = 0;
    loop {
        for (turn, &i) in order.iter().enumerate() {
            // Entries left unclaimed exist (filled < M), so the permutation reaches one.
            let mut c = next[turn];
            while entries[c] != usize::MAX {
                c = step(c, skip[turn]);
            }
            entries[c] = i;
            next[turn] = step(c, skip[turn]);
            filled += 1;
            if filled == MAGLEV_M {
                return entries;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::collections::BTreeMap;
    use std::net::IpAddr;

    use kp_core::model::Protocol;

    fn backends(n: usize) -> Vec<Backend> {
        (0..n)
            .map(|i| Backend {
                ip: IpAddr::from([10, 244, (i / 200) as u8, (i % 200) as u8 + 10]),
                port: 8080,
                protocol: Protocol::Tcp,
            })
            .collect()
    }

    /// The table as backends, entry by entry.
    fn named(b: &[Backend]) -> Vec<Backend> {
        table(b).into_iter().map(|i| b[i]).collect()
    }

    #[test]
    fn every_entry_names_one_of_the_backends_and_each_backend_has_its_share() {
        for n in 1..=10 {
            let b = backends(n);
            let t = table(&b);
            assert_eq!(t.len(), MAGLEV_M);
            let mut shares = BTreeMap::new();
            for i in &t {
                assert!(*i < n, "entry names backend {i} of {n}");
                *shares.entry(*i).or_insert(0usize) += 1;
            }
            assert_eq!(shares.len(), n, "{n} backends: {shares:?}");
            let fair = MAGLEV_M as f64 / n as f64;
            for (i, share) in &shares {
                let off = (*share as f64 - fair).abs() / fair;
                assert!(
                    off <= 0.15,
                    "{n} backends: backend {i} has {share}, fair {fair:.1}"
                );
            }
        }
    }

    #[test]
    fn removing_one_backend_moves_its_entries_and_few_others() {
        for n in 2..=10 {
            let all = backends(n);
            let before = named(&all);
            for gone in 0..n {
                let mut rest = all.clone();
                let removed = rest.remove(gone);
                let after = named(&rest);
                let changed = before.iter().zip(&after).filter(|(a, b)| a != b).count();
                let own = before.iter().filter(|b| **b == removed).count();
                // Every entry of the removed backend changes; the others mostly stay.
                assert!(after.iter().all(|b| *b != removed));
                assert!(changed >= own);
                let bound = 2 * MAGLEV_M / n;
                assert!(
                    changed < bound,
                    "{n} backends, removing {removed:?}: {changed} entries changed ({own} its \
                     own), bound {bound}"
                );
            }
        }
    }

    #[test]
    fn the_table_depends_only_on_the_set_of_backends() {
        let b = backends(7);
        let want = named(&b);
        let mut reversed = b.clone();
        reversed.reverse();
        assert_eq!(named(&reversed), want);
        let mut rotated = b.clone();
        rotated.rotate_left(3);
        assert_eq!(named(&rotated), want);
        // Another port is another backend: another table.
        let other: Vec<Backend> = b.iter().map(|x| Backend { port: 8081, ..*x }).collect();
        let moved = named(&other)
            .iter()
            .zip(&want)
            .filter(|(o, w)| o.ip != w.ip)
            .count();
        assert!(moved > MAGLEV_M / 2, "{moved}");
    }

    #[test]
    fn no_table_without_backends_or_beyond_its_size() {
        assert!(table(&[]).is_empty());
        assert!(table(&backends(MAGLEV_M + 1)).is_empty());
        let full = table(&backends(MAGLEV_M));
        let mut seen = full.clone();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), MAGLEV_M, "each backend one entry");
    }

    #[test]
    fn the_schedulers_by_ipvs_name() {
        for name in ["sh", "mh"] {
            assert_eq!(
                Scheduler::from_ipvs(name),
                Some(Scheduler::Maglev),
                "{name}"
            );
        }
        for name in [
            "", "rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sed", "nq",
        ] {
            assert_eq!(
                Scheduler::from_ipvs(name),
                Some(Scheduler::Random),
                "{name}"
            );
        }
        assert_eq!(Scheduler::from_ipvs("round robin"), None);
        assert_eq!(Scheduler::from_ipvs("SH"), None);
    }
}
