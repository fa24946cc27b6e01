/*
 * mem_thp: transparent huge pages and MADV_HUGEPAGE / MADV_NOHUGEPAGE.
 *
 * Sets up two 8 MiB regions aligned to 2 MiB: one advised MADV_HUGEPAGE and
 * filled (where the machine's THP setting is not "never", the kernel backs
 * it with huge pages: smaps AnonHugePages), one advised MADV_NOHUGEPAGE and
 * filled.
 * Verifies: the VmFlags `hg` and `nh` are back on the right regions, the
 * contents intact, and, if the first region had huge pages before, it has
 * huge pages again (they do not come back as 4 KiB pages).
 */
#include "ferry_test.h"

#define MB (1UL << 20)
#define LEN (8 * MB)

static long anon_huge_kb(const void *addr)
{
	char v[64];
	if (ferry_smaps_field(addr, "AnonHugePages", v, sizeof v) < 0)
		return -1;
	return strtol(v, NULL, 10);
}

static unsigned char *aligned_region(void)
{
	unsigned char *p = FERRY_PTR(mmap(NULL, LEN + 2 * MB, PROT_READ | PROT_WRITE,
					  MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
	unsigned char *a = (unsigned char *)(((unsigned long)p + 2 * MB - 1) & ~(2 * MB - 1));
	if (a > p)
		FERRY_SYS(munmap(p, a - p));
	if (a + LEN < p + LEN + 2 * MB)
		FERRY_SYS(munmap(a + LEN, p + LEN + 2 * MB - (a + LEN)));
	return a;
}

int main(void)
{
	unsigned char *h = aligned_region();
	FERRY_SYS(madvise(h, LEN, MADV_HUGEPAGE));
	ferry_fill(h, LEN, 7);
	unsigned char *n = aligned_region();
	FERRY_SYS(madvise(n, LEN, MADV_NOHUGEPAGE));
	ferry_fill(n, LEN, 8);
	long huge_before = anon_huge_kb(h);
	FERRY_CHECK_EQ("AnonHugePages of the MADV_NOHUGEPAGE region", 0L, anon_huge_kb(n));

	ferry_ready();
	ferry_wait_go();

	FERRY_CHECK_EQ("hg flag of the MADV_HUGEPAGE region", 1, ferry_has_vmflag(h, "hg"));
	FERRY_CHECK_EQ("nh flag of the MADV_NOHUGEPAGE region", 1, ferry_has_vmflag(n, "nh"));
	FERRY_CHECK_EQ("nh flag of the MADV_HUGEPAGE region", 0, ferry_has_vmflag(h, "nh"));
	ferry_check_fill("MADV_HUGEPAGE region", h, LEN, 7);
	ferry_check_fill("MADV_NOHUGEPAGE region", n, LEN, 8);
	long huge_after = anon_huge_kb(h);
	if (huge_before > 0)
		FERRY_CHECK(huge_after > 0,
			    "AnonHugePages of the MADV_HUGEPAGE region: %ld kB before, %ld kB after",
			    huge_before, huge_after);
	FERRY_CHECK_EQ("AnonHugePages of the MADV_NOHUGEPAGE region after", 0L, anon_huge_kb(n));
	ferry_finish();
}
