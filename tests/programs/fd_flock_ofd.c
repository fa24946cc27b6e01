/*
 * fd_flock_ofd: flock and OFD locks of open file descriptions (no POSIX
 * locks), one of them shared with a child.
 *
 * Sets up flock(LOCK_SH) on file "a" through a description inherited by child
 * K (which waits for go), an OFD write lock (F_OFD_SETLK) on bytes 0..9 of
 * "b", and an OFD read lock on bytes 10.. to the end of "b".
 * Verifies (from a child forked after restore, with its own opens): "a" takes
 * LOCK_SH but not LOCK_EX|LOCK_NB; F_OFD_GETLK reports the write lock on
 * b[0..9] and the read lock on b[10..EOF] (l_pid -1); once K and we close
 * our descriptors of "a", LOCK_EX succeeds.
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
	FERRY_SYS(flock(a, LOCK_SH));
	struct flock f;
	ferry_lock_range(&f, F_WRLCK, 0, 10);
	FERRY_SYS(fcntl(b, F_OFD_SETLK, &f));
	ferry_lock_range(&f, F_RDLCK, 10, 0);
	FERRY_SYS(fcntl(b, F_OFD_SETLK, &f));
	pid_t k = FERRY_SYS(fork());
	if (k == 0) {
		ferry_wait_go();
		close(a);
		ferry_child_finish();
	}

	ferry_ready();
	ferry_wait_go();

	pid_t c = FERRY_SYS(fork());
	if (c == 0) {
		int ca = open(pa, O_RDWR), cb = open(pb, O_RDWR);
		errno = 0;
		FERRY_CHECK(flock(ca, LOCK_EX | LOCK_NB) < 0 && errno == EWOULDBLOCK,
			    "the shared flock on a is gone (errno %d)", errno);
		FERRY_CHECK(flock(ca, LOCK_SH | LOCK_NB) == 0, "a: LOCK_SH refused (errno %d)", errno);
		ferry_lock_range(&f, F_RDLCK, 0, 10);
		fcntl(cb, F_OFD_GETLK, &f);
		FERRY_CHECK_EQ("OFD lock type on b[0..9]", F_WRLCK, f.l_type);
		FERRY_CHECK_EQ("OFD lock l_pid", -1, f.l_pid);
		ferry_lock_range(&f, F_WRLCK, 100, 10);
		fcntl(cb, F_OFD_GETLK, &f);
		FERRY_CHECK_EQ("OFD lock type on b[10..]", F_RDLCK, f.l_type);
		FERRY_CHECK_EQ("OFD lock start", 10, (int)f.l_start);
		FERRY_CHECK_EQ("OFD lock to EOF", 0, (int)f.l_len);
		ferry_child_finish();
	}
	ferry_reap_child(c, "lock probe child", 0, 5000);
	ferry_reap_child(k, "K", 0, 5000);
	close(a);
	int a2 = FERRY_SYS(open(pa, O_RDWR));
	FERRY_CHECK(flock(a2, LOCK_EX | LOCK_NB) == 0,
		    "a: LOCK_EX refused once every holder closed it (errno %d)", errno);
	ferry_finish();
}
