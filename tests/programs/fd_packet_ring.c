/*
 * fd_packet_ring: a packet socket with a receive and a transmit ring
 * (TPACKET_V2, PACKET_RX_RING and PACKET_TX_RING, mapped) and memberships
 * (PACKET_ADD_MEMBERSHIP).
 *
 * Sets up P, SOCK_RAW for EtherType 0x88b7 bound to the loopback interface,
 * with both rings (8 frames of 2048 bytes each) mapped at one address, a
 * multicast membership of lo taken twice (group A), another once (group B)
 * and a promiscuous one.  Five frames
 * are received into the ring; the program consumes the first two (gives
 * them back to the kernel) and leaves three unread.  The transmit ring has
 * sent two frames (EtherType 0x88b8) and holds a third waiting to be sent.
 * Verifies: the ring is mapped at the same address, the three unread frames
 * are still the program's with their contents, the two consumed ones the
 * kernel's; the next frames received land in frames 5 and 6 (the kernel
 * goes on where it was); the waiting transmit frame is sent by the next
 * send() and then a fourth from frame 3 (a receiver sees both, in order);
 * the memberships are there (lo has both groups; A stays after one drop and
 * goes after the second; B goes after one).
 */
#include "ferry_test.h"
#include <arpa/inet.h>
#include <linux/if_packet.h>
#include <net/ethernet.h>
#include <net/if.h>
#include <sys/mman.h>
#include <sys/socket.h>

#define ETYPE 0x88b7
#define TX_ETYPE 0x88b8
#define BLOCK 4096
#define BLOCKS 4
#define FSIZE 2048
#define FRAMES 8
#define RING (BLOCK * BLOCKS)

static unsigned char *ring;
static int lo;

static struct tpacket2_hdr *rx_frame(int i)
{
	return (struct tpacket2_hdr *)(ring + i * FSIZE);
}

static struct tpacket2_hdr *tx_frame(int i)
{
	return (struct tpacket2_hdr *)(ring + RING + i * FSIZE);
}

static volatile __u32 *status(struct tpacket2_hdr *h)
{
	return (volatile __u32 *)&h->tp_status;
}

/* An Ethernet frame of EtherType `type` whose payload is `text`. */
static int make_frame(unsigned char *buf, int type, const char *text)
{
	memset(buf, 0, ETH_HLEN);
	buf[12] = type >> 8;
	buf[13] = type & 0xff;
	int n = (int)strlen(text);
	memcpy(buf + ETH_HLEN, text, n);
	return ETH_HLEN + n;
}

static void send_rx(int s, int i)
{
	unsigned char buf[64];
	char text[32];
	snprintf(text, sizeof text, "rx-frame-%d", i);
	int n = make_frame(buf, ETYPE, text);
	struct sockaddr_ll to = { .sll_family = AF_PACKET, .sll_protocol = htons(ETYPE), .sll_ifindex = lo, .sll_halen = 6 };
	if (sendto(s, buf, n, 0, (struct sockaddr *)&to, sizeof to) != n)
		ferry_die("send frame %d: %s", i, strerror(errno));
}

static void fill_tx(int i)
{
	char text[32];
	snprintf(text, sizeof text, "tx-frame-%d", i);
	struct tpacket2_hdr *h = tx_frame(i);
	h->tp_len = make_frame((unsigned char *)h + 32, TX_ETYPE, text);
	__sync_synchronize();
	*status(h) = TP_STATUS_SEND_REQUEST;
}

static void check_rx(const char *what, int i, __u32 want_user)
{
	char text[32], label[64];
	snprintf(text, sizeof text, "rx-frame-%d", i);
	struct tpacket2_hdr *h = rx_frame(i);
	snprintf(label, sizeof label, "%s: frame %d is the program's", what, i);
	FERRY_CHECK_EQ(label, want_user, *status(h) & TP_STATUS_USER);
	snprintf(label, sizeof label, "%s: frame %d's length", what, i);
	FERRY_CHECK_EQ(label, (long)(ETH_HLEN + strlen(text)), (long)h->tp_len);
	snprintf(label, sizeof label, "%s: frame %d's payload", what, i);
	FERRY_CHECK_MEM(label, text, (char *)h + h->tp_mac + ETH_HLEN, strlen(text));
}

static int mc(int s, int op, int type, const unsigned char *addr)
{
	struct packet_mreq m = { .mr_ifindex = lo, .mr_type = type };
	if (addr) {
		m.mr_alen = 6;
		memcpy(m.mr_address, addr, 6);
	}
	return setsockopt(s, SOL_PACKET, op, &m, sizeof m) < 0 ? -errno : 0;
}

/* Whether lo has multicast address `hex` (/proc/net/dev_mcast). */
static int has_group(const char *hex)
{
	char buf[4096];
	int fd = open("/proc/net/dev_mcast", O_RDONLY);
	if (fd < 0)
		return -errno;
	ssize_t n = read(fd, buf, sizeof buf - 1);
	close(fd);
	buf[n > 0 ? n : 0] = 0;
	for (char *l = buf; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL) {
		char name[32], addr[80];
		int idx, users, global;
		if (sscanf(l, "%d %31s %d %d %79s", &idx, name, &users, &global, addr) == 5 &&
		    !strcmp(name, "lo") && !strcmp(addr, hex))
			return 1;
	}
	return 0;
}

int main(void)
{
	static const unsigned char group_a[6] = { 0x01, 0x00, 0x5e, 0x7f, 0x00, 0x01 };
	static const unsigned char group_b[6] = { 0x01, 0x00, 0x5e, 0x7f, 0x00, 0x02 };
	lo = (int)if_nametoindex("lo");
	if (lo <= 0)
		ferry_die("no loopback interface");
	int p = FERRY_SYS(socket(AF_PACKET, SOCK_RAW, htons(ETYPE)));
	struct sockaddr_ll b = { .sll_family = AF_PACKET, .sll_protocol = htons(ETYPE), .sll_ifindex = lo };
	FERRY_SYS(bind(p, (struct sockaddr *)&b, sizeof b));
	int v2 = TPACKET_V2;
	FERRY_SYS(setsockopt(p, SOL_PACKET, PACKET_VERSION, &v2, sizeof v2));
	struct tpacket_req req = { BLOCK, BLOCKS, FSIZE, FRAMES };
	FERRY_SYS(setsockopt(p, SOL_PACKET, PACKET_RX_RING, &req, sizeof req));
	FERRY_SYS(setsockopt(p, SOL_PACKET, PACKET_TX_RING, &req, sizeof req));
	ring = FERRY_PTR(mmap(NULL, 2 * RING, PROT_READ | PROT_WRITE, MAP_SHARED, p, 0));
	if (mc(p, PACKET_ADD_MEMBERSHIP, PACKET_MR_MULTICAST, group_a) || mc(p, PACKET_ADD_MEMBERSHIP, PACKET_MR_MULTICAST, group_a) ||
	    mc(p, PACKET_ADD_MEMBERSHIP, PACKET_MR_MULTICAST, group_b) || mc(p, PACKET_ADD_MEMBERSHIP, PACKET_MR_PROMISC, NULL))
		ferry_die("PACKET_ADD_MEMBERSHIP: %s", strerror(errno));

	int s = FERRY_SYS(socket(AF_PACKET, SOCK_RAW, 0));
	for (int i = 0; i < 5; i++)
		send_rx(s, i);
	if (!FERRY_WAIT_UNTIL(*status(rx_frame(4)) & TP_STATUS_USER, 2000))
		ferry_die("frame 4 did not arrive in the receive ring");
	for (int i = 0; i < 5; i++)
		check_rx("before", i, TP_STATUS_USER);
	*status(rx_frame(0)) = TP_STATUS_KERNEL;
	*status(rx_frame(1)) = TP_STATUS_KERNEL;
	fill_tx(0);
	fill_tx(1);
	FERRY_SYS(send(p, NULL, 0, 0));
	if (!FERRY_WAIT_UNTIL(*status(tx_frame(1)) == TP_STATUS_AVAILABLE, 2000))
		ferry_die("transmit frame 1 was not sent");
	fill_tx(2);
	close(s);
	int before[64];
	int nbefore = ferry_list_fds(before, 64);

	ferry_ready();
	ferry_wait_go();
	ferry_check_fds_same(before, nbefore);
	ferry_check_map("the rings", ring, 2 * RING, "rw-s");

	check_rx("after", 2, TP_STATUS_USER);
	check_rx("after", 3, TP_STATUS_USER);
	check_rx("after", 4, TP_STATUS_USER);
	FERRY_CHECK_EQ("after: frame 0 is the kernel's", 0, *status(rx_frame(0)));
	FERRY_CHECK_EQ("after: frame 1 is the kernel's", 0, *status(rx_frame(1)));
	FERRY_CHECK_EQ("after: transmit frame 2 waits", TP_STATUS_SEND_REQUEST, *status(tx_frame(2)));
	for (int i = 2; i < 5; i++)
		*status(rx_frame(i)) = TP_STATUS_KERNEL;

	s = FERRY_SYS(socket(AF_PACKET, SOCK_RAW, 0));
	send_rx(s, 5);
	send_rx(s, 6);
	FERRY_CHECK(FERRY_WAIT_UNTIL(*status(rx_frame(6)) & TP_STATUS_USER, 2000), "frame 6 did not arrive in the receive ring");
	check_rx("after", 5, TP_STATUS_USER);
	check_rx("after", 6, TP_STATUS_USER);
	FERRY_CHECK_EQ("after: frame 7 is still the kernel's", 0, *status(rx_frame(7)));

	int r = FERRY_SYS(socket(AF_PACKET, SOCK_RAW, htons(TX_ETYPE)));
	struct sockaddr_ll rb = { .sll_family = AF_PACKET, .sll_protocol = htons(TX_ETYPE), .sll_ifindex = lo };
	FERRY_SYS(bind(r, (struct sockaddr *)&rb, sizeof rb));
	struct timeval tv = { 2, 0 };
	setsockopt(r, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	FERRY_CHECK_EQ("send() from the transmit ring", 0L, (long)send(p, NULL, 0, 0) < 0 ? -errno : 0L);
	fill_tx(3);
	FERRY_CHECK_EQ("send() from the transmit ring again", 0L, (long)send(p, NULL, 0, 0) < 0 ? -errno : 0L);
	for (int i = 2; i < 4; i++) {
		char buf[256] = "", text[32], label[64];
		snprintf(text, sizeof text, "tx-frame-%d", i);
		snprintf(label, sizeof label, "transmit frame %d is received", i);
		FERRY_CHECK_EQ(label, (long)(ETH_HLEN + strlen(text)), (long)recv(r, buf, sizeof buf, 0));
		FERRY_CHECK_MEM(label, text, buf + ETH_HLEN, strlen(text));
	}
	FERRY_CHECK_EQ("transmit frame 3 is sent", TP_STATUS_AVAILABLE, *status(tx_frame(3)));

	FERRY_CHECK_EQ("lo has group A", 1, has_group("01005e7f0001"));
	FERRY_CHECK_EQ("lo has group B", 1, has_group("01005e7f0002"));
	FERRY_CHECK_EQ("drop group A", 0, mc(p, PACKET_DROP_MEMBERSHIP, PACKET_MR_MULTICAST, group_a));
	FERRY_CHECK_EQ("lo still has group A (its membership was taken twice)", 1, has_group("01005e7f0001"));
	FERRY_CHECK_EQ("drop group A again", 0, mc(p, PACKET_DROP_MEMBERSHIP, PACKET_MR_MULTICAST, group_a));
	FERRY_CHECK_EQ("lo no longer has group A", 0, has_group("01005e7f0001"));
	FERRY_CHECK_EQ("drop group B", 0, mc(p, PACKET_DROP_MEMBERSHIP, PACKET_MR_MULTICAST, group_b));
	FERRY_CHECK_EQ("lo no longer has group B", 0, has_group("01005e7f0002"));
	FERRY_CHECK_EQ("drop the promiscuous membership", 0, mc(p, PACKET_DROP_MEMBERSHIP, PACKET_MR_PROMISC, NULL));
	ferry_finish();
}
