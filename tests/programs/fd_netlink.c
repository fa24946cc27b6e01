/*
 * fd_netlink: netlink sockets.
 *
 * Sets up N1, NETLINK_ROUTE (SOCK_RAW) autobound by bind() with the
 * multicast groups 21 and 27 in its mask, joined to group 34 (past the
 * mask's 32) with NETLINK_ADD_MEMBERSHIP (groups that see no traffic here,
 * so nothing queues); N2, NETLINK_ROUTE (SOCK_DGRAM) bound to a port of its
 * choosing, with NETLINK_EXT_ACK, NETLINK_NO_ENOBUFS and SO_RCVBUF; N3, an
 * unbound NETLINK_GENERIC socket; N4, NETLINK_ROUTE connected to N2's port.
 * Verifies: port ids, groups (NETLINK_LIST_MEMBERSHIPS), options, N4's
 * peer, N3 still unbound, and that N2 still talks to the kernel (an
 * RTM_GETLINK dump gets an answer for the loopback device).
 */
#include "ferry_test.h"
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <sys/socket.h>

#ifndef SOL_NETLINK
#define SOL_NETLINK 270
#endif

static struct sockaddr_nl name_of(int fd, int peer)
{
	struct sockaddr_nl a = { 0 };
	socklen_t l = sizeof a;
	if (peer)
		getpeername(fd, (struct sockaddr *)&a, &l);
	else
		getsockname(fd, (struct sockaddr *)&a, &l);
	return a;
}

static int opt(int fd, int level, int name)
{
	int v = -1;
	socklen_t l = sizeof v;
	if (getsockopt(fd, level, name, &v, &l) < 0)
		return -errno;
	return v;
}

static int groups(int fd, uint32_t *words, int n)
{
	socklen_t l = (socklen_t)(sizeof(uint32_t) * (size_t)n);
	memset(words, 0, l);
	if (getsockopt(fd, SOL_NETLINK, NETLINK_LIST_MEMBERSHIPS, words, &l) < 0)
		return -errno;
	return (int)l;
}

int main(void)
{
	int n1 = FERRY_SYS(socket(AF_NETLINK, SOCK_RAW, NETLINK_ROUTE));
	struct sockaddr_nl b1 = { .nl_family = AF_NETLINK,
				  .nl_groups = (1u << (21 - 1)) | (1u << (27 - 1)) };
	FERRY_SYS(bind(n1, (struct sockaddr *)&b1, sizeof b1));
	int g34 = 34;
	FERRY_SYS(setsockopt(n1, SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, &g34, sizeof g34));
	int n2 = FERRY_SYS(socket(AF_NETLINK, SOCK_DGRAM, NETLINK_ROUTE));
	int one = 1, rb = 200000;
	FERRY_SYS(setsockopt(n2, SOL_NETLINK, NETLINK_EXT_ACK, &one, sizeof one));
	FERRY_SYS(setsockopt(n2, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one));
	FERRY_SYS(setsockopt(n2, SOL_SOCKET, SO_RCVBUF, &rb, sizeof rb));
	struct sockaddr_nl b2 = { .nl_family = AF_NETLINK,
				  .nl_pid = 0x70000000u | ((uint32_t)getpid() & 0xffffff) };
	FERRY_SYS(bind(n2, (struct sockaddr *)&b2, sizeof b2));
	int n3 = FERRY_SYS(socket(AF_NETLINK, SOCK_RAW, NETLINK_GENERIC));
	int n4 = FERRY_SYS(socket(AF_NETLINK, SOCK_RAW, NETLINK_ROUTE));
	FERRY_SYS(connect(n4, (struct sockaddr *)&b2, sizeof b2));

	struct sockaddr_nl a1 = name_of(n1, 0), a4 = name_of(n4, 0);
	uint32_t g1[4];
	int g1len = groups(n1, g1, 4);
	int rcv = opt(n2, SOL_SOCKET, SO_RCVBUF);
	int before[64];
	int nbefore = ferry_list_fds(before, 64);

	ferry_ready();
	ferry_wait_go();
	ferry_check_fds_same(before, nbefore);

	struct sockaddr_nl now = name_of(n1, 0);
	FERRY_CHECK_EQ("N1 port", a1.nl_pid, now.nl_pid);
	FERRY_CHECK_EQ_HEX("N1 group mask", b1.nl_groups, now.nl_groups);
	uint32_t g[4];
	FERRY_CHECK_EQ("N1 membership bytes", g1len, groups(n1, g, 4));
	FERRY_CHECK_MEM("N1 groups", g1, g, sizeof g);
	FERRY_CHECK(g[1] & (1u << (34 - 33)), "N1 left group 34");
	FERRY_CHECK_EQ("N1 protocol", NETLINK_ROUTE, opt(n1, SOL_SOCKET, SO_PROTOCOL));
	FERRY_CHECK_EQ("N1 type", SOCK_RAW, opt(n1, SOL_SOCKET, SO_TYPE));
	FERRY_CHECK_EQ("N2 port", b2.nl_pid, name_of(n2, 0).nl_pid);
	FERRY_CHECK_EQ("N2 type", SOCK_DGRAM, opt(n2, SOL_SOCKET, SO_TYPE));
	FERRY_CHECK_EQ("N2 NETLINK_EXT_ACK", 1, opt(n2, SOL_NETLINK, NETLINK_EXT_ACK));
	FERRY_CHECK_EQ("N2 NETLINK_NO_ENOBUFS", 1, opt(n2, SOL_NETLINK, NETLINK_NO_ENOBUFS));
	FERRY_CHECK_EQ("N2 NETLINK_PKTINFO", 0, opt(n2, SOL_NETLINK, NETLINK_PKTINFO));
	FERRY_CHECK_EQ("N2 SO_RCVBUF", rcv, opt(n2, SOL_SOCKET, SO_RCVBUF));
	FERRY_CHECK_EQ("N3 unbound", 0, name_of(n3, 0).nl_pid);
	FERRY_CHECK_EQ("N3 protocol", NETLINK_GENERIC, opt(n3, SOL_SOCKET, SO_PROTOCOL));
	FERRY_CHECK_EQ("N4 port", a4.nl_pid, name_of(n4, 0).nl_pid);
	FERRY_CHECK_EQ("N4 peer", b2.nl_pid, name_of(n4, 1).nl_pid);

	/* N2 still talks to the kernel: a dump of links names the loopback device. */
	struct {
		struct nlmsghdr h;
		struct ifinfomsg i;
	} req = { .h = { .nlmsg_len = sizeof req,
			 .nlmsg_type = RTM_GETLINK,
			 .nlmsg_flags = NLM_F_REQUEST | NLM_F_DUMP,
			 .nlmsg_seq = 7 },
		  .i = { .ifi_family = AF_UNSPEC } };
	struct sockaddr_nl kernel = { .nl_family = AF_NETLINK };
	FERRY_CHECK_EQ("N2 sends", (long)sizeof req,
		       sendto(n2, &req, sizeof req, 0, (struct sockaddr *)&kernel, sizeof kernel));
	static char buf[1 << 16];
	struct timeval tv = { 2, 0 };
	setsockopt(n2, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	ssize_t n = recv(n2, buf, sizeof buf, 0);
	FERRY_CHECK(n > (ssize_t)sizeof(struct nlmsghdr), "no answer to RTM_GETLINK (%zd)", n);
	if (n > 0) {
		struct nlmsghdr *h = (struct nlmsghdr *)buf;
		FERRY_CHECK_EQ("answer's sequence", 7, (int)h->nlmsg_seq);
		FERRY_CHECK_EQ("answer's port", b2.nl_pid, h->nlmsg_pid);
		FERRY_CHECK(memmem(buf, (size_t)n, "lo", 3) != NULL, "no loopback device in the dump");
	}
	ferry_finish();
}
