/*
 * fd_directory: directory file descriptors.
 *
 * Sets up a directory "d" with 40 files; fd A = open(d, O_RDONLY|
 * O_DIRECTORY) part-way through a getdents64 listing (first 10 entries
 * read); fd B = O_DIRECTORY|O_CLOEXEC on the test dir, used with openat().
 * Verifies: same paths and flags; continuing the listing on A yields
 * exactly the entries not yet seen (no repeats, none missing); openat(B)
 * and fstatat(A) still resolve relative names.
 */
#include "ferry_test.h"

#define NFILES 40

static char seen[NFILES + 2];

static int list_some(int fd, int max, int *count)
{
	char buf[4096];
	int got = 0;
	while (got < max) {
		/* small buffer: a few entries per call */
		long r = syscall(SYS_getdents64, fd, buf, max == INT_MAX ? sizeof buf : 64);
		if (r < 0)
			return -1;
		if (r == 0)
			break;
		for (long off = 0; off < r;) {
			struct dirent64 *d = (void *)(buf + off);
			int k;
			if (sscanf(d->d_name, "f%d", &k) == 1 && k >= 0 && k < NFILES) {
				if (seen[k])
					ferry_fail("entry %s listed twice", d->d_name);
				seen[k] = 1;
			}
			got++;
			off += d->d_reclen;
		}
	}
	*count = got;
	return 0;
}

int main(void)
{
	char dpath[PATH_MAX];
	ferry_path(dpath, sizeof dpath, "d");
	FERRY_SYS(mkdir(dpath, 0755));
	for (int i = 0; i < NFILES; i++) {
		char p[PATH_MAX + 16];
		snprintf(p, sizeof p, "%s/f%d", dpath, i);
		close(FERRY_SYS(open(p, O_WRONLY | O_CREAT, 0644)));
	}
	int a = FERRY_SYS(open(dpath, O_RDONLY | O_DIRECTORY));
	int first = 0;
	if (list_some(a, 10, &first) < 0 || first < 10)
		ferry_die("first part of listing failed");
	off_t pos = lseek(a, 0, SEEK_CUR);
	int b = FERRY_SYS(open(ferry_dir(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
	long fa = ferry_fdinfo_flags(a), fb = ferry_fdinfo_flags(b);
	char lb[PATH_MAX];
	ferry_fd_link(b, lb, sizeof lb);

	ferry_ready();
	ferry_wait_go();

	char link[PATH_MAX];
	FERRY_CHECK_EQ_STR("fd A path", dpath, ferry_fd_link(a, link, sizeof link));
	FERRY_CHECK_EQ_STR("fd B path", lb, ferry_fd_link(b, link, sizeof link));
	FERRY_CHECK_EQ_HEX("fd A flags", fa, ferry_fdinfo_flags(a));
	FERRY_CHECK_EQ_HEX("fd B flags", fb, ferry_fdinfo_flags(b));
	FERRY_CHECK_EQ("fd A position", pos, lseek(a, 0, SEEK_CUR));
	int rest = 0;
	FERRY_CHECK(list_some(a, INT_MAX, &rest) == 0, "getdents64 after restore: %s", strerror(errno));
	for (int i = 0; i < NFILES; i++)
		FERRY_CHECK(seen[i], "entry f%d never listed", i);
	FERRY_CHECK_EQ("entries in total (incl. . and ..)", NFILES + 2, first + rest);
	int x = openat(b, "d/f7", O_RDONLY);
	FERRY_CHECK(x >= 0, "openat(fd B, \"d/f7\"): %s", strerror(errno));
	struct stat st;
	FERRY_CHECK(fstatat(a, "f9", &st, 0) == 0, "fstatat(fd A, \"f9\"): %s", strerror(errno));
	ferry_finish();
}
