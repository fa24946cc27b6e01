/*
 * fd_unix_seqpacket: an AF_UNIX SOCK_SEQPACKET pair.
 *
 * Sets up a pair with records of 10, 20 and 4000 bytes queued P0 -> P1 and
 * one of 7 bytes P1 -> P0.
 * Verifies: SO_TYPE, record boundaries and contents, no extra records, and
 * the pair is still connected both ways.
 */
#include "ferry_test.h"
#include <sys/socket.h>

int main(void)
{
	int p[2];
	FERRY_SYS(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, p));
	static const int lens[] = { 10, 20, 4000 };
	static unsigned char msg[4000], buf[8000];
	for (int i = 0; i < 3; i++) {
		ferry_fill(msg, (size_t)lens[i], 220 + (uint64_t)i);
		FERRY_SYS(send(p[0], msg, (size_t)lens[i], 0));
	}
	FERRY_SYS(send(p[1], "backlog", 7, 0));

	ferry_ready();
	ferry_wait_go();

	int type = 0;
	socklen_t l = sizeof type;
	getsockopt(p[0], SOL_SOCKET, SO_TYPE, &type, &l);
	FERRY_CHECK_EQ("SO_TYPE", SOCK_SEQPACKET, type);
	for (int i = 0; i < 3; i++) {
		ssize_t n = recv(p[1], buf, sizeof buf, MSG_DONTWAIT);
		FERRY_CHECK_EQ("record length", lens[i], n);
		ferry_fill(msg, (size_t)lens[i], 220 + (uint64_t)i);
		if (n == lens[i])
			FERRY_CHECK_MEM("record data", msg, buf, (size_t)n);
	}
	FERRY_CHECK(recv(p[1], buf, sizeof buf, MSG_DONTWAIT) < 0, "extra record queued on P1");
	FERRY_CHECK_EQ("record P1 -> P0", 7, recv(p[0], buf, sizeof buf, MSG_DONTWAIT));
	FERRY_CHECK_EQ("send P0 -> P1", 3, send(p[0], "xyz", 3, 0));
	FERRY_CHECK_EQ("recv on P1", 3, recv(p[1], buf, sizeof buf, MSG_DONTWAIT));
	FERRY_CHECK_EQ("send P1 -> P0", 2, send(p[1], "ok", 2, 0));
	FERRY_CHECK_EQ("recv on P0", 2, recv(p[0], buf, sizeof buf, MSG_DONTWAIT));
	ferry_finish();
}
