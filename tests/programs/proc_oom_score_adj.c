/*
 * proc_oom_score_adj: the OOM killer's adjustment, per process.
 *
 * Sets up: this process at oom_score_adj 567, a child lowers its own to 123
 * (still above the lowest it may set without CAP_SYS_RESOURCE).
 * Verifies: both read back the same values from /proc/<pid>/oom_score_adj.
 */
#include "ferry_test.h"

static int read_adj(pid_t pid)
{
	char path[64], buf[32];
	snprintf(path, sizeof path, "/proc/%d/oom_score_adj", (int)pid);
	if (ferry_read_file(path, buf, sizeof buf) < 0)
		return -9999;
	return atoi(buf);
}

static void set_adj(pid_t pid, int v)
{
	char path[64], buf[32];
	snprintf(path, sizeof path, "/proc/%d/oom_score_adj", (int)pid);
	snprintf(buf, sizeof buf, "%d\n", v);
	if (ferry_write_file(path, buf) < 0)
		ferry_die("write %s: %s", path, strerror(errno));
}

int main(void)
{
	set_adj(getpid(), 567);
	pid_t c = FERRY_SYS(fork());
	if (c == 0) {
		set_adj(getpid(), 123);
		ferry_wait_go();
		FERRY_CHECK_EQ("child's oom_score_adj", 123, read_adj(getpid()));
		ferry_child_finish();
	}
	if (!FERRY_WAIT_UNTIL(read_adj(c) == 123, 5000))
		ferry_die("the child did not set its oom_score_adj");

	ferry_ready();
	ferry_wait_go();

	FERRY_CHECK_EQ("oom_score_adj", 567, read_adj(getpid()));
	ferry_reap_child(c, "child", 0, 5000);
	ferry_finish();
}
