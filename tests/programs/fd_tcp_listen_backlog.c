/*
 * fd_tcp_listen_backlog: TCP listeners with connections waiting to be
 * accepted, both ends in this process.
 *
 * Sets up listener L on 127.0.0.1 (backlog 8) with clients C1 and C2
 * connected and not accepted, and a dual-stack listener L6 on [::] with
 * client C3 (AF_INET, to 127.0.0.1) waiting; nothing is sent.
 * Verifies: SO_ACCEPTCONN and the addresses; L's queue holds two
 * connections, accepted in the order they were made (their peers are C1's
 * and C2's addresses); L6's holds C3 (v4-mapped); each accepted connection
 * works both ways; L still accepts a new client.
 */
#include "ferry_test.h"
#include "ferry_tcp.h"

static void addr_of(int fd, int peer, struct sockaddr_storage *a, socklen_t *l)
{
	*l = sizeof *a;
	memset(a, 0, sizeof *a);
	if (peer)
		getpeername(fd, (struct sockaddr *)a, l);
	else
		getsockname(fd, (struct sockaddr *)a, l);
}

static int port_of(const struct sockaddr_storage *a)
{
	if (a->ss_family == AF_INET)
		return ntohs(((const struct sockaddr_in *)a)->sin_port);
	return ntohs(((const struct sockaddr_in6 *)a)->sin6_port);
}

/* Accepts from l (waiting at most 3 s); checks the peer is client c. */
static int accept_from(const char *who, int l, int c)
{
	struct pollfd p = { .fd = l, .events = POLLIN };
	if (poll(&p, 1, 3000) != 1) {
		ferry_fail("%s: nothing to accept", who);
		return -1;
	}
	int s = accept(l, NULL, NULL);
	if (s < 0) {
		ferry_fail("%s: accept: %s", who, strerror(errno));
		return -1;
	}
	struct sockaddr_storage cl, sp;
	socklen_t cll, spl;
	addr_of(c, 0, &cl, &cll);
	addr_of(s, 1, &sp, &spl);
	FERRY_CHECK(port_of(&cl) == port_of(&sp), "%s: accepted the connection from port %d, expected %d",
		    who, port_of(&sp), port_of(&cl));
	char buf[8];
	FERRY_CHECK_EQ(who, 4, write(c, "ping", 4));
	p.fd = s;
	FERRY_CHECK_EQ(who, 1, poll(&p, 1, 3000));
	FERRY_CHECK_EQ(who, 4, read(s, buf, sizeof buf));
	FERRY_CHECK_EQ(who, 4, write(s, "pong", 4));
	p.fd = c;
	FERRY_CHECK_EQ(who, 1, poll(&p, 1, 3000));
	FERRY_CHECK_EQ(who, 4, read(c, buf, sizeof buf));
	FERRY_CHECK_MEM(who, "pong", buf, 4);
	return s;
}

int main(void)
{
	int zero = 0;
	struct sockaddr_in la = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t al = sizeof la;
	int l = FERRY_SYS(socket(AF_INET, SOCK_STREAM, 0));
	FERRY_SYS(bind(l, (struct sockaddr *)&la, sizeof la));
	FERRY_SYS(listen(l, 8));
	FERRY_SYS(getsockname(l, (struct sockaddr *)&la, &al));
	int c1 = FERRY_SYS(socket(AF_INET, SOCK_STREAM, 0));
	FERRY_SYS(connect(c1, (struct sockaddr *)&la, sizeof la));
	int c2 = FERRY_SYS(socket(AF_INET, SOCK_STREAM, 0));
	FERRY_SYS(connect(c2, (struct sockaddr *)&la, sizeof la));

	struct sockaddr_in6 l6a = { .sin6_family = AF_INET6, .sin6_addr = IN6ADDR_ANY_INIT };
	al = sizeof l6a;
	int l6 = FERRY_SYS(socket(AF_INET6, SOCK_STREAM, 0));
	FERRY_SYS(setsockopt(l6, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero));
	FERRY_SYS(bind(l6, (struct sockaddr *)&l6a, sizeof l6a));
	FERRY_SYS(listen(l6, 4));
	FERRY_SYS(getsockname(l6, (struct sockaddr *)&l6a, &al));
	struct sockaddr_in v4 = { .sin_family = AF_INET, .sin_port = l6a.sin6_port,
				  .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	int c3 = FERRY_SYS(socket(AF_INET, SOCK_STREAM, 0));
	FERRY_SYS(connect(c3, (struct sockaddr *)&v4, sizeof v4));
	ferry_sleep_ms(20);
	struct sockaddr_storage before[3];
	socklen_t bl[3];
	int cs[3] = { c1, c2, c3 };
	for (int i = 0; i < 3; i++)
		addr_of(cs[i], 0, &before[i], &bl[i]);

	ferry_ready();
	ferry_wait_go();

	for (int i = 0; i < 3; i++) {
		struct sockaddr_storage a;
		socklen_t len;
		addr_of(cs[i], 0, &a, &len);
		FERRY_CHECK_EQ("client address length", (int)bl[i], (int)len);
		FERRY_CHECK_MEM("client address", &before[i], &a, bl[i]);
		FERRY_CHECK_EQ("client state", TCP_ESTABLISHED, tcp_state(cs[i]));
	}
	int v = 0;
	socklen_t vl = sizeof v;
	getsockopt(l, SOL_SOCKET, SO_ACCEPTCONN, &v, &vl);
	FERRY_CHECK_EQ("L listens", 1, v);
	accept_from("L, first", l, c1);
	accept_from("L, second", l, c2);
	int s3 = accept_from("L6", l6, c3);
	struct sockaddr_in6 m;
	socklen_t ml = sizeof m;
	getsockname(s3, (struct sockaddr *)&m, &ml);
	FERRY_CHECK(m.sin6_family == AF_INET6 && IN6_IS_ADDR_V4MAPPED(&m.sin6_addr),
		    "L6's connection is not v4-mapped (family %d)", m.sin6_family);
	int c4 = socket(AF_INET, SOCK_STREAM, 0);
	FERRY_CHECK(connect(c4, (struct sockaddr *)&la, sizeof la) == 0, "new connect: %s", strerror(errno));
	accept_from("L, new", l, c4);
	ferry_finish();
}
