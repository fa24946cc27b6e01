/*
 * fd_file_lease_write: a write lease (fcntl F_SETLEASE F_WRLCK), beside a
 * read lease.
 *
 * Sets up a read lease on file "r" (opened read-only) and a write lease on
 * file "w" (opened read-write, its only opener), F_SETSIG SIGRTMIN+4 on "w"
 * (the lease-break signal), SIGIO and SIGRTMIN+4 blocked.
 * Verifies: F_GETLEASE of each; a child opening "r" for writing and "w" for
 * reading (O_NONBLOCK) is refused with EWOULDBLOCK, the leases being broken:
 * SIGIO for "r" and SIGRTMIN+4 with si_fd "w" reach this process, and
 * F_GETLEASE then reports the lease type being broken to.
 */
#include "ferry_test.h"

static int wait_sig(int sig, siginfo_t *si, int ms)
{
	sigset_t s;
	sigemptyset(&s);
	sigaddset(&s, sig);
	struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };
	for (;;) {
		int r = sigtimedwait(&s, si, &ts);
		if (r < 0 && errno == EINTR)
			continue;
		return r;
	}
}

static int try_open(const char *name, int flags)
{
	int fd = open(name, flags | O_NONBLOCK);
	if (fd >= 0) {
		close(fd);
		return 0;
	}
	return errno;
}

int main(void)
{
	int sig_w = SIGRTMIN + 4;
	sigset_t s;
	sigemptyset(&s);
	sigaddset(&s, SIGIO);
	sigaddset(&s, sig_w);
	sigprocmask(SIG_BLOCK, &s, NULL);
	int c = FERRY_SYS(open("r", O_CREAT | O_WRONLY, 0644));
	FERRY_SYS(write(c, "read lease", 10));
	close(c);
	c = FERRY_SYS(open("w", O_CREAT | O_WRONLY, 0644));
	FERRY_SYS(write(c, "write lease", 11));
	close(c);
	int r = FERRY_SYS(open("r", O_RDONLY));
	int w = FERRY_SYS(open("w", O_RDWR));
	FERRY_SYS(fcntl(r, F_SETLEASE, F_RDLCK));
	FERRY_SYS(fcntl(w, F_SETLEASE, F_WRLCK));
	FERRY_SYS(fcntl(w, F_SETSIG, sig_w));

	ferry_ready();
	ferry_wait_go();

	FERRY_CHECK_EQ("F_GETLEASE r", F_RDLCK, fcntl(r, F_GETLEASE));
	FERRY_CHECK_EQ("F_GETLEASE w", F_WRLCK, fcntl(w, F_GETLEASE));
	FERRY_CHECK_EQ("F_GETSIG w", sig_w, fcntl(w, F_GETSIG));
	pid_t child = FERRY_SYS(fork());
	if (child == 0) {
		FERRY_CHECK_EQ("child: open r for writing", EWOULDBLOCK, try_open("r", O_WRONLY));
		FERRY_CHECK_EQ("child: open w for reading", EWOULDBLOCK, try_open("w", O_RDONLY));
		ferry_child_finish();
	}
	ferry_reap_child(child, "child", 0, 5000);
	siginfo_t si;
	memset(&si, 0, sizeof si);
	FERRY_CHECK_EQ("lease break of r", SIGIO, wait_sig(SIGIO, &si, 5000));
	memset(&si, 0, sizeof si);
	FERRY_CHECK_EQ("lease break of w", sig_w, wait_sig(sig_w, &si, 5000));
	FERRY_CHECK_EQ("lease break of w: si_fd", w, si.si_fd);
	FERRY_CHECK_EQ("F_GETLEASE r while broken", F_UNLCK, fcntl(r, F_GETLEASE));
	FERRY_CHECK_EQ("F_GETLEASE w while broken", F_RDLCK, fcntl(w, F_GETLEASE));
	FERRY_SYS(fcntl(r, F_SETLEASE, F_UNLCK));
	FERRY_SYS(fcntl(w, F_SETLEASE, F_UNLCK));
	ferry_finish();
}
