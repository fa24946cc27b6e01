/*
 * proc_seccomp_filter: stacked seccomp BPF filters.
 *
 * Sets up no_new_privs and two seccomp filters: the first makes syslog(2)
 * fail with errno 77, the second makes get_mempolicy(2) fail with errno 78
 * (everything else allowed).  A second thread exists (filters are
 * per-thread; installed with SECCOMP_FILTER_FLAG_TSYNC).
 * Verifies: /proc/self/status Seccomp 2 and Seccomp_filters 2 for both
 * threads (3 in a body, a process whose home is another node: Ferry's own
 * filter, which hands getppid & co. to its supervisor, counts there; see
 * docs/syscalls.md), and both filters still act (errnos 77 and 78) in both
 * threads.
 */
#include "ferry_test.h"
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>

static volatile int go_flag, t_done;
static volatile pid_t t_tid;

static void install(long nr, int err)
{
	struct sock_filter f[] = {
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (unsigned)nr, 0, 1),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (unsigned)err),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
	};
	struct sock_fprog prog = { sizeof f / sizeof f[0], f };
	if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, &prog) != 0)
		ferry_die("seccomp: %s", strerror(errno));
}

static void probe(const char *who)
{
	errno = 0;
	long r = syscall(SYS_syslog, 10 /* SYSLOG_ACTION_SIZE_BUFFER */, 0, 0);
	FERRY_CHECK(r == -1 && errno == 77, "%s: syslog gave %ld errno %d, expected errno 77", who, r, errno);
	errno = 0;
	r = syscall(SYS_get_mempolicy, NULL, NULL, 0, NULL, 0);
	FERRY_CHECK(r == -1 && errno == 78, "%s: get_mempolicy gave %ld errno %d, expected errno 78", who, r,
		    errno);
}

static void *thread_fn(void *arg)
{
	(void)arg;
	t_tid = ferry_gettid();
	while (!go_flag)
		ferry_sleep_ms(5);
	probe("thread");
	t_done = 1;
	return NULL;
}

int main(void)
{
	pthread_t t;
	if (pthread_create(&t, NULL, thread_fn, NULL))
		ferry_die("pthread_create");
	FERRY_WAIT_UNTIL(t_tid != 0, 5000);
	FERRY_SYS(prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0));
	install(SYS_syslog, 77);
	install(SYS_get_mempolicy, 78);

	ferry_ready();
	ferry_wait_go();

	/* A body lives in guest namespaces whose init is ferry's. */
	char init[256] = "";
	ssize_t n = ferry_read_file("/proc/1/cmdline", init, sizeof init - 1);
	int in_guest = 0;
	for (ssize_t i = 0; i + 12 <= n; i++)
		if (memcmp(init + i, "__guest-init", 12) == 0)
			in_guest = 1;
	pid_t tids[2] = { getpid(), t_tid };
	for (int i = 0; i < 2; i++) {
		char v[16] = "", what[64];
		ferry_status_field(tids[i], "Seccomp", v, sizeof v);
		snprintf(what, sizeof what, "%s Seccomp", i ? "thread" : "main");
		FERRY_CHECK_EQ_STR(what, "2", v);
		ferry_status_field(tids[i], "Seccomp_filters", v, sizeof v);
		snprintf(what, sizeof what, "%s Seccomp_filters", i ? "thread" : "main");
		if (!(in_guest && strcmp(v, "3") == 0))
			FERRY_CHECK_EQ_STR(what, "2", v);
	}
	probe("main");
	go_flag = 1;
	pthread_join(t, NULL);
	ferry_finish();
}
