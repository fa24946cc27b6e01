/*
 * mem_lazy_mapping_changes: mapping changes while pages may still be owed.
 *
 * Sets up private anonymous regions filled with patterns. After go (under
 * `ferry restore --lazy` with a delayed push, their pages are still arriving
 * then), before touching most of them, it:
 *   - forks a child that checks a region it never touched before the fork, and
 *     writes to it (the parent must not see that);
 *   - mremaps a region elsewhere (MREMAP_MAYMOVE|MREMAP_FIXED) and checks it
 *     at its new address, and that the old address is gone;
 *   - grows a region in place with mremap: the old part keeps its bytes, the
 *     new part reads zero;
 *   - munmaps the middle of a region and maps fresh memory there: zeros;
 *   - madvise(MADV_DONTNEED)s part of a region: zeros there, the rest intact;
 *   - mprotects a region read-only and reads it;
 * then checks every byte that should have survived.
 */
#include "ferry_test.h"

#define PG 4096UL
#define N (256 * PG)

static unsigned char *region(uint64_t seed)
{
	unsigned char *p = FERRY_PTR(mmap(NULL, N, PROT_READ | PROT_WRITE,
					  MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
	ferry_fill(p, N, seed);
	return p;
}

static int all_zero(const unsigned char *p, size_t len)
{
	for (size_t i = 0; i < len; i++)
		if (p[i])
			return 0;
	return 1;
}

int main(void)
{
	unsigned char *forked = region(11);
	unsigned char *moved = region(12);
	unsigned char *grown = region(13);
	unsigned char *holed = region(14);
	unsigned char *dropped = region(15);
	unsigned char *ro = region(16);
	/* Where `moved` goes: reserved now, replaced by MREMAP_FIXED later. */
	unsigned char *dest = FERRY_PTR(mmap(NULL, N, PROT_NONE,
					     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
	ferry_ready();
	ferry_wait_go();

	/* fork before the child's region was touched again */
	pid_t child = FERRY_SYS(fork());
	if (child == 0) {
		ferry_check_fill("forked region in the child", forked, N, 11);
		memset(forked, 0x5a, N);
		ferry_child_finish();
	}
	ferry_reap_child(child, "child", 0, 10000);
	ferry_check_fill("forked region in the parent", forked, N, 11);

	/* move */
	unsigned char *m = FERRY_PTR(mremap(moved, N, N, MREMAP_MAYMOVE | MREMAP_FIXED, dest));
	FERRY_CHECK(m == dest, "mremap landed at %p, not %p", (void *)m, (void *)dest);
	ferry_check_fill("moved region", m, N, 12);
	FERRY_CHECK(msync(moved, PG, MS_ASYNC) == -1 && errno == ENOMEM,
		    "the old place of the moved region is still mapped");

	/* grow (in place or moved) */
	unsigned char *g = FERRY_PTR(mremap(grown, N, 2 * N, MREMAP_MAYMOVE));
	ferry_check_fill("grown region, old part", g, N, 13);
	FERRY_CHECK(all_zero(g + N, N), "grown region: the new part is not zero");

	/* a hole unmapped, then mapped afresh */
	FERRY_SYS(munmap(holed + 64 * PG, 64 * PG));
	unsigned char *fresh = FERRY_PTR(mmap(holed + 64 * PG, 64 * PG, PROT_READ | PROT_WRITE,
					      MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0));
	FERRY_CHECK(all_zero(fresh, 64 * PG), "memory mapped into a hole is not zero");
	ferry_check_fill("before the hole", holed, 64 * PG, 14);
	/* the part after the hole: the pattern continues where it was */
	unsigned char *want = FERRY_PTR(malloc(N));
	ferry_fill(want, N, 14);
	FERRY_CHECK_MEM("after the hole", want + 128 * PG, holed + 128 * PG, N - 128 * PG);

	/* dropped pages read zero, the others keep their bytes */
	FERRY_SYS(madvise(dropped + 32 * PG, 32 * PG, MADV_DONTNEED));
	FERRY_CHECK(all_zero(dropped + 32 * PG, 32 * PG), "pages dropped with madvise are not zero");
	ferry_fill(want, N, 15);
	FERRY_CHECK_MEM("before the dropped pages", want, dropped, 32 * PG);
	FERRY_CHECK_MEM("after the dropped pages", want + 64 * PG, dropped + 64 * PG, N - 64 * PG);

	/* read-only */
	FERRY_SYS(mprotect(ro, N, PROT_READ));
	ferry_check_fill("read-only region", ro, N, 16);

	free(want);
	ferry_finish();
}
