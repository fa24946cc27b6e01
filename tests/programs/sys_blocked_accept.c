/*
 * sys_blocked_accept: a thread blocked in accept().
 *
 * Sets up a listening AF_UNIX stream socket bound to $T/accept.sock and a
 * thread blocked in accept() on it (nobody has connected).
 * Verifies: after go, main connects and sends "ping"; accept returns a new
 * fd (never EINTR), which reads "ping" and is connected to main's socket
 * (a reply arrives back).
 */
#include "ferry_test.h"
#include <sys/socket.h>
#include <sys/un.h>

static int lfd;
static volatile pid_t tid;
static int afd = -1, aerr;
static char got[8];

static void *acceptor(void *arg)
{
	(void)arg;
	tid = ferry_gettid();
	afd = accept(lfd, NULL, NULL);
	aerr = afd < 0 ? errno : 0;
	if (afd >= 0) {
		ssize_t n = read(afd, got, 4);
		if (n == 4)
			n = write(afd, "pong", 4);
	}
	return NULL;
}

int main(void)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	char path[PATH_MAX];
	ferry_path(path, sizeof path, "accept.sock");
	if (strlen(path) >= sizeof sa.sun_path)
		ferry_die("socket path too long: %s", path);
	strcpy(sa.sun_path, path);
	lfd = FERRY_SYS(socket(AF_UNIX, SOCK_STREAM, 0));
	FERRY_SYS(bind(lfd, (struct sockaddr *)&sa, sizeof sa));
	FERRY_SYS(listen(lfd, 4));
	pthread_t t;
	if (pthread_create(&t, NULL, acceptor, NULL))
		ferry_die("pthread_create");
	FERRY_WAIT_UNTIL(tid != 0, 5000);
	if (!ferry_wait_blocked(tid, SYS_accept, SYS_accept4, 5000))
		ferry_die("thread not blocked in accept()");

	ferry_ready();
	ferry_wait_go();

	int c = socket(AF_UNIX, SOCK_STREAM, 0);
	FERRY_CHECK(connect(c, (struct sockaddr *)&sa, sizeof sa) == 0, "connect: %s", strerror(errno));
	FERRY_CHECK_EQ("send ping", 4, write(c, "ping", 4));
	pthread_join(t, NULL);
	FERRY_CHECK(aerr != EINTR, "accept failed with EINTR");
	FERRY_CHECK(afd >= 0, "accept failed: %s", strerror(aerr));
	FERRY_CHECK_MEM("data on accepted socket", "ping", got, 4);
	char reply[4] = "";
	FERRY_CHECK_EQ("read reply", 4, read(c, reply, 4));
	FERRY_CHECK_MEM("reply", "pong", reply, 4);
	ferry_finish();
}
