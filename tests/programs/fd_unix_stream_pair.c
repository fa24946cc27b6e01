/*
 * fd_unix_stream_pair: connected AF_UNIX stream sockets with queued data.
 *
 * Sets up pair S: S0 sent 3000 bytes of pattern to S1 and S1 sent "reply"
 * to S0 (both unread), S0 has SO_SNDBUF/SO_RCVBUF set, S1 is O_NONBLOCK;
 * pair T: T0 sent "last" then shutdown(SHUT_WR).
 * Verifies: socket options and flags, SO_PEERCRED pid, queued bytes arrive
 * exactly once in order, both pairs are still connected to each other
 * (new data both ways), T1 reads "last" then EOF while T1 -> T0 still works.
 */
#include "ferry_test.h"
#include <sys/socket.h>

static int opt(int fd, int name)
{
	int v = -1;
	socklen_t l = sizeof v;
	getsockopt(fd, SOL_SOCKET, name, &v, &l);
	return v;
}

int main(void)
{
	int s[2], t[2];
	FERRY_SYS(socketpair(AF_UNIX, SOCK_STREAM, 0, s));
	FERRY_SYS(socketpair(AF_UNIX, SOCK_STREAM, 0, t));
	int sz = 200000;
	FERRY_SYS(setsockopt(s[0], SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz));
	sz = 150000;
	FERRY_SYS(setsockopt(s[0], SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz));
	static unsigned char data[3000], buf[4000];
	ferry_fill(data, sizeof data, 210);
	FERRY_SYS(write(s[0], data, sizeof data));
	FERRY_SYS(write(s[1], "reply", 5));
	FERRY_SYS(fcntl(s[1], F_SETFL, O_NONBLOCK));
	FERRY_SYS(write(t[0], "last", 4));
	FERRY_SYS(shutdown(t[0], SHUT_WR));
	int snd = opt(s[0], SO_SNDBUF), rcv = opt(s[0], SO_RCVBUF);
	long fl1 = ferry_fdinfo_flags(s[1]);

	ferry_ready();
	ferry_wait_go();

	FERRY_CHECK_EQ("S0 SO_TYPE", SOCK_STREAM, opt(s[0], SO_TYPE));
	FERRY_CHECK_EQ("S0 SO_SNDBUF", snd, opt(s[0], SO_SNDBUF));
	FERRY_CHECK_EQ("S0 SO_RCVBUF", rcv, opt(s[0], SO_RCVBUF));
	FERRY_CHECK_EQ_HEX("S1 flags", fl1, ferry_fdinfo_flags(s[1]));
	struct ucred cr;
	socklen_t l = sizeof cr;
	getsockopt(s[0], SOL_SOCKET, SO_PEERCRED, &cr, &l);
	FERRY_CHECK_EQ("S0 SO_PEERCRED pid", getpid(), cr.pid);
	ssize_t got = 0, n;
	while (got < (ssize_t)sizeof data && (n = read(s[1], buf + got, sizeof buf - (size_t)got)) > 0)
		got += n;
	FERRY_CHECK_EQ("bytes queued S0 -> S1", (ssize_t)sizeof data, got);
	FERRY_CHECK_MEM("data S0 -> S1", data, buf, sizeof data);
	FERRY_CHECK(read(s[1], buf, 1) < 0 && errno == EAGAIN, "extra data queued for S1");
	char r[8] = "";
	FERRY_CHECK_EQ("bytes queued S1 -> S0", 5, read(s[0], r, sizeof r));
	FERRY_CHECK_MEM("data S1 -> S0", "reply", r, 5);
	FERRY_CHECK_EQ("S0 -> S1 after restore", 2, write(s[0], "hi", 2));
	FERRY_CHECK_EQ("S1 reads it", 2, read(s[1], r, sizeof r));
	FERRY_CHECK_EQ("S1 -> S0 after restore", 2, write(s[1], "yo", 2));
	FERRY_CHECK_EQ("S0 reads it", 2, read(s[0], r, sizeof r));
	memset(r, 0, sizeof r);
	FERRY_CHECK_EQ("T1 reads queued data", 4, read(t[1], r, sizeof r));
	FERRY_CHECK_MEM("T0 -> T1", "last", r, 4);
	FERRY_CHECK_EQ("T1 EOF after peer's SHUT_WR", 0, read(t[1], r, sizeof r));
	FERRY_CHECK_EQ("T1 -> T0 still works", 3, write(t[1], "ack", 3));
	FERRY_CHECK_EQ("T0 reads it", 3, read(t[0], r, sizeof r));
	ferry_finish();
}
