/*
 * selfcheck: a multi-threaded victim that watches its own state, for the tests that kill
 * ferry's engine worker in the middle of a checkpoint or a migration. Every thread has a
 * signal mask of its own and checks it on every round:
 *   - main (SIGUSR2 blocked): every 10 ms checks a slice of an 8 MiB pattern, writes the next
 *     byte into a pipe, wakes the waiter, and rewrites one line in STATUS (argv[1]):
 *         count=N sigs=S ok=1 why=-
 *   - reader (SIGUSR1 and SIGPIPE blocked): blocked in read() on that pipe, checks that the
 *     bytes come in sequence, none lost, none twice;
 *   - waiter (SIGHUP blocked): blocked in pthread_cond_wait (a futex wait without a deadline),
 *     checks that the main thread's round counter only moves forward;
 *   - spinner (nothing blocked): sums in floating-point registers in bursts (its FPU state must
 *     survive being stopped anywhere), sleeping 2 ms between bursts.
 * A SIGUSR1 handler counts the signals the process receives (`sigs`). Once anything is wrong,
 * `ok` stays 0 and `why` says what.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MEM_WORDS ((8u << 20) / sizeof(unsigned long))

static unsigned long *mem;
static int pipefd[2];
static atomic_ulong sigs;
static const char *volatile why = "-";
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
static unsigned long round_no;
static volatile long burst = 200000;

static void fail(const char *what)
{
	if (why[0] == '-')
		why = what;
}

static void on_usr1(int sig)
{
	(void)sig;
	atomic_fetch_add(&sigs, 1);
}

/* Sets this thread's mask to exactly `blocked`. */
static void set_mask(const int *blocked)
{
	sigset_t s;
	sigemptyset(&s);
	for (; *blocked; blocked++)
		sigaddset(&s, *blocked);
	pthread_sigmask(SIG_SETMASK, &s, NULL);
}

/* Fails with `what` unless this thread's mask is exactly `blocked`. */
static void check_mask(const int *blocked, const char *what)
{
	sigset_t want, now;
	sigemptyset(&want);
	for (; *blocked; blocked++)
		sigaddset(&want, *blocked);
	pthread_sigmask(SIG_BLOCK, NULL, &now);
	for (int s = 1; s < 65; s++)
		if (sigismember(&want, s) != sigismember(&now, s)) {
			fail(what);
			return;
		}
}

static const int reader_mask[] = {SIGUSR1, SIGPIPE, 0};
static void *reader(void *arg)
{
	(void)arg;
	set_mask(reader_mask);
	unsigned char want = 0;
	for (;;) {
		unsigned char b;
		ssize_t n = read(pipefd[0], &b, 1);
		if (n < 0 && errno == EINTR)
			continue;
		if (n != 1) {
			fail("pipe-read");
			return NULL;
		}
		if (b != want)
			fail("pipe-sequence");
		want = b + 1;
		check_mask(reader_mask, "mask-reader");
	}
}

static const int waiter_mask[] = {SIGHUP, 0};
static void *waiter(void *arg)
{
	(void)arg;
	set_mask(waiter_mask);
	unsigned long seen = 0;
	pthread_mutex_lock(&lock);
	for (;;) {
		pthread_cond_wait(&cond, &lock);
		if (round_no < seen)
			fail("waiter-round");
		seen = round_no;
		check_mask(waiter_mask, "mask-waiter");
	}
}

static const int spinner_mask[] = {0};
static void *spinner(void *arg)
{
	(void)arg;
	set_mask(spinner_mask);
	for (;;) {
		long n = burst;
		double s = 0.0, one = 1.0;
		for (long i = 0; i < n; i++)
			s += one;
		if (s != (double)n)
			fail("fpu");
		check_mask(spinner_mask, "mask-spinner");
		struct timespec ts = {0, 2000000};
		nanosleep(&ts, NULL);
	}
}

static const int main_mask[] = {SIGUSR2, 0};
int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: selfcheck STATUS\n");
		return 2;
	}
	mem = malloc(MEM_WORDS * sizeof *mem);
	for (size_t i = 0; i < MEM_WORDS; i++)
		mem[i] = i * 2654435761UL;
	int fd = open(argv[1], O_WRONLY | O_CREAT | O_TRUNC, 0644);
	if (fd < 0 || pipe(pipefd) < 0) {
		perror("selfcheck: setup");
		return 2;
	}
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = on_usr1;
	sa.sa_flags = SA_RESTART;
	sigaction(SIGUSR1, &sa, NULL);
	set_mask(main_mask);
	pthread_t t;
	pthread_create(&t, NULL, reader, NULL);
	pthread_create(&t, NULL, waiter, NULL);
	pthread_create(&t, NULL, spinner, NULL);
	size_t at = 0, slice = MEM_WORDS / 100;
	for (unsigned long count = 0;; count++) {
		for (size_t n = 0; n < slice; n++, at = (at + 1) % MEM_WORDS)
			if (mem[at] != at * 2654435761UL)
				fail("memory");
		check_mask(main_mask, "mask-main");
		unsigned char b = (unsigned char)count;
		if (write(pipefd[1], &b, 1) != 1)
			fail("pipe-write");
		pthread_mutex_lock(&lock);
		round_no = count;
		pthread_cond_signal(&cond);
		pthread_mutex_unlock(&lock);
		char line[128];
		int len = snprintf(line, sizeof line, "count=%lu sigs=%lu ok=%d why=%s",
				   count, atomic_load(&sigs), why[0] == '-', why);
		memset(line + len, ' ', sizeof line - 1 - len);
		line[sizeof line - 1] = '\n';
		pwrite(fd, line, sizeof line, 0);
		struct timespec ts = {0, 10000000};
		while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
			;
	}
}
