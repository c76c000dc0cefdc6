/* The maps the programs share with kube-proxy-rs. The byte layout is kp-ebpf-plan's
 * (crates/kp-ebpf-plan/src/layout.rs); change both together. Every address is 16 bytes, IPv4
 * ones IPv4-mapped (::ffff:a.b.c.d), so one map serves both families. Ports are in network
 * byte order; ids, slots and counts in the host's. */
#ifndef KP_MAPS_H
#define KP_MAPS_H

#include <linux/types.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

/* services: {frontend, slot} -> slot 0: backend count; slot n: backend id. */
struct kp_svc_key {
	__u32 addr[4];
	__be16 port;
	__u16 slot;
	__u8 proto;
	__u8 pad[3];
};

struct kp_svc_val {
	__u32 backend_id;
	__u16 count;
	__u16 rev_nat;
};

struct kp_backend {
	__u32 addr[4];
	__be16 port;
	__u8 proto;
	__u8 pad;
};

struct kp_rev_nat {
	__u32 addr[4];
	__be16 port;
	__u16 pad;
};

/* What a socket was sent to instead of a frontend: the key recvmsg and getpeername look up
 * to give the frontend back. */
struct kp_sk_key {
	__u64 cookie;
	__u32 addr[4];
	__be16 port;
	__u16 pad;
	__u32 pad2;
};

struct kp_sk_val {
	__u32 addr[4];
	__be16 port;
	__u16 rev_nat;
};

/* Sizes here are defaults; the loader sets them from the configuration. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct kp_svc_key);
	__type(value, struct kp_svc_val);
} kp_services SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, struct kp_backend);
} kp_backends SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u16);
	__type(value, struct kp_rev_nat);
} kp_rev_nat SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 262144);
	__type(key, struct kp_sk_key);
	__type(value, struct kp_sk_val);
} kp_sk_rev SEC(".maps");

#endif
