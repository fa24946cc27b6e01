/*
 * ferry_tcp.h: helpers for the engine suite's TCP programs (fd_tcp_*):
 * a loopback pair with small buffers, TCP_INFO's state, a byte pattern
 * written until the buffers are full (a zero window holds back what follows,
 * a FIN included) and read back exactly.  Include after ferry_test.h.
 */
#ifndef FERRY_TCP_H
#define FERRY_TCP_H
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#define FERRY_TCP_BUF (64 * 1024)

static inline int tcp_state(int fd)
{
	struct tcp_info ti;
	socklen_t l = sizeof ti;
	memset(&ti, 0, sizeof ti);
	if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &l) < 0)
		return -1;
	return ti.tcpi_state;
}

/*
 * A connected pair over 127.0.0.1 (*c connected, *s accepted), with small
 * buffers (SO_SNDBUF and SO_RCVBUF at FERRY_TCP_BUF on both), so that a few hundred
 * KiB fill them.
 */
static inline void pair(int *c, int *s)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t al = sizeof a;
	int v = FERRY_TCP_BUF;
	int l = FERRY_SYS(socket(AF_INET, SOCK_STREAM, 0));
	FERRY_SYS(setsockopt(l, SOL_SOCKET, SO_RCVBUF, &v, sizeof v));
	FERRY_SYS(setsockopt(l, SOL_SOCKET, SO_SNDBUF, &v, sizeof v));
	FERRY_SYS(bind(l, (struct sockaddr *)&a, sizeof a));
	FERRY_SYS(listen(l, 4));
	FERRY_SYS(getsockname(l, (struct sockaddr *)&a, &al));
	*c = FERRY_SYS(socket(AF_INET, SOCK_STREAM, 0));
	FERRY_SYS(setsockopt(*c, SOL_SOCKET, SO_RCVBUF, &v, sizeof v));
	FERRY_SYS(setsockopt(*c, SOL_SOCKET, SO_SNDBUF, &v, sizeof v));
	FERRY_SYS(connect(*c, (struct sockaddr *)&a, sizeof a));
	*s = FERRY_SYS(accept(l, NULL, NULL));
	close(l);
}

static inline int ports(int fd)
{
	struct sockaddr_in a, b;
	socklen_t al = sizeof a, bl = sizeof b;
	if (getsockname(fd, (struct sockaddr *)&a, &al) < 0 || getpeername(fd, (struct sockaddr *)&b, &bl) < 0)
		return -1;
	return ntohs(a.sin_port) << 16 | ntohs(b.sin_port);
}

static inline unsigned char pattern(size_t at, unsigned seed)
{
	return (unsigned char)((at * 131 + seed) % 251);
}

/* Writes the pattern into fd until its buffers are full; returns how much. */
static inline size_t stuff(int fd, unsigned seed)
{
	unsigned char chunk[4096];
	size_t total = 0;
	int fl = fcntl(fd, F_GETFL);
	fcntl(fd, F_SETFL, fl | O_NONBLOCK);
	for (;;) {
		for (size_t i = 0; i < sizeof chunk; i++)
			chunk[i] = pattern(total + i, seed);
		ssize_t n = write(fd, chunk, sizeof chunk);
		if (n < 0) {
			if (errno != EAGAIN)
				ferry_die("setup: write: %s", strerror(errno));
			/* Let loopback deliver what it can, then try again once. */
			ferry_sleep_ms(20);
			n = write(fd, chunk, sizeof chunk);
			if (n < 0)
				break;
		}
		total += (size_t)n;
	}
	fcntl(fd, F_SETFL, fl);
	return total;
}

/*
 * Reads exactly `total` bytes of the pattern, then expects EOF if `eof`;
 * each read waits at most 3 s.  Returns 0 if all is well.
 */
static inline int drain(const char *who, int fd, size_t total, unsigned seed, int eof)
{
	unsigned char chunk[4096];
	size_t got = 0;
	while (got < total) {
		struct pollfd p = { .fd = fd, .events = POLLIN };
		if (poll(&p, 1, 3000) != 1) {
			ferry_fail("%s: only %zu of %zu bytes arrived", who, got, total);
			return -1;
		}
		size_t want = total - got < sizeof chunk ? total - got : sizeof chunk;
		ssize_t n = read(fd, chunk, want);
		if (n <= 0) {
			ferry_fail("%s: read after %zu of %zu bytes: %zd (%s)", who, got, total, n, strerror(errno));
			return -1;
		}
		for (ssize_t i = 0; i < n; i++) {
			if (chunk[i] != pattern(got + (size_t)i, seed)) {
				ferry_fail("%s: byte %zu is %u, expected %u", who, got + (size_t)i, chunk[i],
					   pattern(got + (size_t)i, seed));
				return -1;
			}
		}
		got += (size_t)n;
	}
	if (eof) {
		struct pollfd p = { .fd = fd, .events = POLLIN };
		ssize_t n = poll(&p, 1, 3000) == 1 ? read(fd, chunk, sizeof chunk) : -2;
		if (n != 0) {
			ferry_fail("%s: expected EOF after %zu bytes, read gave %zd", who, total, n);
			return -1;
		}
	}
	return 0;
}

#endif
