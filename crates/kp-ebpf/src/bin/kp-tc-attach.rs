//! Attaches the tc programs in the network namespace it runs in (under `ip netns exec`), over
//! the maps pinned in a directory, and pins the links there, so they stay attached after it
//! exits: what `EbpfDataplane::start` does in the proxy's own namespace, for a dataplane whose
//! namespace is another (tests: the lab's node). `remove_pins` on the directory detaches them.
//!
//! ```text
//! kp-tc-attach PIN_DIR OUTSIDE_DEVS REPLY_DEVS    (comma-separated; "-" for none)
//! ```
//!
//! The maps are adopted at the sizes they were pinned with (`MapSizes::from_pins`); those not
//! pinned yet are created at the default sizes.

use std::path::PathBuf;
use std::process::ExitCode;

use kp_ebpf::{MapSizes, SocketLb};

fn list(arg: &str) -> Vec<String> {
    if arg == "-" {
        return Vec::new();
    }
    arg.split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [dir, outside, replies] = args.as_slice() else {
        eprintln!("usage: kp-tc-attach PIN_DIR OUTSIDE_DEVS REPLY_DEVS");
        return ExitCode::from(2);
    };
    let dir = PathBuf::from(dir);
    let run = || -> Result<usize, kp_ebpf::Error> {
        let mut lb = SocketLb::load(MapSizes::from_pins(&dir)?, Some(&dir))?;
        let n = lb.attach_tc(&list(outside), &list(replies))?;
        lb.pin_tc_links(&dir)?;
        Ok(n)
    };
    match run() {
        Ok(n) => {
            println!("attached {n}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kp-tc-attach: {e}");
            ExitCode::FAILURE
        }
    }
}
