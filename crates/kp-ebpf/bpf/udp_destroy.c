/* Stale UDP sockets: a socket iterator (iter/udp, Linux 5.9) that destroys the connected UDP
 * sockets the socket hooks sent to a backend a frontend no longer has, so that a client holding
 * one (a DNS resolver's long-lived socket) sees an error at its next call and makes a new one,
 * which the connect hook sends to a live backend. Without this, its datagrams would go on to
 * the gone pod for good: a connected socket's sends name no address, so no hook runs for them.
 *
 * kube-proxy-rs fills kp_stale with the {frontend, backend} pairs a sync removed, then reads
 * the iterator once in each network namespace the cgroup's processes live in (an iterator walks
 * the UDP table of the namespace it is opened in). A socket is destroyed when its peer is a
 * stale pair's backend and kp_sk_rev says the hooks sent it there for that pair's frontend;
 * each destroyed socket writes its pair to the iterator's output.
 *
 * bpf_sock_destroy is a kfunc (Linux 6.5). The loader (aya 0.14) does not resolve kfunc calls,
 * so the call is compiled as a call of helper KP_KFUNC_SOCK_DESTROY, which kube-proxy-rs
 * rewrites into a kfunc call of the running kernel's bpf_sock_destroy (its BTF id) before the
 * object is loaded (src/stale_udp.rs). A kernel without it does not load this program; the
 * rest of the object never calls it. Included by sock.c, whose maps it shares. */

#include <linux/in6.h>

#define KP_KFUNC_SOCK_DESTROY 0x4b50d001

static long (*const kp_sock_destroy)(void *sk) = (void *)KP_KFUNC_SOCK_DESTROY;

/* The kernel's types, as far as they are read here; CO-RE relocates each field to the running
 * kernel's offset (preserve_access_index). */
struct seq_file;

struct bpf_iter_meta {
	struct seq_file *seq;
} __attribute__((preserve_access_index));

struct sock_common {
	__be32 skc_daddr;
	__be16 skc_dport;
	unsigned short skc_family;
	volatile unsigned char skc_state;
	struct in6_addr skc_v6_daddr;
} __attribute__((preserve_access_index));

struct udp_sock;

struct bpf_iter__udp {
	struct bpf_iter_meta *meta;
	struct udp_sock *udp_sk;
} __attribute__((preserve_access_index));

/* A connected UDP socket's state (TCP_ESTABLISHED). */
#define KP_SK_CONNECTED 1

#define KP_AF_INET 2
#define KP_AF_INET6 10

/* kp_stale: a frontend and a backend it no longer has (layout.rs StaleUdp). */
struct kp_stale_key {
	__u32 frontend[4];
	__u32 backend[4];
	__be16 frontend_port;
	__be16 backend_port;
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct kp_stale_key);
	__type(value, __u8);
} kp_stale SEC(".maps");

SEC("iter/udp")
int kp_udp_destroy(struct bpf_iter__udp *ctx)
{
	struct sock_common *sk = (struct sock_common *)ctx->udp_sk;
	struct kp_stale_key stale;
	struct kp_sk_key key;
	struct kp_sk_val *sent;

	if (!sk || sk->skc_state != KP_SK_CONNECTED)
		return 0;
	__builtin_memset(&key, 0, sizeof(key));
	if (sk->skc_family == KP_AF_INET) {
		v4_mapped(key.addr, sk->skc_daddr);
	} else if (sk->skc_family == KP_AF_INET6) {
		key.addr[0] = sk->skc_v6_daddr.in6_u.u6_addr32[0];
		key.addr[1] = sk->skc_v6_daddr.in6_u.u6_addr32[1];
		key.addr[2] = sk->skc_v6_daddr.in6_u.u6_addr32[2];
		key.addr[3] = sk->skc_v6_daddr.in6_u.u6_addr32[3];
	} else {
		return 0;
	}
	key.port = sk->skc_dport;
	key.cookie = bpf_get_socket_cookie(sk);
	sent = bpf_map_lookup_elem(&kp_sk_rev, &key);
	if (!sent)
		return 0;
	__builtin_memset(&stale, 0, sizeof(stale));
	__builtin_memcpy(stale.frontend, sent->addr, sizeof(stale.frontend));
	__builtin_memcpy(stale.backend, key.addr, sizeof(stale.backend));
	stale.frontend_port = sent->port;
	stale.backend_port = key.port;
	if (!bpf_map_lookup_elem(&kp_stale, &stale))
		return 0;
	if (kp_sock_destroy(sk) == 0)
		bpf_seq_write(ctx->meta->seq, &stale, sizeof(stale));
	return 0;
}
