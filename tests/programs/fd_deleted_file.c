/*
 * fd_deleted_file: open files that were unlinked.
 *
 * Sets up fd A (O_RDWR) on a 10000-byte file at offset 1234 and fd B
 * (O_RDONLY) on another file, both unlinked; a new, different file was then
 * created under A's old name.
 * Verifies: same fds, paths ".../name (deleted)", st_nlink 0, size,
 * offsets, contents; A and B are not the new file; writes through A are
 * readable through A and do not reach the new file.
 */
#include "ferry_test.h"

#define SZ 10000

int main(void)
{
	char pa[PATH_MAX], pb[PATH_MAX];
	ferry_path(pa, sizeof pa, "del-a.bin");
	ferry_path(pb, sizeof pb, "del-b.bin");
	static unsigned char data[SZ];
	int a = FERRY_SYS(open(pa, O_RDWR | O_CREAT | O_TRUNC, 0644));
	ferry_fill(data, SZ, 170);
	FERRY_SYS(write(a, data, SZ));
	lseek(a, 1234, SEEK_SET);
	int b = FERRY_SYS(open(pb, O_RDWR | O_CREAT | O_TRUNC, 0644));
	FERRY_SYS(write(b, "bbbb", 4));
	close(b);
	b = FERRY_SYS(open(pb, O_RDONLY));
	FERRY_SYS(unlink(pa));
	FERRY_SYS(unlink(pb));
	int n = FERRY_SYS(open(pa, O_WRONLY | O_CREAT | O_TRUNC, 0644));
	FERRY_SYS(write(n, "new file", 8));
	close(n);
	struct stat sa_before;
	fstat(a, &sa_before);

	ferry_ready();
	ferry_wait_go();

	char link[PATH_MAX], want[PATH_MAX + 16];
	snprintf(want, sizeof want, "%s (deleted)", pa);
	FERRY_CHECK_EQ_STR("fd A path", want, ferry_fd_link(a, link, sizeof link));
	snprintf(want, sizeof want, "%s (deleted)", pb);
	FERRY_CHECK_EQ_STR("fd B path", want, ferry_fd_link(b, link, sizeof link));
	struct stat st;
	fstat(a, &st);
	FERRY_CHECK_EQ("fd A st_nlink", 0, st.st_nlink);
	FERRY_CHECK_EQ("fd A size", SZ, st.st_size);
	FERRY_CHECK_EQ_HEX("fd A mode", sa_before.st_mode, st.st_mode);
	FERRY_CHECK_EQ("fd A offset", 1234, lseek(a, 0, SEEK_CUR));
	static unsigned char buf[SZ];
	FERRY_CHECK_EQ("pread A", SZ, pread(a, buf, SZ, 0));
	FERRY_CHECK_MEM("fd A contents", data, buf, SZ);
	char bb[8] = "";
	FERRY_CHECK_EQ("read B", 4, read(b, bb, sizeof bb));
	FERRY_CHECK_MEM("fd B contents", "bbbb", bb, 4);
	fstat(b, &st);
	FERRY_CHECK_EQ("fd B st_nlink", 0, st.st_nlink);
	FERRY_CHECK_EQ("write via A", 3, write(a, "XYZ", 3));
	char x[3];
	FERRY_CHECK_EQ("pread A", 3, pread(a, x, 3, 1234));
	FERRY_CHECK_MEM("data written via A", "XYZ", x, 3);
	char nb[16] = "";
	int nn = open(pa, O_RDONLY);
	FERRY_CHECK(nn >= 0 && read(nn, nb, sizeof nb) == 8 && !memcmp(nb, "new file", 8),
		    "the new file under the old name was changed: \"%s\"", nb);
	ferry_finish();
}
