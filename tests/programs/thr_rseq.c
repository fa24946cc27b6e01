/*
 * thr_rseq: restartable sequences (glibc registers rseq in every thread).
 *
 * Sets up the main thread and one more thread; glibc has registered each
 * thread's rseq area (at the thread pointer + __rseq_offset) with the kernel.
 * Verifies in both threads: registering the same area again fails with
 * EBUSY (so the same area, length 32 and signature RSEQ_SIG are registered),
 * cpu_id in the area is >= 0, and the kernel keeps it up to date: after
 * pinning the thread to each CPU in turn, cpu_id and sched_getcpu() both
 * follow.
 */
#include "ferry_test.h"
#include <sched.h>
#include <sys/rseq.h>

static volatile int go_flag, nready;

static struct rseq *area(void)
{
	return (struct rseq *)((char *)__builtin_thread_pointer() + __rseq_offset);
}

static void verify(const char *who)
{
	struct rseq *r = area();
	long rc = syscall(SYS_rseq, r, 32, 0, RSEQ_SIG);
	int err = errno;
	if (rc == 0) {
		ferry_fail("%s: rseq area was not registered (registering it again succeeded)", who);
	} else if (err != EBUSY) {
		ferry_fail("%s: re-registering the rseq area gave %s, expected EBUSY "
			   "(another area, length or signature is registered)", who, strerror(err));
	}
	FERRY_CHECK((int)r->cpu_id >= 0, "%s: rseq cpu_id is %d", who, (int)r->cpu_id);
	FERRY_CHECK(sched_getcpu() >= 0, "%s: sched_getcpu() = %d", who, sched_getcpu());

	cpu_set_t orig;
	sched_getaffinity(0, sizeof orig, &orig);
	for (int cpu = 0; cpu < CPU_SETSIZE && cpu < 64; cpu++) {
		if (!CPU_ISSET(cpu, &orig))
			continue;
		cpu_set_t one;
		CPU_ZERO(&one);
		CPU_SET(cpu, &one);
		if (sched_setaffinity(0, sizeof one, &one) < 0) {
			ferry_fail("%s: sched_setaffinity: %s", who, strerror(errno));
			break;
		}
		FERRY_CHECK((int)r->cpu_id == cpu, "%s: pinned to cpu %d, rseq cpu_id says %d", who, cpu,
			    (int)r->cpu_id);
		FERRY_CHECK(sched_getcpu() == cpu, "%s: pinned to cpu %d, sched_getcpu says %d", who, cpu,
			    sched_getcpu());
	}
	sched_setaffinity(0, sizeof orig, &orig);
}

static void *thread_fn(void *arg)
{
	(void)arg;
	__atomic_add_fetch(&nready, 1, __ATOMIC_SEQ_CST);
	while (!go_flag)
		ferry_sleep_ms(5);
	verify("thread");
	return NULL;
}

int main(void)
{
	if (__rseq_size == 0)
		ferry_die("glibc did not register rseq (__rseq_size == 0; tunable glibc.pthread.rseq=0?)");
	pthread_t t;
	if (pthread_create(&t, NULL, thread_fn, NULL))
		ferry_die("pthread_create");
	if (!FERRY_WAIT_UNTIL(nready == 1, 5000))
		ferry_die("thread did not start");

	ferry_ready();
	ferry_wait_go();
	verify("main");
	go_flag = 1;
	pthread_join(t, NULL);
	ferry_finish();
}
