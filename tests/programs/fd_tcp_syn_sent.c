/*
 * fd_tcp_syn_sent: a TCP connection still being opened (SYN_SENT), both
 * ends in this process.
 *
 * Sets up listener L on 127.0.0.1 with backlog 0: client C1 connects and
 * waits in L's queue, which is then full; C2 connects without blocking: L
 * drops its SYN, and C2 stays in SYN_SENT, sending it again now and then.
 * Verifies: C2's state and local address; once L accepts C1, C2's
 * connection is made (within 10 s: the next SYN), L accepts it from C2's
 * address, and both connections work both ways.
 */
#include "ferry_test.h"
#include "ferry_tcp.h"

static int port_of(int fd, int peer)
{
	struct sockaddr_in a;
	socklen_t l = sizeof a;
	memset(&a, 0, sizeof a);
	if (peer)
		getpeername(fd, (struct sockaddr *)&a, &l);
	else
		getsockname(fd, (struct sockaddr *)&a, &l);
	return ntohs(a.sin_port);
}

static void exchange(const char *who, int c, int s)
{
	char buf[8];
	FERRY_CHECK_EQ(who, 4, write(c, "ping", 4));
	struct pollfd p = { .fd = s, .events = POLLIN };
	FERRY_CHECK_EQ(who, 1, poll(&p, 1, 3000));
	FERRY_CHECK_EQ(who, 4, read(s, buf, sizeof buf));
	FERRY_CHECK_EQ(who, 4, write(s, "pong", 4));
	p.fd = c;
	FERRY_CHECK_EQ(who, 1, poll(&p, 1, 3000));
	FERRY_CHECK_EQ(who, 4, read(c, buf, sizeof buf));
	FERRY_CHECK_MEM(who, "pong", buf, 4);
}

int main(void)
{
	struct sockaddr_in la = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t al = sizeof la;
	int l = FERRY_SYS(socket(AF_INET, SOCK_STREAM, 0));
	FERRY_SYS(bind(l, (struct sockaddr *)&la, sizeof la));
	FERRY_SYS(listen(l, 0));
	FERRY_SYS(getsockname(l, (struct sockaddr *)&la, &al));
	int c1 = FERRY_SYS(socket(AF_INET, SOCK_STREAM, 0));
	FERRY_SYS(connect(c1, (struct sockaddr *)&la, sizeof la));
	ferry_sleep_ms(20);
	int c2 = FERRY_SYS(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0));
	if (connect(c2, (struct sockaddr *)&la, sizeof la) == 0 || errno != EINPROGRESS)
		ferry_die("setup: C2's connect: %s", strerror(errno));
	ferry_sleep_ms(50);
	if (tcp_state(c2) != TCP_SYN_SENT)
		ferry_die("setup: C2 is in state %d, not SYN_SENT", tcp_state(c2));
	int p1 = port_of(c1, 0), p2 = port_of(c2, 0);

	ferry_ready();
	ferry_wait_go();

	FERRY_CHECK_EQ("C2 state", TCP_SYN_SENT, tcp_state(c2));
	FERRY_CHECK_EQ("C1 port", p1, port_of(c1, 0));
	FERRY_CHECK_EQ("C2 port", p2, port_of(c2, 0));
	int s1 = accept(l, NULL, NULL);
	FERRY_CHECK(s1 >= 0, "accept C1: %s", strerror(errno));
	FERRY_CHECK_EQ("S1's peer", p1, port_of(s1, 1));
	exchange("C1", c1, s1);
	struct pollfd p = { .fd = c2, .events = POLLOUT };
	FERRY_CHECK_EQ("C2 connected", 1, poll(&p, 1, 10000));
	int err = -1;
	socklen_t el = sizeof err;
	getsockopt(c2, SOL_SOCKET, SO_ERROR, &err, &el);
	FERRY_CHECK_EQ("C2's SO_ERROR", 0, err);
	p.fd = l;
	p.events = POLLIN;
	FERRY_CHECK_EQ("L has C2", 1, poll(&p, 1, 3000));
	int s2 = accept(l, NULL, NULL);
	FERRY_CHECK(s2 >= 0, "accept C2: %s", strerror(errno));
	FERRY_CHECK_EQ("S2's peer", p2, port_of(s2, 1));
	exchange("C2", c2, s2);
	ferry_finish();
}
