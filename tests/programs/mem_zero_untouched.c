/*
 * mem_zero_untouched: untouched and zero memory must stay cheap.
 *
 * Sets up a 256 MiB private anon region where only 4 pages are written,
 * 64 pages are only read (zero page), and 8 pages were written and then
 * dropped with MADV_DONTNEED.
 * Verifies: the region's Rss (smaps) did not grow by more than 64 KiB over
 * its value at checkpoint time, i.e. untouched/zero pages were not
 * materialised by restore; then that the written pages hold their pattern
 * and every other byte reads zero.
 */
#include "ferry_test.h"

#define PG 4096UL
#define LEN (256UL << 20)

static long rss_kb(void *start)
{
	char v[64];
	if (ferry_smaps_field(start, "Rss", v, sizeof v) < 0)
		return -1;
	return strtol(v, NULL, 10);
}

static const size_t written[] = { 3, 4096, 40000, 65535 };

int main(void)
{
	unsigned char *r = FERRY_PTR(mmap(NULL, LEN, PROT_READ | PROT_WRITE,
					  MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
	FERRY_SYS(madvise(r, LEN, MADV_NOHUGEPAGE));
	for (size_t i = 0; i < 4; i++)
		ferry_fill(r + written[i] * PG, PG, 110 + i);
	volatile unsigned sum = 0;
	for (size_t i = 0; i < 64; i++)
		sum += r[(20000 + i) * PG];
	for (size_t i = 0; i < 8; i++)
		memset(r + (30000 + i) * PG, 0xee, PG);
	FERRY_SYS(madvise(r + 30000 * PG, 8 * PG, MADV_DONTNEED));
	long rss_before = rss_kb(r);

	ferry_ready();
	ferry_wait_go();

	long rss_after = rss_kb(r);
	FERRY_CHECK(rss_after >= 0 && rss_after <= rss_before + 64,
		    "Rss of the 256 MiB region grew from %ld kB to %ld kB", rss_before, rss_after);
	ferry_check_map("region", r, LEN, "rw-p");
	for (size_t pg = 0, w = 0; pg < LEN / PG; pg++) {
		if (w < 4 && written[w] == pg) {
			ferry_check_fill("written page", r + pg * PG, PG, 110 + w);
			w++;
		} else if (!ferry_check_zero("untouched/zero page", r + pg * PG, PG)) {
			break;
		}
	}
	ferry_finish();
}
