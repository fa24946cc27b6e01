/*
 * mem_shared_anon_fork: MAP_SHARED|MAP_ANONYMOUS memory shared by a parent
 * and its forked child, next to a MAP_PRIVATE region inherited copy-on-write.
 *
 * Sets up a 64 KiB shared region (pattern written by the parent, a second
 * part written by the child) and a private region that the child overwrote
 * after fork.
 * Verifies (both processes): same addresses and contents; the shared region
 * is still shared (a value written by one after restore is seen by the
 * other, both directions); the private region is still separate (the parent
 * keeps its own bytes, the child its own).
 */
#include "ferry_test.h"

#define SHLEN (16 * 4096UL)
#define PRLEN (4 * 4096UL)

struct sync {
	volatile int ping, pong, child_ready;
};

int main(void)
{
	unsigned char *sh = FERRY_PTR(mmap(NULL, SHLEN, PROT_READ | PROT_WRITE,
					   MAP_SHARED | MAP_ANONYMOUS, -1, 0));
	unsigned char *pr = FERRY_PTR(mmap(NULL, PRLEN, PROT_READ | PROT_WRITE,
					   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
	struct sync *s = (struct sync *)(sh + SHLEN - 4096);
	ferry_fill(sh, SHLEN / 2, 10);
	ferry_fill(pr, PRLEN, 11);

	pid_t child = FERRY_SYS(fork());
	if (child == 0) {
		ferry_fill(sh + SHLEN / 2, SHLEN / 4, 12); /* child's half */
		ferry_fill(pr, PRLEN, 13);                 /* COW copy */
		__atomic_store_n(&s->child_ready, 1, __ATOMIC_SEQ_CST);
		ferry_wait_go();
		ferry_check_map("child: shared region", sh, SHLEN, "rw-s");
		ferry_check_map("child: private region", pr, PRLEN, "rw-p");
		ferry_check_fill("child: shared parent part", sh, SHLEN / 2, 10);
		ferry_check_fill("child: shared child part", sh + SHLEN / 2, SHLEN / 4, 12);
		ferry_check_fill("child: private copy", pr, PRLEN, 13);
		/* Wait for the parent's ping through the shared page, answer. */
		if (!FERRY_WAIT_UNTIL(__atomic_load_n(&s->ping, __ATOMIC_SEQ_CST) == 0x5a5a, 5000))
			ferry_fail("child: parent's write to shared memory not seen (ping=%#x)", s->ping);
		__atomic_store_n(&s->pong, 0xa5a5, __ATOMIC_SEQ_CST);
		ferry_child_finish();
	}
	if (!FERRY_WAIT_UNTIL(__atomic_load_n(&s->child_ready, __ATOMIC_SEQ_CST), 5000))
		ferry_die("child never got ready");

	ferry_ready();
	ferry_wait_go();

	ferry_check_map("shared region", sh, SHLEN, "rw-s");
	ferry_check_map("private region", pr, PRLEN, "rw-p");
	ferry_check_fill("shared parent part", sh, SHLEN / 2, 10);
	ferry_check_fill("shared child part (written by child)", sh + SHLEN / 2, SHLEN / 4, 12);
	ferry_check_fill("private region (child's copy must not leak)", pr, PRLEN, 11);
	__atomic_store_n(&s->ping, 0x5a5a, __ATOMIC_SEQ_CST);
	if (!FERRY_WAIT_UNTIL(__atomic_load_n(&s->pong, __ATOMIC_SEQ_CST) == 0xa5a5, 5000))
		ferry_fail("child's write to shared memory not seen (pong=%#x)", s->pong);
	ferry_reap_child(child, "child", 0, 5000);
	ferry_finish();
}
