/*
 * fd_tcp_fin_wait1: a TCP connection on loopback (both ends in this
 * process) whose one end shut down writing while its FIN could not go out.
 *
 * Sets up C -> S with small buffers; C writes until both C's send buffer
 * and S's receive buffer are full (S reads nothing: a zero window), then
 * shutdown(C, SHUT_WR): C is in FIN_WAIT1, its FIN queued behind the bytes
 * the window holds back; S is ESTABLISHED and has not seen the FIN.
 * Verifies: the states and ports; S reads every byte in order, then EOF;
 * C reaches FIN_WAIT2 once its FIN is acknowledged; S -> C still works and
 * C cannot send.
 */
#include "ferry_test.h"
#include "ferry_tcp.h"

int main(void)
{
	int c, s;
	char buf[16];
	pair(&c, &s);
	size_t n = stuff(c, 7);
	FERRY_SYS(shutdown(c, SHUT_WR));
	ferry_sleep_ms(50);
	if (tcp_state(c) != TCP_FIN_WAIT1 || tcp_state(s) != TCP_ESTABLISHED)
		ferry_die("setup: states %d/%d, not FIN_WAIT1/ESTABLISHED", tcp_state(c), tcp_state(s));
	int pc = ports(c), ps = ports(s);

	ferry_ready();
	ferry_wait_go();

	FERRY_CHECK_EQ("C ports", pc, ports(c));
	FERRY_CHECK_EQ("S ports", ps, ports(s));
	FERRY_CHECK_EQ("C state", TCP_FIN_WAIT1, tcp_state(c));
	FERRY_CHECK_EQ("S state", TCP_ESTABLISHED, tcp_state(s));
	drain("C -> S", s, n, 7, 1);
	FERRY_WAIT_UNTIL(tcp_state(c) == TCP_FIN_WAIT2, 3000);
	FERRY_CHECK_EQ("C state once S read all", TCP_FIN_WAIT2, tcp_state(c));
	FERRY_CHECK_EQ("S state once S read all", TCP_CLOSE_WAIT, tcp_state(s));
	FERRY_CHECK_EQ("S -> C", 4, write(s, "back", 4));
	struct pollfd p = { .fd = c, .events = POLLIN };
	FERRY_CHECK_EQ("C readable", 1, poll(&p, 1, 3000));
	FERRY_CHECK_EQ("C reads", 4, read(c, buf, sizeof buf));
	FERRY_CHECK_MEM("C data", "back", buf, 4);
	errno = 0;
	FERRY_CHECK_EQ("C cannot send", -1, send(c, "x", 1, MSG_NOSIGNAL));
	FERRY_CHECK_EQ("C send errno", EPIPE, errno);
	ferry_finish();
}
