/* The maps the programs share with kube-proxy-rs. The byte layout is kp-ebpf-plan's
 * (crates/kp-ebpf-plan/src/layout.rs); change both together. Every address is 16 bytes, IPv4
 * ones IPv4-mapped (::ffff:a.b.c.d), so one map serves both families. Ports are in network
 * byte order; ids, slots and counts in the host's. */
#ifndef KP_MAPS_H
#define KP_MAPS_H

#include <linux/types.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

/* services: {frontend, slot} -> slot 0: backend count, affinity timeout and flags; slot n:
 * backend id. */
struct kp_svc_key {
	__u32 addr[4];
	__be16 port;
	__u16 slot;
	__u8 proto;
	__u8 scope; /* KP_SCOPE_* */
	__u8 pad[2];
};

/* kp_svc_key.scope: the entry the socket hooks use (and the tc path when there is no outside
 * one), or the one the tc path uses for traffic from outside the node: a frontend whose
 * outside clients get other backends (externalTrafficPolicy Local: the local ones) or are
 * checked against source ranges. */
#define KP_SCOPE_SOCKET 0
#define KP_SCOPE_OUTSIDE 1

/* kp_svc_val.flags (slot 0): what a frontend without backends does. Set: drop (a Local policy
 * with endpoints elsewhere only); clear: reject (no endpoint at all). */
#define KP_SVC_DROP_EMPTY 0x1
/* From outside (tc): keep the client's address (externalTrafficPolicy Local); clear:
 * masquerade. */
#define KP_SVC_KEEP_SOURCE 0x2
/* From outside (tc): only sources in kp_src_ranges under the frontend's rev_nat. */
#define KP_SVC_SRC_RANGES 0x4
/* A new connection's slot is the one kp_maglev (under the frontend's rev_nat) gives the
 * client's hash (the sh and mh schedulers); clear, or without a table: a random slot. */
#define KP_SVC_MAGLEV 0x8

struct kp_svc_val {
	__u32 backend_id;
	__u16 count;
	__u16 rev_nat;
	__u32 affinity; /* slot 0: ClientIP affinity timeout in seconds; 0: none */
	__u8 flags;     /* slot 0: KP_SVC_* */
	__u8 pad[3];
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

/* Addresses no frontend matched: a ClusterIP (/128, mapped for IPv4) refuses every other port
 * and protocol; a Service CIDR drops what no Service holds. Longest prefix wins. */
#define KP_ADDR_REJECT 1
#define KP_ADDR_DROP 2

struct kp_addr_key {
	__u32 prefixlen;
	__u32 addr[4];
};

/* ClientIP affinity for sockets: the client is the socket's network namespace (one per pod;
 * the node's own is one more), as an address is not known before connect. */
struct kp_aff_key {
	__u64 netns;
	__u16 rev_nat;
	__u16 pad[3];
};

/* ClientIP affinity from outside the node (the tc path): the client is the source address
 * its packets arrive with (IPv4-mapped), as upstream keys it. A map of its own: the socket
 * hooks' key has no room for an address, and a pinned kp_affinity keeps its key size. */
struct kp_aff_out_key {
	__u32 addr[4];
	__u16 rev_nat;
	__u16 pad;
};

/* Both affinity maps' value: the backend and the slot it was given in, and when the client
 * last opened a connection to the frontend. */
struct kp_aff_val {
	__u32 backend_id;
	__u16 slot;
	__u16 pad;
	__u64 last_ns;
};

/* A frontend's Maglev lookup table: for each of KP_MAGLEV_M entries (a prime), a slot of the
 * frontend (1..count). The planner fills it from its backends' names (kp-ebpf-plan's maglev.rs);
 * a client is given entry client_hash % KP_MAGLEV_M. layout.rs MAGLEV_M is the same number. */
#define KP_MAGLEV_M 991

struct kp_maglev_val {
	__u16 slots[KP_MAGLEV_M];
};

/* loadBalancerSourceRanges: {rev_nat, source prefix}; prefixlen counts the 32 bits of rev_nat
 * and pad, then the 16-byte (IPv4-mapped) address. */
struct kp_range_key {
	__u32 prefixlen;
	__u16 rev_nat;
	__u16 pad;
	__u32 addr[4];
};

/* The tc path's connection table. A forward entry is keyed by the client's tuple as it arrives
 * ({client, frontend}); a reply entry by the backend's reply ({backend, the source the backend
 * saw}). Both say what to rewrite the packet to: src:sport -> dst:dport. */
#define KP_CT_FORWARD 0
#define KP_CT_REPLY 1

struct kp_ct_key {
	__u32 src[4];
	__u32 dst[4];
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 dir; /* KP_CT_* */
	__u8 pad[2];
};

struct kp_ct_val {
	__u32 src[4];
	__u32 dst[4];
	__be16 sport;
	__be16 dport;
	__u16 rev_nat;
	/* When the entry was last used: bpf_ktime_get_ns() >> 30 (units of 2^30 ns, about a
	 * second), wrapping. Another mode taking over keeps the tc path attached until no entry
	 * has been used for a while (its connections ended). */
	__u16 seen;
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

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct kp_addr_key);
	__type(value, __u8);
} kp_addrs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 262144);
	__type(key, struct kp_aff_key);
	__type(value, struct kp_aff_val);
} kp_affinity SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct kp_aff_out_key);
	__type(value, struct kp_aff_val);
} kp_affinity_out SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 16384);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct kp_range_key);
	__type(value, __u8);
} kp_src_ranges SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 262144);
	__type(key, struct kp_ct_key);
	__type(value, struct kp_ct_val);
} kp_ct SEC(".maps");

/* rev_nat -> the frontend's Maglev table; only frontends flagged KP_SVC_MAGLEV have one, so
 * entries are allocated as they come (2 KiB each with the element's header). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65535);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u16);
	__type(value, struct kp_maglev_val);
} kp_maglev SEC(".maps");

#endif
