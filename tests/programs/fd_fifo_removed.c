/*
 * fd_fifo_removed: a FIFO unlinked while held open.
 *
 * Sets up $T/fifo (mode 0640), opened O_RDWR (A), O_RDONLY|O_NONBLOCK (R)
 * and O_WRONLY (W), with "abc" written into it, then unlinked.
 * Verifies: all three are still the same FIFO (S_ISFIFO, mode, their links
 * end in " (deleted)", the name is gone), the buffered "abc" is read
 * through R, and bytes written through W and A come out of R.
 */
#include "ferry_test.h"

static void check_link(const char *what, int fd, const char *path)
{
	char link[PATH_MAX + 16], want[PATH_MAX + 16];
	snprintf(want, sizeof want, "%s (deleted)", path);
	FERRY_CHECK_EQ_STR(what, want, ferry_fd_link(fd, link, sizeof link));
}

int main(void)
{
	char path[PATH_MAX];
	ferry_path(path, sizeof path, "fifo");
	FERRY_SYS(mkfifo(path, 0640));
	int a = FERRY_SYS(open(path, O_RDWR));
	int r = FERRY_SYS(open(path, O_RDONLY | O_NONBLOCK));
	int w = FERRY_SYS(open(path, O_WRONLY));
	FERRY_SYS(write(w, "abc", 3));
	FERRY_SYS(unlink(path));
	long fa = ferry_fdinfo_flags(a), fr = ferry_fdinfo_flags(r), fw = ferry_fdinfo_flags(w);
	int before[64];
	int nbefore = ferry_list_fds(before, 64);

	ferry_ready();
	ferry_wait_go();
	ferry_check_fds_same(before, nbefore);

	struct stat st;
	FERRY_CHECK_EQ("fstat(R)", 0, fstat(r, &st));
	FERRY_CHECK(S_ISFIFO(st.st_mode), "R is not a FIFO");
	FERRY_CHECK_EQ_HEX("FIFO's mode", 0640, st.st_mode & 07777);
	FERRY_CHECK_EQ("links of an unlinked FIFO", 0, (long)st.st_nlink);
	check_link("A's link", a, path);
	check_link("R's link", r, path);
	check_link("W's link", w, path);
	FERRY_CHECK(access(path, F_OK) < 0, "the FIFO is back under its name");
	FERRY_CHECK_EQ_HEX("A flags", fa, ferry_fdinfo_flags(a));
	FERRY_CHECK_EQ_HEX("R flags", fr, ferry_fdinfo_flags(r));
	FERRY_CHECK_EQ_HEX("W flags", fw, ferry_fdinfo_flags(w));
	char buf[16] = "";
	FERRY_CHECK_EQ("buffered bytes", 3, read(r, buf, sizeof buf));
	FERRY_CHECK_EQ_STR("buffered", "abc", buf);
	FERRY_CHECK_EQ("write through W", 2, write(w, "wx", 2));
	FERRY_CHECK_EQ("write through A", 2, write(a, "ay", 2));
	memset(buf, 0, sizeof buf);
	FERRY_CHECK_EQ("read them back", 4, read(r, buf, sizeof buf));
	FERRY_CHECK_EQ_STR("bytes through the FIFO", "wxay", buf);
	ferry_finish();
}
