/*
 * fd_proc_self: descriptors of the process's own /proc files (opened through
 * /proc/self: their links name /proc/PID).
 *
 * Sets up /proc/self/status (S) and /proc/self/fd (D) held open.
 * Verifies: S still reads this process's status (its Pid line), D is still a
 * directory, and their links name /proc/<our PID>.
 * PENDING: refused at checkpoint (a file of a process of the tree); before
 * that refusal the checkpoint killed the tree and the restore failed.
 */
#include "ferry_test.h"

int main(void)
{
	int s = FERRY_SYS(open("/proc/self/status", O_RDONLY));
	int d = FERRY_SYS(open("/proc/self/fd", O_RDONLY | O_DIRECTORY));

	ferry_ready();
	ferry_wait_go();

	char buf[4096] = "";
	FERRY_CHECK(pread(s, buf, sizeof buf - 1, 0) > 0, "S reads nothing: errno %d", errno);
	char want[64];
	snprintf(want, sizeof want, "\nPid:\t%d\n", getpid());
	FERRY_CHECK(strstr(buf, want) != NULL, "S is not this process's status");
	struct stat st;
	FERRY_CHECK(fstat(d, &st) == 0 && S_ISDIR(st.st_mode), "D is not a directory");
	char link[PATH_MAX];
	snprintf(want, sizeof want, "/proc/%d/status", getpid());
	FERRY_CHECK_EQ_STR("S's link", want, ferry_fd_link(s, link, sizeof link));
	ferry_finish();
}
