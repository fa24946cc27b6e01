/*
 * fd_proc_outside: a descriptor of a /proc file of a process outside the tree
 * (PID 1's stat).
 *
 * Sets up /proc/1/stat (O) held open.
 * Verifies: O still reads PID 1's stat.
 * PENDING: refused at checkpoint, naming the fd and /proc/1 (that process is
 * not rebuilt with the tree).
 */
#include "ferry_test.h"

int main(void)
{
	int o = FERRY_SYS(open("/proc/1/stat", O_RDONLY));

	ferry_ready();
	ferry_wait_go();

	char buf[512] = "";
	FERRY_CHECK(pread(o, buf, sizeof buf - 1, 0) > 0, "O reads nothing: errno %d", errno);
	FERRY_CHECK(strncmp(buf, "1 (", 3) == 0, "O is not PID 1's stat: %.40s", buf);
	ferry_finish();
}
