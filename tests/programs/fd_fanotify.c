/*
 * fd_fanotify: a fanotify instance with an inode mark.
 *
 * Sets up a fanotify group (FAN_CLASS_NOTIF, FAN_NONBLOCK | FAN_CLOEXEC,
 * events opened O_RDONLY) marking file "f" for FAN_MODIFY | FAN_CLOSE_WRITE,
 * and directory "d" for FAN_MODIFY of its children (FAN_EVENT_ON_CHILD),
 * with its file "g" ignoring FAN_MODIFY (an ignored mask that survives
 * modification).
 * Verifies: the fdinfo mark and flags lines, the fd's flags and FD_CLOEXEC
 * are unchanged; nothing is queued; writing
 * to "f" and closing it queues FAN_MODIFY and FAN_CLOSE_WRITE events whose
 * descriptor names "f" and whose pid is ours; writing to "d/g" queues
 * nothing, writing to "d/h" queues FAN_MODIFY.
 */
#include "ferry_test.h"
#include <sys/fanotify.h>

/* Every "fanotify ino:" line of fd's fdinfo, in order, into out; returns how many. */
static int mark_lines(int fd, char *out, size_t size)
{
	char b[4096], p[64];
	int n = 0;
	out[0] = 0;
	snprintf(p, sizeof p, "/proc/self/fdinfo/%d", fd);
	if (ferry_read_file(p, b, sizeof b) <= 0)
		return -1;
	for (char *q = b; (q = strstr(q, "fanotify ino:")); q++) {
		size_t len = strcspn(q, "\n"), used = strlen(out);
		if (used + len + 2 < size) {
			memcpy(out + used, q, len);
			out[used + len] = '|';
			out[used + len + 1] = 0;
		}
		n++;
	}
	return n;
}

int main(void)
{
	int c = FERRY_SYS(open("f", O_CREAT | O_WRONLY, 0644));
	close(c);
	FERRY_SYS(mkdir("d", 0755));
	c = FERRY_SYS(open("d/g", O_CREAT | O_WRONLY, 0644));
	close(c);
	c = FERRY_SYS(open("d/h", O_CREAT | O_WRONLY, 0644));
	close(c);
	int fan = FERRY_SYS(fanotify_init(FAN_CLASS_NOTIF | FAN_NONBLOCK | FAN_CLOEXEC, O_RDONLY));
	FERRY_SYS(fanotify_mark(fan, FAN_MARK_ADD, FAN_MODIFY | FAN_CLOSE_WRITE, AT_FDCWD, "f"));
	FERRY_SYS(fanotify_mark(fan, FAN_MARK_ADD, FAN_MODIFY | FAN_EVENT_ON_CHILD, AT_FDCWD, "d"));
	FERRY_SYS(fanotify_mark(fan, FAN_MARK_ADD | FAN_MARK_IGNORED_MASK | FAN_MARK_IGNORED_SURV_MODIFY,
				FAN_MODIFY, AT_FDCWD, "d/g"));
	static char marks[2048], marks_now[2048];
	FERRY_CHECK_EQ("marks set up", 3, mark_lines(fan, marks, sizeof marks));
	char mark[256] = "", head[128] = "";
	ferry_fdinfo_field(fan, "fanotify ino", mark, sizeof mark);
	ferry_fdinfo_field(fan, "fanotify flags", head, sizeof head);
	long fl = ferry_fdinfo_flags(fan);
	char want[4096];
	FERRY_PTR(realpath("f", want));

	ferry_ready();
	ferry_wait_go();

	char now[256] = "";
	ferry_fdinfo_field(fan, "fanotify ino", now, sizeof now);
	FERRY_CHECK_EQ_STR("fanotify mark", mark, now);
	ferry_fdinfo_field(fan, "fanotify flags", now, sizeof now);
	FERRY_CHECK_EQ_STR("fanotify flags", head, now);
	FERRY_CHECK_EQ_HEX("fd flags", fl, ferry_fdinfo_flags(fan));
	FERRY_CHECK_EQ("FD_CLOEXEC", FD_CLOEXEC, fcntl(fan, F_GETFD) & FD_CLOEXEC);
	char buf[4096];
	FERRY_CHECK(read(fan, buf, sizeof buf) < 0 && errno == EAGAIN, "an event was queued already");
	FERRY_CHECK_EQ("marks", 3, mark_lines(fan, marks_now, sizeof marks_now));
	FERRY_CHECK_EQ_STR("mark lines, in order", marks, marks_now);
	c = FERRY_SYS(open("d/g", O_WRONLY));
	FERRY_SYS(write(c, "y", 1));
	FERRY_SYS(fsync(c));
	ssize_t ng = read(fan, buf, sizeof buf);
	FERRY_CHECK(ng < 0 && errno == EAGAIN, "writing g (ignored) queued %zd bytes of events", ng);
	close(c);
	/* Its close for writing is not watched. */
	c = FERRY_SYS(open("d/h", O_WRONLY));
	FERRY_SYS(write(c, "z", 1));
	close(c);
	ssize_t nh = read(fan, buf, sizeof buf);
	FERRY_CHECK(nh >= (ssize_t)sizeof(struct fanotify_event_metadata), "no event after writing d/h");
	if (nh > 0) {
		struct fanotify_event_metadata *m = (void *)buf;
		FERRY_CHECK(m->mask & FAN_MODIFY, "d/h: mask %llx", (unsigned long long)m->mask);
		char got[4096], wh[4096];
		FERRY_PTR(realpath("d/h", wh));
		if (m->fd >= 0) {
			FERRY_CHECK_EQ_STR("d/h event file", wh, ferry_fd_link(m->fd, got, sizeof got));
			close(m->fd);
		}
	}
	c = FERRY_SYS(open("f", O_WRONLY));
	FERRY_SYS(write(c, "x", 1));
	close(c);
	uint64_t seen = 0;
	ssize_t n = read(fan, buf, sizeof buf);
	FERRY_CHECK(n > 0, "no event after writing f: %s", strerror(errno));
	for (char *p = buf; n > 0 && p < buf + n;) {
		struct fanotify_event_metadata *m = (void *)p;
		if (m->event_len < sizeof *m)
			break;
		seen |= m->mask;
		FERRY_CHECK_EQ("event pid", getpid(), m->pid);
		if (m->fd >= 0) {
			char got[4096];
			FERRY_CHECK_EQ_STR("event file", want, ferry_fd_link(m->fd, got, sizeof got));
			close(m->fd);
		}
		p += m->event_len;
	}
	FERRY_CHECK(seen & FAN_MODIFY, "no FAN_MODIFY (mask %llx)", (unsigned long long)seen);
	FERRY_CHECK(seen & FAN_CLOSE_WRITE, "no FAN_CLOSE_WRITE (mask %llx)", (unsigned long long)seen);
	ferry_finish();
}
