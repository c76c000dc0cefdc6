//! Comparing what the maps hold with what they should: the updates between the two ([`diff`],
//! [`diff_into`]) and the UDP frontend and backend pairs taken apart ([`stale_udp`]).
//!
//! What they should hold is a [`Wanted`]: a [`Contents`] (a plan listed, or maps read back), or
//! the [`Planner`] itself, which lists nothing. A first full sync compares the maps with the
//! planner and hands the updates on as they come ([`diff_into`]): at 10,000 Services × 10 a
//! listed plan and the list of its updates each hold hundreds of thousands of entries, which
//! the process would hold beside the planner at its peak.

use std::collections::HashSet;
use std::convert::Infallible;
use std::net::SocketAddr;

use crate::{
    AddrKey, AddrVerdict, Backend, Contents, MaglevTable, Op, Planner, RangeKey, RevNat,
    ServiceKey, ServiceValue, StaleUdp,
};

/// What the maps should hold, entry by entry.
pub trait Wanted {
    /// Backends map entries.
    fn backends(&self) -> impl Iterator<Item = (u32, Backend)> + '_;
    /// The backend of id `id`, if it should be there.
    fn backend(&self, id: u32) -> Option<Backend>;
    /// Reverse-NAT map entries.
    fn rev_nats(&self) -> impl Iterator<Item = (u16, RevNat)> + '_;
    /// Services map entries.
    fn services(&self) -> impl Iterator<Item = (ServiceKey, ServiceValue)> + '_;
    /// The services map value at `key`, if there should be one.
    fn service(&self, key: &ServiceKey) -> Option<ServiceValue>;
    /// Address map entries.
    fn addrs(&self) -> impl Iterator<Item = (AddrKey, AddrVerdict)> + '_;
    /// The address map value at `key`, if there should be one.
    fn addr(&self, key: &AddrKey) -> Option<AddrVerdict>;
    /// Source-range map entries.
    fn ranges(&self) -> impl Iterator<Item = RangeKey> + '_;
    /// The frontends (by reverse-NAT id) that should have a Maglev table.
    fn maglev_ids(&self) -> impl Iterator<Item = u16> + '_;
    /// Maglev map entries (a planner computes each table as it is asked for).
    fn maglev(&self) -> impl Iterator<Item = (u16, MaglevTable)> + '_;
}

impl Wanted for Contents {
    fn backends(&self) -> impl Iterator<Item = (u32, Backend)> + '_ {
        self.backends.iter().map(|(k, v)| (*k, *v))
    }

    fn backend(&self, id: u32) -> Option<Backend> {
        self.backends.get(&id).copied()
    }

    fn rev_nats(&self) -> impl Iterator<Item = (u16, RevNat)> + '_ {
        self.rev_nat.iter().map(|(k, v)| (*k, *v))
    }

    fn services(&self) -> impl Iterator<Item = (ServiceKey, ServiceValue)> + '_ {
        self.services.iter().map(|(k, v)| (*k, *v))
    }

    fn service(&self, key: &ServiceKey) -> Option<ServiceValue> {
        self.services.get(key).copied()
    }

    fn addrs(&self) -> impl Iterator<Item = (AddrKey, AddrVerdict)> + '_ {
        self.addrs.iter().map(|(k, v)| (*k, *v))
    }

    fn addr(&self, key: &AddrKey) -> Option<AddrVerdict> {
        self.addrs.get(key).copied()
    }

    fn ranges(&self) -> impl Iterator<Item = RangeKey> + '_ {
        self.ranges.iter().copied()
    }

    fn maglev_ids(&self) -> impl Iterator<Item = u16> + '_ {
        self.maglev.keys().copied()
    }

    fn maglev(&self) -> impl Iterator<Item = (u16, MaglevTable)> + '_ {
        self.maglev.iter().map(|(k, v)| (*k, v.clone()))
    }
}

/// The planner's record, read in place: what [`Planner::contents`] would list.
impl Wanted for Planner {
    fn backends(&self) -> impl Iterator<Item = (u32, Backend)> + '_ {
        self.backends.iter().map(|(k, v)| (*k, *v))
    }

    fn backend(&self, id: u32) -> Option<Backend> {
        self.backends.get(&id).copied()
    }

    fn rev_nats(&self) -> impl Iterator<Item = (u16, RevNat)> + '_ {
        self.frontends.iter().map(|(addr, p)| {
            (
                p.rev_nat,
                RevNat {
                    ip: addr.ip,
                    port: addr.port,
                },
            )
        })
    }

    fn services(&self) -> impl Iterator<Item = (ServiceKey, ServiceValue)> + '_ {
        self.frontends.iter().flat_map(|(addr, p)| {
            let head = (
                ServiceKey {
                    frontend: *addr,
                    slot: 0,
                },
                p.head(),
            );
            let slots = p.slots.iter().enumerate().map(move |(i, id)| {
                (
                    ServiceKey {
                        frontend: *addr,
                        slot: u16::try_from(i + 1).unwrap_or(u16::MAX),
                    },
                    ServiceValue::slot(*id, p.rev_nat),
                )
            });
            std::iter::once(head).chain(slots)
        })
    }

    fn service(&self, key: &ServiceKey) -> Option<ServiceValue> {
        let p = self.frontends.get(&key.frontend)?;
        match usize::from(key.slot) {
            0 => Some(p.head()),
            n => p
                .slots
                .get(n - 1)
                .map(|id| ServiceValue::slot(*id, p.rev_nat)),
        }
    }

    fn addrs(&self) -> impl Iterator<Item = (AddrKey, AddrVerdict)> + '_ {
        // A Service CIDR that is also a ClusterIP's host key is the ClusterIP's.
        let cidrs = self
            .cidrs
            .iter()
            .filter(|k| self.addr_verdict(k) == Some(AddrVerdict::Drop))
            .map(|k| (*k, AddrVerdict::Drop));
        let hosts = self
            .ip_refs
            .keys()
            .map(|ip| (AddrKey::host(*ip), AddrVerdict::Reject));
        cidrs.chain(hosts)
    }

    fn addr(&self, key: &AddrKey) -> Option<AddrVerdict> {
        self.addr_verdict(key)
    }

    fn ranges(&self) -> impl Iterator<Item = RangeKey> + '_ {
        self.frontends.values().flat_map(|p| {
            p.ranges.iter().map(move |r| RangeKey {
                rev_nat: p.rev_nat,
                prefix: *r,
            })
        })
    }

    fn maglev_ids(&self) -> impl Iterator<Item = u16> + '_ {
        // The flag is set only on a frontend whose table could be computed: no table is
        // computed to answer this.
        self.frontends
            .values()
            .filter(|p| p.maglev())
            .map(|p| p.rev_nat)
    }

    fn maglev(&self) -> impl Iterator<Item = (u16, MaglevTable)> + '_ {
        self.frontends
            .values()
            .filter(|p| p.maglev())
            .filter_map(|p| Some((p.rev_nat, self.maglev_table(&p.slots)?)))
    }
}

/// The updates that turn maps holding `have` into `want`, element by element, in the same
/// safe order [`Planner::set_service`] uses: for a full sync, for repairing what the periodic
/// read-back found, and for adopting maps a previous run pinned.
pub fn diff(have: &Contents, want: &impl Wanted) -> Vec<Op> {
    let mut ops = Vec::new();
    let Ok(()) = diff_into(have, want, |op| {
        ops.push(op);
        Ok::<(), Infallible>(())
    });
    ops
}

/// [`diff`], each update handed to `sink` as it is found (in the order [`diff`] lists them),
/// until `sink` fails.
pub fn diff_into<E>(
    have: &Contents,
    want: &impl Wanted,
    mut sink: impl FnMut(Op) -> Result<(), E>,
) -> Result<(), E> {
    for (id, b) in want.backends() {
        if have.backends.get(&id) != Some(&b) {
            sink(Op::UpsertBackend(id, b))?;
        }
    }
    for (id, r) in want.rev_nats() {
        if have.rev_nat.get(&id) != Some(&r) {
            sink(Op::UpsertRevNat(id, r))?;
        }
    }
    for k in want.ranges() {
        if !have.ranges.contains(&k) {
            sink(Op::UpsertRange(k))?;
        }
    }
    // Slots before the heads that make them reachable, the tables between them.
    for (k, v) in want.services().filter(|(k, _)| k.slot != 0) {
        if have.services.get(&k) != Some(&v) {
            sink(Op::UpsertService(k, v))?;
        }
    }
    for (id, t) in want.maglev() {
        if have.maglev.get(&id) != Some(&t) {
            sink(Op::UpsertMaglev(id, t))?;
        }
    }
    for (k, v) in want.services().filter(|(k, _)| k.slot == 0) {
        if have.services.get(&k) != Some(&v) {
            sink(Op::UpsertService(k, v))?;
        }
    }
    for (k, v) in want.addrs() {
        if have.addrs.get(&k) != Some(&v) {
            sink(Op::UpsertAddr(k, v))?;
        }
    }
    for k in have.addrs.keys() {
        if want.addr(k).is_none() {
            sink(Op::DeleteAddr(*k))?;
        }
    }
    // A frontend's head goes before its slots.
    for slots in [false, true] {
        for k in have.services.keys().filter(|k| (k.slot != 0) == slots) {
            if want.service(k).is_none() {
                sink(Op::DeleteService(*k))?;
            }
        }
    }
    // The sets below are built only where the maps hold entries to check (a first full sync
    // starts from empty maps).
    if !have.maglev.is_empty() {
        let tables: HashSet<u16> = want.maglev_ids().collect();
        for id in have.maglev.keys() {
            if !tables.contains(id) {
                sink(Op::DeleteMaglev(*id))?;
            }
        }
    }
    if !have.ranges.is_empty() {
        let ranges: HashSet<RangeKey> = want.ranges().collect();
        for k in &have.ranges {
            if !ranges.contains(k) {
                sink(Op::DeleteRange(*k))?;
            }
        }
    }
    if !have.rev_nat.is_empty() {
        let ids: HashSet<u16> = want.rev_nats().map(|(id, _)| id).collect();
        for id in have.rev_nat.keys() {
            if !ids.contains(id) {
                sink(Op::DeleteRevNat(*id))?;
            }
        }
    }
    for id in have.backends.keys() {
        if want.backend(*id).is_none() {
            sink(Op::DeleteBackend(*id))?;
        }
    }
    Ok(())
}

/// The UDP frontends (of the socket hooks) and backends paired in `have` and not in `want`:
/// what a full sync takes apart ([`Planner::take_stale_udp`] for a partial one). Every
/// frontend's, sorted.
pub fn stale_udp(have: &Contents, want: &impl Wanted) -> Vec<StaleUdp> {
    let held = udp_pairs(have.services(), |id| have.backend(id));
    if held.is_empty() {
        return Vec::new();
    }
    let wanted = udp_pairs(want.services(), |id| want.backend(id));
    let mut out: Vec<StaleUdp> = held.into_iter().filter(|p| !wanted.contains(p)).collect();
    out.sort();
    out
}

/// Every UDP frontend and backend pair of the socket hooks' entries among `services`.
fn udp_pairs(
    services: impl Iterator<Item = (ServiceKey, ServiceValue)>,
    backend: impl Fn(u32) -> Option<Backend>,
) -> HashSet<StaleUdp> {
    services
        .filter(|(k, _)| k.slot != 0 && k.frontend.is_socket_udp())
        .filter_map(|(k, v)| {
            let b = backend(v.backend_id)?;
            Some(StaleUdp {
                frontend: k.frontend.socket_addr(),
                backend: SocketAddr::new(b.ip, b.port),
            })
        })
        .collect()
}
