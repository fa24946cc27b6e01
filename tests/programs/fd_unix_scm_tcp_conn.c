/*
 * fd_unix_scm_tcp_conn: an established TCP connection in flight (SCM_RIGHTS),
 * its other end held by the process, as a server hands an accepted
 * connection to a worker.
 *
 * Sets up a loopback connection C (connected) <-> S (accepted), with "hello"
 * sent by C and read by S, and "world" sent by S, unread; sends "S" over a
 * UNIX datagram pair (d0 -> d1) with S attached and closes S: the server end
 * lives only in d1's queue (with nothing to read, so that closing it would
 * send a FIN: the capture must close it silently).
 * Verifies: the message comes back with one descriptor, an ESTABLISHED TCP
 * socket whose addresses mirror C's; "world" is read from C; more bytes go
 * both ways; a shutdown of one end is seen as the end of the stream at the
 * other.  The fd table is unchanged.
 */
#include "ferry_test.h"
#include "ferry_tcp.h"

static int mirrored(int a, int b)
{
	struct sockaddr_in al, ar, bl, br;
	socklen_t l1 = sizeof al, l2 = sizeof ar, l3 = sizeof bl, l4 = sizeof br;
	if (getsockname(a, (struct sockaddr *)&al, &l1) < 0 || getpeername(a, (struct sockaddr *)&ar, &l2) < 0 ||
	    getsockname(b, (struct sockaddr *)&bl, &l3) < 0 || getpeername(b, (struct sockaddr *)&br, &l4) < 0)
		return 0;
	return al.sin_port == br.sin_port && ar.sin_port == bl.sin_port &&
	       al.sin_addr.s_addr == br.sin_addr.s_addr && ar.sin_addr.s_addr == bl.sin_addr.s_addr;
}

int main(void)
{
	int c, s;
	pair(&c, &s);
	char buf[16] = "";
	FERRY_SYS(write(c, "hello", 5));
	FERRY_CHECK_EQ("S reads", 5, read(s, buf, sizeof buf));
	FERRY_SYS(write(s, "world", 5));
	int c_ports = ports(c);

	int d[2];
	FERRY_SYS(socketpair(AF_UNIX, SOCK_DGRAM, 0, d));
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int) * 4)];
	} u;
	memset(&u, 0, sizeof u);
	struct iovec iov = { .iov_base = "S", .iov_len = 1 };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
			     .msg_controllen = CMSG_SPACE(sizeof(int)) };
	struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
	cm->cmsg_level = SOL_SOCKET;
	cm->cmsg_type = SCM_RIGHTS;
	cm->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(cm), &s, sizeof s);
	FERRY_SYS(sendmsg(d[0], &mh, 0));
	close(s);

	int fds[64];
	int nfds = ferry_list_fds(fds, 64);
	ferry_ready();
	ferry_wait_go();
	ferry_check_fds_same(fds, nfds);
	FERRY_CHECK_EQ_HEX("C's ports", c_ports, ports(c));
	FERRY_CHECK_EQ("C's state", TCP_ESTABLISHED, tcp_state(c));

	char tag[4] = "";
	struct iovec riov = { .iov_base = tag, .iov_len = sizeof tag };
	memset(&u, 0, sizeof u);
	struct msghdr rh = { .msg_iov = &riov, .msg_iovlen = 1, .msg_control = u.buf,
			     .msg_controllen = sizeof u.buf };
	ssize_t n = recvmsg(d[1], &rh, MSG_DONTWAIT);
	FERRY_CHECK(n == 1 && tag[0] == 'S', "the message is %zd bytes \"%.4s\"", n, tag);
	cm = CMSG_FIRSTHDR(&rh);
	FERRY_CHECK(cm && cm->cmsg_type == SCM_RIGHTS && cm->cmsg_len == CMSG_LEN(sizeof(int)),
		    "the message came without exactly one descriptor");
	if (!cm || cm->cmsg_len != CMSG_LEN(sizeof(int)))
		ferry_finish();
	int s2;
	memcpy(&s2, CMSG_DATA(cm), sizeof s2);
	FERRY_CHECK_EQ("S's state", TCP_ESTABLISHED, tcp_state(s2));
	FERRY_CHECK(mirrored(c, s2), "S's addresses do not mirror C's");

	struct timeval tv = { .tv_sec = 5 };
	setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	setsockopt(s2, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	FERRY_CHECK_EQ("C reads", 5, read(c, buf, sizeof buf));
	FERRY_CHECK_MEM("what S had sent", "world", buf, 5);
	FERRY_CHECK_EQ("C sends", 4, write(c, "more", 4));
	FERRY_CHECK_EQ("S reads more", 4, read(s2, buf, sizeof buf));
	FERRY_CHECK_MEM("more", "more", buf, 4);
	FERRY_CHECK_EQ("S sends", 4, write(s2, "back", 4));
	FERRY_CHECK_EQ("C reads back", 4, read(c, buf, sizeof buf));
	FERRY_CHECK_MEM("back", "back", buf, 4);
	FERRY_CHECK_EQ("S shuts down", 0, shutdown(s2, SHUT_WR));
	FERRY_CHECK_EQ("C reads the end", 0, read(c, buf, sizeof buf));
	close(s2);
	ferry_finish();
}
