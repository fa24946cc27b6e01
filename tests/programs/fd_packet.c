/*
 * fd_packet: packet sockets (AF_PACKET), without rings.
 *
 * Sets up P1, SOCK_RAW for EtherType 0x88b5 (reserved for local
 * experiments: no traffic here) bound to the loopback interface, with
 * PACKET_AUXDATA, PACKET_VERSION (TPACKET_V2) and PACKET_IGNORE_OUTGOING;
 * P2, SOCK_DGRAM for the same EtherType on every interface, in a fanout
 * group of its own (PACKET_FANOUT_HASH); P3, SOCK_RAW of protocol 0 (bound
 * to nothing: it takes no packets).
 * Verifies: type, protocol, bound interface and protocol (getsockname),
 * options and fanout read back the same, and a frame P1 sends on the
 * loopback interface reaches P2 (without its Ethernet header) and P1 (with
 * it).
 */
#include "ferry_test.h"
#include <arpa/inet.h>
#include <linux/if_packet.h>
#include <net/ethernet.h>
#include <net/if.h>
#include <sys/socket.h>

#define ETYPE 0x88b5

static int opt(int fd, int level, int name)
{
	int v = -1;
	socklen_t l = sizeof v;
	if (getsockopt(fd, level, name, &v, &l) < 0)
		return -errno;
	return v;
}

static struct sockaddr_ll name_of(int fd)
{
	struct sockaddr_ll a = { 0 };
	socklen_t l = sizeof a;
	getsockname(fd, (struct sockaddr *)&a, &l);
	return a;
}

int main(void)
{
	int lo = (int)if_nametoindex("lo");
	if (lo <= 0)
		ferry_die("no loopback interface");
	int p1 = FERRY_SYS(socket(AF_PACKET, SOCK_RAW, htons(ETYPE)));
	struct sockaddr_ll b1 = { .sll_family = AF_PACKET, .sll_protocol = htons(ETYPE), .sll_ifindex = lo };
	FERRY_SYS(bind(p1, (struct sockaddr *)&b1, sizeof b1));
	int one = 1, v2 = TPACKET_V2;
	FERRY_SYS(setsockopt(p1, SOL_PACKET, PACKET_AUXDATA, &one, sizeof one));
	FERRY_SYS(setsockopt(p1, SOL_PACKET, PACKET_VERSION, &v2, sizeof v2));
	FERRY_SYS(setsockopt(p1, SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof one));
	int p2 = FERRY_SYS(socket(AF_PACKET, SOCK_DGRAM, htons(ETYPE)));
	int fan = (getpid() & 0xffff) | (PACKET_FANOUT_HASH << 16);
	FERRY_SYS(setsockopt(p2, SOL_PACKET, PACKET_FANOUT, &fan, sizeof fan));
	int p3 = FERRY_SYS(socket(AF_PACKET, SOCK_RAW, 0));
	int before[64];
	int nbefore = ferry_list_fds(before, 64);

	ferry_ready();
	ferry_wait_go();
	ferry_check_fds_same(before, nbefore);

	struct sockaddr_ll a1 = name_of(p1), a2 = name_of(p2), a3 = name_of(p3);
	FERRY_CHECK_EQ("P1 interface", lo, a1.sll_ifindex);
	FERRY_CHECK_EQ_HEX("P1 protocol", htons(ETYPE), a1.sll_protocol);
	FERRY_CHECK_EQ("P1 type", SOCK_RAW, opt(p1, SOL_SOCKET, SO_TYPE));
	FERRY_CHECK_EQ("P1 PACKET_AUXDATA", 1, opt(p1, SOL_PACKET, PACKET_AUXDATA));
	FERRY_CHECK_EQ("P1 PACKET_VERSION", TPACKET_V2, opt(p1, SOL_PACKET, PACKET_VERSION));
	FERRY_CHECK_EQ("P1 PACKET_IGNORE_OUTGOING", 1, opt(p1, SOL_PACKET, PACKET_IGNORE_OUTGOING));
	FERRY_CHECK_EQ("P2 interface", 0, a2.sll_ifindex);
	FERRY_CHECK_EQ_HEX("P2 protocol", htons(ETYPE), a2.sll_protocol);
	FERRY_CHECK_EQ("P2 type", SOCK_DGRAM, opt(p2, SOL_SOCKET, SO_TYPE));
	FERRY_CHECK_EQ_HEX("P2 fanout", fan, opt(p2, SOL_PACKET, PACKET_FANOUT));
	FERRY_CHECK_EQ("P3 protocol", 0, a3.sll_protocol);
	FERRY_CHECK_EQ("P3 PACKET_AUXDATA", 0, opt(p3, SOL_PACKET, PACKET_AUXDATA));

	unsigned char frame[ETH_HLEN + 5] = { 0 };
	frame[12] = ETYPE >> 8;
	frame[13] = ETYPE & 0xff;
	memcpy(frame + ETH_HLEN, "hello", 5);
	struct sockaddr_ll to = { .sll_family = AF_PACKET, .sll_protocol = htons(ETYPE), .sll_ifindex = lo };
	FERRY_CHECK_EQ("P1 sends a frame", (long)sizeof frame,
		       sendto(p1, frame, sizeof frame, 0, (struct sockaddr *)&to, sizeof to));
	struct timeval tv = { 2, 0 };
	setsockopt(p1, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	setsockopt(p2, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	char buf[256] = "";
	FERRY_CHECK_EQ("P2 receives the payload", 5, recv(p2, buf, sizeof buf, 0));
	FERRY_CHECK_MEM("P2's payload", "hello", buf, 5);
	memset(buf, 0, sizeof buf);
	FERRY_CHECK_EQ("P1 receives the frame", (long)sizeof frame, recv(p1, buf, sizeof buf, 0));
	FERRY_CHECK_MEM("P1's frame", frame, buf, sizeof frame);
	ferry_finish();
}
