/*
 * fd_unix_dgram: AF_UNIX datagram sockets.
 *
 * Sets up a socketpair D with datagrams of 5, 50 and 500 bytes queued
 * D0 -> D1; a server bound to $T/dgram.sock with a datagram "to-srv"
 * queued from an unbound sender; a client connected to the server.
 * Verifies: datagram boundaries and order, the server's bound name, the
 * connected client's peer name, and that all still send/receive.
 */
#include "ferry_test.h"
#include <sys/socket.h>
#include <sys/un.h>

int main(void)
{
	int d[2];
	FERRY_SYS(socketpair(AF_UNIX, SOCK_DGRAM, 0, d));
	static char msg[500];
	for (int len = 5; len <= 500; len *= 10) {
		ferry_fill(msg, (size_t)len, (uint64_t)len);
		FERRY_SYS(send(d[0], msg, (size_t)len, 0));
	}
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	char path[PATH_MAX];
	ferry_path(path, sizeof path, "dgram.sock");
	if (strlen(path) >= sizeof sa.sun_path)
		ferry_die("path too long");
	strcpy(sa.sun_path, path);
	int srv = FERRY_SYS(socket(AF_UNIX, SOCK_DGRAM, 0));
	FERRY_SYS(bind(srv, (struct sockaddr *)&sa, sizeof sa));
	int snd = FERRY_SYS(socket(AF_UNIX, SOCK_DGRAM, 0));
	FERRY_SYS(sendto(snd, "to-srv", 6, 0, (struct sockaddr *)&sa, sizeof sa));
	int cli = FERRY_SYS(socket(AF_UNIX, SOCK_DGRAM, 0));
	FERRY_SYS(connect(cli, (struct sockaddr *)&sa, sizeof sa));

	ferry_ready();
	ferry_wait_go();

	static char buf[1000];
	for (int len = 5; len <= 500; len *= 10) {
		ssize_t n = recv(d[1], buf, sizeof buf, MSG_DONTWAIT);
		FERRY_CHECK_EQ("datagram length", len, n);
		ferry_fill(msg, (size_t)len, (uint64_t)len);
		if (n == len)
			FERRY_CHECK_MEM("datagram data", msg, buf, (size_t)len);
	}
	FERRY_CHECK(recv(d[1], buf, sizeof buf, MSG_DONTWAIT) < 0, "extra datagram queued on D1");
	FERRY_CHECK_EQ("D1 -> D0 after restore", 3, send(d[1], "abc", 3, 0));
	FERRY_CHECK_EQ("D0 receives", 3, recv(d[0], buf, sizeof buf, MSG_DONTWAIT));
	struct sockaddr_un got;
	socklen_t gl = sizeof got;
	memset(&got, 0, sizeof got);
	FERRY_CHECK_EQ("getsockname(srv)", 0, getsockname(srv, (struct sockaddr *)&got, &gl));
	FERRY_CHECK_EQ_STR("server name", path, got.sun_path);
	memset(&got, 0, sizeof got);
	gl = sizeof got;
	FERRY_CHECK_EQ("getpeername(cli)", 0, getpeername(cli, (struct sockaddr *)&got, &gl));
	FERRY_CHECK_EQ_STR("client's peer", path, got.sun_path);
	memset(buf, 0, sizeof buf);
	FERRY_CHECK_EQ("queued datagram at server", 6, recv(srv, buf, sizeof buf, MSG_DONTWAIT));
	FERRY_CHECK_EQ_STR("queued datagram", "to-srv", buf);
	FERRY_CHECK_EQ("client send", 4, send(cli, "ping", 4, 0));
	memset(buf, 0, sizeof buf);
	FERRY_CHECK_EQ("server receives", 4, recv(srv, buf, sizeof buf, MSG_DONTWAIT));
	FERRY_CHECK_EQ_STR("datagram from client", "ping", buf);
	ferry_finish();
}
