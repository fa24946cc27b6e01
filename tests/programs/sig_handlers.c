/*
 * sig_handlers: signal dispositions.
 *
 * Sets up: SIGUSR1 handler with SA_SIGINFO|SA_RESTART and sa_mask
 * {SIGUSR2,SIGTERM}; SIGUSR2 handler with SA_ONSTACK|SA_NODEFER (and an
 * altstack); SIGRTMIN+3 handler with SA_RESETHAND; SIGALRM SA_SIGINFO handler
 * blocking every signal; SIGHUP and SIGPIPE ignored; SIGCHLD with
 * SA_NOCLDWAIT|SA_NOCLDSTOP and SIG_DFL.
 * Verifies: the kernel's sigaction for every signal 1..64 (handler, flags,
 * restorer, mask; raw rt_sigaction) is unchanged, and the dispositions
 * behave: SIGUSR1 via sigqueue delivers siginfo (SI_QUEUE, value) with the
 * right mask, SIGUSR2 runs on the altstack without blocking itself,
 * SIGRTMIN+3 resets to SIG_DFL after one delivery, SIGHUP is ignored,
 * SIGPIPE is ignored (write gives EPIPE), children are auto-reaped.
 */
#include "ferry_test.h"

struct ksa {
	void *handler;
	unsigned long flags;
	void *restorer;
	uint64_t mask;
};

static struct ksa before[65];
static unsigned char altstack[65536];
static volatile int usr1_code, usr1_value, usr1_masked_ok, usr2_on_alt, usr2_unblocked, rt_runs;

static void h_usr1(int sig, siginfo_t *si, void *uc)
{
	(void)sig, (void)uc;
	sigset_t cur;
	pthread_sigmask(SIG_SETMASK, NULL, &cur);
	usr1_code = si->si_code;
	usr1_value = si->si_value.sival_int;
	usr1_masked_ok = sigismember(&cur, SIGUSR1) && sigismember(&cur, SIGUSR2) &&
			 sigismember(&cur, SIGTERM) && !sigismember(&cur, SIGINT);
}

static void h_usr2(int sig)
{
	(void)sig;
	int local;
	sigset_t cur;
	usr2_on_alt = (unsigned char *)&local >= altstack && (unsigned char *)&local < altstack + sizeof altstack;
	pthread_sigmask(SIG_SETMASK, NULL, &cur);
	usr2_unblocked = !sigismember(&cur, SIGUSR2);
}

static void h_rt(int sig)
{
	(void)sig;
	rt_runs++;
}

static void h_alrm(int sig, siginfo_t *si, void *uc)
{
	(void)sig, (void)si, (void)uc;
}

static void set(int sig, void (*h)(int), void (*sa3)(int, siginfo_t *, void *), int flags, int m1, int m2, int all)
{
	struct sigaction sa = { 0 };
	if (sa3)
		sa.sa_sigaction = sa3;
	else
		sa.sa_handler = h;
	sa.sa_flags = flags;
	if (all)
		sigfillset(&sa.sa_mask);
	else
		sigemptyset(&sa.sa_mask);
	if (m1)
		sigaddset(&sa.sa_mask, m1);
	if (m2)
		sigaddset(&sa.sa_mask, m2);
	if (sigaction(sig, &sa, NULL) < 0)
		ferry_die("sigaction(%d): %s", sig, strerror(errno));
}

static void read_all(struct ksa *out)
{
	for (int s = 1; s <= 64; s++)
		if (syscall(SYS_rt_sigaction, s, NULL, &out[s], 8) < 0)
			memset(&out[s], 0xff, sizeof out[s]);
}

int main(void)
{
	stack_t ss = { .ss_sp = altstack, .ss_size = sizeof altstack };
	FERRY_SYS(sigaltstack(&ss, NULL));
	set(SIGUSR1, NULL, h_usr1, SA_SIGINFO | SA_RESTART, SIGUSR2, SIGTERM, 0);
	set(SIGUSR2, h_usr2, NULL, SA_ONSTACK | SA_NODEFER, 0, 0, 0);
	set(SIGRTMIN + 3, h_rt, NULL, SA_RESETHAND, 0, 0, 0);
	set(SIGALRM, NULL, h_alrm, SA_SIGINFO, 0, 0, 1);
	set(SIGHUP, SIG_IGN, NULL, 0, 0, 0, 0);
	set(SIGPIPE, SIG_IGN, NULL, 0, 0, 0, 0);
	set(SIGCHLD, SIG_DFL, NULL, SA_NOCLDWAIT | SA_NOCLDSTOP, 0, 0, 0);
	read_all(before);

	ferry_ready();
	ferry_wait_go();

	struct ksa now[65];
	read_all(now);
	for (int s = 1; s <= 64; s++) {
		if (s == SIGKILL || s == SIGSTOP)
			continue;
		char what[64];
		snprintf(what, sizeof what, "signal %d handler", s);
		FERRY_CHECK_EQ_HEX(what, before[s].handler, now[s].handler);
		snprintf(what, sizeof what, "signal %d sa_flags", s);
		FERRY_CHECK_EQ_HEX(what, before[s].flags, now[s].flags);
		snprintf(what, sizeof what, "signal %d sa_restorer", s);
		FERRY_CHECK_EQ_HEX(what, before[s].restorer, now[s].restorer);
		snprintf(what, sizeof what, "signal %d sa_mask", s);
		FERRY_CHECK_EQ_HEX(what, before[s].mask, now[s].mask);
	}

	union sigval v = { .sival_int = 7 };
	FERRY_CHECK_EQ("sigqueue", 0, sigqueue(getpid(), SIGUSR1, v));
	FERRY_CHECK_EQ("SIGUSR1 si_code", SI_QUEUE, usr1_code);
	FERRY_CHECK_EQ("SIGUSR1 si_value", 7, usr1_value);
	FERRY_CHECK(usr1_masked_ok, "SIGUSR1 handler ran with the wrong signal mask");
	raise(SIGUSR2);
	FERRY_CHECK(usr2_on_alt, "SIGUSR2 handler did not run on the altstack");
	FERRY_CHECK(usr2_unblocked, "SIGUSR2 blocked inside its SA_NODEFER handler");
	raise(SIGRTMIN + 3);
	FERRY_CHECK_EQ("SIGRTMIN+3 handler runs", 1, rt_runs);
	struct sigaction cur;
	sigaction(SIGRTMIN + 3, NULL, &cur);
	FERRY_CHECK(cur.sa_handler == SIG_DFL, "SIGRTMIN+3 not reset to SIG_DFL by SA_RESETHAND");
	raise(SIGHUP); /* ignored: we live on */
	int p[2];
	FERRY_SYS(pipe(p));
	close(p[0]);
	errno = 0;
	FERRY_CHECK(write(p[1], "x", 1) == -1 && errno == EPIPE, "write to a broken pipe: errno %d", errno);
	close(p[1]);
	pid_t c = fork();
	if (c == 0)
		_exit(0);
	int st;
	errno = 0;
	FERRY_CHECK(waitpid(c, &st, 0) == -1 && errno == ECHILD,
		    "child not auto-reaped with SA_NOCLDWAIT (waitpid errno %d)", errno);
	ferry_finish();
}
