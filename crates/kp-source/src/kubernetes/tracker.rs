//! Turning one kind's watcher events into [`SourceEvent`]s, re-lists included.

use std::collections::{HashMap, HashSet};

use kp_core::track::{Kind, Object, ObjectKey, SourceEvent};
use kube::runtime::watcher::Event;

/// What has been reported for one kind, so that a re-list can be turned into the `Delete`s of
/// the objects it no longer lists.
///
/// Upstream's informers keep a full cache for this; the key and resourceVersion of each object
/// are enough here, and the resourceVersion also lets a re-list skip objects that did not change.
#[derive(Debug)]
pub(crate) struct RelistTracker {
    kind: Kind,
    /// Every object reported present (and not since deleted), with its resourceVersion as
    /// reported (empty if it had none).
    known: HashMap<ObjectKey, String>,
    /// Keys seen in the list in progress; `None` when no list is in progress.
    listing: Option<HashSet<ObjectKey>>,
}

impl RelistTracker {
    /// A tracker for `kind` that has reported nothing yet.
    pub(crate) fn new(kind: Kind) -> Self {
        RelistTracker {
            kind,
            known: HashMap::new(),
            listing: None,
        }
    }

    /// Handles one watcher event, returning what to report.
    ///
    /// - `Init` starts a list: nothing is reported yet, not even for objects about to vanish.
    /// - `InitApply` and `Apply` report the object unless the same resourceVersion was already
    ///   reported.
    /// - `InitDone` reports every previously known object the list did not contain as deleted,
    ///   then `Synced`. A list that fails half-way is followed by a fresh `Init`, so the partial
    ///   one never deletes anything.
    /// - `Delete` reports the deletion of an object that was reported.
    pub(crate) fn handle(&mut self, event: Event<Object>) -> Vec<SourceEvent> {
        match event {
            Event::Init => {
                self.listing = Some(HashSet::new());
                Vec::new()
            }
            Event::InitApply(obj) | Event::Apply(obj) => {
                let key = obj.key();
                if let Some(listing) = &mut self.listing {
                    listing.insert(key.clone());
                }
                let version = resource_version(&obj);
                if !version.is_empty() && self.known.get(&key).map(String::as_str) == Some(version)
                {
                    return Vec::new();
                }
                self.known.insert(key, version.to_string());
                vec![SourceEvent::Upsert(obj)]
            }
            Event::Delete(obj) => {
                let key = obj.key();
                if let Some(listing) = &mut self.listing {
                    listing.remove(&key);
                }
                match self.known.remove(&key) {
                    Some(_) => vec![SourceEvent::Delete(self.kind, key)],
                    None => Vec::new(),
                }
            }
            Event::InitDone => {
                let listed = self.listing.take().unwrap_or_default();
                let mut gone: Vec<ObjectKey> = self
                    .known
                    .keys()
                    .filter(|key| !listed.contains(*key))
                    .cloned()
                    .collect();
                // Sorted so that what is reported does not depend on hash order.
                gone.sort();
                let mut out = Vec::with_capacity(gone.len() + 1);
                for key in gone {
                    self.known.remove(&key);
                    out.push(SourceEvent::Delete(self.kind, key));
                }
                out.push(SourceEvent::Synced(self.kind));
                out
            }
        }
    }
}

fn resource_version(obj: &Object) -> &str {
    let meta = match obj {
        Object::Service(svc) => &svc.metadata,
        Object::EndpointSlice(slice) => &slice.metadata,
        Object::Node(node) => &node.metadata,
    };
    meta.resource_version.as_deref().unwrap_or("")
}
