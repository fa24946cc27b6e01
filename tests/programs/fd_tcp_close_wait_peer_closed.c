/*
 * fd_tcp_close_wait_peer_closed: a TCP connection on loopback whose one end
 * this process closed: the other end, still held, is in CLOSE_WAIT; the
 * closed one lingers in FIN_WAIT2, held by no descriptor (an orphan).
 *
 * Sets up C -> S; C writes "bye" and is closed; S reads nothing.
 * Verifies: S's ports and state; the orphan is in /proc/net/tcp (FIN_WAIT2,
 * no inode); S reads "bye", then EOF; what S sends then draws a reset from
 * the orphan (EPIPE or ECONNRESET on a later send), as it did before.
 */
#include "ferry_test.h"
#include "ferry_tcp.h"

/* Whether /proc/net/tcp lists a socket from port `from` to port `to` in state `st`
 * held by no descriptor (inode 0). */
static int orphan_listed(int from, int to, int st)
{
	FILE *f = fopen("/proc/net/tcp", "r");
	char line[512];
	int found = 0;
	if (!f)
		return 0;
	while (fgets(line, sizeof line, f)) {
		unsigned la, lp, ra, rp, state;
		unsigned long ino;
		if (sscanf(line, " %*d: %x:%x %x:%x %x %*x:%*x %*x:%*x %*x %*u %*u %lu",
			   &la, &lp, &ra, &rp, &state, &ino) == 6 &&
		    (int)lp == from && (int)rp == to && (int)state == st && ino == 0)
			found = 1;
	}
	fclose(f);
	return found;
}

int main(void)
{
	int c, s;
	char buf[16];
	pair(&c, &s);
	FERRY_SYS(write(c, "bye", 3));
	close(c);
	FERRY_WAIT_UNTIL(tcp_state(s) == TCP_CLOSE_WAIT, 2000);
	int ps = ports(s);
	int sport = (ps >> 16) & 0xffff, cport = ps & 0xffff;
	FERRY_WAIT_UNTIL(orphan_listed(cport, sport, TCP_FIN_WAIT2), 2000);
	if (tcp_state(s) != TCP_CLOSE_WAIT || !orphan_listed(cport, sport, TCP_FIN_WAIT2))
		ferry_die("setup: S is %d, and the closed end is%s listed", tcp_state(s),
			  orphan_listed(cport, sport, TCP_FIN_WAIT2) ? "" : " not");

	ferry_ready();
	ferry_wait_go();

	FERRY_CHECK_EQ("S ports", ps, ports(s));
	FERRY_CHECK_EQ("S state", TCP_CLOSE_WAIT, tcp_state(s));
	FERRY_CHECK_EQ("the closed end lingers", 1, orphan_listed(cport, sport, TCP_FIN_WAIT2));
	struct pollfd p = { .fd = s, .events = POLLIN };
	FERRY_CHECK_EQ("S readable", 1, poll(&p, 1, 3000));
	FERRY_CHECK_EQ("S reads", 3, read(s, buf, sizeof buf));
	FERRY_CHECK_MEM("S data", "bye", buf, 3);
	FERRY_CHECK_EQ("S reads EOF", 0, read(s, buf, sizeof buf));
	/* The orphan answers data with a reset. */
	ssize_t r = 0;
	for (int i = 0; i < 100 && r >= 0; i++) {
		r = send(s, "x", 1, MSG_NOSIGNAL);
		ferry_sleep_ms(10);
	}
	FERRY_CHECK(r < 0 && (errno == EPIPE || errno == ECONNRESET), "S's sends never failed (last: %zd, %s)",
		    r, strerror(errno));
	ferry_finish();
}
