/*
 * fd_udp_queued: datagrams waiting in a UDP socket.
 *
 * Sets up U1 bound to 127.0.0.1:<ephemeral>; U2 connected to U1; U3 (since
 * closed) that sent to U1.  Queued on U1: "one" from U2, "three" from U3,
 * an empty datagram and "two" from U2.
 * Verifies: the four datagrams arrive in order with their lengths, contents
 * and senders' ports, and nothing more.
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
	FERRY_SYS(bind(u1, (struct sockaddr *)&lo, sizeof lo));
	struct sockaddr_in a1 = local(u1);
	int u2 = FERRY_SYS(socket(AF_INET, SOCK_DGRAM, 0));
	FERRY_SYS(connect(u2, (struct sockaddr *)&a1, sizeof a1));
	struct sockaddr_in a2 = local(u2);
	FERRY_SYS(send(u2, "one", 3, 0));
	int u3 = FERRY_SYS(socket(AF_INET, SOCK_DGRAM, 0));
	FERRY_SYS(sendto(u3, "three", 5, 0, (struct sockaddr *)&a1, sizeof a1));
	struct sockaddr_in a3 = local(u3);
	close(u3);
	FERRY_SYS(send(u2, "", 0, 0));
	FERRY_SYS(send(u2, "two", 3, 0));
	ferry_sleep_ms(20);
	ferry_ready();
	ferry_wait_go();
	char buf[16];
	struct sockaddr_in f;
	socklen_t fl;
	const char *want[] = { "one", "three", "", "two" };
	int port[] = { ntohs(a2.sin_port), ntohs(a3.sin_port), ntohs(a2.sin_port), ntohs(a2.sin_port) };
	for (int i = 0; i < 4; i++) {
		memset(buf, 0, sizeof buf);
		fl = sizeof f;
		ssize_t n = recvfrom(u1, buf, sizeof buf, MSG_DONTWAIT, (struct sockaddr *)&f, &fl);
		FERRY_CHECK_EQ("len", (ssize_t)strlen(want[i]), n);
		FERRY_CHECK_EQ_STR("data", want[i], buf);
		FERRY_CHECK_EQ("from port", port[i], ntohs(f.sin_port));
	}
	FERRY_CHECK(recv(u1, buf, sizeof buf, MSG_DONTWAIT) < 0, "extra datagram");
	ferry_finish();
}
