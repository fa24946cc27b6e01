/*
 * mem_many_mappings: thousands of mappings, as a JVM or a browser has.
 *
 * Sets up 6,000 pages of anonymous memory side by side, their protections
 * cycling rw-, r--, ---, rw- (4,500 mappings: the kernel merges each last
 * rw- page with the next first one), each page filled with a pattern of its
 * own first; and 400 read-only private mappings
 * of a file of our own, each of a different page of it (more than ferry
 * keeps open for one batch of calls).
 * Verifies: the whole address space the same, mapping for mapping (start,
 * end, protection, offset), and every page's contents (the inaccessible ones
 * after making them readable).
 */
#include "ferry_test.h"

#define PG 4096UL
#define NANON 6000
#define NFILE 400
#define MAXM 8192

struct m {
	unsigned long start, end, offset;
	char perms[5];
};

static struct m before[MAXM], after[MAXM];
static char line[4096];

static int read_maps(struct m *out)
{
	FILE *f = fopen("/proc/self/maps", "r");
	if (!f)
		ferry_die("open /proc/self/maps");
	int n = 0;
	while (n < MAXM && fgets(line, sizeof line, f)) {
		if (sscanf(line, "%lx-%lx %4s %lx", &out[n].start, &out[n].end, out[n].perms,
			   &out[n].offset) == 4)
			n++;
	}
	fclose(f);
	return n;
}

static const int prots[4] = { PROT_READ | PROT_WRITE, PROT_READ, PROT_NONE, PROT_READ | PROT_WRITE };

int main(void)
{
	unsigned char *a = FERRY_PTR(mmap(NULL, NANON * PG, PROT_READ | PROT_WRITE,
					  MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
	for (int i = 0; i < NANON; i++) {
		ferry_fill(a + i * PG, PG, 1000 + i);
		FERRY_SYS(mprotect(a + i * PG, PG, prots[i % 4]));
	}
	/* The file: NFILE pages, each with a pattern. */
	int fd = FERRY_SYS(open("pages", O_RDWR | O_CREAT | O_TRUNC, 0600));
	static unsigned char page[PG];
	for (int i = 0; i < NFILE; i++) {
		ferry_fill(page, PG, 50000 + i);
		if (write(fd, page, PG) != (ssize_t)PG)
			ferry_die("write pages");
	}
	/* Apart from each other: a reservation with a hole after each page. */
	unsigned char *r = FERRY_PTR(mmap(NULL, 2 * NFILE * PG, PROT_NONE,
					  MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
	FERRY_SYS(munmap(r, 2 * NFILE * PG));
	for (int i = 0; i < NFILE; i++)
		FERRY_PTR(mmap(r + 2 * i * PG, PG, PROT_READ, MAP_PRIVATE | MAP_FIXED, fd,
			       (off_t)(NFILE - 1 - i) * PG));
	close(fd);

	int n = read_maps(before);
	FERRY_CHECK(n > NANON * 3 / 4 + NFILE, "only %d mappings", n);
	ferry_ready();
	ferry_wait_go();

	int k = read_maps(after);
	FERRY_CHECK_EQ("number of mappings", n, k);
	for (int i = 0; i < n && i < k; i++) {
		if (before[i].start != after[i].start || before[i].end != after[i].end ||
		    strcmp(before[i].perms, after[i].perms) != 0 ||
		    before[i].offset != after[i].offset) {
			ferry_fail("mapping %d: %lx-%lx %s %lx before, %lx-%lx %s %lx after", i,
				   before[i].start, before[i].end, before[i].perms, before[i].offset,
				   after[i].start, after[i].end, after[i].perms, after[i].offset);
			break;
		}
	}
	for (int i = 0; i < NANON; i++) {
		if (prots[i % 4] == PROT_NONE)
			FERRY_SYS(mprotect(a + i * PG, PG, PROT_READ));
		char what[64];
		snprintf(what, sizeof what, "anonymous page %d", i);
		if (!ferry_check_fill(what, a + i * PG, PG, 1000 + i))
			break;
	}
	for (int i = 0; i < NFILE; i++) {
		char what[64];
		snprintf(what, sizeof what, "file mapping %d", i);
		if (!ferry_check_fill(what, r + 2 * i * PG, PG, 50000 + (NFILE - 1 - i)))
			break;
	}
	ferry_finish();
}
