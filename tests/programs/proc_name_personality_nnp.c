/*
 * proc_name_personality_nnp: process/thread names, personality and
 * no_new_privs.
 *
 * Sets up PR_SET_NAME "ferry-named" for the main thread and "ferry-thr" for
 * a second thread, personality PER_LINUX|ADDR_NO_RANDOMIZE|UNAME26, and
 * PR_SET_NO_NEW_PRIVS.
 * Verifies: /proc/self/comm and the thread's comm, PR_GET_NAME,
 * personality(0xffffffff), uname() release reporting 2.6.x (UNAME26), and
 * no_new_privs (prctl and /proc/self/status NoNewPrivs).
 */
#include "ferry_test.h"
#include <sys/personality.h>
#include <sys/prctl.h>
#include <sys/utsname.h>

static volatile int go_flag;
static volatile pid_t t_tid;

static void *thread_fn(void *arg)
{
	(void)arg;
	prctl(PR_SET_NAME, "ferry-thr", 0, 0, 0);
	t_tid = ferry_gettid();
	while (!go_flag)
		ferry_sleep_ms(5);
	return NULL;
}

int main(void)
{
	FERRY_SYS(prctl(PR_SET_NAME, "ferry-named", 0, 0, 0));
	int pers = PER_LINUX | ADDR_NO_RANDOMIZE | UNAME26;
	FERRY_SYS(personality(pers));
	FERRY_SYS(prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0));
	pthread_t t;
	if (pthread_create(&t, NULL, thread_fn, NULL))
		ferry_die("pthread_create");
	FERRY_WAIT_UNTIL(t_tid != 0, 5000);

	ferry_ready();
	ferry_wait_go();

	char comm[64] = "", path[64], name[17] = "";
	ferry_read_file("/proc/self/comm", comm, sizeof comm);
	FERRY_CHECK_EQ_STR("/proc/self/comm", "ferry-named\n", comm);
	prctl(PR_GET_NAME, name, 0, 0, 0);
	FERRY_CHECK_EQ_STR("PR_GET_NAME", "ferry-named", name);
	snprintf(path, sizeof path, "/proc/self/task/%d/comm", (int)t_tid);
	ferry_read_file(path, comm, sizeof comm);
	FERRY_CHECK_EQ_STR("thread comm", "ferry-thr\n", comm);
	FERRY_CHECK_EQ_HEX("personality", pers, personality(0xffffffff));
	struct utsname u;
	uname(&u);
	FERRY_CHECK(strncmp(u.release, "2.6.", 4) == 0, "uname release \"%s\" (UNAME26 should give 2.6.x)",
		    u.release);
	FERRY_CHECK_EQ("PR_GET_NO_NEW_PRIVS", 1, prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0));
	char nnp[8] = "";
	ferry_status_field(0, "NoNewPrivs", nnp, sizeof nnp);
	FERRY_CHECK_EQ_STR("NoNewPrivs", "1", nnp);
	go_flag = 1;
	pthread_join(t, NULL);
	ferry_finish();
}
