/*
 * fd_sock_opts_filter: socket options and attached classic BPF filters, and
 * UDP sockets after shutdown.
 *
 * Sets up U1, a UDP socket on 127.0.0.1 with SO_DONTROUTE, SO_RCVBUF (so
 * SO_BUF_LOCK says the receive buffer is locked; the send buffer lock set
 * with SO_BUF_LOCK itself), IP_FREEBIND, IP_TOS, a classic BPF filter that
 * drops datagrams of less than 4 bytes (SO_ATTACH_FILTER), locked with
 * SO_LOCK_FILTER; U2, connected to U1; R, a UDP socket bound and shut down
 * for reading; W, a UDP socket connected to U1 and shut down for writing; a
 * TCP listener L with a filter of its own (accept all).
 * Verifies: every option reads back the same, SO_GET_FILTER gives back the
 * same instructions, the filter still drops short datagrams and the lock
 * still refuses SO_DETACH_FILTER, R reads end of file at once, W's send
 * fails with EPIPE, and U2 -> U1 still works.
 */
#include "ferry_test.h"
#include <arpa/inet.h>
#include <linux/filter.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#ifndef SO_BUF_LOCK
#define SO_BUF_LOCK 72
#endif

static struct sockaddr_in local(int fd)
{
	struct sockaddr_in a = { 0 };
	socklen_t l = sizeof a;
	getsockname(fd, (struct sockaddr *)&a, &l);
	return a;
}

static int opt(int fd, int level, int name)
{
	int v = -1;
	socklen_t l = sizeof v;
	if (getsockopt(fd, level, name, &v, &l) < 0)
		return -errno;
	return v;
}

/* The UDP header (8 bytes) and at least 4 bytes of data, or nothing. */
static struct sock_filter prog[] = {
	BPF_STMT(BPF_LD | BPF_W | BPF_LEN, 0),
	BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 12, 0, 1),
	BPF_STMT(BPF_RET | BPF_K, 0xffff),
	BPF_STMT(BPF_RET | BPF_K, 0),
};
static struct sock_filter all[] = {
	BPF_STMT(BPF_RET | BPF_K, 0x40000),
};

static void check_filter(const char *what, int fd, const struct sock_filter *want, int n)
{
	struct sock_filter got[16];
	memset(got, 0, sizeof got);
	socklen_t len = 16; /* in instructions */
	FERRY_CHECK_EQ(what, 0, getsockopt(fd, SOL_SOCKET, SO_GET_FILTER, got, &len));
	FERRY_CHECK_EQ("filter length", n, (int)len);
	if ((int)len == n)
		FERRY_CHECK_MEM(what, want, got, sizeof(*want) * (size_t)n);
}

int main(void)
{
	struct sockaddr_in lo = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	int one = 1;
	int u1 = FERRY_SYS(socket(AF_INET, SOCK_DGRAM, 0));
	FERRY_SYS(setsockopt(u1, SOL_SOCKET, SO_DONTROUTE, &one, sizeof one));
	int rb = 150000;
	FERRY_SYS(setsockopt(u1, SOL_SOCKET, SO_RCVBUF, &rb, sizeof rb));
	int lock = 3;
	FERRY_SYS(setsockopt(u1, SOL_SOCKET, SO_BUF_LOCK, &lock, sizeof lock));
	FERRY_SYS(setsockopt(u1, IPPROTO_IP, IP_FREEBIND, &one, sizeof one));
	int tos = 0x10;
	FERRY_SYS(setsockopt(u1, IPPROTO_IP, IP_TOS, &tos, sizeof tos));
	FERRY_SYS(bind(u1, (struct sockaddr *)&lo, sizeof lo));
	struct sock_fprog fp = { .len = 4, .filter = prog };
	FERRY_SYS(setsockopt(u1, SOL_SOCKET, SO_ATTACH_FILTER, &fp, sizeof fp));
	FERRY_SYS(setsockopt(u1, SOL_SOCKET, SO_LOCK_FILTER, &one, sizeof one));
	struct sockaddr_in a1 = local(u1);
	int u2 = FERRY_SYS(socket(AF_INET, SOCK_DGRAM, 0));
	FERRY_SYS(connect(u2, (struct sockaddr *)&a1, sizeof a1));
	int r = FERRY_SYS(socket(AF_INET, SOCK_DGRAM, 0));
	FERRY_SYS(bind(r, (struct sockaddr *)&lo, sizeof lo));
	/* ENOTCONN on an unconnected socket, but the shutdown is recorded all the same. */
	shutdown(r, SHUT_RD);
	int w = FERRY_SYS(socket(AF_INET, SOCK_DGRAM, 0));
	FERRY_SYS(connect(w, (struct sockaddr *)&a1, sizeof a1));
	FERRY_SYS(shutdown(w, SHUT_WR));
	int l = FERRY_SYS(socket(AF_INET, SOCK_STREAM, 0));
	FERRY_SYS(bind(l, (struct sockaddr *)&lo, sizeof lo));
	struct sock_fprog fa = { .len = 1, .filter = all };
	FERRY_SYS(setsockopt(l, SOL_SOCKET, SO_ATTACH_FILTER, &fa, sizeof fa));
	FERRY_SYS(listen(l, 4));
	int rcv = opt(u1, SOL_SOCKET, SO_RCVBUF), snd = opt(u1, SOL_SOCKET, SO_SNDBUF);
	int before[64];
	int nbefore = ferry_list_fds(before, 64);

	ferry_ready();
	ferry_wait_go();
	ferry_check_fds_same(before, nbefore);

	FERRY_CHECK_EQ("U1 SO_DONTROUTE", 1, opt(u1, SOL_SOCKET, SO_DONTROUTE));
	FERRY_CHECK_EQ("U1 SO_BUF_LOCK", 3, opt(u1, SOL_SOCKET, SO_BUF_LOCK));
	FERRY_CHECK_EQ("U1 SO_RCVBUF", rcv, opt(u1, SOL_SOCKET, SO_RCVBUF));
	FERRY_CHECK_EQ("U1 SO_SNDBUF", snd, opt(u1, SOL_SOCKET, SO_SNDBUF));
	FERRY_CHECK_EQ("U1 IP_FREEBIND", 1, opt(u1, IPPROTO_IP, IP_FREEBIND));
	FERRY_CHECK_EQ("U1 IP_TOS", tos, opt(u1, IPPROTO_IP, IP_TOS));
	FERRY_CHECK_EQ("U1 SO_LOCK_FILTER", 1, opt(u1, SOL_SOCKET, SO_LOCK_FILTER));
	FERRY_CHECK_EQ("U2 SO_DONTROUTE", 0, opt(u2, SOL_SOCKET, SO_DONTROUTE));
	check_filter("U1 filter", u1, prog, 4);
	check_filter("L filter", l, all, 1);
	FERRY_CHECK(setsockopt(u1, SOL_SOCKET, SO_DETACH_FILTER, &one, sizeof one) < 0 &&
			    errno == EPERM,
		    "the locked filter could be detached");
	struct timeval tv = { 2, 0 };
	setsockopt(u1, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	FERRY_CHECK_EQ("U2 send short", 2, send(u2, "ab", 2, 0));
	FERRY_CHECK_EQ("U2 send long", 5, send(u2, "hello", 5, 0));
	char buf[16] = "";
	FERRY_CHECK_EQ("U1 receives only the long one", 5, recv(u1, buf, sizeof buf, 0));
	FERRY_CHECK_EQ_STR("datagram", "hello", buf);
	struct pollfd pr = { .fd = r, .events = POLLIN | POLLRDHUP };
	FERRY_CHECK_EQ("R polls", 1, poll(&pr, 1, 0));
	FERRY_CHECK(pr.revents & POLLRDHUP, "R is not shut down for reading (revents %#x)",
		    pr.revents);
	setsockopt(r, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	FERRY_CHECK_EQ("R reads end of file", 0, recv(r, buf, sizeof buf, 0));
	errno = 0;
	FERRY_CHECK(send(w, "x", 1, MSG_NOSIGNAL) < 0 && errno == EPIPE,
		    "W sends after shutdown(SHUT_WR): errno %d", errno);
	ferry_finish();
}
