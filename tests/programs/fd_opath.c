/*
 * fd_opath: O_PATH file descriptors.
 *
 * Sets up F = open("file", O_PATH), D = open(test dir, O_PATH|O_DIRECTORY)
 * and L = open("link", O_PATH|O_NOFOLLOW) on a symlink to "file".
 * Verifies: paths, flags (incl. O_PATH), that F and D still cannot be read
 * (EBADF) but work as anchors: fstat(F), openat(D, "file"), readlinkat(L,
 * "") gives the symlink's target.
 */
#include "ferry_test.h"

int main(void)
{
	char pf[PATH_MAX], pl[PATH_MAX];
	ferry_path(pf, sizeof pf, "file");
	ferry_path(pl, sizeof pl, "link");
	int w = FERRY_SYS(open(pf, O_WRONLY | O_CREAT, 0640));
	FERRY_SYS(write(w, "contents", 8));
	close(w);
	FERRY_SYS(symlink("file", pl));
	int f = FERRY_SYS(open(pf, O_PATH));
	int d = FERRY_SYS(open(ferry_dir(), O_PATH | O_DIRECTORY));
	int l = FERRY_SYS(open(pl, O_PATH | O_NOFOLLOW));
	long ff = ferry_fdinfo_flags(f), fd = ferry_fdinfo_flags(d), fl = ferry_fdinfo_flags(l);
	char ld[PATH_MAX];
	ferry_fd_link(d, ld, sizeof ld);

	ferry_ready();
	ferry_wait_go();

	char link[PATH_MAX];
	FERRY_CHECK_EQ_STR("F path", pf, ferry_fd_link(f, link, sizeof link));
	FERRY_CHECK_EQ_STR("D path", ld, ferry_fd_link(d, link, sizeof link));
	FERRY_CHECK_EQ_STR("L path", pl, ferry_fd_link(l, link, sizeof link));
	FERRY_CHECK_EQ_HEX("F flags", ff, ferry_fdinfo_flags(f));
	FERRY_CHECK_EQ_HEX("D flags", fd, ferry_fdinfo_flags(d));
	FERRY_CHECK_EQ_HEX("L flags", fl, ferry_fdinfo_flags(l));
	FERRY_CHECK(ferry_fdinfo_flags(f) & O_PATH, "F lost O_PATH");
	char buf[16];
	errno = 0;
	FERRY_CHECK(read(f, buf, 1) < 0 && errno == EBADF, "read on an O_PATH fd: errno %d", errno);
	struct stat st;
	FERRY_CHECK(fstat(f, &st) == 0 && st.st_size == 8 && (st.st_mode & 0777) == 0640,
		    "fstat(F) wrong: size %lld mode %o", (long long)st.st_size, st.st_mode & 0777);
	int o = openat(d, "file", O_RDONLY);
	FERRY_CHECK(o >= 0, "openat(D, \"file\"): %s", strerror(errno));
	char t[16] = "";
	FERRY_CHECK(readlinkat(l, "", t, sizeof t - 1) == 4 && !strcmp(t, "file"),
		    "readlinkat(L, \"\") gave \"%s\"", t);
	ferry_finish();
}
