/*
 * proc_aio_kernel: kernel AIO contexts (io_setup), with completions left in
 * their rings.
 *
 * Sets up: three contexts of different sizes (io_setup with 1, 100 and 600
 * events: rings of one, two and ten pages here), reads of a regular file
 * submitted with io_submit on each and waited for (the ring's tail moves)
 * but not reaped (1, 3 and 5 of them); before them, on the middle one, reads
 * submitted and reaped until its head is at its last slot (its pending
 * completions wrap around the end of the ring), on the largest, around the
 * ring once and 10 slots more.
 * Verifies: every ring is where it was and the same size (the whole address
 * space compares equal), the context ids work: io_getevents returns exactly
 * the pending completions, in order, with their data, obj and res fields,
 * and the buffers hold what was read; a new io_submit and io_getevents work
 * on each context, and io_destroy works (io_getevents then says EINVAL).
 */
#include "ferry_test.h"
#include <linux/aio_abi.h>
#include <sys/syscall.h>

struct ring {
	unsigned id, nr, head, tail, magic, compat, incompat, header_length;
	struct io_event events[];
};

#define NCTX 3
#define MAXPEND 5
static const unsigned asked[NCTX] = {1, 100, 600};
static const int pending[NCTX] = {1, 3, 5};

static aio_context_t ctx[NCTX];
static struct iocb cbs[NCTX][MAXPEND];
static char bufs[NCTX][MAXPEND][64];
static char expect[4096];
static int fd;

static long io_setup(unsigned n, aio_context_t *c) { return syscall(SYS_io_setup, n, c); }
static long io_destroy(aio_context_t c) { return syscall(SYS_io_destroy, c); }
static long io_submit(aio_context_t c, long n, struct iocb **p) { return syscall(SYS_io_submit, c, n, p); }
static long io_getevents(aio_context_t c, long min, long n, struct io_event *ev, struct timespec *t)
{
	return syscall(SYS_io_getevents, c, min, n, ev, t);
}

static void prep(struct iocb *cb, char *buf, size_t len, off_t off, uint64_t data)
{
	memset(cb, 0, sizeof(*cb));
	cb->aio_data = data;
	cb->aio_lio_opcode = IOCB_CMD_PREAD;
	cb->aio_fildes = fd;
	cb->aio_buf = (uintptr_t)buf;
	cb->aio_nbytes = len;
	cb->aio_offset = off;
}

/* Submits one read and waits until the ring says it completed, without reaping it. */
static void submit_wait(int i, struct iocb *cb)
{
	struct ring *r = (struct ring *)ctx[i];
	unsigned tail = __atomic_load_n(&r->tail, __ATOMIC_ACQUIRE);
	struct iocb *p = cb;
	if (io_submit(ctx[i], 1, &p) != 1)
		ferry_die("io_submit on context %d: %s", i, strerror(errno));
	if (!FERRY_WAIT_UNTIL(__atomic_load_n(&r->tail, __ATOMIC_ACQUIRE) != tail, 5000))
		ferry_die("context %d: the read never completed", i);
}

int main(void)
{
	for (size_t k = 0; k < sizeof(expect); k++)
		expect[k] = (char)(k * 7 + 3);
	fd = FERRY_SYS(open("data", O_RDWR | O_CREAT | O_TRUNC, 0600));
	if (write(fd, expect, sizeof(expect)) != (ssize_t)sizeof(expect))
		ferry_die("write data");
	for (int i = 0; i < NCTX; i++)
		FERRY_SYS(io_setup(asked[i], &ctx[i]));
	/* Move the rings' heads and tails away from zero: the middle one's to its last
	 * slot (its pending completions wrap around the ring's end), the big one's around the
	 * ring once and 10 slots on. */
	for (int i = 1; i < NCTX; i++) {
		struct ring *r = (struct ring *)ctx[i];
		unsigned warm = i == 1 ? r->nr - 1 : r->nr + 10;
		static char sink[8];
		for (unsigned k = 0; k < warm; k++) {
			struct iocb cb, *p = &cb;
			struct io_event ev;
			prep(&cb, sink, sizeof(sink), k % 512, 1000 + k);
			if (io_submit(ctx[i], 1, &p) != 1)
				ferry_die("io_submit warm-up: %s", strerror(errno));
			if (io_getevents(ctx[i], 1, 1, &ev, NULL) != 1 || ev.data != 1000 + k)
				ferry_die("io_getevents warm-up: %s", strerror(errno));
		}
	}
	for (int i = 0; i < NCTX; i++)
		for (int j = 0; j < pending[i]; j++) {
			prep(&cbs[i][j], bufs[i][j], 16 + j, 100 * i + 10 * j, ((uint64_t)i << 32) | (j + 7));
			submit_wait(i, &cbs[i][j]);
		}
	struct ring snap[NCTX];
	for (int i = 0; i < NCTX; i++) {
		snap[i] = *(struct ring *)ctx[i];
		ferry_log("context %d at %llx: nr %u head %u tail %u", i, (unsigned long long)ctx[i], snap[i].nr,
			  snap[i].head, snap[i].tail);
	}
	struct ferry_map maps[FERRY_MAX_MAPS];
	int nmaps = ferry_read_maps(maps, FERRY_MAX_MAPS);

	ferry_ready();
	ferry_wait_go();

	ferry_check_maps_same(maps, nmaps);
	for (int i = 0; i < NCTX; i++) {
		struct ring *r = (struct ring *)ctx[i];
		FERRY_CHECK_EQ("ring size", snap[i].nr, r->nr);
		FERRY_CHECK_EQ("ring head", snap[i].head, r->head);
		FERRY_CHECK_EQ("ring tail", snap[i].tail, r->tail);
		FERRY_CHECK_EQ_HEX("ring magic", snap[i].magic, r->magic);
		FERRY_CHECK_EQ("ring header length", snap[i].header_length, r->header_length);
		struct io_event ev[MAXPEND + 1];
		struct timespec zero = {0, 0};
		long n = io_getevents(ctx[i], 0, MAXPEND + 1, ev, &zero);
		FERRY_CHECK(n == pending[i], "context %d: io_getevents gave %ld (%s), expected %d", i, n,
			    n < 0 ? strerror(errno) : "", pending[i]);
		for (int j = 0; j < n && j < pending[i]; j++) {
			FERRY_CHECK_EQ_HEX("event data", ((uint64_t)i << 32) | (j + 7), ev[j].data);
			FERRY_CHECK_EQ_HEX("event obj", (uintptr_t)&cbs[i][j], ev[j].obj);
			FERRY_CHECK_EQ("event res", 16 + j, ev[j].res);
			FERRY_CHECK_EQ("event res2", 0, ev[j].res2);
			FERRY_CHECK_MEM("data read", expect + 100 * i + 10 * j, bufs[i][j], 16 + j);
		}
		/* The context goes on: a new read, reaped. */
		char buf[32] = {0};
		struct iocb cb, *p = &cb;
		prep(&cb, buf, 20, 2000 + i, 0xabc0 + i);
		long s = io_submit(ctx[i], 1, &p);
		FERRY_CHECK(s == 1, "context %d: new io_submit gave %ld (%s)", i, s, s < 0 ? strerror(errno) : "");
		struct timespec five = {5, 0};
		n = io_getevents(ctx[i], 1, 2, ev, &five);
		FERRY_CHECK(n == 1, "context %d: new io_getevents gave %ld (%s)", i, n, n < 0 ? strerror(errno) : "");
		if (n == 1) {
			FERRY_CHECK_EQ_HEX("new event data", 0xabc0 + i, ev[0].data);
			FERRY_CHECK_EQ_HEX("new event obj", (uintptr_t)&cb, ev[0].obj);
			FERRY_CHECK_EQ("new event res", 20, ev[0].res);
			FERRY_CHECK_MEM("new data read", expect + 2000 + i, buf, 20);
		}
		FERRY_CHECK_EQ("ring head after", r->tail, r->head);
	}
	for (int i = 0; i < NCTX; i++) {
		FERRY_CHECK_EQ("io_destroy", 0, io_destroy(ctx[i]));
		struct io_event ev;
		struct timespec zero = {0, 0};
		errno = 0;
		long n = io_getevents(ctx[i], 0, 1, &ev, &zero);
		FERRY_CHECK(n == -1 && errno == EINVAL, "context %d after io_destroy: %ld (%s)", i, n,
			    strerror(errno));
	}
	close(fd);
	ferry_finish();
}
