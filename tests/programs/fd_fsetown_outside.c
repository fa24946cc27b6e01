/*
 * fd_fsetown_outside: a descriptor owned (F_SETOWN) by a process outside
 * the tree.
 *
 * Sets up file "f" whose description is owned by our parent, the harness,
 * which is not part of the checkpointed tree (no O_ASYNC: the harness must
 * get no SIGIO).
 * Verifies: the owner is unchanged (the checkpoint must refuse the tree,
 * naming the owner, and leave it running).
 */
#include "ferry_test.h"

int main(void)
{
	int f = FERRY_SYS(open("f", O_CREAT | O_RDWR, 0644));
	pid_t parent = getppid();
	FERRY_SYS(fcntl(f, F_SETOWN, parent));

	ferry_ready();
	ferry_wait_go();

	FERRY_CHECK_EQ("F_GETOWN", parent, fcntl(f, F_GETOWN));
	ferry_finish();
}
