/*
 * fd_unix_peercred_nonroot: UNIX socket credentials of an unprivileged child.
 *
 * Sets up abstract listener L (root); a child that switches to uid/gid 1000
 * makes a socketpair P, connects client C to L and writes "x" (the
 * connection waits in L's queue, carrying data), then forks a grandchild
 * that shares C.
 * Verifies: SO_PEERCRED of P is the child's pid, uid 1000, gid 1000; after
 * the grandchild and the child write "g" and "k" through C, L accepts the
 * connection, whose SO_PEERCRED is the child (uid 1000), carrying "xgk".
 */
#include "ferry_test.h"
#include <sys/socket.h>
#include <sys/un.h>
#include <grp.h>

static struct ucred pc(int fd)
{
	struct ucred c = { 0 };
	socklen_t l = sizeof c;
	getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &c, &l);
	return c;
}

int main(void)
{
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	snprintf(a.sun_path + 1, sizeof a.sun_path - 1, "sk-creds-%d", getpid());
	socklen_t al = offsetof(struct sockaddr_un, sun_path) + 1 + strlen(a.sun_path + 1);
	int l = FERRY_SYS(socket(AF_UNIX, SOCK_STREAM, 0));
	FERRY_SYS(bind(l, (struct sockaddr *)&a, al));
	FERRY_SYS(listen(l, 4));
	chmod(ferry_dir(), 0777); /* so that the unprivileged child can report failures */
	int ready[2];
	FERRY_SYS(pipe(ready));
	pid_t kid = FERRY_SYS(fork());
	if (kid == 0) {
		if (setgroups(0, NULL) || setresgid(1000, 1000, 1000) || setresuid(1000, 1000, 1000))
			ferry_die("drop privileges");
		int p[2];
		socketpair(AF_UNIX, SOCK_STREAM, 0, p);
		int c = socket(AF_UNIX, SOCK_STREAM, 0);
		if (connect(c, (struct sockaddr *)&a, al))
			ferry_die("connect");
		if (write(c, "x", 1) != 1)
			ferry_die("write");
		pid_t g = fork();
		if (g == 0) {
			ferry_wait_go();
			FERRY_CHECK_EQ("grandchild writes", 1, write(c, "g", 1));
			ferry_child_finish();
		}
		if (write(ready[1], "r", 1) != 1)
			ferry_die("ready");
		ferry_wait_go();
		struct ucred k = pc(p[0]);
		FERRY_CHECK_EQ("pair pid", getpid(), k.pid);
		FERRY_CHECK_EQ("pair uid", 1000, (int)k.uid);
		FERRY_CHECK_EQ("pair gid", 1000, (int)k.gid);
		ferry_reap_child(g, "grandchild", 0, 5000);
		FERRY_CHECK_EQ("kid writes", 1, write(c, "k", 1));
		ferry_child_finish();
	}
	char r;
	if (read(ready[0], &r, 1) != 1)
		ferry_die("child not ready");

	ferry_ready();
	ferry_wait_go();

	ferry_reap_child(kid, "kid", 0, 5000);
	int s = accept(l, NULL, NULL);
	FERRY_CHECK(s >= 0, "accept: %s", strerror(errno));
	struct ucred k = pc(s);
	FERRY_CHECK_EQ("server end pid", kid, k.pid);
	FERRY_CHECK_EQ("server end uid", 1000, (int)k.uid);
	char buf[8] = "";
	FERRY_CHECK_EQ("3 bytes", 3, read(s, buf, 3));
	FERRY_CHECK_MEM("data", "xgk", buf, 3);
	ferry_finish();
}
