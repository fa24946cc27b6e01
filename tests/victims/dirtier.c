/*
 * dirtier: a victim for pre-copy tests and benchmarks. Holds MIB (argv[1]) of memory and keeps
 * dirtying it at RATE pages per second (argv[2]), in 1 ms steps: each write gives a page a new
 * version (its whole contents derive from its index and version; a table, elsewhere, holds
 * every page's version). Every 64th write drops a page instead (madvise MADV_DONTNEED: it must
 * read as zeros, version 0). Every 20 ms it checks a slice of the pages against the table (all
 * of them each second) and rewrites one line in STATUS (argv[3]), as ticker does:
 *     count=N pid=P ok=1 mono=1
 * A page sent stale, or kept when it was dropped, makes ok=0. An optional SWEEP (argv[4], a
 * percentage) rewrites, with the same bytes, one word of each of the first SWEEP % of the
 * pages every 20 ms: a pre-copy's rounds find all of them written every time.
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096
#define WORDS (PAGE / 8)

static uint64_t word(uint64_t page, uint32_t version, uint64_t w)
{
	return (page * 2654435761ULL) ^ ((uint64_t)version << 32) ^ (w * 40503ULL) ^ 1;
}

static void fill(uint64_t *p, uint64_t page, uint32_t version)
{
	for (uint64_t w = 0; w < WORDS; w++)
		p[w] = word(page, version, w);
}

static int check(const uint64_t *p, uint64_t page, uint32_t version)
{
	for (uint64_t w = 0; w < WORDS; w++)
		if (p[w] != (version ? word(page, version, w) : 0))
			return 0;
	return 1;
}

static double now_s(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
	if (argc != 4 && argc != 5) {
		fprintf(stderr, "usage: dirtier MIB RATE STATUS [SWEEP]\n");
		return 2;
	}
	uint64_t pages = ((uint64_t)atol(argv[1]) << 20) / PAGE;
	double rate = atof(argv[2]);
	if (pages == 0)
		pages = 1;
	uint64_t sweep = argc == 5 ? pages * (uint64_t)atol(argv[4]) / 100 : 0;
	uint64_t *mem = mmap(NULL, pages * PAGE, PROT_READ | PROT_WRITE,
			     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	uint32_t *version = calloc(pages, sizeof *version);
	if (mem == MAP_FAILED || !version) {
		perror("memory");
		return 2;
	}
	for (uint64_t i = 0; i < pages; i++) {
		version[i] = 1;
		fill(mem + i * WORDS, i, 1);
	}
	int fd = open(argv[3], O_WRONLY | O_CREAT | O_TRUNC, 0644);
	if (fd < 0) {
		perror("open status");
		return 2;
	}
	int ok = 1, mono = 1;
	double start = now_s(), last = start, last_status = 0;
	uint64_t written = 0, cursor = 0, slice = pages / 50 + 1;
	uint64_t x = 88172645463325252ULL;
	for (unsigned long count = 0;;) {
		double t = now_s();
		if (t < last)
			mono = 0;
		last = t;
		/* Writes due by now, at RATE per second. */
		uint64_t due = (uint64_t)((t - start) * rate);
		for (; written < due; written++) {
			x ^= x << 13, x ^= x >> 7, x ^= x << 17;
			uint64_t i = x % pages;
			if (written % 64 == 63) {
				madvise(mem + i * WORDS, PAGE, MADV_DONTNEED);
				version[i] = 0;
			} else {
				version[i] = version[i] % 0xffff + 1;
				fill(mem + i * WORDS, i, version[i]);
			}
		}
		if (t - last_status >= 0.02) {
			for (uint64_t i = 0; i < sweep && i < pages; i++) {
				volatile uint64_t *q = (volatile uint64_t *)(mem + i * WORDS);
				*q = *q;
			}
			for (uint64_t n = 0; n < slice; n++, cursor = (cursor + 1) % pages)
				if (!check(mem + cursor * WORDS, cursor, version[cursor]))
					ok = 0;
			char line[128];
			int n = snprintf(line, sizeof line, "count=%-12lu pid=%-8d ok=%d mono=%d\n",
					 count++, (int)getpid(), ok, mono);
			if (pwrite(fd, line, n, 0) != n)
				return 3;
			last_status = t;
		}
		usleep(1000);
	}
}
