/*
 * proc_aio_inflight: a kernel AIO request still in flight at the freeze,
 * which completes while the process is frozen.
 *
 * Sets up: an inotify instance watching this process's /proc/PID/pagemap
 * for reads and opens, and on a kernel AIO context an IOCB_CMD_POLL request
 * for that instance becoming readable (its descriptor then closed: the
 * request holds it): in flight until someone reads the
 * pagemap (a capture of the process's memory does, after it has read the
 * ring), so its completion lands in the ring while the process is frozen.
 * Verifies: reading the pagemap itself (natively the request is still in
 * flight then), the poll's completion comes, with its data and POLLIN, and
 * the context goes on.
 */
#include "ferry_test.h"
#include <linux/aio_abi.h>
#include <poll.h>
#include <sys/inotify.h>
#include <sys/syscall.h>

static aio_context_t ctx;
static struct iocb cb;

int main(void)
{
	int in = FERRY_SYS(inotify_init1(IN_NONBLOCK | IN_CLOEXEC));
	FERRY_SYS(inotify_add_watch(in, "/proc/self/pagemap", IN_ACCESS | IN_OPEN));
	FERRY_SYS(syscall(SYS_io_setup, 8, &ctx));
	cb.aio_data = 77;
	cb.aio_lio_opcode = IOCB_CMD_POLL;
	cb.aio_fildes = in;
	cb.aio_buf = POLLIN;
	struct iocb *p = &cb;
	FERRY_SYS(syscall(SYS_io_submit, ctx, 1, &p));
	struct io_event ev;
	struct timespec zero = {0, 0};
	if (syscall(SYS_io_getevents, ctx, 0, 1, &ev, &zero) != 0)
		ferry_die("the poll completed before anything read the pagemap");
	/* The request holds the instance: no descriptor of it is left to capture. */
	close(in);

	ferry_ready();
	ferry_wait_go();

	char buf[8];
	int pm = FERRY_SYS(open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC));
	FERRY_CHECK(pread(pm, buf, sizeof(buf), 0) == sizeof(buf), "read the pagemap");
	close(pm);
	struct timespec five = {5, 0};
	long n = syscall(SYS_io_getevents, ctx, 1, 1, &ev, &five);
	FERRY_CHECK(n == 1, "io_getevents %ld (%s)", n, n < 0 ? strerror(errno) : "");
	if (n == 1) {
		FERRY_CHECK_EQ_HEX("poll data", 77, ev.data);
		FERRY_CHECK_EQ_HEX("poll obj", (uintptr_t)&cb, ev.obj);
		FERRY_CHECK(ev.res & POLLIN, "poll res %lld", (long long)ev.res);
	}
	FERRY_CHECK_EQ("io_destroy", 0, syscall(SYS_io_destroy, ctx));
	ferry_finish();
}
