/*
 * fd_fifo: a named pipe (FIFO) in the test dir with data in it.
 *
 * Sets up fifo "f": fd R opened O_RDONLY|O_NONBLOCK, fd W opened O_WRONLY,
 * fd RW opened O_RDWR; 5000 bytes written through W, not yet read.
 * Verifies: paths, flags, the FIFO inode (same as stat of the path), the
 * 5000 bytes come out of R exactly once, and R/W/RW are ends of one pipe
 * (data written via RW is read via R).
 */
#include "ferry_test.h"

int main(void)
{
	char path[PATH_MAX];
	ferry_path(path, sizeof path, "f");
	FERRY_SYS(mkfifo(path, 0600));
	int r = FERRY_SYS(open(path, O_RDONLY | O_NONBLOCK));
	int w = FERRY_SYS(open(path, O_WRONLY));
	int rw = FERRY_SYS(open(path, O_RDWR));
	static unsigned char data[5000], buf[6000];
	ferry_fill(data, sizeof data, 190);
	FERRY_SYS(write(w, data, sizeof data));
	long fr = ferry_fdinfo_flags(r), fw = ferry_fdinfo_flags(w), frw = ferry_fdinfo_flags(rw);

	ferry_ready();
	ferry_wait_go();

	char link[PATH_MAX];
	int fds[3] = { r, w, rw };
	long fl[3] = { fr, fw, frw };
	struct stat sp;
	FERRY_CHECK(stat(path, &sp) == 0 && S_ISFIFO(sp.st_mode), "%s is not a FIFO any more", path);
	for (int i = 0; i < 3; i++) {
		char what[64];
		snprintf(what, sizeof what, "fd %d path", fds[i]);
		FERRY_CHECK_EQ_STR(what, path, ferry_fd_link(fds[i], link, sizeof link));
		snprintf(what, sizeof what, "fd %d flags", fds[i]);
		FERRY_CHECK_EQ_HEX(what, fl[i], ferry_fdinfo_flags(fds[i]));
		struct stat st;
		fstat(fds[i], &st);
		snprintf(what, sizeof what, "fd %d inode", fds[i]);
		FERRY_CHECK_EQ(what, sp.st_ino, st.st_ino);
	}
	ssize_t got = 0, n;
	while ((n = read(r, buf + got, sizeof buf - (size_t)got)) > 0)
		got += n;
	FERRY_CHECK_EQ("bytes buffered in the FIFO", (ssize_t)sizeof data, got);
	FERRY_CHECK_MEM("FIFO data", data, buf, sizeof data);
	FERRY_CHECK_EQ("write via RW", 5, write(rw, "hello", 5));
	FERRY_CHECK_EQ("read via R", 5, read(r, buf, sizeof buf));
	FERRY_CHECK_MEM("data via RW -> R", "hello", buf, 5);
	FERRY_CHECK_EQ("write via W", 2, write(w, "hi", 2));
	FERRY_CHECK_EQ("read via RW", 2, read(rw, buf, 2));
	ferry_finish();
}
