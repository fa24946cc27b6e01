/*
 * fd_unix_assorted: UNIX socket states beyond the basic ones, across a fork.
 *
 * Sets up listener L on $T/l.sock with: an accepted pair C2/S2 ("to-s2"
 * unread on S2); a waiting client C1 that sent "early1" and is shared with
 * a child; a waiting client that sent "bye3" and was closed.  Also: pair P
 * (made before the fork); pair D whose D0 wrote "bye" and closed with
 * "unread" unread (so D1 is reset); datagram socket R bound to the
 * relative name "rel.sock" (cwd $T) with SO_PASSCRED and a datagram from N
 * ($T/n.sock) queued; datagram socket G bound to $T/gone.sock, then
 * unlinked; pair Q with "abcdef" queued, SO_PEEK_OFF 2 and SHUT_RD on Q1.
 * The child makes a seqpacket pair of its own with one record queued.
 * Verifies: SO_PEERCRED pids, names (accepted end, relative, unlinked),
 * data and order, that accept() returns exactly the two waiting connections
 * with their data (and the child's later write through its copy of C1),
 * reset-then-EOF on D1, sender name of the queued datagram, SO_PASSCRED,
 * the peek offset and the SHUT_RD.
 */
#include "ferry_test.h"
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>

static socklen_t mkaddr(struct sockaddr_un *a, const char *path)
{
	memset(a, 0, sizeof *a);
	a->sun_family = AF_UNIX;
	strcpy(a->sun_path, path);
	return sizeof *a;
}

static int peerpid(int fd)
{
	struct ucred c = { 0 };
	socklen_t l = sizeof c;
	getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &c, &l);
	return c.pid;
}

int main(void)
{
	char lpath[PATH_MAX], gpath[PATH_MAX], npath[PATH_MAX];
	struct sockaddr_un la, ga, na, ra;
	ferry_path(lpath, sizeof lpath, "l.sock");
	ferry_path(gpath, sizeof gpath, "gone.sock");
	ferry_path(npath, sizeof npath, "n.sock");
	mkaddr(&la, lpath);
	mkaddr(&ga, gpath);
	mkaddr(&na, npath);
	int l = FERRY_SYS(socket(AF_UNIX, SOCK_STREAM, 0));
	FERRY_SYS(bind(l, (struct sockaddr *)&la, sizeof la));
	FERRY_SYS(listen(l, 4));
	/* accepted pair */
	int c2 = FERRY_SYS(socket(AF_UNIX, SOCK_STREAM, 0));
	FERRY_SYS(connect(c2, (struct sockaddr *)&la, sizeof la));
	int s2 = FERRY_SYS(accept(l, NULL, NULL));
	FERRY_SYS(write(c2, "to-s2", 5));
	/* pending client with data, shared with the child */
	int c1 = FERRY_SYS(socket(AF_UNIX, SOCK_STREAM, 0));
	FERRY_SYS(connect(c1, (struct sockaddr *)&la, sizeof la));
	FERRY_SYS(write(c1, "early1", 6));
	/* closed pending client with data */
	int c3 = FERRY_SYS(socket(AF_UNIX, SOCK_STREAM, 0));
	FERRY_SYS(connect(c3, (struct sockaddr *)&la, sizeof la));
	FERRY_SYS(write(c3, "bye3", 4));
	close(c3);
	/* socketpair before fork */
	int p[2];
	FERRY_SYS(socketpair(AF_UNIX, SOCK_STREAM, 0, p));
	/* peer closed with unread data both ways */
	int d[2];
	FERRY_SYS(socketpair(AF_UNIX, SOCK_STREAM, 0, d));
	FERRY_SYS(write(d[0], "bye", 3));
	FERRY_SYS(write(d[1], "unread", 6));
	close(d[0]);
	/* relative name */
	FERRY_SYS(chdir(ferry_dir()));
	int r = FERRY_SYS(socket(AF_UNIX, SOCK_DGRAM, 0));
	socklen_t rl = mkaddr(&ra, "rel.sock");
	FERRY_SYS(bind(r, (struct sockaddr *)&ra, rl));
	/* deleted name */
	int g = FERRY_SYS(socket(AF_UNIX, SOCK_DGRAM, 0));
	FERRY_SYS(bind(g, (struct sockaddr *)&ga, sizeof ga));
	unlink(gpath);
	/* named sender */
	int n = FERRY_SYS(socket(AF_UNIX, SOCK_DGRAM, 0));
	FERRY_SYS(bind(n, (struct sockaddr *)&na, sizeof na));
	FERRY_SYS(sendto(n, "from-n", 6, 0, (struct sockaddr *)&ra, rl));
	int one = 1;
	FERRY_SYS(setsockopt(r, SOL_SOCKET, SO_PASSCRED, &one, sizeof one));
	/* peek offset */
	int q[2];
	FERRY_SYS(socketpair(AF_UNIX, SOCK_STREAM, 0, q));
	FERRY_SYS(write(q[0], "abcdef", 6));
	int two = 2;
	FERRY_SYS(setsockopt(q[1], SOL_SOCKET, SO_PEEK_OFF, &two, sizeof two));
	FERRY_SYS(shutdown(q[1], SHUT_RD));
	pid_t me = getpid();
	pid_t kid = FERRY_SYS(fork());
	if (kid == 0) {
		int k[2];
		socketpair(AF_UNIX, SOCK_SEQPACKET, 0, k);
		send(k[0], "kk", 2, 0);
		ferry_wait_go();
		FERRY_CHECK_EQ("kid pair creds", getpid(), peerpid(k[1]));
		char b[4];
		FERRY_CHECK_EQ("kid pair rec", 2, recv(k[1], b, 4, MSG_DONTWAIT));
		FERRY_CHECK_EQ("kid writes on c1", 3, write(c1, "kid", 3));
		ferry_child_finish();
	}

	ferry_ready();
	ferry_wait_go();

	char buf[64];
	struct sockaddr_un got;
	socklen_t gl;
	FERRY_CHECK_EQ("pair creds", me, peerpid(p[0]));
	FERRY_CHECK_EQ("c2 creds (listener's)", me, peerpid(c2));
	FERRY_CHECK_EQ("s2 creds (connector)", me, peerpid(s2));
	gl = sizeof got; memset(&got, 0, sizeof got);
	getsockname(s2, (struct sockaddr *)&got, &gl);
	FERRY_CHECK_EQ_STR("s2 name", lpath, got.sun_path);
	gl = sizeof got; memset(&got, 0, sizeof got);
	getpeername(c2, (struct sockaddr *)&got, &gl);
	FERRY_CHECK_EQ_STR("c2 peer", lpath, got.sun_path);
	memset(buf, 0, sizeof buf);
	FERRY_CHECK_EQ("s2 data", 5, read(s2, buf, sizeof buf));
	FERRY_CHECK_EQ("s2 -> c2", 2, write(s2, "ok", 2));
	FERRY_CHECK_EQ("c2 reads", 2, read(c2, buf, sizeof buf));
	/* pending connections */
	fcntl(l, F_SETFL, O_NONBLOCK);
	int s1 = accept(l, NULL, NULL);
	FERRY_CHECK(s1 >= 0, "accept 1: %s", strerror(errno));
	int s3 = accept(l, NULL, NULL);
	FERRY_CHECK(s3 >= 0, "accept 3: %s", strerror(errno));
	FERRY_CHECK(accept(l, NULL, NULL) < 0, "extra pending connection");
	if (s1 >= 0) {
		FERRY_CHECK_EQ("s1 creds", me, peerpid(s1));
		memset(buf, 0, sizeof buf);
		FERRY_CHECK_EQ("early1", 6, read(s1, buf, 6));
		FERRY_CHECK_MEM("early1 data", "early1", buf, 6);
		ferry_reap_child(kid, "kid", 0, 5000);
		FERRY_CHECK_EQ("kid's data", 3, read(s1, buf, 3));
		FERRY_CHECK_MEM("kid data", "kid", buf, 3);
		FERRY_CHECK_EQ("s1 -> c1", 2, write(s1, "hi", 2));
		FERRY_CHECK_EQ("c1 reads", 2, read(c1, buf, sizeof buf));
	} else {
		ferry_reap_child(kid, "kid", 0, 5000);
	}
	if (s3 >= 0) {
		memset(buf, 0, sizeof buf);
		FERRY_CHECK_EQ("bye3", 4, read(s3, buf, sizeof buf));
		FERRY_CHECK_EQ("s3 EOF", 0, read(s3, buf, sizeof buf));
	}
	/* dead peer */
	FERRY_CHECK_EQ("d1 bye", 3, read(d[1], buf, sizeof buf));
	errno = 0;
	FERRY_CHECK(read(d[1], buf, sizeof buf) < 0 && errno == ECONNRESET, "d1 reset: %s", strerror(errno));
	FERRY_CHECK_EQ("d1 EOF", 0, read(d[1], buf, sizeof buf));
	/* names */
	gl = sizeof got; memset(&got, 0, sizeof got);
	getsockname(r, (struct sockaddr *)&got, &gl);
	FERRY_CHECK_EQ_STR("relative name", "rel.sock", got.sun_path);
	gl = sizeof got; memset(&got, 0, sizeof got);
	getsockname(g, (struct sockaddr *)&got, &gl);
	FERRY_CHECK_EQ_STR("deleted name", gpath, got.sun_path);
	FERRY_CHECK(access(gpath, F_OK) < 0, "deleted socket file is back");
	int v = 0; socklen_t vl = sizeof v;
	getsockopt(r, SOL_SOCKET, SO_PASSCRED, &v, &vl);
	FERRY_CHECK_EQ("SO_PASSCRED", 1, v);
	gl = sizeof got; memset(&got, 0, sizeof got); memset(buf, 0, sizeof buf);
	FERRY_CHECK_EQ("from-n", 6, recvfrom(r, buf, sizeof buf, MSG_DONTWAIT, (struct sockaddr *)&got, &gl));
	FERRY_CHECK_EQ_STR("sender name", npath, got.sun_path);
	FERRY_CHECK_EQ("send to rel", 2, sendto(n, "zz", 2, 0, (struct sockaddr *)&ra, rl));
	/* peek offset and shutdown */
	memset(buf, 0, sizeof buf);
	FERRY_CHECK_EQ("peek at offset", 4, recv(q[1], buf, sizeof buf, MSG_PEEK));
	FERRY_CHECK_MEM("peeked", "cdef", buf, 4);
	FERRY_CHECK(send(q[0], "x", 1, MSG_NOSIGNAL) < 0 && errno == EPIPE, "write to SHUT_RD peer");
	ferry_finish();
}
