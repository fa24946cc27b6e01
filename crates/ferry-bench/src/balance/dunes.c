/* DUNES Fig 4.4's processes (Cruz & Park, §4.4.1), for `ferry-bench balance`.
 *
 *   dunes writer CHUNKS UNITS
 *                         Gw: per 64 KiB chunk, UNITS of computation, then the chunk to
 *                         stdout (Grs) and, every tenth chunk, to stderr (Grl): 10:1.
 *   dunes reader UNITS    Grs / Grl: UNITS of computation per chunk read from stdin.
 *   dunes independent N   I: N rounds of 40 ms of CPU time and 60 ms of sleep (CPU
 *                         utilization 0.4 alone; DUNES' I had 0.65, but there Gw used more
 *                         CPU than I, which under Linux's fair scheduler takes an I that
 *                         sleeps more).
 *
 * A unit is 16 rounds of xorshift (about 1.7 ns each here).
 *
 * Each prints nothing; its exit status is 0 when it did all its work. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CHUNK 65536

static volatile uint64_t sink;

static void work(long units) {
    uint64_t x = 88172645463325252ull;
    for (long i = 0; i < units * 16; i++) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    }
    sink += x;
}

static double cpu_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static int put(int fd, const char *b, size_t n) {
    while (n) {
        ssize_t w = write(fd, b, n);
        if (w <= 0) return -1;
        b += w; n -= (size_t)w;
    }
    return 0;
}

int main(int argc, char **argv) {
    static char buf[CHUNK];
    if (argc >= 4 && !strcmp(argv[1], "writer")) {
        long chunks = atol(argv[2]), units = atol(argv[3]);
        memset(buf, 'x', sizeof buf);
        for (long i = 0; i < chunks; i++) {
            work(units);
            if (put(1, buf, CHUNK)) return 2;
            if (i % 10 == 0 && put(2, buf, CHUNK)) return 3;
        }
        return 0;
    }
    if (argc >= 3 && !strcmp(argv[1], "reader")) {
        long units = atol(argv[2]);
        size_t have = 0;
        for (;;) {
            ssize_t r = read(0, buf, sizeof buf);
            if (r < 0) return 2;
            if (r == 0) break;
            have += (size_t)r;
            while (have >= CHUNK) { work(units); have -= CHUNK; }
        }
        return 0;
    }
    if (argc >= 3 && !strcmp(argv[1], "independent")) {
        long rounds = atol(argv[2]);
        /* Units per 40 ms of CPU, measured once at the start (a restored process's CPU-time
         * clock starts again from zero, so it cannot be read across a migration). */
        double t0 = cpu_now();
        work(20000);
        long per_round = (long)(20000 * 0.040 / (cpu_now() - t0));
        for (long i = 0; i < rounds; i++) {
            work(per_round);
            usleep(60000);
        }
        return 0;
    }
    fprintf(stderr, "usage: dunes writer CHUNKS UNITS | reader UNITS | independent ROUNDS\n");
    return 1;
}
