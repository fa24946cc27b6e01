/*
 * fd_removed_dir: a removed directory held open, and a removed working
 * directory.
 *
 * Sets up $T/held, opened O_RDONLY|O_DIRECTORY (fd D) and then removed;
 * $T/cwd, entered with chdir() and then removed.
 * Verifies: D is still a directory, removed (st_nlink 0, its link ends in
 * " (deleted)"), empty, and creating a file in it fails with ENOENT; the
 * working directory likewise (getcwd says it is unreachable or deleted,
 * and opening "." gives a removed directory); and the process can leave it
 * for $T again by its absolute path.
 */
#include "ferry_test.h"

static void check_removed(const char *what, int fd)
{
	struct stat st;
	FERRY_CHECK_EQ(what, 0, fstat(fd, &st));
	FERRY_CHECK(S_ISDIR(st.st_mode), "%s is not a directory", what);
	FERRY_CHECK_EQ("links of a removed directory", 0, (long)st.st_nlink);
	FERRY_CHECK(openat(fd, "new", O_CREAT | O_WRONLY, 0600) < 0 && errno == ENOENT,
		    "%s: a file could be made in it (errno %d)", what, errno);
	char link[PATH_MAX];
	const char *l = ferry_fd_link(fd, link, sizeof link);
	size_t n = strlen(l);
	FERRY_CHECK(n > 10 && strcmp(l + n - 10, " (deleted)") == 0, "%s's link: %s", what, l);
}

int main(void)
{
	char held[PATH_MAX], cwd[PATH_MAX];
	ferry_path(held, sizeof held, "held");
	ferry_path(cwd, sizeof cwd, "cwd");
	FERRY_SYS(mkdir(held, 0750));
	FERRY_SYS(mkdir(cwd, 0700));
	int d = FERRY_SYS(open(held, O_RDONLY | O_DIRECTORY));
	FERRY_SYS(rmdir(held));
	FERRY_SYS(chdir(cwd));
	FERRY_SYS(rmdir(cwd));
	struct stat sd;
	FERRY_SYS(fstat(d, &sd));
	int before[64];
	int nbefore = ferry_list_fds(before, 64);

	ferry_ready();
	ferry_wait_go();
	ferry_check_fds_same(before, nbefore);

	check_removed("D", d);
	struct stat now;
	fstat(d, &now);
	FERRY_CHECK_EQ_HEX("D's mode", sd.st_mode, now.st_mode);
	int here = open(".", O_RDONLY | O_DIRECTORY);
	FERRY_CHECK(here >= 0, "cannot open the working directory: errno %d", errno);
	if (here >= 0) {
		check_removed("working directory", here);
		close(here);
	}
	char buf[PATH_MAX];
	FERRY_CHECK(getcwd(buf, sizeof buf) == NULL && errno == ENOENT,
		    "getcwd answers for a removed directory");
	FERRY_CHECK_EQ("leave for $T", 0, chdir(ferry_dir()));
	ferry_finish();
}
