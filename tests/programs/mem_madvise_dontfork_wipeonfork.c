/*
 * mem_madvise_dontfork_wipeonfork: VMA flags set by madvise().
 *
 * Sets up three 4-page anon regions with a pattern: MADV_DONTFORK ("dc"),
 * MADV_WIPEONFORK ("wf") and MADV_DONTDUMP ("dd").
 * Verifies: the VmFlags are still set, the contents are intact, and in a
 * child forked after restore the DONTFORK region is absent, the WIPEONFORK
 * region reads zero, and the DONTDUMP region holds the pattern.
 */
#include "ferry_test.h"

#define LEN (4 * 4096UL)

int main(void)
{
	unsigned char *df = FERRY_PTR(mmap(NULL, LEN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
	unsigned char *wf = FERRY_PTR(mmap(NULL, LEN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
	unsigned char *dd = FERRY_PTR(mmap(NULL, LEN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
	ferry_fill(df, LEN, 100);
	ferry_fill(wf, LEN, 101);
	ferry_fill(dd, LEN, 102);
	FERRY_SYS(madvise(df, LEN, MADV_DONTFORK));
	FERRY_SYS(madvise(wf, LEN, MADV_WIPEONFORK));
	FERRY_SYS(madvise(dd, LEN, MADV_DONTDUMP));
	if (ferry_has_vmflag(df, "dc") != 1 || ferry_has_vmflag(wf, "wf") != 1 ||
	    ferry_has_vmflag(dd, "dd") != 1)
		ferry_die("VmFlags not as expected before checkpoint");

	ferry_ready();
	ferry_wait_go();

	FERRY_CHECK_EQ("DONTFORK region VmFlags has dc", 1, ferry_has_vmflag(df, "dc"));
	FERRY_CHECK_EQ("WIPEONFORK region VmFlags has wf", 1, ferry_has_vmflag(wf, "wf"));
	FERRY_CHECK_EQ("DONTDUMP region VmFlags has dd", 1, ferry_has_vmflag(dd, "dd"));
	ferry_check_fill("DONTFORK region", df, LEN, 100);
	ferry_check_fill("WIPEONFORK region", wf, LEN, 101);
	ferry_check_fill("DONTDUMP region", dd, LEN, 102);

	pid_t child = FERRY_SYS(fork());
	if (child == 0) {
		struct ferry_map m;
		FERRY_CHECK(ferry_find_map(df, &m) < 0, "child: DONTFORK region %p is mapped", (void *)df);
		ferry_check_zero("child: WIPEONFORK region", wf, LEN);
		ferry_check_fill("child: DONTDUMP region", dd, LEN, 102);
		ferry_child_finish();
	}
	ferry_reap_child(child, "fork child", 0, 5000);
	ferry_finish();
}
