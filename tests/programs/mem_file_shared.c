/*
 * mem_file_shared: MAP_SHARED mappings of a regular file in the test dir.
 *
 * Sets up shared.bin (6 pages) mapped MAP_SHARED read-write twice (whole
 * file, and pages 2..3 at another address), data written through the
 * mapping before checkpoint, and a read-only MAP_SHARED mapping.
 * Verifies: maps unchanged, the file holds what was written through the
 * mapping, writes through the mapping after restore reach the file (pread),
 * write()s to the file show in the mapping, and both mappings share pages.
 */
#include "ferry_test.h"

#define PG 4096UL
#define NPG 6

static struct ferry_map maps_before[FERRY_MAX_MAPS];

int main(void)
{
	char path[PATH_MAX];
	ferry_path(path, sizeof path, "shared.bin");
	int fd = FERRY_SYS(open(path, O_RDWR | O_CREAT | O_TRUNC, 0644));
	FERRY_SYS(ftruncate(fd, NPG * PG));
	unsigned char *a = FERRY_PTR(mmap(NULL, NPG * PG, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
	unsigned char *b = FERRY_PTR(mmap(NULL, 2 * PG, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 2 * PG));
	unsigned char *r = FERRY_PTR(mmap(NULL, NPG * PG, PROT_READ, MAP_SHARED, fd, 0));
	close(fd);
	ferry_fill(a, NPG * PG, 50);

	int nmaps = ferry_read_maps(maps_before, FERRY_MAX_MAPS);
	ferry_ready();
	ferry_wait_go();

	ferry_check_maps_same(maps_before, nmaps);
	ferry_check_map("mapping A", a, NPG * PG, "rw-s");
	ferry_check_map("mapping B", b, 2 * PG, "rw-s");
	ferry_check_map("read-only mapping", r, NPG * PG, "r--s");
	ferry_check_fill("mapping A", a, NPG * PG, 50);
	FERRY_CHECK_MEM("mapping B vs A", a + 2 * PG, b, 2 * PG);
	FERRY_CHECK_MEM("read-only mapping vs A", a, r, NPG * PG);

	static unsigned char file[NPG * PG];
	fd = open(path, O_RDWR);
	FERRY_CHECK(fd >= 0, "open %s: %s", path, strerror(errno));
	if (fd >= 0) {
		FERRY_CHECK_EQ("pread", sizeof file, pread(fd, file, sizeof file, 0));
		ferry_check_fill("file written through the mapping", file, sizeof file, 50);
		/* mapping -> file */
		a[3 * PG + 7] = 0x11;
		unsigned char c = 0;
		FERRY_CHECK_EQ("pread 1", 1, pread(fd, &c, 1, 3 * PG + 7));
		FERRY_CHECK_EQ("byte written via mapping, read from file", 0x11, c);
		FERRY_CHECK_EQ("byte written via A seen via B", 0x11, b[PG + 7]);
		/* file -> mapping */
		c = 0x22;
		FERRY_CHECK_EQ("pwrite 1", 1, pwrite(fd, &c, 1, 5 * PG + 9));
		FERRY_CHECK_EQ("byte written to file, seen via mapping", 0x22, a[5 * PG + 9]);
		FERRY_CHECK_EQ("byte written to file, seen via read-only mapping", 0x22, r[5 * PG + 9]);
		close(fd);
	}
	ferry_finish();
}
