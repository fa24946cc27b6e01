/*
 * proc_loginuid: the audit login uid (and that it is kept per process).
 *
 * Sets up: this process's /proc/self/loginuid set to 4321 (root with
 * CAP_AUDIT_CONTROL may set it while it is unset or not immutable); a child
 * forked before that keeps the restorer's value.
 * Verifies: /proc/self/loginuid reads 4321 in this process, and the child's
 * reads what it read before.  (The audit session id is new after a restore:
 * it is not compared.)
 */
#include "ferry_test.h"

static long read_luid(pid_t pid)
{
	char path[64], buf[32];
	snprintf(path, sizeof path, "/proc/%d/loginuid", (int)pid);
	if (ferry_read_file(path, buf, sizeof buf) < 0)
		return -1;
	return atol(buf);
}

int main(void)
{
	long before = read_luid(getpid());
	if (before < 0)
		ferry_die("no /proc/self/loginuid (a kernel without audit)");
	pid_t c = FERRY_SYS(fork());
	if (c == 0) {
		ferry_wait_go();
		FERRY_CHECK_EQ("child's loginuid", before, read_luid(getpid()));
		ferry_child_finish();
	}
	if (ferry_write_file("/proc/self/loginuid", "4321") < 0)
		ferry_die("set loginuid: %s", strerror(errno));
	FERRY_CHECK_EQ("loginuid set", 4321, read_luid(getpid()));

	ferry_ready();
	ferry_wait_go();

	FERRY_CHECK_EQ("loginuid", 4321, read_luid(getpid()));
	ferry_reap_child(c, "child", 0, 5000);
	ferry_finish();
}
