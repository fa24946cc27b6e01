/*
 * fd_unix_named_listen: listening AF_UNIX sockets with a backlog.
 *
 * Sets up L bound to $T/listen.sock (backlog 5) with two connections not yet
 * accepted (C1 sent "early", C2 sent nothing), and an abstract-namespace
 * listener A.
 * Verifies: SO_ACCEPTCONN, bound names, accept() returns C1's connection
 * (with "early") then C2's, both still connected both ways, and new
 * connections to L and A succeed.
 */
#include "ferry_test.h"
#include <sys/socket.h>
#include <sys/un.h>

static socklen_t abstract_addr(struct sockaddr_un *a)
{
	memset(a, 0, sizeof *a);
	a->sun_family = AF_UNIX;
	int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "ferry-test-%d", (int)ferry__main_pid);
	return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

int main(void)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX }, ab;
	char path[PATH_MAX];
	ferry_path(path, sizeof path, "listen.sock");
	if (strlen(path) >= sizeof sa.sun_path)
		ferry_die("path too long");
	strcpy(sa.sun_path, path);
	int l = FERRY_SYS(socket(AF_UNIX, SOCK_STREAM, 0));
	FERRY_SYS(bind(l, (struct sockaddr *)&sa, sizeof sa));
	FERRY_SYS(listen(l, 5));
	int c1 = FERRY_SYS(socket(AF_UNIX, SOCK_STREAM, 0));
	FERRY_SYS(connect(c1, (struct sockaddr *)&sa, sizeof sa));
	FERRY_SYS(write(c1, "early", 5));
	int c2 = FERRY_SYS(socket(AF_UNIX, SOCK_STREAM, 0));
	FERRY_SYS(connect(c2, (struct sockaddr *)&sa, sizeof sa));
	socklen_t abl = abstract_addr(&ab);
	int a = FERRY_SYS(socket(AF_UNIX, SOCK_STREAM, 0));
	FERRY_SYS(bind(a, (struct sockaddr *)&ab, abl));
	FERRY_SYS(listen(a, 2));

	ferry_ready();
	ferry_wait_go();

	int v = 0;
	socklen_t vl = sizeof v;
	getsockopt(l, SOL_SOCKET, SO_ACCEPTCONN, &v, &vl);
	FERRY_CHECK_EQ("L SO_ACCEPTCONN", 1, v);
	struct sockaddr_un got;
	socklen_t gl = sizeof got;
	memset(&got, 0, sizeof got);
	getsockname(l, (struct sockaddr *)&got, &gl);
	FERRY_CHECK_EQ_STR("L name", path, got.sun_path);
	memset(&got, 0, sizeof got);
	gl = sizeof got;
	getsockname(a, (struct sockaddr *)&got, &gl);
	FERRY_CHECK_EQ("A name length", abl, gl);
	FERRY_CHECK_MEM("A abstract name", ab.sun_path, got.sun_path, (size_t)abl - offsetof(struct sockaddr_un, sun_path));

	fcntl(l, F_SETFL, O_NONBLOCK);
	int s1 = accept(l, NULL, NULL);
	FERRY_CHECK(s1 >= 0, "accept #1: %s", strerror(errno));
	int s2 = accept(l, NULL, NULL);
	FERRY_CHECK(s2 >= 0, "accept #2: %s", strerror(errno));
	char buf[16] = "";
	if (s1 >= 0) {
		fcntl(s1, F_SETFL, O_NONBLOCK);
		FERRY_CHECK_EQ("data queued by C1", 5, read(s1, buf, sizeof buf));
		FERRY_CHECK_MEM("C1's data", "early", buf, 5);
		FERRY_CHECK_EQ("S1 -> C1", 2, write(s1, "s1", 2));
		FERRY_CHECK_EQ("C1 reads", 2, read(c1, buf, sizeof buf));
	}
	if (s2 >= 0) {
		FERRY_CHECK_EQ("C2 -> S2", 2, write(c2, "c2", 2));
		FERRY_CHECK_EQ("S2 reads", 2, read(s2, buf, sizeof buf));
		FERRY_CHECK_MEM("C2's data", "c2", buf, 2);
	}
	int c3 = socket(AF_UNIX, SOCK_STREAM, 0);
	FERRY_CHECK(connect(c3, (struct sockaddr *)&sa, sizeof sa) == 0, "new connect to L: %s", strerror(errno));
	int c4 = socket(AF_UNIX, SOCK_STREAM, 0);
	FERRY_CHECK(connect(c4, (struct sockaddr *)&ab, abl) == 0, "new connect to A: %s", strerror(errno));
	ferry_finish();
}
