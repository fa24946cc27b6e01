/*
 * mem_heap: the brk heap and malloc state.
 *
 * Sets up many malloc'ed blocks of assorted sizes (some freed, leaving
 * holes in glibc's free lists), one large mmap'ed malloc block, and an
 * explicit sbrk() extension.
 * Verifies: sbrk(0) is unchanged, the [heap] mapping has the same bounds and
 * label, /proc/self/stat start_brk is unchanged, every live block holds its
 * pattern, and malloc/free/realloc still work (new blocks, reuse of freed
 * ones, growing the heap with brk).
 */
#include "ferry_test.h"

#define NBLK 400

static void *blk[NBLK];
static size_t blksz[NBLK];

static unsigned long stat_field(int n) /* 1-based field of /proc/self/stat */
{
	char buf[2048];
	if (ferry_read_file("/proc/self/stat", buf, sizeof buf) < 0)
		return 0;
	char *p = strrchr(buf, ')') + 2; /* field 3 */
	for (int i = 3; i < n && p; i++) {
		p = strchr(p, ' ');
		if (p)
			p++;
	}
	return p ? strtoul(p, NULL, 10) : 0;
}

int main(void)
{
	for (int i = 0; i < NBLK; i++) {
		blksz[i] = 16 + (size_t)(i * 37 % 3000);
		blk[i] = FERRY_PTR(malloc(blksz[i]));
		ferry_fill(blk[i], blksz[i], 1000 + i);
	}
	for (int i = 0; i < NBLK; i += 3) {
		free(blk[i]);
		blk[i] = NULL;
	}
	size_t bigsz = 4 << 20;
	unsigned char *big = FERRY_PTR(malloc(bigsz)); /* mmap'ed chunk */
	ferry_fill(big, bigsz, 70);
	unsigned char *ext = FERRY_PTR(sbrk(8192));
	ferry_fill(ext, 8192, 71);
	void *brk_before = sbrk(0);
	unsigned long start_brk = stat_field(47);
	struct ferry_map heap_before;
	if (ferry_find_map(ext, &heap_before) < 0)
		ferry_die("no mapping for sbrk area");

	ferry_ready();
	ferry_wait_go();

	FERRY_CHECK_EQ_HEX("sbrk(0)", brk_before, sbrk(0));
	FERRY_CHECK_EQ_HEX("start_brk (/proc/self/stat)", start_brk, stat_field(47));
	struct ferry_map heap_now;
	if (ferry_find_map(ext, &heap_now) == 0) {
		FERRY_CHECK_EQ_HEX("heap start", heap_before.start, heap_now.start);
		FERRY_CHECK_EQ_HEX("heap end", heap_before.end, heap_now.end);
		FERRY_CHECK_EQ_STR("heap label", heap_before.path, heap_now.path);
		FERRY_CHECK_EQ_STR("heap label", "[heap]", heap_now.path);
	} else {
		ferry_fail("heap mapping gone");
	}
	for (int i = 0; i < NBLK; i++)
		if (blk[i] && !ferry_check_fill("malloc block", blk[i], blksz[i], 1000 + i))
			break;
	ferry_check_fill("large malloc block", big, bigsz, 70);
	ferry_check_fill("sbrk extension", ext, 8192, 71);

	/* The allocator still works: reuse holes, grow, realloc, free. */
	for (int i = 0; i < NBLK; i += 3) {
		blksz[i] = 24 + (size_t)i;
		blk[i] = malloc(blksz[i]);
		FERRY_CHECK(blk[i] != NULL, "malloc after restore failed");
		if (blk[i])
			ferry_fill(blk[i], blksz[i], 5000 + i);
	}
	void *huge = malloc(100000); /* below the mmap threshold: brk grows */
	FERRY_CHECK(huge != NULL, "malloc(100000) failed");
	if (huge)
		memset(huge, 1, 100000);
	big = realloc(big, bigsz * 2);
	FERRY_CHECK(big != NULL, "realloc failed");
	if (big)
		ferry_check_fill("realloc'ed block", big, bigsz, 70);
	for (int i = 0; i < NBLK; i++)
		if (blk[i] && !ferry_check_fill("block after new allocations", blk[i], blksz[i],
						(i % 3 == 0 ? 5000 : 1000) + i))
			break;
	for (int i = 0; i < NBLK; i++)
		free(blk[i]);
	free(huge);
	free(big);
	ferry_finish();
}
