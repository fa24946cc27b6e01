/*
 * proc_aio_forked: a child forked after io_setup, which keeps its parent's
 * kernel AIO ring mapped without the context.
 *
 * Sets up: a context with one completion left in its ring, then a child
 * (forked after it) that waits for go.
 * Verifies: the parent's context still gives its completion and works; the
 * child still sees the ring at the same address and the completion in it,
 * and io_getevents on that id says EINVAL there (the context is not its).
 */
#include "ferry_test.h"
#include <linux/aio_abi.h>
#include <sys/syscall.h>

struct ring {
	unsigned id, nr, head, tail, magic, compat, incompat, header_length;
	struct io_event events[];
};

static aio_context_t ctx;
static struct iocb cb;
static char buf[32];

static long getevents(long min, long n, struct io_event *ev, struct timespec *t)
{
	return syscall(SYS_io_getevents, ctx, min, n, ev, t);
}

int main(void)
{
	int fd = FERRY_SYS(open("data", O_RDWR | O_CREAT | O_TRUNC, 0600));
	if (write(fd, "0123456789abcdefghij", 20) != 20)
		ferry_die("write data");
	FERRY_SYS(syscall(SYS_io_setup, 8, &ctx));
	struct ring *r = (struct ring *)ctx;
	cb.aio_data = 42;
	cb.aio_lio_opcode = IOCB_CMD_PREAD;
	cb.aio_fildes = fd;
	cb.aio_buf = (uintptr_t)buf;
	cb.aio_nbytes = 10;
	struct iocb *p = &cb;
	FERRY_SYS(syscall(SYS_io_submit, ctx, 1, &p));
	if (!FERRY_WAIT_UNTIL(__atomic_load_n(&r->tail, __ATOMIC_ACQUIRE) == 1, 5000))
		ferry_die("the read never completed");
	pid_t child = FERRY_SYS(fork());
	if (child == 0) {
		ferry_wait_go();
		FERRY_CHECK_EQ("child: ring tail", 1, r->tail);
		FERRY_CHECK_EQ_HEX("child: completion data", 42, r->events[0].data);
		struct timespec zero = {0, 0};
		struct io_event ev;
		errno = 0;
		long n = getevents(0, 1, &ev, &zero);
		FERRY_CHECK(n == -1 && errno == EINVAL, "child: io_getevents %ld (%s)", n, strerror(errno));
		ferry_child_finish();
	}

	ferry_ready();
	ferry_wait_go();

	struct io_event ev;
	struct timespec five = {5, 0};
	long n = getevents(1, 1, &ev, &five);
	FERRY_CHECK(n == 1, "io_getevents %ld (%s)", n, n < 0 ? strerror(errno) : "");
	FERRY_CHECK_EQ_HEX("completion data", 42, ev.data);
	FERRY_CHECK_EQ("completion res", 10, ev.res);
	FERRY_CHECK_MEM("data read", "0123456789", buf, 10);
	ferry_reap_child(child, "child", 0, 10000);
	FERRY_CHECK_EQ("io_destroy", 0, syscall(SYS_io_destroy, ctx));
	ferry_finish();
}
