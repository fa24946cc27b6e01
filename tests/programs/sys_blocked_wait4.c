/*
 * sys_blocked_wait4: threads blocked waiting for children.
 *
 * Sets up two children that wait for go; thread A is blocked in wait4() on
 * child 1 (which then exits with status 42), thread B in waitid(P_PID,
 * WEXITED) on child 2 (which then kills itself with SIGTERM).
 * Verifies: wait4 returns child 1's pid with WEXITSTATUS 42, waitid reports
 * CLD_KILLED / SIGTERM for child 2; neither ever fails with EINTR.
 */
#include "ferry_test.h"
#include <sys/resource.h>

static pid_t c1, c2;
static volatile pid_t ta_tid, tb_tid;
static pid_t r1;
static int st1, err1, r2, err2;
static siginfo_t si2;

static void *wait_a(void *arg)
{
	(void)arg;
	ta_tid = ferry_gettid();
	struct rusage ru;
	r1 = wait4(c1, &st1, 0, &ru);
	err1 = r1 < 0 ? errno : 0;
	return NULL;
}

static void *wait_b(void *arg)
{
	(void)arg;
	tb_tid = ferry_gettid();
	r2 = waitid(P_PID, (id_t)c2, &si2, WEXITED);
	err2 = r2 < 0 ? errno : 0;
	return NULL;
}

int main(void)
{
	c1 = FERRY_SYS(fork());
	if (c1 == 0) {
		ferry_wait_go();
		_exit(42);
	}
	c2 = FERRY_SYS(fork());
	if (c2 == 0) {
		ferry_wait_go();
		signal(SIGTERM, SIG_DFL);
		raise(SIGTERM);
		_exit(1);
	}
	pthread_t a, b;
	if (pthread_create(&a, NULL, wait_a, NULL) || pthread_create(&b, NULL, wait_b, NULL))
		ferry_die("pthread_create");
	FERRY_WAIT_UNTIL(ta_tid && tb_tid, 5000);
	if (!ferry_wait_blocked(ta_tid, SYS_wait4, SYS_wait4, 5000) ||
	    !ferry_wait_blocked(tb_tid, SYS_waitid, SYS_waitid, 5000))
		ferry_die("waiters not blocked");

	ferry_ready();
	ferry_wait_go();

	pthread_join(a, NULL);
	pthread_join(b, NULL);
	FERRY_CHECK(err1 != EINTR, "wait4 failed with EINTR");
	FERRY_CHECK_EQ("wait4 result", c1, r1);
	FERRY_CHECK(WIFEXITED(st1) && WEXITSTATUS(st1) == 42, "wait4 status %#x, expected exit 42", st1);
	FERRY_CHECK(err2 != EINTR, "waitid failed with EINTR");
	FERRY_CHECK_EQ("waitid result", 0, r2);
	FERRY_CHECK_EQ("waitid si_pid", c2, si2.si_pid);
	FERRY_CHECK_EQ("waitid si_code", CLD_KILLED, si2.si_code);
	FERRY_CHECK_EQ("waitid si_status", SIGTERM, si2.si_status);
	ferry_finish();
}
