//! The guest's `/init` (busybox `sh`, PID 1) and the order of the modules it loads.

use std::collections::BTreeSet;

/// Printed (at the start of a line) when a set-up step fails, with the step after it.
pub(crate) const SETUP_FAILED: &str = "KP-VM-SETUP-FAILED";
/// Printed alone on a line just before the script starts.
pub(crate) const READY: &str = "KP-VM-READY";
/// Printed with the script's exit status after it ends.
pub(crate) const EXIT: &str = "KP-VM-EXIT ";

/// The kernel's module loader (`/proc/sys/kernel/modprobe`): the host's `modprobe`, run in the
/// guest's root, so that modules the kernel asks for (an nf_tables expression, a scheduler)
/// load too.
pub(crate) const MODPROBE: &str =
    "#!/bin/busybox sh\nexec /bin/busybox chroot /newroot /sbin/modprobe \"$@\"\n";

/// The modules to load so that each of `roots` loads, dependencies first, each once.
/// `depends` gives a module's direct dependencies (`modinfo -F depends`).
pub fn load_order<E>(
    roots: &[&str],
    mut depends: impl FnMut(&str) -> Result<Vec<String>, E>,
) -> Result<Vec<String>, E> {
    fn visit<E>(
        m: &str,
        depends: &mut impl FnMut(&str) -> Result<Vec<String>, E>,
        seen: &mut BTreeSet<String>,
        order: &mut Vec<String>,
    ) -> Result<(), E> {
        // Marked before its dependencies are visited: a cycle (which modinfo never reports)
        // cannot recurse for ever.
        if !seen.insert(m.to_string()) {
            return Ok(());
        }
        for d in depends(m)? {
            visit(&d, depends, seen, order)?;
        }
        order.push(m.to_string());
        Ok(())
    }
    let mut seen = BTreeSet::new();
    let mut order = Vec::new();
    for m in roots {
        visit(m, &mut depends, &mut seen, &mut order)?;
    }
    Ok(order)
}

/// `/init`: mounts, boot modules (`/modules/NAME.ko`, in order), the host's root over 9p, a
/// tmpfs root with `binds` (top-level host directories, read-only) and `links` (name, target),
/// the kernel's modprobe helper, `modules` loaded with modprobe, then `/script.sh`, its exit
/// status, and power-off.
pub(crate) fn script(
    boot_modules: &[String],
    binds: &[String],
    links: &[(String, String)],
    modules: &[String],
) -> String {
    let mut s = String::from(
        r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
fail() { echo "KP-VM-SETUP-FAILED $*"; poweroff -f; sleep 60; }
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
"#,
    );
    for m in boot_modules {
        s += &format!("insmod /modules/{m} || fail insmod {m}\n");
    }
    s += "mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=262144 hostroot /host || fail mount 9p\n";
    s += "mount -t tmpfs -o mode=0755 newroot /newroot || fail mount tmpfs root\n";
    // The guest's own file systems first, so that a bind below /tmp (a workspace there) lands
    // on the fresh tmpfs, not under it.
    s += r#"cd /newroot
mkdir -p proc sys dev tmp run
mount -t proc proc proc || fail guest proc
mount -t sysfs sysfs sys || fail guest sysfs
mount -t cgroup2 cgroup2 sys/fs/cgroup || fail guest cgroup2
mount -t devtmpfs devtmpfs dev || fail guest dev
mount -t tmpfs -o mode=1777 tmp tmp || fail guest tmp
mount -t tmpfs -o mode=0755 run run || fail guest run
cd /
"#;
    for d in binds {
        let (host, guest) = (
            quote(&format!("/host/{d}")),
            quote(&format!("/newroot/{d}")),
        );
        s += &format!("mkdir -p {guest} && mount --bind {host} {guest} || fail bind {d}\n");
    }
    for (name, target) in links {
        s += &format!(
            "ln -s {} {}\n",
            quote(target),
            quote(&format!("/newroot/{name}"))
        );
    }
    s += "echo /sbin/kp-modprobe > /proc/sys/kernel/modprobe\n";
    s += "cp /script.sh /newroot/run/kp-vm-script.sh\n";
    if !modules.is_empty() {
        // One modprobe for all (each start reads the module indexes over 9p); on a failure,
        // one at a time to name the module.
        let all = modules.join(" ");
        s += &format!(
            "chroot /newroot /sbin/modprobe -a {all} || for m in {all}; do chroot /newroot /sbin/modprobe $m || fail modprobe $m; done\n"
        );
    }
    s += &format!(
        r#"echo "kp-vm: ready after $(cut -d' ' -f1 /proc/uptime) s of guest uptime"
echo {READY}
chroot /newroot /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root KP_VM_GUEST=1 /bin/sh -c 'cd / && exec /bin/sh /run/kp-vm-script.sh' 2>&1
rc=$?
printf '\n{EXIT}%d\n' "$rc"
poweroff -f
sleep 60
"#
    );
    s
}

/// `s` as one word for `sh`: single-quoted, a quote inside written `'\''`.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn deps(table: &[(&str, &[&str])]) -> BTreeMap<String, Vec<String>> {
        table
            .iter()
            .map(|(m, d)| (m.to_string(), d.iter().map(|s| s.to_string()).collect()))
            .collect()
    }

    #[test]
    fn every_module_comes_after_its_dependencies_and_only_once() {
        // The 9p stack of Debian's 6.1 kernel, as modinfo reports it.
        let table = deps(&[
            (
                "virtio_pci",
                &[
                    "virtio_ring",
                    "virtio_pci_modern_dev",
                    "virtio_pci_legacy_dev",
                    "virtio",
                ],
            ),
            ("9pnet_virtio", &["virtio", "9pnet", "virtio_ring"]),
            ("9p", &["9pnet", "fscache", "netfs"]),
            ("fscache", &["netfs"]),
            ("virtio", &["virtio_ring"]),
        ]);
        let order = load_order::<()>(&["virtio_pci", "9pnet_virtio", "9p"], |m| {
            Ok(table.get(m).cloned().unwrap_or_default())
        })
        .unwrap();
        let at = |m: &str| order.iter().position(|o| o == m).unwrap();
        for (m, ds) in &table {
            for d in ds {
                assert!(at(d) < at(m), "{d} must load before {m}: {order:?}");
            }
        }
        let unique: BTreeSet<_> = order.iter().collect();
        assert_eq!(unique.len(), order.len(), "{order:?}");
        assert_eq!(order.len(), 10, "{order:?}");
    }

    #[test]
    fn a_module_modinfo_cannot_describe_stops_the_order_with_its_error() {
        let r = load_order(&["ip_vs"], |m| match m {
            "ip_vs" => Ok(vec!["nf_conntrack".to_string()]),
            other => Err(format!("no module {other}")),
        });
        assert_eq!(r, Err("no module nf_conntrack".to_string()));
    }
}
