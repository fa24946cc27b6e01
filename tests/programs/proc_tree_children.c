/*
 * proc_tree_children: a tree of processes.
 *
 *   R (root) -- A -- A1
 *            |    `- A2
 *            |-- B -- B1 (2 threads)
 *            `-- C
 *
 * Every process records its pid and parent in shared memory, then waits
 * for go.
 * Verifies in every process: getpid() and getppid() unchanged, and
 * /proc/self/task/<pid>/children lists exactly its own children; B1's
 * second thread is still there; each parent reaps its children with their
 * expected exit codes (A1 11, A2 12, B1 21, A 1, B 2, C 3) and collects
 * their failures.
 */
#include "ferry_test.h"

struct node {
	pid_t pid, ppid;
};

static struct node *tab; /* shared: R A B C A1 A2 B1 */
enum { R, A, B, C, A1, A2, B1, NN };
static const char *nm[NN] = { "R", "A", "B", "C", "A1", "A2", "B1" };
static volatile int thread_go;

static int cmp_pid(const void *a, const void *b)
{
	return *(const pid_t *)a - *(const pid_t *)b;
}

/* Compare /proc/self/task/<pid>/children with the given set. */
static void check_children(int me, const int *kids, int nkids)
{
	char path[64], buf[512];
	snprintf(path, sizeof path, "/proc/self/task/%d/children", (int)getpid());
	if (ferry_read_file(path, buf, sizeof buf) < 0) {
		ferry_log("no %s (CONFIG_PROC_CHILDREN?); skipped", path);
		return;
	}
	pid_t got[16], want[16];
	int ng = 0;
	for (char *p = buf; *p && ng < 16;) {
		char *end;
		long v = strtol(p, &end, 10);
		if (end == p)
			break;
		got[ng++] = (pid_t)v;
		p = end;
	}
	for (int i = 0; i < nkids; i++)
		want[i] = tab[kids[i]].pid;
	qsort(got, (size_t)ng, sizeof got[0], cmp_pid);
	qsort(want, (size_t)nkids, sizeof want[0], cmp_pid);
	if (ng != nkids || memcmp(got, want, sizeof got[0] * (size_t)ng) != 0)
		ferry_fail("%s: children are \"%s\", expected %d of them", nm[me], buf, nkids);
}

static void check_self(int me)
{
	char what[64];
	snprintf(what, sizeof what, "%s: getpid", nm[me]);
	FERRY_CHECK_EQ(what, tab[me].pid, getpid());
	if (me != R) {
		snprintf(what, sizeof what, "%s: getppid", nm[me]);
		FERRY_CHECK_EQ(what, tab[me].ppid, getppid());
	}
}

static void *b1_thread(void *arg)
{
	(void)arg;
	while (!thread_go)
		ferry_sleep_ms(5);
	return (void *)21;
}

static void run_node(int me);

static pid_t spawn(int who)
{
	pid_t p = FERRY_SYS(fork());
	if (p == 0) {
		tab[who].pid = getpid();
		tab[who].ppid = getppid();
		run_node(who);
	}
	return p;
}

static void wait_registered(int who)
{
	if (!FERRY_WAIT_UNTIL(__atomic_load_n(&tab[who].pid, __ATOMIC_SEQ_CST) != 0, 5000))
		ferry_die("%s did not start", nm[who]);
}

static void run_node(int me)
{
	static const int kids_a[] = { A1, A2 }, kids_b[] = { B1 };
	static const int codes[NN] = { 0, 1, 2, 3, 11, 12, 21 };
	const int *kids = NULL;
	int nk = 0;
	if (me == A)
		kids = kids_a, nk = 2;
	if (me == B)
		kids = kids_b, nk = 1;
	pid_t pids[2];
	for (int i = 0; i < nk; i++) {
		pids[i] = spawn(kids[i]);
		wait_registered(kids[i]);
	}
	pthread_t t;
	if (me == B1 && pthread_create(&t, NULL, b1_thread, NULL))
		ferry_die("pthread_create");
	ferry_wait_go();
	check_self(me);
	check_children(me, kids, nk);
	if (me == B1) {
		thread_go = 1;
		void *ret;
		pthread_join(t, &ret);
		FERRY_CHECK_EQ("B1: thread result", 21, (intptr_t)ret);
	}
	for (int i = 0; i < nk; i++)
		ferry_reap_child(pids[i], nm[kids[i]], codes[kids[i]], 10000);
	if (ferry_failed())
		ferry_child_finish(); /* exit 1 with the failures */
	_exit(codes[me]);
}

int main(void)
{
	tab = FERRY_PTR(mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
	tab[R].pid = getpid();
	pid_t p[3];
	for (int i = 0; i < 3; i++) {
		p[i] = spawn(A + i);
		wait_registered(A + i);
	}
	FERRY_WAIT_UNTIL(tab[A1].pid && tab[A2].pid && tab[B1].pid, 5000);

	ferry_ready();
	ferry_wait_go();

	check_self(R);
	static const int kids_r[] = { A, B, C };
	check_children(R, kids_r, 3);
	for (int i = 0; i < 3; i++)
		ferry_reap_child(p[i], nm[A + i], 1 + i, 15000);
	ferry_finish();
}
