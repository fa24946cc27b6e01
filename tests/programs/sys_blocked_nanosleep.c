/*
 * sys_blocked_nanosleep: threads in nanosleep/clock_nanosleep.
 *
 * Sets up thread A in nanosleep() for 1.5 s (relative) and thread B in
 * clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME) until start + 1.5 s.
 * (The checkpoints happen while they sleep; the sleep ends on its own.)
 * Verifies: both calls return 0 (never EINTR), and neither returned before
 * its deadline on CLOCK_MONOTONIC.
 */
#include "ferry_test.h"

#define SLEEP_NS 1500000000ull

struct sleeper {
	pid_t tid;
	uint64_t start, end;
	int rc, err;
	struct timespec rem;
} s[2];

static void *rel_sleeper(void *arg)
{
	struct sleeper *x = arg;
	struct timespec d = { SLEEP_NS / 1000000000ull, SLEEP_NS % 1000000000ull };
	x->tid = ferry_gettid();
	x->start = ferry_now_ns(CLOCK_MONOTONIC);
	x->rc = nanosleep(&d, &x->rem);
	x->err = x->rc ? errno : 0;
	x->end = ferry_now_ns(CLOCK_MONOTONIC);
	return NULL;
}

static void *abs_sleeper(void *arg)
{
	struct sleeper *x = arg;
	x->tid = ferry_gettid();
	x->start = ferry_now_ns(CLOCK_MONOTONIC);
	uint64_t dl = x->start + SLEEP_NS;
	struct timespec d = { dl / 1000000000ull, dl % 1000000000ull };
	x->rc = clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &d, NULL);
	x->err = x->rc; /* clock_nanosleep returns the error */
	x->end = ferry_now_ns(CLOCK_MONOTONIC);
	return NULL;
}

int main(void)
{
	pthread_t t[2];
	if (pthread_create(&t[0], NULL, rel_sleeper, &s[0]) || pthread_create(&t[1], NULL, abs_sleeper, &s[1]))
		ferry_die("pthread_create");
	for (int i = 0; i < 2; i++) {
		FERRY_WAIT_UNTIL(s[i].tid != 0, 5000);
		if (!ferry_wait_blocked(s[i].tid, SYS_nanosleep, SYS_clock_nanosleep, 1000))
			ferry_die("sleeper %d not in nanosleep", i);
	}

	ferry_ready();
	ferry_wait_go();

	for (int i = 0; i < 2; i++) {
		pthread_join(t[i], NULL);
		const char *who = i ? "clock_nanosleep(ABSTIME)" : "nanosleep";
		FERRY_CHECK(s[i].err != EINTR, "%s failed with EINTR", who);
		FERRY_CHECK(s[i].rc == 0, "%s returned %d (%s)", who, s[i].rc, strerror(s[i].err));
		FERRY_CHECK(s[i].end - s[i].start >= SLEEP_NS, "%s returned after %.3f s, expected >= %.3f s",
			    who, (s[i].end - s[i].start) / 1e9, SLEEP_NS / 1e9);
	}
	ferry_finish();
}
