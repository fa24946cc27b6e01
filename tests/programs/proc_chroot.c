/*
 * proc_chroot: a process whose root directory is not /, with a working
 * directory inside it.
 *
 * Sets up: T/sub, T/marker and, inside T, T's own absolute path as a
 * symbolic link to / (so that the protocol's files, named by T's absolute
 * path, are still reachable from inside); then chroot(T) and chdir("/sub").
 * A child C, before that, changes its root to T/jail and stays in T: its
 * working directory lies outside its root (chroot without chdir).
 * Verifies: getcwd() is "/sub"; "/marker" is T's; "/.." is "/" (no way out);
 * "." and "/" are the same directories (device and inode) as before.  C
 * still finds "go" relative to its directory, outside its root, reads
 * T/jail/inner as "/inner", and exits with 0 (a failure code otherwise).
 */
#include "ferry_test.h"
#include <sys/wait.h>

int main(void)
{
	char path[PATH_MAX + 64], link[2 * PATH_MAX];
	const char *t = ferry_dir();
	snprintf(path, sizeof path, "%s/sub", t);
	FERRY_SYS(mkdir(path, 0755));
	snprintf(path, sizeof path, "%s/marker", t);
	FERRY_SYS(ferry_write_file(path, "inside\n"));
	/* T/<T's path>: its directories, then the link itself to "/" (= T inside). */
	snprintf(link, sizeof link, "%s%s", t, t);
	for (char *s = link + strlen(t) + 1; (s = strchr(s, '/')); s++) {
		*s = 0;
		mkdir(link, 0755);
		*s = '/';
	}
	FERRY_SYS(symlink("/", link));
	snprintf(path, sizeof path, "%s/jail", t);
	FERRY_SYS(mkdir(path, 0755));
	snprintf(path, sizeof path, "%s/jail/inner", t);
	FERRY_SYS(ferry_write_file(path, "inner\n"));
	FERRY_SYS(chdir(t));
	pid_t c = FERRY_SYS(fork());
	if (c == 0) {
		if (chroot("jail") < 0)
			_exit(2);
		/* Only relative names reach T now. */
		while (access("go", F_OK) != 0)
			ferry_sleep_ms(2);
		char b[64] = "";
		if (ferry_read_file("/inner", b, sizeof b) <= 0 || strcmp(b, "inner\n"))
			_exit(3);
		if (access("marker", F_OK) != 0)
			_exit(4);
		if (access("/marker", F_OK) == 0)
			_exit(5);
		_exit(0);
	}
	FERRY_SYS(chroot(t));
	FERRY_SYS(chdir("/sub"));
	struct stat dot, root;
	FERRY_SYS(stat(".", &dot));
	FERRY_SYS(stat("/", &root));

	ferry_ready();
	ferry_wait_go();

	char cwd[PATH_MAX] = "";
	FERRY_CHECK(getcwd(cwd, sizeof cwd) != NULL, "getcwd: %s", strerror(errno));
	FERRY_CHECK_EQ_STR("cwd", "/sub", cwd);
	char buf[64] = "";
	FERRY_CHECK(ferry_read_file("/marker", buf, sizeof buf) > 0, "/marker: %s", strerror(errno));
	FERRY_CHECK_EQ_STR("/marker", "inside\n", buf);
	struct stat st;
	FERRY_CHECK(stat("/..", &st) == 0 && st.st_ino == root.st_ino && st.st_dev == root.st_dev,
		    "\"/..\" leads out of the root");
	FERRY_CHECK(stat(".", &st) == 0 && st.st_ino == dot.st_ino && st.st_dev == dot.st_dev, "\".\" moved");
	FERRY_CHECK(stat("/", &st) == 0 && st.st_ino == root.st_ino && st.st_dev == root.st_dev, "\"/\" moved");
	int status = 0;
	FERRY_CHECK_EQ("waitpid(C)", c, waitpid(c, &status, 0));
	FERRY_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "C: status %#x", status);
	ferry_finish();
}
