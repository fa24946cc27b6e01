/*
 * fd_udp: UDP sockets on loopback.
 *
 * Sets up U1 bound to 127.0.0.1:<ephemeral> with SO_RCVBUF set, and U2
 * bound to 127.0.0.1:<ephemeral> and connect()ed to U1.
 * Verifies: local and peer addresses, SO_RCVBUF, and datagrams both ways
 * (U2 send -> U1 recvfrom sees U2's address; U1 sendto U2).
 */
#include "ferry_test.h"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

static struct sockaddr_in local(int fd)
{
	struct sockaddr_in a = { 0 };
	socklen_t l = sizeof a;
	getsockname(fd, (struct sockaddr *)&a, &l);
	return a;
}

int main(void)
{
	struct sockaddr_in lo = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	int u1 = FERRY_SYS(socket(AF_INET, SOCK_DGRAM, 0));
	int rb = 100000;
	FERRY_SYS(setsockopt(u1, SOL_SOCKET, SO_RCVBUF, &rb, sizeof rb));
	FERRY_SYS(bind(u1, (struct sockaddr *)&lo, sizeof lo));
	int u2 = FERRY_SYS(socket(AF_INET, SOCK_DGRAM, 0));
	FERRY_SYS(bind(u2, (struct sockaddr *)&lo, sizeof lo));
	struct sockaddr_in a1 = local(u1), a2 = local(u2);
	FERRY_SYS(connect(u2, (struct sockaddr *)&a1, sizeof a1));
	int rcv = 0;
	socklen_t ol = sizeof rcv;
	getsockopt(u1, SOL_SOCKET, SO_RCVBUF, &rcv, &ol);

	ferry_ready();
	ferry_wait_go();

	struct sockaddr_in n1 = local(u1), n2 = local(u2), peer = { 0 };
	FERRY_CHECK_EQ("U1 port", ntohs(a1.sin_port), ntohs(n1.sin_port));
	FERRY_CHECK_EQ("U2 port", ntohs(a2.sin_port), ntohs(n2.sin_port));
	socklen_t pl = sizeof peer;
	FERRY_CHECK_EQ("getpeername(U2)", 0, getpeername(u2, (struct sockaddr *)&peer, &pl));
	FERRY_CHECK_EQ("U2 peer port", ntohs(a1.sin_port), ntohs(peer.sin_port));
	int v = 0;
	ol = sizeof v;
	getsockopt(u1, SOL_SOCKET, SO_RCVBUF, &v, &ol);
	FERRY_CHECK_EQ("U1 SO_RCVBUF", rcv, v);
	FERRY_CHECK_EQ("U2 send", 5, send(u2, "hello", 5, 0));
	char buf[16] = "";
	struct sockaddr_in from = { 0 };
	socklen_t fl = sizeof from;
	struct timeval tv = { 2, 0 };
	setsockopt(u1, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	setsockopt(u2, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	FERRY_CHECK_EQ("U1 recvfrom", 5, recvfrom(u1, buf, sizeof buf, 0, (struct sockaddr *)&from, &fl));
	FERRY_CHECK_EQ("sender port", ntohs(a2.sin_port), ntohs(from.sin_port));
	FERRY_CHECK_EQ("U1 sendto U2", 3, sendto(u1, "yes", 3, 0, (struct sockaddr *)&a2, sizeof a2));
	FERRY_CHECK_EQ("U2 recv", 3, recv(u2, buf, sizeof buf, 0));
	ferry_finish();
}
