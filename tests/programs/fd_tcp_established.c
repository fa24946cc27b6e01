/*
 * fd_tcp_established: an established TCP connection on loopback, both ends
 * in this process, with unread data both ways.
 *
 * Sets up listener L on 127.0.0.1:<ephemeral>, client C connected to it,
 * S = accept(L); C sent 100 KiB (unread by S), S sent 500 bytes (unread by
 * C); TCP_NODELAY on C.
 * Verifies: addresses and ports of C and S, TCP_NODELAY, all queued bytes
 * arrive exactly once in order, the connection still works both ways, and
 * L still accepts.
 */
#include "ferry_test.h"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#define BIG (100 * 1024)

static void addr(int fd, int peer, struct sockaddr_in *a)
{
	socklen_t l = sizeof *a;
	memset(a, 0, sizeof *a);
	if (peer)
		getpeername(fd, (struct sockaddr *)a, &l);
	else
		getsockname(fd, (struct sockaddr *)a, &l);
}

static ssize_t read_n(int fd, unsigned char *buf, size_t n)
{
	size_t got = 0;
	struct timeval tv = { 3, 0 };
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	while (got < n) {
		ssize_t r = read(fd, buf + got, n - got);
		if (r <= 0)
			break;
		got += (size_t)r;
	}
	return (ssize_t)got;
}

int main(void)
{
	struct sockaddr_in lo = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	int l = FERRY_SYS(socket(AF_INET, SOCK_STREAM, 0));
	FERRY_SYS(bind(l, (struct sockaddr *)&lo, sizeof lo));
	FERRY_SYS(listen(l, 4));
	struct sockaddr_in la;
	addr(l, 0, &la);
	int c = FERRY_SYS(socket(AF_INET, SOCK_STREAM, 0));
	int one = 1;
	FERRY_SYS(setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one));
	FERRY_SYS(connect(c, (struct sockaddr *)&la, sizeof la));
	int s = FERRY_SYS(accept(l, NULL, NULL));
	static unsigned char big[BIG], small[500], buf[BIG];
	ferry_fill(big, BIG, 230);
	ferry_fill(small, sizeof small, 231);
	FERRY_SYS(write(c, big, BIG));
	FERRY_SYS(write(s, small, sizeof small));
	struct sockaddr_in cl, cp, sl, sp;
	addr(c, 0, &cl);
	addr(c, 1, &cp);
	addr(s, 0, &sl);
	addr(s, 1, &sp);
	ferry_sleep_ms(50); /* let everything reach the receive queues */

	ferry_ready();
	ferry_wait_go();

	struct sockaddr_in x;
	addr(c, 0, &x);
	FERRY_CHECK_EQ("C local port", ntohs(cl.sin_port), ntohs(x.sin_port));
	addr(c, 1, &x);
	FERRY_CHECK_EQ("C peer port", ntohs(cp.sin_port), ntohs(x.sin_port));
	addr(s, 0, &x);
	FERRY_CHECK_EQ("S local port", ntohs(sl.sin_port), ntohs(x.sin_port));
	addr(s, 1, &x);
	FERRY_CHECK_EQ("S peer port", ntohs(sp.sin_port), ntohs(x.sin_port));
	int v = 0;
	socklen_t vl = sizeof v;
	getsockopt(c, IPPROTO_TCP, TCP_NODELAY, &v, &vl);
	FERRY_CHECK_EQ("C TCP_NODELAY", 1, v);
	FERRY_CHECK_EQ("bytes C -> S", BIG, read_n(s, buf, BIG));
	FERRY_CHECK_MEM("data C -> S", big, buf, BIG);
	FERRY_CHECK_EQ("bytes S -> C", (ssize_t)sizeof small, read_n(c, buf, sizeof small));
	FERRY_CHECK_MEM("data S -> C", small, buf, sizeof small);
	FERRY_CHECK_EQ("C -> S after restore", 3, write(c, "abc", 3));
	FERRY_CHECK_EQ("S reads", 3, read_n(s, buf, 3));
	FERRY_CHECK_EQ("S -> C after restore", 3, write(s, "def", 3));
	FERRY_CHECK_EQ("C reads", 3, read_n(c, buf, 3));
	int c2 = socket(AF_INET, SOCK_STREAM, 0);
	FERRY_CHECK(connect(c2, (struct sockaddr *)&la, sizeof la) == 0, "new connect: %s", strerror(errno));
	int s2 = accept(l, NULL, NULL);
	FERRY_CHECK(s2 >= 0, "accept: %s", strerror(errno));
	ferry_finish();
}
