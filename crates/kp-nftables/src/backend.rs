//! What the dataplane needs from the kernel, behind one trait, so that tests can put a fake
//! (`kp-nftables-test`'s `FakeNftables`) where the real tools are: upstream's `knftables.Interface`
//! and its `knftables.Fake` play the same roles.
//!
//! [`NftCommand`] is the real backend: `nft -f -` for scripts, a kept `NETLINK_NETFILTER`
//! socket for element batches and the affinity maps, a socket of its own for each table read.

use std::collections::BTreeMap;

use kp_core::model::IpFamily;
use kp_nftables_plan::element::Tuple;
use kp_nftables_plan::{EncodedBatch, KernelTable, SetSchema};

use crate::{netlink, DigestTable, Error, NftCommand};

/// A read of the tables taken off the sync's path: the ruleset generation before the read,
/// then each family's table (or why it could not be read), in the order asked.
pub type ReadAhead = TablesRead<KernelTable>;

/// A read of the tables for the periodic drift check, off the sync's path: the ruleset
/// generation before the read, then each family's table with its elements as digests
/// ([`netlink::read_table_digests`]), in the order asked.
pub type DigestRead = TablesRead<DigestTable>;

/// A read of the tables off the sync's path, each family's table as `T`: the ruleset
/// generation before the read, then each family's table (or why it could not be read).
pub type TablesRead<T> = Box<dyn FnOnce() -> Result<(u32, Vec<Result<T, Error>>), Error> + Send>;

/// A netlink reader of one family's table as `T`, with the schema of the sets to read.
type TableReader<T> =
    fn(IpFamily, Option<&str>, &dyn Fn(&str) -> Option<SetSchema>) -> Result<T, Error>;

/// The kernel as the dataplane talks to it. Every call is one exchange: a script or a batch is
/// one atomic transaction, applied in full or not at all.
pub trait NftablesBackend: Send {
    /// `nft -f -` with `script` on stdin: one atomic transaction. Errors:
    /// [`Error::Transaction`] when it is refused (nothing of it applied), [`Error::Spawn`] when
    /// nft cannot run.
    fn run(&mut self, script: &str) -> Result<(), Error>;

    /// `nft -j ARGS…`, its output: used only when element changes do not go over netlink
    /// ([`NftablesBackend::netlink_elements`] is false), or when a netlink read fails.
    fn list_json(&mut self, args: &[&str]) -> Result<String, Error>;

    /// Whether element changes go as netlink batches ([`NftablesBackend::send_batch`]) and the
    /// table is read back over netlink; when false, everything is nft text.
    fn netlink_elements(&self) -> bool;

    /// Sends one element batch and waits for the kernel's verdict: all of it is committed or
    /// none. Errors: [`Error::Netlink`] with the kernel's errno.
    fn send_batch(&mut self, batch: &EncodedBatch) -> Result<(), Error>;

    /// Reads the `kube-proxy` table of `family` ([`netlink::read_table`]): chains with their rule
    /// ids, every set with the elements of those `schema` describes, the table's comment. A
    /// missing table is an [`Error::Netlink`] with `ENOENT`.
    fn read_table(
        &mut self,
        family: IpFamily,
        schema: &dyn Fn(&str) -> Option<SetSchema>,
    ) -> Result<KernelTable, Error>;

    /// Reads one set's elements ([`netlink::read_set`]); `None` if the table or the set does
    /// not exist.
    fn read_set(
        &mut self,
        family: IpFamily,
        name: &str,
        schema: &SetSchema,
    ) -> Result<Option<BTreeMap<Tuple, Option<Tuple>>>, Error>;

    /// The ruleset generation ([`netlink::generation`]): the same number at two moments means
    /// nothing was committed in between.
    fn generation(&mut self) -> Result<u32, Error>;

    /// A read of `families`' tables for another thread, or `None` when this backend does not
    /// read ahead (the first sync then reads the tables itself).
    fn read_ahead(&self, families: Vec<IpFamily>) -> Option<ReadAhead> {
        let _ = families;
        None
    }

    /// A read of `families`' tables as digests for the drift check, to run on another thread or
    /// in line; `None` when this backend cannot read them so (the check then reads the tables
    /// in full, in line, with [`NftablesBackend::read_table`]).
    fn read_digests(&self, families: Vec<IpFamily>) -> Option<DigestRead> {
        let _ = families;
        None
    }
}

impl NftablesBackend for NftCommand {
    fn run(&mut self, script: &str) -> Result<(), Error> {
        NftCommand::run(self, script)
    }

    fn list_json(&mut self, args: &[&str]) -> Result<String, Error> {
        self.json(args)
    }

    fn netlink_elements(&self) -> bool {
        NftCommand::netlink_elements(self)
    }

    fn send_batch(&mut self, batch: &EncodedBatch) -> Result<(), Error> {
        self.with_session(|s| s.send_batch(batch))
    }

    fn read_table(
        &mut self,
        family: IpFamily,
        schema: &dyn Fn(&str) -> Option<SetSchema>,
    ) -> Result<KernelTable, Error> {
        netlink::read_table(family, self.netns(), schema)
    }

    fn read_set(
        &mut self,
        family: IpFamily,
        name: &str,
        schema: &SetSchema,
    ) -> Result<Option<BTreeMap<Tuple, Option<Tuple>>>, Error> {
        self.with_session(|s| s.read_set(family, name, schema))
    }

    fn generation(&mut self) -> Result<u32, Error> {
        self.with_session(|s| s.generation())
    }

    fn read_ahead(&self, families: Vec<IpFamily>) -> Option<ReadAhead> {
        self.netlink_elements()
            .then(|| tables_read(self.netns(), families, netlink::read_table))
    }

    fn read_digests(&self, families: Vec<IpFamily>) -> Option<DigestRead> {
        self.netlink_elements()
            .then(|| tables_read(self.netns(), families, netlink::read_table_digests))
    }
}

/// A netlink read of our table in each of `families` with `read` (as tuples or as digests,
/// every set the adoptable schema names), after the ruleset generation, to run off the sync's
/// path.
fn tables_read<T: 'static>(
    netns: Option<&str>,
    families: Vec<IpFamily>,
    read: TableReader<T>,
) -> TablesRead<T> {
    let netns = netns.map(str::to_string);
    Box::new(move || {
        let generation = netlink::generation(netns.as_deref())?;
        let tables = families
            .into_iter()
            .map(|f| read(f, netns.as_deref(), &crate::adoptable_schema))
            .collect();
        Ok((generation, tables))
    })
}

/// A boxed backend is the one inside it (the dataplane keeps its backend boxed).
impl<B: NftablesBackend + ?Sized> NftablesBackend for Box<B> {
    fn run(&mut self, script: &str) -> Result<(), Error> {
        (**self).run(script)
    }

    fn list_json(&mut self, args: &[&str]) -> Result<String, Error> {
        (**self).list_json(args)
    }

    fn netlink_elements(&self) -> bool {
        (**self).netlink_elements()
    }

    fn send_batch(&mut self, batch: &EncodedBatch) -> Result<(), Error> {
        (**self).send_batch(batch)
    }

    fn read_table(
        &mut self,
        family: IpFamily,
        schema: &dyn Fn(&str) -> Option<SetSchema>,
    ) -> Result<KernelTable, Error> {
        (**self).read_table(family, schema)
    }

    fn read_set(
        &mut self,
        family: IpFamily,
        name: &str,
        schema: &SetSchema,
    ) -> Result<Option<BTreeMap<Tuple, Option<Tuple>>>, Error> {
        (**self).read_set(family, name, schema)
    }

    fn generation(&mut self) -> Result<u32, Error> {
        (**self).generation()
    }

    fn read_ahead(&self, families: Vec<IpFamily>) -> Option<ReadAhead> {
        (**self).read_ahead(families)
    }

    fn read_digests(&self, families: Vec<IpFamily>) -> Option<DigestRead> {
        (**self).read_digests(families)
    }
}
