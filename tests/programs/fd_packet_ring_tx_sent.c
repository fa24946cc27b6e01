/*
 * fd_packet_ring_tx_sent: a packet socket whose transmit ring (TPACKET_V2)
 * has sent frames and has none waiting to be sent.
 *
 * Sets up P, SOCK_RAW bound to the loopback interface for EtherType 0x88ba,
 * with a transmit ring of 8 frames mapped; frames 0 and 1 are sent.
 * Verifies: the ring is mapped at the same address; frame 2, filled and
 * sent, goes out (a receiver bound to 0x88bb on lo gets it): the kernel
 * sends from frame 2 on.
 */
#include "ferry_test.h"
#include <arpa/inet.h>
#include <linux/if_packet.h>
#include <net/ethernet.h>
#include <net/if.h>
#include <sys/mman.h>
#include <sys/socket.h>

#define ETYPE 0x88ba
#define TX_ETYPE 0x88bb
#define BLOCK 4096
#define FSIZE 2048
#define FRAMES 8

static unsigned char *ring;

static struct tpacket2_hdr *tx_frame(int i)
{
	return (struct tpacket2_hdr *)(ring + i * FSIZE);
}

static void fill_tx(int i)
{
	struct tpacket2_hdr *h = tx_frame(i);
	unsigned char *d = (unsigned char *)h + 32;
	memset(d, 0, ETH_HLEN);
	d[12] = TX_ETYPE >> 8;
	d[13] = TX_ETYPE & 0xff;
	int n = snprintf((char *)d + ETH_HLEN, 32, "tx-frame-%d", i);
	h->tp_len = ETH_HLEN + n;
	__sync_synchronize();
	*(volatile __u32 *)&h->tp_status = TP_STATUS_SEND_REQUEST;
}

int main(void)
{
	int lo = (int)if_nametoindex("lo");
	if (lo <= 0)
		ferry_die("no loopback interface");
	int p = FERRY_SYS(socket(AF_PACKET, SOCK_RAW, htons(ETYPE)));
	struct sockaddr_ll b = { .sll_family = AF_PACKET, .sll_protocol = htons(ETYPE), .sll_ifindex = lo };
	FERRY_SYS(bind(p, (struct sockaddr *)&b, sizeof b));
	int v2 = TPACKET_V2;
	FERRY_SYS(setsockopt(p, SOL_PACKET, PACKET_VERSION, &v2, sizeof v2));
	struct tpacket_req req = { BLOCK, FRAMES * FSIZE / BLOCK, FSIZE, FRAMES };
	FERRY_SYS(setsockopt(p, SOL_PACKET, PACKET_TX_RING, &req, sizeof req));
	ring = FERRY_PTR(mmap(NULL, FRAMES * FSIZE, PROT_READ | PROT_WRITE, MAP_SHARED, p, 0));
	fill_tx(0);
	fill_tx(1);
	FERRY_SYS(send(p, NULL, 0, 0));
	if (!FERRY_WAIT_UNTIL(*(volatile __u32 *)&tx_frame(1)->tp_status == TP_STATUS_AVAILABLE, 2000))
		ferry_die("transmit frame 1 was not sent");
	int before[64];
	int nbefore = ferry_list_fds(before, 64);

	ferry_ready();
	ferry_wait_go();
	ferry_check_fds_same(before, nbefore);
	ferry_check_map("the ring", ring, FRAMES * FSIZE, "rw-s");
	int r = FERRY_SYS(socket(AF_PACKET, SOCK_RAW, htons(TX_ETYPE)));
	struct sockaddr_ll rb = { .sll_family = AF_PACKET, .sll_protocol = htons(TX_ETYPE), .sll_ifindex = lo };
	FERRY_SYS(bind(r, (struct sockaddr *)&rb, sizeof rb));
	struct timeval tv = { 2, 0 };
	setsockopt(r, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	fill_tx(2);
	FERRY_CHECK_EQ("send() from the transmit ring", 0L, (long)send(p, NULL, 0, 0) < 0 ? -errno : 0L);
	char buf[256] = "";
	FERRY_CHECK_EQ("transmit frame 2 is received", (long)(ETH_HLEN + 10), (long)recv(r, buf, sizeof buf, 0));
	FERRY_CHECK_MEM("transmit frame 2's payload", "tx-frame-2", buf + ETH_HLEN, 10);
	ferry_finish();
}
