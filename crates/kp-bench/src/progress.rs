//! Progress lines on standard error, stamped with the time since the run started.

use std::time::{Duration, Instant};

/// How often a long loop says how far it got.
pub const EVERY: Duration = Duration::from_secs(30);

/// Prints progress.
#[derive(Debug)]
pub struct Progress {
    start: Instant,
}

impl Default for Progress {
    fn default() -> Self {
        Progress::new()
    }
}

impl Progress {
    /// Starts the clock.
    pub fn new() -> Self {
        Progress {
            start: Instant::now(),
        }
    }

    /// Seconds since the start.
    pub fn elapsed(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Prints one line.
    pub fn say(&self, line: impl AsRef<str>) {
        eprintln!("[{:7.1} s] {}", self.elapsed(), line.as_ref());
    }

    /// Prints `line()` if [`EVERY`] has passed since `*last`, and restarts `last` then: for
    /// loops whose steps take seconds (a change at 30k Services with iptables-legacy).
    pub fn every(&self, last: &mut Instant, line: impl FnOnce() -> String) {
        if last.elapsed() >= EVERY {
            self.say(line());
            *last = Instant::now();
        }
    }
}
