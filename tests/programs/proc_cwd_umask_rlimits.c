/*
 * proc_cwd_umask_rlimits: working directory, umask and resource limits.
 *
 * Sets up cwd = "$T/dir with space", umask 027, and non-default rlimits
 * (only lowered: without CAP_SYS_RESOURCE hard limits cannot be raised):
 * NOFILE 777/2048, CORE 0/1 GiB, STACK 6 MiB/unlimited, NPROC 5000/6000,
 * MSGQUEUE 12345/23456, FSIZE 1 GiB/2 GiB, SIGPENDING 9999/10000, MEMLOCK
 * 128 KiB/256 KiB, CPU 1000 s/2000 s, LOCKS 500/600.
 * Verifies: getcwd() and /proc/self/cwd, umask (/proc/self/status and the
 * mode of a newly created file), every one of the RLIM_NLIMITS limits equal
 * to its value at checkpoint time, and relative paths resolve against cwd.
 */
#include "ferry_test.h"
#include <sys/resource.h>

static void setlim(int r, rlim_t soft, rlim_t hard)
{
	struct rlimit l;
	getrlimit(r, &l); /* never above the current hard limit */
	if (hard > l.rlim_max)
		hard = l.rlim_max;
	if (soft > hard)
		soft = hard;
	l.rlim_cur = soft;
	l.rlim_max = hard;
	if (setrlimit(r, &l) < 0)
		ferry_die("setrlimit(%d): %s", r, strerror(errno));
}

int main(void)
{
	char dir[PATH_MAX];
	ferry_path(dir, sizeof dir, "dir with space");
	FERRY_SYS(mkdir(dir, 0755));
	FERRY_SYS(chdir(dir));
	char cwd_before[PATH_MAX];
	FERRY_PTR(getcwd(cwd_before, sizeof cwd_before));
	umask(027);
	setlim(RLIMIT_NOFILE, 777, 2048);
	setlim(RLIMIT_CORE, 0, 1UL << 30);
	setlim(RLIMIT_STACK, 6 << 20, RLIM_INFINITY);
	setlim(RLIMIT_NPROC, 5000, 6000);
	setlim(RLIMIT_MSGQUEUE, 12345, 23456);
	setlim(RLIMIT_CPU, 1000, 2000);
	setlim(RLIMIT_LOCKS, 500, 600);
	setlim(RLIMIT_FSIZE, 1UL << 30, 2UL << 30);
	setlim(RLIMIT_SIGPENDING, 9999, 10000);
	setlim(RLIMIT_MEMLOCK, 128 << 10, 256 << 10);
	struct rlimit before[RLIM_NLIMITS];
	for (int r = 0; r < RLIM_NLIMITS; r++)
		getrlimit(r, &before[r]);
	int rel = FERRY_SYS(open("relative.txt", O_WRONLY | O_CREAT, 0666));
	close(rel);

	ferry_ready();
	ferry_wait_go();

	char cwd[PATH_MAX] = "", link[PATH_MAX] = "";
	FERRY_CHECK(getcwd(cwd, sizeof cwd) != NULL, "getcwd: %s", strerror(errno));
	FERRY_CHECK_EQ_STR("getcwd", cwd_before, cwd);
	ssize_t n = readlink("/proc/self/cwd", link, sizeof link - 1);
	link[n < 0 ? 0 : n] = 0;
	FERRY_CHECK_EQ_STR("/proc/self/cwd", cwd_before, link);
	char um[16] = "";
	ferry_status_field(0, "Umask", um, sizeof um);
	FERRY_CHECK_EQ_STR("Umask", "0027", um);
	int fd = open("new.txt", O_WRONLY | O_CREAT, 0666);
	struct stat st;
	FERRY_CHECK(fd >= 0 && fstat(fd, &st) == 0 && (st.st_mode & 0777) == 0640,
		    "new file mode %o, expected 640", st.st_mode & 0777);
	FERRY_CHECK(access("relative.txt", F_OK) == 0, "relative.txt not found relative to cwd");
	for (int r = 0; r < RLIM_NLIMITS; r++) {
		struct rlimit now;
		getrlimit(r, &now);
		char what[64];
		snprintf(what, sizeof what, "rlimit %d soft", r);
		FERRY_CHECK_EQ(what, before[r].rlim_cur, now.rlim_cur);
		snprintf(what, sizeof what, "rlimit %d hard", r);
		FERRY_CHECK_EQ(what, before[r].rlim_max, now.rlim_max);
	}
	ferry_finish();
}
