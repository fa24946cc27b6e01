/*
 * fd_signalfd: a signalfd with a signal pending.
 *
 * Sets up SIGUSR1 and SIGUSR2 blocked, signalfd F for both
 * (SFD_NONBLOCK|SFD_CLOEXEC), and SIGUSR1 queued with value 5 (pending).
 * Verifies: F's fdinfo sigmask and flags, reading F gives SIGUSR1 with
 * SI_QUEUE, value 5 and our pid, then EAGAIN; a SIGUSR2 raised after
 * restore is read from F as well.
 */
#include "ferry_test.h"
#include <sys/signalfd.h>

int main(void)
{
	sigset_t s;
	sigemptyset(&s);
	sigaddset(&s, SIGUSR1);
	sigaddset(&s, SIGUSR2);
	pthread_sigmask(SIG_BLOCK, &s, NULL);
	int f = FERRY_SYS(signalfd(-1, &s, SFD_NONBLOCK | SFD_CLOEXEC));
	union sigval v = { .sival_int = 5 };
	FERRY_SYS(sigqueue(getpid(), SIGUSR1, v));
	char mask[64];
	ferry_fdinfo_field(f, "sigmask", mask, sizeof mask);
	long fl = ferry_fdinfo_flags(f);

	ferry_ready();
	ferry_wait_go();

	char now[64] = "";
	ferry_fdinfo_field(f, "sigmask", now, sizeof now);
	FERRY_CHECK_EQ_STR("signalfd sigmask", mask, now);
	FERRY_CHECK_EQ_HEX("signalfd flags", fl, ferry_fdinfo_flags(f));
	FERRY_CHECK_EQ("FD_CLOEXEC", FD_CLOEXEC, fcntl(f, F_GETFD) & FD_CLOEXEC);
	struct signalfd_siginfo si;
	memset(&si, 0, sizeof si);
	FERRY_CHECK_EQ("read pending SIGUSR1", (ssize_t)sizeof si, read(f, &si, sizeof si));
	FERRY_CHECK_EQ("ssi_signo", SIGUSR1, si.ssi_signo);
	FERRY_CHECK_EQ("ssi_code", SI_QUEUE, si.ssi_code);
	FERRY_CHECK_EQ("ssi_int", 5, si.ssi_int);
	FERRY_CHECK_EQ("ssi_pid", getpid(), si.ssi_pid);
	FERRY_CHECK(read(f, &si, sizeof si) < 0 && errno == EAGAIN, "more than one signal pending");
	raise(SIGUSR2);
	FERRY_CHECK_EQ("read SIGUSR2", (ssize_t)sizeof si, read(f, &si, sizeof si));
	FERRY_CHECK_EQ("ssi_signo", SIGUSR2, si.ssi_signo);
	ferry_finish();
}
