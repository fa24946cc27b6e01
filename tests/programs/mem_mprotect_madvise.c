/*
 * mem_mprotect_madvise: what mprotect may still do to file mappings after a
 * restore, and madvise and mlock states that show in VmFlags.
 *
 * Sets up file $T/f (4 pages) and mappings of it:
 *   RO_SH  MAP_SHARED, PROT_READ, of an O_RDONLY descriptor (since closed):
 *          mprotect(PROT_READ|PROT_WRITE) must fail with EACCES
 *   RO_PR  MAP_PRIVATE, PROT_READ, of an O_RDONLY descriptor: mprotect to
 *          read-write succeeds, and a write stays private
 *   RW_SH  MAP_SHARED, PROT_READ, of an O_RDWR descriptor: mprotect to
 *          read-write succeeds, and a write reaches the file
 * and anonymous mappings with MADV_DONTDUMP, MADV_HUGEPAGE, MADV_NOHUGEPAGE,
 * MADV_MERGEABLE, MADV_DONTFORK, MADV_WIPEONFORK, MADV_SEQUENTIAL,
 * MADV_RANDOM, and one locked with mlock (MLOCK_ONFAULT).
 * Verifies: those mprotect outcomes; each mapping's VmFlags in smaps are
 * the same as before (dd, hg, nh, mg, dc, wf, sr, rr, lo lf; "um" aside); the
 * maps.
 */
#include "ferry_test.h"
#include <sys/resource.h>

#define PG 4096

static char *anon(size_t pages)
{
	return FERRY_PTR(mmap(NULL, pages * PG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
}

/* The mapping's VmFlags, without "um" (registered with userfaultfd: a lazy restore's page
 * server fetches its pages meanwhile). */
static int get_flags(void *a, char *out, size_t n)
{
	int r = ferry_smaps_field(a, "VmFlags", out, n);
	char *um = strstr(out, "um ");
	if (um)
		memmove(um, um + 3, strlen(um + 3) + 1);
	return r;
}

#define NA 9

int main(void)
{
	char path[PATH_MAX];
	ferry_path(path, sizeof path, "f");
	int fd = FERRY_SYS(open(path, O_RDWR | O_CREAT | O_TRUNC, 0600));
	char page[PG];
	for (int i = 0; i < 4; i++) {
		memset(page, 'a' + i, sizeof page);
		FERRY_SYS(write(fd, page, sizeof page));
	}
	close(fd);
	int ro = FERRY_SYS(open(path, O_RDONLY));
	char *ro_sh = FERRY_PTR(mmap(NULL, PG, PROT_READ, MAP_SHARED, ro, 0));
	char *ro_pr = FERRY_PTR(mmap(NULL, PG, PROT_READ, MAP_PRIVATE, ro, PG));
	close(ro);
	int rw = FERRY_SYS(open(path, O_RDWR));
	char *rw_sh = FERRY_PTR(mmap(NULL, PG, PROT_READ, MAP_SHARED, rw, 2 * PG));
	close(rw);

	char *a[NA];
	int advice[NA] = { MADV_DONTDUMP, MADV_HUGEPAGE, MADV_NOHUGEPAGE, MADV_MERGEABLE,
			   MADV_DONTFORK, MADV_WIPEONFORK, MADV_SEQUENTIAL, MADV_RANDOM, -1 };
	for (int i = 0; i < NA; i++) {
		/* Each its own mapping: a guard page of PROT_NONE between them keeps them apart. */
		a[i] = anon(3);
		FERRY_SYS(mprotect(a[i] + 2 * PG, PG, PROT_NONE));
		a[i][0] = 1;
		if (advice[i] >= 0 && madvise(a[i], 2 * PG, advice[i]) != 0)
			ferry_die("madvise %d: %s", advice[i], strerror(errno));
	}
	struct rlimit rl = { 1 << 20, 1 << 20 };
	setrlimit(RLIMIT_MEMLOCK, &rl);
	FERRY_SYS(syscall(SYS_mlock2, a[NA - 1], 2 * PG, 1 /* MLOCK_ONFAULT */));

	char before[NA][256];
	for (int i = 0; i < NA; i++)
		if (get_flags(a[i], before[i], sizeof before[i]) != 0)
			ferry_die("no VmFlags for mapping %d", i);
	static struct ferry_map maps[FERRY_MAX_MAPS];
	int nmaps = ferry_read_maps(maps, FERRY_MAX_MAPS);
	ferry_ready();
	ferry_wait_go();
	ferry_check_maps_same(maps, nmaps);

	for (int i = 0; i < NA; i++) {
		char now[256] = "";
		get_flags(a[i], now, sizeof now);
		FERRY_CHECK(strcmp(before[i], now) == 0, "mapping %d (advice %d): VmFlags \"%s\", were \"%s\"",
			    i, advice[i], now, before[i]);
	}

	errno = 0;
	int r = mprotect(ro_sh, PG, PROT_READ | PROT_WRITE);
	FERRY_CHECK(r != 0 && errno == EACCES,
		    "mprotect RW of a shared mapping of a read-only descriptor: %d (%s), expected EACCES", r,
		    strerror(errno));
	FERRY_CHECK_EQ("RO_SH contents", 'a', ro_sh[0]);
	FERRY_CHECK_EQ("mprotect RO_PR", 0, mprotect(ro_pr, PG, PROT_READ | PROT_WRITE));
	ro_pr[0] = 'X';
	FERRY_CHECK_EQ("mprotect RW_SH", 0, mprotect(rw_sh, PG, PROT_READ | PROT_WRITE));
	rw_sh[0] = 'Y';
	FERRY_SYS(msync(rw_sh, PG, MS_SYNC));
	int check = FERRY_SYS(open(path, O_RDONLY));
	char got[3 * PG];
	FERRY_CHECK_EQ("file read", (ssize_t)sizeof got, read(check, got, sizeof got));
	close(check);
	FERRY_CHECK_EQ("private write stays private", 'b', got[PG]);
	FERRY_CHECK_EQ("shared write reaches the file", 'Y', got[2 * PG]);
	ferry_finish();
}
