/*
 * sys_blocked_futex: tasks blocked in futex waits.
 *
 * Sets up thread A in FUTEX_WAIT (private, no timeout), thread B in
 * FUTEX_WAIT_BITSET with an absolute CLOCK_REALTIME timeout 60 s ahead, and
 * a forked child in a shared (non-private) FUTEX_WAIT on a word in
 * MAP_SHARED memory.
 * Verifies: after go, each waiter is still waiting on its futex word:
 * FUTEX_WAKE on each word wakes exactly 1 task; each wait returns 0, never
 * EINTR or ETIMEDOUT.
 */
#include "ferry_test.h"
#include <linux/futex.h>

static long futex(volatile uint32_t *uaddr, int op, uint32_t val, const struct timespec *ts, uint32_t val3)
{
	return syscall(SYS_futex, uaddr, op, val, ts, NULL, val3);
}

struct waiter {
	volatile uint32_t word;
	pid_t tid;
	long rc;
	int err;
};
static struct waiter a, b;

static void *wait_plain(void *arg)
{
	struct waiter *x = arg;
	x->tid = ferry_gettid();
	do {
		x->rc = futex(&x->word, FUTEX_WAIT_PRIVATE, 0, NULL, 0);
		x->err = x->rc < 0 ? errno : 0;
	} while (x->rc < 0 && x->err == EAGAIN && x->word == 0);
	return NULL;
}

static void *wait_bitset(void *arg)
{
	struct waiter *x = arg;
	x->tid = ferry_gettid();
	struct timespec dl;
	clock_gettime(CLOCK_REALTIME, &dl);
	dl.tv_sec += 60;
	x->rc = futex(&x->word, FUTEX_WAIT_BITSET_PRIVATE | FUTEX_CLOCK_REALTIME, 0, &dl, 0x0f0f0f0f);
	x->err = x->rc < 0 ? errno : 0;
	return NULL;
}

static void check(const char *who, struct waiter *x)
{
	FERRY_CHECK(x->err != EINTR, "%s: futex wait failed with EINTR", who);
	FERRY_CHECK(x->err != ETIMEDOUT, "%s: futex wait timed out", who);
	FERRY_CHECK(x->rc == 0, "%s: futex wait returned %ld (%s)", who, x->rc, strerror(x->err));
}

int main(void)
{
	struct waiter *sh = FERRY_PTR(mmap(NULL, 4096, PROT_READ | PROT_WRITE,
					   MAP_SHARED | MAP_ANONYMOUS, -1, 0));
	pid_t child = FERRY_SYS(fork());
	if (child == 0) {
		do {
			sh->rc = futex(&sh->word, FUTEX_WAIT, 0, NULL, 0);
			sh->err = sh->rc < 0 ? errno : 0;
		} while (sh->rc < 0 && sh->err == EAGAIN && sh->word == 0);
		check("child (shared futex)", sh);
		ferry_child_finish();
	}
	pthread_t ta, tb;
	if (pthread_create(&ta, NULL, wait_plain, &a) || pthread_create(&tb, NULL, wait_bitset, &b))
		ferry_die("pthread_create");
	FERRY_WAIT_UNTIL(a.tid && b.tid, 5000);
	if (!ferry_wait_blocked(a.tid, SYS_futex, SYS_futex, 5000) ||
	    !ferry_wait_blocked(b.tid, SYS_futex, SYS_futex, 5000) ||
	    !ferry_wait_blocked_in(child, child, SYS_futex, SYS_futex, 5000))
		ferry_die("waiters not blocked in futex()");

	ferry_ready();
	ferry_wait_go();

	FERRY_CHECK(ferry_wait_blocked(a.tid, SYS_futex, SYS_futex, 3000), "thread A not in futex() after go");
	/* B's wait has a timeout: once interrupted it is resumed as restart_syscall. */
	FERRY_CHECK(ferry_wait_blocked(b.tid, SYS_futex, SYS_restart_syscall, 3000),
		    "thread B not in futex() after go");
	FERRY_CHECK(ferry_wait_blocked_in(child, child, SYS_futex, SYS_futex, 3000),
		    "child not in futex() after go");
	a.word = 1;
	FERRY_CHECK_EQ("tasks woken on A's word", 1, futex(&a.word, FUTEX_WAKE_PRIVATE, 1, NULL, 0));
	b.word = 1;
	FERRY_CHECK_EQ("tasks woken on B's word", 1,
		       futex(&b.word, FUTEX_WAKE_BITSET_PRIVATE, 1, NULL, 0x0f0f0f0f));
	sh->word = 1;
	FERRY_CHECK_EQ("tasks woken on the shared word", 1, futex(&sh->word, FUTEX_WAKE, 1, NULL, 0));
	pthread_join(ta, NULL);
	pthread_join(tb, NULL);
	check("thread A (FUTEX_WAIT)", &a);
	check("thread B (FUTEX_WAIT_BITSET, abs timeout)", &b);
	ferry_reap_child(child, "child", 0, 5000);
	ferry_finish();
}
