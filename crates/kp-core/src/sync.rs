//! When to sync: upstream's bounded-frequency runner, as a pure state machine.
//!
//! A sync runs at most once per `min_interval` and at least once per `max_interval`; requests
//! that arrive in between coalesce into one run. After a failed sync the next run is a full one
//! and comes sooner: a retry follows exponential backoff (1 s, 2 s, 4 s, ...) capped at
//! `max_interval` and never sooner than `min_interval`. A failed sync consumes the requests it
//! tried to serve (so they do not bypass the backoff), but they stay unserved for `/healthz`;
//! a request that arrives after the failure runs after `min_interval` as usual, like upstream's
//! runner, since the new change may be what fixes the failure. Time is an argument, so
//! tests drive it without sleeping. Mirrors `k8s.io/kubernetes/pkg/util/async/bounded_frequency_runner.go`.
//!
//! The periodic full sync may instead be a drift check that runs off the loop
//! ([`SyncSchedule::check_started`]): it counts as the period's full sync from the moment it
//! starts, so changes that arrive while it runs are served by partial syncs at once, and the
//! `max_interval` timer restarts from it.

use std::time::{Duration, Instant};

/// Which kind of sync is due.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncKind {
    /// Rewrite everything and repair drift.
    Full,
    /// Program only what changed.
    Partial,
}

/// The runner's state.
#[derive(Clone, Debug)]
pub struct SyncSchedule {
    min_interval: Duration,
    max_interval: Duration,
    /// When the last sync finished (successfully or not).
    last_run: Option<Instant>,
    /// When the oldest request not yet served by a successful sync arrived.
    requested: Option<Instant>,
    /// Whether a request arrived since the last sync finished.
    run_wanted: bool,
    /// When to retry after a failure.
    retry_at: Option<Instant>,
    /// Current retry backoff.
    backoff: Duration,
    /// The next sync must be full (start-up, or after a failure).
    next_full: bool,
    /// When the last full sync finished.
    last_full: Option<Instant>,
}

/// First retry delay after a failure.
pub const INITIAL_BACKOFF: Duration = Duration::from_secs(1);

impl SyncSchedule {
    /// A schedule whose first sync is full and due as soon as it is requested.
    pub fn new(min_interval: Duration, max_interval: Duration) -> Self {
        SyncSchedule {
            min_interval,
            max_interval: max_interval.max(min_interval),
            last_run: None,
            requested: None,
            run_wanted: false,
            retry_at: None,
            backoff: INITIAL_BACKOFF,
            next_full: true,
            last_full: None,
        }
    }

    /// Records that something changed and a sync is wanted.
    pub fn request(&mut self, now: Instant) {
        self.requested.get_or_insert(now);
        self.run_wanted = true;
    }

    /// When the oldest unserved request arrived, if any (feeds `/healthz`).
    pub fn oldest_request(&self) -> Option<Instant> {
        self.requested
    }

    /// The earliest instant at which [`Self::due`] may return something.
    pub fn next_wakeup(&self, now: Instant) -> Instant {
        let Some(last) = self.last_run else {
            return if self.run_wanted {
                now
            } else {
                now + self.max_interval
            };
        };
        let mut at = self.period_start(last) + self.max_interval;
        if self.run_wanted {
            at = at.min(last + self.min_interval);
        }
        if let Some(r) = self.retry_at {
            at = at.min(r);
        }
        at.max(now)
    }

    /// Whether a sync should run at `now`, and which kind.
    pub fn due(&self, now: Instant) -> Option<SyncKind> {
        let kind = if self.next_full
            || self
                .last_full
                .is_none_or(|f| now.duration_since(f) >= self.max_interval)
        {
            SyncKind::Full
        } else {
            SyncKind::Partial
        };
        let Some(last) = self.last_run else {
            return self.run_wanted.then_some(kind);
        };
        let since = now.saturating_duration_since(last);
        if now.saturating_duration_since(self.period_start(last)) >= self.max_interval {
            return Some(kind);
        }
        if self.retry_at.is_some_and(|r| now >= r) {
            return Some(kind);
        }
        if self.run_wanted && since >= self.min_interval {
            return Some(kind);
        }
        None
    }

    /// Whether the full sync [`Self::due`] asks for is only the periodic one: the last sync
    /// succeeded and nothing forces a rebuild, so a drift check off the loop may take its place
    /// ([`Self::check_started`]).
    pub fn periodic(&self) -> bool {
        !self.next_full && self.last_full.is_some()
    }

    /// A periodic drift check started at `now` in place of the full sync: until `max_interval`
    /// has passed again, [`Self::due`] asks only for partial syncs (of changes, after
    /// `min_interval` as usual), and nothing is due without a change. Requests stay pending:
    /// the check serves none.
    pub fn check_started(&mut self, now: Instant) {
        self.last_full = Some(now);
    }

    /// When the `max_interval` timer started: the last sync, or a later drift check.
    fn period_start(&self, last: Instant) -> Instant {
        self.last_full.map_or(last, |f| f.max(last))
    }

    /// Records the outcome of a sync of `kind` that finished at `now`.
    pub fn finished(&mut self, now: Instant, kind: SyncKind, ok: bool) {
        self.last_run = Some(now);
        self.run_wanted = false;
        if ok {
            self.requested = None;
            self.retry_at = None;
            self.backoff = INITIAL_BACKOFF;
            self.next_full = false;
            if kind == SyncKind::Full {
                self.last_full = Some(now);
            }
        } else {
            self.next_full = true;
            self.retry_at = Some(now + self.backoff.max(self.min_interval));
            self.backoff = (self.backoff * 2).min(self.max_interval);
        }
    }

    /// Forces the next sync to be full (for example when someone flushed our rules).
    pub fn force_full(&mut self, now: Instant) {
        self.next_full = true;
        self.request(now);
    }
}

#[cfg(test)]
mod tests;
