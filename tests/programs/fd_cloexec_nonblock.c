/*
 * fd_cloexec_nonblock: per-fd (FD_CLOEXEC) and per-file (O_NONBLOCK) flags.
 *
 * Sets up: 10 = file with O_CLOEXEC; 11 = dup of 10 without CLOEXEC (same
 * open file); 12 = file with O_NONBLOCK; 13/14 = pipe2(O_CLOEXEC|
 * O_NONBLOCK); 15 = dup3(14, O_CLOEXEC) made non-blocking through F_SETFL
 * (which 14 sees too); 16 = /dev/null without any flag; 17 = F_DUPFD_CLOEXEC
 * of 16.
 * Verifies: F_GETFD and F_GETFL of every fd and fdinfo flags are unchanged,
 * and a shell exec'ed by a child sees exactly the non-CLOEXEC fds.
 */
#include "ferry_test.h"

#define FIRST 10
#define N 8

static void put(int want, int fd)
{
	if (fd != want) {
		FERRY_SYS(dup3(fd, want, fcntl(fd, F_GETFD) & FD_CLOEXEC ? O_CLOEXEC : 0));
		close(fd);
	}
}

int main(void)
{
	char path[PATH_MAX];
	ferry_path(path, sizeof path, "file");
	put(10, FERRY_SYS(open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644)));
	FERRY_SYS(dup2(10, 11));
	put(12, FERRY_SYS(open(path, O_RDONLY | O_NONBLOCK)));
	int p[2];
	FERRY_SYS(pipe2(p, O_CLOEXEC | O_NONBLOCK));
	put(13, p[0]);
	put(14, p[1]);
	FERRY_SYS(dup3(14, 15, O_CLOEXEC));
	FERRY_SYS(fcntl(14, F_SETFL, 0)); /* clears O_NONBLOCK for 14 and 15 */
	put(16, FERRY_SYS(open("/dev/null", O_RDWR)));
	put(17, FERRY_SYS(fcntl(16, F_DUPFD_CLOEXEC, 17)));
	int fd_flags[N], fl_flags[N];
	long info[N];
	for (int i = 0; i < N; i++) {
		fd_flags[i] = fcntl(FIRST + i, F_GETFD);
		fl_flags[i] = fcntl(FIRST + i, F_GETFL);
		info[i] = ferry_fdinfo_flags(FIRST + i);
	}

	ferry_ready();
	ferry_wait_go();

	char expect_exec[64] = "";
	for (int i = 0; i < N; i++) {
		int fd = FIRST + i;
		char what[64];
		snprintf(what, sizeof what, "fd %d F_GETFD", fd);
		FERRY_CHECK_EQ_HEX(what, fd_flags[i], fcntl(fd, F_GETFD));
		snprintf(what, sizeof what, "fd %d F_GETFL", fd);
		FERRY_CHECK_EQ_HEX(what, fl_flags[i], fcntl(fd, F_GETFL));
		snprintf(what, sizeof what, "fd %d fdinfo flags", fd);
		FERRY_CHECK_EQ_HEX(what, info[i], ferry_fdinfo_flags(fd));
		if (!(fd_flags[i] & FD_CLOEXEC))
			snprintf(expect_exec + strlen(expect_exec), sizeof expect_exec - strlen(expect_exec),
				 "%d ", fd);
	}
	/* O_NONBLOCK is per open file: setting it on 11 shows on 10. */
	fcntl(11, F_SETFL, O_NONBLOCK);
	FERRY_CHECK(fcntl(10, F_GETFL) & O_NONBLOCK, "fds 10 and 11 are no longer one open file");

	char out[PATH_MAX];
	ferry_path(out, sizeof out, "exec-fds");
	pid_t c = fork();
	if (c == 0) {
		int o = open(out, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
		dup2(o, 1);
		execl("/bin/sh", "sh", "-c",
		      "for f in 10 11 12 13 14 15 16 17; do [ -e /proc/$$/fd/$f ] && printf '%s ' $f; done; exit 0",
		      (char *)NULL);
		_exit(127);
	}
	ferry_reap_child(c, "exec child", 0, 5000);
	char got[64] = "";
	ferry_read_file(out, got, sizeof got);
	FERRY_CHECK_EQ_STR("fds inherited across exec", expect_exec, got);
	ferry_finish();
}
