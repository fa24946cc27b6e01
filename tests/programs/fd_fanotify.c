/*
 * fd_fanotify: a fanotify instance with an inode mark.
 *
 * Sets up a fanotify group (FAN_CLASS_NOTIF, FAN_NONBLOCK | FAN_CLOEXEC,
 * events opened O_RDONLY) marking file "f" for FAN_MODIFY | FAN_CLOSE_WRITE.
 * Verifies: the fdinfo mark line is unchanged; nothing is queued; writing
 * to "f" and closing it queues FAN_MODIFY and FAN_CLOSE_WRITE events whose
 * descriptor names "f" and whose pid is ours.
 */
#include "ferry_test.h"
#include <sys/fanotify.h>

int main(void)
{
	int c = FERRY_SYS(open("f", O_CREAT | O_WRONLY, 0644));
	close(c);
	int fan = FERRY_SYS(fanotify_init(FAN_CLASS_NOTIF | FAN_NONBLOCK | FAN_CLOEXEC, O_RDONLY));
	FERRY_SYS(fanotify_mark(fan, FAN_MARK_ADD, FAN_MODIFY | FAN_CLOSE_WRITE, AT_FDCWD, "f"));
	char mark[256] = "";
	ferry_fdinfo_field(fan, "fanotify ino", mark, sizeof mark);
	char want[4096];
	FERRY_PTR(realpath("f", want));

	ferry_ready();
	ferry_wait_go();

	char now[256] = "";
	ferry_fdinfo_field(fan, "fanotify ino", now, sizeof now);
	FERRY_CHECK_EQ_STR("fanotify mark", mark, now);
	char buf[4096];
	FERRY_CHECK(read(fan, buf, sizeof buf) < 0 && errno == EAGAIN, "an event was queued already");
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
