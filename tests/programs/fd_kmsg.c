/*
 * fd_kmsg: /dev/kmsg, the kernel's log, whose read position (the sequence
 * number of the next record) belongs to each open file.
 *
 * Sets up three descriptions: a writer (O_WRONLY), a reader with records
 * waiting (O_RDONLY|O_NONBLOCK: SEEK_END, three lines logged through the
 * writer, one record read) and a reader at its end (O_RDONLY: a marker line
 * written through the writer, then SEEK_END, so nothing waits).
 * Verifies: paths, device numbers, flags; the middle reader's next record is
 * the one after the one it read (its sequence number); the end reader's next
 * record is the next one logged (sequence number one past the marker's), and
 * the second marker, written after the restore, reaches it; the writer still
 * writes.
 */
#include "ferry_test.h"
#include <sys/sysmacros.h>

static long long rec_seq(const char *rec)
{
	long long seq = -1;
	int prio;
	if (sscanf(rec, "%d,%lld,", &prio, &seq) != 2)
		return -1;
	return seq;
}

/* One record of fd (blocking or not), its sequence number; -errno on error. */
static long long next_rec(int fd, char *buf, size_t size)
{
	ssize_t n = read(fd, buf, size - 1);
	if (n < 0)
		return -errno;
	buf[n] = 0;
	return rec_seq(buf);
}

static char buf[16384];

int main(void)
{
	int w = FERRY_SYS(open("/dev/kmsg", O_WRONLY));
	int mid = FERRY_SYS(open("/dev/kmsg", O_RDONLY | O_NONBLOCK));
	int end = FERRY_SYS(open("/dev/kmsg", O_RDONLY));
	int fds[3] = { w, mid, end };
	long fl[3];
	for (int i = 0; i < 3; i++)
		fl[i] = FERRY_SYS(fcntl(fds[i], F_GETFL));

	/* Near the end of the log, not at its start, whose first records the kernel overwrites
	 * as others log (a reader there would rightly be refused: its next read fails with
	 * EPIPE). Three lines logged, one record read: two or more wait. */
	FERRY_SYS(lseek(mid, 0, SEEK_END));
	for (int i = 0; i < 3; i++) {
		char line[96];
		snprintf(line, sizeof line, "<7>ferry test fd_kmsg %d: line %d\n", (int)getpid(), i);
		FERRY_SYS(write(w, line, strlen(line)));
	}
	long long last = next_rec(mid, buf, sizeof buf);
	if (last < 0)
		ferry_die("read /dev/kmsg: %lld", last);

	char marker[128];
	snprintf(marker, sizeof marker, "<7>ferry test fd_kmsg %d: first marker\n", (int)getpid());
	FERRY_SYS(write(w, marker, strlen(marker)));
	FERRY_SYS(lseek(end, 0, SEEK_END));
	/* SEEK_END came after the marker: nothing waits. Its position is the marker's + 1. */
	long long mark_seq = -1;
	{
		int probe = FERRY_SYS(open("/dev/kmsg", O_RDONLY | O_NONBLOCK));
		char needle[96];
		snprintf(needle, sizeof needle, "ferry test fd_kmsg %d: first marker", (int)getpid());
		long long s;
		while ((s = next_rec(probe, buf, sizeof buf)) != -EAGAIN) {
			if (s >= 0 && strstr(buf, needle))
				mark_seq = s;
		}
		close(probe);
	}
	if (mark_seq < 0)
		ferry_die("the first marker is not in the log");

	ferry_ready();
	ferry_wait_go();

	for (int i = 0; i < 3; i++) {
		char link[PATH_MAX];
		FERRY_CHECK_EQ_STR("path", "/dev/kmsg", ferry_fd_link(fds[i], link, sizeof link));
		FERRY_CHECK_EQ_HEX("flags", fl[i], fcntl(fds[i], F_GETFL));
		struct stat st;
		fstat(fds[i], &st);
		FERRY_CHECK_EQ_HEX("st_rdev", makedev(1, 11), st.st_rdev);
	}
	FERRY_CHECK_EQ("middle reader's next record", last + 1, next_rec(mid, buf, sizeof buf));

	char marker2[128];
	snprintf(marker2, sizeof marker2, "<7>ferry test fd_kmsg %d: second marker\n", (int)getpid());
	FERRY_CHECK_EQ("write /dev/kmsg", (ssize_t)strlen(marker2), write(w, marker2, strlen(marker2)));
	/* The end reader: the next record logged after the first marker, then (perhaps after
	 * others logged meanwhile) the second marker. */
	long long s = next_rec(end, buf, sizeof buf);
	FERRY_CHECK_EQ("end reader's next record", mark_seq + 1, s);
	int seen = s >= 0 && strstr(buf, "second marker") != NULL;
	FERRY_SYS(fcntl(end, F_SETFL, fl[2] | O_NONBLOCK));
	for (int i = 0; i < 1000 && !seen && s >= 0; i++) {
		s = next_rec(end, buf, sizeof buf);
		seen = s >= 0 && strstr(buf, "second marker") != NULL;
	}
	FERRY_CHECK(seen, "the second marker did not reach the end reader");
	ferry_finish();
}
