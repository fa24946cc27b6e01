/*
 * fd_icmp_ping: ICMP echo ("ping") sockets, SOCK_DGRAM over IPPROTO_ICMP and
 * IPPROTO_ICMPV6, with echo replies waiting in their queues.
 *
 * Sets up P4, bound to 127.0.0.1 with identifier 0x4f52, connected to
 * 127.0.0.1, IP_TTL 33 and IP_RECVTTL: three echo requests sent, the first
 * reply read, two queued.  P6, never bound (its identifier chosen by the
 * kernel at its first send), one echo request to ::1, its reply queued.  Q,
 * an IPv4 ping socket never used.
 * Verifies: the names (identifiers) and the connected address (from
 * /proc/self/net/icmp) are the same; the queued replies come back whole, in
 * order, from their sources; an IP_TTL cmsg still comes with them; each
 * socket still answers a new echo request with its identifier; options.
 *
 * Needs the program's group in net.ipv4.ping_group_range (the engine suite
 * widens this machine's to root's group, and `ferry cluster up` gives separate
 * nodes this machine's range); otherwise it fails at setup saying so.
 */
#include "ferry_test.h"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/ip_icmp.h>
#include <netinet/icmp6.h>
#include <sys/socket.h>

#define ID4 0x4f52

static int ping_socket(int domain, int proto)
{
	int s = socket(domain, SOCK_DGRAM, proto);
	if (s < 0)
		ferry_die("socket(%s ping): %s (is the group %d in net.ipv4.ping_group_range?)",
			  domain == AF_INET ? "IPv4" : "IPv6", strerror(errno), (int)getgid());
	return s;
}

/* An echo request with sequence `seq` and payload "echo <seq>". */
static size_t echo(unsigned char *b, int v6, int seq)
{
	memset(b, 0, 8);
	b[0] = v6 ? ICMP6_ECHO_REQUEST : ICMP_ECHO;
	b[6] = seq >> 8;
	b[7] = seq & 0xff;
	return 8 + sprintf((char *)b + 8, "echo %d", seq);
}

/* Waits up to 2 s for something to read on `s`. */
static int wait_in(int s)
{
	for (int i = 0; i < 400; i++) {
		char c;
		if (recv(s, &c, 1, MSG_PEEK | MSG_DONTWAIT | MSG_TRUNC) >= 0)
			return 1;
		ferry_sleep_ms(5);
	}
	return 0;
}

/* Reads one reply and checks it is the reply to `seq`, from loopback, for identifier `id`. */
static void check_reply(const char *what, int s, int v6, int id, int seq, int want_ttl)
{
	unsigned char b[128], c[256];
	struct sockaddr_in6 f;
	struct iovec iov = { b, sizeof b };
	struct msghdr m = { .msg_name = &f, .msg_namelen = sizeof f, .msg_iov = &iov, .msg_iovlen = 1,
			    .msg_control = c, .msg_controllen = sizeof c };
	memset(&f, 0, sizeof f);
	if (!wait_in(s)) {
		ferry_fail("%s: no reply %d within 2 s", what, seq);
		return;
	}
	ssize_t n = recvmsg(s, &m, MSG_DONTWAIT);
	unsigned char want[64];
	size_t wn = echo(want, v6, seq);
	want[0] = v6 ? ICMP6_ECHO_REPLY : ICMP_ECHOREPLY;
	FERRY_CHECK(n == (ssize_t)wn, "%s: reply %d is %zd bytes, expected %zu", what, seq, n, wn);
	if (n < 8)
		return;
	FERRY_CHECK(b[0] == want[0], "%s: reply %d has type %d", what, seq, b[0]);
	FERRY_CHECK_EQ("reply identifier", id, (b[4] << 8) | b[5]);
	FERRY_CHECK_EQ("reply sequence", seq, (b[6] << 8) | b[7]);
	FERRY_CHECK(memcmp(b + 8, want + 8, wn - 8) == 0, "%s: reply %d's payload differs", what, seq);
	if (v6) {
		FERRY_CHECK(f.sin6_family == AF_INET6 && IN6_IS_ADDR_LOOPBACK(&f.sin6_addr),
			    "%s: reply %d is not from ::1", what, seq);
	} else {
		struct sockaddr_in *f4 = (struct sockaddr_in *)&f;
		FERRY_CHECK(f4->sin_family == AF_INET && f4->sin_addr.s_addr == htonl(INADDR_LOOPBACK),
			    "%s: reply %d is from %s", what, seq, inet_ntoa(f4->sin_addr));
	}
	if (want_ttl) {
		int ttl = -1;
		for (struct cmsghdr *h = CMSG_FIRSTHDR(&m); h; h = CMSG_NXTHDR(&m, h))
			if (h->cmsg_level == IPPROTO_IP && h->cmsg_type == IP_TTL)
				memcpy(&ttl, CMSG_DATA(h), sizeof ttl);
		FERRY_CHECK(ttl > 0, "%s: reply %d came without its IP_TTL cmsg", what, seq);
	}
}

static int ident(int s)
{
	struct sockaddr_in6 a;
	socklen_t l = sizeof a;
	memset(&a, 0, sizeof a);
	FERRY_SYS(getsockname(s, (struct sockaddr *)&a, &l));
	return ntohs(a.sin6_port); /* sin_port and sin6_port are at the same offset */
}

/* The remote address of socket `s` in /proc/self/net/icmp (8 hex digits), or "". */
static void icmp_remote(int s, char *out)
{
	char link[64], buf[8192], ino[32];
	out[0] = 0;
	ferry_fd_link(s, link, sizeof link);
	if (sscanf(link, "socket:[%31[0-9]]", ino) != 1)
		return;
	if (ferry_read_file("/proc/self/net/icmp", buf, sizeof buf) < 0)
		return;
	for (char *l = strtok(buf, "\n"); l; l = strtok(NULL, "\n")) {
		char loc[64], rem[64], st[8], in[32];
		if (sscanf(l, "%*s %63s %63s %7s %*s %*s %*s %*s %*s %31s", loc, rem, st, in) == 4 &&
		    strcmp(in, ino) == 0)
			snprintf(out, 64, "%s %s", rem, st);
	}
}

int main(void)
{
	unsigned char b[64];
	struct sockaddr_in lo = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	struct sockaddr_in6 lo6 = { .sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT };

	int p4 = ping_socket(AF_INET, IPPROTO_ICMP);
	struct sockaddr_in me = lo;
	me.sin_port = htons(ID4);
	FERRY_SYS(bind(p4, (struct sockaddr *)&me, sizeof me));
	FERRY_SYS(connect(p4, (struct sockaddr *)&lo, sizeof lo));
	int one = 1, ttl = 33;
	FERRY_SYS(setsockopt(p4, IPPROTO_IP, IP_TTL, &ttl, sizeof ttl));
	FERRY_SYS(setsockopt(p4, IPPROTO_IP, IP_RECVTTL, &one, sizeof one));
	for (int seq = 1; seq <= 3; seq++)
		FERRY_SYS(send(p4, b, echo(b, 0, seq), 0));
	check_reply("P4 before", p4, 0, ID4, 1, 1);

	int p6 = ping_socket(AF_INET6, IPPROTO_ICMPV6);
	FERRY_SYS(sendto(p6, b, echo(b, 1, 9), 0, (struct sockaddr *)&lo6, sizeof lo6));
	int id6 = ident(p6);
	int q = ping_socket(AF_INET, IPPROTO_ICMP);

	/* Every reply is in its queue before the checkpoint (over loopback they come at once;
	 * ping sockets answer no FIONREAD). */
	FERRY_CHECK(wait_in(p4) && wait_in(p6), "no replies queued");
	ferry_sleep_ms(20);
	char rem_before[64];
	icmp_remote(p4, rem_before);
	FERRY_CHECK(rem_before[0] != 0, "P4 is not in /proc/self/net/icmp");
	int fds[64];
	int nfds = ferry_list_fds(fds, 64);
	ferry_ready();
	ferry_wait_go();

	ferry_check_fds_same(fds, nfds);
	FERRY_CHECK_EQ("P4 identifier", ID4, ident(p4));
	FERRY_CHECK_EQ("P6 identifier", id6, ident(p6));
	FERRY_CHECK_EQ("Q identifier", 0, ident(q));
	char rem_after[64];
	icmp_remote(p4, rem_after);
	FERRY_CHECK_EQ_STR("P4 remote address and state", rem_before, rem_after);
	int v = 0;
	socklen_t vl = sizeof v;
	FERRY_SYS(getsockopt(p4, SOL_SOCKET, SO_PROTOCOL, &v, &vl));
	FERRY_CHECK_EQ("P4 SO_PROTOCOL", IPPROTO_ICMP, v);
	vl = sizeof v;
	FERRY_SYS(getsockopt(p6, SOL_SOCKET, SO_PROTOCOL, &v, &vl));
	FERRY_CHECK_EQ("P6 SO_PROTOCOL", IPPROTO_ICMPV6, v);
	vl = sizeof v;
	FERRY_SYS(getsockopt(p4, IPPROTO_IP, IP_TTL, &v, &vl));
	FERRY_CHECK_EQ("P4 IP_TTL", 33, v);

	check_reply("P4 queued", p4, 0, ID4, 2, 1);
	check_reply("P4 queued", p4, 0, ID4, 3, 1);
	check_reply("P6 queued", p6, 1, id6, 9, 0);
	FERRY_CHECK(recv(p4, b, sizeof b, MSG_DONTWAIT) < 0, "P4: an extra reply");
	FERRY_CHECK(recv(p6, b, sizeof b, MSG_DONTWAIT) < 0, "P6: an extra reply");
	FERRY_CHECK(recv(q, b, sizeof b, MSG_DONTWAIT) < 0, "Q: a reply");

	/* They still ping. */
	FERRY_SYS(send(p4, b, echo(b, 0, 4), 0));
	check_reply("P4 after", p4, 0, ID4, 4, 1);
	FERRY_SYS(sendto(p6, b, echo(b, 1, 10), 0, (struct sockaddr *)&lo6, sizeof lo6));
	check_reply("P6 after", p6, 1, id6, 10, 0);
	FERRY_SYS(sendto(q, b, echo(b, 0, 5), 0, (struct sockaddr *)&lo, sizeof lo));
	check_reply("Q after", q, 0, ident(q), 5, 0);
	ferry_finish();
}
