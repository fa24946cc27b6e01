/*
 * sleepers: a victim for migration tests whose threads are always asleep with a deadline.
 *
 *     sleepers MIB DIR
 *
 * Holds MIB of memory with a pattern that compresses (one byte in each 8 varies). Three threads sleep again and again for 2 s each: one in
 * nanosleep (relative, with a `rem`), one in a futex wait with a relative timeout on a word
 * nobody wakes, one in poll on a pipe nobody writes to, with a timeout; the main thread naps
 * 20 ms at a time (usleep) until DIR/stop exists. The kernel resumes each of these calls after
 * a stop with `restart_syscall`, so whenever the tree is frozen, a thread is caught in one.
 * Every call must end as its deadline says (0, ETIMEDOUT, 0 ready descriptors), never with
 * EINTR, and never before its deadline on CLOCK_MONOTONIC.
 *
 * Writes DIR/ready once its threads run, then, at DIR/stop, DIR/result: "PASS N" (N: sleeps
 * that ended) or "FAIL: what", and exits 0 or 1.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/futex.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define SLEEP_NS 2000000000ull

static char dir[4096];
static volatile int stop;
static char failure[512];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned long ended;
static int pipe_fds[2];

static uint64_t now_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (uint64_t)t.tv_sec * 1000000000ull + t.tv_nsec;
}

__attribute__((format(printf, 1, 2))) static void fail(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	pthread_mutex_lock(&lock);
	if (!failure[0])
		vsnprintf(failure, sizeof failure, fmt, ap);
	pthread_mutex_unlock(&lock);
	va_end(ap);
}

/* One sleep of `who`: `rc` and `err` what it returned, `want` the result expected. */
static void check(const char *who, uint64_t start, long rc, int err, long want, int want_err)
{
	uint64_t took = now_ns() - start;
	if (rc < 0 && err == EINTR)
		fail("%s failed with EINTR after %.3f s", who, took / 1e9);
	else if (rc != want || (rc < 0 && err != want_err))
		fail("%s returned %ld (%s), expected %ld", who, rc, rc < 0 ? strerror(err) : "-", want);
	else if (took < SLEEP_NS)
		fail("%s ended after %.3f s, before its deadline (%.3f s)", who, took / 1e9, SLEEP_NS / 1e9);
	pthread_mutex_lock(&lock);
	ended++;
	pthread_mutex_unlock(&lock);
}

static void *nanosleeper(void *arg)
{
	(void)arg;
	while (!stop) {
		struct timespec d = { SLEEP_NS / 1000000000ull, SLEEP_NS % 1000000000ull }, rem;
		uint64_t start = now_ns();
		int rc = nanosleep(&d, &rem);
		check("nanosleep", start, rc, rc ? errno : 0, 0, 0);
	}
	return NULL;
}

static void *futex_waiter(void *arg)
{
	(void)arg;
	static uint32_t word;
	while (!stop) {
		struct timespec d = { SLEEP_NS / 1000000000ull, SLEEP_NS % 1000000000ull };
		uint64_t start = now_ns();
		long rc = syscall(SYS_futex, &word, FUTEX_WAIT_PRIVATE, 0, &d, NULL, 0);
		check("futex wait with a timeout", start, rc, rc ? errno : 0, -1, ETIMEDOUT);
	}
	return NULL;
}

static void *poller(void *arg)
{
	(void)arg;
	while (!stop) {
		struct pollfd p = { .fd = pipe_fds[0], .events = POLLIN };
		uint64_t start = now_ns();
		int rc = poll(&p, 1, SLEEP_NS / 1000000);
		check("poll with a timeout", start, rc, rc < 0 ? errno : 0, 0, 0);
	}
	return NULL;
}

static int exists(const char *name)
{
	char p[4200];
	snprintf(p, sizeof p, "%s/%s", dir, name);
	return access(p, F_OK) == 0;
}

static void put(const char *name, const char *text)
{
	char p[4200], tmp[4200];
	snprintf(p, sizeof p, "%s/%s", dir, name);
	snprintf(tmp, sizeof tmp, "%s/%s.tmp", dir, name);
	FILE *f = fopen(tmp, "w");
	if (!f || fputs(text, f) < 0 || fclose(f) || rename(tmp, p)) {
		perror(p);
		exit(2);
	}
}

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: sleepers MIB DIR\n");
		return 2;
	}
	snprintf(dir, sizeof dir, "%s", argv[2]);
	size_t len = (size_t)atol(argv[1]) << 20;
	unsigned long *mem = malloc(len ? len : 8);
	size_t words = len / sizeof *mem;
	for (size_t i = 0; i < words; i++)
		mem[i] = ((i * 2654435761UL) & 0xff) | 1;
	if (pipe(pipe_fds)) {
		perror("pipe");
		return 2;
	}
	pthread_t t[3];
	if (pthread_create(&t[0], NULL, nanosleeper, NULL) || pthread_create(&t[1], NULL, futex_waiter, NULL) ||
	    pthread_create(&t[2], NULL, poller, NULL)) {
		fprintf(stderr, "pthread_create failed\n");
		return 2;
	}
	usleep(100000);
	put("ready", "ready\n");
	while (!exists("stop")) {
		uint64_t start = now_ns();
		if (usleep(20000))
			fail("usleep (main thread) failed: %s after %.3f s", strerror(errno),
			     (now_ns() - start) / 1e9);
	}
	stop = 1;
	for (int i = 0; i < 3; i++)
		pthread_join(t[i], NULL);
	for (size_t i = 0; i < words; i++)
		if (mem[i] != (((i * 2654435761UL) & 0xff) | 1)) {
			fail("memory word %zu differs", i);
			break;
		}
	char out[600];
	if (failure[0])
		snprintf(out, sizeof out, "FAIL: %s\n", failure);
	else
		snprintf(out, sizeof out, "PASS %lu\n", ended);
	put("result", out);
	return failure[0] ? 1 : 0;
}
