/*
 * mem_memfd: mappings of a memfd (the fd itself is closed; see fd_memfd for
 * an open memfd).
 *
 * Sets up a 32 KiB memfd "ferry-test" with a pattern, mapped MAP_SHARED
 * twice (at two addresses) and MAP_PRIVATE once (then partly overwritten,
 * so some pages are private copies), and a second memfd mapped read-only.
 * Verifies: maps are unchanged (paths "/memfd:... (deleted)", offsets), the
 * two shared mappings still share the same pages (write one, read other),
 * the private mapping keeps its own copies, contents are intact.
 */
#include "ferry_test.h"

#define LEN (8 * 4096UL)

static struct ferry_map maps_before[FERRY_MAX_MAPS];

int main(void)
{
	int fd = FERRY_SYS(memfd_create("ferry-test", MFD_CLOEXEC));
	FERRY_SYS(ftruncate(fd, LEN));
	unsigned char *a = FERRY_PTR(mmap(NULL, LEN, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
	unsigned char *b = FERRY_PTR(mmap(NULL, LEN / 2, PROT_READ | PROT_WRITE, MAP_SHARED, fd, LEN / 2));
	unsigned char *p = FERRY_PTR(mmap(NULL, LEN, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0));
	ferry_fill(a, LEN, 20);
	ferry_fill(p, 4096, 21); /* first page of the private mapping: own copy */

	int fd2 = FERRY_SYS(memfd_create("ferry-ro", 0));
	static unsigned char buf[4096];
	ferry_fill(buf, sizeof buf, 22);
	FERRY_SYS(write(fd2, buf, sizeof buf));
	unsigned char *r = FERRY_PTR(mmap(NULL, 4096, PROT_READ, MAP_SHARED, fd2, 0));
	close(fd);
	close(fd2);

	int nmaps = ferry_read_maps(maps_before, FERRY_MAX_MAPS);
	ferry_ready();
	ferry_wait_go();

	ferry_check_maps_same(maps_before, nmaps);
	struct ferry_map m;
	if (ferry_find_map(a, &m) == 0)
		FERRY_CHECK(strncmp(m.path, "/memfd:ferry-test", 17) == 0, "memfd path: got \"%s\"", m.path);
	ferry_check_map("shared mapping A", a, LEN, "rw-s");
	ferry_check_map("shared mapping B", b, LEN / 2, "rw-s");
	ferry_check_map("private mapping", p, LEN, "rw-p");
	ferry_check_map("read-only mapping", r, 4096, "r--s");
	ferry_check_fill("shared mapping A", a, LEN, 20);
	FERRY_CHECK_MEM("shared mapping B vs A", a + LEN / 2, b, LEN / 2);
	ferry_check_fill("private copied page", p, 4096, 21);
	FERRY_CHECK_MEM("private untouched pages vs A", a + 4096, p + 4096, LEN - 4096);
	ferry_check_fill("read-only memfd", r, 4096, 22);

	/* Sharing: a write through A shows in B; the private copy keeps its page. */
	a[LEN / 2 + 100] ^= 0xff;
	FERRY_CHECK_EQ("byte written via A seen via B", a[LEN / 2 + 100], b[100]);
	a[0] ^= 0xff;
	ferry_check_fill("private copied page after shared write", p, 4096, 21);
	b[200] = 0x77;
	FERRY_CHECK_EQ("byte written via B seen via A", 0x77, a[LEN / 2 + 200]);
	ferry_finish();
}
