/*
 * proc_session_orphaned: a session whose leader has exited.
 *
 * Sets up, under root R (a child subreaper): S calls setsid() and forks T,
 * then S exits; T, adopted by R, stays in session S, which has no leader.
 * Verifies: T's session is still S and its group S; R reaps T.
 * (The engine refuses to capture this: a session is made only by its
 * leader's setsid, and S is gone.)
 */
#include "ferry_test.h"
#include <sys/prctl.h>

int main(void)
{
	FERRY_SYS(prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0));
	int link[2];
	FERRY_SYS(pipe(link));
	pid_t s = FERRY_SYS(fork());
	if (s == 0) {
		FERRY_SYS(setsid());
		pid_t t = FERRY_SYS(fork());
		if (t == 0) {
			pid_t sid = getsid(0);
			FERRY_WAIT_UNTIL(getppid() != sid, 5000); /* adopted by R */
			pid_t me = getpid();
			if (write(link[1], &me, sizeof me) != sizeof me)
				ferry_die("tell R");
			ferry_wait_go();
			FERRY_CHECK_EQ("T: session of the exited leader", sid, getsid(0));
			FERRY_CHECK_EQ("T: group of the exited leader", sid, getpgid(0));
			ferry_child_finish();
		}
		_exit(0);
	}
	ferry_reap_child(s, "S", 0, 5000);
	pid_t t;
	if (read(link[0], &t, sizeof t) != sizeof t)
		ferry_die("T did not start");
	ferry_ready();
	ferry_wait_go();
	ferry_reap_child(t, "T", 0, 10000); /* adopted: R is a subreaper */
	ferry_finish();
}
