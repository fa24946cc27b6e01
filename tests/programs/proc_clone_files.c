/*
 * proc_clone_files: two processes sharing one descriptor table
 * (clone(CLONE_FILES) without CLONE_VM), beside one that does not.
 *
 * Sets up: child S made with clone(CLONE_FILES | SIGCHLD), child N with a
 * plain fork; the parent P opens a pipe and S opens /dev/null, so both
 * appear in the one table.
 * Verifies: kcmp(KCMP_FILES) says P and S share a table and P and N do not;
 * S sees the pipe and P sees S's /dev/null (same descriptions, kcmp
 * KCMP_FILE); a descriptor P opens after go appears in S, and one S closes
 * disappears in P; N's table is its own (a descriptor N opens does not
 * appear in P).
 */
#include "ferry_test.h"
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <linux/kcmp.h>

struct shared {
	int s_null;	/* fd S opened */
	int p_new;	/* fd P opens after go */
	int n_new;	/* fd N opens after go */
	int step;	/* 1: P opened p_new; 2: S checked and closed s_null; 3: N opened n_new */
	int s_failed;
};
static struct shared *sh;
static int pipefd[2];
static char stack_s[64 * 1024];

static int fd_open(int fd)
{
	return fcntl(fd, F_GETFD) >= 0;
}

static int s_main(void *arg)
{
	(void)arg;
	sh->s_null = open("/dev/null", O_RDONLY);
	ferry_wait_go();
	while (sh->step < 1)
		ferry_sleep_ms(1);
	/* P's new descriptor is ours too; so is the pipe. */
	if (!fd_open(sh->p_new) || !fd_open(pipefd[0]) || !fd_open(pipefd[1]))
		sh->s_failed = 1;
	close(sh->s_null);
	sh->step = 2;
	_exit(0);
}

static long kcmp(pid_t a, pid_t b, int type, long x, long y)
{
	return syscall(SYS_kcmp, a, b, type, x, y);
}

int main(void)
{
	sh = FERRY_PTR(mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
	sh->s_null = -1;
	FERRY_SYS(pipe(pipefd));
	pid_t s = FERRY_SYS(clone(s_main, stack_s + sizeof stack_s, CLONE_FILES | SIGCHLD, NULL));
	pid_t n = FERRY_SYS(fork());
	if (n == 0) {
		ferry_wait_go();
		while (sh->step < 2)
			ferry_sleep_ms(1);
		sh->n_new = eventfd(0, 0);
		sh->step = 3;
		for (;;)
			pause();
	}
	if (!FERRY_WAIT_UNTIL(sh->s_null >= 0, 5000))
		ferry_die("S did not open /dev/null");

	ferry_ready();
	ferry_wait_go();

	pid_t me = getpid();
	FERRY_CHECK_EQ("kcmp(P, S, KCMP_FILES)", 0, kcmp(me, s, KCMP_FILES, 0, 0));
	FERRY_CHECK(kcmp(me, n, KCMP_FILES, 0, 0) != 0, "P and N share a descriptor table");
	FERRY_CHECK(fd_open(sh->s_null), "S's /dev/null (fd %d) is not in P's table", sh->s_null);
	FERRY_CHECK_EQ("kcmp(P, S, KCMP_FILE, pipe)", 0, kcmp(me, s, KCMP_FILE, pipefd[0], pipefd[0]));
	sh->p_new = FERRY_SYS(eventfd(0, 0));
	sh->step = 1;
	ferry_reap_child(s, "S", 0, 5000);
	FERRY_CHECK_EQ("S saw P's descriptors", 0, sh->s_failed);
	FERRY_CHECK(!fd_open(sh->s_null), "fd %d that S closed is still open in P", sh->s_null);
	FERRY_CHECK(FERRY_WAIT_UNTIL(sh->step == 3, 5000), "N did not open its eventfd");
	/* N's eventfd number is the lowest free in N's own table: the one S closed here. */
	FERRY_CHECK(kcmp(me, n, KCMP_FILE, sh->n_new, sh->n_new) != 0 || !fd_open(sh->n_new),
		    "N's new fd %d is P's too", sh->n_new);
	kill(n, SIGKILL);
	waitpid(n, NULL, 0);
	ferry_finish();
}
