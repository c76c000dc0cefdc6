use super::*;

use proptest::prelude::*;

// Time is `base + offset`; nothing sleeps. Unless a test says otherwise, min_interval is 1 s
// and max_interval 30 s, upstream's defaults.

const MIN: Duration = Duration::from_secs(1);
const MAX: Duration = Duration::from_secs(30);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// A schedule whose first (full) sync succeeded at `base`.
fn after_first_sync(base: Instant) -> SyncSchedule {
    let mut s = SyncSchedule::new(MIN, MAX);
    s.request(base);
    assert_eq!(s.due(base), Some(SyncKind::Full));
    s.finished(base, SyncKind::Full, true);
    s
}

/// Runs the sync that is due at `now`, with the given outcome, and returns its kind.
fn run(s: &mut SyncSchedule, now: Instant, ok: bool) -> SyncKind {
    let kind = s.due(now).expect("a sync is due");
    s.finished(now, kind, ok);
    kind
}

#[test]
fn nothing_is_due_before_the_first_request() {
    let base = Instant::now();
    let s = SyncSchedule::new(MIN, MAX);
    assert_eq!(s.due(base), None);
    assert_eq!(s.due(base + secs(3600)), None);
    assert_eq!(s.oldest_request(), None);
}

#[test]
fn the_first_sync_is_full_and_due_as_soon_as_requested() {
    let base = Instant::now();
    let mut s = SyncSchedule::new(MIN, MAX);
    s.request(base + ms(5));
    assert_eq!(s.next_wakeup(base + ms(5)), base + ms(5));
    assert_eq!(s.due(base + ms(5)), Some(SyncKind::Full));
    assert_eq!(s.oldest_request(), Some(base + ms(5)));
}

#[test]
fn a_successful_sync_serves_the_request() {
    let base = Instant::now();
    let s = after_first_sync(base);
    assert_eq!(s.oldest_request(), None);
    assert_eq!(s.due(base + ms(1)), None);
    assert_eq!(s.due(base + secs(29)), None);
}

#[test]
fn requests_within_min_interval_coalesce_into_one_run() {
    let base = Instant::now();
    let mut s = after_first_sync(base);
    for offset in [10, 20, 30, 400, 999] {
        s.request(base + ms(offset));
        assert_eq!(s.due(base + ms(offset)), None, "too soon at +{offset}ms");
    }
    assert_eq!(s.oldest_request(), Some(base + ms(10)));
    assert_eq!(s.next_wakeup(base + ms(999)), base + MIN);
    assert_eq!(run(&mut s, base + MIN, true), SyncKind::Partial);
    assert_eq!(
        s.due(base + MIN + ms(1)),
        None,
        "the burst was served by one run"
    );
    assert_eq!(s.due(base + MIN * 2), None);
    assert_eq!(s.oldest_request(), None);
}

#[test]
fn a_request_long_after_the_last_sync_runs_at_once() {
    let base = Instant::now();
    let mut s = after_first_sync(base);
    let later = base + secs(7);
    assert_eq!(s.due(later), None);
    s.request(later);
    assert_eq!(s.next_wakeup(later), later);
    assert_eq!(s.due(later), Some(SyncKind::Partial));
}

#[test]
fn max_interval_forces_a_periodic_run_without_requests() {
    let base = Instant::now();
    let mut s = after_first_sync(base);
    assert_eq!(s.next_wakeup(base + secs(1)), base + MAX);
    assert_eq!(s.due(base + MAX - ms(1)), None);
    assert!(s.due(base + MAX).is_some());
    s.finished(base + MAX, SyncKind::Full, true);
    assert_eq!(s.next_wakeup(base + MAX), base + MAX * 2);
    assert!(s.due(base + MAX * 2).is_some());
}

#[test]
fn after_a_success_the_next_sync_is_partial() {
    let base = Instant::now();
    let mut s = after_first_sync(base);
    s.request(base + secs(2));
    assert_eq!(run(&mut s, base + secs(2), true), SyncKind::Partial);
    s.request(base + secs(4));
    assert_eq!(run(&mut s, base + secs(4), true), SyncKind::Partial);
}

#[test]
fn after_a_failure_the_next_sync_is_full() {
    let base = Instant::now();
    let mut s = after_first_sync(base);
    s.request(base + secs(2));
    assert_eq!(run(&mut s, base + secs(2), false), SyncKind::Partial);
    assert_eq!(
        s.oldest_request(),
        Some(base + secs(2)),
        "a failed sync serves nothing"
    );
    assert_eq!(run(&mut s, base + secs(3), true), SyncKind::Full);
    assert_eq!(s.oldest_request(), None);
    s.request(base + secs(5));
    assert_eq!(run(&mut s, base + secs(5), true), SyncKind::Partial);
}

#[test]
fn a_failed_first_sync_is_retried_in_full() {
    let base = Instant::now();
    let mut s = SyncSchedule::new(MIN, MAX);
    s.request(base);
    assert_eq!(run(&mut s, base, false), SyncKind::Full);
    assert_eq!(s.due(base + ms(999)), None);
    assert_eq!(run(&mut s, base + secs(1), true), SyncKind::Full);
}

#[test]
fn retries_back_off_from_one_second_doubling_up_to_max_interval() {
    let base = Instant::now();
    let max = secs(10);
    let mut s = SyncSchedule::new(MIN, max);
    s.request(base);
    s.finished(base, SyncKind::Full, false);
    let mut now = base;
    for delay in [1, 2, 4, 8, 10, 10] {
        let retry = now + secs(delay);
        assert_eq!(s.next_wakeup(now), retry, "retry after {delay}s");
        assert_eq!(s.due(retry - ms(1)), None, "retry before {delay}s");
        assert_eq!(s.due(retry), Some(SyncKind::Full));
        s.finished(retry, SyncKind::Full, false);
        now = retry;
    }
}

#[test]
fn a_success_resets_the_backoff() {
    let base = Instant::now();
    let mut s = after_first_sync(base);
    s.request(base + secs(1));
    run(&mut s, base + secs(1), false);
    run(&mut s, base + secs(2), false);
    run(&mut s, base + secs(4), true);
    s.request(base + secs(5));
    run(&mut s, base + secs(5), false);
    assert_eq!(s.next_wakeup(base + secs(5)), base + secs(6));
    assert_eq!(s.due(base + secs(6)), Some(SyncKind::Full));
}

#[test]
fn a_retry_never_comes_sooner_than_min_interval() {
    let base = Instant::now();
    let mut s = SyncSchedule::new(secs(5), MAX);
    s.request(base);
    run(&mut s, base, false);
    assert_eq!(s.due(base + secs(1)), None);
    assert_eq!(s.due(base + secs(5) - ms(1)), None);
    assert_eq!(s.next_wakeup(base), base + secs(5));
    assert_eq!(s.due(base + secs(5)), Some(SyncKind::Full));
}

#[test]
fn a_new_request_after_a_failure_runs_after_min_interval() {
    // Like upstream's runner: a retry timer does not hold back fresh changes, which may be the
    // fix for what failed. The run is full.
    let base = Instant::now();
    let mut s = after_first_sync(base);
    s.request(base + secs(1));
    run(&mut s, base + secs(1), false); // retry at +2 s
    run(&mut s, base + secs(2), false); // retry at +4 s
    s.request(base + ms(2500));
    assert_eq!(s.due(base + ms(2999)), None);
    assert_eq!(s.next_wakeup(base + ms(2500)), base + secs(3));
    assert_eq!(s.due(base + secs(3)), Some(SyncKind::Full));
}

#[test]
fn a_full_sync_is_due_again_once_max_interval_passed_since_the_last_full_one() {
    let base = Instant::now();
    let mut s = after_first_sync(base);
    for t in [5, 10, 15, 20, 25] {
        s.request(base + secs(t));
        assert_eq!(
            run(&mut s, base + secs(t), true),
            SyncKind::Partial,
            "at +{t}s"
        );
    }
    s.request(base + secs(29));
    assert_eq!(s.due(base + secs(29)), Some(SyncKind::Partial));
    assert_eq!(s.due(base + secs(30)), Some(SyncKind::Full));
    s.finished(base + secs(30), SyncKind::Full, true);
    s.request(base + secs(32));
    assert_eq!(run(&mut s, base + secs(32), true), SyncKind::Partial);
}

#[test]
fn a_partial_sync_does_not_count_as_full() {
    let base = Instant::now();
    let mut s = after_first_sync(base);
    s.request(base + secs(29));
    // A caller that ran partial although full was due does not reset the full-sync clock.
    s.finished(base + secs(31), SyncKind::Partial, true);
    s.request(base + secs(33));
    assert_eq!(s.due(base + secs(33)), Some(SyncKind::Full));
}

#[test]
fn force_full_requests_a_full_sync() {
    let base = Instant::now();
    let mut s = after_first_sync(base);
    s.force_full(base + secs(3));
    assert_eq!(s.oldest_request(), Some(base + secs(3)));
    assert_eq!(s.next_wakeup(base + secs(3)), base + secs(3));
    assert_eq!(run(&mut s, base + secs(3), true), SyncKind::Full);
    s.request(base + secs(5));
    assert_eq!(run(&mut s, base + secs(5), true), SyncKind::Partial);
}

#[test]
fn force_full_still_respects_min_interval() {
    let base = Instant::now();
    let mut s = after_first_sync(base);
    s.force_full(base + ms(100));
    assert_eq!(s.due(base + ms(100)), None);
    assert_eq!(s.due(base + MIN), Some(SyncKind::Full));
}

#[test]
fn a_max_interval_below_min_interval_is_raised_to_it() {
    let base = Instant::now();
    let mut s = SyncSchedule::new(secs(5), secs(1));
    s.request(base);
    run(&mut s, base, true);
    assert_eq!(s.due(base + secs(1)), None);
    assert_eq!(s.next_wakeup(base), base + secs(5));
    assert!(s.due(base + secs(5)).is_some());
}

#[test]
fn next_wakeup_is_never_in_the_past() {
    let base = Instant::now();
    let mut s = after_first_sync(base);
    s.request(base + ms(10));
    assert_eq!(s.next_wakeup(base + secs(100)), base + secs(100));
}

#[test]
fn a_drift_check_takes_the_place_of_the_periodic_full_sync() {
    let base = Instant::now();
    let mut s = after_first_sync(base);
    assert_eq!(s.due(base + MAX), Some(SyncKind::Full));
    assert!(
        s.periodic(),
        "nothing forces a rebuild: a check may replace it"
    );
    s.check_started(base + MAX);
    // Nothing is due without a change while the check runs, and the timer restarted.
    assert_eq!(s.due(base + MAX), None);
    assert_eq!(s.due(base + MAX + secs(29)), None);
    assert_eq!(s.next_wakeup(base + MAX + secs(1)), base + MAX * 2);
    // A change during the check syncs partially, after min_interval since the last sync only.
    s.request(base + MAX + ms(10));
    assert_eq!(s.due(base + MAX + ms(10)), Some(SyncKind::Partial));
    assert_eq!(s.oldest_request(), Some(base + MAX + ms(10)));
    assert_eq!(run(&mut s, base + MAX + ms(10), true), SyncKind::Partial);
    // A period after the check started, the next change's sync is full again (periodic), and
    // without changes a period after the last run.
    assert_eq!(s.due(base + MAX * 2 - ms(1)), None);
    assert_eq!(s.due(base + MAX * 2 + ms(10)), Some(SyncKind::Full));
    s.request(base + MAX * 2);
    assert_eq!(s.due(base + MAX * 2), Some(SyncKind::Full));
    assert!(s.periodic());
}

#[test]
fn a_check_never_replaces_a_full_sync_that_a_failure_or_the_start_asks_for() {
    let base = Instant::now();
    let mut s = SyncSchedule::new(MIN, MAX);
    s.request(base);
    assert!(!s.periodic(), "the first sync builds everything");
    s.finished(base, SyncKind::Full, false);
    assert!(!s.periodic());
    let mut s = after_first_sync(base);
    s.force_full(base + secs(2));
    assert!(!s.periodic(), "a repair is a full sync");
}

// ---- Property: a driver loop that sleeps until next_wakeup ----

#[derive(Clone, Debug)]
enum Action {
    /// Time passes, then a change arrives.
    Request(u64),
    /// Time passes with no change.
    Idle(u64),
}

fn arb_action() -> impl Strategy<Value = Action> {
    prop_oneof![
        3 => (0u64..3000).prop_map(Action::Request),
        1 => (0u64..40_000).prop_map(Action::Idle),
    ]
}

/// What the driver observed.
struct Driver {
    schedule: SyncSchedule,
    min: Duration,
    max: Duration,
    now: Instant,
    last_run: Option<Instant>,
    last_failed: bool,
    last_full_ok: Option<Instant>,
    outcomes: Vec<bool>,
    runs: usize,
}

impl Driver {
    /// Sleeps until `until`, running every sync that falls due on the way.
    fn advance(&mut self, until: Instant) -> Result<(), TestCaseError> {
        loop {
            let wake = self.schedule.next_wakeup(self.now);
            prop_assert!(wake >= self.now);
            if wake > until {
                break;
            }
            if wake > self.now {
                prop_assert_eq!(
                    self.schedule.due(wake - Duration::from_nanos(1)),
                    None,
                    "due before next_wakeup"
                );
            }
            self.now = wake;
            let Some(kind) = self.schedule.due(wake) else {
                // Only before the first sync with nothing requested may a wakeup be idle.
                prop_assert!(self.last_run.is_none() && self.schedule.oldest_request().is_none());
                break;
            };
            if let Some(last) = self.last_run {
                let gap = wake - last;
                prop_assert!(gap >= self.min, "runs {:?} apart, min {:?}", gap, self.min);
                prop_assert!(gap <= self.max, "runs {:?} apart, max {:?}", gap, self.max);
            }
            let full_due =
                self.last_failed || self.last_full_ok.is_none_or(|f| wake - f >= self.max);
            prop_assert_eq!(
                kind,
                if full_due {
                    SyncKind::Full
                } else {
                    SyncKind::Partial
                }
            );

            let ok = self.outcomes[self.runs % self.outcomes.len()];
            self.runs += 1;
            self.schedule.finished(wake, kind, ok);
            if ok {
                prop_assert_eq!(self.schedule.oldest_request(), None);
                if kind == SyncKind::Full {
                    self.last_full_ok = Some(wake);
                }
            }
            self.last_run = Some(wake);
            self.last_failed = !ok;
            prop_assert!(self.runs < 10_000, "the loop spins");
        }
        self.now = until;
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn a_driver_loop_runs_no_more_often_than_min_and_no_less_often_than_max(
        min_ms in prop_oneof![Just(10u64), Just(1000), Just(5000)],
        max_s in prop_oneof![Just(1u64), Just(10), Just(30)],
        outcomes in prop::collection::vec(prop::bool::weighted(0.7), 1..8),
        actions in prop::collection::vec(arb_action(), 1..60),
    ) {
        let (min, max) = (ms(min_ms), secs(max_s).max(ms(min_ms)));
        let base = Instant::now();
        let mut d = Driver {
            schedule: SyncSchedule::new(min, secs(max_s)),
            min,
            max,
            now: base,
            last_run: None,
            last_failed: false,
            last_full_ok: None,
            outcomes,
            runs: 0,
        };
        for action in actions {
            match action {
                Action::Request(delay) => {
                    d.advance(d.now + ms(delay))?;
                    d.schedule.request(d.now);
                    prop_assert!(d.schedule.oldest_request().is_some());
                }
                Action::Idle(delay) => d.advance(d.now + ms(delay))?,
            }
        }
        // Every request is served by a successful sync sooner or later.
        if d.outcomes.iter().any(|ok| *ok) {
            let deadline = d.now + max * 20;
            while d.schedule.oldest_request().is_some() && d.now < deadline {
                let next = d.schedule.next_wakeup(d.now);
                d.advance(next)?;
            }
            prop_assert_eq!(d.schedule.oldest_request(), None);
        }
    }
}
