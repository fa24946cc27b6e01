/*
 * mem_anon_private: private anonymous memory.
 *
 * Sets up MAP_PRIVATE|MAP_ANONYMOUS regions: a RW region filled with a
 * pattern, a read-only one (filled, then mprotect'ed), a region split by
 * mprotect into rw-/r--/rw-, a sparse 64 MiB region with a few touched pages,
 * a region moved by mremap (right below the sparse one), a MAP_FIXED region at a chosen address and an
 * executable page holding code.
 *
 * Verifies: /proc/self/maps is unchanged, every byte is intact, untouched
 * pages read zero, the code page still runs, and the memory is still private
 * (a forked child's writes are not seen by the parent).
 */
#include "ferry_test.h"

#define PG 4096UL
#define FIXED_ADDR ((void *)0x3f0000000000UL)

static struct ferry_map maps_before[FERRY_MAX_MAPS];

int main(void)
{
	unsigned char *rw = FERRY_PTR(mmap(NULL, 33 * PG, PROT_READ | PROT_WRITE,
					   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
	ferry_fill(rw, 33 * PG, 1);

	unsigned char *ro = FERRY_PTR(mmap(NULL, 4 * PG, PROT_READ | PROT_WRITE,
					   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
	ferry_fill(ro, 4 * PG, 2);
	FERRY_SYS(mprotect(ro, 4 * PG, PROT_READ));

	unsigned char *split = FERRY_PTR(mmap(NULL, 12 * PG, PROT_READ | PROT_WRITE,
					      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
	ferry_fill(split, 12 * PG, 3);
	FERRY_SYS(mprotect(split + 4 * PG, 4 * PG, PROT_READ));

	/*
	 * The sparse region has room for the mremap'ed one right below it: the two are
	 * adjacent, alike in maps, and kept apart only by MAP_NORESERVE (and by their page
	 * offsets), which a restore must keep.
	 */
	size_t sparse_len = 64UL << 20;
	unsigned char *below_sparse = FERRY_PTR(mmap(NULL, 16 * PG + sparse_len, PROT_NONE,
						     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
	unsigned char *sparse = FERRY_PTR(mmap(below_sparse + 16 * PG, sparse_len,
					       PROT_READ | PROT_WRITE,
					       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
					       -1, 0));
	static const size_t touched[] = { 0, 1, 1000, 8191, 16383 };
	for (size_t i = 0; i < sizeof touched / sizeof touched[0]; i++)
		ferry_fill(sparse + touched[i] * PG, PG, 100 + i);

	unsigned char *moved = FERRY_PTR(mmap(NULL, 8 * PG, PROT_READ | PROT_WRITE,
					      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
	ferry_fill(moved, 8 * PG, 4);
	moved = FERRY_PTR(mremap(moved, 8 * PG, 16 * PG, MREMAP_MAYMOVE | MREMAP_FIXED, below_sparse));
	ferry_fill(moved + 8 * PG, 8 * PG, 5);

	unsigned char *fixed = FERRY_PTR(mmap(FIXED_ADDR, 3 * PG, PROT_READ | PROT_WRITE,
					      MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0));
	if (fixed != FIXED_ADDR)
		ferry_die("MAP_FIXED_NOREPLACE gave %p", (void *)fixed);
	ferry_fill(fixed, 3 * PG, 6);

	unsigned char *code = FERRY_PTR(mmap(NULL, PG, PROT_READ | PROT_WRITE,
					     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
	static const unsigned char mov42_ret[] = { 0xb8, 0x2a, 0x00, 0x00, 0x00, 0xc3 };
	memcpy(code, mov42_ret, sizeof mov42_ret);
	FERRY_SYS(mprotect(code, PG, PROT_READ | PROT_EXEC));

	int nmaps = ferry_read_maps(maps_before, FERRY_MAX_MAPS);
	ferry_ready();
	ferry_wait_go();

	ferry_check_maps_same(maps_before, nmaps);
	ferry_check_map("rw region", rw, 33 * PG, "rw-p");
	ferry_check_map("ro region", ro, 4 * PG, "r--p");
	ferry_check_map("split head", split, 4 * PG, "rw-p");
	ferry_check_map("split middle", split + 4 * PG, 4 * PG, "r--p");
	ferry_check_map("split tail", split + 8 * PG, 4 * PG, "rw-p");
	ferry_check_map("sparse region", sparse, sparse_len, "rw-p");
	ferry_check_map("mremap'ed region", moved, 16 * PG, "rw-p");
	ferry_check_map("fixed region", fixed, 3 * PG, "rw-p");
	ferry_check_map("code page", code, PG, "r-xp");

	ferry_check_fill("rw region", rw, 33 * PG, 1);
	ferry_check_fill("ro region", ro, 4 * PG, 2);
	ferry_check_fill("split region", split, 12 * PG, 3);
	for (size_t pg = 0, t = 0; pg < sparse_len / PG; pg++) {
		if (t < sizeof touched / sizeof touched[0] && touched[t] == pg) {
			ferry_check_fill("sparse touched page", sparse + pg * PG, PG, 100 + t);
			t++;
		} else if (!ferry_check_zero("sparse untouched page", sparse + pg * PG, PG)) {
			break;
		}
	}
	ferry_check_fill("mremap'ed region (old part)", moved, 8 * PG, 4);
	ferry_check_fill("mremap'ed region (new part)", moved + 8 * PG, 8 * PG, 5);
	ferry_check_fill("fixed region", fixed, 3 * PG, 6);
	int (*fn)(void) = (int (*)(void))(void *)code;
	FERRY_CHECK_EQ("code page returns", 42, fn());

	/* Still private: a child's writes must not reach the parent. */
	pid_t child = FERRY_SYS(fork());
	if (child == 0) {
		memset(rw, 0xAA, 33 * PG);
		memset(split, 0xAA, 4 * PG);
		memset(sparse, 0xAA, PG);
		_exit(0);
	}
	ferry_reap_child(child, "writer child", 0, 5000);
	ferry_check_fill("rw region after child wrote", rw, 33 * PG, 1);
	ferry_check_fill("split region after child wrote", split, 12 * PG, 3);
	ferry_check_fill("sparse page after child wrote", sparse, PG, 100);

	/* And still writable. */
	rw[5] ^= 0xff;
	split[9 * PG] ^= 0xff;
	ferry_finish();
}
