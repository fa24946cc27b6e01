/*
 * fd_eventfd: eventfd counters and modes.
 *
 * Sets up E1 = eventfd(5, EFD_NONBLOCK) plus a write of 10 (count 15),
 * E2 = eventfd(3, EFD_SEMAPHORE|EFD_CLOEXEC|EFD_NONBLOCK), E3 = eventfd(0).
 * Verifies: fdinfo eventfd-count and flags unchanged, E1 reads 15 once
 * then EAGAIN, E2 reads 1 three times then EAGAIN (semaphore mode), E3 is
 * not readable until written, FD_CLOEXEC only on E2.
 */
#include "ferry_test.h"
#include <poll.h>
#include <sys/eventfd.h>

int main(void)
{
	int e1 = FERRY_SYS(eventfd(5, EFD_NONBLOCK));
	uint64_t v = 10;
	FERRY_SYS(write(e1, &v, 8));
	int e2 = FERRY_SYS(eventfd(3, EFD_SEMAPHORE | EFD_CLOEXEC | EFD_NONBLOCK));
	int e3 = FERRY_SYS(eventfd(0, 0));
	int fds[3] = { e1, e2, e3 };
	char count[3][64];
	long fl[3];
	for (int i = 0; i < 3; i++) {
		ferry_fdinfo_field(fds[i], "eventfd-count", count[i], sizeof count[i]);
		fl[i] = ferry_fdinfo_flags(fds[i]);
	}

	ferry_ready();
	ferry_wait_go();

	for (int i = 0; i < 3; i++) {
		char now[64] = "", what[64], link[64];
		ferry_fdinfo_field(fds[i], "eventfd-count", now, sizeof now);
		snprintf(what, sizeof what, "E%d eventfd-count", i + 1);
		FERRY_CHECK_EQ_STR(what, count[i], now);
		snprintf(what, sizeof what, "E%d flags", i + 1);
		FERRY_CHECK_EQ_HEX(what, fl[i], ferry_fdinfo_flags(fds[i]));
		snprintf(what, sizeof what, "E%d link", i + 1);
		FERRY_CHECK_EQ_STR(what, "anon_inode:[eventfd]", ferry_fd_link(fds[i], link, sizeof link));
	}
	FERRY_CHECK_EQ("E1 FD_CLOEXEC", 0, fcntl(e1, F_GETFD) & FD_CLOEXEC);
	FERRY_CHECK_EQ("E2 FD_CLOEXEC", FD_CLOEXEC, fcntl(e2, F_GETFD) & FD_CLOEXEC);
	v = 0;
	FERRY_CHECK_EQ("E1 read", 8, read(e1, &v, 8));
	FERRY_CHECK_EQ("E1 value", 15, v);
	FERRY_CHECK(read(e1, &v, 8) < 0 && errno == EAGAIN, "E1 second read did not give EAGAIN");
	for (int i = 0; i < 3; i++) {
		v = 0;
		FERRY_CHECK_EQ("E2 read", 8, read(e2, &v, 8));
		FERRY_CHECK_EQ("E2 semaphore value", 1, v);
	}
	FERRY_CHECK(read(e2, &v, 8) < 0 && errno == EAGAIN, "E2 fourth read did not give EAGAIN");
	struct pollfd p = { .fd = e3, .events = POLLIN };
	FERRY_CHECK_EQ("E3 readable before write", 0, poll(&p, 1, 0));
	v = 2;
	FERRY_CHECK_EQ("E3 write", 8, write(e3, &v, 8));
	FERRY_CHECK_EQ("E3 readable after write", 1, poll(&p, 1, 0));
	ferry_finish();
}
