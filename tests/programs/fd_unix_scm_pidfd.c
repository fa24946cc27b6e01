/*
 * fd_unix_scm_pidfd: pidfds of processes of the tree in flight (SCM_RIGHTS),
 * as a supervisor hands a worker's pidfd to a reaper.
 *
 * Forks a child K that waits for go and exits with code 7, and a child Z that
 * exits at once with code 9 and is left a zombie.  Sets up a UNIX stream pair
 * (s0 -> s1) whose queue holds "ab" (no descriptors), "P" with a
 * non-blocking pidfd of K attached, then "cd"; and a datagram pair
 * (d0 -> d1) whose queue holds "Q" with a pidfd of the process itself, then
 * "Z" with a pidfd of Z.  The pidfds are closed here: they live only in the
 * queues.
 * Verifies: "ab" is read first and alone, "P" then comes with one
 * descriptor, a pidfd (fdinfo Pid) of K, non-blocking; "cd" follows; "Q"
 * comes with a pidfd of the process itself; once K is told to go, polling
 * the pidfd reports its end and waitid(P_PIDFD) reaps it with code 7; "Z"
 * comes with a pidfd of Z, through which waitid reaps it with code 9.
 * The fd table is unchanged.
 */
#include "ferry_test.h"
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>

#ifndef P_PIDFD
#define P_PIDFD 3
#endif

static int pidfd_open(pid_t pid, unsigned flags)
{
	return (int)syscall(SYS_pidfd_open, pid, flags);
}

static void send_with(int s, const char *data, int fd)
{
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int))];
	} u;
	memset(&u, 0, sizeof u);
	struct iovec iov = { .iov_base = (void *)data, .iov_len = strlen(data) };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
	if (fd >= 0) {
		mh.msg_control = u.buf;
		mh.msg_controllen = sizeof u.buf;
		struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(sizeof(int));
		memcpy(CMSG_DATA(c), &fd, sizeof fd);
	}
	FERRY_SYS(sendmsg(s, &mh, 0));
}

/* Reads up to `size` bytes of one message; returns the descriptor that came with it, or -1. */
static int recv_with(int s, const char *what, const char *want)
{
	char data[16] = "";
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int) * 4)];
	} u;
	memset(&u, 0, sizeof u);
	struct iovec iov = { .iov_base = data, .iov_len = strlen(want) };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
			     .msg_controllen = sizeof u.buf };
	ssize_t n = recvmsg(s, &mh, MSG_DONTWAIT);
	FERRY_CHECK(n == (ssize_t)strlen(want) && memcmp(data, want, n) == 0,
		    "%s: read %zd bytes \"%.16s\", expected \"%s\"", what, n, data, want);
	struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
	if (!c)
		return -1;
	FERRY_CHECK(c->cmsg_type == SCM_RIGHTS && c->cmsg_len == CMSG_LEN(sizeof(int)),
		    "%s: not exactly one descriptor", what);
	int fd;
	memcpy(&fd, CMSG_DATA(c), sizeof fd);
	return fd;
}

static long pidfd_pid(int fd)
{
	char v[32];
	if (ferry_fdinfo_field(fd, "Pid", v, sizeof v) != 0)
		return -1;
	return strtol(v, NULL, 10);
}

int main(void)
{
	pid_t k = FERRY_SYS(fork());
	if (k == 0) {
		ferry_wait_go();
		_exit(7);
	}
	pid_t z = FERRY_SYS(fork());
	if (z == 0)
		_exit(9);
	siginfo_t zi;
	FERRY_SYS(waitid(P_PID, z, &zi, WEXITED | WNOWAIT));
	int s[2], d[2];
	FERRY_SYS(socketpair(AF_UNIX, SOCK_STREAM, 0, s));
	FERRY_SYS(socketpair(AF_UNIX, SOCK_DGRAM, 0, d));
	int pk = FERRY_SYS(pidfd_open(k, O_NONBLOCK));
	int pm = FERRY_SYS(pidfd_open(getpid(), 0));
	int pz = FERRY_SYS(pidfd_open(z, 0));
	send_with(s[0], "ab", -1);
	send_with(s[0], "P", pk);
	send_with(s[0], "cd", -1);
	send_with(d[0], "Q", pm);
	send_with(d[0], "Z", pz);
	close(pk);
	close(pm);
	close(pz);

	int fds[64];
	int nfds = ferry_list_fds(fds, 64);
	ferry_ready();
	ferry_wait_go();
	ferry_check_fds_same(fds, nfds);

	int none = recv_with(s[1], "first", "ab");
	FERRY_CHECK(none < 0, "\"ab\" came with a descriptor");
	int got_k = recv_with(s[1], "second", "P");
	int more = recv_with(s[1], "third", "cd");
	FERRY_CHECK(more < 0, "\"cd\" came with a descriptor");
	int got_m = recv_with(d[1], "datagram", "Q");
	int got_z = recv_with(d[1], "zombie's", "Z");
	FERRY_CHECK(got_z >= 0, "\"Z\" came without its pidfd");
	if (got_z >= 0) {
		FERRY_CHECK_EQ("Z's pidfd Pid", (long)z, pidfd_pid(got_z));
		siginfo_t si;
		memset(&si, 0, sizeof si);
		FERRY_CHECK_EQ("waitid(P_PIDFD) on Z", 0, waitid(P_PIDFD, got_z, &si, WEXITED | WNOHANG));
		FERRY_CHECK_EQ("Z's pid", (long)z, (long)si.si_pid);
		FERRY_CHECK_EQ("Z's exit code", 9, si.si_status);
	}
	FERRY_CHECK(got_k >= 0, "\"P\" came without its pidfd");
	FERRY_CHECK(got_m >= 0, "\"Q\" came without its pidfd");
	if (got_k < 0 || got_m < 0) {
		kill(k, SIGKILL);
		ferry_reap_child(k, "K", -1, 5000);
		ferry_finish();
	}
	char l[64];
	ferry_fd_link(got_k, l, sizeof l);
	FERRY_CHECK(strcmp(l, "anon_inode:[pidfd]") == 0, "K's descriptor is %s", l);
	FERRY_CHECK_EQ("K's pidfd Pid", (long)k, pidfd_pid(got_k));
	FERRY_CHECK(ferry_fdinfo_flags(got_k) & O_NONBLOCK, "K's pidfd is not non-blocking");
	FERRY_CHECK_EQ("own pidfd Pid", (long)getpid(), pidfd_pid(got_m));
	FERRY_CHECK(!(ferry_fdinfo_flags(got_m) & O_NONBLOCK), "own pidfd is non-blocking");

	struct pollfd p = { .fd = got_k, .events = POLLIN };
	/* K saw go as we did: it ends now. */
	FERRY_CHECK_EQ("poll until K ends", 1, poll(&p, 1, 5000));
	siginfo_t si;
	memset(&si, 0, sizeof si);
	FERRY_CHECK_EQ("waitid(P_PIDFD)", 0, waitid(P_PIDFD, got_k, &si, WEXITED));
	FERRY_CHECK_EQ("K's pid", (long)k, (long)si.si_pid);
	FERRY_CHECK_EQ("K's exit code", 7, si.si_status);
	ferry_finish();
}
