//! [`FakeNftables`]: the kernel's nf_tables in memory, behind the same
//! [`NftablesBackend`] the dataplane drives the real one through, so the dataplane's syncs,
//! failures, read-back, adoption and affinity purge are tested without root (as upstream's
//! `knftables.Fake`).
//!
//! The tables are an [`NftTracer`]'s, so what the dataplane sends is checked as the tracer
//! checks it, and a test can trace the packet-flow table through whatever the syncs left. What
//! the kernel does that the fake keeps:
//!
//! - `nft -f -` scripts go through [`NftTracer::apply`] on a copy that replaces the tables only
//!   if the whole script applies: a transaction is atomic.
//! - Element batches arrive as the bytes the real kernel gets. They are decoded with
//!   [`kp_nftables::netlink::decode_batch`] (kp-netlink's framing, the nf_tables ABI, the
//!   read-back's element decoder) and applied message by message, again all or nothing. An
//!   element added again with the same value changes nothing, with another value is refused
//!   (`EBUSY`); a deleted element or a set that is missing is refused (`ENOENT`), as the kernel
//!   refuses them. Taking the bytes, not typed changes, means the fake also checks the encoder.
//! - The read-back (a table, one set, the ruleset generation) is answered from the tables, a
//!   missing table with `ENOENT`. Every committed script or batch moves the generation.
//! - `nft -j` listings are not answered: the fake says it speaks netlink only.
//!
//! [`FakeNftables::fail_next_transaction`] makes the next script or batch fail without applying
//! it; [`FakeNftables::apply_behind`] and [`FakeNftables::insert_element`] change the tables
//! behind the dataplane's back (an operator's `nft`, the packet path filling an affinity map).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use kp_core::model::IpFamily;
use kp_netlink::KernelError;
use kp_nftables::netlink::{decode_batch, ElementChanges, SetSchema};
use kp_nftables::{Error, KernelTable, NftablesBackend};
use kp_nftables_plan::element::Tuple;
use kp_nftables_plan::names::{self, TABLE};
use kp_nftables_plan::EncodedBatch;

use crate::tracer::{ElementError, NftTracer, TraceError};

/// `ENOENT`, `EBUSY`, `EINVAL` (asm-generic/errno-base.h).
const ENOENT: i32 = 2;
const EBUSY: i32 = 16;
const EINVAL: i32 = 22;

/// The kernel's nf_tables in memory. Clones share the tables, so a test keeps one and hands
/// another to the dataplane.
#[derive(Clone)]
pub struct FakeNftables {
    state: Arc<Mutex<State>>,
}

/// Everything the fake holds.
struct State {
    /// The `ip` and `ip6` `kube-proxy` tables.
    tables: NftTracer,
    /// The ruleset generation: moved by every committed transaction.
    generation: u32,
    /// Whether the next script or batch fails.
    fail_next: bool,
    /// Scripts run, failed ones included.
    scripts: usize,
    /// Batches sent, failed ones included.
    batches: usize,
    /// The last batch committed, decoded.
    last_batch: Vec<ElementChanges>,
}

impl Default for FakeNftables {
    fn default() -> Self {
        FakeNftables::new(Vec::new())
    }
}

impl FakeNftables {
    /// The kernel of a node whose own addresses are `local` (what a trace takes for local
    /// destinations; loopback always is). No table exists yet.
    pub fn new(local: Vec<IpAddr>) -> Self {
        FakeNftables {
            state: Arc::new(Mutex::new(State {
                tables: NftTracer::new(local),
                generation: 1,
                fail_next: false,
                scripts: 0,
                batches: 0,
                last_batch: Vec::new(),
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A test that panicked while holding the lock left consistent tables: every change
        // replaces them whole.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A tracer over the tables as they are now, for the packet-flow table.
    pub fn tracer(&self) -> NftTracer {
        self.lock().tables.clone()
    }

    /// The next transaction (script or batch, whichever comes first) fails and applies nothing.
    pub fn fail_next_transaction(&self) {
        self.lock().fail_next = true;
    }

    /// `nft -f -` scripts run so far, failed ones included.
    pub fn scripts(&self) -> usize {
        self.lock().scripts
    }

    /// Element batches sent so far, failed ones included.
    pub fn batches(&self) -> usize {
        self.lock().batches
    }

    /// The element changes of the last batch committed, message by message.
    pub fn last_batch(&self) -> Vec<ElementChanges> {
        self.lock().last_batch.clone()
    }

    /// The ruleset generation.
    pub fn generation(&self) -> u32 {
        self.lock().generation
    }

    /// A set's elements, spelled as the read-back spells them; `None` if it does not exist.
    pub fn elements(&self, family: IpFamily, set: &str) -> Option<BTreeMap<Tuple, Option<Tuple>>> {
        self.lock().tables.elements(family, set)
    }

    /// Runs `script` as someone else's `nft -f -` would, behind the dataplane's back: atomic,
    /// not counted among the dataplane's scripts, and never told to fail.
    pub fn apply_behind(&self, script: &str) -> Result<(), TraceError> {
        let mut state = self.lock();
        let mut tables = state.tables.clone();
        tables.apply(script)?;
        state.tables = tables;
        state.generation += 1;
        Ok(())
    }

    /// Adds one element behind the dataplane's back, as the packet path adds a ClientIP
    /// affinity choice to `affinity-T` (`update @affinity-T { … }`).
    pub fn insert_element(
        &self,
        family: IpFamily,
        set: &str,
        key: &Tuple,
        value: Option<&Tuple>,
    ) -> Result<(), ElementError> {
        let mut state = self.lock();
        state.tables.insert_element(family, set, key, value)?;
        state.generation += 1;
        Ok(())
    }
}

/// A refusal as the kernel reports it over netlink.
fn refused(op: String, errno: i32, detail: String) -> Error {
    let error = KernelError::new(errno);
    Error::Netlink {
        op,
        detail: format!("netlink error -{} ({detail})", error.errno_label()),
        errno: Some(error),
    }
}

/// Applies one decoded batch to `tables`, in order; the first refusal stops it.
fn apply_batch(tables: &mut NftTracer, changes: &[ElementChanges]) -> Result<(), Error> {
    for (i, m) in changes.iter().enumerate() {
        for (key, value) in &m.elements {
            let r = if m.delete {
                tables.remove_element(m.family, &m.set, key)
            } else {
                tables.insert_element(m.family, &m.set, key, value.as_ref())
            };
            if let Err(e) = r {
                let errno = match e {
                    ElementError::NoSet | ElementError::Missing => ENOENT,
                    ElementError::Clash => EBUSY,
                    ElementError::Shape => EINVAL,
                };
                return Err(refused(
                    format!("netlink element batch ({} messages)", changes.len()),
                    errno,
                    format!(
                        "message {} of {}, set {} {}, element {key}: {e}; nothing was applied",
                        i + 1,
                        changes.len(),
                        names::family(m.family),
                        m.set
                    ),
                ));
            }
        }
    }
    Ok(())
}

impl NftablesBackend for FakeNftables {
    fn run(&mut self, script: &str) -> Result<(), Error> {
        let mut state = self.lock();
        state.scripts += 1;
        if std::mem::take(&mut state.fail_next) {
            return Err(Error::Transaction {
                status: Some(1),
                stderr: "the fake was told to fail this transaction".into(),
                failing_statement: None,
            });
        }
        let mut tables = state.tables.clone();
        if let Err(e) = tables.apply(script) {
            let line = match &e {
                TraceError::Unsupported { line, .. } | TraceError::Invalid { line, .. } => *line,
            };
            return Err(Error::Transaction {
                status: Some(1),
                stderr: e.to_string(),
                failing_statement: script
                    .lines()
                    .nth(line.saturating_sub(1))
                    .map(str::to_string),
            });
        }
        state.tables = tables;
        state.generation += 1;
        Ok(())
    }

    fn list_json(&mut self, args: &[&str]) -> Result<String, Error> {
        Err(Error::List {
            args: args.join(" "),
            stderr: "FakeNftables answers over netlink only".into(),
        })
    }

    fn netlink_elements(&self) -> bool {
        true
    }

    fn send_batch(&mut self, batch: &EncodedBatch) -> Result<(), Error> {
        let mut state = self.lock();
        state.batches += 1;
        if std::mem::take(&mut state.fail_next) {
            return Err(Error::Netlink {
                op: format!("netlink element batch ({} messages)", batch.messages),
                detail: "the fake was told to fail this transaction".into(),
                errno: None,
            });
        }
        let changes = decode_batch(&batch.bytes)?;
        let mut tables = state.tables.clone();
        apply_batch(&mut tables, &changes)?;
        state.tables = tables;
        state.generation += 1;
        state.last_batch = changes;
        Ok(())
    }

    fn read_table(
        &mut self,
        family: IpFamily,
        schema: &dyn Fn(&str) -> Option<SetSchema>,
    ) -> Result<KernelTable, Error> {
        let state = self.lock();
        let t = &state.tables;
        if !t.has_table(family) {
            return Err(refused(
                format!("netlink list table {} {TABLE}", names::family(family)),
                ENOENT,
                "table missing".into(),
            ));
        }
        let sets = t
            .set_names(family)
            .into_iter()
            .map(|name| {
                let elements = match schema(&name) {
                    Some(_) => t.elements(family, &name).unwrap_or_default(),
                    None => BTreeMap::new(),
                };
                (name, elements)
            })
            .collect();
        Ok(KernelTable {
            chains: t.rule_ids(family),
            sets,
            comment: t.comment(family).map(str::to_string),
        })
    }

    fn read_set(
        &mut self,
        family: IpFamily,
        name: &str,
        _schema: &SetSchema,
    ) -> Result<Option<BTreeMap<Tuple, Option<Tuple>>>, Error> {
        Ok(self.lock().tables.elements(family, name))
    }

    fn generation(&mut self) -> Result<u32, Error> {
        Ok(self.lock().generation)
    }
}
