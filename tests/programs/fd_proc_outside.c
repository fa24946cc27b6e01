/*
 * fd_proc_outside: a descriptor of a /proc file of a process outside the tree.
 *
 * Sets up O, /proc/B/stat of process B: a grandchild whose parent has exited,
 * so that it is not a descendant (B exits once this process has: it waits on
 * a pidfd of it).
 * Verifies: O still reads B's stat.
 * PENDING: refused at checkpoint, naming the fd and /proc/B (B is not rebuilt
 * with the tree). Before 2026-11-28 the checkpoint took it, and the restore
 * opened /proc/B/stat again by its path: the tree was lost when B had gone
 * (or got whichever process had that number then).
 */
#include "ferry_test.h"
#include <poll.h>

int main(void)
{
	pid_t me = getpid();
	int p[2];
	FERRY_SYS(pipe(p));
	pid_t a = FERRY_SYS(fork());
	if (a == 0) {
		pid_t b = fork();
		if (b == 0) {
			int pf = (int)syscall(SYS_pidfd_open, me, 0);
			close(p[0]);
			close(p[1]);
			struct pollfd w = { .fd = pf, .events = POLLIN };
			while (pf >= 0 && poll(&w, 1, -1) < 0 && errno == EINTR)
				;
			_exit(0);
		}
		if (write(p[1], &b, sizeof b) != sizeof b)
			_exit(1);
		_exit(0);
	}
	pid_t b = 0;
	FERRY_CHECK_EQ("B's PID read", (ssize_t)sizeof b, read(p[0], &b, sizeof b));
	FERRY_SYS(waitpid(a, NULL, 0));
	close(p[0]);
	close(p[1]);
	char path[64];
	snprintf(path, sizeof path, "/proc/%d/stat", (int)b);
	int o = FERRY_SYS(open(path, O_RDONLY));

	ferry_ready();
	ferry_wait_go();

	char buf[512] = "", want[32];
	FERRY_CHECK(pread(o, buf, sizeof buf - 1, 0) > 0, "O reads nothing: errno %d", errno);
	snprintf(want, sizeof want, "%d (", (int)b);
	FERRY_CHECK(strncmp(buf, want, strlen(want)) == 0, "O is not B's stat: %.40s", buf);
	kill(b, SIGKILL);
	ferry_finish();
}
