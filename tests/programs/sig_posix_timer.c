/*
 * sig_posix_timer: POSIX timers (timer_create).
 *
 * Sets up five timers: A CLOCK_MONOTONIC every 50 ms -> SIGRTMIN+1 with
 * value 42; B CLOCK_REALTIME absolute one-shot 100 s ahead -> SIGUSR1;
 * C CLOCK_MONOTONIC SIGEV_NONE at 200 s with a 10 s interval;
 * D CLOCK_BOOTTIME every 50 ms -> SIGRTMIN+2 to thread T (SIGEV_THREAD_ID);
 * E created but disarmed.
 * Verifies: /proc/self/timers is unchanged (ids, signals, values, notify,
 * clocks), timer_gettime gives the same intervals and sane remaining
 * values, A keeps firing with value 42 and D keeps firing in thread T.
 */
#include "ferry_test.h"

static timer_t ta, tb, tc, td, te;
static volatile int a_fires, a_value_ok = 1, d_fires, d_in_t = 1, go_flag;
static volatile pid_t t_tid;

static void on_a(int sig, siginfo_t *si, void *uc)
{
	(void)sig, (void)uc;
	a_fires++;
	if (si->si_code != SI_TIMER || si->si_value.sival_int != 42)
		a_value_ok = 0;
}

static void on_d(int sig)
{
	(void)sig;
	d_fires++;
	if (ferry_gettid() != t_tid)
		d_in_t = 0;
}

static void *thread_fn(void *arg)
{
	(void)arg;
	t_tid = ferry_gettid();
	while (!go_flag)
		ferry_sleep_ms(5);
	return NULL;
}

static void mk(clockid_t clk, int notify, int sig, int value, pid_t tid, timer_t *t)
{
	struct sigevent ev;
	memset(&ev, 0, sizeof ev);
	ev.sigev_notify = notify;
	ev.sigev_signo = sig;
	ev.sigev_value.sival_int = value;
	if (notify == SIGEV_THREAD_ID)
		ev._sigev_un._tid = tid;
	if (timer_create(clk, &ev, t) < 0)
		ferry_die("timer_create: %s", strerror(errno));
}

static void arm(timer_t t, int flags, time_t vs, long vns, time_t is, long ins)
{
	struct itimerspec its = { { is, ins }, { vs, vns } };
	if (timer_settime(t, flags, &its, NULL) < 0)
		ferry_die("timer_settime: %s", strerror(errno));
}

static long long ns(struct timespec t)
{
	return (long long)t.tv_sec * 1000000000 + t.tv_nsec;
}

int main(void)
{
	struct sigaction sa = { .sa_sigaction = on_a, .sa_flags = SA_SIGINFO | SA_RESTART };
	sigemptyset(&sa.sa_mask);
	FERRY_SYS(sigaction(SIGRTMIN + 1, &sa, NULL));
	struct sigaction sd = { .sa_handler = on_d, .sa_flags = SA_RESTART };
	sigemptyset(&sd.sa_mask);
	FERRY_SYS(sigaction(SIGRTMIN + 2, &sd, NULL));
	/* Only thread T may take SIGRTMIN+2; SIGUSR1 (timer B) stays blocked. */
	pthread_t t;
	if (pthread_create(&t, NULL, thread_fn, NULL))
		ferry_die("pthread_create");
	FERRY_WAIT_UNTIL(t_tid != 0, 5000);
	sigset_t blk;
	sigemptyset(&blk);
	sigaddset(&blk, SIGRTMIN + 2);
	sigaddset(&blk, SIGUSR1);
	pthread_sigmask(SIG_BLOCK, &blk, NULL);

	mk(CLOCK_MONOTONIC, SIGEV_SIGNAL, SIGRTMIN + 1, 42, 0, &ta);
	mk(CLOCK_REALTIME, SIGEV_SIGNAL, SIGUSR1, 43, 0, &tb);
	mk(CLOCK_MONOTONIC, SIGEV_NONE, 0, 44, 0, &tc);
	mk(CLOCK_BOOTTIME, SIGEV_THREAD_ID, SIGRTMIN + 2, 45, t_tid, &td);
	mk(CLOCK_MONOTONIC, SIGEV_SIGNAL, SIGUSR2, 46, 0, &te);
	struct timespec now;
	clock_gettime(CLOCK_REALTIME, &now);
	arm(ta, 0, 0, 50000000, 0, 50000000);
	arm(tb, TIMER_ABSTIME, now.tv_sec + 100, now.tv_nsec, 0, 0);
	arm(tc, 0, 200, 0, 10, 0);
	arm(td, 0, 0, 50000000, 0, 50000000);
	static char timers_before[4096];
	FERRY_SYS(ferry_read_file("/proc/self/timers", timers_before, sizeof timers_before));

	ferry_ready();
	ferry_wait_go();

	static char timers_now[4096];
	ferry_read_file("/proc/self/timers", timers_now, sizeof timers_now);
	if (strcmp(timers_before, timers_now) != 0) {
		for (char *p = timers_before; *p; p++)
			if (*p == '\n')
				*p = '|';
		for (char *p = timers_now; *p; p++)
			if (*p == '\n')
				*p = '|';
		ferry_fail("/proc/self/timers changed: expected \"%s\", got \"%s\"", timers_before, timers_now);
	}
	struct itimerspec ia, ib, ic, id, ie;
	FERRY_CHECK_EQ("timer_gettime A", 0, timer_gettime(ta, &ia));
	FERRY_CHECK_EQ("timer_gettime B", 0, timer_gettime(tb, &ib));
	FERRY_CHECK_EQ("timer_gettime C", 0, timer_gettime(tc, &ic));
	FERRY_CHECK_EQ("timer_gettime D", 0, timer_gettime(td, &id));
	FERRY_CHECK_EQ("timer_gettime E", 0, timer_gettime(te, &ie));
	FERRY_CHECK_EQ("A interval (ns)", 50000000, ns(ia.it_interval));
	FERRY_CHECK(ns(ia.it_value) > 0 && ns(ia.it_value) <= 50000000, "A value %lld ns", ns(ia.it_value));
	FERRY_CHECK_EQ("B interval", 0, ns(ib.it_interval));
	FERRY_CHECK(ns(ib.it_value) > 60000000000LL && ns(ib.it_value) <= 100000000000LL,
		    "B remaining %lld ns, expected a bit under 100 s", ns(ib.it_value));
	FERRY_CHECK_EQ("C interval (ns)", 10000000000LL, ns(ic.it_interval));
	FERRY_CHECK(ns(ic.it_value) > 160000000000LL && ns(ic.it_value) <= 200000000000LL,
		    "C remaining %lld ns, expected a bit under 200 s", ns(ic.it_value));
	FERRY_CHECK_EQ("D interval (ns)", 50000000, ns(id.it_interval));
	FERRY_CHECK_EQ("E value (disarmed)", 0, ns(ie.it_value));
	FERRY_CHECK_EQ("E interval (disarmed)", 0, ns(ie.it_interval));
	int a0 = a_fires, d0 = d_fires;
	ferry_sleep_ms(400);
	FERRY_CHECK(a_fires - a0 >= 3, "timer A fired %d times in 400 ms", a_fires - a0);
	FERRY_CHECK(d_fires - d0 >= 3, "timer D fired %d times in 400 ms", d_fires - d0);
	FERRY_CHECK(a_value_ok, "timer A delivered a wrong si_code/si_value");
	FERRY_CHECK(d_in_t, "timer D's signal was handled outside thread T");
	go_flag = 1;
	pthread_join(t, NULL);
	ferry_finish();
}
