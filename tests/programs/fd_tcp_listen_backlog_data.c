/*
 * fd_tcp_listen_backlog_data: a TCP connection waiting to be accepted that
 * already carries what its client sent (both ends in this process).
 *
 * Sets up listener L on 127.0.0.1 and client C connected, not accepted;
 * C sent "request": the bytes wait in the server end of the connection,
 * which no descriptor reaches before accept.
 * Verifies: L accepts the connection from C and reads "request"; the
 * connection works both ways.
 */
#include "ferry_test.h"
#include "ferry_tcp.h"

int main(void)
{
	struct sockaddr_in la = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t al = sizeof la;
	int l = FERRY_SYS(socket(AF_INET, SOCK_STREAM, 0));
	FERRY_SYS(bind(l, (struct sockaddr *)&la, sizeof la));
	FERRY_SYS(listen(l, 8));
	FERRY_SYS(getsockname(l, (struct sockaddr *)&la, &al));
	int c = FERRY_SYS(socket(AF_INET, SOCK_STREAM, 0));
	FERRY_SYS(connect(c, (struct sockaddr *)&la, sizeof la));
	FERRY_SYS(write(c, "request", 7));
	int pc = ports(c);
	ferry_sleep_ms(20);

	ferry_ready();
	ferry_wait_go();

	FERRY_CHECK_EQ("C ports", pc, ports(c));
	struct pollfd p = { .fd = l, .events = POLLIN };
	FERRY_CHECK_EQ("L has a connection", 1, poll(&p, 1, 3000));
	int s = accept(l, NULL, NULL);
	FERRY_CHECK(s >= 0, "accept: %s", strerror(errno));
	char buf[16];
	p.fd = s;
	FERRY_CHECK_EQ("S readable", 1, poll(&p, 1, 3000));
	FERRY_CHECK_EQ("S reads", 7, read(s, buf, sizeof buf));
	FERRY_CHECK_MEM("S data", "request", buf, 7);
	FERRY_CHECK_EQ("S -> C", 5, write(s, "reply", 5));
	p.fd = c;
	FERRY_CHECK_EQ("C readable", 1, poll(&p, 1, 3000));
	FERRY_CHECK_EQ("C reads", 5, read(c, buf, sizeof buf));
	FERRY_CHECK_MEM("C data", "reply", buf, 5);
	ferry_finish();
}
