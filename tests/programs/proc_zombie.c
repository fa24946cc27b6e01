/*
 * proc_zombie: unreaped (zombie) children.
 *
 * Sets up child Z1 that exited with status 7 and child Z2 killed by
 * SIGTERM, both left unreaped, and a live child L that exits with 3 after
 * go.
 * Verifies: Z1 and Z2 are still zombies (/proc/<pid>/stat state Z) with
 * this process as parent; waitid() reaps Z1 as CLD_EXITED/7 and Z2 as
 * CLD_KILLED/SIGTERM with their original pids; L exits with 3.
 */
#include "ferry_test.h"

static char state_of(pid_t pid, pid_t *ppid)
{
	char path[64], buf[512];
	snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
	if (ferry_read_file(path, buf, sizeof buf) < 0)
		return '?';
	char *p = strrchr(buf, ')');
	if (!p)
		return '?';
	char st = 0;
	int pp = 0;
	sscanf(p + 2, "%c %d", &st, &pp);
	*ppid = pp;
	return st;
}

int main(void)
{
	signal(SIGCHLD, SIG_DFL);
	pid_t z1 = FERRY_SYS(fork());
	if (z1 == 0)
		_exit(7);
	pid_t z2 = FERRY_SYS(fork());
	if (z2 == 0) {
		signal(SIGTERM, SIG_DFL);
		raise(SIGTERM);
		_exit(99);
	}
	pid_t l = FERRY_SYS(fork());
	if (l == 0) {
		ferry_wait_go();
		_exit(3);
	}
	pid_t pp;
	if (!FERRY_WAIT_UNTIL(state_of(z1, &pp) == 'Z' && state_of(z2, &pp) == 'Z', 5000))
		ferry_die("children did not become zombies");

	ferry_ready();
	ferry_wait_go();

	pid_t zs[2] = { z1, z2 };
	for (int i = 0; i < 2; i++) {
		pp = 0;
		char st = state_of(zs[i], &pp);
		FERRY_CHECK(st == 'Z', "Z%d (pid %d): state '%c', expected a zombie", i + 1, (int)zs[i], st);
		FERRY_CHECK(pp == getpid(), "Z%d: parent %d, expected %d", i + 1, (int)pp, (int)getpid());
	}
	siginfo_t si;
	memset(&si, 0, sizeof si);
	FERRY_CHECK_EQ("waitid(Z1)", 0, waitid(P_PID, (id_t)z1, &si, WEXITED | WNOHANG));
	FERRY_CHECK_EQ("Z1 si_pid", z1, si.si_pid);
	FERRY_CHECK_EQ("Z1 si_code", CLD_EXITED, si.si_code);
	FERRY_CHECK_EQ("Z1 exit status", 7, si.si_status);
	memset(&si, 0, sizeof si);
	FERRY_CHECK_EQ("waitid(Z2)", 0, waitid(P_PID, (id_t)z2, &si, WEXITED | WNOHANG));
	FERRY_CHECK_EQ("Z2 si_pid", z2, si.si_pid);
	FERRY_CHECK_EQ("Z2 si_code", CLD_KILLED, si.si_code);
	FERRY_CHECK_EQ("Z2 signal", SIGTERM, si.si_status);
	ferry_reap_child(l, "L", 3, 5000);
	ferry_finish();
}
