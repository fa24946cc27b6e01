/*
 * sparse: a victim for lazy migration with sparse memory. Maps MIB (argv[1]) of private
 * anonymous memory and, in it, page by page (i mod 4):
 *   0: written with a pattern of its index;
 *   1: never touched;
 *   2: written, then dropped with madvise(MADV_DONTNEED) (reads zeros);
 *   3: read, never written (the kernel's zero page);
 * but for a run of 1024 pages in the middle never touched at all. Beside it, a reservation of
 * RESERVE MiB (argv[3]) of which only the first and the last page are written. Then it writes
 * "ready" to STATUS (argv[2]) and watches its own PID namespace (/proc/self/ns/pid): a
 * migration rebuilds it in a new one. As soon as it runs there, while its pages are still
 * owed by the source, it checks every page of the first mapping and every 64th page of the
 * reservation (the written ones have their pattern, every other page reads zeros), then
 * writes a pattern into each page that read zeros and checks it again (a page served as a
 * hole must take writes), and writes "result=ok" (or "result=bad WHAT page=N") to STATUS and
 * sleeps.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define PAGE 4096UL
#define WORDS (PAGE / 8)

static const char *status_path;

static uint64_t word(uint64_t page, uint64_t w, uint64_t salt)
{
	return (page * 0x9E3779B97F4A7C15ULL) ^ (w * 40503ULL) ^ salt;
}

static void fill(uint8_t *p, uint64_t page, uint64_t salt)
{
	uint64_t *q = (uint64_t *)p;
	for (uint64_t w = 0; w < WORDS; w++)
		q[w] = word(page, w, salt);
}

static int check(const uint8_t *p, uint64_t page, uint64_t salt)
{
	const volatile uint64_t *q = (const volatile uint64_t *)p;
	for (uint64_t w = 0; w < WORDS; w++)
		if (q[w] != word(page, w, salt))
			return 0;
	return 1;
}

static int zero(const uint8_t *p)
{
	const volatile uint64_t *q = (const volatile uint64_t *)p;
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

static void ns_of(char *buf, size_t n)
{
	ssize_t r = readlink("/proc/self/ns/pid", buf, n - 1);
	buf[r < 0 ? 0 : r] = 0;
}

/* What page i of the first mapping holds: 1 its pattern, 0 zeros. */
static int written(uint64_t i, uint64_t pages)
{
	if (i >= pages / 2 && i < pages / 2 + 1024)
		return 0;
	return i % 4 == 0;
}

int main(int argc, char **argv)
{
	if (argc != 4) {
		fprintf(stderr, "usage: sparse MIB STATUS RESERVE_MIB\n");
		return 2;
	}
	uint64_t pages = ((uint64_t)atol(argv[1]) << 20) / PAGE;
	uint64_t rpages = ((uint64_t)atol(argv[3]) << 20) / PAGE;
	status_path = argv[2];
	if (pages < 4096 || rpages < 2)
		return 2;
	uint8_t *mem = mmap(NULL, pages * PAGE, PROT_READ | PROT_WRITE,
			    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	uint8_t *res = mmap(NULL, rpages * PAGE, PROT_READ | PROT_WRITE,
			    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (mem == MAP_FAILED || res == MAP_FAILED)
		return 1;
	/* No transparent huge pages: a lazy move leaves only 4 KiB-page mappings at the source. */
	madvise(mem, pages * PAGE, MADV_NOHUGEPAGE);
	madvise(res, rpages * PAGE, MADV_NOHUGEPAGE);
	volatile uint64_t sink = 0;
	for (uint64_t i = 0; i < pages; i++) {
		if (i >= pages / 2 && i < pages / 2 + 1024)
			continue;
		uint8_t *p = mem + i * PAGE;
		switch (i % 4) {
		case 0:
			fill(p, i, 0xA5);
			break;
		case 2:
			fill(p, i, 0x5A);
			if (madvise(p, PAGE, MADV_DONTNEED))
				return 1;
			break;
		case 3:
			sink += *(volatile uint64_t *)p;
			break;
		}
	}
	fill(res, 0, 0xA5);
	fill(res + (rpages - 1) * PAGE, rpages - 1, 0xA5);
	(void)sink;
	char home[128], now[128];
	ns_of(home, sizeof home);
	say("ready\n");
	for (;;) {
		ns_of(now, sizeof now);
		if (strcmp(home, now))
			break;
		usleep(1000);
	}
	for (uint64_t i = 0; i < pages; i++) {
		uint8_t *p = mem + i * PAGE;
		if (written(i, pages) ? !check(p, i, 0xA5) : !zero(p))
			bad(written(i, pages) ? "written" : "zero", i);
	}
	for (uint64_t i = 0; i < rpages; i += (i + 64 < rpages - 1 ? 64 : 1)) {
		uint8_t *p = res + i * PAGE;
		int w = i == 0 || i == rpages - 1;
		if (w ? !check(p, i, 0xA5) : !zero(p))
			bad(w ? "reserve written" : "reserve zero", i);
	}
	/* The pages that read zeros take writes. */
	for (uint64_t i = 0; i < pages; i++)
		if (!written(i, pages))
			fill(mem + i * PAGE, i, 0x33);
	for (uint64_t i = 0; i < pages; i++)
		if (!check(mem + i * PAGE, i, written(i, pages) ? 0xA5 : 0x33))
			bad("rewritten", i);
	say("result=ok\n");
	for (;;)
		pause();
}
