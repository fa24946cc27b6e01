/*
 * busy: a victim for the CLI and robustness tests. Two threads keep counting, 64 MiB of
 * memory hold a pattern, and SIGUSR1 blocked in the main thread. On SIGUSR2 (delivered to a
 * worker thread) it checks that the counters still move, the pattern is intact and the mask
 * unchanged, and exits 0 (or 3 with a message on stderr).
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MIB (64UL << 20)
static volatile unsigned long counters[2];
static volatile sig_atomic_t check_now;
static unsigned char *mem;

static void on_usr2(int sig) { (void)sig; check_now = 1; }

static void *count(void *arg)
{
	long i = (long)arg;
	for (;;) {
		counters[i]++;
		usleep(100);
	}
	return NULL;
}

int main(void)
{
	mem = malloc(MIB);
	for (unsigned long i = 0; i < MIB; i++)
		mem[i] = (unsigned char)(i * 7 + 3);
	signal(SIGUSR2, on_usr2);
	pthread_t t[2];
	for (long i = 0; i < 2; i++)
		pthread_create(&t[i], NULL, count, (void *)i);
	sigset_t set;
	sigemptyset(&set);
	sigaddset(&set, SIGUSR1);
	pthread_sigmask(SIG_BLOCK, &set, NULL);
	printf("ready %d\n", getpid());
	fflush(stdout);
	while (!check_now)
		usleep(1000);
	unsigned long before[2] = {counters[0], counters[1]};
	usleep(20000);
	if (counters[0] == before[0] || counters[1] == before[1]) {
		fprintf(stderr, "a counting thread stopped\n");
		return 3;
	}
	for (unsigned long i = 0; i < MIB; i++)
		if (mem[i] != (unsigned char)(i * 7 + 3)) {
			fprintf(stderr, "memory differs at %lu\n", i);
			return 3;
		}
	sigset_t now;
	pthread_sigmask(SIG_BLOCK, NULL, &now);
	if (!sigismember(&now, SIGUSR1) || sigismember(&now, SIGUSR2)) {
		fprintf(stderr, "signal mask changed\n");
		return 3;
	}
	return 0;
}
