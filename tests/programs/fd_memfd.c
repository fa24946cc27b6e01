/*
 * fd_memfd: open memfds (the fds themselves, not mappings).
 *
 * Sets up memfd M "ferry-memfd" (MFD_ALLOW_SEALING) with 20000 bytes,
 * seals F_SEAL_SHRINK|F_SEAL_GROW, offset 1000; fd R = a second, read-only
 * open of the same memfd via /proc/self/fd/M (its own offset, 7); memfd
 * N "plain" with MFD_CLOEXEC and no sealing (F_SEAL_SEAL).
 * Verifies: paths "/memfd:... (deleted)", flags, seals, size, offsets,
 * contents, that M and R are the same inode (a write via M is read via R)
 * and that the seals still bite (ftruncate fails with EPERM).
 */
#include "ferry_test.h"

#define SZ 20000

int main(void)
{
	int m = FERRY_SYS(memfd_create("ferry-memfd", MFD_ALLOW_SEALING));
	static unsigned char data[SZ], buf[SZ];
	ferry_fill(data, SZ, 240);
	FERRY_SYS(write(m, data, SZ));
	FERRY_SYS(fcntl(m, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW));
	lseek(m, 1000, SEEK_SET);
	char proc[64];
	snprintf(proc, sizeof proc, "/proc/self/fd/%d", m);
	int r = FERRY_SYS(open(proc, O_RDONLY));
	lseek(r, 7, SEEK_SET);
	int n = FERRY_SYS(memfd_create("plain", MFD_CLOEXEC));
	FERRY_SYS(write(n, "plain", 5));
	long fm = ferry_fdinfo_flags(m), fr = ferry_fdinfo_flags(r), fn = ferry_fdinfo_flags(n);

	ferry_ready();
	ferry_wait_go();

	char link[PATH_MAX];
	FERRY_CHECK_EQ_STR("M path", "/memfd:ferry-memfd (deleted)", ferry_fd_link(m, link, sizeof link));
	FERRY_CHECK_EQ_STR("R path", "/memfd:ferry-memfd (deleted)", ferry_fd_link(r, link, sizeof link));
	FERRY_CHECK_EQ_STR("N path", "/memfd:plain (deleted)", ferry_fd_link(n, link, sizeof link));
	FERRY_CHECK_EQ_HEX("M flags", fm, ferry_fdinfo_flags(m));
	FERRY_CHECK_EQ_HEX("R flags", fr, ferry_fdinfo_flags(r));
	FERRY_CHECK_EQ_HEX("N flags", fn, ferry_fdinfo_flags(n));
	FERRY_CHECK_EQ_HEX("M seals", F_SEAL_SHRINK | F_SEAL_GROW, fcntl(m, F_GET_SEALS));
	FERRY_CHECK_EQ_HEX("N seals", F_SEAL_SEAL, fcntl(n, F_GET_SEALS));
	FERRY_CHECK_EQ("M offset", 1000, lseek(m, 0, SEEK_CUR));
	FERRY_CHECK_EQ("R offset", 7, lseek(r, 0, SEEK_CUR));
	struct stat sm, sr;
	fstat(m, &sm);
	fstat(r, &sr);
	FERRY_CHECK_EQ("M size", SZ, sm.st_size);
	FERRY_CHECK(sm.st_ino == sr.st_ino && sm.st_dev == sr.st_dev, "M and R are different files");
	FERRY_CHECK_EQ("pread M", SZ, pread(m, buf, SZ, 0));
	FERRY_CHECK_MEM("M contents", data, buf, SZ);
	FERRY_CHECK_EQ("write via M", 3, write(m, "XYZ", 3));
	char x[3];
	FERRY_CHECK_EQ("pread via R", 3, pread(r, x, 3, 1000));
	FERRY_CHECK_MEM("data written via M, read via R", "XYZ", x, 3);
	errno = 0;
	FERRY_CHECK(ftruncate(m, 10) < 0 && errno == EPERM, "F_SEAL_SHRINK not enforced (errno %d)", errno);
	char p[8] = "";
	FERRY_CHECK_EQ("pread N", 5, pread(n, p, sizeof p, 0));
	ferry_finish();
}
