/*
 * fd_tcp_ipv6: TCP connections over IPv6 on loopback, and IPv4 connections
 * seen through IPv6 sockets (v4-mapped addresses), both ends in this
 * process.
 *
 * Sets up:
 *   A: C1 (AF_INET6) -> [::1]:<L6>, S1 accepted; 3000 bytes C1 -> S1 and
 *      700 bytes S1 -> C1 queued, unread;
 *   B: a dual-stack listener on [::] (IPV6_V6ONLY off); C2 (AF_INET) ->
 *      127.0.0.1:<LD>: S2, accepted, is AF_INET6 with ::ffff:127.0.0.1 at
 *      both ends; 500 bytes each way queued;
 *   C: C3 (AF_INET6) -> [::ffff:127.0.0.1]:<LD>, S3 accepted: both
 *      AF_INET6 with v4-mapped addresses; C3 shut down writing.
 * Verifies: families and full addresses (address and port) of every end,
 * the queued bytes, that each connection works both ways, C3's half-close
 * (S3 reads EOF), and that both listeners still accept.
 */
#include "ferry_test.h"
#include "ferry_tcp.h"

struct names {
	struct sockaddr_storage local, peer;
	socklen_t llen, plen;
};

static void names_of(int fd, struct names *n)
{
	memset(n, 0, sizeof *n);
	n->llen = n->plen = sizeof n->local;
	getsockname(fd, (struct sockaddr *)&n->local, &n->llen);
	getpeername(fd, (struct sockaddr *)&n->peer, &n->plen);
}

static void check_names(const char *who, int fd, const struct names *before)
{
	struct names now;
	names_of(fd, &now);
	char w[64];
	snprintf(w, sizeof w, "%s local", who);
	FERRY_CHECK_EQ(w, (int)before->llen, (int)now.llen);
	FERRY_CHECK_MEM(w, &before->local, &now.local, before->llen);
	snprintf(w, sizeof w, "%s peer", who);
	FERRY_CHECK_EQ(w, (int)before->plen, (int)now.plen);
	FERRY_CHECK_MEM(w, &before->peer, &now.peer, before->plen);
}

static int family(int fd)
{
	int v = -1;
	socklen_t l = sizeof v;
	getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &v, &l);
	return v;
}

static int mapped(int fd)
{
	struct sockaddr_in6 a;
	socklen_t l = sizeof a;
	if (getsockname(fd, (struct sockaddr *)&a, &l) < 0 || a.sin6_family != AF_INET6)
		return 0;
	return IN6_IS_ADDR_V4MAPPED(&a.sin6_addr);
}

static void exchange(const char *who, int a, int b)
{
	char buf[8];
	char w[64];
	snprintf(w, sizeof w, "%s: a -> b", who);
	FERRY_CHECK_EQ(w, 4, write(a, "ping", 4));
	struct pollfd p = { .fd = b, .events = POLLIN };
	FERRY_CHECK_EQ(w, 1, poll(&p, 1, 3000));
	FERRY_CHECK_EQ(w, 4, read(b, buf, sizeof buf));
	FERRY_CHECK_MEM(w, "ping", buf, 4);
	snprintf(w, sizeof w, "%s: b -> a", who);
	FERRY_CHECK_EQ(w, 4, write(b, "pong", 4));
	p.fd = a;
	FERRY_CHECK_EQ(w, 1, poll(&p, 1, 3000));
	FERRY_CHECK_EQ(w, 4, read(a, buf, sizeof buf));
	FERRY_CHECK_MEM(w, "pong", buf, 4);
}

static void accepts(const char *who, int l, int fam, const struct sockaddr *to, socklen_t len)
{
	int c = socket(fam, SOCK_STREAM, 0);
	FERRY_CHECK(connect(c, to, len) == 0, "%s: connect: %s", who, strerror(errno));
	int s = accept(l, NULL, NULL);
	FERRY_CHECK(s >= 0, "%s: accept: %s", who, strerror(errno));
	close(s);
	close(c);
}

static void put(int fd, size_t n, unsigned seed)
{
	unsigned char b[4096];
	for (size_t i = 0; i < n; i++)
		b[i] = pattern(i, seed);
	if (write(fd, b, n) != (ssize_t)n)
		ferry_die("setup: write: %s", strerror(errno));
}

int main(void)
{
	int one = 1, zero = 0;
	/* A: IPv6 loopback. */
	struct sockaddr_in6 l6a = { .sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT };
	socklen_t al = sizeof l6a;
	int l6 = FERRY_SYS(socket(AF_INET6, SOCK_STREAM, 0));
	FERRY_SYS(setsockopt(l6, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one));
	FERRY_SYS(bind(l6, (struct sockaddr *)&l6a, sizeof l6a));
	FERRY_SYS(listen(l6, 4));
	FERRY_SYS(getsockname(l6, (struct sockaddr *)&l6a, &al));
	int c1 = FERRY_SYS(socket(AF_INET6, SOCK_STREAM, 0));
	FERRY_SYS(connect(c1, (struct sockaddr *)&l6a, sizeof l6a));
	int s1 = FERRY_SYS(accept(l6, NULL, NULL));
	put(c1, 3000, 1);
	put(s1, 700, 2);

	/* B and C: a dual-stack listener. */
	struct sockaddr_in6 lda = { .sin6_family = AF_INET6, .sin6_addr = IN6ADDR_ANY_INIT };
	al = sizeof lda;
	int ld = FERRY_SYS(socket(AF_INET6, SOCK_STREAM, 0));
	FERRY_SYS(setsockopt(ld, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero));
	FERRY_SYS(bind(ld, (struct sockaddr *)&lda, sizeof lda));
	FERRY_SYS(listen(ld, 4));
	FERRY_SYS(getsockname(ld, (struct sockaddr *)&lda, &al));
	struct sockaddr_in v4 = { .sin_family = AF_INET, .sin_port = lda.sin6_port,
				  .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	int c2 = FERRY_SYS(socket(AF_INET, SOCK_STREAM, 0));
	FERRY_SYS(connect(c2, (struct sockaddr *)&v4, sizeof v4));
	int s2 = FERRY_SYS(accept(ld, NULL, NULL));
	put(c2, 500, 3);
	put(s2, 500, 4);
	struct sockaddr_in6 m = { .sin6_family = AF_INET6, .sin6_port = lda.sin6_port };
	FERRY_SYS(inet_pton(AF_INET6, "::ffff:127.0.0.1", &m.sin6_addr));
	int c3 = FERRY_SYS(socket(AF_INET6, SOCK_STREAM, 0));
	FERRY_SYS(connect(c3, (struct sockaddr *)&m, sizeof m));
	int s3 = FERRY_SYS(accept(ld, NULL, NULL));
	FERRY_SYS(shutdown(c3, SHUT_WR));
	ferry_sleep_ms(50);
	if (!mapped(s2) || !mapped(c3) || !mapped(s3) || family(c2) != AF_INET)
		ferry_die("setup: the addresses are not v4-mapped as expected");
	int fds[6] = { c1, s1, c2, s2, c3, s3 };
	const char *who[6] = { "C1", "S1", "C2", "S2", "C3", "S3" };
	int fams[6];
	struct names before[6];
	for (int i = 0; i < 6; i++) {
		names_of(fds[i], &before[i]);
		fams[i] = family(fds[i]);
	}

	ferry_ready();
	ferry_wait_go();

	for (int i = 0; i < 6; i++) {
		FERRY_CHECK_EQ(who[i], fams[i], family(fds[i]));
		check_names(who[i], fds[i], &before[i]);
	}
	FERRY_CHECK_EQ("S3 mapped", 1, mapped(s3));
	FERRY_CHECK_EQ("C3 state", TCP_FIN_WAIT2, tcp_state(c3));
	FERRY_CHECK_EQ("S3 state", TCP_CLOSE_WAIT, tcp_state(s3));
	drain("C1 -> S1", s1, 3000, 1, 0);
	drain("S1 -> C1", c1, 700, 2, 0);
	drain("C2 -> S2", s2, 500, 3, 0);
	drain("S2 -> C2", c2, 500, 4, 0);
	drain("C3 -> S3", s3, 0, 0, 1);
	exchange("A", c1, s1);
	exchange("B", c2, s2);
	FERRY_CHECK_EQ("S3 -> C3", 4, write(s3, "late", 4));
	drain("S3 -> C3 (length)", c3, 0, 0, 0);
	char buf[8];
	struct pollfd p = { .fd = c3, .events = POLLIN };
	FERRY_CHECK_EQ("C3 readable", 1, poll(&p, 1, 3000));
	FERRY_CHECK_EQ("C3 reads", 4, read(c3, buf, sizeof buf));
	accepts("IPv6 listener", l6, AF_INET6, (struct sockaddr *)&l6a, sizeof l6a);
	accepts("dual-stack listener, IPv4", ld, AF_INET, (struct sockaddr *)&v4, sizeof v4);
	accepts("dual-stack listener, v4-mapped", ld, AF_INET6, (struct sockaddr *)&m, sizeof m);
	ferry_finish();
}
