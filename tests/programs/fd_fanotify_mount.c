/*
 * fd_fanotify_mount: fanotify mount and filesystem marks (FAN_MARK_MOUNT,
 * FAN_MARK_FILESYSTEM).
 *
 * Sets up two tmpfs mounts of its own, A at "a" and B at "b", each bound a
 * second time ("a2", "b2": another mount of the same filesystem), and a
 * fanotify notification group with a mount mark on A's mount and a
 * filesystem mark on B, both for FAN_CLOSE_WRITE.
 * Verifies: a file written through "a" and one written through "b2" are
 * reported (the mount and the filesystem are marked), in order, with their
 * paths; one written through "a2" (another mount of A's filesystem) is not.
 * Unmounts everything at the end.
 */
#include "ferry_test.h"
#include <poll.h>
#include <sys/fanotify.h>
#include <sys/mount.h>

static void write_file(const char *path)
{
	int fd = open(path, O_CREAT | O_WRONLY | O_TRUNC, 0644);
	if (fd < 0)
		ferry_die("open %s: %s", path, strerror(errno));
	if (write(fd, "x", 1) != 1)
		ferry_die("write %s", path);
	close(fd);
}

/* The path of the next event's file, "" if none comes within `ms`. */
static void next_event(int g, char *out, size_t size, int ms)
{
	static char buf[4096] __attribute__((aligned(8)));
	static int len, at;
	out[0] = 0;
	if (at >= len) {
		struct pollfd p = { .fd = g, .events = POLLIN };
		if (poll(&p, 1, ms) <= 0)
			return;
		len = (int)read(g, buf, sizeof buf);
		at = 0;
		if (len <= 0)
			return;
	}
	struct fanotify_event_metadata *m = (struct fanotify_event_metadata *)(buf + at);
	at += m->event_len;
	if (m->fd >= 0) {
		char link[64];
		snprintf(link, sizeof link, "/proc/self/fd/%d", m->fd);
		ssize_t n = readlink(link, out, size - 1);
		out[n > 0 ? n : 0] = 0;
		close(m->fd);
	}
}

static void ends_with(const char *what, const char *path, const char *suffix)
{
	size_t a = strlen(path), b = strlen(suffix);
	FERRY_CHECK(a >= b && !strcmp(path + a - b, suffix), "%s: expected a path ending in %s, got \"%s\"", what, suffix,
		    path);
}

int main(void)
{
	const char *dirs[] = { "a", "a2", "b", "b2" };
	/* (Its mounts go in its test directory, whoever started it where.) */
	if (getenv("FERRY_TEST_DIR"))
		FERRY_SYS(chdir(getenv("FERRY_TEST_DIR")));
	for (int i = 0; i < 4; i++)
		FERRY_SYS(mkdir(dirs[i], 0755));
	FERRY_SYS(mount("ferry-a", "a", "tmpfs", 0, "size=64k"));
	FERRY_SYS(mount("ferry-b", "b", "tmpfs", 0, "size=64k"));
	FERRY_SYS(mount("a", "a2", NULL, MS_BIND, NULL));
	FERRY_SYS(mount("b", "b2", NULL, MS_BIND, NULL));
	int g = FERRY_SYS(fanotify_init(FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_NONBLOCK, O_RDONLY));
	FERRY_SYS(fanotify_mark(g, FAN_MARK_ADD | FAN_MARK_MOUNT, FAN_CLOSE_WRITE, AT_FDCWD, "a"));
	FERRY_SYS(fanotify_mark(g, FAN_MARK_ADD | FAN_MARK_FILESYSTEM, FAN_CLOSE_WRITE, AT_FDCWD, "b"));
	int before[64];
	int nbefore = ferry_list_fds(before, 64);

	ferry_ready();
	ferry_wait_go();
	ferry_check_fds_same(before, nbefore);

	char path[512];
	write_file("a/one");
	write_file("a2/not-seen");
	write_file("b2/two");
	next_event(g, path, sizeof path, 2000);
	ends_with("the mount mark's event", path, "/a/one");
	next_event(g, path, sizeof path, 2000);
	ends_with("the filesystem mark's event (through another mount)", path, "/b2/two");
	next_event(g, path, sizeof path, 200);
	FERRY_CHECK_EQ("no event for another mount of the marked mount's filesystem", 0, (int)strlen(path));
	close(g);
	for (int i = 3; i >= 0; i--)
		umount2(dirs[i], MNT_DETACH);
	ferry_finish();
}
