/*
 * fd_pipe_buffered: pipes with data in them.
 *
 * Sets up: P1 (both ends here, F_SETPIPE_SZ 128 KiB, read end O_NONBLOCK)
 * holding 90 KiB of unread pattern; P2 whose write end is closed after
 * "tail" was written (reader must see "tail" then EOF); P3 whose read end is
 * closed (write gives EPIPE); P4 whose write end is held by a child that
 * wrote "from-child"; P5 a packet-mode pipe (O_DIRECT) holding packets of
 * 10, 20 and 30 bytes.
 * Verifies: same fds and flags, each pipe's ends share one inode, pipe
 * size, every buffered byte exactly once in order, EOF/EPIPE semantics,
 * packet boundaries, and the ends are still connected (the child writes
 * "after-go" and exits; parent reads it, then EOF).
 */
#include "ferry_test.h"

#define BIG (100 * 1024)
#define READ_FIRST (10 * 1024)

static unsigned char data[BIG], buf[BIG];

static void same_pipe(const char *what, int r, int w)
{
	struct stat a, b;
	fstat(r, &a);
	fstat(w, &b);
	FERRY_CHECK(S_ISFIFO(a.st_mode) && a.st_ino == b.st_ino, "%s: ends are not the same pipe", what);
}

int main(void)
{
	signal(SIGPIPE, SIG_IGN);
	int p1[2], p2[2], p3[2], p4[2], p5[2];
	FERRY_SYS(pipe(p1));
	FERRY_SYS(fcntl(p1[0], F_SETPIPE_SZ, 128 * 1024));
	ferry_fill(data, BIG, 180);
	for (size_t off = 0; off < BIG; off += 4096)
		FERRY_SYS(write(p1[1], data + off, BIG - off < 4096 ? BIG - off : 4096));
	FERRY_SYS(read(p1[0], buf, READ_FIRST));
	FERRY_SYS(fcntl(p1[0], F_SETFL, O_NONBLOCK));

	FERRY_SYS(pipe(p2));
	FERRY_SYS(write(p2[1], "tail", 4));
	close(p2[1]);
	FERRY_SYS(pipe(p3));
	close(p3[0]);

	FERRY_SYS(pipe(p4));
	pid_t child = FERRY_SYS(fork());
	if (child == 0) {
		close(p4[0]);
		if (write(p4[1], "from-child", 10) != 10)
			ferry_fail("child: write");
		ferry_wait_go();
		if (write(p4[1], "after-go", 8) != 8)
			ferry_fail("child: write after go: %s", strerror(errno));
		ferry_child_finish();
	}
	close(p4[1]);

	FERRY_SYS(pipe2(p5, O_DIRECT));
	static char pk[30];
	memset(pk, 'p', sizeof pk);
	FERRY_SYS(write(p5[1], pk, 10));
	FERRY_SYS(write(p5[1], pk, 20));
	FERRY_SYS(write(p5[1], pk, 30));

	int fds_before[64];
	int nfds = ferry_list_fds(fds_before, 64);
	long fl[10];
	int all[10] = { p1[0], p1[1], p2[0], p3[1], p4[0], p5[0], p5[1] };
	for (int i = 0; i < 7; i++)
		fl[i] = ferry_fdinfo_flags(all[i]);
	long sz = fcntl(p1[0], F_GETPIPE_SZ);

	ferry_ready();
	ferry_wait_go();

	ferry_check_fds_same(fds_before, nfds);
	for (int i = 0; i < 7; i++) {
		char what[64];
		snprintf(what, sizeof what, "fd %d flags", all[i]);
		FERRY_CHECK_EQ_HEX(what, fl[i], ferry_fdinfo_flags(all[i]));
	}
	same_pipe("P1", p1[0], p1[1]);
	same_pipe("P5", p5[0], p5[1]);
	FERRY_CHECK_EQ("P1 pipe size", sz, fcntl(p1[0], F_GETPIPE_SZ));
	ssize_t got = 0, n;
	while ((n = read(p1[0], buf + got, BIG - (size_t)got)) > 0)
		got += n;
	FERRY_CHECK_EQ("P1 bytes buffered", BIG - READ_FIRST, got);
	FERRY_CHECK(n < 0 && errno == EAGAIN, "P1: after the data: read %zd, errno %d (want EAGAIN)", n, errno);
	FERRY_CHECK_MEM("P1 data", data + READ_FIRST, buf, (size_t)(got < BIG - READ_FIRST ? got : BIG - READ_FIRST));
	FERRY_CHECK_EQ("P1 write after restore", 3, write(p1[1], "abc", 3));
	FERRY_CHECK_EQ("P1 read after restore", 3, read(p1[0], buf, 10));
	FERRY_CHECK_MEM("P1 data after restore", "abc", buf, 3);

	char t[8] = "";
	FERRY_CHECK_EQ("P2 read", 4, read(p2[0], t, sizeof t));
	FERRY_CHECK_MEM("P2 data", "tail", t, 4);
	FERRY_CHECK_EQ("P2 EOF (no writers)", 0, read(p2[0], t, sizeof t));
	errno = 0;
	FERRY_CHECK(write(p3[1], "x", 1) < 0 && errno == EPIPE, "P3: write to a pipe without readers: errno %d",
		    errno);

	for (int len = 10; len <= 30; len += 10)
		FERRY_CHECK_EQ("P5 packet length", len, read(p5[0], buf, 100));

	char c[32] = "";
	ssize_t cn = 0;
	while (cn < 18 && (n = read(p4[0], c + cn, sizeof c - 1 - (size_t)cn)) > 0)
		cn += n;
	FERRY_CHECK_EQ_STR("P4 data from child", "from-childafter-go", c);
	ferry_reap_child(child, "child", 0, 5000);
	FERRY_CHECK_EQ("P4 EOF after the child exited", 0, read(p4[0], c, sizeof c));
	ferry_finish();
}
