/*
 * fd_unix_scm_tty: terminals in flight (SCM_RIGHTS): a pty slave whose
 * master the process holds, and a pty master whose slave it holds, as a
 * terminal server hands a session's terminal to a worker.
 *
 * Sets up pty A (master MA held, slave SA sent, then closed here) and pty B
 * (master MB sent, then closed here; slave SB held), both in raw mode; a UNIX
 * datagram pair (d0 -> d1) whose queue holds "A" with SA and "B" with MB.
 * Verifies: "A" comes with a descriptor that is /dev/pts/<A's number>, raw
 * as it was, and bytes written on MA are read from it and back; "B" comes
 * with a pty master whose number (TIOCGPTN) is B's, and bytes written on SB
 * are read from it and back.  The fd table is unchanged.
 */
#include "ferry_test.h"
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <termios.h>

static int open_pty(int *slave, int *index)
{
	int m = FERRY_SYS(posix_openpt(O_RDWR | O_NOCTTY));
	FERRY_SYS(grantpt(m));
	FERRY_SYS(unlockpt(m));
	FERRY_SYS(ioctl(m, TIOCGPTN, index));
	char path[64];
	snprintf(path, sizeof path, "/dev/pts/%d", *index);
	*slave = FERRY_SYS(open(path, O_RDWR | O_NOCTTY));
	struct termios t;
	FERRY_SYS(tcgetattr(*slave, &t));
	cfmakeraw(&t);
	FERRY_SYS(tcsetattr(*slave, TCSANOW, &t));
	return m;
}

static void send_with(int s, const char *data, int fd)
{
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int))];
	} u;
	memset(&u, 0, sizeof u);
	struct iovec iov = { .iov_base = (void *)data, .iov_len = strlen(data) };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
			     .msg_controllen = sizeof u.buf };
	struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
	c->cmsg_level = SOL_SOCKET;
	c->cmsg_type = SCM_RIGHTS;
	c->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(c), &fd, sizeof fd);
	FERRY_SYS(sendmsg(s, &mh, 0));
}

static int recv_with(int s, const char *want)
{
	char data[8] = "";
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int) * 4)];
	} u;
	memset(&u, 0, sizeof u);
	struct iovec iov = { .iov_base = data, .iov_len = sizeof data };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
			     .msg_controllen = sizeof u.buf };
	ssize_t n = recvmsg(s, &mh, MSG_DONTWAIT);
	FERRY_CHECK(n == 1 && data[0] == want[0], "read %zd bytes \"%.8s\", expected \"%s\"", n, data, want);
	struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
	FERRY_CHECK(c && c->cmsg_type == SCM_RIGHTS && c->cmsg_len == CMSG_LEN(sizeof(int)),
		    "\"%s\" came without exactly one descriptor", want);
	if (!c || c->cmsg_len != CMSG_LEN(sizeof(int)))
		return -1;
	int fd;
	memcpy(&fd, CMSG_DATA(c), sizeof fd);
	return fd;
}

/* Writes `what` on `from` and reads it back from `to` (raw mode: as written). */
static void carries(const char *name, int from, int to, const char *what)
{
	size_t len = strlen(what);
	FERRY_CHECK_EQ(name, (long)len, (long)write(from, what, len));
	char buf[32] = "";
	size_t got = 0;
	for (int i = 0; i < 200 && got < len; i++) {
		ssize_t n = read(to, buf + got, sizeof buf - 1 - got);
		if (n > 0)
			got += n;
		else
			ferry_sleep_ms(5);
	}
	FERRY_CHECK(got == len && memcmp(buf, what, len) == 0, "%s: read \"%s\", expected \"%s\"", name,
		    buf, what);
}

int main(void)
{
	int sa, sb, ia, ib;
	int ma = open_pty(&sa, &ia);
	int mb = open_pty(&sb, &ib);
	int d[2];
	FERRY_SYS(socketpair(AF_UNIX, SOCK_DGRAM, 0, d));
	send_with(d[0], "A", sa);
	send_with(d[0], "B", mb);
	close(sa);
	close(mb);
	FERRY_SYS(fcntl(ma, F_SETFL, O_NONBLOCK));
	FERRY_SYS(fcntl(sb, F_SETFL, O_NONBLOCK));

	int fds[64];
	int nfds = ferry_list_fds(fds, 64);
	ferry_ready();
	ferry_wait_go();
	ferry_check_fds_same(fds, nfds);

	int sa2 = recv_with(d[1], "A");
	int mb2 = recv_with(d[1], "B");
	if (sa2 < 0 || mb2 < 0)
		ferry_finish();
	char link[64], want[64];
	ferry_fd_link(sa2, link, sizeof link);
	snprintf(want, sizeof want, "/dev/pts/%d", ia);
	FERRY_CHECK(strcmp(link, want) == 0, "A's slave is %s, expected %s", link, want);
	struct termios t;
	FERRY_CHECK_EQ("tcgetattr A", 0, tcgetattr(sa2, &t));
	FERRY_CHECK(!(t.c_lflag & (ICANON | ECHO)), "A's slave is not raw any more: lflag %#x",
		    (unsigned)t.c_lflag);
	int n = -1;
	FERRY_CHECK_EQ("TIOCGPTN B", 0, ioctl(mb2, TIOCGPTN, &n));
	FERRY_CHECK_EQ("B's number", ib, n);
	FERRY_SYS(fcntl(sa2, F_SETFL, O_NONBLOCK));
	FERRY_SYS(fcntl(mb2, F_SETFL, O_NONBLOCK));
	carries("MA -> SA", ma, sa2, "to A's slave");
	carries("SA -> MA", sa2, ma, "from A's slave");
	carries("SB -> MB", sb, mb2, "to B's master");
	carries("MB -> SB", mb2, sb, "from B's master");
	ferry_finish();
}
