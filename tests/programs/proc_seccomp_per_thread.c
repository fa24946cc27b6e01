/*
 * proc_seccomp_per_thread: a seccomp filter on one thread only.
 *
 * Sets up no_new_privs and, in the main thread only (no TSYNC), a filter
 * that makes syslog(2) fail with errno 77; a second thread has none.
 * Verifies: the main thread gets errno 77 from syslog, the other thread does
 * not (its Seccomp is 0).
 * (The engine refuses to capture this: it rebuilds only filters that every
 * thread shares.)
 */
#include "ferry_test.h"
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>

static volatile int go_flag, t_done;
static volatile pid_t t_tid;

static void *thread_fn(void *arg)
{
	(void)arg;
	t_tid = ferry_gettid();
	while (!go_flag)
		ferry_sleep_ms(5);
	errno = 0;
	long r = syscall(SYS_syslog, 10 /* SYSLOG_ACTION_SIZE_BUFFER */, 0, 0);
	FERRY_CHECK(!(r == -1 && errno == 77), "thread: syslog is filtered (%ld, errno %d)", r, errno);
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
	struct sock_filter f[] = {
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_syslog, 0, 1),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | 77),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
	};
	struct sock_fprog prog = { sizeof f / sizeof f[0], f };
	FERRY_SYS(syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog));

	ferry_ready();
	ferry_wait_go();

	errno = 0;
	long r = syscall(SYS_syslog, 10, 0, 0);
	FERRY_CHECK(r == -1 && errno == 77, "main: syslog gave %ld errno %d, expected errno 77", r, errno);
	go_flag = 1;
	pthread_join(t, NULL);
	FERRY_CHECK(t_done, "the thread did not finish");
	ferry_finish();
}
