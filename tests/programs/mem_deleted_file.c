/*
 * mem_deleted_file: mappings of a file that was unlinked afterwards.
 *
 * Sets up gone.bin (4 pages), mapped MAP_SHARED twice and MAP_PRIVATE once
 * (one private page overwritten), then unlinks it (no fd stays open).
 * Verifies: maps unchanged (path ".../gone.bin (deleted)"), contents, the
 * two shared mappings still share one file (write one, read the other), the
 * private copy is kept, and no gone.bin reappeared in the directory.
 */
#include "ferry_test.h"

#define PG 4096UL
#define NPG 4

static struct ferry_map maps_before[FERRY_MAX_MAPS];

int main(void)
{
	char path[PATH_MAX];
	ferry_path(path, sizeof path, "gone.bin");
	int fd = FERRY_SYS(open(path, O_RDWR | O_CREAT | O_TRUNC, 0644));
	FERRY_SYS(ftruncate(fd, NPG * PG));
	unsigned char *a = FERRY_PTR(mmap(NULL, NPG * PG, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
	unsigned char *b = FERRY_PTR(mmap(NULL, NPG * PG, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
	ferry_fill(a, NPG * PG, 60);
	unsigned char *p = FERRY_PTR(mmap(NULL, NPG * PG, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0));
	ferry_fill(p + 2 * PG, PG, 61);
	close(fd);
	FERRY_SYS(unlink(path));

	int nmaps = ferry_read_maps(maps_before, FERRY_MAX_MAPS);
	ferry_ready();
	ferry_wait_go();

	ferry_check_maps_same(maps_before, nmaps);
	struct ferry_map m;
	char want[PATH_MAX + 16];
	snprintf(want, sizeof want, "%s (deleted)", path);
	if (ferry_find_map(a, &m) == 0)
		FERRY_CHECK_EQ_STR("mapping path", want, m.path);
	ferry_check_map("shared mapping A", a, NPG * PG, "rw-s");
	ferry_check_map("shared mapping B", b, NPG * PG, "rw-s");
	ferry_check_map("private mapping", p, NPG * PG, "rw-p");
	ferry_check_fill("shared mapping A", a, NPG * PG, 60);
	ferry_check_fill("shared mapping B", b, NPG * PG, 60);
	ferry_check_fill("private page 0..1", p, 2 * PG, 60);
	ferry_check_fill("private copied page", p + 2 * PG, PG, 61);
	a[100] = 0x42;
	FERRY_CHECK_EQ("write via A seen via B", 0x42, b[100]);
	FERRY_CHECK(access(path, F_OK) != 0, "%s exists again after restore", path);
	ferry_finish();
}
