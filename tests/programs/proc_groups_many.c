/*
 * proc_groups_many: more supplementary groups than one page holds, in every
 * thread.
 *
 * Sets up: a second thread T (blocked waiting), then 2,000 supplementary
 * groups (2000..3999, 8,000 bytes as setgroups takes them: more than the
 * one-page scratch area an injected call had for them) with glibc's
 * setgroups, which applies them to every thread.
 * Verifies: getgroups in the main thread answers the same 2,000 groups in
 * order, and /proc/self/task/<tid>/status of each thread (main and T) lists
 * 2,000 groups, the first 2000 and the last 3999.
 */
#include "ferry_test.h"
#include <grp.h>

#define NGROUPS 2000

static volatile int checked;
static pid_t t_tid;

static void *thread_main(void *arg)
{
	(void)arg;
	t_tid = ferry_gettid();
	while (!checked)
		ferry_sleep_ms(1);
	return NULL;
}

static void check_task(pid_t tid, const char *name)
{
	char path[96];
	static char buf[65536];
	snprintf(path, sizeof path, "/proc/self/task/%d/status", (int)tid);
	if (ferry_read_file(path, buf, sizeof buf) < 0) {
		ferry_fail("%s: cannot read %s", name, path);
		return;
	}
	char *line = strstr(buf, "Groups:");
	if (!line) {
		ferry_fail("%s: no Groups line", name);
		return;
	}
	line += strlen("Groups:");
	int n = 0;
	unsigned first = 0, last = 0;
	char *end;
	for (;;) {
		while (*line == ' ' || *line == '\t')
			line++;
		if (*line < '0' || *line > '9')
			break;
		unsigned g = (unsigned)strtoul(line, &end, 10);
		if (n == 0)
			first = g;
		last = g;
		n++;
		line = end;
	}
	FERRY_CHECK(n == NGROUPS, "%s: %d groups, expected %d", name, n, NGROUPS);
	FERRY_CHECK(first == 2000, "%s: first group %u, expected 2000", name, first);
	FERRY_CHECK(last == 2000 + NGROUPS - 1, "%s: last group %u, expected %u", name, last,
		    2000 + NGROUPS - 1);
}

int main(void)
{
	static gid_t want[NGROUPS], got[NGROUPS + 1];
	pthread_t t;
	pthread_create(&t, NULL, thread_main, NULL);
	if (!FERRY_WAIT_UNTIL(t_tid != 0, 5000))
		ferry_die("thread did not start");
	for (int i = 0; i < NGROUPS; i++)
		want[i] = 2000 + i;
	FERRY_SYS(setgroups(NGROUPS, want));

	ferry_ready();
	ferry_wait_go();

	int n = getgroups(NGROUPS + 1, got);
	FERRY_CHECK_EQ("getgroups count", NGROUPS, n);
	int same = n == NGROUPS;
	for (int i = 0; same && i < NGROUPS; i++)
		same = got[i] == want[i];
	FERRY_CHECK(same, "getgroups answers other groups than the 2000..3999 set");
	check_task(getpid(), "main thread");
	check_task(t_tid, "thread T");
	checked = 1;
	pthread_join(t, NULL);
	ferry_finish();
}
