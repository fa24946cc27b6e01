/*
 * tty_pty_ctty: a pseudo-terminal as the controlling terminal.
 *
 * Sets up (the process is a session leader without a terminal): a pty
 * pair; the slave opened without O_NOCTTY and made the controlling tty
 * (TIOCSCTTY), our process group in the foreground; the slave in raw mode
 * with VMIN 3 / VTIME 7 and speed 38400; window size 33x111 (5x6 pixels);
 * "queued" written on the master and not yet read from the slave.
 * Verifies: the pts number (TIOCGPTN) and slave path, /proc/self/stat
 * tty_nr, tcgetsid and tcgetpgrp, termios and window size, the queued input,
 * /dev/tty reaches the same terminal, and master <-> slave still talk.
 */
#include "ferry_test.h"
#include <sys/ioctl.h>
#include <termios.h>

static int tty_nr(void)
{
	char buf[1024];
	if (ferry_read_file("/proc/self/stat", buf, sizeof buf) < 0)
		return -1;
	char *p = strrchr(buf, ')');
	int nr = -1;
	/* fields after comm: state ppid pgrp session tty_nr */
	sscanf(p + 2, "%*c %*d %*d %*d %d", &nr);
	return nr;
}

static ssize_t read_some(int fd, char *buf, size_t n)
{
	fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
	ssize_t got = 0;
	for (int i = 0; i < 200 && got < (ssize_t)n; i++) {
		ssize_t r = read(fd, buf + got, n - (size_t)got);
		if (r > 0)
			got += r;
		else
			ferry_sleep_ms(5);
	}
	fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
	return got;
}

int main(void)
{
	if (getsid(0) != getpid())
		ferry_die("not a session leader (run under setsid)");
	int m = FERRY_SYS(posix_openpt(O_RDWR | O_NOCTTY));
	FERRY_SYS(grantpt(m));
	FERRY_SYS(unlockpt(m));
	char sname[64];
	snprintf(sname, sizeof sname, "%s", ptsname(m));
	int s = FERRY_SYS(open(sname, O_RDWR));
	FERRY_SYS(ioctl(s, TIOCSCTTY, 0));
	FERRY_SYS(tcsetpgrp(s, getpgrp()));
	struct termios t;
	FERRY_SYS(tcgetattr(s, &t));
	cfmakeraw(&t);
	t.c_cc[VMIN] = 3;
	t.c_cc[VTIME] = 7;
	cfsetspeed(&t, B38400);
	FERRY_SYS(tcsetattr(s, TCSANOW, &t));
	struct winsize ws = { 33, 111, 5, 6 };
	FERRY_SYS(ioctl(s, TIOCSWINSZ, &ws));
	FERRY_SYS(write(m, "queued", 6));
	unsigned ptn = 0;
	ioctl(m, TIOCGPTN, &ptn);
	struct stat sst;
	fstat(s, &sst);
	struct termios tb;
	tcgetattr(s, &tb);

	ferry_ready();
	ferry_wait_go();

	unsigned ptn_now = 99999;
	FERRY_CHECK_EQ("TIOCGPTN", 0, ioctl(m, TIOCGPTN, &ptn_now));
	FERRY_CHECK_EQ("pts number", ptn, ptn_now);
	char name[64] = "";
	FERRY_CHECK(ttyname_r(s, name, sizeof name) == 0, "ttyname of the slave failed");
	FERRY_CHECK_EQ_STR("slave path", sname, name);
	FERRY_CHECK_EQ_HEX("tty_nr (controlling terminal)", sst.st_rdev, tty_nr());
	FERRY_CHECK_EQ("tcgetsid", getsid(0), tcgetsid(s));
	FERRY_CHECK_EQ("tcgetpgrp", getpgrp(), tcgetpgrp(s));
	struct termios tn;
	tcgetattr(s, &tn);
	FERRY_CHECK_EQ_HEX("c_iflag", tb.c_iflag, tn.c_iflag);
	FERRY_CHECK_EQ_HEX("c_oflag", tb.c_oflag, tn.c_oflag);
	FERRY_CHECK_EQ_HEX("c_cflag", tb.c_cflag, tn.c_cflag);
	FERRY_CHECK_EQ_HEX("c_lflag", tb.c_lflag, tn.c_lflag);
	FERRY_CHECK_MEM("c_cc", tb.c_cc, tn.c_cc, NCCS);
	FERRY_CHECK_EQ("output speed", B38400, cfgetospeed(&tn));
	struct winsize wn = { 0 };
	ioctl(s, TIOCGWINSZ, &wn);
	FERRY_CHECK(wn.ws_row == 33 && wn.ws_col == 111 && wn.ws_xpixel == 5 && wn.ws_ypixel == 6,
		    "window size %dx%d (%dx%d px)", wn.ws_row, wn.ws_col, wn.ws_xpixel, wn.ws_ypixel);
	char buf[32] = "";
	FERRY_CHECK_EQ("queued input on the slave", 6, read_some(s, buf, 6));
	FERRY_CHECK_MEM("queued input", "queued", buf, 6);
	int ctty = open("/dev/tty", O_RDWR);
	FERRY_CHECK(ctty >= 0, "open /dev/tty: %s (no controlling terminal)", strerror(errno));
	if (ctty >= 0) {
		FERRY_CHECK_EQ("write /dev/tty", 3, write(ctty, "ctl", 3));
		memset(buf, 0, sizeof buf);
		FERRY_CHECK_EQ("master reads what /dev/tty wrote", 3, read_some(m, buf, 3));
		FERRY_CHECK_MEM("data via /dev/tty", "ctl", buf, 3);
	}
	FERRY_CHECK_EQ("master -> slave", 4, write(m, "abcd", 4));
	memset(buf, 0, sizeof buf);
	FERRY_CHECK_EQ("slave reads", 4, read_some(s, buf, 4));
	FERRY_CHECK_MEM("master -> slave data", "abcd", buf, 4);
	FERRY_CHECK_EQ("slave -> master", 3, write(s, "xyz", 3));
	memset(buf, 0, sizeof buf);
	FERRY_CHECK_EQ("master reads", 3, read_some(m, buf, 3));
	FERRY_CHECK_MEM("slave -> master data", "xyz", buf, 3);
	ferry_finish();
}
