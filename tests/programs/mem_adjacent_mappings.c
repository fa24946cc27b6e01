/*
 * mem_adjacent_mappings: thousands of small mappings side by side, of mixed protections and
 * contents, anonymous and private file mappings next to one another (what a record of
 * pages that goes on across adjacent mappings must get right).
 *
 * Sets up 5,000 anonymous pages side by side in mappings of 1, 2, 1 and 3 pages, their
 * protections cycling rw-, r--, ---, r-x (about 2,860 mappings, no two adjacent alike); each
 * page holds a pattern of its own, or only a last word, or was written and zeroed again, or
 * was never touched. Right after them, 64 pages of a private mapping of a file of our own
 * (every third page written since, copied on write), in mappings of 4 pages alternately rw-
 * and r--; right after that, 16 more anonymous pages in mappings of 2 pages, rw- and r--.
 * Verifies: the whole address space the same, mapping for mapping (start, end, protection,
 * offset), and every page's contents (the inaccessible ones after making them readable).
 */
#include "ferry_test.h"

#define PG 4096UL
#define NANON 5000
#define NFILE 64
#define NTAIL 16
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

static const int prots[4] = { PROT_READ | PROT_WRITE, PROT_READ, PROT_NONE, PROT_READ | PROT_EXEC };
static const int sizes[4] = { 1, 2, 1, 3 };

/* What anonymous page i holds: 0 never touched, 1 written and zeroed, 2 a last word only,
 * 3 a pattern. */
static int kind(int i)
{
	if (i % 97 == 0)
		return 0;
	if (i % 89 == 0)
		return 1;
	if (i % 13 == 0)
		return 2;
	return 3;
}

static uint64_t last_word(int i)
{
	return 0x6c617374ULL << 32 | (uint64_t)i;
}

static int check_anon(const char *what, unsigned char *p, int i)
{
	switch (kind(i)) {
	case 0:
	case 1:
		return ferry_check_zero(what, p, PG);
	case 2: {
		if (!ferry_check_zero(what, p, PG - 8))
			return 0;
		uint64_t w;
		memcpy(&w, p + PG - 8, 8);
		FERRY_CHECK(w == last_word(i), "%s: last word %lx, expected %lx", what,
			    (unsigned long)w, (unsigned long)last_word(i));
		return w == last_word(i);
	}
	default:
		return ferry_check_fill(what, p, PG, 7000 + i);
	}
}

int main(void)
{
	size_t total = (NANON + NFILE + NTAIL) * PG;
	unsigned char *a = FERRY_PTR(mmap(NULL, total, PROT_READ | PROT_WRITE,
					  MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
	for (int i = 0; i < NANON; i++) {
		unsigned char *p = a + i * PG;
		switch (kind(i)) {
		case 0:
			break;
		case 1:
			ferry_fill(p, PG, 7000 + i);
			memset(p, 0, PG);
			break;
		case 2: {
			uint64_t w = last_word(i);
			memcpy(p + PG - 8, &w, 8);
			break;
		}
		default:
			ferry_fill(p, PG, 7000 + i);
		}
	}
	int nmaps = 0;
	for (int i = 0, k = 0; i < NANON; k++) {
		int len = sizes[k % 4];
		if (i + len > NANON)
			len = NANON - i;
		FERRY_SYS(mprotect(a + i * PG, len * PG, prots[k % 4]));
		i += len;
		nmaps++;
	}
	/* The file, mapped privately right after the anonymous pages. */
	int fd = FERRY_SYS(open("pages", O_RDWR | O_CREAT | O_TRUNC, 0600));
	static unsigned char page[PG];
	for (int j = 0; j < NFILE; j++) {
		ferry_fill(page, PG, 90000 + j);
		if (write(fd, page, PG) != (ssize_t)PG)
			ferry_die("write pages");
	}
	unsigned char *f = a + NANON * PG;
	FERRY_PTR(mmap(f, NFILE * PG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd, 0));
	close(fd);
	for (int j = 0; j < NFILE; j += 3)
		ferry_fill(f + j * PG, PG, 95000 + j);
	for (int j = 0; j < NFILE; j += 4)
		FERRY_SYS(mprotect(f + j * PG, 4 * PG, (j / 4) % 2 ? PROT_READ : PROT_READ | PROT_WRITE));
	/* And anonymous pages again right after it. */
	unsigned char *t = f + NFILE * PG;
	for (int j = 0; j < NTAIL; j++)
		ferry_fill(t + j * PG, PG, 99000 + j);
	for (int j = 0; j < NTAIL; j += 2)
		FERRY_SYS(mprotect(t + j * PG, 2 * PG, (j / 2) % 2 ? PROT_READ : PROT_READ | PROT_WRITE));

	int n = read_maps(before);
	FERRY_CHECK(n > nmaps, "only %d mappings (%d made)", n, nmaps);
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
	FERRY_SYS(mprotect(a, total, PROT_READ));
	char what[64];
	for (int i = 0; i < NANON; i++) {
		snprintf(what, sizeof what, "anonymous page %d", i);
		if (!check_anon(what, a + i * PG, i))
			break;
	}
	for (int j = 0; j < NFILE; j++) {
		snprintf(what, sizeof what, "file page %d", j);
		if (!ferry_check_fill(what, f + j * PG, PG, j % 3 == 0 ? 95000 + j : 90000 + j))
			break;
	}
	for (int j = 0; j < NTAIL; j++) {
		snprintf(what, sizeof what, "tail page %d", j);
		if (!ferry_check_fill(what, t + j * PG, PG, 99000 + j))
			break;
	}
	ferry_finish();
}
