/*
 * mem_memfd_exec: a program running from a memfd (execveat/fexecve of a
 * memfd, as packers and self-updating programs do).
 *
 * Sets up: the program copies its own executable into memfd "ferry-exe" and
 * executes it through /proc/self/fd (fexecve), so that its text, data and
 * /proc/self/exe are the memfd's ("/memfd:ferry-exe (deleted)"); the memfd
 * descriptor itself is closed on exec.  A global counter is bumped.
 * Verifies: /proc/self/exe still names the memfd; its text still runs (a
 * call through a function pointer); the counter; the maps.
 */
#include "ferry_test.h"
#include <sys/sendfile.h>

static volatile int counter = 41;

static int __attribute__((noinline)) twice(int x)
{
	return 2 * x;
}

int main(int argc, char **argv)
{
	(void)argc;
	if (!getenv("FERRY_MEMFD_EXEC")) {
		int exe = FERRY_SYS(open("/proc/self/exe", O_RDONLY | O_CLOEXEC));
		int m = FERRY_SYS(memfd_create("ferry-exe", MFD_CLOEXEC));
		struct stat st;
		FERRY_SYS(fstat(exe, &st));
		off_t off = 0;
		while (off < st.st_size)
			if (sendfile(m, exe, &off, st.st_size - off) <= 0)
				ferry_die("copy the executable: %s", strerror(errno));
		setenv("FERRY_MEMFD_EXEC", "1", 1);
		extern char **environ;
		fexecve(m, argv, environ);
		ferry_die("fexecve: %s", strerror(errno));
	}
	counter++;
	char exe[256] = "";
	FERRY_SYS(readlink("/proc/self/exe", exe, sizeof exe - 1));
	FERRY_CHECK(strncmp(exe, "/memfd:ferry-exe", 16) == 0, "not running from the memfd: %s", exe);
	int (*volatile f)(int) = twice;
	static struct ferry_map maps[FERRY_MAX_MAPS];
	int nmaps = ferry_read_maps(maps, FERRY_MAX_MAPS);
	ferry_ready();
	ferry_wait_go();
	ferry_check_maps_same(maps, nmaps);
	char now[256] = "";
	FERRY_SYS(readlink("/proc/self/exe", now, sizeof now - 1));
	FERRY_CHECK_EQ_STR("/proc/self/exe", exe, now);
	FERRY_CHECK_EQ("text runs", 42, f(21));
	FERRY_CHECK_EQ("counter", 42, counter);
	ferry_finish();
}
