/*
 * fd_tcp_last_ack: a TCP connection on loopback (both ends in this process)
 * closed by one side, then by the other: FIN_WAIT2 and LAST_ACK.
 *
 * Sets up C and S with small buffers; S writes until both S's send buffer
 * and C's receive buffer are full (C reads nothing: a zero window); then
 * shutdown(C, SHUT_WR): C's FIN reaches S (CLOSE_WAIT; C: FIN_WAIT2); then
 * shutdown(S, SHUT_WR): S is in LAST_ACK, its FIN held back behind the
 * bytes the window holds back.
 * Verifies: the states and ports; S reads EOF; C reads every byte in order,
 * then EOF; both ends then close (TCP_CLOSE).
 */
#include "ferry_test.h"
#include "ferry_tcp.h"

int main(void)
{
	int c, s;
	char buf[16];
	pair(&c, &s);
	size_t n = stuff(s, 13);
	FERRY_SYS(shutdown(c, SHUT_WR));
	ferry_sleep_ms(20);
	FERRY_SYS(shutdown(s, SHUT_WR));
	ferry_sleep_ms(50);
	if (tcp_state(c) != TCP_FIN_WAIT2 || tcp_state(s) != TCP_LAST_ACK)
		ferry_die("setup: states %d/%d, not FIN_WAIT2/LAST_ACK", tcp_state(c), tcp_state(s));
	int pc = ports(c), ps = ports(s);

	ferry_ready();
	ferry_wait_go();

	FERRY_CHECK_EQ("C ports", pc, ports(c));
	FERRY_CHECK_EQ("S ports", ps, ports(s));
	FERRY_CHECK_EQ("C state", TCP_FIN_WAIT2, tcp_state(c));
	FERRY_CHECK_EQ("S state", TCP_LAST_ACK, tcp_state(s));
	struct pollfd p = { .fd = s, .events = POLLIN };
	FERRY_CHECK_EQ("S readable", 1, poll(&p, 1, 3000));
	FERRY_CHECK_EQ("S reads EOF", 0, read(s, buf, sizeof buf));
	drain("S -> C", c, n, 13, 1);
	FERRY_WAIT_UNTIL(tcp_state(c) == TCP_CLOSE && tcp_state(s) == TCP_CLOSE, 3000);
	FERRY_CHECK_EQ("C state at the end", TCP_CLOSE, tcp_state(c));
	FERRY_CHECK_EQ("S state at the end", TCP_CLOSE, tcp_state(s));
	ferry_finish();
}
