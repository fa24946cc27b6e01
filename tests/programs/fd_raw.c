/*
 * fd_raw: raw IP sockets.
 *
 * Sets up R1, IPv4 raw of protocol 253 (reserved for experiments: no
 * traffic here) bound to 127.0.0.1, with IP_TOS; R2, the same protocol,
 * connected to 127.0.0.1; I, raw ICMP with an ICMP_FILTER that lets only
 * echo replies through; H, IPPROTO_RAW (IP_HDRINCL); R6, IPv6 raw of
 * protocol 253 bound to ::1 with IPV6_CHECKSUM at offset 2.
 * Verifies: names, protocols and options read back the same, R2 still
 * sends without an address (getpeername does not work on raw sockets) and
 * its packet reaches R1 (with its IP header), and R6 receives its own packet,
 * whose checksum the kernel computed and checked at offset 2.
 */
#include "ferry_test.h"
#include <arpa/inet.h>
#include <linux/icmp.h>
#include <netinet/in.h>
#include <netinet/ip.h>
#include <sys/socket.h>

#define PROTO 253

static int opt(int fd, int level, int name)
{
	int v = -1;
	socklen_t l = sizeof v;
	if (getsockopt(fd, level, name, &v, &l) < 0)
		return -errno;
	return v;
}

int main(void)
{
	struct sockaddr_in lo = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	int r1 = FERRY_SYS(socket(AF_INET, SOCK_RAW, PROTO));
	FERRY_SYS(bind(r1, (struct sockaddr *)&lo, sizeof lo));
	int tos = 0x08;
	FERRY_SYS(setsockopt(r1, IPPROTO_IP, IP_TOS, &tos, sizeof tos));
	int r2 = FERRY_SYS(socket(AF_INET, SOCK_RAW, PROTO));
	FERRY_SYS(connect(r2, (struct sockaddr *)&lo, sizeof lo));
	int ic = FERRY_SYS(socket(AF_INET, SOCK_RAW, IPPROTO_ICMP));
	struct icmp_filter flt = { .data = ~(1u << ICMP_ECHOREPLY) };
	FERRY_SYS(setsockopt(ic, SOL_RAW, ICMP_FILTER, &flt, sizeof flt));
	int h = FERRY_SYS(socket(AF_INET, SOCK_RAW, IPPROTO_RAW));
	int r6 = FERRY_SYS(socket(AF_INET6, SOCK_RAW, PROTO));
	struct sockaddr_in6 lo6 = { .sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT };
	FERRY_SYS(bind(r6, (struct sockaddr *)&lo6, sizeof lo6));
	int csum = 2;
	FERRY_SYS(setsockopt(r6, IPPROTO_IPV6, IPV6_CHECKSUM, &csum, sizeof csum));
	int before[64];
	int nbefore = ferry_list_fds(before, 64);

	ferry_ready();
	ferry_wait_go();
	ferry_check_fds_same(before, nbefore);

	struct sockaddr_in a = { 0 };
	socklen_t l = sizeof a;
	FERRY_CHECK_EQ("getsockname(R1)", 0, getsockname(r1, (struct sockaddr *)&a, &l));
	FERRY_CHECK_EQ_HEX("R1 address", htonl(INADDR_LOOPBACK), a.sin_addr.s_addr);
	FERRY_CHECK_EQ("R1 protocol", PROTO, opt(r1, SOL_SOCKET, SO_PROTOCOL));
	FERRY_CHECK_EQ("R1 type", SOCK_RAW, opt(r1, SOL_SOCKET, SO_TYPE));
	FERRY_CHECK_EQ("R1 IP_TOS", tos, opt(r1, IPPROTO_IP, IP_TOS));
	FERRY_CHECK_EQ("R1 IP_HDRINCL", 0, opt(r1, IPPROTO_IP, IP_HDRINCL));
	struct icmp_filter got = { 0 };
	l = sizeof got;
	FERRY_CHECK_EQ("I ICMP_FILTER", 0, getsockopt(ic, SOL_RAW, ICMP_FILTER, &got, &l));
	FERRY_CHECK_EQ_HEX("I filter", flt.data, got.data);
	FERRY_CHECK_EQ("I protocol", IPPROTO_ICMP, opt(ic, SOL_SOCKET, SO_PROTOCOL));
	FERRY_CHECK_EQ("H IP_HDRINCL", 1, opt(h, IPPROTO_IP, IP_HDRINCL));
	FERRY_CHECK_EQ("H protocol", IPPROTO_RAW, opt(h, SOL_SOCKET, SO_PROTOCOL));
	FERRY_CHECK_EQ("R6 IPV6_CHECKSUM", 2, opt(r6, IPPROTO_IPV6, IPV6_CHECKSUM));

	struct timeval tv = { 2, 0 };
	setsockopt(r1, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	setsockopt(r6, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	FERRY_CHECK_EQ("R2 sends", 5, send(r2, "hello", 5, 0));
	char buf[256] = "";
	ssize_t n = recv(r1, buf, sizeof buf, 0);
	FERRY_CHECK_EQ("R1 receives header and data", (long)(sizeof(struct iphdr) + 5), (long)n);
	if (n == (ssize_t)(sizeof(struct iphdr) + 5)) {
		struct iphdr *ip = (struct iphdr *)buf;
		FERRY_CHECK_EQ("packet's protocol", PROTO, ip->protocol);
		FERRY_CHECK_MEM("packet's data", "hello", buf + sizeof *ip, 5);
	}
	char out[8] = { 'a', 'b', 0, 0, 'c', 'd', 'e', 'f' };
	FERRY_CHECK_EQ("R6 sends", 8,
		       sendto(r6, out, sizeof out, 0, (struct sockaddr *)&lo6, sizeof lo6));
	memset(buf, 0, sizeof buf);
	n = recv(r6, buf, sizeof buf, 0);
	FERRY_CHECK_EQ("R6 receives its packet", 8, (long)n);
	FERRY_CHECK(n == 8 && memcmp(buf, "ab", 2) == 0 && memcmp(buf + 4, "cdef", 4) == 0,
		    "R6's packet differs");
	FERRY_CHECK(n == 8 && (buf[2] || buf[3]), "no checksum at offset 2");
	ferry_finish();
}
