/*
 * fd_proc_self: descriptors of /proc files of processes of the tree (its own,
 * opened through /proc/self: their links name /proc/PID; and a child's).
 *
 * Sets up /proc/self/status (S, its offset moved to 5), /proc/self/fd held
 * open as a directory (D, and D2 a dup of it, sharing its offset), and
 * /proc/C/stat of child C (T; C waits in pause until killed).
 * Verifies: S still reads this process's status (its Pid line) at offset 5,
 * D is still a directory and lists S, D2 shares D's offset, T reads C's stat,
 * and the links name /proc/<our PID> and /proc/<C>.
 * (Before 2026-11-28 refused at checkpoint; before that refusal the checkpoint
 * killed the tree and the restore failed.)
 */
#include "ferry_test.h"
#include <dirent.h>

int main(void)
{
	pid_t c = FERRY_SYS(fork());
	if (c == 0) {
		for (;;)
			pause();
	}
	int s = FERRY_SYS(open("/proc/self/status", O_RDONLY));
	FERRY_CHECK_EQ("seek S", 5, lseek(s, 5, SEEK_SET));
	int d = FERRY_SYS(open("/proc/self/fd", O_RDONLY | O_DIRECTORY));
	int d2 = FERRY_SYS(dup(d));
	char path[64];
	snprintf(path, sizeof path, "/proc/%d/stat", (int)c);
	int t = FERRY_SYS(open(path, O_RDONLY));

	ferry_ready();
	ferry_wait_go();

	char buf[4096] = "";
	FERRY_CHECK_EQ("S's offset", 5, lseek(s, 0, SEEK_CUR));
	FERRY_CHECK(pread(s, buf, sizeof buf - 1, 0) > 0, "S reads nothing: errno %d", errno);
	char want[64];
	snprintf(want, sizeof want, "\nPid:\t%d\n", getpid());
	FERRY_CHECK(strstr(buf, want) != NULL, "S is not this process's status");
	struct stat st;
	FERRY_CHECK(fstat(d, &st) == 0 && S_ISDIR(st.st_mode), "D is not a directory");
	char link[PATH_MAX];
	snprintf(want, sizeof want, "/proc/%d/status", getpid());
	FERRY_CHECK_EQ_STR("S's link", want, ferry_fd_link(s, link, sizeof link));
	snprintf(want, sizeof want, "/proc/%d/fd", getpid());
	FERRY_CHECK_EQ_STR("D's link", want, ferry_fd_link(d, link, sizeof link));
	snprintf(want, sizeof want, "/proc/%d/stat", (int)c);
	FERRY_CHECK_EQ_STR("T's link", want, ferry_fd_link(t, link, sizeof link));

	/* D lists S; D2 shares D's offset. */
	int lister = FERRY_SYS(dup(d));
	DIR *dir = fdopendir(lister);
	FERRY_CHECK(dir != NULL, "fdopendir D: errno %d", errno);
	rewinddir(dir);
	snprintf(want, sizeof want, "%d", s);
	int found = 0;
	for (struct dirent *e; (e = readdir(dir)) != NULL;)
		found |= strcmp(e->d_name, want) == 0;
	FERRY_CHECK(found, "D does not list S (fd %d)", s);
	FERRY_CHECK(lseek(d, 0, SEEK_CUR) > 0, "D's offset did not move");
	FERRY_CHECK_EQ("D2 shares D's offset", lseek(d, 0, SEEK_CUR), lseek(d2, 0, SEEK_CUR));
	closedir(dir);

	memset(buf, 0, sizeof buf);
	FERRY_CHECK(pread(t, buf, sizeof buf - 1, 0) > 0, "T reads nothing: errno %d", errno);
	snprintf(want, sizeof want, "%d (", (int)c);
	FERRY_CHECK(strncmp(buf, want, strlen(want)) == 0, "T is not C's stat: %.40s", buf);
	kill(c, SIGKILL);
	FERRY_SYS(waitpid(c, NULL, 0));
	ferry_finish();
}
