/*
 * proc_prctl_misc: assorted per-process prctl() state.
 *
 * Sets up PR_SET_PDEATHSIG SIGUSR2 (with a handler that notes if it ever
 * fires), PR_SET_DUMPABLE 0, PR_SET_CHILD_SUBREAPER 1, PR_SET_TIMERSLACK
 * 123456 ns, PR_SET_THP_DISABLE 1, and (if the kernel has it)
 * PR_SET_MDWE PR_MDWE_REFUSE_EXEC_GAIN.
 * Verifies: every value reads back the same, the parent-death signal did
 * not fire (our parent never died), and subreaping works: an orphaned
 * grandchild is reparented to us.
 */
#include "ferry_test.h"
#include <sys/prctl.h>

#ifndef PR_SET_MDWE
#define PR_SET_MDWE 65
#define PR_GET_MDWE 66
#endif
#ifndef PR_MDWE_REFUSE_EXEC_GAIN
#define PR_MDWE_REFUSE_EXEC_GAIN 1
#endif

static volatile int pdeath_fired;

static void on_usr2(int sig)
{
	(void)sig;
	pdeath_fired = 1;
}

int main(void)
{
	signal(SIGUSR2, on_usr2);
	FERRY_SYS(prctl(PR_SET_PDEATHSIG, SIGUSR2, 0, 0, 0));
	FERRY_SYS(prctl(PR_SET_DUMPABLE, 0, 0, 0, 0));
	FERRY_SYS(prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0));
	FERRY_SYS(prctl(PR_SET_TIMERSLACK, 123456, 0, 0, 0));
	FERRY_SYS(prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0));
	int mdwe = prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0) == 0;
	if (!mdwe)
		ferry_log("PR_SET_MDWE not available: %s", strerror(errno));

	ferry_ready();
	ferry_wait_go();

	int sig = -1;
	prctl(PR_GET_PDEATHSIG, &sig, 0, 0, 0);
	FERRY_CHECK_EQ("PR_GET_PDEATHSIG", SIGUSR2, sig);
	FERRY_CHECK(!pdeath_fired, "the parent-death signal fired");
	FERRY_CHECK_EQ("PR_GET_DUMPABLE", 0, prctl(PR_GET_DUMPABLE, 0, 0, 0, 0));
	int sub = -1;
	prctl(PR_GET_CHILD_SUBREAPER, &sub, 0, 0, 0);
	FERRY_CHECK_EQ("PR_GET_CHILD_SUBREAPER", 1, sub);
	FERRY_CHECK_EQ("PR_GET_TIMERSLACK", 123456, prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0));
	FERRY_CHECK_EQ("PR_GET_THP_DISABLE", 1, prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0));
	if (mdwe)
		FERRY_CHECK_EQ_HEX("PR_GET_MDWE", PR_MDWE_REFUSE_EXEC_GAIN, prctl(PR_GET_MDWE, 0, 0, 0, 0));

	/* Subreaper at work: child forks a grandchild and exits. */
	int p[2];
	FERRY_SYS(pipe(p));
	pid_t c = FERRY_SYS(fork());
	if (c == 0) {
		pid_t me = getpid();
		pid_t g = fork();
		if (g == 0) {
			close(p[0]);
			FERRY_WAIT_UNTIL(getppid() != me, 5000);
			pid_t pp = getppid();
			ssize_t unused = write(p[1], &pp, sizeof pp);
			(void)unused;
			_exit(0);
		}
		_exit(0);
	}
	close(p[1]);
	ferry_reap_child(c, "child", 0, 5000);
	pid_t gp = 0;
	FERRY_CHECK_EQ("read grandchild's report", (ssize_t)sizeof gp, read(p[0], &gp, sizeof gp));
	FERRY_CHECK_EQ("orphaned grandchild's new parent", getpid(), gp);
	while (waitpid(-1, NULL, 0) > 0)
		;
	ferry_finish();
}
