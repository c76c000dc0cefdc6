/* Socket-level load balancing: cgroup v2 hooks that send a connection (or a UDP datagram) to
 * a Service frontend straight to a backend before any packet exists, and give the frontend
 * back to the application wherever it asks whom it talks to.
 *
 *   connect4/6   rewrite the destination of connect(); TCP, and UDP sockets that connect
 *   sendmsg4/6   rewrite the destination of an unconnected UDP sendmsg()
 *   recvmsg4/6   rewrite the source a UDP recvmsg() reports back to the frontend
 *   getpeername4/6  rewrite getpeername() back to the frontend
 *
 * A frontend found with no backends refuses: the hook returns 0 and the call fails with
 * EPERM. Needs Linux 5.8 (getpeername hooks); written for clang -target bpf. */

#include "maps.h"
#include <linux/in.h>
#include <bpf/bpf_endian.h>

#define SYS_REJECT 0
#define SYS_PROCEED 1

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

/* Looks the frontend up and picks a backend at random. Returns NULL when the address is no
 * frontend; sets *reject when it is one without a usable backend. */
static __always_inline struct kp_backend *pick(struct kp_svc_key *key, __u16 *rev_nat, int *reject)
{
	struct kp_svc_val *svc;
	struct kp_svc_val *slot;
	struct kp_backend *be;

	*reject = 0;
	key->slot = 0;
	svc = bpf_map_lookup_elem(&kp_services, key);
	if (!svc)
		return NULL;
	*rev_nat = svc->rev_nat;
	if (svc->count == 0) {
		*reject = 1;
		return NULL;
	}
	key->slot = (bpf_get_prandom_u32() % svc->count) + 1;
	slot = bpf_map_lookup_elem(&kp_services, key);
	if (!slot) {
		*reject = 1;
		return NULL;
	}
	be = bpf_map_lookup_elem(&kp_backends, &slot->backend_id);
	if (!be)
		*reject = 1;
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
	int reject;

	__builtin_memset(&key, 0, sizeof(key));
	v4_mapped(key.addr, ctx->user_ip4);
	key.port = (__be16)ctx->user_port;
	key.proto = ctx->protocol;
	be = pick(&key, &rev_nat, &reject);
	if (!be)
		return reject ? SYS_REJECT : SYS_PROCEED;
	if (!is_v4_mapped(be->addr))
		return SYS_REJECT;
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
	int reject;

	__builtin_memset(&key, 0, sizeof(key));
	key.addr[0] = ctx->user_ip6[0];
	key.addr[1] = ctx->user_ip6[1];
	key.addr[2] = ctx->user_ip6[2];
	key.addr[3] = ctx->user_ip6[3];
	key.port = (__be16)ctx->user_port;
	key.proto = ctx->protocol;
	be = pick(&key, &rev_nat, &reject);
	if (!be)
		return reject ? SYS_REJECT : SYS_PROCEED;
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

char _license[] SEC("license") = "Dual BSD/GPL";
