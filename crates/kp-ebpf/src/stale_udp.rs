//! Destroying stale connected UDP sockets (`bpf/udp_destroy.c`): when a sync takes a backend
//! from a UDP frontend, the connected sockets the hooks sent there for that frontend are
//! destroyed, so their owners see an error at their next call and connect again, to a backend
//! the frontend has.
//!
//! The iterator calls the `bpf_sock_destroy` kfunc (Linux 6.5), which aya 0.14 cannot link:
//! the C code calls a placeholder helper number instead, and [`prepare`] rewrites each such
//! call into a kfunc call of the running kernel's `bpf_sock_destroy` (its id in
//! `/sys/kernel/btf/vmlinux`) before the object is loaded. A kernel without it gets the object
//! unchanged and no iterator ([`SocketLb::stale_udp_support`] says why); nothing else of the
//! object calls it.
//!
//! An iterator walks the UDP sockets of the network namespace it is opened in, so
//! [`SocketLb::destroy_stale_udp`] opens it once in each namespace the hooks' processes live in
//! ([`crate::cgroup::network_namespaces`]), from a short-lived thread that enters it.

use std::fs::File;
use std::io::Read;

use aya::programs::Iter;
use aya::Btf;
use aya_obj::btf::BtfKind;
use kp_ebpf_plan::layout::STALE_UDP_SIZE;
use kp_ebpf_plan::StaleUdp;

use crate::{Error, SocketLb};

/// The iterator program, by function name.
pub const ITERATOR: &str = "kp_udp_destroy";

/// The map of pairs to destroy sockets of (`kp_stale`), filled for one run of the iterator.
pub const MAP: &str = "kp_stale";

/// The helper number `bpf/udp_destroy.c` calls in place of `bpf_sock_destroy`.
const PLACEHOLDER: u32 = 0x4b50_d001;

/// The kfunc.
const KFUNC: &str = "bpf_sock_destroy";

/// `BPF_JMP | BPF_CALL`.
const CALL: u8 = 0x85;

/// `BPF_PSEUDO_KFUNC_CALL` in an instruction's source register (its high nibble).
const PSEUDO_KFUNC_CALL: u8 = 2 << 4;

/// Rewrites, in `object` (an ELF file of BPF programs), every call of helper `placeholder` into
/// a call of kernel function `btf_id` (of vmlinux's BTF), and says how many it rewrote.
/// Instructions are 8 bytes at 8-byte aligned offsets (code sections are so aligned).
pub fn rewrite_calls(object: &mut [u8], placeholder: u32, btf_id: u32) -> usize {
    let mut want = [0u8; 8];
    want[0] = CALL;
    want[4..].copy_from_slice(&placeholder.to_le_bytes());
    let mut n = 0;
    for insn in object.chunks_exact_mut(8) {
        if *insn == want {
            insn[1] = PSEUDO_KFUNC_CALL;
            insn[4..].copy_from_slice(&btf_id.to_le_bytes());
            n += 1;
        }
    }
    n
}

/// A copy of `bytes` at an 8-byte aligned address, as the object parser needs (a `Vec<u8>`
/// promises no alignment).
pub(crate) struct Aligned {
    buf: Vec<u8>,
    at: usize,
    len: usize,
}

impl Aligned {
    fn new(bytes: &[u8]) -> Aligned {
        let mut buf = vec![0u8; bytes.len() + 8];
        let at = buf.as_ptr().align_offset(8).min(8);
        buf[at..at + bytes.len()].copy_from_slice(bytes);
        Aligned {
            buf,
            at,
            len: bytes.len(),
        }
    }

    fn bytes(&self) -> &[u8] {
        &self.buf[self.at..self.at + self.len]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.at..self.at + self.len]
    }
}

/// The object to load: `object` with its placeholder calls made kfunc calls and the kernel's
/// BTF (to load the iterator with), or `object` as is and why the iterator cannot be loaded.
pub(crate) fn prepare(object: &[u8]) -> (Object<'_>, Result<Btf, String>) {
    let btf = match Btf::from_sys_fs() {
        Ok(btf) => btf,
        Err(e) => return (Object::Borrowed(object), Err(format!("no kernel BTF: {e}"))),
    };
    let id = match btf.id_by_type_name_kind(KFUNC, BtfKind::Func) {
        Ok(id) => id,
        Err(_) => {
            return (
                Object::Borrowed(object),
                Err(format!("the kernel has no {KFUNC} kfunc (Linux 6.5)")),
            )
        }
    };
    let mut copy = Aligned::new(object);
    match rewrite_calls(copy.bytes_mut(), PLACEHOLDER, id) {
        0 => (
            Object::Borrowed(object),
            Err(format!("the object calls no {KFUNC} placeholder")),
        ),
        _ => (Object::Owned(copy), Ok(btf)),
    }
}

/// An object to load, rewritten or not.
pub(crate) enum Object<'a> {
    Borrowed(&'a [u8]),
    Owned(Aligned),
}

impl Object<'_> {
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            Object::Borrowed(b) => b,
            Object::Owned(a) => a.bytes(),
        }
    }
}

/// Loads the iterator of `ebpf` (the verifier runs here), or says why it cannot be.
pub(crate) fn load_iterator(ebpf: &mut aya::Ebpf, btf: &Btf) -> Result<(), String> {
    let prog: &mut Iter = ebpf
        .program_mut(ITERATOR)
        .ok_or_else(|| format!("the object has no {ITERATOR}"))?
        .try_into()
        .map_err(|e| format!("{ITERATOR}: {e}"))?;
    prog.load("udp", btf)
        .map_err(|e| format!("{ITERATOR}: {e}"))
}

impl SocketLb {
    /// Whether stale UDP sockets can be destroyed; if not, why (a kernel before 6.5).
    pub fn stale_udp_support(&self) -> Result<(), &str> {
        self.stale_udp.as_ref().map(|_| ()).map_err(String::as_str)
    }

    /// Destroys the connected UDP sockets in `namespaces` (network namespace files) that the
    /// hooks sent to a backend of one of `pairs` for its frontend, and returns a pair for each
    /// socket destroyed. `kp_stale` holds `pairs` only while this runs.
    pub fn destroy_stale_udp(
        &mut self,
        pairs: &[StaleUdp],
        namespaces: Vec<File>,
    ) -> Result<Vec<StaleUdp>, Error> {
        if let Err(why) = &self.stale_udp {
            return Err(Error::StaleUdp(why.clone()));
        }
        let err = |source| Error::Map { name: MAP, source };
        let mut map = self.map::<STALE_UDP_SIZE, 1>(MAP)?;
        let mut written = Vec::with_capacity(pairs.len());
        let mut result = Ok(Vec::new());
        for pair in pairs {
            match map.insert(pair.to_bytes(), [1], 0) {
                Ok(()) => written.push(pair.to_bytes()),
                Err(e) => {
                    result = Err(err(e));
                    break;
                }
            }
        }
        if result.is_ok() {
            result = self.run_iterator(namespaces);
        }
        let mut map = self.map::<STALE_UDP_SIZE, 1>(MAP)?;
        for key in &written {
            // Gone already is fine; anything else leaves an entry the next run overwrites.
            let _ = map.remove(key);
        }
        result
    }

    /// Reads the iterator once in each of `namespaces`.
    fn run_iterator(&mut self, namespaces: Vec<File>) -> Result<Vec<StaleUdp>, Error> {
        let prog: &mut Iter = self
            .ebpf
            .program_mut(ITERATOR)
            .ok_or(Error::Missing(ITERATOR))?
            .try_into()
            .map_err(|source| Error::Program {
                name: ITERATOR,
                source,
            })?;
        let mut destroyed = Vec::new();
        for ns in namespaces {
            let program_error = |source| Error::Program {
                name: ITERATOR,
                source,
            };
            let id = prog.attach().map_err(program_error)?;
            let link = prog.take_link(id).map_err(program_error)?;
            // The iterator takes the namespace of the thread that opens it (BPF_ITER_CREATE).
            let read = kp_netlink::netns::run_in_file(ns, "kp-stale-udp", move || {
                let mut file = link.into_file().map_err(|e| e.to_string())?;
                let mut out = Vec::new();
                file.read_to_end(&mut out).map_err(|e| e.to_string())?;
                Ok::<_, String>(out)
            });
            let out = match read {
                Ok(Ok(out)) => out,
                Ok(Err(e)) => return Err(Error::StaleUdp(e)),
                Err(e) => return Err(Error::StaleUdp(e.to_string())),
            };
            destroyed.extend(
                out.chunks_exact(STALE_UDP_SIZE)
                    .filter_map(StaleUdp::from_bytes),
            );
        }
        Ok(destroyed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_placeholder_calls_become_kfunc_calls_and_nothing_else_changes() {
        let call = |imm: u32| {
            let mut i = [CALL, 0, 0, 0, 0, 0, 0, 0];
            i[4..].copy_from_slice(&imm.to_le_bytes());
            i
        };
        // A helper call, the placeholder twice, and the placeholder's bytes off the grid.
        let mut object: Vec<u8> = [call(46), call(PLACEHOLDER), call(PLACEHOLDER)].concat();
        object.extend([0u8; 4]);
        object.extend(call(PLACEHOLDER));
        object.extend([0u8; 4]);
        let before = object.clone();
        assert_eq!(rewrite_calls(&mut object, PLACEHOLDER, 0x1234), 2);
        let kfunc = [CALL, 0x20, 0, 0, 0x34, 0x12, 0, 0];
        assert_eq!(&object[..8], &before[..8]);
        assert_eq!(&object[8..16], &kfunc);
        assert_eq!(&object[16..24], &kfunc);
        assert_eq!(&object[24..], &before[24..]);
    }

    #[test]
    fn the_built_object_calls_the_placeholder() {
        let mut object = crate::SOCK_OBJECT.to_vec();
        assert!(rewrite_calls(&mut object, PLACEHOLDER, 1) >= 1);
        let aligned = Aligned::new(crate::SOCK_OBJECT);
        assert_eq!(aligned.bytes(), crate::SOCK_OBJECT);
        assert_eq!(aligned.bytes().as_ptr().align_offset(8), 0);
    }
}
