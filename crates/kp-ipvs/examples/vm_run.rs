//! Runs one shell command line in the kp-vm guest (Debian's kernel with IPVS under qemu TCG,
//! the host's root read-only over 9p) and hands back what it printed and its exit status: the
//! benchmark's way into the guest (`bench vm` starts this once per mode and size), since kp-bench
//! itself does not depend on kp-vm.
//!
//! ```sh
//! cargo build --release -p kp-ipvs --example vm_run
//! target/release/examples/vm_run --timeout 1800 -- /path/to/program args...
//! ```
//!
//! The guest's output goes to standard output as it came back (after the guest finished: kp-vm
//! returns it whole); one line on standard error says how long the boot and the whole run took
//! (`kp-vm: kernel VERSION, boot S s, total S s, status N`). The exit code is the guest script's
//! status; 70 if the guest could not run it (a set-up failure, a timeout, qemu exiting), with
//! the reason and the guest's console on standard error.

use std::process::ExitCode;
use std::time::Duration;

fn usage() -> ExitCode {
    eprintln!("usage: vm_run [--timeout SECONDS] -- PROGRAM [ARGS...]");
    ExitCode::from(64)
}

/// One shell word, quoted unless it is plainly safe.
fn quote(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-=,:+@%".contains(c));
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut timeout = Duration::from_secs(300);
    let mut i = 0;
    while i < args.len() && args[i] != "--" {
        match (args[i].as_str(), args.get(i + 1)) {
            ("--timeout", Some(v)) => match v.parse::<u64>() {
                Ok(s) if s > 0 => timeout = Duration::from_secs(s),
                _ => return usage(),
            },
            _ => return usage(),
        }
        i += 2;
    }
    let command: Vec<String> = args.iter().skip(i + 1).map(|w| quote(w)).collect();
    if command.is_empty() {
        return usage();
    }
    let vm = match kp_vm::Vm::new() {
        Ok(vm) => vm.timeout(timeout),
        Err(e) => {
            eprintln!("vm_run: {e}");
            return ExitCode::from(70);
        }
    };
    let kernel = vm.kernel().version.clone();
    match vm.run(&command.join(" ")) {
        Ok(run) => {
            println!("{}", run.output);
            eprintln!(
                "kp-vm: kernel {kernel}, boot {:.1} s, total {:.1} s, status {}",
                run.boot.as_secs_f64(),
                run.total.as_secs_f64(),
                run.status
            );
            ExitCode::from(u8::try_from(run.status).unwrap_or(1))
        }
        Err(e) => {
            eprintln!("vm_run: {e}");
            ExitCode::from(70)
        }
    }
}
