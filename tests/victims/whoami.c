/*
 * whoami: a victim for the PID-namespace tests. It idles; on SIGUSR1 it appends one line to
 * ./whoami.log: "pid <getpid()> ppid <getppid()> mono <CLOCK_MONOTONIC ns>". Run it, clone
 * it into a PID namespace, and signal each copy in turn: both print the same getpid().
 */
#include <signal.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t asked;

static void on_usr1(int sig) { (void)sig; asked = 1; }

int main(void)
{
	struct sigaction sa = { .sa_handler = on_usr1 };
	sigaction(SIGUSR1, &sa, NULL);
	for (;;) {
		struct timespec nap = { 0, 2000000 };
		nanosleep(&nap, NULL);
		if (!asked)
			continue;
		asked = 0;
		struct timespec t;
		clock_gettime(CLOCK_MONOTONIC, &t);
		FILE *f = fopen("whoami.log", "a");
		if (!f)
			return 2;
		fprintf(f, "pid %d ppid %d mono %lld\n", (int)getpid(), (int)getppid(),
			(long long)t.tv_sec * 1000000000LL + t.tv_nsec);
		fclose(f);
	}
}
