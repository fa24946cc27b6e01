/*
 * sys_blocked_poll: threads blocked in poll(), ppoll() and select().
 *
 * Sets up four threads waiting for their own empty pipe to become readable:
 * poll() with no timeout, poll() with a 60 s timeout, ppoll() with a 60 s
 * timeout and a signal mask blocking SIGUSR2, select() with a 60 s timeout.
 * Verifies: after go, main writes one byte into each pipe; each call returns
 * 1 with POLLIN / the fd set, never EINTR or a timeout (0).
 */
#include "ferry_test.h"
#include <poll.h>
#include <sys/select.h>

enum { POLL_INF, POLL_TMO, PPOLL, SELECT, NW };
static const char *names[NW] = { "poll(-1)", "poll(60 s)", "ppoll(60 s, mask)", "select(60 s)" };

struct waiter {
	int kind, fd;
	pid_t tid;
	int rc, err, ready;
} w[NW];

static void *waiter_fn(void *arg)
{
	struct waiter *x = arg;
	x->tid = ferry_gettid();
	struct pollfd pfd = { .fd = x->fd, .events = POLLIN };
	if (x->kind == POLL_INF || x->kind == POLL_TMO) {
		x->rc = poll(&pfd, 1, x->kind == POLL_INF ? -1 : 60000);
		x->ready = pfd.revents == POLLIN;
	} else if (x->kind == PPOLL) {
		struct timespec ts = { 60, 0 };
		sigset_t m;
		sigemptyset(&m);
		sigaddset(&m, SIGUSR2);
		x->rc = ppoll(&pfd, 1, &ts, &m);
		x->ready = pfd.revents == POLLIN;
	} else {
		fd_set rs;
		FD_ZERO(&rs);
		FD_SET(x->fd, &rs);
		struct timeval tv = { 60, 0 };
		x->rc = select(x->fd + 1, &rs, NULL, NULL, &tv);
		x->ready = FD_ISSET(x->fd, &rs);
	}
	x->err = x->rc < 0 ? errno : 0;
	return NULL;
}

int main(void)
{
	int p[NW][2];
	pthread_t t[NW];
	for (int i = 0; i < NW; i++) {
		FERRY_SYS(pipe(p[i]));
		w[i].kind = i;
		w[i].fd = p[i][0];
		if (pthread_create(&t[i], NULL, waiter_fn, &w[i]))
			ferry_die("pthread_create");
	}
	static const long nr[NW][2] = { { SYS_poll, SYS_ppoll }, { SYS_poll, SYS_ppoll },
					{ SYS_ppoll, SYS_ppoll }, { SYS_select, SYS_pselect6 } };
	for (int i = 0; i < NW; i++) {
		FERRY_WAIT_UNTIL(w[i].tid != 0, 5000);
		if (!ferry_wait_blocked(w[i].tid, nr[i][0], nr[i][1], 5000))
			ferry_die("%s waiter not blocked", names[i]);
	}

	ferry_ready();
	ferry_wait_go();

	for (int i = 0; i < NW; i++)
		FERRY_CHECK_EQ("write", 1, write(p[i][1], "x", 1));
	for (int i = 0; i < NW; i++) {
		pthread_join(t[i], NULL);
		FERRY_CHECK(w[i].err != EINTR, "%s failed with EINTR", names[i]);
		FERRY_CHECK(w[i].rc == 1, "%s returned %d (%s)", names[i], w[i].rc, strerror(w[i].err));
		FERRY_CHECK(w[i].ready, "%s: fd not reported readable", names[i]);
	}
	ferry_finish();
}
