/*
 * sys_blocked_sigwaitinfo: threads blocked waiting for signals.
 *
 * Sets up (SIGUSR1 and SIGRTMIN+1 blocked everywhere) thread A in
 * sigwaitinfo({SIGUSR1}), thread B in sigtimedwait({SIGRTMIN+1}, 60 s),
 * thread C in sigsuspend() with a mask that lets only SIGUSR2 (which has a
 * handler) through.
 * Verifies: after go, main sends SIGUSR1 to A, SIGRTMIN+1 with value 99 to
 * B, SIGUSR2 to C: A and B get exactly those signals with the right
 * siginfo (never EINTR/EAGAIN); C returns from sigsuspend only after its
 * handler ran, with its old mask back in place.
 */
#include "ferry_test.h"

static volatile pid_t tids[3];
static int ra, rb, ea, eb;
static siginfo_t sia, sib;
static volatile int usr2_seen;
static int rc_c, ec_c, c_saw_handler, c_mask_ok;

static void on_usr2(int sig)
{
	(void)sig;
	usr2_seen = 1;
}

static void *thread_a(void *arg)
{
	(void)arg;
	tids[0] = ferry_gettid();
	sigset_t s;
	sigemptyset(&s);
	sigaddset(&s, SIGUSR1);
	ra = sigwaitinfo(&s, &sia);
	ea = ra < 0 ? errno : 0;
	return NULL;
}

static void *thread_b(void *arg)
{
	(void)arg;
	tids[1] = ferry_gettid();
	sigset_t s;
	sigemptyset(&s);
	sigaddset(&s, SIGRTMIN + 1);
	struct timespec ts = { 60, 0 };
	rb = sigtimedwait(&s, &sib, &ts);
	eb = rb < 0 ? errno : 0;
	return NULL;
}

static void *thread_c(void *arg)
{
	(void)arg;
	sigset_t blk, wait_mask, after;
	sigemptyset(&blk);
	sigaddset(&blk, SIGUSR2);
	pthread_sigmask(SIG_BLOCK, &blk, NULL); /* normal mask: USR1, RT+1, USR2 */
	sigfillset(&wait_mask);
	sigdelset(&wait_mask, SIGUSR2);
	tids[2] = ferry_gettid();
	rc_c = sigsuspend(&wait_mask);
	ec_c = errno;
	c_saw_handler = usr2_seen;
	pthread_sigmask(SIG_SETMASK, NULL, &after);
	c_mask_ok = sigismember(&after, SIGUSR2) && sigismember(&after, SIGUSR1) &&
		    !sigismember(&after, SIGTERM);
	return NULL;
}

int main(void)
{
	struct sigaction sa = { .sa_handler = on_usr2 };
	sigemptyset(&sa.sa_mask);
	FERRY_SYS(sigaction(SIGUSR2, &sa, NULL));
	sigset_t s;
	sigemptyset(&s);
	sigaddset(&s, SIGUSR1);
	sigaddset(&s, SIGRTMIN + 1);
	pthread_sigmask(SIG_BLOCK, &s, NULL);
	pthread_t t[3];
	void *(*fn[3])(void *) = { thread_a, thread_b, thread_c };
	for (int i = 0; i < 3; i++)
		if (pthread_create(&t[i], NULL, fn[i], NULL))
			ferry_die("pthread_create");
	static const long nr[3] = { SYS_rt_sigtimedwait, SYS_rt_sigtimedwait, SYS_rt_sigsuspend };
	for (int i = 0; i < 3; i++) {
		FERRY_WAIT_UNTIL(tids[i] != 0, 5000);
		if (!ferry_wait_blocked(tids[i], nr[i], nr[i], 5000))
			ferry_die("thread %d not blocked", i);
	}

	ferry_ready();
	ferry_wait_go();

	FERRY_CHECK_EQ("tgkill A", 0, syscall(SYS_tgkill, getpid(), tids[0], SIGUSR1));
	siginfo_t qi = { .si_signo = SIGRTMIN + 1, .si_code = SI_QUEUE, .si_pid = getpid(),
			 .si_uid = getuid() };
	qi.si_value.sival_int = 99;
	FERRY_CHECK_EQ("rt_tgsigqueueinfo B", 0,
		       syscall(SYS_rt_tgsigqueueinfo, getpid(), tids[1], SIGRTMIN + 1, &qi));
	FERRY_CHECK_EQ("tgkill C", 0, syscall(SYS_tgkill, getpid(), tids[2], SIGUSR2));
	for (int i = 0; i < 3; i++)
		pthread_join(t[i], NULL);

	FERRY_CHECK(ea != EINTR, "sigwaitinfo failed with EINTR");
	FERRY_CHECK_EQ("sigwaitinfo result", SIGUSR1, ra);
	FERRY_CHECK(sia.si_code == SI_TKILL || sia.si_code == SI_USER, "sigwaitinfo si_code %d",
		    sia.si_code);
	FERRY_CHECK_EQ("sigwaitinfo si_pid", getpid(), sia.si_pid);
	FERRY_CHECK(eb != EINTR && eb != EAGAIN, "sigtimedwait failed: %s", strerror(eb));
	FERRY_CHECK_EQ("sigtimedwait result", SIGRTMIN + 1, rb);
	FERRY_CHECK_EQ("sigtimedwait si_code", SI_QUEUE, sib.si_code);
	FERRY_CHECK_EQ("sigtimedwait si_value", 99, sib.si_value.sival_int);
	FERRY_CHECK(rc_c == -1 && ec_c == EINTR, "sigsuspend returned %d (%s)", rc_c, strerror(ec_c));
	FERRY_CHECK(c_saw_handler, "sigsuspend returned before the SIGUSR2 handler ran");
	FERRY_CHECK(c_mask_ok, "thread C's signal mask after sigsuspend is not its old mask");
	ferry_finish();
}
