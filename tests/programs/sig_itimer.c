/*
 * sig_itimer: interval timers (setitimer).
 *
 * Sets up ITIMER_REAL firing SIGALRM every 100 ms (counted by a SA_RESTART
 * handler), ITIMER_VIRTUAL at 1000 s with a 500 s interval and ITIMER_PROF
 * at 2000 s one-shot.
 * Verifies: getitimer gives the same intervals and remaining values that
 * are not larger than before (nor much smaller for the CPU-time ones), and
 * ITIMER_REAL keeps firing after restore.
 */
#include "ferry_test.h"
#include <sys/time.h>

static volatile int alarms;

static void on_alrm(int sig)
{
	(void)sig;
	alarms++;
}

static long long us(struct timeval tv)
{
	return (long long)tv.tv_sec * 1000000 + tv.tv_usec;
}

int main(void)
{
	struct sigaction sa = { .sa_handler = on_alrm, .sa_flags = SA_RESTART };
	sigemptyset(&sa.sa_mask);
	FERRY_SYS(sigaction(SIGALRM, &sa, NULL));
	struct itimerval real = { { 0, 100000 }, { 0, 100000 } };
	struct itimerval virt = { { 500, 0 }, { 1000, 0 } };
	struct itimerval prof = { { 0, 0 }, { 2000, 0 } };
	FERRY_SYS(setitimer(ITIMER_REAL, &real, NULL));
	FERRY_SYS(setitimer(ITIMER_VIRTUAL, &virt, NULL));
	FERRY_SYS(setitimer(ITIMER_PROF, &prof, NULL));
	struct itimerval vb, pb;
	getitimer(ITIMER_VIRTUAL, &vb);
	getitimer(ITIMER_PROF, &pb);

	ferry_ready();
	ferry_wait_go();

	struct itimerval r, v, p;
	getitimer(ITIMER_REAL, &r);
	getitimer(ITIMER_VIRTUAL, &v);
	getitimer(ITIMER_PROF, &p);
	FERRY_CHECK_EQ("ITIMER_REAL interval (us)", 100000, us(r.it_interval));
	FERRY_CHECK(us(r.it_value) > 0 && us(r.it_value) <= 100000, "ITIMER_REAL value %lld us",
		    us(r.it_value));
	FERRY_CHECK_EQ("ITIMER_VIRTUAL interval (us)", 500000000LL, us(v.it_interval));
	FERRY_CHECK(us(v.it_value) <= us(vb.it_value) && us(v.it_value) > us(vb.it_value) - 5000000,
		    "ITIMER_VIRTUAL value %lld us, was %lld us at checkpoint", us(v.it_value), us(vb.it_value));
	FERRY_CHECK_EQ("ITIMER_PROF interval (us)", 0, us(p.it_interval));
	FERRY_CHECK(us(p.it_value) <= us(pb.it_value) && us(p.it_value) > us(pb.it_value) - 5000000,
		    "ITIMER_PROF value %lld us, was %lld us at checkpoint", us(p.it_value), us(pb.it_value));
	int a0 = alarms;
	ferry_sleep_ms(450);
	FERRY_CHECK(alarms - a0 >= 2, "ITIMER_REAL fired %d times in 450 ms after restore", alarms - a0);
	ferry_finish();
}
