/*
 * fd_append: O_APPEND file descriptors.
 *
 * Sets up log.txt with "first\n" written through fd A (O_WRONLY|O_APPEND)
 * and fd B (O_RDWR|O_APPEND, read offset moved to 2), then the file grown by
 * an unrelated fd that was closed.
 * Verifies: both fds still have O_APPEND (F_GETFL and fdinfo flags), B's
 * offset is unchanged, and writes after restore through A and B land at the
 * end of the file, even after the file grows through another fd.
 */
#include "ferry_test.h"

int main(void)
{
	char path[PATH_MAX];
	ferry_path(path, sizeof path, "log.txt");
	int a = FERRY_SYS(open(path, O_WRONLY | O_CREAT | O_APPEND, 0644));
	int b = FERRY_SYS(open(path, O_RDWR | O_APPEND));
	FERRY_SYS(write(a, "first\n", 6));
	FERRY_SYS(write(b, "second\n", 7));
	lseek(b, 2, SEEK_SET);
	int o = FERRY_SYS(open(path, O_WRONLY));
	FERRY_SYS(pwrite(o, "third\n", 6, 13));
	close(o);
	long fa = ferry_fdinfo_flags(a), fb = ferry_fdinfo_flags(b);
	off_t ob = lseek(b, 0, SEEK_CUR);

	ferry_ready();
	ferry_wait_go();

	FERRY_CHECK(fcntl(a, F_GETFL) & O_APPEND, "fd A lost O_APPEND");
	FERRY_CHECK(fcntl(b, F_GETFL) & O_APPEND, "fd B lost O_APPEND");
	FERRY_CHECK_EQ_HEX("fd A flags", fa, ferry_fdinfo_flags(a));
	FERRY_CHECK_EQ_HEX("fd B flags", fb, ferry_fdinfo_flags(b));
	FERRY_CHECK_EQ("fd B offset", ob, lseek(b, 0, SEEK_CUR));
	char buf[64] = "";
	FERRY_CHECK_EQ("read via B", 4, read(b, buf, 4));
	FERRY_CHECK_MEM("read via B at offset 2", "rst\n", buf, 4);
	o = open(path, O_WRONLY);
	FERRY_CHECK_EQ("grow through another fd", 6, pwrite(o, "fourth", 6, 19));
	close(o);
	FERRY_CHECK_EQ("append via A", 2, write(a, "A\n", 2));
	FERRY_CHECK_EQ("append via B", 2, write(b, "B\n", 2));
	const char *want = "first\nsecond\nthird\nfourthA\nB\n";
	memset(buf, 0, sizeof buf);
	int r = open(path, O_RDONLY);
	FERRY_CHECK_EQ("file size", (ssize_t)strlen(want), read(r, buf, sizeof buf - 1));
	FERRY_CHECK_EQ_STR("file contents", want, buf);
	ferry_finish();
}
