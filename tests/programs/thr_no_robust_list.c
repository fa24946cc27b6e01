/*
 * thr_no_robust_list: a thread without a robust futex list (as a Go or a
 * static program's threads have none).
 *
 * Sets up: the main thread drops the list glibc gave it
 * (set_robust_list(NULL)).
 * Verifies: get_robust_list still answers NULL: the thread a restore
 * rebuilds the process in had a list of its own, which the kernel would walk
 * in the restored memory when the thread exits.
 */
#include "ferry_test.h"

int main(void)
{
	void *head = (void *)1;
	size_t len = 0;
	FERRY_SYS(syscall(SYS_get_robust_list, 0, &head, &len));
	size_t want_len = len;
	FERRY_SYS(syscall(SYS_set_robust_list, NULL, want_len));

	ferry_ready();
	ferry_wait_go();

	head = (void *)1;
	len = 0;
	FERRY_SYS(syscall(SYS_get_robust_list, 0, &head, &len));
	FERRY_CHECK_EQ_HEX("robust list head", (void *)NULL, head);
	FERRY_CHECK_EQ("robust list length", want_len, len);
	ferry_finish();
}
