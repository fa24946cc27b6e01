/*
 * fd_tcp_inflight: a TCP connection on loopback (both ends in this process)
 * whose buffers are full both ways: bytes received and not read, bytes
 * sent and not acknowledged, bytes the zero window keeps from being sent.
 *
 * Sets up C <-> S with small buffers; C writes until its send buffer and
 * S's receive buffer are full, then S does the same towards C; nobody
 * reads.  Records how many bytes each side wrote and what SIOCOUTQ says.
 * Verifies: the ports and states; every byte arrives exactly once and in
 * order, both ways; the connection then works both ways.
 */
#include "ferry_test.h"
#include "ferry_tcp.h"
#include <linux/sockios.h>
#include <sys/ioctl.h>

int main(void)
{
	int c, s;
	char buf[16];
	pair(&c, &s);
	size_t to_s = stuff(c, 21);
	size_t to_c = stuff(s, 22);
	ferry_sleep_ms(50);
	int outq_c = 0, outq_s = 0;
	ioctl(c, SIOCOUTQ, &outq_c);
	ioctl(s, SIOCOUTQ, &outq_s);
	if (outq_c <= 0 || outq_s <= 0)
		ferry_die("setup: nothing waits in the send queues (%d, %d)", outq_c, outq_s);
	ferry_log("C wrote %zu (%d in its send queue), S wrote %zu (%d)", to_s, outq_c, to_c, outq_s);
	int pc = ports(c), ps = ports(s);

	ferry_ready();
	ferry_wait_go();

	FERRY_CHECK_EQ("C ports", pc, ports(c));
	FERRY_CHECK_EQ("S ports", ps, ports(s));
	FERRY_CHECK_EQ("C state", TCP_ESTABLISHED, tcp_state(c));
	FERRY_CHECK_EQ("S state", TCP_ESTABLISHED, tcp_state(s));
	drain("C -> S", s, to_s, 21, 0);
	drain("S -> C", c, to_c, 22, 0);
	FERRY_CHECK_EQ("C -> S after", 4, write(c, "ping", 4));
	struct pollfd p = { .fd = s, .events = POLLIN };
	FERRY_CHECK_EQ("S readable", 1, poll(&p, 1, 3000));
	FERRY_CHECK_EQ("S reads", 4, read(s, buf, sizeof buf));
	FERRY_CHECK_EQ("S -> C after", 4, write(s, "pong", 4));
	p.fd = c;
	FERRY_CHECK_EQ("C readable", 1, poll(&p, 1, 3000));
	FERRY_CHECK_EQ("C reads", 4, read(c, buf, sizeof buf));
	ferry_finish();
}
