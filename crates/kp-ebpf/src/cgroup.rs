//! Finding the cgroup v2 hierarchy to attach the socket hooks to: its root, so every process
//! on the node (and in its pods) is covered. `/sys/fs/cgroup` on a unified-only host,
//! `/sys/fs/cgroup/unified` on a hybrid one (the development machines); a flag overrides it.
//! And the network namespaces of the processes under it ([`network_namespaces`]).

use std::collections::HashSet;
use std::fs::File;
use std::io::ErrorKind;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The mount point of the cgroup v2 hierarchy's root in `mountinfo` (`/proc/self/mountinfo`'s
/// text); `None` when none is mounted. A cgroup v2 mount of a sub-tree (a container's view) is
/// not the root and is skipped.
pub fn cgroup2_root(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (mount, fs) = line.split_once(" - ")?;
        if fs.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        let fields: Vec<&str> = mount.split_whitespace().collect();
        let (root, point) = (fields.get(3)?, fields.get(4)?);
        (*root == "/").then(|| PathBuf::from(unescape(point)))
    })
}

/// Reads this process's mount table and returns [`cgroup2_root`] of it.
pub fn find_cgroup2_root() -> std::io::Result<Option<PathBuf>> {
    Ok(cgroup2_root(&std::fs::read_to_string(
        "/proc/self/mountinfo",
    )?))
}

/// The network namespaces of the processes in cgroup `dir` and every cgroup below it, one open
/// file each (a `/proc/PID/ns/net`; holding it keeps the namespace while it is used). The
/// socket hooks attached at `dir` serve exactly these processes, so their sockets live in these
/// namespaces. A process that exits meanwhile is skipped; so is a cgroup removed meanwhile.
pub fn network_namespaces(dir: &Path) -> std::io::Result<Vec<File>> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    let root = dir;
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let procs = match std::fs::read_to_string(dir.join("cgroup.procs")) {
            Ok(text) => text,
            Err(e) if e.kind() == ErrorKind::NotFound && dir != root => continue,
            Err(e) => return Err(e),
        };
        for pid in procs.split_whitespace() {
            let Ok(ns) = File::open(format!("/proc/{pid}/ns/net")) else {
                continue;
            };
            let Ok(meta) = ns.metadata() else {
                continue;
            };
            if seen.insert((meta.dev(), meta.ino())) {
                out.push(ns);
            }
        }
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == ErrorKind::NotFound && dir != root => continue,
            Err(e) => return Err(e),
        };
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                dirs.push(entry.path());
            }
        }
    }
    Ok(out)
}

/// mountinfo writes space, tab, newline and backslash in a path as `\ooo` octal.
fn unescape(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| bytes[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)))
            .and_then(|d| u8::from_str_radix(std::str::from_utf8(d).ok()?, 8).ok());
        match octal {
            Some(b) => {
                out.push(b);
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hybrid_host_has_its_cgroup2_root_under_unified() {
        let text = "\
30 24 0:26 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid shared:10 - cgroup2 cgroup2 rw,nsdelegate
32 30 0:28 / /sys/fs/cgroup/systemd rw shared:11 - cgroup cgroup rw,name=systemd
";
        assert_eq!(
            cgroup2_root(text),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
    }

    #[test]
    fn a_sub_tree_mount_is_not_the_root_and_escaped_paths_are_read() {
        let text = "\
40 30 0:27 /kubepods/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw
41 30 0:27 / /run/my\\040cgroup rw - cgroup2 cgroup2 rw
";
        assert_eq!(cgroup2_root(text), Some(PathBuf::from("/run/my cgroup")));
        assert_eq!(cgroup2_root("1 0 0:1 / / rw - ext4 /dev/vda rw\n"), None);
    }
}
