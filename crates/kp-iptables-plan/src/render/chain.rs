//! What rendering produces: whole chains, by table, and the chains of one Service port.

/// An iptables table kube-proxy writes with `iptables-restore`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Table {
    /// The filter table.
    Filter,
    /// The nat table.
    Nat,
}

impl Table {
    /// Both tables.
    pub const ALL: [Table; 2] = [Table::Filter, Table::Nat];

    /// The order a restore input lists (and so commits) them: nat, then filter. Both
    /// iptables-restore backends commit table by table. Upstream commits filter first, so a
    /// Service gaining its first endpoint loses its REJECT before its DNAT exists, for as long
    /// as the (large) nat commit takes; nat first makes the only window the reverse case (a
    /// Service losing its last endpoint, DNAT gone before the REJECT lands), bounded by the
    /// small filter commit.
    pub const COMMIT_ORDER: [Table; 2] = [Table::Nat, Table::Filter];

    /// The table's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Table::Filter => "filter",
            Table::Nat => "nat",
        }
    }
}

/// One chain, written whole: flushed (or created) and filled with `rules`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChainWrite {
    /// Its table.
    pub table: Table,
    /// Its name.
    pub chain: String,
    /// Its rules in order, each as the arguments after `-A CHAIN `.
    pub rules: Vec<String>,
}

/// The chains of one Service port (`KUBE-SVC`, `KUBE-SVL`, `KUBE-EXT`, `KUBE-FW` and its
/// `KUBE-SEP` chains): they jump to each other and to the fixed chains only, so a group can be
/// written in any step after the fixed chains exist.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceChains {
    /// The Service port, upstream's spelling (`namespace/name:port`).
    pub service_port: String,
    /// Its chains; a chain appears after the chains it jumps to.
    pub chains: Vec<ChainWrite>,
}

/// A nat chain.
pub(crate) fn nat(chain: &str, rules: Vec<String>) -> ChainWrite {
    ChainWrite {
        table: Table::Nat,
        chain: chain.to_string(),
        rules,
    }
}
