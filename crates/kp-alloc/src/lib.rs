//! The kube-proxy binary's allocator settings.
//!
//! The binary allocates with mimalloc (`kube-proxy/src/main.rs` says why). mimalloc v3's defaults
//! suit a process that stays near its peak: on Linux it commits each arena eagerly, so a purge
//! of freed pages can only mark them reusable (`MADV_FREE`) and they stay resident until the
//! machine runs short of memory, and it purges freed pages only after a delay (1 s, ten times
//! that inside arenas). A proxy's memory comes in bursts (the initial lists, a full sync's
//! batch, a periodic read-back), and its peak RSS is what a DaemonSet's memory limit has to
//! cover. At 10k Services × 10 endpoints from a real API server the binary peaked at 94 MiB with
//! mimalloc's defaults and at 59 MiB with arenas committed on demand and freed pages purged at
//! once (`MADV_DONTNEED`), with the same sync times (BENCHMARKS.md).
//!
//! mimalloc reads its options when the process starts, and the Rust runtime allocates (and so
//! reserves mimalloc's first arena) before `main`. So the defaults are changed by a constructor
//! that runs before mimalloc's own: `.init_array` entries run in order of priority, this one's
//! is 100, mimalloc's 101 (clang) or none (gcc: after every prioritised one). An operator's
//! `MIMALLOC_ARENA_EAGER_COMMIT` or `MIMALLOC_PURGE_DELAY` still wins: only the defaults change.

use std::os::raw::{c_int, c_long};

// The C library the two functions below are in (linked through the mimalloc crate, which every
// binary of this crate's users also takes as its allocator).
extern crate mimalloc as _;

/// mimalloc's option numbers, from `mi_option_e` in mimalloc v3's `include/mimalloc.h` (as
/// vendored by libmimalloc-sys 0.1.49, whose bindings name neither). The tests check both
/// against the environment variables mimalloc reads them from.
const ARENA_EAGER_COMMIT: c_int = 4;
const PURGE_DELAY: c_int = 15;

extern "C" {
    fn mi_option_set_default(option: c_int, value: c_long);
    fn mi_option_get(option: c_int) -> c_long;
}

/// Arenas committed as they are used; freed pages purged at once.
extern "C" fn set_defaults() {
    // SAFETY: both calls only read or write mimalloc's static option table, which needs no
    // initialisation; the option numbers are in range (checked by the tests).
    #[allow(unsafe_code)]
    unsafe {
        mi_option_set_default(ARENA_EAGER_COMMIT, 0);
        mi_option_set_default(PURGE_DELAY, 0);
    }
}

/// The constructor: run by the C runtime before mimalloc's (see the crate's documentation).
#[allow(unsafe_code)]
#[used]
#[link_section = ".init_array.00100"]
static SET_DEFAULTS: extern "C" fn() = set_defaults;

/// The settings of mimalloc's that this crate changes, as in force.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    /// `arena_eager_commit`: 0 commits arenas as they are used, 1 eagerly, 2 eagerly where the
    /// system overcommits (mimalloc's default).
    pub arena_eager_commit: i64,
    /// `purge_delay`, milliseconds: how long freed pages stay before they are given back.
    pub purge_delay_ms: i64,
}

/// The settings in force. A binary that calls this also links the constructor that changed
/// them (an object file nothing refers to could otherwise be left out by the linker).
pub fn settings() -> Settings {
    std::hint::black_box(&SET_DEFAULTS);
    // SAFETY: `mi_option_get` reads mimalloc's option table (initialising an option from the
    // environment on first use); the option numbers are in range.
    #[allow(unsafe_code)]
    unsafe {
        Settings {
            arena_eager_commit: mi_option_get(ARENA_EAGER_COMMIT) as i64,
            purge_delay_ms: mi_option_get(PURGE_DELAY) as i64,
        }
    }
}
