/*
 * mem_growsdown: grows-down memory (the main stack and a MAP_GROWSDOWN map).
 *
 * Sets up a deep-ish main stack (a 256 KiB frame with a pattern, live while
 * waiting), and a 4-page MAP_GROWSDOWN region at a fixed address with free
 * space below it.
 * Verifies: the [stack] mapping keeps its bounds and label and "gd" VmFlag,
 * /proc/self/stat startstack is unchanged, the stack frame's pattern is
 * intact, the stack still grows on demand (a 4 MiB frame after restore),
 * and the MAP_GROWSDOWN region keeps "gd" and grows when touched below.
 */
#include "ferry_test.h"

#define PG 4096UL
#define GD_ADDR ((unsigned char *)0x3e0000800000UL)

static struct ferry_map maps_before[FERRY_MAX_MAPS];

static unsigned long startstack(void)
{
	char buf[2048];
	if (ferry_read_file("/proc/self/stat", buf, sizeof buf) < 0)
		return 0;
	char *p = strrchr(buf, ')') + 2;
	for (int i = 3; i < 28 && p; i++) {
		p = strchr(p, ' ');
		if (p)
			p++;
	}
	return p ? strtoul(p, NULL, 10) : 0;
}

__attribute__((noinline)) static int deep_use(size_t n)
{
	volatile unsigned char *big = alloca(n);
	for (size_t i = 0; i < n; i += PG)
		big[i] = (unsigned char)i;
	big[n - 1] = 9;
	return big[0] + big[n - 1];
}

__attribute__((noinline)) static void body(void)
{
	unsigned char frame[256 * 1024];
	ferry_fill(frame, sizeof frame, 90);

	unsigned char *gd = FERRY_PTR(mmap(GD_ADDR, 4 * PG, PROT_READ | PROT_WRITE,
					   MAP_PRIVATE | MAP_ANONYMOUS | MAP_GROWSDOWN | MAP_FIXED_NOREPLACE,
					   -1, 0));
	if (gd != GD_ADDR)
		ferry_die("MAP_GROWSDOWN region landed at %p", (void *)gd);
	ferry_fill(gd, 4 * PG, 91);

	struct ferry_map stk;
	if (ferry_find_map(frame, &stk) < 0)
		ferry_die("no mapping for the stack");
	unsigned long ss = startstack();
	int nmaps = ferry_read_maps(maps_before, FERRY_MAX_MAPS);

	ferry_ready();
	ferry_wait_go();

	ferry_check_maps_same(maps_before, nmaps);
	struct ferry_map now;
	if (ferry_find_map(frame, &now) == 0) {
		FERRY_CHECK_EQ_STR("stack label", "[stack]", now.path);
		FERRY_CHECK_EQ_HEX("stack start", stk.start, now.start);
		FERRY_CHECK_EQ_HEX("stack end", stk.end, now.end);
		FERRY_CHECK_EQ("stack VmFlags has gd", 1, ferry_has_vmflag((void *)now.start, "gd"));
	} else {
		ferry_fail("stack mapping gone");
	}
	FERRY_CHECK_EQ_HEX("startstack", ss, startstack());
	ferry_check_fill("stack frame", frame, sizeof frame, 90);

	/* The stack still grows. */
	FERRY_CHECK_EQ("deep stack use", 9, deep_use(4UL << 20));
	if (ferry_find_map(frame, &now) == 0)
		FERRY_CHECK(now.start < stk.start, "stack did not grow: start %#lx, was %#lx", now.start,
			    stk.start);

	/* The MAP_GROWSDOWN region keeps its flag and grows when touched below. */
	FERRY_CHECK_EQ("MAP_GROWSDOWN region VmFlags has gd", 1, ferry_has_vmflag(gd, "gd"));
	ferry_check_fill("MAP_GROWSDOWN region", gd, 4 * PG, 91);
	volatile unsigned char *below = gd - 3 * PG;
	*below = 0x33;
	if (ferry_find_map((void *)below, &now) == 0)
		FERRY_CHECK_EQ_HEX("grown region start", (unsigned long)(gd - 3 * PG), now.start);
	else
		ferry_fail("MAP_GROWSDOWN region did not grow");
	FERRY_CHECK_EQ("byte in grown part", 0x33, *below);
}

int main(void)
{
	body();
	ferry_finish();
}
