//! Compiles the BPF programs under `bpf/` with clang (`-target bpf`) into `OUT_DIR`, where
//! `src/lib.rs` embeds them. Fails with the package to install when clang or the libbpf
//! headers are missing.

use std::env;
use std::path::PathBuf;
use std::process::Command;

const PROGRAMS: &[&str] = &["sock"];

fn main() {
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let clang = env::var("KP_CLANG").unwrap_or_else(|_| "clang".to_string());
    println!("cargo:rerun-if-env-changed=KP_CLANG");
    println!("cargo:rerun-if-changed=bpf");
    if !std::path::Path::new("/usr/include/bpf/bpf_helpers.h").exists() {
        panic!(
            "kp-ebpf: /usr/include/bpf/bpf_helpers.h is missing: install the libbpf headers \
             (`apt-get install libbpf-dev`)"
        );
    }
    for name in PROGRAMS {
        let src = format!("bpf/{name}.c");
        let obj = out.join(format!("{name}.o"));
        let status = Command::new(&clang)
            .args(["-O2", "-g", "-Wall", "-Werror", "-target", "bpf"])
            .args(["-I/usr/include/x86_64-linux-gnu", "-Ibpf", "-c", &src, "-o"])
            .arg(&obj)
            .status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => panic!("kp-ebpf: `{clang} -target bpf` failed on {src} ({s})"),
            Err(e) => panic!(
                "kp-ebpf: cannot run `{clang}` ({e}): the BPF programs are compiled with clang \
                 (`apt-get install clang`, Debian's clang 14 or later; KP_CLANG names another)"
            ),
        }
    }
}
