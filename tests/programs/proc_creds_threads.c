/*
 * proc_creds_threads: credentials of every thread, not only the main one.
 *
 * Sets up: a second thread T (blocked waiting), then drops the process to
 * uid/gid 1000 with setresgid/setresuid (glibc applies them to every
 * thread) and clears the effective and permitted capabilities.
 * Verifies: /proc/self/task/<tid>/status of each thread (main and T) shows
 * Uid and Gid 1000 and CapEff/CapPrm 0, and T itself, once it runs, cannot
 * open a root-only file.
 */
#include "ferry_test.h"
#include <grp.h>

static volatile int t_result = -1, checked;
static pid_t t_tid;

static void *thread_main(void *arg)
{
	(void)arg;
	t_tid = ferry_gettid();
	ferry_wait_go();
	while (!checked)
		ferry_sleep_ms(1);
	int fd = open("/etc/shadow", O_RDONLY);
	t_result = fd >= 0 ? 1 : 0;
	if (fd >= 0)
		close(fd);
	return NULL;
}

static void check_task(pid_t tid, const char *name)
{
	char path[96], buf[4096];
	snprintf(path, sizeof path, "/proc/self/task/%d/status", (int)tid);
	if (ferry_read_file(path, buf, sizeof buf) < 0) {
		ferry_fail("%s: cannot read %s", name, path);
		return;
	}
	char *uid = strstr(buf, "Uid:"), *gid = strstr(buf, "Gid:");
	char *eff = strstr(buf, "CapEff:"), *prm = strstr(buf, "CapPrm:");
	unsigned u[4] = { 9, 9, 9, 9 }, g[4] = { 9, 9, 9, 9 };
	unsigned long long ce = 1, cp = 1;
	if (uid)
		sscanf(uid, "Uid: %u %u %u %u", &u[0], &u[1], &u[2], &u[3]);
	if (gid)
		sscanf(gid, "Gid: %u %u %u %u", &g[0], &g[1], &g[2], &g[3]);
	if (eff)
		sscanf(eff, "CapEff: %llx", &ce);
	if (prm)
		sscanf(prm, "CapPrm: %llx", &cp);
	for (int i = 0; i < 4; i++) {
		FERRY_CHECK(u[i] == 1000, "%s: uid[%d] %u, expected 1000", name, i, u[i]);
		FERRY_CHECK(g[i] == 1000, "%s: gid[%d] %u, expected 1000", name, i, g[i]);
	}
	FERRY_CHECK(ce == 0, "%s: CapEff %llx, expected 0", name, ce);
	FERRY_CHECK(cp == 0, "%s: CapPrm %llx, expected 0", name, cp);
}

int main(void)
{
	pthread_t t;
	pthread_create(&t, NULL, thread_main, NULL);
	if (!FERRY_WAIT_UNTIL(t_tid != 0, 5000))
		ferry_die("thread did not start");
	FERRY_SYS(chmod(ferry_dir(), 0777));
	gid_t none[1] = { 1000 };
	FERRY_SYS(setgroups(1, none));
	FERRY_SYS(setresgid(1000, 1000, 1000));
	FERRY_SYS(setresuid(1000, 1000, 1000));

	ferry_ready();
	ferry_wait_go();

	check_task(getpid(), "main thread");
	check_task(t_tid, "thread T");
	checked = 1;
	pthread_join(t, NULL);
	FERRY_CHECK_EQ("T opened /etc/shadow", 0, t_result);
	ferry_finish();
}
