/*
 * fd_fsetown_sigio: signal-driven I/O (O_ASYNC with an owner and F_SETSIG).
 *
 * Sets up, with SIGRTMIN+1..+4 and SIGIO blocked everywhere:
 * - pipe A, read end O_ASYNC, owned by a second thread (F_OWNER_TID),
 *   F_SETSIG SIGRTMIN+1;
 * - socketpair B, end 0 O_ASYNC, owned by this process (F_OWNER_PID),
 *   F_SETSIG SIGRTMIN+2;
 * - pipe C, read end O_ASYNC, owned by our process group (F_OWNER_PGRP),
 *   F_SETSIG SIGRTMIN+3, and a forked child in the group;
 * - pipe D, read end O_ASYNC, owned with plain F_SETOWN(getpid()), no
 *   F_SETSIG (SIGIO, no si_fd).
 * Verifies: F_GETOWN_EX and F_GETSIG of each as set; writing to A, B's peer,
 * C and D raises SIGRTMIN+1 in the thread (si_fd A, si_band POLLIN), +2 in
 * the process (si_fd B), +3 in both the process and the child (si_fd C), and
 * SIGIO in the process.
 */
#include "ferry_test.h"
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>

static int pa[2], pc[2], pd[2], sb[2];
static volatile pid_t worker_tid;
static volatile int worker_got, worker_fd;
static volatile long worker_band;

static int sig_a, sig_b, sig_c;

static void block_all(void)
{
	sigset_t s;
	sigemptyset(&s);
	sigaddset(&s, sig_a);
	sigaddset(&s, sig_b);
	sigaddset(&s, sig_c);
	sigaddset(&s, SIGIO);
	pthread_sigmask(SIG_BLOCK, &s, NULL);
}

/* Waits up to ms for signal sig (blocked) and returns its siginfo's signo. */
static int wait_sig(int sig, siginfo_t *si, int ms)
{
	sigset_t s;
	sigemptyset(&s);
	sigaddset(&s, sig);
	struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };
	for (;;) {
		int r = sigtimedwait(&s, si, &ts);
		if (r < 0 && errno == EINTR)
			continue;
		return r;
	}
}

static void *worker(void *arg)
{
	(void)arg;
	worker_tid = ferry_gettid();
	while (!ferry_go_seen())
		ferry_sleep_ms(5);
	siginfo_t si;
	memset(&si, 0, sizeof si);
	if (wait_sig(sig_a, &si, 5000) == sig_a) {
		worker_fd = si.si_fd;
		worker_band = si.si_band;
		worker_got = 1;
	}
	return NULL;
}

static void set_owner(int fd, int type, pid_t pid, int sig)
{
	struct f_owner_ex o = { .type = type, .pid = pid };
	FERRY_SYS(fcntl(fd, F_SETOWN_EX, &o));
	if (sig)
		FERRY_SYS(fcntl(fd, F_SETSIG, sig));
	FERRY_SYS(fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_ASYNC | O_NONBLOCK));
}

static void check_owner(const char *what, int fd, int type, pid_t pid, int sig)
{
	struct f_owner_ex o = { -1, -1 };
	FERRY_CHECK(fcntl(fd, F_GETOWN_EX, &o) == 0, "%s: F_GETOWN_EX: %s", what, strerror(errno));
	FERRY_CHECK(o.type == type && o.pid == pid, "%s: owner expected type %d pid %d, got type %d pid %d",
		    what, type, pid, o.type, o.pid);
	FERRY_CHECK_EQ(what, sig, fcntl(fd, F_GETSIG));
	FERRY_CHECK(fcntl(fd, F_GETFL) & O_ASYNC, "%s: O_ASYNC lost", what);
}

int main(void)
{
	sig_a = SIGRTMIN + 1;
	sig_b = SIGRTMIN + 2;
	sig_c = SIGRTMIN + 3;
	block_all();
	FERRY_SYS(pipe(pa));
	FERRY_SYS(pipe(pc));
	FERRY_SYS(pipe(pd));
	FERRY_SYS(socketpair(AF_UNIX, SOCK_STREAM, 0, sb));
	pthread_t th;
	if (pthread_create(&th, NULL, worker, NULL))
		ferry_die("pthread_create");
	FERRY_WAIT_UNTIL(worker_tid != 0, 2000);
	pid_t me = getpid(), grp = getpgrp(), tid = worker_tid;
	set_owner(pa[0], F_OWNER_TID, tid, sig_a);
	set_owner(sb[0], F_OWNER_PID, me, sig_b);
	set_owner(pc[0], F_OWNER_PGRP, grp, sig_c);
	FERRY_SYS(fcntl(pd[0], F_SETOWN, me));
	FERRY_SYS(fcntl(pd[0], F_SETFL, fcntl(pd[0], F_GETFL) | O_ASYNC | O_NONBLOCK));

	pid_t child = FERRY_SYS(fork());
	if (child == 0) {
		while (!ferry_go_seen())
			ferry_sleep_ms(5);
		siginfo_t si;
		memset(&si, 0, sizeof si);
		FERRY_CHECK_EQ("child: group signal", sig_c, wait_sig(sig_c, &si, 5000));
		FERRY_CHECK_EQ("child: si_fd", pc[0], si.si_fd);
		FERRY_CHECK(si.si_band & POLLIN, "child: si_band %lx", (long)si.si_band);
		ferry_child_finish();
	}

	ferry_ready();
	ferry_wait_go();

	check_owner("pipe A (thread)", pa[0], F_OWNER_TID, tid, sig_a);
	check_owner("socket B (process)", sb[0], F_OWNER_PID, me, sig_b);
	check_owner("pipe C (group)", pc[0], F_OWNER_PGRP, grp, sig_c);
	check_owner("pipe D (F_SETOWN)", pd[0], F_OWNER_PID, me, 0);
	FERRY_CHECK_EQ("F_GETOWN of D", me, fcntl(pd[0], F_GETOWN));

	FERRY_SYS(write(pa[1], "a", 1));
	FERRY_SYS(write(sb[1], "b", 1));
	FERRY_SYS(write(pc[1], "c", 1));
	FERRY_SYS(write(pd[1], "d", 1));

	siginfo_t si;
	memset(&si, 0, sizeof si);
	FERRY_CHECK_EQ("socket B signal", sig_b, wait_sig(sig_b, &si, 5000));
	FERRY_CHECK_EQ("socket B si_fd", sb[0], si.si_fd);
	FERRY_CHECK(si.si_band & POLLIN, "socket B si_band %lx", (long)si.si_band);
	memset(&si, 0, sizeof si);
	FERRY_CHECK_EQ("pipe C signal (process)", sig_c, wait_sig(sig_c, &si, 5000));
	FERRY_CHECK_EQ("pipe C si_fd", pc[0], si.si_fd);
	memset(&si, 0, sizeof si);
	FERRY_CHECK_EQ("pipe D SIGIO", SIGIO, wait_sig(SIGIO, &si, 5000));
	pthread_join(th, NULL);
	FERRY_CHECK(worker_got, "the owner thread got no signal %d for pipe A", sig_a);
	FERRY_CHECK_EQ("pipe A si_fd", pa[0], worker_fd);
	FERRY_CHECK(worker_band & POLLIN, "pipe A si_band %lx", worker_band);
	/* The thread's signal went to it alone: none is left for the process. */
	struct timespec zero = { 0, 0 };
	sigset_t s;
	sigemptyset(&s);
	sigaddset(&s, sig_a);
	FERRY_CHECK(sigtimedwait(&s, &si, &zero) < 0, "signal %d for pipe A also pending in the main thread", sig_a);
	ferry_reap_child(child, "child", 0, 5000);
	ferry_finish();
}
