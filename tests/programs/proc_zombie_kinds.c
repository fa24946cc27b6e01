/*
 * proc_zombie_kinds: zombies of every kind of death, and the SIGCHLD they
 * left pending.
 *
 * Sets up, with SIGCHLD blocked and handled (SA_SIGINFO), unreaped children:
 *   K  killed by SIGKILL;
 *   A  killed by SIGABRT (a core-dumping signal; RLIMIT_CORE 0: no core);
 *   U  made by clone() with exit signal SIGUSR2 instead of SIGCHLD (its
 *      death is reported by SIGUSR2, handled, and waited for with __WALL);
 *   E  exited with status 42;
 *   N  made with exit signal 0 (its parent is told nothing), exited with 3;
 *   D  killed by SIGQUIT and dumped core (when core_pattern writes a file
 *      into its directory, the test directory; else it is not checked).
 * Verifies: each is still a zombie with this process as parent and its exit
 * signal (/proc stat field 38) kept; SIGCHLD is still pending, and once
 * unblocked the handler runs exactly once; SIGUSR2 was handled once before
 * (not again); waitid() reports each with its pid, CLD_KILLED/CLD_DUMPED or
 * CLD_EXITED and its signal or status, and CLD_DUMPED for D.
 */
#include "ferry_test.h"
#include <sched.h>
#include <sys/resource.h>
#include <sys/wait.h>

static volatile int chld_runs, usr2_runs;
static volatile pid_t chld_from;

static void on_chld(int sig, siginfo_t *si, void *ctx)
{
	(void)sig;
	(void)ctx;
	chld_runs++;
	chld_from = si->si_pid;
}

static void on_usr2(int sig)
{
	(void)sig;
	usr2_runs++;
}

static char state_of(pid_t pid, pid_t *ppid, int *exit_signal)
{
	char path[64], buf[1024];
	snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
	if (ferry_read_file(path, buf, sizeof buf) < 0)
		return '?';
	char *p = strrchr(buf, ')');
	if (!p)
		return '?';
	char st = 0;
	sscanf(p + 2, "%c %d", &st, ppid);
	/* Field 38 (exit_signal); p + 2 is field 3. */
	char *f = p + 2;
	for (int i = 3; i < 38 && f; i++) {
		f = strchr(f, ' ');
		if (f)
			f++;
	}
	*exit_signal = f ? atoi(f) : -1;
	return st;
}

static char stack_u[64 * 1024], stack_n[64 * 1024];
static int exit_usr2(void *arg)
{
	(void)arg;
	_exit(21);
}
static int exit_quietly(void *arg)
{
	(void)arg;
	_exit(3);
}

int main(void)
{
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_sigaction = on_chld;
	sa.sa_flags = SA_SIGINFO | SA_RESTART;
	FERRY_SYS(sigaction(SIGCHLD, &sa, NULL));
	signal(SIGUSR2, on_usr2);
	sigset_t chld;
	sigemptyset(&chld);
	sigaddset(&chld, SIGCHLD);
	FERRY_SYS(sigprocmask(SIG_BLOCK, &chld, NULL));
	struct rlimit no_core = { 0, RLIM_INFINITY };
	FERRY_SYS(setrlimit(RLIMIT_CORE, &no_core));

	pid_t k = FERRY_SYS(fork());
	if (k == 0) {
		for (;;)
			pause();
	}
	FERRY_SYS(kill(k, SIGKILL));
	pid_t a = FERRY_SYS(fork());
	if (a == 0) {
		signal(SIGABRT, SIG_DFL);
		raise(SIGABRT);
		_exit(99);
	}
	pid_t u = FERRY_SYS(clone(exit_usr2, stack_u + sizeof stack_u, SIGUSR2, NULL));
	pid_t e = FERRY_SYS(fork());
	if (e == 0)
		_exit(42);
	pid_t n = FERRY_SYS(clone(exit_quietly, stack_n + sizeof stack_n, 0, NULL));

	pid_t d = FERRY_SYS(fork());
	if (d == 0) {
		struct rlimit core = { RLIM_INFINITY, RLIM_INFINITY };
		setrlimit(RLIMIT_CORE, &core);
		signal(SIGQUIT, SIG_DFL);
		raise(SIGQUIT);
		_exit(99);
	}
	char pattern[256] = "";
	ferry_read_file("/proc/sys/kernel/core_pattern", pattern, sizeof pattern);
	int dumps = pattern[0] && pattern[0] != '|' && !strchr(pattern, '/');

#define NKIDS 6
	pid_t kids[NKIDS] = { k, a, u, e, n, d };
	const char *names[NKIDS] = { "K", "A", "U", "E", "N", "D" };
	int exit_signals[NKIDS] = { SIGCHLD, SIGCHLD, SIGUSR2, SIGCHLD, 0, SIGCHLD };
	pid_t pp;
	int es;
	for (int i = 0; i < NKIDS; i++)
		if (!FERRY_WAIT_UNTIL(state_of(kids[i], &pp, &es) == 'Z', 5000))
			ferry_die("%s did not become a zombie", names[i]);
	if (!FERRY_WAIT_UNTIL(usr2_runs == 1, 5000))
		ferry_die("SIGUSR2 not handled");

	ferry_ready();
	ferry_wait_go();

	for (int i = 0; i < NKIDS; i++) {
		pp = 0;
		es = -1;
		char st = state_of(kids[i], &pp, &es);
		FERRY_CHECK(st == 'Z', "%s (pid %d): state '%c', expected a zombie", names[i], (int)kids[i], st);
		FERRY_CHECK(pp == getpid(), "%s: parent %d, expected %d", names[i], (int)pp, (int)getpid());
		FERRY_CHECK(es == exit_signals[i], "%s: exit signal %d, expected %d", names[i], es, exit_signals[i]);
	}
	sigset_t pending;
	sigpending(&pending);
	FERRY_CHECK(sigismember(&pending, SIGCHLD), "SIGCHLD is no longer pending");
	FERRY_CHECK(!sigismember(&pending, SIGUSR2), "SIGUSR2 is pending again");
	FERRY_CHECK_EQ("SIGCHLD handler runs before unblocking", 0, chld_runs);
	FERRY_SYS(sigprocmask(SIG_UNBLOCK, &chld, NULL));
	FERRY_CHECK_EQ("SIGCHLD handler runs after unblocking", 1, chld_runs);
	FERRY_CHECK(chld_from == k || chld_from == a || chld_from == e || chld_from == d,
		    "SIGCHLD from pid %d, not from a child that sends it", (int)chld_from);
	FERRY_CHECK_EQ("SIGUSR2 handler runs", 1, usr2_runs);

	siginfo_t si;
	int want_code[NKIDS] = { CLD_KILLED, CLD_KILLED, CLD_EXITED, CLD_EXITED, CLD_EXITED,
				 dumps ? CLD_DUMPED : -1 };
	int want_status[NKIDS] = { SIGKILL, SIGABRT, 21, 42, 3, SIGQUIT };
	for (int i = 0; i < NKIDS; i++) {
		memset(&si, 0, sizeof si);
		FERRY_CHECK_EQ("waitid", 0, waitid(P_PID, (id_t)kids[i], &si, WEXITED | WNOHANG | __WALL));
		FERRY_CHECK(si.si_pid == kids[i], "%s: si_pid %d, expected %d", names[i], (int)si.si_pid, (int)kids[i]);
		FERRY_CHECK(si.si_code == want_code[i] || (want_code[i] == -1 && si.si_code == CLD_KILLED), "%s: si_code %d, expected %d", names[i], si.si_code, want_code[i]);
		FERRY_CHECK(si.si_status == want_status[i], "%s: si_status %d, expected %d", names[i], si.si_status, want_status[i]);
	}
	ferry_finish();
}
