/*
 * sys_blocked_epoll_wait: threads blocked in epoll_wait()/epoll_pwait().
 *
 * Sets up an epoll instance watching an empty pipe (EPOLLIN, data.u64 =
 * 0xfeed0001); thread A waits in epoll_wait() with no timeout, thread B in
 * epoll_pwait() with a 60 s timeout and a signal mask.
 * Verifies: after go, main writes into the pipe; both calls return 1 event
 * with EPOLLIN and the right data, never EINTR or 0.
 */
#include "ferry_test.h"
#include <sys/epoll.h>

struct waiter {
	int epfd, pwait;
	pid_t tid;
	int rc, err;
	struct epoll_event ev;
} w[2];

static void *waiter_fn(void *arg)
{
	struct waiter *x = arg;
	x->tid = ferry_gettid();
	if (x->pwait) {
		sigset_t m;
		sigemptyset(&m);
		sigaddset(&m, SIGUSR2);
		x->rc = epoll_pwait(x->epfd, &x->ev, 1, 60000, &m);
	} else {
		x->rc = epoll_wait(x->epfd, &x->ev, 1, -1);
	}
	x->err = x->rc < 0 ? errno : 0;
	return NULL;
}

int main(void)
{
	int p[2];
	FERRY_SYS(pipe(p));
	int epfd = FERRY_SYS(epoll_create1(EPOLL_CLOEXEC));
	struct epoll_event ev = { .events = EPOLLIN, .data.u64 = 0xfeed0001 };
	FERRY_SYS(epoll_ctl(epfd, EPOLL_CTL_ADD, p[0], &ev));
	pthread_t t[2];
	for (int i = 0; i < 2; i++) {
		w[i].epfd = epfd;
		w[i].pwait = i;
		if (pthread_create(&t[i], NULL, waiter_fn, &w[i]))
			ferry_die("pthread_create");
	}
	for (int i = 0; i < 2; i++) {
		FERRY_WAIT_UNTIL(w[i].tid != 0, 5000);
		if (!ferry_wait_blocked(w[i].tid, SYS_epoll_wait, SYS_epoll_pwait, 5000))
			ferry_die("waiter %d not blocked in epoll_wait", i);
	}

	ferry_ready();
	ferry_wait_go();

	FERRY_CHECK_EQ("write", 1, write(p[1], "x", 1));
	for (int i = 0; i < 2; i++) {
		const char *who = i ? "epoll_pwait(60 s)" : "epoll_wait(-1)";
		pthread_join(t[i], NULL);
		FERRY_CHECK(w[i].err != EINTR, "%s failed with EINTR", who);
		FERRY_CHECK(w[i].rc == 1, "%s returned %d (%s)", who, w[i].rc, strerror(w[i].err));
		FERRY_CHECK_EQ_HEX("event mask", EPOLLIN, w[i].ev.events);
		FERRY_CHECK_EQ_HEX("event data", 0xfeed0001, w[i].ev.data.u64);
	}
	ferry_finish();
}
