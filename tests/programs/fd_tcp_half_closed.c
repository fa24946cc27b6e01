/*
 * fd_tcp_half_closed: TCP connections on loopback, both ends in this
 * process, shut down in one direction.
 *
 * Sets up three connections (listener closed after accepting):
 *   A: C1 wrote "hello" then shutdown(SHUT_WR); S1 has not read: C1 is in
 *      FIN_WAIT2, S1 in CLOSE_WAIT with "hello" and the EOF queued;
 *   B: C2 called shutdown(SHUT_RD): both ends ESTABLISHED;
 *   C: C3 shutdown(SHUT_WR), and S3 already read the EOF (CLOSE_WAIT).
 * Verifies: the states (TCP_INFO), the addresses, that S1 reads "hello"
 * then EOF, that S1 -> C1 still works and C1 cannot send (EPIPE), that S1's
 * shutdown reaches C1 as EOF; that C2 reads EOF at once (POLLRDHUP) and can
 * still send; that S3 reads EOF again and can still send to C3.
 */
#include "ferry_test.h"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

static int tcp_state(int fd)
{
	struct tcp_info ti;
	socklen_t l = sizeof ti;
	memset(&ti, 0, sizeof ti);
	if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &l) < 0)
		return -1;
	return ti.tcpi_state;
}

/* A connected pair over 127.0.0.1: *c connected, *s accepted. */
static void pair(int *c, int *s)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t al = sizeof a;
	int l = FERRY_SYS(socket(AF_INET, SOCK_STREAM, 0));
	FERRY_SYS(bind(l, (struct sockaddr *)&a, sizeof a));
	FERRY_SYS(listen(l, 4));
	FERRY_SYS(getsockname(l, (struct sockaddr *)&a, &al));
	*c = FERRY_SYS(socket(AF_INET, SOCK_STREAM, 0));
	FERRY_SYS(connect(*c, (struct sockaddr *)&a, sizeof a));
	*s = FERRY_SYS(accept(l, NULL, NULL));
	close(l);
}

static int ports(int fd)
{
	struct sockaddr_in a, b;
	socklen_t al = sizeof a, bl = sizeof b;
	if (getsockname(fd, (struct sockaddr *)&a, &al) < 0 || getpeername(fd, (struct sockaddr *)&b, &bl) < 0)
		return -1;
	return ntohs(a.sin_port) << 16 | ntohs(b.sin_port);
}

/* Reads up to n bytes, waiting at most 3 s for each. */
static ssize_t read_t(int fd, char *buf, size_t n)
{
	struct pollfd p = { .fd = fd, .events = POLLIN };
	if (poll(&p, 1, 3000) != 1)
		return -2;
	return read(fd, buf, n);
}

int main(void)
{
	int c1, s1, c2, s2, c3, s3;
	char buf[64];
	pair(&c1, &s1);
	pair(&c2, &s2);
	pair(&c3, &s3);
	FERRY_SYS(write(c1, "hello", 5));
	FERRY_SYS(shutdown(c1, SHUT_WR));
	FERRY_SYS(shutdown(c2, SHUT_RD));
	FERRY_SYS(shutdown(c3, SHUT_WR));
	FERRY_WAIT_UNTIL(tcp_state(s3) == TCP_CLOSE_WAIT, 2000);
	if (read_t(s3, buf, sizeof buf) != 0)
		ferry_die("setup: S3 did not read EOF");
	FERRY_WAIT_UNTIL(tcp_state(c1) == TCP_FIN_WAIT2 && tcp_state(s1) == TCP_CLOSE_WAIT, 2000);
	int p[6] = { ports(c1), ports(s1), ports(c2), ports(s2), ports(c3), ports(s3) };
	FERRY_CHECK_EQ("setup: C1 state", TCP_FIN_WAIT2, tcp_state(c1));
	FERRY_CHECK_EQ("setup: S1 state", TCP_CLOSE_WAIT, tcp_state(s1));

	ferry_ready();
	ferry_wait_go();

	int q[6] = { ports(c1), ports(s1), ports(c2), ports(s2), ports(c3), ports(s3) };
	for (int i = 0; i < 6; i++)
		FERRY_CHECK_EQ("local and peer ports", p[i], q[i]);
	FERRY_CHECK_EQ("C1 state", TCP_FIN_WAIT2, tcp_state(c1));
	FERRY_CHECK_EQ("S1 state", TCP_CLOSE_WAIT, tcp_state(s1));
	FERRY_CHECK_EQ("C2 state", TCP_ESTABLISHED, tcp_state(c2));
	FERRY_CHECK_EQ("S2 state", TCP_ESTABLISHED, tcp_state(s2));
	FERRY_CHECK_EQ("C3 state", TCP_FIN_WAIT2, tcp_state(c3));
	FERRY_CHECK_EQ("S3 state", TCP_CLOSE_WAIT, tcp_state(s3));

	/* A: the queued bytes, then EOF; the other direction still works. */
	FERRY_CHECK_EQ("S1 reads", 5, read_t(s1, buf, sizeof buf));
	FERRY_CHECK_MEM("S1 data", "hello", buf, 5);
	FERRY_CHECK_EQ("S1 reads EOF", 0, read_t(s1, buf, sizeof buf));
	FERRY_CHECK_EQ("S1 -> C1", 4, write(s1, "back", 4));
	FERRY_CHECK_EQ("C1 reads", 4, read_t(c1, buf, sizeof buf));
	FERRY_CHECK_MEM("C1 data", "back", buf, 4);
	errno = 0;
	FERRY_CHECK_EQ("C1 cannot send", -1, send(c1, "x", 1, MSG_NOSIGNAL));
	FERRY_CHECK_EQ("C1 send errno", EPIPE, errno);
	FERRY_SYS(shutdown(s1, SHUT_WR));
	FERRY_CHECK_EQ("C1 reads EOF", 0, read_t(c1, buf, sizeof buf));

	/* B: shut for reading here, the other direction works. */
	struct pollfd pf = { .fd = c2, .events = POLLIN | POLLRDHUP };
	FERRY_CHECK_EQ("C2 poll", 1, poll(&pf, 1, 0));
	FERRY_CHECK(pf.revents & POLLRDHUP, "C2 revents %#x lack POLLRDHUP", pf.revents);
	FERRY_CHECK_EQ("C2 reads EOF", 0, read(c2, buf, sizeof buf));
	FERRY_CHECK_EQ("C2 -> S2", 4, write(c2, "ping", 4));
	FERRY_CHECK_EQ("S2 reads", 4, read_t(s2, buf, sizeof buf));
	FERRY_CHECK_MEM("S2 data", "ping", buf, 4);
	pf.fd = s2;
	pf.revents = 0;
	FERRY_CHECK_EQ("S2 not shut", 0, poll(&pf, 1, 0));

	/* C: EOF again, the other direction works. */
	FERRY_CHECK_EQ("S3 reads EOF", 0, read_t(s3, buf, sizeof buf));
	FERRY_CHECK_EQ("S3 -> C3", 4, write(s3, "late", 4));
	FERRY_CHECK_EQ("C3 reads", 4, read_t(c3, buf, sizeof buf));
	FERRY_CHECK_MEM("C3 data", "late", buf, 4);
	ferry_finish();
}
