/*
 * fd_tcp_listen: listening TCP sockets on loopback.
 *
 * Sets up an IPv4 listener on 127.0.0.1:<ephemeral> with SO_REUSEADDR and
 * backlog 8, and an IPv6 listener on [::1]:<ephemeral> with IPV6_V6ONLY
 * (skipped if IPv6 is unavailable).
 * Verifies: same local addresses/ports, SO_ACCEPTCONN and SO_REUSEADDR,
 * and that connecting and accepting works with data both ways.
 */
#include "ferry_test.h"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

static int opt(int fd, int level, int name)
{
	int v = -1;
	socklen_t l = sizeof v;
	getsockopt(fd, level, name, &v, &l);
	return v;
}

static void exercise(const char *who, int l, struct sockaddr *addr, socklen_t len, int family)
{
	int c = socket(family, SOCK_STREAM, 0);
	if (connect(c, addr, len) < 0) {
		ferry_fail("%s: connect: %s", who, strerror(errno));
		return;
	}
	int s = accept(l, NULL, NULL);
	if (s < 0) {
		ferry_fail("%s: accept: %s", who, strerror(errno));
		return;
	}
	char buf[8] = "";
	FERRY_CHECK_EQ("client send", 4, write(c, "ping", 4));
	FERRY_CHECK_EQ("server recv", 4, read(s, buf, sizeof buf));
	FERRY_CHECK_EQ("server send", 4, write(s, "pong", 4));
	FERRY_CHECK_EQ("client recv", 4, read(c, buf, sizeof buf));
	FERRY_CHECK_MEM("reply", "pong", buf, 4);
	close(s);
	close(c);
}

int main(void)
{
	int one = 1;
	int l4 = FERRY_SYS(socket(AF_INET, SOCK_STREAM, 0));
	FERRY_SYS(setsockopt(l4, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one));
	struct sockaddr_in a4 = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	FERRY_SYS(bind(l4, (struct sockaddr *)&a4, sizeof a4));
	FERRY_SYS(listen(l4, 8));
	socklen_t al = sizeof a4;
	getsockname(l4, (struct sockaddr *)&a4, &al);

	struct sockaddr_in6 a6 = { .sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT };
	int l6 = socket(AF_INET6, SOCK_STREAM, 0);
	if (l6 >= 0 && (setsockopt(l6, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one) < 0 ||
			bind(l6, (struct sockaddr *)&a6, sizeof a6) < 0 || listen(l6, 4) < 0)) {
		ferry_log("no IPv6 loopback: %s; IPv6 part skipped", strerror(errno));
		close(l6);
		l6 = -1;
	}
	if (l6 >= 0) {
		al = sizeof a6;
		getsockname(l6, (struct sockaddr *)&a6, &al);
	}

	ferry_ready();
	ferry_wait_go();

	struct sockaddr_in n4;
	al = sizeof n4;
	FERRY_CHECK_EQ("getsockname v4", 0, getsockname(l4, (struct sockaddr *)&n4, &al));
	FERRY_CHECK_EQ("v4 port", ntohs(a4.sin_port), ntohs(n4.sin_port));
	FERRY_CHECK_EQ_HEX("v4 address", ntohl(a4.sin_addr.s_addr), ntohl(n4.sin_addr.s_addr));
	FERRY_CHECK_EQ("v4 SO_ACCEPTCONN", 1, opt(l4, SOL_SOCKET, SO_ACCEPTCONN));
	FERRY_CHECK_EQ("v4 SO_REUSEADDR", 1, opt(l4, SOL_SOCKET, SO_REUSEADDR));
	exercise("IPv4", l4, (struct sockaddr *)&a4, sizeof a4, AF_INET);
	if (l6 >= 0) {
		struct sockaddr_in6 n6;
		al = sizeof n6;
		FERRY_CHECK_EQ("getsockname v6", 0, getsockname(l6, (struct sockaddr *)&n6, &al));
		FERRY_CHECK_EQ("v6 port", ntohs(a6.sin6_port), ntohs(n6.sin6_port));
		FERRY_CHECK_EQ("v6 IPV6_V6ONLY", 1, opt(l6, IPPROTO_IPV6, IPV6_V6ONLY));
		exercise("IPv6", l6, (struct sockaddr *)&a6, sizeof a6, AF_INET6);
	}
	ferry_finish();
}
