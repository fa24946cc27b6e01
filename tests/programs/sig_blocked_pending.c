/*
 * sig_blocked_pending: blocked signals waiting to be delivered.
 *
 * Sets up (all threads block SIGUSR1, SIGUSR2, SIGTERM, SIGRTMIN+2,
 * SIGRTMIN+4):
 *   process-wide pending: SIGUSR1 from kill(); SIGRTMIN+2 queued twice by
 *   sigqueue() with values 1234 then 5678;
 *   pending for the main thread: SIGTERM (tgkill);
 *   pending for thread T: SIGUSR2 (tgkill) and SIGRTMIN+4 queued with
 *   value 77 (rt_tgsigqueueinfo).
 * Verifies: SigPnd/ShdPnd/SigBlk of every thread are unchanged, and each
 * signal is dequeued (sigtimedwait) by the right thread with the right
 * siginfo (si_code, si_pid, si_uid, si_value, queue order), after which
 * nothing is pending.
 */
#include "ferry_test.h"

static volatile pid_t t_tid;
static volatile int go_flag, t_done;

static int take(int sig, siginfo_t *si)
{
	sigset_t s;
	sigemptyset(&s);
	sigaddset(&s, sig);
	struct timespec zero = { 0, 0 };
	return sigtimedwait(&s, si, &zero);
}

static void expect(const char *who, int sig, int code_a, int code_b, int value)
{
	siginfo_t si;
	memset(&si, 0, sizeof si);
	int r = take(sig, &si);
	if (r != sig) {
		ferry_fail("%s: signal %d not pending (sigtimedwait: %d, %s)", who, sig, r, strerror(errno));
		return;
	}
	FERRY_CHECK(si.si_code == code_a || si.si_code == code_b, "%s: signal %d si_code %d, expected %d",
		    who, sig, si.si_code, code_a);
	FERRY_CHECK(si.si_pid == getpid(), "%s: signal %d si_pid %d, expected %d", who, sig, si.si_pid,
		    (int)getpid());
	FERRY_CHECK(si.si_uid == getuid(), "%s: signal %d si_uid %d", who, sig, (int)si.si_uid);
	if (code_a == SI_QUEUE)
		FERRY_CHECK(si.si_value.sival_int == value, "%s: signal %d si_value %d, expected %d", who,
			    sig, si.si_value.sival_int, value);
}

static void *thread_fn(void *arg)
{
	(void)arg;
	t_tid = ferry_gettid();
	while (!go_flag)
		ferry_sleep_ms(5);
	/* Per-thread first, then T also sees the process-wide ones: leave those to main. */
	expect("thread T", SIGUSR2, SI_TKILL, SI_USER, 0);
	expect("thread T", SIGRTMIN + 4, SI_QUEUE, SI_QUEUE, 77);
	siginfo_t si;
	FERRY_CHECK(take(SIGRTMIN + 4, &si) < 0, "thread T: SIGRTMIN+4 pending twice");
	t_done = 1;
	return NULL;
}

static void send_queue(pid_t tid, int sig, int value)
{
	siginfo_t qi;
	memset(&qi, 0, sizeof qi);
	qi.si_signo = sig;
	qi.si_code = SI_QUEUE;
	qi.si_pid = getpid();
	qi.si_uid = getuid();
	qi.si_value.sival_int = value;
	if (syscall(SYS_rt_tgsigqueueinfo, getpid(), tid, sig, &qi) < 0)
		ferry_die("rt_tgsigqueueinfo: %s", strerror(errno));
}

int main(void)
{
	sigset_t s;
	sigemptyset(&s);
	int blocked[] = { SIGUSR1, SIGUSR2, SIGTERM, SIGRTMIN + 2, SIGRTMIN + 4 };
	for (size_t i = 0; i < sizeof blocked / sizeof blocked[0]; i++)
		sigaddset(&s, blocked[i]);
	pthread_sigmask(SIG_BLOCK, &s, NULL);
	pthread_t t;
	if (pthread_create(&t, NULL, thread_fn, NULL))
		ferry_die("pthread_create");
	FERRY_WAIT_UNTIL(t_tid != 0, 5000);

	FERRY_SYS(kill(getpid(), SIGUSR1));
	union sigval v1 = { .sival_int = 1234 }, v2 = { .sival_int = 5678 };
	FERRY_SYS(sigqueue(getpid(), SIGRTMIN + 2, v1));
	FERRY_SYS(sigqueue(getpid(), SIGRTMIN + 2, v2));
	FERRY_SYS(syscall(SYS_tgkill, getpid(), getpid(), SIGTERM));
	FERRY_SYS(syscall(SYS_tgkill, getpid(), t_tid, SIGUSR2));
	send_queue(t_tid, SIGRTMIN + 4, 77);

	static const char *fields[] = { "SigPnd", "ShdPnd", "SigBlk" };
	char before[2][3][32];
	pid_t tids[2] = { getpid(), t_tid };
	for (int i = 0; i < 2; i++)
		for (int f = 0; f < 3; f++)
			ferry_status_field(tids[i], fields[f], before[i][f], 32);

	ferry_ready();
	ferry_wait_go();

	for (int i = 0; i < 2; i++)
		for (int f = 0; f < 3; f++) {
			char now[32] = "", what[64];
			ferry_status_field(tids[i], fields[f], now, sizeof now);
			snprintf(what, sizeof what, "%s %s", i ? "thread T" : "main thread", fields[f]);
			FERRY_CHECK_EQ_STR(what, before[i][f], now);
		}
	expect("main", SIGTERM, SI_TKILL, SI_USER, 0);
	go_flag = 1;
	FERRY_WAIT_UNTIL(t_done, 5000);
	expect("main", SIGUSR1, SI_USER, SI_USER, 0);
	expect("main", SIGRTMIN + 2, SI_QUEUE, SI_QUEUE, 1234);
	expect("main", SIGRTMIN + 2, SI_QUEUE, SI_QUEUE, 5678);
	siginfo_t si;
	FERRY_CHECK(take(SIGRTMIN + 2, &si) < 0, "SIGRTMIN+2 queued more than twice");
	pthread_join(t, NULL);
	sigset_t pend;
	sigpending(&pend);
	for (int sig = 1; sig < NSIG; sig++)
		FERRY_CHECK(!sigismember(&pend, sig), "signal %d still pending at the end", sig);
	ferry_finish();
}
