/*
 * fd_epoll: an epoll instance and its interest list.
 *
 * Sets up epoll E watching: pipe P1's read end (EPOLLIN|EPOLLET,
 * data.u64 = 0x1111222233334444), an eventfd (EPOLLIN|EPOLLOUT, data.fd),
 * pipe P2's read end (EPOLLIN|EPOLLONESHOT, data.u64 = 0x3333), which has
 * already fired once and is therefore disarmed.
 * Verifies: the "tfd/events/data" lines of E's fdinfo are unchanged, and
 * epoll_wait behaves: the eventfd is reported writable with its data; data
 * in P1 is reported once with its data (edge-triggered: not again without
 * new data); P2 reports nothing until re-armed with EPOLL_CTL_MOD.
 */
#include "ferry_test.h"
#include <sys/epoll.h>
#include <sys/eventfd.h>

/* The "tfd: N events: X data: Y" parts of the fdinfo, in increasing tfd order:
 * the kernel lists items in the order of their struct file's address, which
 * no restore can reproduce (and no program can observe except here). */
static void interest(int epfd, char *out, size_t size)
{
	char buf[4096], path[64];
	snprintf(path, sizeof path, "/proc/self/fdinfo/%d", epfd);
	out[0] = 0;
	if (ferry_read_file(path, buf, sizeof buf) < 0)
		return;
	for (int want = 0; want < 1024; want++) {
		for (char *line = buf; line && *line;) {
			char *nl = strchr(line, '\n');
			int tfd;
			unsigned events;
			unsigned long long data;
			if (sscanf(line, "tfd: %d events: %x data: %llx", &tfd, &events, &data) == 3 &&
			    tfd == want)
				snprintf(out + strlen(out), size - strlen(out), "tfd %d events %x data %llx; ",
					 tfd, events, data);
			line = nl ? nl + 1 : NULL;
		}
	}
}

static int wait_one(int ep, struct epoll_event *ev)
{
	return epoll_wait(ep, ev, 1, 0);
}

int main(void)
{
	int p1[2], p2[2];
	FERRY_SYS(pipe(p1));
	FERRY_SYS(pipe(p2));
	int efd = FERRY_SYS(eventfd(0, EFD_NONBLOCK));
	int ep = FERRY_SYS(epoll_create1(0));
	struct epoll_event ev = { .events = EPOLLIN | EPOLLET, .data.u64 = 0x1111222233334444ull };
	FERRY_SYS(epoll_ctl(ep, EPOLL_CTL_ADD, p1[0], &ev));
	ev = (struct epoll_event){ .events = EPOLLIN | EPOLLOUT, .data.fd = efd };
	FERRY_SYS(epoll_ctl(ep, EPOLL_CTL_ADD, efd, &ev));
	ev = (struct epoll_event){ .events = EPOLLIN | EPOLLONESHOT, .data.u64 = 0x3333 };
	FERRY_SYS(epoll_ctl(ep, EPOLL_CTL_ADD, p2[0], &ev));
	/* Drain: the eventfd is writable (level), fire P2's one-shot. */
	FERRY_SYS(write(p2[1], "1", 1));
	struct epoll_event evs[8];
	int n = epoll_wait(ep, evs, 8, 1000);
	if (n != 2)
		ferry_die("setup epoll_wait gave %d events", n);
	char buf[16];
	FERRY_SYS(read(p2[0], buf, 1));
	char before[1024];
	interest(ep, before, sizeof before);

	ferry_ready();
	ferry_wait_go();

	char now[1024];
	interest(ep, now, sizeof now);
	FERRY_CHECK_EQ_STR("epoll interest list", before, now);
	n = wait_one(ep, &ev);
	FERRY_CHECK_EQ("events when idle (eventfd writable)", 1, n);
	if (n == 1) {
		FERRY_CHECK_EQ_HEX("eventfd events", EPOLLOUT, ev.events);
		FERRY_CHECK_EQ("eventfd data.fd", efd, ev.data.fd);
	}
	ev = (struct epoll_event){ .events = EPOLLIN | EPOLLET, .data.u64 = 0x1111222233334444ull };
	epoll_ctl(ep, EPOLL_CTL_DEL, efd, NULL);
	FERRY_CHECK_EQ("write P1", 1, write(p1[1], "x", 1));
	FERRY_CHECK_EQ("write P2", 1, write(p2[1], "y", 1));
	n = wait_one(ep, &ev);
	FERRY_CHECK_EQ("events after writing P1 and P2 (P2 disarmed)", 1, n);
	if (n == 1) {
		FERRY_CHECK_EQ_HEX("P1 events", EPOLLIN, ev.events);
		FERRY_CHECK_EQ_HEX("P1 data", 0x1111222233334444ull, ev.data.u64);
	}
	FERRY_CHECK_EQ("edge-triggered P1 not reported again", 0, wait_one(ep, &ev));
	ev = (struct epoll_event){ .events = EPOLLIN | EPOLLONESHOT, .data.u64 = 0x3333 };
	FERRY_CHECK_EQ("EPOLL_CTL_MOD P2", 0, epoll_ctl(ep, EPOLL_CTL_MOD, p2[0], &ev));
	n = wait_one(ep, &ev);
	FERRY_CHECK_EQ("events after re-arming P2", 1, n);
	if (n == 1)
		FERRY_CHECK_EQ_HEX("P2 data", 0x3333, ev.data.u64);
	ferry_finish();
}
