/*
 * proc_stopped: children stopped by job control (group stops).
 *
 * Sets up, with a SIGCHLD handler (SA_SIGINFO, no SA_NOCLDSTOP) that counts
 * CLD_STOPPED and CLD_CONTINUED per child:
 *   A  stopped by SIGSTOP; the parent already collected the stop with
 *      waitpid(WUNTRACED); then sent SIGUSR1, which A handles: it waits,
 *      pending, until A is continued;
 *   B  in a process group of its own, stopped by SIGTSTP sent to the group
 *      (a job stopped with ^Z); the parent has NOT collected the stop;
 *   C  in a group of its own, three threads counting in shared memory,
 *      stopped by SIGTTIN (a group stop of every thread); collected.
 * Verifies, after go: every child (and each thread of C) is still stopped
 * (state T) and C's counters do not move; the handler saw no new SIGCHLD;
 * waitpid(WUNTRACED|WNOHANG) reports B stopped by SIGTSTP and nothing for A
 * and C; after SIGCONT each child is reported by waitpid(WCONTINUED), the
 * handler sees one CLD_CONTINUED each, A's SIGUSR1 handler runs then (once),
 * C's threads count again, and every child exits with its code.
 */
#include "ferry_test.h"
#include <sys/wait.h>

#define NCHILD 3
static pid_t kids[NCHILD];
static volatile int stopped_seen[NCHILD], continued_seen[NCHILD], other_seen;
static volatile uint64_t *counters; /* C's threads, shared with the parent; [3]: A's SIGUSR1 */

static void on_usr1(int sig)
{
	(void)sig;
	counters[3]++;
}

static void on_chld(int sig, siginfo_t *si, void *ctx)
{
	(void)sig;
	(void)ctx;
	for (int i = 0; i < NCHILD; i++) {
		if (kids[i] == si->si_pid) {
			if (si->si_code == CLD_STOPPED)
				stopped_seen[i]++;
			else if (si->si_code == CLD_CONTINUED)
				continued_seen[i]++;
			return;
		}
	}
	other_seen++;
}

static char task_state(pid_t pid, pid_t tid)
{
	char path[96], buf[512];
	snprintf(path, sizeof path, "/proc/%d/task/%d/stat", (int)pid, (int)tid);
	if (ferry_read_file(path, buf, sizeof buf) < 0)
		return '?';
	char *p = strrchr(buf, ')');
	return p ? p[2] : '?';
}

/* Every thread of pid in state `want`; the number of threads in *n. */
static int all_threads(pid_t pid, char want, int *n)
{
	char path[64];
	snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
	DIR *d = opendir(path);
	if (!d)
		return 0;
	int ok = 1, count = 0;
	struct dirent *e;
	while ((e = readdir(d))) {
		if (e->d_name[0] == '.')
			continue;
		count++;
		if (task_state(pid, atoi(e->d_name)) != want)
			ok = 0;
	}
	closedir(d);
	*n = count;
	return ok;
}

static void *counter(void *arg)
{
	volatile uint64_t *c = arg;
	for (;;) {
		(*c)++;
		ferry_sleep_ms(1);
	}
	return NULL;
}

static void child_wait_loop(void)
{
	/* Stopped somewhere in here; after SIGCONT, go exists: wait for release. */
	ferry_wait_go();
	char p[PATH_MAX];
	ferry_path(p, sizeof p, "release");
	while (access(p, F_OK) != 0)
		ferry_sleep_ms(2);
}

int main(void)
{
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_sigaction = on_chld;
	sa.sa_flags = SA_SIGINFO | SA_RESTART;
	sigemptyset(&sa.sa_mask);
	FERRY_SYS(sigaction(SIGCHLD, &sa, NULL));
	counters = FERRY_PTR(mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));

	sigset_t chld, old;
	sigemptyset(&chld);
	sigaddset(&chld, SIGCHLD);
	/* kids[] is filled before the handler may look at it. */
	sigprocmask(SIG_BLOCK, &chld, &old);
	kids[0] = FERRY_SYS(fork());
	if (kids[0] == 0) {
		signal(SIGUSR1, on_usr1);
		sigset_t usr1;
		sigemptyset(&usr1);
		sigaddset(&usr1, SIGUSR1);
		sigprocmask(SIG_UNBLOCK, &usr1, NULL);
		counters[4] = 1; /* handler installed */
		child_wait_loop();
		_exit(10);
	}
	kids[1] = FERRY_SYS(fork());
	if (kids[1] == 0) {
		setpgid(0, 0);
		child_wait_loop();
		_exit(11);
	}
	setpgid(kids[1], kids[1]);
	kids[2] = FERRY_SYS(fork());
	if (kids[2] == 0) {
		setpgid(0, 0);
		pthread_t t;
		for (int i = 0; i < 2; i++)
			pthread_create(&t, NULL, counter, (void *)&counters[i]);
		counter((void *)&counters[2]);
	}
	setpgid(kids[2], kids[2]);
	sigprocmask(SIG_SETMASK, &old, NULL);

	int n;
	if (!FERRY_WAIT_UNTIL(all_threads(kids[2], 'S', &n) && n == 3, 5000))
		ferry_die("C did not start its threads");
	if (!FERRY_WAIT_UNTIL(counters[4] == 1, 5000))
		ferry_die("A did not install its handler");
	/* One at a time: SIGCHLDs that arrive together merge into one. */
	FERRY_SYS(kill(kids[0], SIGSTOP));
	if (!FERRY_WAIT_UNTIL(stopped_seen[0], 5000))
		ferry_die("the handler did not see A stop");
	FERRY_SYS(kill(-kids[1], SIGTSTP));
	if (!FERRY_WAIT_UNTIL(stopped_seen[1], 5000))
		ferry_die("the handler did not see B stop");
	FERRY_SYS(kill(-kids[2], SIGTTIN));
	if (!FERRY_WAIT_UNTIL(stopped_seen[2], 5000))
		ferry_die("the handler did not see C stop");
	int st;
	FERRY_CHECK_EQ("waitpid(A, WUNTRACED)", kids[0], waitpid(kids[0], &st, WUNTRACED));
	FERRY_CHECK(WIFSTOPPED(st) && WSTOPSIG(st) == SIGSTOP, "A: status %#x", st);
	FERRY_SYS(kill(kids[0], SIGUSR1));
	FERRY_CHECK_EQ("waitpid(C, WUNTRACED)", kids[2], waitpid(kids[2], &st, WUNTRACED));
	FERRY_CHECK(WIFSTOPPED(st) && WSTOPSIG(st) == SIGTTIN, "C: status %#x", st);
	if (!FERRY_WAIT_UNTIL(all_threads(kids[1], 'T', &n), 5000))
		ferry_die("B did not stop");
	uint64_t before[3];

	ferry_ready();
	ferry_wait_go();

	const char *names[NCHILD] = { "A", "B", "C" };
	for (int i = 0; i < NCHILD; i++) {
		int ok = all_threads(kids[i], 'T', &n);
		FERRY_CHECK(ok, "%s (pid %d): not every thread is stopped", names[i], (int)kids[i]);
	}
	FERRY_CHECK_EQ("threads of C", 3, n);
	for (int i = 0; i < 3; i++)
		before[i] = counters[i];
	ferry_sleep_ms(50);
	for (int i = 0; i < 3; i++)
		FERRY_CHECK(counters[i] == before[i], "C thread %d counted while stopped", i);
	for (int i = 0; i < NCHILD; i++) {
		FERRY_CHECK_EQ("CLD_STOPPED seen", 1, stopped_seen[i]);
		FERRY_CHECK_EQ("CLD_CONTINUED seen", 0, continued_seen[i]);
	}
	FERRY_CHECK_EQ("SIGCHLD from others", 0, other_seen);
	FERRY_CHECK_EQ("A's SIGUSR1 handled while stopped", 0, counters[3]);
	FERRY_CHECK_EQ("waitpid(A, WUNTRACED|WNOHANG)", 0, waitpid(kids[0], &st, WUNTRACED | WNOHANG));
	FERRY_CHECK_EQ("waitpid(C, WUNTRACED|WNOHANG)", 0, waitpid(kids[2], &st, WUNTRACED | WNOHANG));
	st = 0;
	FERRY_CHECK_EQ("waitpid(B, WUNTRACED|WNOHANG)", kids[1], waitpid(kids[1], &st, WUNTRACED | WNOHANG));
	FERRY_CHECK(WIFSTOPPED(st) && WSTOPSIG(st) == SIGTSTP, "B: status %#x, expected stopped by SIGTSTP", st);
	FERRY_CHECK_EQ("waitpid(B, WUNTRACED|WNOHANG) again", 0, waitpid(kids[1], &st, WUNTRACED | WNOHANG));

	for (int i = 0; i < NCHILD; i++) {
		FERRY_SYS(kill(kids[i], SIGCONT));
		FERRY_CHECK(FERRY_WAIT_UNTIL(continued_seen[i], 5000), "%s: CLD_CONTINUED not seen", names[i]);
		st = 0;
		FERRY_CHECK_EQ("waitpid(WCONTINUED|WNOHANG)", kids[i], waitpid(kids[i], &st, WCONTINUED | WNOHANG));
		FERRY_CHECK(WIFCONTINUED(st), "%s: status %#x, expected continued", names[i], st);
	}
	for (int i = 0; i < 3; i++)
		before[i] = counters[i];
	FERRY_CHECK(FERRY_WAIT_UNTIL(counters[0] > before[0] && counters[1] > before[1] &&
					     counters[2] > before[2], 5000),
		    "C's threads do not count after SIGCONT");
	FERRY_CHECK(FERRY_WAIT_UNTIL(counters[3] == 1, 5000), "A's SIGUSR1 handler ran %d times after SIGCONT",
		    (int)counters[3]);
	char rel[PATH_MAX];
	FERRY_SYS(ferry_write_file(ferry_path(rel, sizeof rel, "release"), "1\n"));
	kill(kids[2], SIGKILL);
	ferry_reap_child(kids[0], "A", 10, 5000);
	ferry_reap_child(kids[1], "B", 11, 5000);
	waitpid(kids[2], &st, 0);
	FERRY_CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "C: status %#x", st);
	for (int i = 0; i < NCHILD; i++) {
		FERRY_CHECK_EQ("CLD_STOPPED seen in the end", 1, stopped_seen[i]);
		FERRY_CHECK_EQ("CLD_CONTINUED seen in the end", 1, continued_seen[i]);
	}
	ferry_finish();
}
