/*
 * fd_unix_scm_anon: anonymous-inode descriptors in flight (SCM_RIGHTS) in a
 * UNIX datagram socket's queue: a timerfd, a signalfd, an inotify instance
 * and two epoll instances.
 *
 * Sets up a datagram pair D (d0 -> d1) whose queue holds one message "anon"
 * carrying [TF, SF, IN, EP, EQ]:
 *   TF  a CLOCK_MONOTONIC timerfd armed for 100 s, interval 7 s (closed here)
 *   SF  a signalfd for SIGUSR1 and SIGUSR2 (closed here)
 *   IN  an inotify instance watching $T/w for IN_CREATE (closed here)
 *   EP  an epoll instance the process keeps (as fd ep), watching eventfd E
 *       for EPOLLIN with data 0x1234
 *   EQ  an epoll instance with an empty interest list (closed here)
 * Verifies: the message comes back with its five descriptors, each the kind
 * it was; the timer still has between 0 and 100 s left and its 7 s interval;
 * the signalfd's mask; an IN_CREATE for a file made in $T/w comes on IN with
 * its name and watch descriptor; EP is the description the process holds
 * (kcmp) and reports E with data 0x1234 once E is written; EQ reports
 * nothing; the process's fd table is unchanged.
 */
#include "ferry_test.h"
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/timerfd.h>

#define N 5

static void check_link(int fd, const char *what, const char *want)
{
	char l[128];
	ferry_fd_link(fd, l, sizeof l);
	FERRY_CHECK(strcmp(l, want) == 0, "%s in flight is %s, expected %s", what, l, want);
}

int main(void)
{
	int d[2];
	FERRY_SYS(socketpair(AF_UNIX, SOCK_DGRAM, 0, d));

	int tf = FERRY_SYS(timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK));
	struct itimerspec its = { .it_interval = { 7, 0 }, .it_value = { 100, 0 } };
	FERRY_SYS(timerfd_settime(tf, 0, &its, NULL));
	sigset_t mask;
	sigemptyset(&mask);
	sigaddset(&mask, SIGUSR1);
	sigaddset(&mask, SIGUSR2);
	int sf = FERRY_SYS(signalfd(-1, &mask, SFD_NONBLOCK));
	int in = FERRY_SYS(inotify_init1(IN_NONBLOCK));
	char wdir[PATH_MAX];
	FERRY_SYS(mkdir(ferry_path(wdir, sizeof wdir, "w"), 0700));
	int wd = FERRY_SYS(inotify_add_watch(in, wdir, IN_CREATE));
	int e = FERRY_SYS(eventfd(0, EFD_NONBLOCK));
	int ep = FERRY_SYS(epoll_create1(0));
	struct epoll_event ev = { .events = EPOLLIN, .data.u64 = 0x1234 };
	FERRY_SYS(epoll_ctl(ep, EPOLL_CTL_ADD, e, &ev));
	int eq = FERRY_SYS(epoll_create1(0));

	int out[N] = { tf, sf, in, ep, eq };
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int) * N)];
	} u;
	memset(&u, 0, sizeof u);
	struct iovec iov = { .iov_base = "anon", .iov_len = 4 };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
			     .msg_controllen = sizeof u.buf };
	struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
	c->cmsg_level = SOL_SOCKET;
	c->cmsg_type = SCM_RIGHTS;
	c->cmsg_len = CMSG_LEN(sizeof(int) * N);
	memcpy(CMSG_DATA(c), out, sizeof out);
	FERRY_SYS(sendmsg(d[0], &mh, 0));
	close(tf);
	close(sf);
	close(in);
	close(eq);

	int fds[64];
	int nfds = ferry_list_fds(fds, 64);
	ferry_ready();
	ferry_wait_go();
	ferry_check_fds_same(fds, nfds);

	char data[8] = "";
	struct iovec riov = { .iov_base = data, .iov_len = sizeof data };
	memset(&u, 0, sizeof u);
	struct msghdr rh = { .msg_iov = &riov, .msg_iovlen = 1, .msg_control = u.buf,
			     .msg_controllen = sizeof u.buf };
	ssize_t n = recvmsg(d[1], &rh, MSG_DONTWAIT);
	FERRY_CHECK(n == 4 && memcmp(data, "anon", 4) == 0, "the message is %zd bytes \"%.8s\"", n, data);
	c = CMSG_FIRSTHDR(&rh);
	FERRY_CHECK(c && c->cmsg_type == SCM_RIGHTS && c->cmsg_len == CMSG_LEN(sizeof(int) * N),
		    "the message came without its %d descriptors", N);
	if (!c || c->cmsg_len != CMSG_LEN(sizeof(int) * N))
		ferry_finish();
	int got[N];
	memcpy(got, CMSG_DATA(c), sizeof got);
	check_link(got[0], "TF", "anon_inode:[timerfd]");
	check_link(got[1], "SF", "anon_inode:[signalfd]");
	check_link(got[2], "IN", "anon_inode:inotify");
	check_link(got[3], "EP", "anon_inode:[eventpoll]");
	check_link(got[4], "EQ", "anon_inode:[eventpoll]");

	struct itimerspec now;
	FERRY_SYS(timerfd_gettime(got[0], &now));
	FERRY_CHECK(now.it_value.tv_sec < 100 && (now.it_value.tv_sec > 0 || now.it_value.tv_nsec > 0),
		    "TF has %lds left", (long)now.it_value.tv_sec);
	FERRY_CHECK_EQ("TF interval", 7L, (long)now.it_interval.tv_sec);

	char v[64];
	FERRY_CHECK(ferry_fdinfo_field(got[1], "sigmask", v, sizeof v) == 0, "SF has no sigmask");
	unsigned long long m = strtoull(v, NULL, 16);
	FERRY_CHECK_EQ_HEX("SF mask", (1ULL << (SIGUSR1 - 1)) | (1ULL << (SIGUSR2 - 1)), m);

	char path[PATH_MAX];
	int nf = FERRY_SYS(open(ferry_path(path, sizeof path, "w/made-after"), O_CREAT | O_WRONLY, 0600));
	close(nf);
	char ibuf[sizeof(struct inotify_event) + NAME_MAX + 1] __attribute__((aligned(8)));
	int found = 0;
	for (int i = 0; i < 200 && !found; i++) {
		ssize_t k = read(got[2], ibuf, sizeof ibuf);
		for (ssize_t at = 0; at < k;) {
			struct inotify_event *ie = (struct inotify_event *)(ibuf + at);
			if (ie->wd == wd && (ie->mask & IN_CREATE) && strcmp(ie->name, "made-after") == 0)
				found = 1;
			at += sizeof *ie + ie->len;
		}
		if (!found)
			ferry_sleep_ms(5);
	}
	FERRY_CHECK(found, "IN: no IN_CREATE for made-after on watch %d", wd);
	unlink(path);
	rmdir(wdir);

	FERRY_CHECK(syscall(SYS_kcmp, getpid(), getpid(), 0 /* KCMP_FILE */, ep, got[3]) == 0,
		    "EP in flight is not the epoll instance the process holds");
	struct epoll_event r[4];
	FERRY_CHECK_EQ("EP ready before E is written", 0, epoll_wait(got[3], r, 4, 0));
	uint64_t one = 1;
	FERRY_SYS(write(e, &one, sizeof one));
	int k = epoll_wait(got[3], r, 4, 0);
	FERRY_CHECK_EQ("EP ready", 1, k);
	if (k == 1)
		FERRY_CHECK_EQ_HEX("EP data", 0x1234ULL, (unsigned long long)r[0].data.u64);
	FERRY_CHECK_EQ("EQ ready", 0, epoll_wait(got[4], r, 4, 0));
	ferry_finish();
}
