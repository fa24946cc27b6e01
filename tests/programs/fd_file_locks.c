/*
 * fd_file_locks: file locks held by the process.
 *
 * Sets up flock(LOCK_EX) on file "a"; a POSIX (fcntl F_SETLK) write lock on
 * bytes 0..99 of file "b"; an OFD read lock (F_OFD_SETLK) on bytes
 * 200..299 of "b".
 * Verifies (from a child forked after restore, with its own opens): "a" is
 * flock'ed (LOCK_EX|LOCK_NB fails with EWOULDBLOCK); F_GETLK on b[0..99]
 * reports a write lock owned by our pid; F_OFD_GETLK for a write lock on
 * b[200..299] reports a read lock; b[100..199] is free.
 */
#include "ferry_test.h"
#include <sys/file.h>

int main(void)
{
	char pa[PATH_MAX], pb[PATH_MAX];
	ferry_path(pa, sizeof pa, "a");
	ferry_path(pb, sizeof pb, "b");
	int a = FERRY_SYS(open(pa, O_RDWR | O_CREAT, 0644));
	int b = FERRY_SYS(open(pb, O_RDWR | O_CREAT, 0644));
	FERRY_SYS(ftruncate(b, 4096));
	FERRY_SYS(flock(a, LOCK_EX));
	struct flock f;
	ferry_lock_range(&f, F_WRLCK, 0, 100);
	FERRY_SYS(fcntl(b, F_SETLK, &f));
	int bo = FERRY_SYS(open(pb, O_RDWR));
	ferry_lock_range(&f, F_RDLCK, 200, 100);
	FERRY_SYS(fcntl(bo, F_OFD_SETLK, &f));

	ferry_ready();
	ferry_wait_go();

	pid_t parent = getpid();
	pid_t c = FERRY_SYS(fork());
	if (c == 0) {
		int ca = open(pa, O_RDWR), cb = open(pb, O_RDWR);
		errno = 0;
		FERRY_CHECK(flock(ca, LOCK_EX | LOCK_NB) < 0 && errno == EWOULDBLOCK,
			    "flock on a is gone (errno %d)", errno);
		ferry_lock_range(&f, F_WRLCK, 0, 100);
		fcntl(cb, F_GETLK, &f);
		FERRY_CHECK_EQ("POSIX lock type on b[0..99]", F_WRLCK, f.l_type);
		FERRY_CHECK_EQ("POSIX lock owner", parent, f.l_pid);
		ferry_lock_range(&f, F_WRLCK, 200, 100);
		fcntl(cb, F_OFD_GETLK, &f);
		FERRY_CHECK_EQ("OFD lock type on b[200..299]", F_RDLCK, f.l_type);
		FERRY_CHECK_EQ("OFD lock l_pid", -1, f.l_pid);
		ferry_lock_range(&f, F_WRLCK, 100, 100);
		fcntl(cb, F_GETLK, &f);
		FERRY_CHECK_EQ("b[100..199] free", F_UNLCK, f.l_type);
		ferry_child_finish();
	}
	ferry_reap_child(c, "lock probe child", 0, 5000);
	ferry_finish();
}
