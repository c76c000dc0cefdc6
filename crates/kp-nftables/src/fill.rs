//! The first full sync on a node, sent as it is planned: each table's structure and rules, its
//! elements in batches of about [`CHUNK_BYTES`], then the jumps of its base chains.
//!
//! A table at 10k Services × 10 endpoints is 165k element operations, 10.5 MB of netlink (31 MB
//! at 30k). As one batch, that buffer is resident on top of everything the proxy holds, at the
//! moment the proxy peaks: the proxy state and the planner's record are all built by then. The
//! kernel applies each batch as one transaction, so the buffer cannot be streamed into one; it
//! can be cut into several transactions. That is safe here, where no table of ours exists yet,
//! if no packet meets the table before it is whole. [`FillSink`] sends, per table: the table,
//! its chains (the base chains, hooked with policy accept, still empty), its set declarations
//! and the rules of its regular chains in one `nft -f -` script (nft can add a rule that looks
//! a `typeof` map up only in the script that declares it), the elements in batches, and last
//! the rules of its base chains (plain jumps into the regular chains) in one script. Until that
//! last script, every base chain is empty and accepts, so no packet sees a half-filled set;
//! with it, every element is in place. (Before this, the rules went first, with every set empty
//! until the one batch.) A failure part-way leaves a table whose base chains are empty; the next
//! full sync finds it and adopts it, sending what is missing.
//!
//! This relies on the order [`Planner::full_into`] writes a table in: table, chains, set
//! declarations, rules, then elements; and on it handing the rules of base chains over as such
//! ([`TransactionSink::base_chain_rule`]).
//!
//! [`Planner::full_into`]: kp_nftables_plan::Planner::full_into

use kp_core::model::IpFamily;
use kp_nftables_plan::element::Atom;
use kp_nftables_plan::planner::{NftText, TransactionSink};
use kp_nftables_plan::{ElementBatch, SetId};

use crate::backend::NftablesBackend;
use crate::Error;

/// Bytes of element messages per batch: a batch is sent once it holds this much (one message
/// more at most, ~60 KiB). At 10k Services the full sync is about ten batches.
pub(crate) const CHUNK_BYTES: usize = 1 << 20;

/// What a fill sent.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Filled {
    /// The scripts sent with `nft -f -`, in order.
    pub(crate) scripts: Vec<String>,
    /// Element batches sent.
    pub(crate) batches: usize,
    /// Element operations in them.
    pub(crate) elements: usize,
}

/// A [`TransactionSink`] that sends as it goes (see the module's documentation). After the
/// planners wrote into it, [`FillSink::finish`] sends the rest and says what was sent, or the
/// first failure (after which nothing more was sent).
pub(crate) struct FillSink<'a> {
    nft: &'a mut dyn NftablesBackend,
    chunk: usize,
    /// Statements not yet sent that go before `batch`.
    before: NftText,
    /// Elements not yet sent.
    batch: ElementBatch,
    /// The rules of the current table's base chains: sent once its elements are.
    jumps: NftText,
    filled: Filled,
    failed: Option<Error>,
}

impl<'a> FillSink<'a> {
    /// A fill through `nft`, sending a batch once it holds `chunk` bytes.
    pub(crate) fn new(nft: &'a mut dyn NftablesBackend, chunk: usize) -> Self {
        FillSink {
            nft,
            chunk,
            before: NftText::new(),
            batch: ElementBatch::new(),
            jumps: NftText::new(),
            filled: Filled::default(),
            failed: None,
        }
    }

    /// Sends what is left, in order.
    pub(crate) fn finish(mut self) -> Result<Filled, Error> {
        self.flush(true);
        match self.failed {
            Some(e) => Err(e),
            None => Ok(self.filled),
        }
    }

    /// Sends the statements before the batch and the batch; at the end of a table (`whole`),
    /// then its base chains' rules.
    fn flush(&mut self, whole: bool) {
        if self.failed.is_some() {
            return;
        }
        if let Err(e) = self.send_pending(whole) {
            self.failed = Some(e);
        }
    }

    fn send_pending(&mut self, whole: bool) -> Result<(), Error> {
        let before = std::mem::take(&mut self.before);
        self.run(before)?;
        let batch = std::mem::take(&mut self.batch);
        if let Some(e) = batch.errors().first() {
            return Err(Error::Netlink {
                op: "encode element batch".into(),
                detail: format!(
                    "{e} ({} elements could not be encoded)",
                    batch.errors().len()
                ),
                errno: None,
            });
        }
        let elements = batch.elements();
        if let Some(encoded) = batch.finish() {
            self.nft.send_batch(&encoded)?;
            self.filled.batches += 1;
            self.filled.elements += elements;
        }
        if whole {
            let jumps = std::mem::take(&mut self.jumps);
            self.run(jumps)?;
        }
        Ok(())
    }

    fn run(&mut self, text: NftText) -> Result<(), Error> {
        let script = text.into_text();
        if script.is_empty() {
            return Ok(());
        }
        self.nft.run(&script)?;
        self.filled.scripts.push(script);
        Ok(())
    }

    /// Before an element: a full batch goes.
    fn element(&mut self) -> bool {
        if self.failed.is_some() {
            return false;
        }
        if self.batch.len_bytes() >= self.chunk {
            self.flush(false);
        }
        self.failed.is_none()
    }
}

impl FillSink<'_> {
    /// A statement after elements starts the next table: the previous one is complete.
    fn next_statement(&mut self) {
        if !self.batch.is_empty() {
            self.flush(true);
        }
    }
}

impl TransactionSink for FillSink<'_> {
    fn statement(&mut self, line: std::fmt::Arguments<'_>) {
        self.next_statement();
        self.before.statement(line);
    }

    fn base_chain_rule(&mut self, line: std::fmt::Arguments<'_>) {
        self.next_statement();
        self.jumps.statement(line);
    }

    fn add_element(&mut self, family: IpFamily, set: SetId, key: &[Atom], value: Option<&[Atom]>) {
        if self.element() {
            self.batch.add(family, set, key, value);
        }
    }

    fn delete_element(&mut self, family: IpFamily, set: SetId, key: &[Atom]) {
        if self.element() {
            self.batch.delete(family, set, key);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::net::{IpAddr, Ipv4Addr};

    use kp_nftables_plan::element::Tuple;
    use kp_nftables_plan::{EncodedBatch, KernelTable, SetSchema};

    use super::*;

    /// What a fill sent, in order.
    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Sent {
        Script(String),
        /// Bytes of the batch.
        Batch(usize),
    }

    /// A kernel that records what it is sent and refuses the `fail_at`th exchange.
    #[derive(Default)]
    struct Recorder {
        sent: Vec<Sent>,
        fail_at: Option<usize>,
    }

    impl Recorder {
        fn take(&mut self, sent: Sent) -> Result<(), Error> {
            if self.fail_at == Some(self.sent.len()) {
                return Err(refused("refused"));
            }
            self.sent.push(sent);
            Ok(())
        }
    }

    impl NftablesBackend for Recorder {
        fn run(&mut self, script: &str) -> Result<(), Error> {
            self.take(Sent::Script(script.to_string()))
        }
        fn list_json(&mut self, _: &[&str]) -> Result<String, Error> {
            Err(refused("not read in this test"))
        }
        fn netlink_elements(&self) -> bool {
            true
        }
        fn send_batch(&mut self, batch: &EncodedBatch) -> Result<(), Error> {
            self.take(Sent::Batch(batch.bytes.len()))
        }
        fn read_table(
            &mut self,
            _: IpFamily,
            _: &dyn Fn(&str) -> Option<SetSchema>,
        ) -> Result<KernelTable, Error> {
            Err(refused("not read in this test"))
        }
        fn read_set(
            &mut self,
            _: IpFamily,
            _: &str,
            _: &SetSchema,
        ) -> Result<Option<BTreeMap<Tuple, Option<Tuple>>>, Error> {
            Ok(None)
        }
        fn generation(&mut self) -> Result<u32, Error> {
            Ok(1)
        }
    }

    fn refused(why: &str) -> Error {
        Error::Transaction {
            status: Some(1),
            stderr: why.to_string(),
            failing_statement: None,
        }
    }

    fn address(n: u32) -> Atom {
        Atom::Ip(IpAddr::V4(Ipv4Addr::from(0x0a60_0000 + n)))
    }

    /// A table as the planner writes one: structure, rules (one in a base chain), elements.
    fn write_table(sink: &mut dyn TransactionSink, elements: u32) {
        sink.statement(format_args!("add table ip kube-proxy"));
        sink.statement(format_args!(
            "add chain ip kube-proxy nat-prerouting {{ type nat hook prerouting priority -100; policy accept; }}"
        ));
        sink.statement(format_args!("add chain ip kube-proxy services"));
        sink.statement(format_args!(
            "add set ip kube-proxy cluster-ips {{ type ipv4_addr; }}"
        ));
        sink.base_chain_rule(format_args!(
            "add rule ip kube-proxy nat-prerouting jump services"
        ));
        sink.statement(format_args!(
            "add rule ip kube-proxy services ip daddr @cluster-ips accept"
        ));
        for n in 0..elements {
            sink.add_element(IpFamily::V4, SetId::ClusterIps, &[address(n)], None);
        }
    }

    #[test]
    fn a_table_goes_as_structure_and_rules_then_batches_then_its_base_chains_jumps() {
        let mut nft = Recorder::default();
        let mut fill = FillSink::new(&mut nft, 4096);
        write_table(&mut fill, 3000);
        let filled = fill.finish().expect("fill");
        assert_eq!(filled.elements, 3000);
        assert!(filled.batches > 3, "{filled:?}");
        let sent = &nft.sent;
        assert_eq!(sent.len(), filled.batches + 2, "{sent:?}");
        match (&sent[0], &sent[sent.len() - 1]) {
            (Sent::Script(first), Sent::Script(last)) => {
                // The regular chain's rule goes with the declarations; the base chain's
                // jump comes last, alone.
                assert!(first.contains("add set") && first.contains("services ip daddr"));
                assert!(!first.contains("jump services"), "{first}");
                assert_eq!(
                    last.trim(),
                    "add rule ip kube-proxy nat-prerouting jump services"
                );
            }
            other => panic!("not structure first and jumps last: {other:?}"),
        }
        for s in &sent[1..sent.len() - 1] {
            match s {
                // A batch closes once it holds the chunk: one message more at most.
                Sent::Batch(bytes) => assert!(*bytes <= 4096 + 64 * 1024, "{bytes}"),
                other => panic!("a script between the batches: {other:?}"),
            }
        }
    }

    #[test]
    fn each_tables_jumps_follow_its_own_elements_and_come_before_the_next_table() {
        // Two families, as the dataplane plans them: one planner after the other.
        let mut nft = Recorder::default();
        let mut fill = FillSink::new(&mut nft, 1 << 20);
        write_table(&mut fill, 10);
        write_table(&mut fill, 10);
        fill.finish().expect("fill");
        let kinds: Vec<&str> = nft
            .sent
            .iter()
            .map(|s| match s {
                Sent::Script(t) if t.contains("jump") => "jumps",
                Sent::Script(_) => "structure",
                Sent::Batch(_) => "batch",
            })
            .collect();
        assert_eq!(
            kinds,
            ["structure", "batch", "jumps", "structure", "batch", "jumps"]
        );
    }

    #[test]
    fn a_refused_exchange_stops_the_fill_and_is_its_error() {
        for fail_at in 0..4 {
            let mut nft = Recorder {
                fail_at: Some(fail_at),
                ..Recorder::default()
            };
            let mut fill = FillSink::new(&mut nft, 4096);
            write_table(&mut fill, 3000);
            assert!(fill.finish().is_err(), "failing exchange {fail_at}");
            assert_eq!(nft.sent.len(), fail_at, "nothing is sent after the failure");
        }
    }
}
