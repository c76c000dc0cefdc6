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
    /// The list in progress, if any.
    listing: Listing,
}

/// Where a list stands.
#[derive(Debug)]
enum Listing {
    /// No list in progress.
    Idle,
    /// A list started while nothing was known: nothing can have vanished, so the keys it
    /// lists are not collected (at 10k Services, a copy of 10k keys per kind saved).
    First,
    /// A re-list, with the keys seen so far.
    Relist(HashSet<ObjectKey>),
}

impl RelistTracker {
    /// A tracker for `kind` that has reported nothing yet.
    pub(crate) fn new(kind: Kind) -> Self {
        RelistTracker {
            kind,
            known: HashMap::new(),
            listing: Listing::Idle,
        }
    }

    /// The kind it tracks.
    pub(crate) fn kind(&self) -> Kind {
        self.kind
    }

    /// Handles one watcher event, returning what to report.
    ///
    /// - `Init` starts a list: nothing is reported yet, not even for objects about to vanish.
    ///   (A half-listed first list that starts over is a re-list: its objects are known.)
    /// - `InitApply` and `Apply` report the object unless the same resourceVersion was already
    ///   reported.
    /// - `InitDone` reports every previously known object the list did not contain as deleted,
    ///   then `Synced`. A list that fails half-way is followed by a fresh `Init`, so the partial
    ///   one never deletes anything.
    /// - `Delete` reports the deletion of an object that was reported.
    pub(crate) fn handle(&mut self, event: Event<Object>) -> Vec<SourceEvent> {
        match event {
            Event::Init => {
                self.listing = if self.known.is_empty() {
                    Listing::First
                } else {
                    Listing::Relist(HashSet::new())
                };
                Vec::new()
            }
            Event::InitApply(obj) | Event::Apply(obj) => {
                let key = obj.key();
                if let Listing::Relist(listed) = &mut self.listing {
                    listed.insert(key.clone());
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
                if let Listing::Relist(listed) = &mut self.listing {
                    listed.remove(&key);
                }
                match self.known.remove(&key) {
                    Some(_) => vec![SourceEvent::Delete(self.kind, key)],
                    None => Vec::new(),
                }
            }
            Event::InitDone => {
                let mut gone: Vec<ObjectKey> =
                    match std::mem::replace(&mut self.listing, Listing::Idle) {
                        // Everything known was listed.
                        Listing::First => Vec::new(),
                        // A list that never started (kube-runtime always starts one) lists nothing.
                        Listing::Idle => self.known.keys().cloned().collect(),
                        Listing::Relist(listed) => self
                            .known
                            .keys()
                            .filter(|key| !listed.contains(*key))
                            .cloned()
                            .collect(),
                    };
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

impl RelistTracker {
    /// Counts `key` as listed by the list in progress without reporting anything: an object
    /// that is there but does not decode. Its last good version, if any, stays in force; a
    /// re-list must not take it for deleted.
    pub(crate) fn keep(&mut self, key: ObjectKey) {
        if let Listing::Relist(listed) = &mut self.listing {
            listed.insert(key);
        }
    }
}

fn resource_version(obj: &Object) -> &str {
    obj.metadata().resource_version.as_deref().unwrap_or("")
}
