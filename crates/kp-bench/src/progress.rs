//! Progress lines on standard error, stamped with the time since the run started.

use std::time::Instant;

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
}
