/*
 * tty_dev_tty_more_ptys: /dev/tty held open, and ptys in more
 * configurations.
 *
 * Sets up (the process is a session leader without a terminal): pty A made
 * the controlling terminal; /dev/tty opened (fd T, kept) and "via-T" written
 * through it, unread on A's master; pty B, not a controlling terminal, whose
 * master is in packet mode (TIOCPKT) and whose slave is owned by uid 1234,
 * gid 5 and mode 0620 (as a login's); pty C, whose slave is locked again
 * (TIOCSPTLCK) after B's was opened.
 * Verifies: T is still /dev/tty (its link), reaches A (what it writes comes
 * out of A's master; "via-T" first) and reads what A's master writes; B's
 * master still answers in packet mode (a data packet starts with
 * TIOCPKT_DATA); B's slave's owner, group and mode; C's lock (TIOCGPTLCK)
 * and that its slave cannot be opened; the pts numbers.
 */
#include "ferry_test.h"
#include <sys/ioctl.h>
#include <termios.h>

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
	return got;
}

static int new_pty(char *sname, size_t len)
{
	int m = FERRY_SYS(posix_openpt(O_RDWR | O_NOCTTY));
	FERRY_SYS(grantpt(m));
	FERRY_SYS(unlockpt(m));
	snprintf(sname, len, "%s", ptsname(m));
	return m;
}

static void raw(int fd)
{
	struct termios t;
	FERRY_SYS(tcgetattr(fd, &t));
	cfmakeraw(&t);
	FERRY_SYS(tcsetattr(fd, TCSANOW, &t));
}

int main(void)
{
	if (getsid(0) != getpid())
		ferry_die("not a session leader (run under setsid)");
	char an[64], bn[64], cn[64];
	int am = new_pty(an, sizeof an);
	int as = FERRY_SYS(open(an, O_RDWR));
	FERRY_SYS(ioctl(as, TIOCSCTTY, 0));
	raw(as);
	int t = FERRY_SYS(open("/dev/tty", O_RDWR));
	FERRY_CHECK_EQ("write via /dev/tty", 5, write(t, "via-T", 5));

	int bm = new_pty(bn, sizeof bn);
	int bs = FERRY_SYS(open(bn, O_RDWR | O_NOCTTY));
	raw(bs);
	int one = 1;
	FERRY_SYS(ioctl(bm, TIOCPKT, &one));
	FERRY_SYS(fchown(bs, 1234, 5));
	FERRY_SYS(fchmod(bs, 0620));

	int cm = new_pty(cn, sizeof cn);
	FERRY_SYS(ioctl(cm, TIOCSPTLCK, &one));

	unsigned pa = 0, pb = 0, pc = 0;
	ioctl(am, TIOCGPTN, &pa);
	ioctl(bm, TIOCGPTN, &pb);
	ioctl(cm, TIOCGPTN, &pc);
	ferry_ready();
	ferry_wait_go();

	unsigned n = 0;
	ioctl(am, TIOCGPTN, &n);
	FERRY_CHECK_EQ("A's pts number", pa, n);
	ioctl(bm, TIOCGPTN, &n);
	FERRY_CHECK_EQ("B's pts number", pb, n);
	ioctl(cm, TIOCGPTN, &n);
	FERRY_CHECK_EQ("C's pts number", pc, n);

	char l[64] = "";
	ferry_fd_link(t, l, sizeof l);
	FERRY_CHECK_EQ_STR("T's link", "/dev/tty", l);
	char buf[32] = "";
	FERRY_CHECK_EQ("A's master reads what T wrote before", 5, read_some(am, buf, 5));
	FERRY_CHECK_MEM("before", "via-T", buf, 5);
	FERRY_CHECK_EQ("write via T", 3, write(t, "abc", 3));
	memset(buf, 0, sizeof buf);
	FERRY_CHECK_EQ("A's master reads what T writes", 3, read_some(am, buf, 3));
	FERRY_CHECK_MEM("after", "abc", buf, 3);
	FERRY_CHECK_EQ("A's master writes", 2, write(am, "xy", 2));
	memset(buf, 0, sizeof buf);
	FERRY_CHECK_EQ("T reads", 2, read_some(t, buf, 2));
	FERRY_CHECK_MEM("T reads", "xy", buf, 2);

	FERRY_CHECK_EQ("B's slave writes", 3, write(bs, "pkt", 3));
	memset(buf, 0, sizeof buf);
	ssize_t k = read_some(bm, buf, 4);
	FERRY_CHECK(k == 4 && buf[0] == TIOCPKT_DATA && memcmp(buf + 1, "pkt", 3) == 0,
		    "B's master read %zd bytes, first %d, not a data packet \"pkt\"", k, buf[0]);
	struct stat st;
	FERRY_SYS(fstat(bs, &st));
	FERRY_CHECK_EQ("B's slave owner", 1234, (int)st.st_uid);
	FERRY_CHECK_EQ("B's slave group", 5, (int)st.st_gid);
	FERRY_CHECK_EQ_HEX("B's slave mode", 0620, st.st_mode & 07777);

	int lock = 0;
	FERRY_SYS(ioctl(cm, TIOCGPTLCK, &lock));
	FERRY_CHECK_EQ("C locked", 1, lock);
	int cs = open(cn, O_RDWR | O_NOCTTY);
	FERRY_CHECK(cs < 0 && errno == EIO, "C's slave opened (%d, %s) though locked", cs, strerror(errno));
	if (cs >= 0)
		close(cs);
	ferry_finish();
}
