/*
 * fd_timerfd: timerfd timers.
 *
 * Sets up T1 CLOCK_MONOTONIC every 50 ms (O_NONBLOCK); T2 CLOCK_REALTIME
 * absolute one-shot 100 s ahead; T3 CLOCK_BOOTTIME disarmed; T4
 * CLOCK_MONOTONIC one-shot that already expired once and was not read.
 * Verifies: fdinfo clockid and settime flags, timerfd_gettime intervals and
 * sane remaining values, T4 still has exactly 1 expiration to read, T1
 * keeps expiring after restore, T3 stays disarmed.
 */
#include "ferry_test.h"
#include <poll.h>
#include <sys/timerfd.h>

static long long ns(struct timespec t)
{
	return (long long)t.tv_sec * 1000000000 + t.tv_nsec;
}

int main(void)
{
	int t1 = FERRY_SYS(timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK));
	int t2 = FERRY_SYS(timerfd_create(CLOCK_REALTIME, 0));
	int t3 = FERRY_SYS(timerfd_create(CLOCK_BOOTTIME, TFD_CLOEXEC));
	int t4 = FERRY_SYS(timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK));
	struct itimerspec its = { { 0, 50000000 }, { 0, 50000000 } };
	FERRY_SYS(timerfd_settime(t1, 0, &its, NULL));
	struct timespec now;
	clock_gettime(CLOCK_REALTIME, &now);
	its = (struct itimerspec){ { 0, 0 }, { now.tv_sec + 100, now.tv_nsec } };
	FERRY_SYS(timerfd_settime(t2, TFD_TIMER_ABSTIME, &its, NULL));
	its = (struct itimerspec){ { 0, 0 }, { 0, 1000000 } };
	FERRY_SYS(timerfd_settime(t4, 0, &its, NULL));
	ferry_sleep_ms(20);
	int fds[4] = { t1, t2, t3, t4 };
	char clk[4][32], fl[4][32];
	for (int i = 0; i < 4; i++) {
		ferry_fdinfo_field(fds[i], "clockid", clk[i], sizeof clk[i]);
		ferry_fdinfo_field(fds[i], "settime flags", fl[i], sizeof fl[i]);
	}

	ferry_ready();
	ferry_wait_go();

	for (int i = 0; i < 4; i++) {
		char v[32] = "", what[64];
		ferry_fdinfo_field(fds[i], "clockid", v, sizeof v);
		snprintf(what, sizeof what, "T%d clockid", i + 1);
		FERRY_CHECK_EQ_STR(what, clk[i], v);
		ferry_fdinfo_field(fds[i], "settime flags", v, sizeof v);
		snprintf(what, sizeof what, "T%d settime flags", i + 1);
		FERRY_CHECK_EQ_STR(what, fl[i], v);
	}
	struct itimerspec g;
	uint64_t ticks = 0;
	FERRY_CHECK_EQ("T4 read", 8, read(t4, &ticks, 8));
	FERRY_CHECK_EQ("T4 expirations", 1, ticks);
	FERRY_CHECK(read(t4, &ticks, 8) < 0 && errno == EAGAIN, "T4 readable twice");
	timerfd_gettime(t1, &g);
	FERRY_CHECK_EQ("T1 interval", 50000000, ns(g.it_interval));
	FERRY_CHECK(ns(g.it_value) > 0 && ns(g.it_value) <= 50000000, "T1 value %lld ns", ns(g.it_value));
	timerfd_gettime(t2, &g);
	FERRY_CHECK_EQ("T2 interval", 0, ns(g.it_interval));
	FERRY_CHECK(ns(g.it_value) > 60000000000LL && ns(g.it_value) <= 100000000000LL,
		    "T2 remaining %lld ns, expected a bit under 100 s", ns(g.it_value));
	timerfd_gettime(t3, &g);
	FERRY_CHECK_EQ("T3 value (disarmed)", 0, ns(g.it_value));
	read(t1, &ticks, 8); /* drain */
	ferry_sleep_ms(200);
	ticks = 0;
	FERRY_CHECK_EQ("T1 read", 8, read(t1, &ticks, 8));
	FERRY_CHECK(ticks >= 2, "T1 expired %llu times in 200 ms", (unsigned long long)ticks);
	struct pollfd p = { .fd = t3, .events = POLLIN };
	FERRY_CHECK_EQ("T3 not readable", 0, poll(&p, 1, 0));
	ferry_finish();
}
