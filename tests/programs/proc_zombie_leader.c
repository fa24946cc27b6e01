/*
 * proc_zombie_leader: a process whose main thread has exited (pthread_exit)
 * while another thread runs on: its thread-group leader is a zombie.
 *
 * Sets up: child L starts thread W and ends its main thread with
 * pthread_exit(); W goes on counting.
 * Verifies: L's leader is still a zombie (state Z) while W runs with the
 * same tid; W sees go, and L exits with 9 (W's exit(): 8 if W found the
 * leader not a zombie, 7 if its tid changed).
 */
#include "ferry_test.h"
#include <sys/wait.h>

static pid_t w_tid;
static volatile pid_t *shared; /* [0]: W's tid, as L sees it */

static void *worker(void *arg)
{
	(void)arg;
	shared[0] = ferry_gettid();
	ferry_wait_go();
	/* The leader is a zombie; this thread still runs. */
	char path[64], buf[512];
	snprintf(path, sizeof path, "/proc/%d/stat", (int)getpid());
	ferry_read_file(path, buf, sizeof buf);
	char *p = strrchr(buf, ')');
	if (ferry_gettid() != shared[0])
		exit(7);
	exit(p && p[2] == 'Z' ? 9 : 8);
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

int main(void)
{
	shared = FERRY_PTR(mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
	pid_t l = FERRY_SYS(fork());
	if (l == 0) {
		pthread_t t;
		pthread_create(&t, NULL, worker, NULL);
		pthread_exit(NULL);
	}
	if (!FERRY_WAIT_UNTIL(shared[0] && task_state(l, l) == 'Z', 5000))
		ferry_die("L's leader did not exit");
	w_tid = shared[0];

	ferry_ready();
	ferry_wait_go();

	/* W may already have seen go and exited: only check what is still there. */
	char s = task_state(l, l);
	FERRY_CHECK(s == 'Z' || s == '?', "L's leader: state '%c', expected a zombie", s);
	ferry_reap_child(l, "L", 9, 5000);
	ferry_finish();
}
