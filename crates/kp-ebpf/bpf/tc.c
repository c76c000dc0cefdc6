/* The tc path: traffic that arrives from outside the node (NodePorts on the node's addresses,
 * external IPs, LoadBalancer IPs, ClusterIPs routed to the node) meets no socket hook, so it is
 * translated per packet by cls_bpf programs in direct-action mode (tcx on Linux 6.6+):
 *
 *   kp_tc_outside  on the interfaces outside traffic arrives on (the node's uplinks): replies
 *                  first (below), then a packet to a frontend is sent to a backend;
 *   kp_tc_reply    on every other interface (pod veths, node-to-node links): replies only.
 *
 * A new connection to a frontend looks up its outside scope entry first (a LoadBalancer with
 * source ranges, an externalTrafficPolicy Local frontend: local endpoints only, the client's
 * address kept), then the shared socket scope entry (everything else: masqueraded). Source
 * ranges are checked in kp_src_ranges (a miss drops). A backend is picked at random (with the
 * KP_SVC_MAGLEV flag: the slot the entry's Maglev table gives the source address's hash), or with
 * ClientIP affinity (the entry's timeout) the one the client's address was last given by that
 * entry (kp_affinity_out, keyed by {source address, the entry's rev_nat}) while the client
 * comes back within the timeout and the backend holds its slot still; the choice is written to
 * kp_ct twice: the client's tuple, so the flow's later packets follow it (a new TCP SYN picks
 * again), and the backend's reply tuple, so replies are given the frontend back. Only a SYN
 * starts a TCP connection here: a later packet of one kp_ct does not hold (netfilter's, from
 * before the mode started) goes to the stack untouched. A later packet of one it holds follows
 * it even once its frontend is gone (as conntrack keeps an established flow after its Service
 * goes): so when another mode takes over, which empties kp_services and kp_addrs and leaves
 * these programs attached, new connections reach that mode's rules and the ones made here go
 * on to their backends; a SYN on one of their tuples, or a SYN-ACK answering on one (the new
 * mode masqueraded its own connection to the same port), is the new mode's and ends both
 * entries. Each use stamps the entry (`seen`), which tells that mode when they ended.
 * Masquerading takes the address the
 * kernel would send from towards the backend (bpf_fib_lookup with BPF_FIB_LOOKUP_SRC) and
 * keeps the client's port unless another connection holds it (then a random one of
 * 32768-60999).
 *
 * Translated packets are sent on with bpf_redirect_neigh to the interface the FIB names: the
 * stack would refuse a packet arriving with one of the node's own addresses as its source
 * (a masqueraded request, or a reply given back the NodePort's address).
 *
 * Not done here: a frontend that upstream rejects (no endpoints, a ClusterIP's unknown port)
 * is dropped, as no TCP reset or ICMP error is built; the TTL is not decremented. Needs Linux
 * 6.8 (BPF_FIB_LOOKUP_SRC). */

#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <stddef.h>

#define KP_AF_INET 2
#define KP_AF_INET6 10
#define KP_IPPROTO_TCP 6
#define KP_IPPROTO_UDP 17

struct kp_pkt {
	__u32 src[4];
	__u32 dst[4];
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 v6;
	__u8 syn;
	__u8 synack;
	__u8 tos;
	__u32 l3_off;
	__u32 l4_off;
	__u32 len;
};

static __always_inline int parse(struct __sk_buff *skb, struct kp_pkt *p)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	__be16 ports[2];
	__u8 flags;

	if ((void *)(eth + 1) > end)
		return -1;
	p->l3_off = sizeof(*eth);
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);

		if ((void *)(ip + 1) > end || ip->ihl < 5)
			return -1;
		/* Fragments carry no ports to look up. */
		if (ip->frag_off & bpf_htons(0x3fff))
			return -1;
		p->v6 = 0;
		v4_mapped(p->src, ip->saddr);
		v4_mapped(p->dst, ip->daddr);
		p->proto = ip->protocol;
		p->tos = ip->tos;
		p->len = bpf_ntohs(ip->tot_len);
		p->l4_off = p->l3_off + ip->ihl * 4;
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);

		if ((void *)(ip6 + 1) > end)
			return -1;
		p->v6 = 1;
		__builtin_memcpy(p->src, &ip6->saddr, 16);
		__builtin_memcpy(p->dst, &ip6->daddr, 16);
		/* No extension headers: what follows must be TCP or UDP. */
		p->proto = ip6->nexthdr;
		p->tos = 0;
		p->len = bpf_ntohs(ip6->payload_len);
		p->l4_off = p->l3_off + sizeof(*ip6);
	} else {
		return -1;
	}
	if (p->proto != KP_IPPROTO_TCP && p->proto != KP_IPPROTO_UDP)
		return -1;
	if (bpf_skb_load_bytes(skb, p->l4_off, ports, sizeof(ports)) < 0)
		return -1;
	p->sport = ports[0];
	p->dport = ports[1];
	p->syn = 0;
	p->synack = 0;
	if (p->proto == KP_IPPROTO_TCP) {
		if (bpf_skb_load_bytes(skb, p->l4_off + 13, &flags, 1) < 0)
			return -1;
		/* SYN without ACK: a new connection; SYN with ACK: its answer. */
		p->syn = (flags & 0x12) == 0x02;
		p->synack = (flags & 0x12) == 0x12;
	}
	return 0;
}

static __always_inline int same_addr(const __u32 *a, const __u32 *b)
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3];
}

/* Rewrites the packet's addresses and ports to src:sport -> dst:dport, fixing the IPv4 header
 * checksum and the TCP/UDP checksum (its pseudo header included). */
static __always_inline int rewrite(struct __sk_buff *skb, const struct kp_pkt *p, const __u32 *src,
				   __be16 sport, const __u32 *dst, __be16 dport)
{
	__u32 csum = p->l4_off + (p->proto == KP_IPPROTO_TCP ? 16 : 6);
	__u64 mangled = p->proto == KP_IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;
	__u32 old[4], new[4];
	__s64 diff;

	if (!p->v6) {
		__u32 l3 = p->l3_off + offsetof(struct iphdr, check);
		__be32 o, n;

		o = p->src[3];
		n = src[3];
		if (o != n) {
			if (bpf_l4_csum_replace(skb, csum, o, n, BPF_F_PSEUDO_HDR | 4 | mangled) ||
			    bpf_l3_csum_replace(skb, l3, o, n, 4) ||
			    bpf_skb_store_bytes(skb, p->l3_off + offsetof(struct iphdr, saddr), &n, 4, 0))
				return -1;
		}
		o = p->dst[3];
		n = dst[3];
		if (o != n) {
			if (bpf_l4_csum_replace(skb, csum, o, n, BPF_F_PSEUDO_HDR | 4 | mangled) ||
			    bpf_l3_csum_replace(skb, l3, o, n, 4) ||
			    bpf_skb_store_bytes(skb, p->l3_off + offsetof(struct iphdr, daddr), &n, 4, 0))
				return -1;
		}
	} else {
		if (!same_addr(p->src, src)) {
			__builtin_memcpy(old, p->src, 16);
			__builtin_memcpy(new, src, 16);
			diff = bpf_csum_diff(old, 16, new, 16, 0);
			if (bpf_l4_csum_replace(skb, csum, 0, diff, BPF_F_PSEUDO_HDR | mangled) ||
			    bpf_skb_store_bytes(skb, p->l3_off + offsetof(struct ipv6hdr, saddr), new, 16, 0))
				return -1;
		}
		if (!same_addr(p->dst, dst)) {
			__builtin_memcpy(old, p->dst, 16);
			__builtin_memcpy(new, dst, 16);
			diff = bpf_csum_diff(old, 16, new, 16, 0);
			if (bpf_l4_csum_replace(skb, csum, 0, diff, BPF_F_PSEUDO_HDR | mangled) ||
			    bpf_skb_store_bytes(skb, p->l3_off + offsetof(struct ipv6hdr, daddr), new, 16, 0))
				return -1;
		}
	}
	if (p->sport != sport) {
		if (bpf_l4_csum_replace(skb, csum, p->sport, sport, 2 | mangled) ||
		    bpf_skb_store_bytes(skb, p->l4_off, &sport, 2, 0))
			return -1;
	}
	if (p->dport != dport) {
		if (bpf_l4_csum_replace(skb, csum, p->dport, dport, 2 | mangled) ||
		    bpf_skb_store_bytes(skb, p->l4_off + 2, &dport, 2, 0))
			return -1;
	}
	return 0;
}

/* The FIB's route from src towards dst: the interface, and with want_src the address the node
 * sends from on it. Returns 0 on success. */
static __always_inline int route(struct __sk_buff *skb, const struct kp_pkt *p, const __u32 *src,
				 const __u32 *dst, __u32 *ifindex, __u32 *out_src, int want_src)
{
	struct bpf_fib_lookup fib;
	__u32 flags = BPF_FIB_LOOKUP_SKIP_NEIGH | (want_src ? BPF_FIB_LOOKUP_SRC : 0);
	long rc;

	__builtin_memset(&fib, 0, sizeof(fib));
	fib.ifindex = skb->ingress_ifindex;
	fib.l4_protocol = p->proto;
	fib.tot_len = p->len;
	if (!p->v6) {
		fib.family = KP_AF_INET;
		fib.tos = p->tos;
		fib.ipv4_src = src[3];
		fib.ipv4_dst = dst[3];
	} else {
		fib.family = KP_AF_INET6;
		__builtin_memcpy(fib.ipv6_src, src, 16);
		__builtin_memcpy(fib.ipv6_dst, dst, 16);
	}
	rc = bpf_fib_lookup(skb, &fib, sizeof(fib), flags);
	if (rc != BPF_FIB_LKUP_RET_SUCCESS)
		return -1;
	*ifindex = fib.ifindex;
	if (want_src) {
		if (!p->v6)
			v4_mapped(out_src, fib.ipv4_src);
		else
			__builtin_memcpy(out_src, fib.ipv6_src, 16);
	}
	return 0;
}

/* Rewrites the packet as `t` says and sends it out of the interface the FIB gives for its new
 * destination. */
static __always_inline int translate(struct __sk_buff *skb, const struct kp_pkt *p,
				     const struct kp_ct_val *t)
{
	__u32 ifindex = 0;
	__u32 unused[4];

	if (route(skb, p, t->src, t->dst, &ifindex, unused, 0) < 0)
		return TC_ACT_SHOT;
	if (rewrite(skb, p, t->src, t->sport, t->dst, t->dport) < 0)
		return TC_ACT_SHOT;
	return bpf_redirect_neigh(ifindex, NULL, 0, 0);
}

/* The clock of kp_ct's `seen`: units of 2^30 ns (about a second), wrapping at 16 bits. */
static __always_inline __u16 ct_clock(void)
{
	return bpf_ktime_get_ns() >> 30;
}

/* Stamps a connection-table entry as used now (written only when the stamp moves). */
static __always_inline void ct_touch(struct kp_ct_val *v)
{
	__u16 now = ct_clock();

	if (v->seen != now)
		v->seen = now;
}

static __always_inline void ct_key(struct kp_ct_key *k, const __u32 *src, __be16 sport,
				   const __u32 *dst, __be16 dport, __u8 proto, __u8 dir)
{
	__builtin_memset(k, 0, sizeof(*k));
	__builtin_memcpy(k->src, src, 16);
	__builtin_memcpy(k->dst, dst, 16);
	k->sport = sport;
	k->dport = dport;
	k->proto = proto;
	k->dir = dir;
}

/* The frontend addr:port as the tc path looks it up: its outside scope entry where it has one,
 * else its socket scope entry; NULL when there is neither. `key` is left naming the entry
 * found (slot 0), for the caller's slot lookups. */
static __always_inline struct kp_svc_val *frontend(struct kp_svc_key *key, const __u32 *addr,
						   __be16 port, __u8 proto)
{
	struct kp_svc_val *svc;

	__builtin_memset(key, 0, sizeof(*key));
	__builtin_memcpy(key->addr, addr, 16);
	key->port = port;
	key->proto = proto;
	key->scope = KP_SCOPE_OUTSIDE;
	svc = bpf_map_lookup_elem(&kp_services, key);
	if (!svc) {
		key->scope = KP_SCOPE_SOCKET;
		svc = bpf_map_lookup_elem(&kp_services, key);
	}
	return svc;
}

/* A reply of a translated connection: given the frontend back. Returns -1 when the packet is
 * none. */
static __always_inline int reply(struct __sk_buff *skb, const struct kp_pkt *p)
{
	struct kp_ct_key k;
	struct kp_ct_key fk;
	struct kp_svc_key svc;
	struct kp_ct_val *v;
	struct kp_ct_val t;

	ct_key(&k, p->src, p->sport, p->dst, p->dport, p->proto, KP_CT_REPLY);
	v = bpf_map_lookup_elem(&kp_ct, &k);
	if (!v)
		return -1;
	t = *v;
	if (p->synack) {
		/* A handshake's answer on the tuple of a connection this path made, whose frontend
		 * is gone (another mode took over): no SYN can have been sent on from here for it,
		 * so it answers the stack's new connection, masqueraded by the mode that took over
		 * to the same port. Both entries go and the packet is the stack's (given the old
		 * frontend back, the new connection would be reset). */
		if (!frontend(&svc, t.src, t.sport, p->proto)) {
			ct_key(&fk, t.dst, t.dport, t.src, t.sport, p->proto, KP_CT_FORWARD);
			bpf_map_delete_elem(&kp_ct, &fk);
			bpf_map_delete_elem(&kp_ct, &k);
			return TC_ACT_OK;
		}
	}
	ct_touch(v);
	return translate(skb, p, &t);
}

/* Writes the reply entry of a new connection (backend -> the source the backend sees), taking
 * another source port when that tuple belongs to another connection. Returns -1 when no port
 * is free. */
static __always_inline int claim(struct kp_ct_val *fwd, const struct kp_pkt *p, __u16 rev_nat,
				 int masquerade)
{
	struct kp_ct_key k;
	struct kp_ct_val back;
	struct kp_ct_val *held;
	int i;

	__builtin_memset(&back, 0, sizeof(back));
	__builtin_memcpy(back.src, p->dst, 16);
	back.sport = p->dport;
	__builtin_memcpy(back.dst, p->src, 16);
	back.dport = p->sport;
	back.rev_nat = rev_nat;
	back.seen = ct_clock();
	for (i = 0; i < 8; i++) {
		ct_key(&k, fwd->dst, fwd->dport, fwd->src, fwd->sport, p->proto, KP_CT_REPLY);
		held = bpf_map_lookup_elem(&kp_ct, &k);
		if (!held || (same_addr(held->dst, p->src) && held->dport == p->sport)) {
			bpf_map_update_elem(&kp_ct, &k, &back, BPF_ANY);
			return 0;
		}
		/* Without masquerading the tuple is the client's own: a stale entry. */
		if (!masquerade) {
			bpf_map_update_elem(&kp_ct, &k, &back, BPF_ANY);
			return 0;
		}
		fwd->sport = bpf_htons(32768 + bpf_get_prandom_u32() % 28232);
	}
	return -1;
}

/* Whether `src` may reach the frontend with reverse-NAT id `rev_nat` (its source ranges). */
static __always_inline int in_ranges(__u16 rev_nat, const __u32 *src)
{
	struct kp_range_key k;

	__builtin_memset(&k, 0, sizeof(k));
	k.prefixlen = 32 + 128;
	k.rev_nat = rev_nat;
	__builtin_memcpy(k.addr, src, 16);
	return bpf_map_lookup_elem(&kp_src_ranges, &k) != NULL;
}

static __always_inline int outside(struct __sk_buff *skb)
{
	struct kp_pkt p;
	struct kp_svc_key key;
	struct kp_svc_val *svc;
	struct kp_svc_val *slot;
	struct kp_backend *be;
	struct kp_ct_key k;
	struct kp_ct_val *held;
	struct kp_ct_val fwd;
	struct kp_aff_out_key aff;
	struct kp_aff_val chosen;
	__u64 now = 0;
	__u32 ifindex = 0, affinity, backend_id;
	__u16 rev_nat, n = 0;
	int masquerade, rc;

	__builtin_memset(&p, 0, sizeof(p));
	if (parse(skb, &p) < 0)
		return TC_ACT_OK;
	rc = reply(skb, &p);
	if (rc >= 0)
		return rc;

	svc = frontend(&key, p.dst, p.dport, p.proto);
	/* A later packet of a connection this path made: to its backend while the frontend is
	 * the same, or gone (see the top). */
	ct_key(&k, p.src, p.sport, p.dst, p.dport, p.proto, KP_CT_FORWARD);
	held = bpf_map_lookup_elem(&kp_ct, &k);
	if (held && !p.syn && (!svc || held->rev_nat == svc->rev_nat)) {
		ct_touch(held);
		fwd = *held;
		return translate(skb, &p, &fwd);
	}
	if (held && !svc) {
		/* A new connection on the tuple of one this path made, whose frontend is gone: it is
		 * the stack's (the mode that took over) now. Both entries go, so its later packets and
		 * its replies are not taken for the old connection's. */
		struct kp_ct_key rk;

		fwd = *held;
		ct_key(&rk, fwd.dst, fwd.dport, fwd.src, fwd.sport, p.proto, KP_CT_REPLY);
		bpf_map_delete_elem(&kp_ct, &rk);
		bpf_map_delete_elem(&kp_ct, &k);
	}
	if (!svc)
		/* A ClusterIP's other ports and a Service CIDR's free addresses: dropped (no reject
		 * is built here). */
		return unmatched(p.dst) == PASS ? TC_ACT_OK : TC_ACT_SHOT;
	rev_nat = svc->rev_nat;
	if ((svc->flags & KP_SVC_SRC_RANGES) && !in_ranges(rev_nat, p.src))
		return TC_ACT_SHOT;
	masquerade = !(svc->flags & KP_SVC_KEEP_SOURCE);

	/* A TCP packet that opens nothing (no SYN) of a connection this path did not make: one that
	 * netfilter translated before the mode started (conntrack still holds it, and the mode keeps
	 * conntrack and the NAT hooks on), or one the stack resets. Left to the stack, so a switch
	 * to this mode keeps the old mode's connections. */
	if (p.proto == KP_IPPROTO_TCP && !p.syn)
		return TC_ACT_OK;
	if (svc->count == 0)
		return TC_ACT_SHOT;
	/* ClientIP affinity: the client's address sticks to the backend it was last given from
	 * this entry (its rev_nat: the outside entry's own where there is one) while it comes back
	 * within the timeout and that backend still holds its slot. */
	affinity = svc->affinity;
	__builtin_memset(&aff, 0, sizeof(aff));
	if (affinity) {
		__builtin_memcpy(aff.addr, p.src, 16);
		aff.rev_nat = rev_nat;
		now = bpf_ktime_get_ns();
		n = sticky(&kp_affinity_out, &key, svc, &aff, now);
	}
	/* sh/mh: the slot the frontend's Maglev table gives the client's address (as IPVS sh
	 * hashes the source address). */
	if (n == 0 && (svc->flags & KP_SVC_MAGLEV))
		n = maglev_slot(rev_nat, client_hash(p.src[0], p.src[1], p.src[2], p.src[3]),
				svc->count);
	if (n == 0)
		n = (bpf_get_prandom_u32() % svc->count) + 1;
	key.slot = n;
	slot = bpf_map_lookup_elem(&kp_services, &key);
	if (!slot)
		return TC_ACT_SHOT;
	backend_id = slot->backend_id;
	be = bpf_map_lookup_elem(&kp_backends, &backend_id);
	if (!be)
		return TC_ACT_SHOT;
	__builtin_memset(&fwd, 0, sizeof(fwd));
	__builtin_memcpy(fwd.dst, be->addr, 16);
	fwd.dport = be->port;
	fwd.sport = p.sport;
	fwd.rev_nat = rev_nat;
	fwd.seen = ct_clock();
	if (masquerade) {
		if (route(skb, &p, p.src, fwd.dst, &ifindex, fwd.src, 1) < 0)
			return TC_ACT_SHOT;
	} else {
		__builtin_memcpy(fwd.src, p.src, 16);
	}
	if (claim(&fwd, &p, rev_nat, masquerade) < 0)
		return TC_ACT_SHOT;
	if (affinity) {
		/* The choice, and this connection as the client's last use. */
		__builtin_memset(&chosen, 0, sizeof(chosen));
		chosen.backend_id = backend_id;
		chosen.slot = n;
		chosen.last_ns = now;
		bpf_map_update_elem(&kp_affinity_out, &aff, &chosen, BPF_ANY);
	}
	bpf_map_update_elem(&kp_ct, &k, &fwd, BPF_ANY);
	return translate(skb, &p, &fwd);
}

static __always_inline int replies_only(struct __sk_buff *skb)
{
	struct kp_pkt p;
	int rc;

	__builtin_memset(&p, 0, sizeof(p));
	if (parse(skb, &p) < 0)
		return TC_ACT_OK;
	rc = reply(skb, &p);
	return rc >= 0 ? rc : TC_ACT_OK;
}

SEC("classifier")
int kp_tc_outside(struct __sk_buff *skb) { return outside(skb); }

SEC("classifier")
int kp_tc_reply(struct __sk_buff *skb) { return replies_only(skb); }
