/*
 * sys_blocked_read: threads blocked in read() on empty pipes.
 *
 * Sets up thread A blocked in read() on pipe 1, thread B blocked in read()
 * on pipe 2 with a SIGUSR1 handler installed with SA_RESTART, and the MAIN
 * thread blocked in read() on pipe 3; a helper thread H signals ready once
 * all three are asleep in read(), and does the waking after go.
 * Verifies: after go, H sends SIGUSR1 to B (its read must restart, not
 * fail), then writes a message to each pipe; each read returns exactly that
 * message, and no read ever failed with EINTR.
 */
#include "ferry_test.h"

struct waiter {
	int fd, wfd;
	pid_t tid;
	ssize_t n;
	int err;
	char buf[64];
} w[3]; /* A, B, main */

static const char *msg[3] = { "message-for-A", "message-for-B-after-signal", "message-for-main" };
static pthread_t t[2];
static volatile int handler_ran;

static void on_usr1(int sig)
{
	(void)sig;
	handler_ran = 1;
}

static void do_read(struct waiter *x)
{
	x->tid = ferry_gettid();
	x->n = read(x->fd, x->buf, sizeof x->buf);
	x->err = x->n < 0 ? errno : 0;
}

static void *reader(void *arg)
{
	do_read(arg);
	return NULL;
}

static void *helper(void *arg)
{
	(void)arg;
	for (int i = 0; i < 3; i++) {
		FERRY_WAIT_UNTIL(w[i].tid != 0, 5000);
		if (!ferry_wait_blocked(w[i].tid, SYS_read, SYS_read, 5000))
			ferry_die("reader %d not blocked in read()", i);
	}
	ferry_ready();
	ferry_wait_go();
	pthread_kill(t[1], SIGUSR1);
	FERRY_CHECK(FERRY_WAIT_UNTIL(handler_ran, 2000), "SIGUSR1 handler did not run");
	ferry_sleep_ms(20);
	for (int i = 0; i < 3; i++)
		FERRY_CHECK_EQ("write", (ssize_t)strlen(msg[i]), write(w[i].wfd, msg[i], strlen(msg[i])));
	return NULL;
}

int main(void)
{
	struct sigaction sa = { .sa_handler = on_usr1, .sa_flags = SA_RESTART };
	sigemptyset(&sa.sa_mask);
	FERRY_SYS(sigaction(SIGUSR1, &sa, NULL));
	for (int i = 0; i < 3; i++) {
		int p[2];
		FERRY_SYS(pipe(p));
		w[i].fd = p[0];
		w[i].wfd = p[1];
	}
	for (int i = 0; i < 2; i++)
		if (pthread_create(&t[i], NULL, reader, &w[i]))
			ferry_die("pthread_create");
	pthread_t h;
	if (pthread_create(&h, NULL, helper, NULL))
		ferry_die("pthread_create");

	do_read(&w[2]); /* main blocks here across the checkpoints */

	pthread_join(h, NULL);
	static const char *who[3] = { "reader A", "reader B", "main thread" };
	for (int i = 0; i < 3; i++) {
		if (i < 2)
			pthread_join(t[i], NULL);
		char what[64];
		snprintf(what, sizeof what, "%s: read() errno", who[i]);
		FERRY_CHECK_EQ(what, 0, w[i].err);
		FERRY_CHECK(w[i].err != EINTR, "%s: read() failed with EINTR", who[i]);
		snprintf(what, sizeof what, "%s: read() result", who[i]);
		FERRY_CHECK_EQ(what, (ssize_t)strlen(msg[i]), w[i].n);
		if (w[i].n == (ssize_t)strlen(msg[i]))
			FERRY_CHECK_MEM("data read", msg[i], w[i].buf, (size_t)w[i].n);
	}
	ferry_finish();
}
