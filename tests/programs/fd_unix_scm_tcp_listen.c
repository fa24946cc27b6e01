/*
 * fd_unix_scm_tcp_listen: a TCP listener in flight (SCM_RIGHTS), as a
 * pre-fork server hands its listening socket to a worker.
 *
 * The parent makes an IPv4 listener L on 127.0.0.1:<ephemeral> (SO_REUSEADDR,
 * backlog 8), forks a worker holding one end of a UNIX stream pair, sends
 * "L" over the pair with L attached and closes its own L: the listener lives
 * only in the worker's queue.  The parent then connects a client C to it,
 * which waits, not accepted, in L's queue.
 * Verifies (worker, after go): the message comes back with one descriptor, a
 * socket listening (SO_ACCEPTCONN, SO_REUSEADDR) on the same address and
 * port; it accepts C's connection, which carries "ping" one way and "pong"
 * the other; a new connection to it is accepted and carries data too.  The
 * parent's fd table is unchanged.
 */
#include "ferry_test.h"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>

static int opt(int fd, int level, int name)
{
	int v = -1;
	socklen_t l = sizeof v;
	getsockopt(fd, level, name, &v, &l);
	return v;
}

static int recv_fd(int from, char *data, size_t size)
{
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int) * 4)];
	} u;
	memset(&u, 0, sizeof u);
	struct iovec iov = { .iov_base = data, .iov_len = size };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
			     .msg_controllen = sizeof u.buf };
	ssize_t n = recvmsg(from, &mh, MSG_DONTWAIT);
	FERRY_CHECK(n == 1, "the message is %zd bytes (%s)", n, n < 0 ? strerror(errno) : "");
	struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
	FERRY_CHECK(c && c->cmsg_type == SCM_RIGHTS && c->cmsg_len == CMSG_LEN(sizeof(int)),
		    "the message came without exactly one descriptor");
	if (!c || c->cmsg_len != CMSG_LEN(sizeof(int)))
		return -1;
	int fd;
	memcpy(&fd, CMSG_DATA(c), sizeof fd);
	return fd;
}

static void worker(int d, struct sockaddr_in *want)
{
	ferry_wait_go();
	char tag[4] = "";
	int l = recv_fd(d, tag, sizeof tag);
	if (l < 0)
		ferry_child_finish();
	FERRY_CHECK(tag[0] == 'L', "the message is \"%.1s\", expected \"L\"", tag);
	FERRY_CHECK_EQ("SO_ACCEPTCONN", 1, opt(l, SOL_SOCKET, SO_ACCEPTCONN));
	FERRY_CHECK_EQ("SO_REUSEADDR", 1, opt(l, SOL_SOCKET, SO_REUSEADDR));
	struct sockaddr_in a;
	socklen_t al = sizeof a;
	FERRY_CHECK_EQ("getsockname", 0, getsockname(l, (struct sockaddr *)&a, &al));
	FERRY_CHECK_EQ("port", ntohs(want->sin_port), ntohs(a.sin_port));
	FERRY_CHECK_EQ_HEX("address", ntohl(want->sin_addr.s_addr), ntohl(a.sin_addr.s_addr));

	/* The parent's connection, waiting in the queue. */
	int s = accept(l, NULL, NULL);
	FERRY_CHECK(s >= 0, "accept the waiting connection: %s", strerror(errno));
	if (s >= 0) {
		char buf[8] = "";
		FERRY_CHECK_EQ("read ping", 4, read(s, buf, sizeof buf));
		FERRY_CHECK_MEM("ping", "ping", buf, 4);
		FERRY_CHECK_EQ("write pong", 4, write(s, "pong", 4));
		close(s);
	}

	/* A new one. */
	int c = FERRY_SYS(socket(AF_INET, SOCK_STREAM, 0));
	FERRY_CHECK_EQ("connect", 0, connect(c, (struct sockaddr *)want, sizeof *want));
	s = accept(l, NULL, NULL);
	FERRY_CHECK(s >= 0, "accept a new connection: %s", strerror(errno));
	if (s >= 0) {
		char buf[8] = "";
		FERRY_CHECK_EQ("client send", 4, write(c, "abcd", 4));
		FERRY_CHECK_EQ("server recv", 4, read(s, buf, sizeof buf));
		FERRY_CHECK_MEM("data", "abcd", buf, 4);
		close(s);
	}
	close(c);
	close(l);
	ferry_child_finish();
}

int main(void)
{
	int one = 1;
	int l = FERRY_SYS(socket(AF_INET, SOCK_STREAM, 0));
	FERRY_SYS(setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one));
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	FERRY_SYS(bind(l, (struct sockaddr *)&a, sizeof a));
	FERRY_SYS(listen(l, 8));
	socklen_t al = sizeof a;
	FERRY_SYS(getsockname(l, (struct sockaddr *)&a, &al));

	int d[2];
	FERRY_SYS(socketpair(AF_UNIX, SOCK_STREAM, 0, d));
	pid_t w = FERRY_SYS(fork());
	if (w == 0) {
		close(d[0]);
		close(l);
		worker(d[1], &a);
	}
	close(d[1]);

	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int))];
	} u;
	memset(&u, 0, sizeof u);
	struct iovec iov = { .iov_base = "L", .iov_len = 1 };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
			     .msg_controllen = sizeof u.buf };
	struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
	cm->cmsg_level = SOL_SOCKET;
	cm->cmsg_type = SCM_RIGHTS;
	cm->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(cm), &l, sizeof l);
	FERRY_SYS(sendmsg(d[0], &mh, 0));
	close(l);

	int c = FERRY_SYS(socket(AF_INET, SOCK_STREAM, 0));
	FERRY_SYS(connect(c, (struct sockaddr *)&a, sizeof a));

	int fds[64];
	int nfds = ferry_list_fds(fds, 64);
	ferry_ready();
	ferry_wait_go();
	ferry_check_fds_same(fds, nfds);

	char buf[8] = "";
	FERRY_CHECK_EQ("write ping", 4, write(c, "ping", 4));
	struct timeval tv = { .tv_sec = 5 };
	setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	FERRY_CHECK_EQ("read pong", 4, read(c, buf, sizeof buf));
	FERRY_CHECK_MEM("pong", "pong", buf, 4);
	close(c);
	ferry_reap_child(w, "worker", 0, 5000);
	ferry_finish();
}
