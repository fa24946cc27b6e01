/*
 * mem_cow_shared: private anonymous memory that a parent shares copy-on-write
 * with the children it forked must still be shared after a restore, not
 * copied into each of them.
 *
 * Sets up a 64 MiB private region filled by the parent, then forks two
 * children. Child A writes its own bytes over the first 8 MiB and makes
 * 1 MiB in the middle read-only (its mapping is split: changed since the
 * fork). Child B writes its own bytes into every 16th page and moves a
 * small inherited region elsewhere with mremap (same pages, another
 * address). After the forks the parent writes 4 MiB of the region again
 * (those pages are its own now; the children keep the old ones).
 * Verifies (in every process): the address space is the same, every byte is
 * what that process last wrote or inherited, and the region is shared again:
 * its proportional set size (Pss in /proc/self/smaps) is well below its
 * resident size (Rss), as it is before a checkpoint. A restore that gives
 * each process its own copy makes Pss equal Rss.
 */
#include "ferry_test.h"

#define MB (1024 * 1024UL)
#define LEN (64 * MB)
#define PAGE 4096UL
#define SMALL (1 * MB)

/* Sharing is measured while all three still live: each says it has checked (a file
 * checked.NAME in T) and waits for the others' files before it ends. (No shared memory for
 * this: the program must also move with --memory lazy, which refuses shared memory.) */
static void checked_wait_all(const char *me)
{
	char path[512], name[64];
	snprintf(name, sizeof name, "checked.%s", me);
	ferry_write_atomic(name, "1\n");
	const char *all[] = { "checked.parent", "checked.A", "checked.B" };
	for (int i = 0; i < 3; i++) {
		ferry_path(path, sizeof path, all[i]);
		if (!FERRY_WAIT_UNTIL(access(path, F_OK) == 0, 30000)) {
			ferry_fail("%s never finished its checks", all[i]);
			return;
		}
	}
}

static unsigned char *region, *small;
static struct ferry_map maps[FERRY_MAX_MAPS];
static int nmaps;

/*
 * The address space must be the one captured, every mapping of it, the stack included. It is
 * compared from a frame 8 KiB below the one its snapshot was taken in, as a check made in a
 * called function is: ferry_test.h's stack prefault (256 KiB below its caller) must not grow
 * the stack there. Until it was made once per thread it did, in every process, natively as
 * after a restore; with the check made from main, 144 bytes deeper than the snapshot, by one
 * page in 9 of the 256 places the stack pointer can have in its page, which was taken for a
 * fault of the copy-on-write restore.
 */
__attribute__((noinline)) static void check_maps_same_deeper(void)
{
	volatile unsigned char pad[8192];
	pad[0] = pad[sizeof pad - 1] = 1;
	ferry_check_maps_same(maps, nmaps);
	if (pad[0] != 1 || pad[sizeof pad - 1] != 1)
		ferry_fail("stack bytes changed under the address-space check");
}

static unsigned long smaps_kb(const void *start, const char *field)
{
	char v[64];
	if (ferry_smaps_field(start, field, v, sizeof v) < 0) {
		ferry_fail("no %s for the mapping at %p", field, start);
		return 0;
	}
	return strtoul(v, NULL, 10);
}

/* The mapping at start is mostly shared: Pss at most 3/4 of Rss. */
static void check_shared(const char *who, const void *start)
{
	unsigned long rss = smaps_kb(start, "Rss"), pss = smaps_kb(start, "Pss");
	if (rss == 0 || pss * 4 > rss * 3)
		ferry_fail("%s: mapping at %p is not shared copy-on-write: Rss %lu kB, Pss %lu kB", who,
			   start, rss, pss);
}

/* Each page of the region holds its own pattern: page i of writer w, seed w + i. */
#define INITIAL 100000
#define BY_A 200000
#define BY_B 300000
#define BY_PARENT 400000

static void fill_pages(unsigned long from, unsigned long to, uint64_t base, unsigned long step)
{
	for (unsigned long i = from; i < to; i += step)
		ferry_fill(region + i * PAGE, PAGE, base + i);
}

/* Region page i holds: the parent's first fill, or what its process wrote since. */
static void check_region(const char *who, int child_a, int child_b, int parent)
{
	for (unsigned long i = 0; i < LEN / PAGE; i++) {
		uint64_t seed = INITIAL + i;
		if (child_a && i < 8 * MB / PAGE)
			seed = BY_A + i;
		else if (child_b && i % 16 == 5)
			seed = BY_B + i;
		else if (parent && i >= 40 * MB / PAGE && i < 44 * MB / PAGE)
			seed = BY_PARENT + i;
		if (!ferry_check_fill(who, region + i * PAGE, PAGE, seed))
			return;
	}
}

int main(void)
{
	int ready[2];
	FERRY_SYS(pipe(ready));
	region = FERRY_PTR(mmap(NULL, LEN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
	small = FERRY_PTR(mmap(NULL, SMALL, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
	/* Keep the kernel from using huge pages here: the checks count 4 KiB pages. */
	FERRY_SYS(madvise(region, LEN, MADV_NOHUGEPAGE));
	fill_pages(0, LEN / PAGE, INITIAL, 1);
	ferry_fill(small, SMALL, 30);

	pid_t a = FERRY_SYS(fork());
	if (a == 0) {
		fill_pages(0, 8 * MB / PAGE, BY_A, 1);
		FERRY_SYS(mprotect(region + 32 * MB, MB, PROT_READ));
		FERRY_SYS(write(ready[1], "A", 1));
		nmaps = ferry_read_maps(maps, FERRY_MAX_MAPS);
		ferry_wait_go();
		check_maps_same_deeper();
		check_region("child A: region", 1, 0, 0);
		ferry_check_fill("child A: small region", small, SMALL, 30);
		check_shared("child A", region);
		check_shared("child A", region + 33 * MB);
		checked_wait_all("A");
		ferry_child_finish();
	}
	pid_t b = FERRY_SYS(fork());
	if (b == 0) {
		fill_pages(5, LEN / PAGE, BY_B, 16);
		/* The small region moves one page-aligned step up: the same pages, elsewhere. */
		unsigned char *to = FERRY_PTR(mmap(NULL, 2 * SMALL, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
		FERRY_SYS(munmap(to + SMALL, SMALL));
		small = FERRY_PTR(mremap(small, SMALL, SMALL, MREMAP_MAYMOVE | MREMAP_FIXED, to));
		FERRY_SYS(write(ready[1], "B", 1));
		nmaps = ferry_read_maps(maps, FERRY_MAX_MAPS);
		ferry_wait_go();
		check_maps_same_deeper();
		check_region("child B: region", 0, 1, 0);
		ferry_check_fill("child B: moved small region", small, SMALL, 30);
		check_shared("child B", region);
		checked_wait_all("B");
		ferry_child_finish();
	}
	char got[2];
	for (int n = 0; n < 2;) {
		ssize_t r = read(ready[0], got + n, 2 - n);
		if (r <= 0)
			ferry_die("children never got ready");
		n += r;
	}
	fill_pages(40 * MB / PAGE, 44 * MB / PAGE, BY_PARENT, 1);
	check_shared("parent (before checkpoint)", region);

	nmaps = ferry_read_maps(maps, FERRY_MAX_MAPS);
	ferry_ready();
	ferry_wait_go();
	check_maps_same_deeper();
	check_region("parent: region", 0, 0, 1);
	ferry_check_fill("parent: small region", small, SMALL, 30);
	check_shared("parent", region);
	checked_wait_all("parent");
	ferry_reap_child(a, "child A", 0, 10000);
	ferry_reap_child(b, "child B", 0, 10000);
	ferry_finish();
}
