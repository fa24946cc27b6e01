/*
 * thr_pthreads: a multi-threaded process.
 *
 * Sets up 4 threads besides main, each with its own name (comm), __thread
 * value, pthread_key value, signal mask (thread 0 blocks SIGUSR1, 1 blocks
 * SIGUSR2 and SIGRTMIN, 2 blocks nothing, 3 blocks every signal), a stack
 * variable with a pattern; thread 2 runs on a caller-allocated stack.
 * Verifies: the same set of TIDs (/proc/self/task), each thread's gettid(),
 * pthread_self(), name, TLS/key values, stack contents and address, and
 * signal mask (pthread_sigmask and /proc .../status SigBlk); that the
 * threads still run (they do the checks) and join.
 */
#include "ferry_test.h"

#define NT 4

static __thread int tls_id = -1;
static pthread_key_t key;
static volatile int go_flag, nready;

struct tinfo {
	pid_t tid;
	pthread_t self;
	void *stack_var;
	sigset_t mask;
	char name[16];
} info[NT];

static void make_mask(int i, sigset_t *s)
{
	sigemptyset(s);
	if (i == 0)
		sigaddset(s, SIGUSR1);
	if (i == 1) {
		sigaddset(s, SIGUSR2);
		sigaddset(s, SIGRTMIN);
	}
	if (i == 3) {
		sigfillset(s);
		sigdelset(s, SIGKILL); /* cannot be blocked */
		sigdelset(s, SIGSTOP);
	}
}

static void *thread_fn(void *arg)
{
	int i = (int)(intptr_t)arg;
	unsigned char stack_data[4096];
	ferry_fill(stack_data, sizeof stack_data, 140 + (uint64_t)i);
	struct tinfo *ti = &info[i];
	ti->tid = ferry_gettid();
	ti->self = pthread_self();
	ti->stack_var = stack_data;
	tls_id = 1000 + i;
	pthread_setspecific(key, (void *)(intptr_t)(2000 + i));
	snprintf(ti->name, sizeof ti->name, "ferry-w%d", i);
	pthread_setname_np(pthread_self(), ti->name);
	make_mask(i, &ti->mask);
	pthread_sigmask(SIG_SETMASK, &ti->mask, NULL);
	__atomic_add_fetch(&nready, 1, __ATOMIC_SEQ_CST);

	while (!go_flag)
		ferry_sleep_ms(5);

	char what[64];
	snprintf(what, sizeof what, "thread %d: gettid", i);
	FERRY_CHECK_EQ(what, ti->tid, ferry_gettid());
	snprintf(what, sizeof what, "thread %d: pthread_self", i);
	FERRY_CHECK_EQ_HEX(what, ti->self, pthread_self());
	snprintf(what, sizeof what, "thread %d: tls", i);
	FERRY_CHECK_EQ(what, 1000 + i, tls_id);
	snprintf(what, sizeof what, "thread %d: pthread_getspecific", i);
	FERRY_CHECK_EQ(what, 2000 + i, (intptr_t)pthread_getspecific(key));
	snprintf(what, sizeof what, "thread %d: stack data", i);
	ferry_check_fill(what, stack_data, sizeof stack_data, 140 + (uint64_t)i);
	snprintf(what, sizeof what, "thread %d: stack address", i);
	FERRY_CHECK_EQ_HEX(what, ti->stack_var, stack_data);
	char name[16] = "";
	pthread_getname_np(pthread_self(), name, sizeof name);
	snprintf(what, sizeof what, "thread %d: name", i);
	FERRY_CHECK_EQ_STR(what, ti->name, name);
	sigset_t cur;
	pthread_sigmask(SIG_SETMASK, NULL, &cur);
	for (int s = 1; s < NSIG; s++)
		if (sigismember(&cur, s) != sigismember(&ti->mask, s))
			ferry_fail("thread %d: signal %d %s blocked", i, s,
				   sigismember(&cur, s) ? "is" : "is not");
	return (void *)(intptr_t)(3000 + i);
}

static int task_list(pid_t *out, int max)
{
	int dfd = open("/proc/self/task", O_RDONLY | O_DIRECTORY);
	if (dfd < 0)
		return -1;
	char buf[4096];
	int n = 0;
	long r;
	while ((r = syscall(SYS_getdents64, dfd, buf, sizeof buf)) > 0)
		for (long off = 0; off < r;) {
			struct dirent64 *d = (void *)(buf + off);
			if (d->d_name[0] != '.' && n < max)
				out[n++] = atoi(d->d_name);
			off += d->d_reclen;
		}
	close(dfd);
	for (int i = 1; i < n; i++)
		for (int j = i; j > 0 && out[j - 1] > out[j]; j--) {
			pid_t t = out[j];
			out[j] = out[j - 1];
			out[j - 1] = t;
		}
	return n;
}

int main(void)
{
	pthread_key_create(&key, NULL);
	pthread_t t[NT];
	size_t custom_size = 256 * 1024;
	void *custom_stack = FERRY_PTR(mmap(NULL, custom_size, PROT_READ | PROT_WRITE,
					    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
	for (int i = 0; i < NT; i++) {
		pthread_attr_t a;
		pthread_attr_init(&a);
		if (i == 2)
			pthread_attr_setstack(&a, custom_stack, custom_size);
		if (pthread_create(&t[i], &a, thread_fn, (void *)(intptr_t)i))
			ferry_die("pthread_create");
		pthread_attr_destroy(&a);
	}
	if (!FERRY_WAIT_UNTIL(nready == NT, 5000))
		ferry_die("threads did not start");
	pid_t tasks_before[16], tasks_now[16];
	int ntasks = task_list(tasks_before, 16);
	char blk_before[NT][32];
	for (int i = 0; i < NT; i++)
		ferry_status_field(info[i].tid, "SigBlk", blk_before[i], sizeof blk_before[i]);

	ferry_ready();
	ferry_wait_go();

	int n = task_list(tasks_now, 16);
	FERRY_CHECK_EQ("number of tasks", ntasks, n);
	for (int i = 0; i < n && i < ntasks; i++)
		FERRY_CHECK_EQ("task id", tasks_before[i], tasks_now[i]);
	for (int i = 0; i < NT; i++) {
		char path[64], comm[64] = "", blk[32] = "", what[64];
		snprintf(path, sizeof path, "/proc/self/task/%d/comm", info[i].tid);
		ferry_read_file(path, comm, sizeof comm);
		comm[strcspn(comm, "\n")] = 0;
		snprintf(what, sizeof what, "thread %d: comm", i);
		FERRY_CHECK_EQ_STR(what, info[i].name, comm);
		ferry_status_field(info[i].tid, "SigBlk", blk, sizeof blk);
		snprintf(what, sizeof what, "thread %d: SigBlk", i);
		FERRY_CHECK_EQ_STR(what, blk_before[i], blk);
	}
	go_flag = 1;
	for (int i = 0; i < NT; i++) {
		void *ret = NULL;
		pthread_join(t[i], &ret);
		FERRY_CHECK_EQ("thread return value", 3000 + i, (intptr_t)ret);
	}
	ferry_finish();
}
