/*
 * proc_continued: a child stopped and continued, whose continue its parent
 * has not collected yet.
 *
 * Sets up, with a SIGCHLD handler counting CLD_STOPPED and CLD_CONTINUED:
 * child D stopped by SIGSTOP (collected with WUNTRACED) then continued by
 * SIGCONT (not collected); child E stopped and continued, both collected.
 * Verifies: D and E run (state not T); waitpid(D, WCONTINUED|WNOHANG)
 * reports D continued, once; nothing is reported for E; the handler saw
 * exactly one stop and one continue of each; both exit with their codes.
 */
#include "ferry_test.h"
#include <sys/wait.h>

static pid_t kids[2];
static volatile int stops[2], conts[2];

static void on_chld(int sig, siginfo_t *si, void *ctx)
{
	(void)sig;
	(void)ctx;
	for (int i = 0; i < 2; i++)
		if (si->si_pid == kids[i]) {
			if (si->si_code == CLD_STOPPED)
				stops[i]++;
			else if (si->si_code == CLD_CONTINUED)
				conts[i]++;
		}
}

int main(void)
{
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_sigaction = on_chld;
	sa.sa_flags = SA_SIGINFO | SA_RESTART;
	FERRY_SYS(sigaction(SIGCHLD, &sa, NULL));
	sigset_t chld, old;
	sigemptyset(&chld);
	sigaddset(&chld, SIGCHLD);
	sigprocmask(SIG_BLOCK, &chld, &old);
	for (int i = 0; i < 2; i++) {
		kids[i] = FERRY_SYS(fork());
		if (kids[i] == 0) {
			ferry_wait_go();
			char p[PATH_MAX];
			ferry_path(p, sizeof p, "release");
			while (access(p, F_OK) != 0)
				ferry_sleep_ms(2);
			_exit(20 + i);
		}
	}
	sigprocmask(SIG_SETMASK, &old, NULL);
	int st;
	for (int i = 0; i < 2; i++) {
		FERRY_SYS(kill(kids[i], SIGSTOP));
		FERRY_CHECK_EQ("waitpid(WUNTRACED)", kids[i], waitpid(kids[i], &st, WUNTRACED));
		if (!FERRY_WAIT_UNTIL(stops[i] == 1, 5000))
			ferry_die("stop %d not seen", i);
		FERRY_SYS(kill(kids[i], SIGCONT));
		if (!FERRY_WAIT_UNTIL(conts[i] == 1, 5000))
			ferry_die("continue %d not seen", i);
	}
	FERRY_CHECK_EQ("waitpid(E, WCONTINUED)", kids[1], waitpid(kids[1], &st, WCONTINUED));
	FERRY_CHECK(WIFCONTINUED(st), "E: status %#x", st);

	ferry_ready();
	ferry_wait_go();

	st = 0;
	/* waitid, so that an early exit of D is not collected here. */
	siginfo_t si;
	memset(&si, 0, sizeof si);
	FERRY_CHECK_EQ("waitid(D, WCONTINUED)", 0, waitid(P_PID, kids[0], &si, WCONTINUED | WNOHANG));
	FERRY_CHECK(si.si_pid == kids[0] && si.si_code == CLD_CONTINUED, "D: si_pid %d si_code %d, expected continued",
		    (int)si.si_pid, si.si_code);
	memset(&si, 0, sizeof si);
	FERRY_CHECK_EQ("waitid(D, WCONTINUED) again", 0, waitid(P_PID, kids[0], &si, WCONTINUED | WNOHANG));
	FERRY_CHECK_EQ("D reported again", 0, si.si_pid);
	memset(&si, 0, sizeof si);
	FERRY_CHECK_EQ("waitid(E, WCONTINUED)", 0, waitid(P_PID, kids[1], &si, WCONTINUED | WNOHANG));
	FERRY_CHECK_EQ("E reported", 0, si.si_pid);
	for (int i = 0; i < 2; i++) {
		FERRY_CHECK_EQ("stops seen", 1, stops[i]);
		FERRY_CHECK_EQ("continues seen", 1, conts[i]);
	}
	char rel[PATH_MAX];
	FERRY_SYS(ferry_write_file(ferry_path(rel, sizeof rel, "release"), "1\n"));
	ferry_reap_child(kids[0], "D", 20, 5000);
	ferry_reap_child(kids[1], "E", 21, 5000);
	ferry_finish();
}
