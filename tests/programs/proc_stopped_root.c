/*
 * proc_stopped_root: the checkpointed process itself is stopped (SIGSTOP),
 * with a second thread, as a job stopped by its shell would be.
 *
 * Sets up: the main process R starts a thread that counts, forks a waker W,
 * and stops itself with raise(SIGSTOP). W waits until every thread of R is
 * stopped, then writes the ready file with R's pid (so R, stopped, is what
 * is checkpointed), waits for go, checks that R and its thread are still
 * stopped (state T) and that the counter does not move, and continues R.
 * Verifies (in R, once continued): W saw R stopped throughout and exited
 * with 0; the thread counts again.
 */
#include "ferry_test.h"
#include <sys/wait.h>

static volatile uint64_t count;

static void *counter(void *arg)
{
	(void)arg;
	for (;;) {
		count++;
		ferry_sleep_ms(1);
	}
	return NULL;
}

static int threads_in(pid_t pid, char want)
{
	char path[64];
	snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
	DIR *d = opendir(path);
	if (!d)
		return -1;
	int n = 0;
	struct dirent *e;
	while ((e = readdir(d))) {
		if (e->d_name[0] == '.')
			continue;
		char p[320], buf[512];
		snprintf(p, sizeof p, "/proc/%d/task/%s/stat", (int)pid, e->d_name);
		if (ferry_read_file(p, buf, sizeof buf) < 0)
			continue;
		char *c = strrchr(buf, ')');
		if (c && c[2] == want)
			n++;
	}
	closedir(d);
	return n;
}

int main(void)
{
	pthread_t t;
	pthread_create(&t, NULL, counter, NULL);
	pid_t r = getpid();
	pid_t w = FERRY_SYS(fork());
	if (w == 0) {
		if (!FERRY_WAIT_UNTIL(threads_in(r, 'T') == 2, 5000))
			ferry_die("R did not stop");
		char text[32];
		snprintf(text, sizeof text, "%d\n", (int)r);
		if (ferry_write_atomic("ready", text) < 0)
			ferry_die("cannot write ready");
		ferry_wait_go();
		FERRY_CHECK_EQ("threads of R stopped", 2, threads_in(r, 'T'));
		ferry_sleep_ms(20);
		FERRY_CHECK_EQ("threads of R stopped later", 2, threads_in(r, 'T'));
		FERRY_SYS(kill(r, SIGCONT));
		ferry_child_finish();
	}
	raise(SIGSTOP);
	/* Continued by W, after go. */
	ferry_wait_go();
	ferry_reap_child(w, "W", 0, 5000);
	uint64_t before = count;
	FERRY_CHECK(FERRY_WAIT_UNTIL(count > before, 5000), "the thread does not count");
	ferry_finish();
}
