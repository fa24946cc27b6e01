/*
 * fd_console_vt: the machine's console, virtual terminals and console memory.
 *
 * Sets up fds on /dev/console (O_WRONLY), /dev/tty1 (O_RDWR|O_NOCTTY),
 * /dev/tty0 (O_WRONLY|O_NOCTTY|O_NONBLOCK: the foreground virtual terminal),
 * /dev/vcs1 (O_RDONLY, at offset 37) and /dev/vcsa1 (O_RDONLY|O_NONBLOCK, at
 * offset 14), in a session without a controlling terminal.
 * Verifies: paths, device numbers (st_rdev), flags (F_GETFL), offsets, the
 * terminal each terminal device leads to (TIOCGDEV: the active console for
 * /dev/console), that a write to the console still works (one short line: it
 * goes to the machine's console, ttyS0 here, which is harmless), that a write
 * to /dev/tty1 gives what it gave before (0 bytes written: an empty write; a
 * VT without a driver attached might answer EIO, the same before and after),
 * that /dev/vcs1 still reads from its offset, and that nothing became the
 * process's controlling terminal (tty_nr 0).
 */
#include "ferry_test.h"
#include <sys/ioctl.h>
#include <sys/sysmacros.h>

static const char *devs[] = { "/dev/console", "/dev/tty1", "/dev/tty0", "/dev/vcs1", "/dev/vcsa1" };
static const int modes[] = { O_WRONLY, O_RDWR | O_NOCTTY, O_WRONLY | O_NOCTTY | O_NONBLOCK, O_RDONLY,
			     O_RDONLY | O_NONBLOCK };
static const off_t offsets[] = { -1, -1, -1, 37, 14 };
static const int is_tty[] = { 1, 1, 1, 0, 0 };
#define ND 5

static long tty_nr(void)
{
	char buf[1024];
	if (ferry_read_file("/proc/self/stat", buf, sizeof buf) <= 0)
		return -1;
	char *p = strrchr(buf, ')');
	long v[5] = { 0 };
	if (!p || sscanf(p + 2, "%*c %ld %ld %ld %ld", &v[0], &v[1], &v[2], &v[3]) != 4)
		return -1;
	return v[3];
}

int main(void)
{
	int fd[ND];
	long fl[ND];
	dev_t rdev[ND];
	unsigned int real[ND];
	for (int i = 0; i < ND; i++) {
		fd[i] = FERRY_SYS(open(devs[i], modes[i]));
		if (offsets[i] >= 0)
			FERRY_SYS(lseek(fd[i], offsets[i], SEEK_SET));
		fl[i] = FERRY_SYS(fcntl(fd[i], F_GETFL));
		struct stat st;
		FERRY_SYS(fstat(fd[i], &st));
		rdev[i] = st.st_rdev;
		if (is_tty[i])
			FERRY_SYS(ioctl(fd[i], TIOCGDEV, &real[i]));
	}
	/* What an empty write to the VT answers here (0, or -EIO without a VT driver). */
	errno = 0;
	long vt_write = write(fd[1], "", 0) < 0 ? -errno : 0;
	long ctty = tty_nr();
	FERRY_CHECK_EQ("tty_nr before", 0, ctty);

	ferry_ready();
	ferry_wait_go();

	for (int i = 0; i < ND; i++) {
		char link[PATH_MAX], what[64];
		snprintf(what, sizeof what, "%s path", devs[i]);
		FERRY_CHECK_EQ_STR(what, devs[i], ferry_fd_link(fd[i], link, sizeof link));
		snprintf(what, sizeof what, "%s flags", devs[i]);
		FERRY_CHECK_EQ_HEX(what, fl[i], fcntl(fd[i], F_GETFL));
		struct stat st;
		fstat(fd[i], &st);
		snprintf(what, sizeof what, "%s st_rdev", devs[i]);
		FERRY_CHECK_EQ_HEX(what, rdev[i], st.st_rdev);
		if (offsets[i] >= 0) {
			snprintf(what, sizeof what, "%s offset", devs[i]);
			FERRY_CHECK_EQ(what, (long)offsets[i], (long)lseek(fd[i], 0, SEEK_CUR));
		}
		if (is_tty[i]) {
			unsigned int now = 0;
			snprintf(what, sizeof what, "%s TIOCGDEV", devs[i]);
			FERRY_CHECK_EQ(what, 0, ioctl(fd[i], TIOCGDEV, &now));
			FERRY_CHECK_EQ_HEX(what, real[i], now);
		}
	}
	static const char line[] = "ferry test fd_console_vt: console still writable\n";
	FERRY_CHECK_EQ("write /dev/console", (ssize_t)strlen(line), write(fd[0], line, strlen(line)));
	errno = 0;
	long vt_now = write(fd[1], "", 0) < 0 ? -errno : 0;
	FERRY_CHECK_EQ("empty write /dev/tty1", vt_write, vt_now);
	char buf[16];
	FERRY_CHECK_EQ("read /dev/vcs1", (ssize_t)sizeof buf, read(fd[3], buf, sizeof buf));
	FERRY_CHECK_EQ("/dev/vcs1 offset after read", 37 + (long)sizeof buf, (long)lseek(fd[3], 0, SEEK_CUR));
	FERRY_CHECK_EQ("tty_nr after", 0, tty_nr());
	ferry_finish();
}
