/*
 * mem_file_private: MAP_PRIVATE mappings of a regular file in the test dir.
 *
 * Sets up data.bin (8 pages of pattern), mapped MAP_PRIVATE read-only at
 * file offset 2 pages, and MAP_PRIVATE read-write over the whole file with
 * pages 1 and 5 overwritten (private copies; the file is not changed).
 * Verifies: maps unchanged (path, offset, perms), the copied pages hold the
 * private data, the other pages hold file data, the file itself is
 * unchanged, and writes after restore still do not reach the file.
 */
#include "ferry_test.h"

#define PG 4096UL
#define NPG 8

static struct ferry_map maps_before[FERRY_MAX_MAPS];
static unsigned char filedata[NPG * PG];

static void check_file(const char *path, const char *what)
{
	static unsigned char now[NPG * PG];
	int fd = open(path, O_RDONLY);
	FERRY_CHECK(fd >= 0, "%s: open %s: %s", what, path, strerror(errno));
	if (fd < 0)
		return;
	FERRY_CHECK_EQ(what, sizeof now, pread(fd, now, sizeof now, 0));
	FERRY_CHECK_MEM(what, filedata, now, sizeof now);
	close(fd);
}

int main(void)
{
	char path[PATH_MAX];
	ferry_path(path, sizeof path, "data.bin");
	ferry_fill(filedata, sizeof filedata, 40);
	int fd = FERRY_SYS(open(path, O_RDWR | O_CREAT | O_TRUNC, 0644));
	FERRY_SYS(write(fd, filedata, sizeof filedata));

	unsigned char *ro = FERRY_PTR(mmap(NULL, 3 * PG, PROT_READ, MAP_PRIVATE, fd, 2 * PG));
	unsigned char *rw = FERRY_PTR(mmap(NULL, NPG * PG, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0));
	close(fd);
	ferry_fill(rw + 1 * PG, PG, 41);
	ferry_fill(rw + 5 * PG, PG, 45);

	int nmaps = ferry_read_maps(maps_before, FERRY_MAX_MAPS);
	ferry_ready();
	ferry_wait_go();

	ferry_check_maps_same(maps_before, nmaps);
	struct ferry_map m;
	if (ferry_find_map(ro, &m) == 0) {
		FERRY_CHECK_EQ_STR("read-only mapping path", path, m.path);
		FERRY_CHECK_EQ_HEX("read-only mapping offset", 2 * PG, m.offset);
	} else {
		ferry_fail("read-only mapping %p is gone", (void *)ro);
	}
	ferry_check_map("read-only mapping", ro, 3 * PG, "r--p");
	ferry_check_map("read-write mapping", rw, NPG * PG, "rw-p");
	FERRY_CHECK_MEM("read-only mapping contents", filedata + 2 * PG, ro, 3 * PG);
	for (int i = 0; i < NPG; i++) {
		char what[64];
		snprintf(what, sizeof what, "rw mapping page %d", i);
		if (i == 1 || i == 5)
			ferry_check_fill(what, rw + i * PG, PG, 40 + i);
		else
			FERRY_CHECK_MEM(what, filedata + i * PG, rw + i * PG, PG);
	}
	check_file(path, "file contents");
	memset(rw, 0x5c, NPG * PG);
	check_file(path, "file contents after writing the private mapping");
	ferry_finish();
}
