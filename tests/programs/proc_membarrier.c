/*
 * proc_membarrier: membarrier(2) registrations of the address space.
 *
 * Sets up: registers for MEMBARRIER_CMD_PRIVATE_EXPEDITED and
 * MEMBARRIER_CMD_PRIVATE_EXPEDITED_SYNC_CORE (not for _RSEQ or GLOBAL).
 * Verifies: MEMBARRIER_CMD_GET_REGISTRATIONS reports the same two
 * registrations; the private expedited barriers succeed (without a
 * registration they fail with EPERM), the RSEQ one still fails with EPERM.
 */
#include "ferry_test.h"
#include <linux/membarrier.h>
#include <sys/syscall.h>

#ifndef MEMBARRIER_CMD_GET_REGISTRATIONS
#define MEMBARRIER_CMD_GET_REGISTRATIONS (1 << 9)
#endif

static long mb(int cmd)
{
	return syscall(SYS_membarrier, cmd, 0, 0);
}

int main(void)
{
	long supported = mb(MEMBARRIER_CMD_QUERY);
	if (supported < 0)
		ferry_die("membarrier: %s", strerror(errno));
	FERRY_SYS(mb(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED));
	FERRY_SYS(mb(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED_SYNC_CORE));
	long regs = FERRY_SYS(mb(MEMBARRIER_CMD_GET_REGISTRATIONS));

	ferry_ready();
	ferry_wait_go();

	FERRY_CHECK_EQ_HEX("registrations", regs, mb(MEMBARRIER_CMD_GET_REGISTRATIONS));
	FERRY_CHECK_EQ("private expedited barrier", 0, mb(MEMBARRIER_CMD_PRIVATE_EXPEDITED));
	FERRY_CHECK_EQ("sync-core barrier", 0, mb(MEMBARRIER_CMD_PRIVATE_EXPEDITED_SYNC_CORE));
	errno = 0;
	long r = mb(MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ);
	FERRY_CHECK(r == -1 && errno == EPERM, "rseq barrier without registration: %ld (%s)", r, strerror(errno));
	ferry_finish();
}
