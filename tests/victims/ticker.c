/*
 * ticker: a victim for migration tests. Holds MIB (argv[1]) of memory with a pattern and, every
 * 20 ms, counts, checks a slice of the pattern (all of it each second) and that CLOCK_MONOTONIC
 * never went backwards, then rewrites one line in STATUS (argv[2]):
 *     count=N pid=P ok=1 mono=1
 * `pid` is getpid() as the process sees it: it must never change, wherever the process runs.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: ticker MIB STATUS\n");
		return 2;
	}
	size_t len = (size_t)atol(argv[1]) << 20;
	unsigned long *mem = malloc(len ? len : 8);
	size_t words = len / sizeof *mem;
	for (size_t i = 0; i < words; i++)
		mem[i] = i * 2654435761UL;
	int fd = open(argv[2], O_WRONLY | O_CREAT | O_TRUNC, 0644);
	if (fd < 0) {
		perror("open status");
		return 2;
	}
	struct timespec last;
	clock_gettime(CLOCK_MONOTONIC, &last);
	int ok = 1, mono = 1;
	size_t slice = words / 50 + 1, at = 0;
	for (unsigned long count = 0;; count++) {
		for (size_t n = 0; n < slice && words; n++, at = (at + 1) % words)
			if (mem[at] != at * 2654435761UL)
				ok = 0;
		struct timespec now;
		clock_gettime(CLOCK_MONOTONIC, &now);
		if (now.tv_sec < last.tv_sec || (now.tv_sec == last.tv_sec && now.tv_nsec < last.tv_nsec))
			mono = 0;
		last = now;
		char line[128];
		int n = snprintf(line, sizeof line, "count=%-12lu pid=%-8d ok=%d mono=%d\n", count,
				 (int)getpid(), ok, mono);
		if (pwrite(fd, line, n, 0) != n)
			return 3;
		usleep(20000);
	}
}
