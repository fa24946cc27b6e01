/*
 * fd_packet_ring_v3: a packet socket with a TPACKET_V3 receive ring, mapped.
 *
 * Sets up P, SOCK_RAW for EtherType 0x88b9 bound to the loopback interface,
 * with a TPACKET_V3 receive ring of 4 blocks of 4096 bytes (blocks retired
 * after 10 ms), into which three frames are received (block 0, retired, is
 * the program's).
 * Verifies: block 0 is still the program's with its three frames; given
 * back, the next two frames fill block 1.
 */
#include "ferry_test.h"
#include <arpa/inet.h>
#include <linux/if_packet.h>
#include <net/ethernet.h>
#include <net/if.h>
#include <sys/mman.h>
#include <sys/socket.h>

#define ETYPE 0x88b9
#define BLOCK 4096
#define BLOCKS 4

static unsigned char *ring;
static int lo;

static struct tpacket_block_desc *block(int i)
{
	return (struct tpacket_block_desc *)(ring + i * BLOCK);
}

static volatile __u32 *block_status(int i)
{
	return (volatile __u32 *)&block(i)->hdr.bh1.block_status;
}

static void send_frame(int s, int i)
{
	unsigned char buf[64] = { 0 };
	buf[12] = ETYPE >> 8;
	buf[13] = ETYPE & 0xff;
	int n = ETH_HLEN + snprintf((char *)buf + ETH_HLEN, 32, "v3-frame-%d", i);
	struct sockaddr_ll to = { .sll_family = AF_PACKET, .sll_protocol = htons(ETYPE), .sll_ifindex = lo, .sll_halen = 6 };
	if (sendto(s, buf, n, 0, (struct sockaddr *)&to, sizeof to) != n)
		ferry_die("send frame %d: %s", i, strerror(errno));
}

int main(void)
{
	lo = (int)if_nametoindex("lo");
	if (lo <= 0)
		ferry_die("no loopback interface");
	int p = FERRY_SYS(socket(AF_PACKET, SOCK_RAW, htons(ETYPE)));
	struct sockaddr_ll b = { .sll_family = AF_PACKET, .sll_protocol = htons(ETYPE), .sll_ifindex = lo };
	FERRY_SYS(bind(p, (struct sockaddr *)&b, sizeof b));
	int v3 = TPACKET_V3;
	FERRY_SYS(setsockopt(p, SOL_PACKET, PACKET_VERSION, &v3, sizeof v3));
	struct tpacket_req3 req = { .tp_block_size = BLOCK, .tp_block_nr = BLOCKS, .tp_frame_size = 2048,
				    .tp_frame_nr = BLOCK * BLOCKS / 2048, .tp_retire_blk_tov = 10 };
	FERRY_SYS(setsockopt(p, SOL_PACKET, PACKET_RX_RING, &req, sizeof req));
	ring = FERRY_PTR(mmap(NULL, BLOCK * BLOCKS, PROT_READ | PROT_WRITE, MAP_SHARED, p, 0));
	int s = FERRY_SYS(socket(AF_PACKET, SOCK_RAW, 0));
	for (int i = 0; i < 3; i++)
		send_frame(s, i);
	if (!FERRY_WAIT_UNTIL(*block_status(0) & TP_STATUS_USER, 2000))
		ferry_die("block 0 was not retired");
	if (block(0)->hdr.bh1.num_pkts != 3)
		ferry_die("block 0 holds %u frames, not 3", block(0)->hdr.bh1.num_pkts);
	int before[64];
	int nbefore = ferry_list_fds(before, 64);

	ferry_ready();
	ferry_wait_go();
	ferry_check_fds_same(before, nbefore);
	ferry_check_map("the ring", ring, BLOCK * BLOCKS, "rw-s");
	FERRY_CHECK_EQ("block 0 is the program's", TP_STATUS_USER, *block_status(0) & TP_STATUS_USER);
	FERRY_CHECK_EQ("block 0's frames", 3, block(0)->hdr.bh1.num_pkts);
	struct tpacket3_hdr *f = (struct tpacket3_hdr *)((char *)block(0) + block(0)->hdr.bh1.offset_to_first_pkt);
	FERRY_CHECK_MEM("block 0's first frame", "v3-frame-0", (char *)f + f->tp_mac + ETH_HLEN, 10);
	*block_status(0) = TP_STATUS_KERNEL;
	send_frame(s, 3);
	send_frame(s, 4);
	FERRY_CHECK(FERRY_WAIT_UNTIL(*block_status(1) & TP_STATUS_USER, 2000), "block 1 was not retired");
	FERRY_CHECK_EQ("block 1's frames", 2, block(1)->hdr.bh1.num_pkts);
	ferry_finish();
}
