/*
 * proc_aio_posix: glibc's POSIX AIO (aio_read, aio_error, aio_return,
 * aio_suspend), which glibc runs on threads of its own.
 *
 * Sets up: aio_init keeping idle helper threads for a minute; an aio_read of
 * a regular file that has completed but whose result is not yet taken; an
 * aio_read of an empty pipe, still in progress (its helper thread sleeps in
 * read); an aio_write to a file, completed.
 * Verifies: the completed requests say 0 to aio_error and their byte counts
 * to aio_return, with the data read; the pending one still says EINPROGRESS,
 * then, once the pipe is written, aio_suspend returns and it reads exactly
 * what was written; a new aio_read works.
 */
#include "ferry_test.h"
#include <aio.h>

static char expect[4096];

static void check_done(const char *what, struct aiocb *cb, ssize_t want)
{
	FERRY_CHECK(aio_error(cb) == 0, "%s: aio_error %d", what, aio_error(cb));
	FERRY_CHECK(aio_return(cb) == want, "%s: aio_return differs", what);
}

int main(void)
{
	for (size_t k = 0; k < sizeof(expect); k++)
		expect[k] = (char)(k * 13 + 1);
	int fd = FERRY_SYS(open("data", O_RDWR | O_CREAT | O_TRUNC, 0600));
	if (write(fd, expect, sizeof(expect)) != (ssize_t)sizeof(expect))
		ferry_die("write data");
	int out = FERRY_SYS(open("out", O_RDWR | O_CREAT | O_TRUNC, 0600));
	int p[2];
	FERRY_SYS(pipe(p));
	struct aioinit init = {.aio_threads = 4, .aio_num = 16, .aio_idle_time = 60};
	aio_init(&init);

	static char rbuf[100], pbuf[64], nbuf[50];
	struct aiocb rd = {.aio_fildes = fd, .aio_buf = rbuf, .aio_nbytes = sizeof(rbuf), .aio_offset = 1000};
	struct aiocb wr = {.aio_fildes = out, .aio_buf = expect, .aio_nbytes = 300, .aio_offset = 0};
	struct aiocb pr = {.aio_fildes = p[0], .aio_buf = pbuf, .aio_nbytes = sizeof(pbuf)};
	FERRY_SYS(aio_read(&rd));
	FERRY_SYS(aio_write(&wr));
	if (!FERRY_WAIT_UNTIL(aio_error(&rd) != EINPROGRESS && aio_error(&wr) != EINPROGRESS, 5000))
		ferry_die("the file requests never completed");
	FERRY_SYS(aio_read(&pr));
	ferry_sleep_ms(20);
	if (aio_error(&pr) != EINPROGRESS)
		ferry_die("the pipe read did not wait: %d", aio_error(&pr));

	ferry_ready();
	ferry_wait_go();

	check_done("file read", &rd, sizeof(rbuf));
	FERRY_CHECK_MEM("file read data", expect + 1000, rbuf, sizeof(rbuf));
	check_done("file write", &wr, 300);
	char back[300];
	FERRY_CHECK(pread(out, back, 300, 0) == 300, "read back the file written");
	FERRY_CHECK_MEM("file written", expect, back, 300);
	FERRY_CHECK_EQ("pipe read still in progress", EINPROGRESS, aio_error(&pr));
	const char msg[] = "through the pipe, after the move";
	FERRY_CHECK(write(p[1], msg, sizeof(msg)) == sizeof(msg), "write the pipe");
	const struct aiocb *list[1] = {&pr};
	struct timespec ten = {10, 0};
	FERRY_CHECK_EQ("aio_suspend", 0, aio_suspend(list, 1, &ten));
	check_done("pipe read", &pr, sizeof(msg));
	FERRY_CHECK_MEM("pipe read data", msg, pbuf, sizeof(msg));

	struct aiocb nr = {.aio_fildes = fd, .aio_buf = nbuf, .aio_nbytes = sizeof(nbuf), .aio_offset = 3000};
	FERRY_CHECK_EQ("new aio_read", 0, aio_read(&nr));
	list[0] = &nr;
	FERRY_CHECK_EQ("aio_suspend new", 0, aio_suspend(list, 1, &ten));
	check_done("new read", &nr, sizeof(nbuf));
	FERRY_CHECK_MEM("new read data", expect + 3000, nbuf, sizeof(nbuf));
	ferry_finish();
}
