//! The redirect table: planned by `kp-userspace-plan`'s [`RedirectPlanner`], sent with
//! `nft -f -`, read back with `nft -j list table` to verify.
//!
//! The table is small at any scale compared with the nftables mode's (frontends only, no
//! endpoints), so everything goes as nft text: a full sync replaces the table atomically, a
//! partial one is the element changes of the Service ports that changed, and a change of
//! endpoints alone sends nothing.

use kp_core::node::NodeContext;
use kp_core::track::{Changes, ProxyState};
use kp_nftables::NftCommand;
use kp_userspace_plan::names::{FAMILY, SERVICES, TABLE};
use kp_userspace_plan::{RedirectConfig, RedirectPlanner};

use crate::Error;

/// The redirect table and what was last sent.
pub struct Table {
    nft: NftCommand,
    mark: u32,
    node_ports_restricted: bool,
    planner: Option<RedirectPlanner>,
    last_transaction: String,
}

impl Table {
    /// Nothing sent yet.
    pub fn new(nft: NftCommand, mark: u32, node_ports_restricted: bool) -> Table {
        Table {
            nft,
            mark,
            node_ports_restricted,
            planner: None,
            last_transaction: String::new(),
        }
    }

    /// How nft is run.
    pub fn nft(&self) -> &NftCommand {
        &self.nft
    }

    /// The last nft text sent.
    pub fn last_transaction(&self) -> &str {
        &self.last_transaction
    }

    /// Programs the table for proxy port `port`; returns whether the sync was full and the
    /// operations sent. After a failure the next sync is full.
    pub fn sync(
        &mut self,
        state: &ProxyState,
        node: &NodeContext,
        changes: &Changes,
        full: bool,
        port: u16,
    ) -> Result<(bool, usize), Error> {
        let planner = match &mut self.planner {
            Some(p) if p.config().proxy_port == port => p,
            slot => slot.insert(RedirectPlanner::new(RedirectConfig {
                proxy_port: port,
                transparent_mark: self.mark,
                node_ports_restricted: self.node_ports_restricted,
            })),
        };
        let mut full = full || changes.node_changed || !planner.programmed();
        if full && !changes.node_changed && planner.programmed() {
            // A periodic full sync: rebuild only if the kernel no longer holds the plan (or
            // cannot be read), as the nftables mode does; otherwise send the changes only.
            let diffs = self
                .verify()
                .unwrap_or_else(|e| vec![format!("cannot read the table back: {e}")]);
            for d in diffs.iter().take(10) {
                tracing::warn!(difference = %d, "the userspace redirect table differs from the plan; rebuilding");
            }
            full = !diffs.is_empty();
        }
        let Some(planner) = &mut self.planner else {
            return Err(Error::NotStarted);
        };
        let tx = planner.sync(state, node, changes, full);
        if tx.text.is_empty() {
            self.last_transaction.clear();
            return Ok((full, 0));
        }
        let r = self.nft.run(&tx.text);
        self.last_transaction = tx.text;
        if let Err(e) = r {
            planner.invalidate();
            return Err(e.into());
        }
        Ok((full, tx.operations))
    }

    /// The differences between the kernel's table and the plan (every difference when nothing
    /// was planned yet is the table itself, so a missing plan reports nothing).
    pub fn verify(&mut self) -> Result<Vec<String>, Error> {
        let Some(planner) = &self.planner else {
            return Ok(Vec::new());
        };
        let json = match self.nft.json(&["list", "table", FAMILY, TABLE]) {
            Ok(j) => j,
            Err(kp_nftables::Error::List { .. }) => {
                return Ok(vec![format!("{FAMILY}: table {TABLE} is missing")])
            }
            Err(e) => return Err(e.into()),
        };
        let kernel = kp_nftables::parse_table_named(&json, TABLE)?;
        Ok(kp_nftables::compare(
            FAMILY,
            &planner.expected_chains(),
            &planner.expected_sets(),
            &kernel,
        ))
    }

    /// Whether the kernel's table still sends connections to proxy port `port`: some rule of
    /// its `services` chain redirects there. `Ok(false)` when the table or the chain is gone
    /// (another mode removed them, or `--cleanup` did) or every redirect names another port
    /// (another userspace proxy took over); an error when the table cannot be read.
    pub fn redirects_to(&self, port: u16) -> Result<bool, Error> {
        let json = match self.nft.json(&["list", "chain", FAMILY, TABLE, SERVICES]) {
            Ok(j) => j,
            Err(kp_nftables::Error::List { stderr, .. })
                if stderr.contains("No such file or directory") =>
            {
                return Ok(false)
            }
            Err(e) => return Err(e.into()),
        };
        redirect_ports(&json).map(|ports| ports.contains(&port))
    }

    /// Deletes the table (whether or not it exists); the next sync rebuilds it.
    pub fn cleanup(&mut self) -> Result<(), Error> {
        if let Some(p) = &mut self.planner {
            p.invalidate();
        }
        self.nft.run(&format!(
            "add table {FAMILY} {TABLE}\ndelete table {FAMILY} {TABLE}\n"
        ))?;
        Ok(())
    }
}

/// The ports the rules of an `nft -j list chain` listing redirect to.
fn redirect_ports(json: &str) -> Result<Vec<u16>, Error> {
    let doc: serde_json::Value = serde_json::from_str(json)
        .map_err(|e| kp_nftables::Error::Parse(format!("nft -j list chain: {e}")))?;
    let mut ports = Vec::new();
    let items = doc["nftables"].as_array().into_iter().flatten();
    for rule in items.filter_map(|i| i.get("rule")) {
        let exprs = rule["expr"].as_array().into_iter().flatten();
        for port in exprs.filter_map(|e| e["redirect"]["port"].as_u64()) {
            ports.extend(u16::try_from(port).ok());
        }
    }
    Ok(ports)
}

#[cfg(test)]
mod tests {
    use super::redirect_ports;

    #[test]
    fn the_redirect_ports_of_a_chain_listing_are_read_from_its_rules() {
        // nft 1.0.6's listing of a `services` chain with its two redirect rules.
        let rule = |port: u16| {
            format!(
                r#"{{"rule": {{"family": "inet", "table": "kube-proxy-userspace", "chain": "services", "handle": 5, "comment": "redirect-vips-v4", "expr": [{{"match": {{"op": "==", "left": {{"meta": {{"key": "l4proto"}}}}, "right": {{"set": ["tcp", "udp"]}}}}}}, {{"redirect": {{"port": {port}}}}}]}}}}"#
            )
        };
        let json = format!(
            r#"{{"nftables": [{{"metainfo": {{"version": "1.0.6"}}}}, {{"chain": {{"family": "inet", "table": "kube-proxy-userspace", "name": "services", "handle": 1}}}}, {}, {}]}}"#,
            rule(34567),
            rule(34568)
        );
        assert_eq!(redirect_ports(&json).unwrap(), vec![34567, 34568]);
        // A chain without rules redirects nowhere.
        let empty = r#"{"nftables": [{"chain": {"family": "inet", "table": "kube-proxy-userspace", "name": "services", "handle": 1}}]}"#;
        assert!(redirect_ports(empty).unwrap().is_empty());
        assert!(redirect_ports("not json").is_err());
    }
}
