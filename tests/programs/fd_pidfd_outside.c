/*
 * fd_pidfd_outside: a pidfd of a process outside the tree (its parent).
 *
 * Sets up P = pidfd_open(getppid()).
 * Verifies: P's fdinfo "Pid:" is still the parent's pid and P is not
 * readable (the parent runs on).
 * (The engine refuses to capture this: the pidfd would have to refer to a
 * process that is not rebuilt with the tree.)
 */
#include "ferry_test.h"
#include <poll.h>

int main(void)
{
	pid_t parent = getppid();
	int p = (int)FERRY_SYS(syscall(SYS_pidfd_open, parent, 0));
	ferry_ready();
	ferry_wait_go();
	char pid_now[32];
	ferry_fdinfo_field(p, "Pid", pid_now, sizeof pid_now);
	FERRY_CHECK_EQ("fdinfo Pid", (int)parent, atoi(pid_now));
	struct pollfd pfd = { .fd = p, .events = POLLIN };
	FERRY_CHECK_EQ("the parent still runs", 0, poll(&pfd, 1, 0));
	ferry_finish();
}
