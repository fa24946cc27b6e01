/*
 * mem_guard_prot_none: PROT_NONE memory.
 *
 * Sets up a 1 GiB PROT_NONE MAP_NORESERVE reservation with a 16-page RW
 * window mprotect'ed in its middle, and a RW region with a PROT_NONE guard
 * page between two data pages.
 * Verifies: maps unchanged (---p around rw-p), data intact, and touching the
 * guard page or the reservation faults with SIGSEGV at exactly that address
 * (si_code SEGV_ACCERR), while the neighbours are readable.
 */
#include "ferry_test.h"
#include <setjmp.h>

#define PG 4096UL

static struct ferry_map maps_before[FERRY_MAX_MAPS];
static sigjmp_buf jb;
static void *volatile fault_addr;
static volatile int fault_code;

static void on_segv(int sig, siginfo_t *si, void *uc)
{
	(void)sig, (void)uc;
	fault_addr = si->si_addr;
	fault_code = si->si_code;
	siglongjmp(jb, 1);
}

static void expect_fault(const char *what, volatile unsigned char *addr)
{
	fault_addr = NULL;
	if (sigsetjmp(jb, 1) == 0) {
		unsigned char v = *addr;
		(void)v;
		ferry_fail("%s: reading %p did not fault", what, (void *)addr);
		return;
	}
	FERRY_CHECK_EQ_HEX(what, addr, fault_addr);
	FERRY_CHECK_EQ("si_code", SEGV_ACCERR, fault_code);
}

int main(void)
{
	size_t rlen = 1UL << 30;
	unsigned char *res = FERRY_PTR(mmap(NULL, rlen, PROT_NONE,
					    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
	unsigned char *win = res + rlen / 2;
	FERRY_SYS(mprotect(win, 16 * PG, PROT_READ | PROT_WRITE));
	ferry_fill(win, 16 * PG, 80);

	unsigned char *g = FERRY_PTR(mmap(NULL, 3 * PG, PROT_READ | PROT_WRITE,
					  MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
	ferry_fill(g, PG, 81);
	ferry_fill(g + 2 * PG, PG, 82);
	FERRY_SYS(mprotect(g + PG, PG, PROT_NONE));

	struct sigaction sa = { .sa_sigaction = on_segv, .sa_flags = SA_SIGINFO | SA_NODEFER };
	FERRY_SYS(sigaction(SIGSEGV, &sa, NULL));

	int nmaps = ferry_read_maps(maps_before, FERRY_MAX_MAPS);
	ferry_ready();
	ferry_wait_go();

	ferry_check_maps_same(maps_before, nmaps);
	ferry_check_map("reservation below window", res, rlen / 2, "---p");
	ferry_check_map("window", win, 16 * PG, "rw-p");
	ferry_check_map("reservation above window", win + 16 * PG, rlen / 2 - 16 * PG, "---p");
	ferry_check_map("guard page", g + PG, PG, "---p");
	ferry_check_fill("window", win, 16 * PG, 80);
	ferry_check_fill("page before guard", g, PG, 81);
	ferry_check_fill("page after guard", g + 2 * PG, PG, 82);
	expect_fault("fault address in guard page", g + PG + 123);
	expect_fault("fault address below window", win - 1);
	expect_fault("fault address above window", win + 16 * PG);
	expect_fault("fault address at reservation start", res);
	ferry_finish();
}
