/*
 * fd_tcp_closing: a TCP connection on loopback (both ends in this process)
 * closed from both sides at once: CLOSING and FIN_WAIT2.
 *
 * Sets up C -> S with small buffers; C writes until both C's send buffer
 * and S's receive buffer are full (S reads nothing: a zero window), then
 * shutdown(C, SHUT_WR) (C: FIN_WAIT1, its FIN held back), then
 * shutdown(S, SHUT_WR): S's FIN reaches C, which is now CLOSING (its own FIN
 * not acknowledged), and S, its FIN acknowledged, FIN_WAIT2.
 * Verifies: the states and ports; C reads EOF; S reads every byte in order,
 * then EOF; both ends then close (TCP_CLOSE: TIME_WAIT behind them).
 */
#include "ferry_test.h"
#include "ferry_tcp.h"

int main(void)
{
	int c, s;
	char buf[16];
	pair(&c, &s);
	size_t n = stuff(c, 11);
	FERRY_SYS(shutdown(c, SHUT_WR));
	ferry_sleep_ms(20);
	FERRY_SYS(shutdown(s, SHUT_WR));
	ferry_sleep_ms(50);
	if (tcp_state(c) != TCP_CLOSING || tcp_state(s) != TCP_FIN_WAIT2)
		ferry_die("setup: states %d/%d, not CLOSING/FIN_WAIT2", tcp_state(c), tcp_state(s));
	int pc = ports(c), ps = ports(s);

	ferry_ready();
	ferry_wait_go();

	FERRY_CHECK_EQ("C ports", pc, ports(c));
	FERRY_CHECK_EQ("S ports", ps, ports(s));
	FERRY_CHECK_EQ("C state", TCP_CLOSING, tcp_state(c));
	FERRY_CHECK_EQ("S state", TCP_FIN_WAIT2, tcp_state(s));
	struct pollfd p = { .fd = c, .events = POLLIN };
	FERRY_CHECK_EQ("C readable", 1, poll(&p, 1, 3000));
	FERRY_CHECK_EQ("C reads EOF", 0, read(c, buf, sizeof buf));
	errno = 0;
	FERRY_CHECK_EQ("S cannot send", -1, send(s, "x", 1, MSG_NOSIGNAL));
	FERRY_CHECK_EQ("S send errno", EPIPE, errno);
	drain("C -> S", s, n, 11, 1);
	FERRY_WAIT_UNTIL(tcp_state(c) == TCP_CLOSE && tcp_state(s) == TCP_CLOSE, 3000);
	FERRY_CHECK_EQ("C state at the end", TCP_CLOSE, tcp_state(c));
	FERRY_CHECK_EQ("S state at the end", TCP_CLOSE, tcp_state(s));
	ferry_finish();
}
