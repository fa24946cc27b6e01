/*
 * sig_itimer_expired: an interval timer that expired while its signal could not be taken.
 *
 * ITIMER_REAL fires SIGALRM every 50 ms, but SIGALRM is blocked: once it has expired, the
 * signal stays pending and the kernel arms the timer again only when the signal is taken, so
 * at the checkpoint getitimer says 0 us left with a 50 ms interval.
 * Verifies: the SIGALRM is still pending, and once unblocked the timer keeps firing (a
 * restore that set the timer to 0 us would disarm it).
 */
#include "ferry_test.h"
#include <sys/time.h>

static volatile int alarms;

static void on_alrm(int sig)
{
	(void)sig;
	alarms++;
}

int main(void)
{
	struct sigaction sa = { .sa_handler = on_alrm, .sa_flags = SA_RESTART };
	sigemptyset(&sa.sa_mask);
	FERRY_SYS(sigaction(SIGALRM, &sa, NULL));
	sigset_t alrm;
	sigemptyset(&alrm);
	sigaddset(&alrm, SIGALRM);
	FERRY_SYS(sigprocmask(SIG_BLOCK, &alrm, NULL));
	struct itimerval real = { { 0, 50000 }, { 0, 50000 } };
	FERRY_SYS(setitimer(ITIMER_REAL, &real, NULL));
	ferry_sleep_ms(120);
	struct itimerval r;
	getitimer(ITIMER_REAL, &r);
	if (r.it_value.tv_sec || r.it_value.tv_usec)
		ferry_die("ITIMER_REAL did not stay expired");

	ferry_ready();
	ferry_wait_go();

	sigset_t pending;
	sigpending(&pending);
	FERRY_CHECK(sigismember(&pending, SIGALRM), "SIGALRM no longer pending");
	FERRY_SYS(sigprocmask(SIG_UNBLOCK, &alrm, NULL));
	ferry_sleep_ms(300);
	FERRY_CHECK(alarms >= 3, "ITIMER_REAL fired %d times in 300 ms once unblocked", alarms);
	ferry_finish();
}
