/*
 * fd_packet_ring_v3: a packet socket with a TPACKET_V3 receive ring, mapped.
 *
 * Sets up P, SOCK_RAW for EtherType 0x88b9 bound to the loopback interface,
 * with a TPACKET_V3 receive ring of 4 blocks of 4096 bytes (blocks retired
 * after 10 ms).  The kernel has gone once around the ring: blocks 0-2 were
 * each retired with one frame and given back; block 3 (one frame) and block
 * 0 again (three frames) are retired and unread; block 1 is the one the
 * kernel fills next (sequence number 6, empty).
 * Verifies: blocks 3 and 0 are still the program's, with their frames and
 * sequence numbers (4 and 5); given back, the next two frames fill block 1
 * (sequence number 6), and the kernel then opens block 2 (sequence number 7).
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
static int lo, sender;

static struct tpacket_block_desc *block(int i)
{
	return (struct tpacket_block_desc *)(ring + i * BLOCK);
}

static volatile __u32 *block_status(int i)
{
	return (volatile __u32 *)&block(i)->hdr.bh1.block_status;
}

static void send_frame(int i)
{
	unsigned char buf[64] = { 0 };
	buf[12] = ETYPE >> 8;
	buf[13] = ETYPE & 0xff;
	int n = ETH_HLEN + snprintf((char *)buf + ETH_HLEN, 32, "v3-frame-%d", i);
	struct sockaddr_ll to = { .sll_family = AF_PACKET, .sll_protocol = htons(ETYPE), .sll_ifindex = lo, .sll_halen = 6 };
	if (sendto(sender, buf, n, 0, (struct sockaddr *)&to, sizeof to) != n)
		ferry_die("send frame %d: %s", i, strerror(errno));
}

/* Block b is retired, with `n` frames, sequence number `seq`, the first frame `first`. */
static void check_block(const char *when, int b, int n, int seq, int first)
{
	char label[96], text[32];
	snprintf(label, sizeof label, "%s: block %d is the program's", when, b);
	FERRY_CHECK_EQ(label, TP_STATUS_USER, *block_status(b) & TP_STATUS_USER);
	snprintf(label, sizeof label, "%s: block %d's frames", when, b);
	FERRY_CHECK_EQ(label, n, block(b)->hdr.bh1.num_pkts);
	snprintf(label, sizeof label, "%s: block %d's sequence number", when, b);
	FERRY_CHECK_EQ(label, seq, block(b)->hdr.bh1.seq_num);
	struct tpacket3_hdr *f = (struct tpacket3_hdr *)((char *)block(b) + block(b)->hdr.bh1.offset_to_first_pkt);
	snprintf(text, sizeof text, "v3-frame-%d", first);
	snprintf(label, sizeof label, "%s: block %d's first frame", when, b);
	FERRY_CHECK_MEM(label, text, (char *)f + f->tp_mac + ETH_HLEN, strlen(text));
}

static void retire(int b, int frames, int *next)
{
	for (int i = 0; i < frames; i++)
		send_frame((*next)++);
	if (!FERRY_WAIT_UNTIL(*block_status(b) & TP_STATUS_USER, 2000))
		ferry_die("block %d was not retired", b);
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
	sender = FERRY_SYS(socket(AF_PACKET, SOCK_RAW, 0));
	int next = 0;
	for (int i = 0; i < 3; i++) {
		retire(i, 1, &next);
		*block_status(i) = TP_STATUS_KERNEL;
	}
	retire(3, 1, &next);
	retire(0, 3, &next);
	/* Block 1 is open (its timer sees it empty). */
	if (!FERRY_WAIT_UNTIL(block(1)->hdr.bh1.seq_num == 6, 2000))
		ferry_die("block 1 was not opened");
	check_block("before", 3, 1, 4, 3);
	check_block("before", 0, 3, 5, 4);
	int before[64];
	int nbefore = ferry_list_fds(before, 64);

	ferry_ready();
	ferry_wait_go();
	ferry_check_fds_same(before, nbefore);
	ferry_check_map("the ring", ring, BLOCK * BLOCKS, "rw-s");
	check_block("after", 3, 1, 4, 3);
	check_block("after", 0, 3, 5, 4);
	FERRY_CHECK_EQ("after: block 1 is the kernel's", 0, *block_status(1));
	FERRY_CHECK_EQ("after: block 1 is empty", 0, block(1)->hdr.bh1.num_pkts);
	*block_status(3) = TP_STATUS_KERNEL;
	*block_status(0) = TP_STATUS_KERNEL;
	next = 7;
	send_frame(7);
	send_frame(8);
	FERRY_CHECK(FERRY_WAIT_UNTIL(*block_status(1) & TP_STATUS_USER, 2000), "block 1 was not retired");
	check_block("after", 1, 2, 6, 7);
	FERRY_CHECK(FERRY_WAIT_UNTIL(block(2)->hdr.bh1.seq_num == 7, 2000), "block 2 was not opened as number 7 (it is %llu)",
		    (unsigned long long)block(2)->hdr.bh1.seq_num);
	ferry_finish();
}
