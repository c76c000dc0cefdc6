/* Socket-level load balancing: cgroup v2 hooks that send a connection (or a UDP datagram) to
 * a Service frontend straight to a backend before any packet exists, and give the frontend
 * back to the application wherever it asks whom it talks to.
 *
 *   connect4/6   rewrite the destination of connect(); TCP, and UDP sockets that connect
 *   sendmsg4/6   rewrite the destination of an unconnected UDP sendmsg()
 *   recvmsg4/6   rewrite the source a UDP recvmsg() reports back to the frontend
 *   getpeername4/6  rewrite getpeername() back to the frontend
 *
 * What upstream rejects (a Service without endpoints, a ClusterIP on a port no Service uses)
 * fails the call with ECONNREFUSED, as a reset or an ICMP port unreachable would; what upstream
 * drops (a Local policy with no endpoint on this node, an address of a Service CIDR no Service
 * holds) fails it with ETIMEDOUT, what the client of a dropped connection sees in the end.
 * Both through bpf_set_retval (Linux 5.18). Built with -DKP_NO_SET_RETVAL for older kernels,
 * where both are EPERM; the rest needs Linux 5.8 (getpeername hooks). Written for clang
 * -target bpf. */

#include "maps.h"
#include <linux/in.h>
#include <bpf/bpf_endian.h>

#define SYS_REJECT 0
#define SYS_PROCEED 1

#define KP_ECONNREFUSED 111
#define KP_ETIMEDOUT 110

/* What a hook does with a call it does not let through. */
enum verdict {
	PASS,   /* no frontend: untouched */
	REJECT, /* ECONNREFUSED */
	DROP,   /* ETIMEDOUT */
};

static __always_inline int refuse(enum verdict v)
{
#ifndef KP_NO_SET_RETVAL
	bpf_set_retval(v == DROP ? -KP_ETIMEDOUT : -KP_ECONNREFUSED);
#endif
	return SYS_REJECT;
}

static __always_inline void v4_mapped(__u32 *addr, __u32 ip4)
{
	addr[0] = 0;
	addr[1] = 0;
	addr[2] = bpf_htonl(0x0000ffff);
	addr[3] = ip4;
}

static __always_inline int is_v4_mapped(const __u32 *addr)
{
	return addr[0] == 0 && addr[1] == 0 && addr[2] == bpf_htonl(0x0000ffff);
}

/* What no frontend matched: a ClusterIP's other ports reject, a Service CIDR drops. */
static __always_inline enum verdict unmatched(const __u32 *addr)
{
	struct kp_addr_key key;
	__u8 *v;

	key.prefixlen = 128;
	key.addr[0] = addr[0];
	key.addr[1] = addr[1];
	key.addr[2] = addr[2];
	key.addr[3] = addr[3];
	v = bpf_map_lookup_elem(&kp_addrs, &key);
	if (!v)
		return PASS;
	if (*v == KP_ADDR_REJECT)
		return REJECT;
	if (*v == KP_ADDR_DROP)
		return DROP;
	return PASS;
}

/* The programs' hash of a client: four words, each mixed in with MurmurHash3's 32-bit
 * finalizer. kp-ebpf-plan's layout.rs client_hash is the same function (the tracer and tests
 * predict the pick with it). */
#define KP_HASH_SEED 0x9e3779b9

static __always_inline __u32 mix32(__u32 h)
{
	h ^= h >> 16;
	h *= 0x85ebca6b;
	h ^= h >> 13;
	h *= 0xc2b2ae35;
	h ^= h >> 16;
	return h;
}

static __always_inline __u32 client_hash(__u32 w0, __u32 w1, __u32 w2, __u32 w3)
{
	__u32 h = KP_HASH_SEED;

	h = mix32(h ^ w0);
	h = mix32(h ^ w1);
	h = mix32(h ^ w2);
	h = mix32(h ^ w3);
	return h;
}

/* The slot the Maglev table of frontend `rev_nat` gives a client of hash `hash`, or 0: no
 * table, or a slot beyond `count` (a backend was added and its count is not written yet). */
static __always_inline __u16 maglev_slot(__u16 rev_nat, __u32 hash, __u16 count)
{
	struct kp_maglev_val *t;
	__u16 key = rev_nat;
	__u32 i = hash % KP_MAGLEV_M;
	__u16 n;

	t = bpf_map_lookup_elem(&kp_maglev, &key);
	if (!t)
		return 0;
	/* The verifier does not bound a modulo; keep clang from folding away the check that
	 * does. */
	asm volatile("" : "+r"(i));
	if (i >= KP_MAGLEV_M)
		return 0;
	n = t->slots[i];
	return n <= count ? n : 0;
}

/* The backend this client was last given, while its affinity lasts and the backend still holds
 * the slot it was given in: `aff` is its key in `map`, kp_affinity (the socket hooks: the
 * client's network namespace) or kp_affinity_out (the tc path: its address). `key` is the
 * frontend's slot-0 key, `svc` its value. Returns the slot, or 0. */
static __always_inline __u16 sticky(void *map, struct kp_svc_key *key,
				    const struct kp_svc_val *svc, const void *aff, __u64 now)
{
	struct kp_aff_val *a;
	struct kp_svc_val *slot;

	a = bpf_map_lookup_elem(map, aff);
	if (!a || a->slot == 0 || a->slot > svc->count)
		return 0;
	if (now - a->last_ns > (__u64)svc->affinity * 1000000000ULL)
		return 0;
	key->slot = a->slot;
	slot = bpf_map_lookup_elem(&kp_services, key);
	if (!slot || slot->backend_id != a->backend_id)
		return 0;
	return a->slot;
}

/* Looks the frontend up and picks a backend: the affinity one, else the Maglev table's for the
 * client's network namespace (KP_SVC_MAGLEV: a pod always gets the same backend), else at
 * random. Returns NULL with *verdict PASS when the address is no frontend, REJECT or DROP when
 * it is refused. */
static __always_inline struct kp_backend *pick(void *ctx, struct kp_svc_key *key, __u16 *rev_nat,
					       enum verdict *verdict)
{
	struct kp_svc_val *svc;
	struct kp_svc_val *slot;
	struct kp_backend *be;
	struct kp_aff_key aff;
	struct kp_aff_val chosen;
	__u64 now = 0;
	__u64 netns = 0;
	__u16 n = 0;

	*verdict = REJECT;
	key->slot = 0;
	svc = bpf_map_lookup_elem(&kp_services, key);
	if (!svc) {
		*verdict = unmatched(key->addr);
		return NULL;
	}
	*rev_nat = svc->rev_nat;
	if (svc->count == 0) {
		*verdict = (svc->flags & KP_SVC_DROP_EMPTY) ? DROP : REJECT;
		return NULL;
	}
	if (svc->affinity || (svc->flags & KP_SVC_MAGLEV))
		netns = bpf_get_netns_cookie(ctx);
	if (svc->affinity) {
		__builtin_memset(&aff, 0, sizeof(aff));
		aff.netns = netns;
		aff.rev_nat = svc->rev_nat;
		now = bpf_ktime_get_ns();
		n = sticky(&kp_affinity, key, svc, &aff, now);
	}
	if (n == 0 && (svc->flags & KP_SVC_MAGLEV))
		n = maglev_slot(svc->rev_nat, client_hash((__u32)netns, (__u32)(netns >> 32), 0, 0),
				svc->count);
	if (n == 0)
		n = (bpf_get_prandom_u32() % svc->count) + 1;
	key->slot = n;
	slot = bpf_map_lookup_elem(&kp_services, key);
	key->slot = 0;
	if (!slot)
		return NULL;
	be = bpf_map_lookup_elem(&kp_backends, &slot->backend_id);
	if (be && svc->affinity) {
		__builtin_memset(&chosen, 0, sizeof(chosen));
		chosen.backend_id = slot->backend_id;
		chosen.slot = n;
		chosen.last_ns = now;
		bpf_map_update_elem(&kp_affinity, &aff, &chosen, BPF_ANY);
	}
	return be;
}

static __always_inline void remember(void *ctx, const struct kp_backend *be,
				     const struct kp_svc_key *frontend, __u16 rev_nat)
{
	struct kp_sk_key sk;
	struct kp_sk_val val;

	__builtin_memset(&sk, 0, sizeof(sk));
	__builtin_memset(&val, 0, sizeof(val));
	sk.cookie = bpf_get_socket_cookie(ctx);
	__builtin_memcpy(sk.addr, be->addr, sizeof(sk.addr));
	sk.port = be->port;
	__builtin_memcpy(val.addr, frontend->addr, sizeof(val.addr));
	val.port = frontend->port;
	val.rev_nat = rev_nat;
	bpf_map_update_elem(&kp_sk_rev, &sk, &val, BPF_ANY);
}

static __always_inline int lb4(struct bpf_sock_addr *ctx)
{
	struct kp_svc_key key;
	struct kp_backend *be;
	__u16 rev_nat = 0;
	enum verdict verdict;

	__builtin_memset(&key, 0, sizeof(key));
	v4_mapped(key.addr, ctx->user_ip4);
	key.port = (__be16)ctx->user_port;
	key.proto = ctx->protocol;
	be = pick(ctx, &key, &rev_nat, &verdict);
	if (!be)
		return verdict == PASS ? SYS_PROCEED : refuse(verdict);
	if (!is_v4_mapped(be->addr))
		return refuse(REJECT);
	remember(ctx, be, &key, rev_nat);
	ctx->user_ip4 = be->addr[3];
	ctx->user_port = (__u32)be->port;
	return SYS_PROCEED;
}

static __always_inline int lb6(struct bpf_sock_addr *ctx)
{
	struct kp_svc_key key;
	struct kp_backend *be;
	__u16 rev_nat = 0;
	enum verdict verdict;

	__builtin_memset(&key, 0, sizeof(key));
	key.addr[0] = ctx->user_ip6[0];
	key.addr[1] = ctx->user_ip6[1];
	key.addr[2] = ctx->user_ip6[2];
	key.addr[3] = ctx->user_ip6[3];
	key.port = (__be16)ctx->user_port;
	key.proto = ctx->protocol;
	be = pick(ctx, &key, &rev_nat, &verdict);
	if (!be)
		return verdict == PASS ? SYS_PROCEED : refuse(verdict);
	/* A v4-mapped frontend on an IPv6 socket gets a v4-mapped backend; a native IPv6 one an
	 * IPv6 backend: the planner never mixes families within a frontend. */
	remember(ctx, be, &key, rev_nat);
	ctx->user_ip6[0] = be->addr[0];
	ctx->user_ip6[1] = be->addr[1];
	ctx->user_ip6[2] = be->addr[2];
	ctx->user_ip6[3] = be->addr[3];
	ctx->user_port = (__u32)be->port;
	return SYS_PROCEED;
}

/* Gives the frontend back for a peer address the socket was sent to. Only when the frontend
 * still exists (its reverse-NAT entry), so a deleted Service's backend shows as itself. */
static __always_inline struct kp_sk_val *restore(struct bpf_sock_addr *ctx, const __u32 *addr)
{
	struct kp_sk_key sk;
	struct kp_sk_val *val;
	struct kp_rev_nat *rn;
	__u16 id;

	__builtin_memset(&sk, 0, sizeof(sk));
	sk.cookie = bpf_get_socket_cookie(ctx);
	sk.addr[0] = addr[0];
	sk.addr[1] = addr[1];
	sk.addr[2] = addr[2];
	sk.addr[3] = addr[3];
	sk.port = (__be16)ctx->user_port;
	val = bpf_map_lookup_elem(&kp_sk_rev, &sk);
	if (!val)
		return NULL;
	id = val->rev_nat;
	rn = bpf_map_lookup_elem(&kp_rev_nat, &id);
	if (!rn || rn->port != val->port || rn->addr[0] != val->addr[0] || rn->addr[1] != val->addr[1] ||
	    rn->addr[2] != val->addr[2] || rn->addr[3] != val->addr[3])
		return NULL;
	return val;
}

static __always_inline int restore4(struct bpf_sock_addr *ctx)
{
	__u32 addr[4];
	struct kp_sk_val *val;

	v4_mapped(addr, ctx->user_ip4);
	val = restore(ctx, addr);
	if (val) {
		ctx->user_ip4 = val->addr[3];
		ctx->user_port = (__u32)val->port;
	}
	return SYS_PROCEED;
}

static __always_inline int restore6(struct bpf_sock_addr *ctx)
{
	__u32 addr[4];
	struct kp_sk_val *val;

	addr[0] = ctx->user_ip6[0];
	addr[1] = ctx->user_ip6[1];
	addr[2] = ctx->user_ip6[2];
	addr[3] = ctx->user_ip6[3];
	val = restore(ctx, addr);
	if (val) {
		ctx->user_ip6[0] = val->addr[0];
		ctx->user_ip6[1] = val->addr[1];
		ctx->user_ip6[2] = val->addr[2];
		ctx->user_ip6[3] = val->addr[3];
		ctx->user_port = (__u32)val->port;
	}
	return SYS_PROCEED;
}

SEC("cgroup/connect4")
int kp_connect4(struct bpf_sock_addr *ctx) { return lb4(ctx); }

SEC("cgroup/connect6")
int kp_connect6(struct bpf_sock_addr *ctx) { return lb6(ctx); }

SEC("cgroup/sendmsg4")
int kp_sendmsg4(struct bpf_sock_addr *ctx) { return lb4(ctx); }

SEC("cgroup/sendmsg6")
int kp_sendmsg6(struct bpf_sock_addr *ctx) { return lb6(ctx); }

SEC("cgroup/recvmsg4")
int kp_recvmsg4(struct bpf_sock_addr *ctx) { return restore4(ctx); }

SEC("cgroup/recvmsg6")
int kp_recvmsg6(struct bpf_sock_addr *ctx) { return restore6(ctx); }

SEC("cgroup/getpeername4")
int kp_getpeername4(struct bpf_sock_addr *ctx) { return restore4(ctx); }

SEC("cgroup/getpeername6")
int kp_getpeername6(struct bpf_sock_addr *ctx) { return restore6(ctx); }

/* The tc path, in the same object so that it shares these maps. */
#include "tc.c"

/* The stale UDP socket iterator, in the same object for kp_sk_rev. */
#include "udp_destroy.c"

char _license[] SEC("license") = "Dual BSD/GPL";
