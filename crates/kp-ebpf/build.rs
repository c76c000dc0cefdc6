//! Compiles the BPF programs under `bpf/` with clang (`-target bpf`) into `OUT_DIR`, where
//! `src/lib.rs` embeds them: each program as `NAME.o`, and again as `NAME_compat.o` with
//! `-DKP_NO_SET_RETVAL` (for kernels before 5.18, which lack `bpf_set_retval`). Fails with the
//! package to install when clang or the libbpf headers are missing.

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
    let variants: [(&str, &[&str]); 2] = [("", &[]), ("_compat", &["-DKP_NO_SET_RETVAL"])];
    for (name, (suffix, defines)) in PROGRAMS
        .iter()
        .flat_map(|n| variants.iter().map(move |v| (n, v)))
    {
        let src = format!("bpf/{name}.c");
        let obj = out.join(format!("{name}{suffix}.o"));
        let status = Command::new(&clang)
            .args(["-O2", "-g", "-Wall", "-Werror", "-target", "bpf"])
            .args(defines.iter())
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
