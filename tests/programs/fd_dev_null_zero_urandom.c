/*
 * fd_dev_null_zero_urandom: character devices and a /dev/zero mapping.
 *
 * Sets up fds on /dev/null (O_RDWR), /dev/zero (O_RDONLY), /dev/urandom
 * (O_RDONLY|O_NONBLOCK), /dev/full (O_WRONLY), /dev/random (O_RDONLY), and
 * a MAP_SHARED mapping of /dev/zero (shared anon memory) with a pattern.
 * Verifies: paths, flags, device numbers (st_rdev), behaviour (null reads
 * EOF and swallows writes, zero reads zeros, urandom gives varying bytes,
 * full gives ENOSPC), and the /dev/zero mapping's contents and path.
 */
#include "ferry_test.h"
#include <sys/sysmacros.h>

static const char *devs[] = { "/dev/null", "/dev/zero", "/dev/urandom", "/dev/full", "/dev/random" };
static const int modes[] = { O_RDWR, O_RDONLY, O_RDONLY | O_NONBLOCK, O_WRONLY, O_RDONLY };
#define ND 5

static struct ferry_map maps_before[FERRY_MAX_MAPS];

int main(void)
{
	int fd[ND];
	long fl[ND];
	dev_t rdev[ND];
	for (int i = 0; i < ND; i++) {
		fd[i] = FERRY_SYS(open(devs[i], modes[i]));
		fl[i] = ferry_fdinfo_flags(fd[i]);
		struct stat st;
		fstat(fd[i], &st);
		rdev[i] = st.st_rdev;
	}
	int z = FERRY_SYS(open("/dev/zero", O_RDWR));
	unsigned char *m = FERRY_PTR(mmap(NULL, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, z, 0));
	close(z);
	ferry_fill(m, 8192, 200);
	int nmaps = ferry_read_maps(maps_before, FERRY_MAX_MAPS);

	ferry_ready();
	ferry_wait_go();

	ferry_check_maps_same(maps_before, nmaps);
	for (int i = 0; i < ND; i++) {
		char link[PATH_MAX], what[64];
		snprintf(what, sizeof what, "%s path", devs[i]);
		FERRY_CHECK_EQ_STR(what, devs[i], ferry_fd_link(fd[i], link, sizeof link));
		snprintf(what, sizeof what, "%s flags", devs[i]);
		FERRY_CHECK_EQ_HEX(what, fl[i], ferry_fdinfo_flags(fd[i]));
		struct stat st;
		fstat(fd[i], &st);
		snprintf(what, sizeof what, "%s st_rdev", devs[i]);
		FERRY_CHECK_EQ_HEX(what, rdev[i], st.st_rdev);
	}
	unsigned char buf[256];
	FERRY_CHECK_EQ("read /dev/null", 0, read(fd[0], buf, sizeof buf));
	FERRY_CHECK_EQ("write /dev/null", 5, write(fd[0], "hello", 5));
	memset(buf, 1, sizeof buf);
	FERRY_CHECK_EQ("read /dev/zero", (ssize_t)sizeof buf, read(fd[1], buf, sizeof buf));
	ferry_check_zero("/dev/zero data", buf, sizeof buf);
	unsigned char r1[32], r2[32];
	FERRY_CHECK_EQ("read /dev/urandom", 32, read(fd[2], r1, 32));
	FERRY_CHECK_EQ("read /dev/urandom", 32, read(fd[2], r2, 32));
	FERRY_CHECK(memcmp(r1, r2, 32) != 0, "/dev/urandom gave the same 32 bytes twice");
	errno = 0;
	FERRY_CHECK(write(fd[3], "x", 1) < 0 && errno == ENOSPC, "write /dev/full: errno %d", errno);
	ferry_check_fill("/dev/zero shared mapping", m, 8192, 200);
	struct ferry_map mm;
	if (ferry_find_map(m, &mm) == 0) {
		FERRY_CHECK_EQ_STR("/dev/zero mapping perms", "rw-s", mm.perms);
		FERRY_CHECK(strncmp(mm.path, "/dev/zero", 9) == 0, "/dev/zero mapping path \"%s\"", mm.path);
	}
	ferry_finish();
}
