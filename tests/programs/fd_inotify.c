/*
 * fd_inotify: an inotify instance with watches.
 *
 * Sets up inotify I (IN_NONBLOCK) watching directory "w" (not the test dir
 * itself: the protocol files are created there) for IN_CREATE|IN_DELETE
 * (wd 1) and file "w/watched" for IN_MODIFY (wd 2).
 * Verifies: the "inotify wd:... mask:..." lines of I's fdinfo are unchanged
 * (watch descriptors and masks), nothing is queued, creating a file in the
 * dir yields IN_CREATE with wd 1 and its name, and writing "watched"
 * yields IN_MODIFY with wd 2.
 */
#include "ferry_test.h"
#include <sys/inotify.h>

static void watches(int fd, char *out, size_t size)
{
	char buf[4096], path[64];
	snprintf(path, sizeof path, "/proc/self/fdinfo/%d", fd);
	out[0] = 0;
	if (ferry_read_file(path, buf, sizeof buf) < 0)
		return;
	for (char *line = buf; line && *line;) {
		char *nl = strchr(line, '\n');
		if (nl)
			*nl = 0;
		int wd;
		unsigned long ino;
		unsigned mask;
		char *m = strstr(line, "mask:");
		if (sscanf(line, "inotify wd:%d ino:%lx", &wd, &ino) == 2 && m && sscanf(m, "mask:%x", &mask) == 1)
			snprintf(out + strlen(out), size - strlen(out), "wd %d ino %lx mask %x; ", wd, ino, mask);
		line = nl ? nl + 1 : NULL;
	}
}

int main(void)
{
	char dir[PATH_MAX], file[PATH_MAX];
	ferry_path(dir, sizeof dir, "w");
	ferry_path(file, sizeof file, "w/watched");
	FERRY_SYS(mkdir(dir, 0755));
	close(FERRY_SYS(open(file, O_WRONLY | O_CREAT, 0644)));
	int in = FERRY_SYS(inotify_init1(IN_NONBLOCK));
	int wd1 = FERRY_SYS(inotify_add_watch(in, dir, IN_CREATE | IN_DELETE));
	int wd2 = FERRY_SYS(inotify_add_watch(in, file, IN_MODIFY));
	char before[1024];
	watches(in, before, sizeof before);

	ferry_ready();
	ferry_wait_go();

	char now[1024];
	watches(in, now, sizeof now);
	FERRY_CHECK_EQ_STR("inotify watches", before, now);
	char buf[4096] __attribute__((aligned(8)));
	ssize_t n = read(in, buf, sizeof buf);
	FERRY_CHECK(n < 0 && errno == EAGAIN, "events queued before any change (read %zd)", n);
	char p[PATH_MAX];
	close(open(ferry_path(p, sizeof p, "w/new-file"), O_WRONLY | O_CREAT, 0644));
	n = read(in, buf, sizeof buf);
	struct inotify_event *e = (void *)buf;
	FERRY_CHECK(n >= (ssize_t)sizeof *e, "no IN_CREATE event (read %zd)", n);
	if (n >= (ssize_t)sizeof *e) {
		FERRY_CHECK_EQ("IN_CREATE wd", wd1, e->wd);
		FERRY_CHECK(e->mask & IN_CREATE, "event mask %#x, expected IN_CREATE", e->mask);
		FERRY_CHECK_EQ_STR("IN_CREATE name", "new-file", e->len ? e->name : "");
	}
	int fd = open(file, O_WRONLY);
	FERRY_CHECK_EQ("write watched", 1, write(fd, "x", 1));
	close(fd);
	n = read(in, buf, sizeof buf);
	FERRY_CHECK(n >= (ssize_t)sizeof *e, "no IN_MODIFY event (read %zd)", n);
	if (n >= (ssize_t)sizeof *e) {
		FERRY_CHECK_EQ("IN_MODIFY wd", wd2, e->wd);
		FERRY_CHECK(e->mask & IN_MODIFY, "event mask %#x, expected IN_MODIFY", e->mask);
	}
	ferry_finish();
}
