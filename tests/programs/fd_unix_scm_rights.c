/*
 * fd_unix_scm_rights: descriptors in flight (SCM_RIGHTS) in UNIX sockets'
 * receive queues, several deep and of several kinds.
 *
 * Sets up a stream pair S (s0 -> s1) whose queue holds, in order:
 *   "hdr1"               no descriptors (the next message's bytes must not
 *                        bring its descriptors early)
 *   "body"  [W, F]       the write end of pipe P (whose read end R the
 *                        process keeps) and regular file $T/data (offset 3,
 *                        then closed: only in flight)
 *   "tail"               no descriptors
 *   "mfd"   [M]          a memfd with 3000 bytes, closed here
 *   "sock"  [d0]         one end of datagram pair D, still held too
 *   "nest"  [n1]         one end of stream pair N, closed here; n1's own
 *                        queue holds "inner" [R2], the read end of pipe P2
 *                        (closed here; "nested" waits in it)
 * D's d1 holds "self" [d1] (the socket carries itself) and "peer" [d0].
 * A seqpacket pair Q holds "dir" [the directory $T, opened O_DIRECTORY] and
 * "ghost" [$T/gone, a file deleted since, only in flight].
 * Verifies: every message comes back with its descriptors and none early,
 * each descriptor is the same object (the same description as the one the
 * process holds (kcmp), the file's inode and offset, the memfd's name and
 * contents, a pipe still joined to its other end), the sockets in flight still work and carry
 * their own queues, and the process's fd table is unchanged (nothing in
 * flight leaked into it).
 */
#include "ferry_test.h"
#include <sys/socket.h>
#include <sys/un.h>

static void send_fds(int s, const char *msg, const int *fds, int n)
{
	struct iovec iov = { .iov_base = (void *)msg, .iov_len = strlen(msg) };
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int) * 4)];
	} u;
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
	if (n > 0) {
		memset(&u, 0, sizeof u);
		mh.msg_control = u.buf;
		mh.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)n);
		struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)n);
		memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)n);
	}
	if (sendmsg(s, &mh, 0) != (ssize_t)strlen(msg))
		ferry_die("sendmsg %s: %s", msg, strerror(errno));
}

/* Receives exactly strlen(want) bytes; returns how many descriptors came (into fds). */
static int recv_fds(int s, const char *what, const char *want, int *fds, int max)
{
	char data[64] = "";
	size_t len = strlen(want);
	struct iovec iov = { .iov_base = data, .iov_len = len };
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int) * 8)];
	} u;
	memset(&u, 0, sizeof u);
	struct msghdr mh = { .msg_iov = &iov,
			     .msg_iovlen = 1,
			     .msg_control = u.buf,
			     .msg_controllen = sizeof u.buf };
	ssize_t n = recvmsg(s, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
	FERRY_CHECK_EQ(what, (long)len, (long)n);
	FERRY_CHECK_EQ_STR(what, want, data);
	int got = 0;
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
		if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
			continue;
		int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
		for (int i = 0; i < k; i++) {
			int fd;
			memcpy(&fd, CMSG_DATA(c) + sizeof(int) * (size_t)i, sizeof fd);
			if (got < max)
				fds[got++] = fd;
			else
				close(fd);
		}
	}
	FERRY_CHECK(!(mh.msg_flags & MSG_CTRUNC), "%s: control data truncated", what);
	return got;
}

/* Whether two descriptors of this process share one open file description. */
static int same_file(int a, int b)
{
	pid_t me = getpid();
	return syscall(SYS_kcmp, me, me, 0 /* KCMP_FILE */, a, b) == 0;
}

static ino_t ino_of(int fd)
{
	struct stat st;
	return fstat(fd, &st) == 0 ? st.st_ino : 0;
}

int main(void)
{
	int s[2], d[2], n[2], q[2], p[2], p2[2];
	FERRY_SYS(socketpair(AF_UNIX, SOCK_STREAM, 0, s));
	FERRY_SYS(socketpair(AF_UNIX, SOCK_DGRAM, 0, d));
	FERRY_SYS(socketpair(AF_UNIX, SOCK_STREAM, 0, n));
	FERRY_SYS(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, q));
	FERRY_SYS(pipe(p));
	FERRY_SYS(pipe(p2));
	char path[PATH_MAX];
	ferry_path(path, sizeof path, "data");
	int f = FERRY_SYS(open(path, O_RDWR | O_CREAT | O_TRUNC, 0600));
	FERRY_SYS(write(f, "0123456789", 10));
	FERRY_SYS(lseek(f, 3, SEEK_SET));
	ino_t f_ino = ino_of(f);
	int m = FERRY_SYS(memfd_create("in-flight", 0));
	static char mdata[3000];
	ferry_fill(mdata, sizeof mdata, 77);
	FERRY_SYS(write(m, mdata, sizeof mdata));
	int dir = FERRY_SYS(open(ferry_dir(), O_RDONLY | O_DIRECTORY));
	char gone[PATH_MAX];
	ferry_path(gone, sizeof gone, "gone");
	int gh = FERRY_SYS(open(gone, O_RDWR | O_CREAT | O_TRUNC, 0640));
	FERRY_SYS(write(gh, "ghost-data", 10));
	FERRY_SYS(unlink(gone));
	ino_t dir_ino = ino_of(dir);

	send_fds(s[0], "hdr1", NULL, 0);
	send_fds(s[0], "body", (int[]){ p[1], f }, 2);
	send_fds(s[0], "tail", NULL, 0);
	send_fds(s[0], "mfd", (int[]){ m }, 1);
	send_fds(s[0], "sock", (int[]){ d[0] }, 1);
	FERRY_SYS(write(p2[1], "nested", 6));
	send_fds(n[0], "inner", (int[]){ p2[0] }, 1);
	send_fds(s[0], "nest", (int[]){ n[1] }, 1);
	send_fds(d[0], "self", (int[]){ d[1] }, 1);
	send_fds(d[0], "peer", (int[]){ d[0] }, 1);
	send_fds(q[0], "dir", (int[]){ dir }, 1);
	send_fds(q[0], "ghost", (int[]){ gh }, 1);
	/* Only in flight from here on. */
	close(p[1]);
	close(f);
	close(m);
	close(n[1]);
	close(p2[0]);
	close(dir);
	close(gh);

	int before[64];
	int nbefore = ferry_list_fds(before, 64);
	ferry_ready();
	ferry_wait_go();
	ferry_check_fds_same(before, nbefore);

	int got[8], k;
	char buf[64];
	k = recv_fds(s[1], "hdr1", "hdr1", got, 8);
	FERRY_CHECK_EQ("descriptors with hdr1", 0, k);
	k = recv_fds(s[1], "body", "body", got, 8);
	FERRY_CHECK_EQ("descriptors with body", 2, k);
	if (k == 2) {
		FERRY_CHECK_EQ("W is the write end", O_WRONLY, fcntl(got[0], F_GETFL) & O_ACCMODE);
		FERRY_CHECK_EQ("write through W", 3, write(got[0], "xyz", 3));
		memset(buf, 0, sizeof buf);
		FERRY_CHECK_EQ("read from R", 3, read(p[0], buf, sizeof buf));
		FERRY_CHECK_EQ_STR("bytes through the pipe", "xyz", buf);
		FERRY_CHECK_EQ("file inode", (long)f_ino, (long)ino_of(got[1]));
		FERRY_CHECK_EQ("file offset", 3, lseek(got[1], 0, SEEK_CUR));
		FERRY_CHECK_EQ("file mode", O_RDWR, fcntl(got[1], F_GETFL) & O_ACCMODE);
		memset(buf, 0, sizeof buf);
		FERRY_CHECK_EQ("read the file", 7, read(got[1], buf, sizeof buf));
		FERRY_CHECK_EQ_STR("file contents", "3456789", buf);
		close(got[0]);
		close(got[1]);
	}
	k = recv_fds(s[1], "tail", "tail", got, 8);
	FERRY_CHECK_EQ("descriptors with tail", 0, k);
	k = recv_fds(s[1], "mfd", "mfd", got, 8);
	FERRY_CHECK_EQ("descriptors with mfd", 1, k);
	if (k == 1) {
		static char back[3000];
		FERRY_CHECK_EQ("memfd read", 3000, pread(got[0], back, sizeof back, 0));
		FERRY_CHECK_MEM("memfd contents", mdata, back, sizeof back);
		FERRY_CHECK_EQ_STR("memfd name", "/memfd:in-flight (deleted)",
				   ferry_fd_link(got[0], buf, sizeof buf));
		close(got[0]);
	}
	k = recv_fds(s[1], "sock", "sock", got, 8);
	FERRY_CHECK_EQ("descriptors with sock", 1, k);
	if (k == 1) {
		FERRY_CHECK(same_file(got[0], d[0]), "the socket in flight is not d0");
		close(got[0]);
	}
	k = recv_fds(s[1], "nest", "nest", got, 8);
	FERRY_CHECK_EQ("descriptors with nest", 1, k);
	if (k == 1) {
		int n1 = got[0];
		k = recv_fds(n1, "inner", "inner", got, 8);
		FERRY_CHECK_EQ("descriptors with inner", 1, k);
		if (k == 1) {
			memset(buf, 0, sizeof buf);
			FERRY_CHECK_EQ("read nested pipe", 6, read(got[0], buf, sizeof buf));
			FERRY_CHECK_EQ_STR("nested pipe bytes", "nested", buf);
			close(got[0]);
		}
		FERRY_CHECK_EQ("n0 -> n1 after restore", 2, write(n[0], "ok", 2));
		memset(buf, 0, sizeof buf);
		FERRY_CHECK_EQ("n1 receives", 2, recv(n1, buf, sizeof buf, MSG_DONTWAIT));
		close(n1);
	}
	FERRY_CHECK(recv(s[1], buf, sizeof buf, MSG_DONTWAIT) < 0 && errno == EAGAIN,
		    "more queued on s1");
	k = recv_fds(d[1], "self", "self", got, 8);
	FERRY_CHECK_EQ("descriptors with self", 1, k);
	if (k == 1) {
		FERRY_CHECK(same_file(got[0], d[1]), "d1 does not carry itself");
		close(got[0]);
	}
	k = recv_fds(d[1], "peer", "peer", got, 8);
	FERRY_CHECK_EQ("descriptors with peer", 1, k);
	if (k == 1) {
		FERRY_CHECK(same_file(got[0], d[0]), "d1 does not carry d0");
		close(got[0]);
	}
	FERRY_CHECK_EQ("d0 -> d1 after restore", 2, send(d[0], "hi", 2, 0));
	FERRY_CHECK_EQ("d1 receives", 2, recv(d[1], buf, sizeof buf, MSG_DONTWAIT));
	k = recv_fds(q[1], "dir", "dir", got, 8);
	FERRY_CHECK_EQ("descriptors with dir", 1, k);
	if (k == 1) {
		FERRY_CHECK_EQ("directory inode", (long)dir_ino, (long)ino_of(got[0]));
		FERRY_CHECK(faccessat(got[0], "data", F_OK, 0) == 0, "data not found through dir");
		close(got[0]);
	}
	k = recv_fds(q[1], "ghost", "ghost", got, 8);
	FERRY_CHECK_EQ("descriptors with ghost", 1, k);
	if (k == 1) {
		memset(buf, 0, sizeof buf);
		FERRY_CHECK_EQ("read the deleted file", 10, pread(got[0], buf, sizeof buf, 0));
		FERRY_CHECK_EQ_STR("deleted file's contents", "ghost-data", buf);
		char want[PATH_MAX + 16];
		snprintf(want, sizeof want, "%s (deleted)", gone);
		char lk[PATH_MAX + 16];
		FERRY_CHECK_EQ_STR("deleted file's link", want, ferry_fd_link(got[0], lk, sizeof lk));
		FERRY_CHECK(access(gone, F_OK) < 0, "the deleted file is back under its name");
		close(got[0]);
	}
	FERRY_CHECK_EQ("s0 -> s1 after restore", 2, write(s[0], "ok", 2));
	FERRY_CHECK_EQ("s1 receives", 2, recv(s[1], buf, sizeof buf, MSG_DONTWAIT));
	ferry_finish();
}
