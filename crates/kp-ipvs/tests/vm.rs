//! The client against a real IPVS kernel: Debian's kernel booted under qemu by `kp-vm` (this
//! machine's kernel has no IPVS). Inside the guest, in network namespaces the script creates, a
//! load balancer namespace gets a virtual service through `kp-ipvsctl` (this crate's client),
//! two real-server namespaces run kp-echo, and a client namespace connects through the virtual
//! address. Marked "needs root" like every kernel test (see kp-vm).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use kp_netlink::ipvs::{Destination, DestinationState, Service, ServiceKey};
use kp_vm::Vm;

fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(a, b, c, d))
}

/// The script's sections: the lines after each `== NAME` line.
fn sections(output: &str) -> BTreeMap<String, Vec<String>> {
    let mut all = BTreeMap::new();
    let mut current = String::from("preamble");
    for line in output.lines() {
        if let Some(name) = line.strip_prefix("== ") {
            current = name.trim().to_string();
            all.entry(current.clone()).or_insert_with(Vec::new);
        } else {
            all.entry(current.clone())
                .or_insert_with(Vec::new)
                .push(line.to_string());
        }
    }
    all
}

/// Lines with runs of blanks made one space, sorted: `ipvsadm -Ln` pads its columns.
fn normalized(lines: &[String]) -> Vec<String> {
    let mut v: Vec<String> = lines
        .iter()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|l| !l.is_empty())
        .collect();
    v.sort();
    v
}

#[test]
#[ignore = "needs root"]
fn a_round_robin_service_with_two_real_servers_reads_back_as_sent_and_carries_tcp() {
    if !kp_test::netns::require_root() {
        return;
    }
    let ctl = env!("CARGO_BIN_EXE_kp-ipvsctl");
    let echo = kp_test::echo::echo_binary();
    let echo = echo.display();
    // lb: the IPVS host, VIP 10.96.0.10 on a dummy link (as kube-ipvs0), forwarding on.
    // client 10.0.0.2 -- 10.0.0.1 lb 10.0.1.1 -- 10.0.1.2 rs1, lb 10.0.2.1 -- 10.0.2.2 rs2.
    let script = format!(
        r#"set -e
for ns in lb client rs1 rs2; do ip netns add kpvm-$ns; ip -n kpvm-$ns link set lo up; done
ip -n kpvm-lb link add kube-ipvs0 type dummy
ip -n kpvm-lb addr add 10.96.0.10/32 dev kube-ipvs0
ip -n kpvm-lb link set kube-ipvs0 up
ip netns exec kpvm-lb sh -c 'echo 1 > /proc/sys/net/ipv4/ip_forward'
link() {{ # peer namespace, lb address, peer address
    ip -n kpvm-lb link add to-$1 type veth peer name eth0 netns kpvm-$1
    ip -n kpvm-lb addr add $2/24 dev to-$1
    ip -n kpvm-lb link set to-$1 up
    ip -n kpvm-$1 addr add $3/24 dev eth0
    ip -n kpvm-$1 link set eth0 up
    ip -n kpvm-$1 route add default via $2
}}
link client 10.0.0.1 10.0.0.2
link rs1 10.0.1.1 10.0.1.2
link rs2 10.0.2.1 10.0.2.2
for rs in rs1 rs2; do
    ip netns exec kpvm-$rs {echo} serve --name $rs --tcp 8080 > /tmp/$rs.log 2>&1 &
done
for rs in rs1 rs2; do
    i=0; until grep -q ready /tmp/$rs.log; do i=$((i+1)); [ $i -lt 200 ] || {{ cat /tmp/$rs.log; exit 1; }}; sleep 0.1; done
done
ctl() {{ {ctl} --netns kpvm-lb "$@"; }}
ctl add-service tcp 10.96.0.10:80 rr
ctl add-dest tcp 10.96.0.10:80 10.0.1.2:8080 1
ctl add-dest tcp 10.96.0.10:80 10.0.2.2:8080 1
echo "== dump"
ctl dump
echo "== list"
ctl list
echo "== ipvsadm"
ip netns exec kpvm-lb ipvsadm -Ln | tail -n +4
echo "== refusals"
ctl add-service tcp 10.96.0.10:80 rr 2>&1 || echo "exit $?"
ctl del-dest tcp 10.96.0.10:80 10.0.9.9:8080 2>&1 || echo "exit $?"
ctl del-service tcp 10.96.0.11:80 2>&1 || echo "exit $?"
echo "== requests"
ip netns exec kpvm-client {echo} request tcp 10.96.0.10 80 --count 6 --timeout-ms 3000
echo "== after"
ctl del-dest tcp 10.96.0.10:80 10.0.1.2:8080
ctl dump
ctl flush
echo "== flushed"
ctl dump
"#
    );
    let vm = Vm::new().expect("qemu, the kernel and busybox are installed");
    let run = vm.run(&script).expect("the guest runs the script");
    eprintln!(
        "boot to script {:?}, total {:?}\n{}",
        run.boot, run.total, run.output
    );
    assert!(run.success(), "exit {}:\n{}", run.status, run.output);
    let s = sections(&run.output);

    // What was sent, read back field for field (destinations in either order).
    let key = ServiceKey::Addr {
        addr: v4(10, 96, 0, 10),
        protocol: kp_ipvs::IpvsProtocol::Tcp,
        port: 80,
    };
    let idle = |addr| DestinationState {
        destination: Destination::masquerade(addr, 8080, 1),
        active_connections: 0,
        inactive_connections: 0,
        persistent_connections: 0,
    };
    let want = normalized(&[
        format!("{:?}", Service::new(key, "rr")),
        format!("{:?}", idle(v4(10, 0, 1, 2))),
        format!("{:?}", idle(v4(10, 0, 2, 2))),
    ]);
    assert_eq!(normalized(&s["dump"]), want);

    // ipvsadm, reading the kernel on its own, sees the same.
    assert_eq!(normalized(&s["list"]), normalized(&s["ipvsadm"]));
    assert_eq!(s["list"].len(), 3, "{:?}", s["list"]);

    // Refusals carry the kernel's errno.
    let refusals = s["refusals"].join("\n");
    assert!(
        refusals.contains("add service TCP 10.96.0.10:80: EEXIST"),
        "{refusals}"
    );
    assert!(
        refusals.contains("delete destination 10.0.9.9:8080 of TCP 10.96.0.10:80: ENOENT"),
        "{refusals}"
    );
    assert!(
        refusals.contains("delete service TCP 10.96.0.11:80: ESRCH"),
        "{refusals}"
    );
    assert_eq!(refusals.matches("exit 1").count(), 3, "{refusals}");

    // Round robin over two real servers, each seeing the client's own address (NAT, no SNAT).
    let answers = &s["requests"];
    assert_eq!(answers.len(), 6, "{answers:?}");
    for rs in ["rs1", "rs2"] {
        let n = answers
            .iter()
            .filter(|l| *l == &format!("{rs} 10.0.0.2"))
            .count();
        assert_eq!(n, 3, "{rs} answered {n} of 6: {answers:?}");
    }

    // The deleted destination is gone; the other kept its connections' counts; flush empties.
    let after = &s["after"];
    assert_eq!(after.len(), 2, "{after:?}");
    assert!(
        after[1].contains("10.0.2.2") && !after.join("").contains("10.0.1.2"),
        "{after:?}"
    );
    assert!(s["flushed"].is_empty(), "{:?}", s["flushed"]);
}

#[test]
#[ignore = "needs root"]
fn a_kernel_without_the_ipvs_module_is_unavailable_until_it_is_loaded() {
    if !kp_test::netns::require_root() {
        return;
    }
    let ctl = env!("CARGO_BIN_EXE_kp-ipvsctl");
    // No module loaded at boot, and the kernel's own loader disabled, so asking for the family
    // does not load ip_vs behind our back.
    let script = format!(
        r#"echo /bin/false > /proc/sys/kernel/modprobe
ip netns add kpvm-bare
echo "== before"
{ctl} --netns kpvm-bare info 2>&1; echo "exit $?"
modprobe ip_vs
echo "== after"
{ctl} --netns kpvm-bare info 2>&1; echo "exit $?"
"#
    );
    let vm = Vm::new()
        .expect("qemu, the kernel and busybox are installed")
        .modules(&[]);
    let run = vm.run(&script).expect("the guest runs the script");
    assert!(run.success(), "exit {}:\n{}", run.status, run.output);
    let s = sections(&run.output);
    assert_eq!(
        s["before"],
        [
            "kp-ipvsctl: IPVS is not available in netns kpvm-bare: the kernel has no generic netlink family IPVS (module ip_vs missing)",
            "exit 1"
        ],
        "{}",
        run.output
    );
    assert_eq!(
        s["after"],
        ["IP Virtual Server version 1.2.1 (size=4096)", "exit 0"],
        "{}",
        run.output
    );
}
