/*
 * lazychanger: a victim for lazy migration. Holds MIB (argv[1]) of private anonymous memory,
 * every page filled with a pattern of its index, and writes "ready" to STATUS (argv[2]). It
 * watches its own PID namespace (/proc/self/ns/pid): a migration rebuilds it in a new one.
 * As soon as it runs there, while most of its pages are still owed by the source, it changes
 * its mappings and checks every page it can still see:
 *   - eight threads read the same pages at the same moment (each page faulted by all at once);
 *   - a 16 MiB piece is moved with mremap (MREMAP_MAYMOVE|MREMAP_FIXED) and checked there;
 *   - a piece is unmapped; one is dropped with madvise(MADV_DONTNEED) (must read zeros); one is
 *     made read-only with mprotect and checked;
 *   - the rest is checked page by page;
 *   - a forked child checks all it can see again and exits 0 (bad: its status).
 * Then it writes "result=ok" (or "result=bad WHAT") to STATUS and sleeps.
 * With a third argument, "dirty", it rewrites (with the same bytes) one word of each of the
 * first three quarters of its pages every millisecond until it has moved: a pre-copy's rounds
 * find those pages written every time, so a hybrid migration leaves them to its lazy phase and
 * sends the last quarter ahead.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096UL
#define WORDS (PAGE / 8)

static uint8_t *mem;
static uint64_t pages;
static const char *status_path;
static pthread_barrier_t barrier;

static uint64_t word(uint64_t page, uint64_t w)
{
	return (page * 0x9E3779B97F4A7C15ULL) ^ (w * 40503ULL) ^ 0xA5;
}

static int check_page(const uint8_t *p, uint64_t page)
{
	const uint64_t *q = (const uint64_t *)p;
	for (uint64_t w = 0; w < WORDS; w++)
		if (q[w] != word(page, w))
			return 0;
	return 1;
}

static int zero_page(const uint8_t *p)
{
	const uint64_t *q = (const uint64_t *)p;
	for (uint64_t w = 0; w < WORDS; w++)
		if (q[w])
			return 0;
	return 1;
}

static void say(const char *what)
{
	int fd = open(status_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	if (fd >= 0) {
		if (write(fd, what, strlen(what)) < 0) {
		}
		close(fd);
	}
}

static void bad(const char *what, uint64_t page)
{
	char buf[200];
	snprintf(buf, sizeof buf, "result=bad %s page=%lu\n", what, (unsigned long)page);
	say(buf);
	for (;;)
		pause();
}

/* The pages from 0 to 255 are read by every thread at once. */
static void *reader(void *arg)
{
	(void)arg;
	pthread_barrier_wait(&barrier);
	for (uint64_t i = 0; i < 256; i++)
		if (!check_page(mem + i * PAGE, i))
			return (void *)1;
	return NULL;
}

/* Every page outside the pieces changed after the move (see main) has its pattern; the
 * dropped ones read as zeros. */
static void check_rest(uint64_t base)
{
	for (uint64_t i = 0; i < pages; i++) {
		if (i >= 1024 && i < base)
			continue;
		if (i >= base + 100 && i < base + 200)
			continue;
		if (i >= base + 300 && i < base + 400) {
			if (!zero_page(mem + i * PAGE))
				bad("dropped", i);
			continue;
		}
		if (!check_page(mem + i * PAGE, i))
			bad("kept", i);
	}
}

static void ns_of(char *buf, size_t n)
{
	ssize_t r = readlink("/proc/self/ns/pid", buf, n - 1);
	buf[r < 0 ? 0 : r] = 0;
}

int main(int argc, char **argv)
{
	if (argc != 3 && !(argc == 4 && !strcmp(argv[3], "dirty"))) {
		fprintf(stderr, "usage: lazychanger MIB STATUS [dirty]\n");
		return 2;
	}
	int dirty = argc == 4;
	pages = ((uint64_t)atol(argv[1]) << 20) / PAGE;
	status_path = argv[2];
	if (pages < 8192)
		pages = 8192; /* 32 MiB at least: the pieces below must fit */
	mem = mmap(NULL, pages * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (mem == MAP_FAILED)
		return 1;
	for (uint64_t i = 0; i < pages; i++) {
		uint64_t *q = (uint64_t *)(mem + i * PAGE);
		for (uint64_t w = 0; w < WORDS; w++)
			q[w] = word(i, w);
	}
	/* A place for the moved piece, reserved now so that its address is free later. */
	uint64_t piece = 4096; /* 16 MiB */
	uint8_t *dest = mmap(NULL, piece * PAGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	char home[128], now[128];
	ns_of(home, sizeof home);
	say("ready\n");
	for (;;) {
		ns_of(now, sizeof now);
		if (strcmp(home, now))
			break;
		for (uint64_t i = 0; dirty && i < pages / 4 * 3; i++) {
			volatile uint64_t *q = (volatile uint64_t *)(mem + i * PAGE);
			*q = *q;
		}
		usleep(1000);
	}
	/* Moved: most pages are still at the source. */
	pthread_t t[8];
	pthread_barrier_init(&barrier, NULL, 8);
	for (int i = 0; i < 8; i++)
		pthread_create(&t[i], NULL, reader, NULL);
	for (int i = 0; i < 8; i++) {
		void *r;
		pthread_join(t[i], &r);
		if (r)
			bad("threads", 0);
	}
	/* Pieces: [1024, 1024+piece) moved; [6000, 6100) unmapped; [7000, 7100) dropped;
	 * [7500, 7600) read-only. */
	uint8_t *moved = mremap(mem + 1024 * PAGE, piece * PAGE, piece * PAGE,
				MREMAP_MAYMOVE | MREMAP_FIXED, dest);
	if (moved == MAP_FAILED)
		bad("mremap", 0);
	for (uint64_t i = 0; i < piece; i++)
		if (!check_page(moved + i * PAGE, 1024 + i))
			bad("moved", 1024 + i);
	uint64_t base = 1024 + piece;
	if (munmap(mem + (base + 100) * PAGE, 100 * PAGE))
		bad("munmap", 0);
	if (madvise(mem + (base + 300) * PAGE, 100 * PAGE, MADV_DONTNEED))
		bad("madvise", 0);
	if (mprotect(mem + (base + 500) * PAGE, 100 * PAGE, PROT_READ))
		bad("mprotect", 0);
	check_rest(base);
	/* A child forked now checks what its parent sees. (A fork in a body waits for its home
	 * to make the child's deputy, which it can once the original is a deputy: after a lazy
	 * migration's phase.) */
	pid_t child = fork();
	if (child == 0) {
		/* (A page found wrong says so in STATUS, as the parent's would.) */
		for (uint64_t i = 0; i < piece; i++)
			if (!check_page(moved + i * PAGE, 1024 + i))
				bad("child: moved", 1024 + i);
		check_rest(base);
		_exit(0);
	}
	int st;
	if (waitpid(child, &st, 0) != child || !WIFEXITED(st) || WEXITSTATUS(st))
		bad("child", 0);
	say("result=ok\n");
	for (;;)
		pause();
}
