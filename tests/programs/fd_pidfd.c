/*
 * fd_pidfd: a pidfd referring to a child.
 *
 * Sets up child C (waits for go, then exits with 7) and P = pidfd_open(C).
 * Verifies: P's fdinfo "Pid:" is C's pid, P is not readable while C runs,
 * becomes readable when C exits, and waitid(P_PIDFD, P) reports exit code 7.
 */
#include "ferry_test.h"
#include <poll.h>

#ifndef P_PIDFD
#define P_PIDFD 3
#endif

int main(void)
{
	pid_t c = FERRY_SYS(fork());
	if (c == 0) {
		ferry_wait_go();
		ferry_sleep_ms(100);
		_exit(7);
	}
	int p = (int)FERRY_SYS(syscall(SYS_pidfd_open, c, 0));
	char pid_before[32];
	ferry_fdinfo_field(p, "Pid", pid_before, sizeof pid_before);

	ferry_ready();
	ferry_wait_go();

	char pid_now[32] = "", want[32];
	snprintf(want, sizeof want, "%d", (int)c);
	ferry_fdinfo_field(p, "Pid", pid_now, sizeof pid_now);
	FERRY_CHECK_EQ_STR("pidfd Pid", want, pid_now);
	struct pollfd pf = { .fd = p, .events = POLLIN };
	FERRY_CHECK_EQ("pidfd readable while the child runs", 0, poll(&pf, 1, 0));
	FERRY_CHECK_EQ("pidfd readable after the child exits", 1, poll(&pf, 1, 5000));
	siginfo_t si;
	memset(&si, 0, sizeof si);
	FERRY_CHECK_EQ("waitid(P_PIDFD)", 0, waitid(P_PIDFD, (id_t)p, &si, WEXITED));
	FERRY_CHECK_EQ("si_pid", c, si.si_pid);
	FERRY_CHECK_EQ("exit code", 7, si.si_status);
	ferry_finish();
}
