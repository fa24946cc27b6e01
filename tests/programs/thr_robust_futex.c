/*
 * thr_robust_futex: robust futex lists (set_robust_list).
 *
 * Sets up a robust process-private mutex locked by a thread, and a robust
 * process-shared mutex (in MAP_SHARED memory) locked by a forked child.
 * Both owners keep the lock across the checkpoint and, after go, exit
 * without unlocking.
 * Verifies: each task's robust list head (get_robust_list) is unchanged,
 * and the kernel still cleans up at exit: locking each mutex afterwards
 * returns EOWNERDEAD (and it can be made consistent).
 */
#include "ferry_test.h"

struct shared {
	pthread_mutex_t m;
	volatile int locked;
};

static pthread_mutex_t tm;
static volatile int thread_locked, go_flag;
static volatile pid_t owner_tid;

static void robust_head(pid_t tid, void **head, size_t *len)
{
	*head = NULL;
	*len = 0;
	if (syscall(SYS_get_robust_list, tid, head, len) < 0)
		ferry_fail("get_robust_list(%d): %s", (int)tid, strerror(errno));
}

static void *owner(void *arg)
{
	(void)arg;
	owner_tid = ferry_gettid();
	if (pthread_mutex_lock(&tm))
		ferry_die("thread lock");
	thread_locked = 1;
	while (!go_flag)
		ferry_sleep_ms(5);
	return NULL; /* exits holding tm */
}

static void init_robust(pthread_mutex_t *m, int pshared)
{
	pthread_mutexattr_t a;
	pthread_mutexattr_init(&a);
	pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
	if (pshared)
		pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
	pthread_mutex_init(m, &a);
	pthread_mutexattr_destroy(&a);
}

static void expect_owner_dead(const char *what, pthread_mutex_t *m)
{
	int r = pthread_mutex_lock(m);
	if (r != EOWNERDEAD) {
		ferry_fail("%s: lock returned %d (%s), expected EOWNERDEAD", what, r, strerror(r));
		if (r == 0)
			pthread_mutex_unlock(m);
		return;
	}
	FERRY_CHECK_EQ("pthread_mutex_consistent", 0, pthread_mutex_consistent(m));
	FERRY_CHECK_EQ("unlock", 0, pthread_mutex_unlock(m));
	r = pthread_mutex_lock(m);
	FERRY_CHECK_EQ("relock after consistent", 0, r);
	if (r == 0)
		pthread_mutex_unlock(m);
}

int main(void)
{
	struct shared *sh = FERRY_PTR(mmap(NULL, 4096, PROT_READ | PROT_WRITE,
					   MAP_SHARED | MAP_ANONYMOUS, -1, 0));
	init_robust(&sh->m, 1);
	init_robust(&tm, 0);

	pid_t child = FERRY_SYS(fork());
	if (child == 0) {
		void *h0, *h1;
		size_t l0, l1;
		robust_head(0, &h0, &l0);
		if (pthread_mutex_lock(&sh->m))
			ferry_die("child lock");
		sh->locked = 1;
		ferry_wait_go();
		robust_head(0, &h1, &l1);
		FERRY_CHECK_EQ_HEX("child: robust list head", h0, h1);
		FERRY_CHECK_EQ("child: robust list len", l0, l1);
		ferry_child_finish(); /* exits holding sh->m */
	}
	pthread_t t;
	if (pthread_create(&t, NULL, owner, NULL))
		ferry_die("pthread_create");
	if (!FERRY_WAIT_UNTIL(thread_locked && sh->locked, 5000))
		ferry_die("lock owners did not start");
	void *mh, *th;
	size_t ml, tl;
	robust_head(0, &mh, &ml);
	robust_head(owner_tid, &th, &tl);
	FERRY_CHECK(mh && th && mh != th, "robust heads not set up: %p %p", mh, th);

	ferry_ready();
	ferry_wait_go();

	void *mh2, *th2;
	size_t ml2, tl2;
	robust_head(0, &mh2, &ml2);
	robust_head(owner_tid, &th2, &tl2);
	FERRY_CHECK_EQ_HEX("main: robust list head", mh, mh2);
	FERRY_CHECK_EQ("main: robust list len", ml, ml2);
	FERRY_CHECK_EQ_HEX("thread: robust list head", th, th2);
	FERRY_CHECK_EQ("thread: robust list len", tl, tl2);
	go_flag = 1;
	pthread_join(t, NULL);
	expect_owner_dead("process-private mutex of exited thread", &tm);
	ferry_reap_child(child, "child", 0, 5000);
	expect_owner_dead("process-shared mutex of exited child", &sh->m);
	ferry_finish();
}
