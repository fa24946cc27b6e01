/*
 * fd_regular: regular files open with assorted flags and offsets.
 *
 * Sets up, in the test dir: fd 3 O_RDONLY at offset 100; fd 4 O_WRONLY|
 * O_TRUNC (then written 5000 bytes, offset 5000); fd 5 O_RDWR|O_CREAT|O_EXCL
 * at offset 7; fd 6 O_RDWR|O_SYNC|O_NOATIME; fd 200 (dup2 of a O_RDONLY fd)
 * on a file that was renamed after opening; fd 201 O_RDONLY on a 0400 file.
 * Verifies: the set of open fds is the same, each fd's path
 * (/proc/self/fd), full flags (fdinfo "flags:"), offset, and that the files
 * were not truncated or re-created (contents, inode numbers); reads
 * continue at the saved offset and writes land at it.
 */
#include "ferry_test.h"

#define SZ 8192

struct f {
	int fd;
	char path[PATH_MAX];
	long flags;
	off_t off;
	ino_t ino;
} f[6];
static unsigned char data[SZ];

static void note(int i, int fd, const char *path)
{
	f[i].fd = fd;
	snprintf(f[i].path, sizeof f[i].path, "%s", path);
	f[i].flags = ferry_fdinfo_flags(fd);
	f[i].off = lseek(fd, 0, SEEK_CUR);
	struct stat st;
	fstat(fd, &st);
	f[i].ino = st.st_ino;
}

static void make(const char *path, uint64_t seed)
{
	int fd = FERRY_SYS(open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644));
	ferry_fill(data, SZ, seed);
	FERRY_SYS(write(fd, data, SZ));
	close(fd);
}

static int at(int want, int fd)
{
	if (fd == want)
		return fd;
	FERRY_SYS(dup2(fd, want));
	close(fd);
	return want;
}

int main(void)
{
	char p[6][PATH_MAX];
	const char *names[6] = { "ro.bin", "trunc.bin", "excl.bin", "sync.bin", "before-rename.bin", "mode0400.bin" };
	for (int i = 0; i < 6; i++)
		ferry_path(p[i], sizeof p[i], names[i]);
	make(p[0], 150);
	make(p[1], 151);
	make(p[3], 153);
	make(p[4], 154);
	make(p[5], 155);
	FERRY_SYS(chmod(p[5], 0400));

	int fd = at(3, FERRY_SYS(open(p[0], O_RDONLY)));
	lseek(fd, 100, SEEK_SET);
	note(0, fd, p[0]);

	fd = at(4, FERRY_SYS(open(p[1], O_WRONLY | O_TRUNC)));
	ferry_fill(data, 5000, 161);
	FERRY_SYS(write(fd, data, 5000));
	note(1, fd, p[1]);

	fd = at(5, FERRY_SYS(open(p[2], O_RDWR | O_CREAT | O_EXCL, 0600)));
	FERRY_SYS(write(fd, "0123456789", 10));
	lseek(fd, 7, SEEK_SET);
	note(2, fd, p[2]);

	fd = at(6, FERRY_SYS(open(p[3], O_RDWR | O_SYNC | O_NOATIME)));
	lseek(fd, 4096, SEEK_SET);
	note(3, fd, p[3]);

	fd = at(200, FERRY_SYS(open(p[4], O_RDONLY)));
	lseek(fd, 3, SEEK_SET);
	char renamed[PATH_MAX];
	ferry_path(renamed, sizeof renamed, "after-rename.bin");
	FERRY_SYS(rename(p[4], renamed));
	note(4, fd, renamed);

	fd = at(201, FERRY_SYS(open(p[5], O_RDONLY)));
	note(5, fd, p[5]);

	int fds_before[64];
	int nfds = ferry_list_fds(fds_before, 64);

	ferry_ready();
	ferry_wait_go();

	ferry_check_fds_same(fds_before, nfds);
	for (int i = 0; i < 6; i++) {
		char link[PATH_MAX], what[96];
		snprintf(what, sizeof what, "fd %d path", f[i].fd);
		FERRY_CHECK_EQ_STR(what, f[i].path, ferry_fd_link(f[i].fd, link, sizeof link));
		snprintf(what, sizeof what, "fd %d flags (octal %lo)", f[i].fd, f[i].flags);
		FERRY_CHECK_EQ_HEX(what, f[i].flags, ferry_fdinfo_flags(f[i].fd));
		snprintf(what, sizeof what, "fd %d offset", f[i].fd);
		FERRY_CHECK_EQ(what, f[i].off, lseek(f[i].fd, 0, SEEK_CUR));
		struct stat st;
		fstat(f[i].fd, &st);
		snprintf(what, sizeof what, "fd %d inode", f[i].fd);
		FERRY_CHECK_EQ(what, f[i].ino, st.st_ino);
	}
	/* Contents: nothing truncated or recreated. */
	static unsigned char buf[SZ];
	FERRY_CHECK_EQ("read at offset 100 from fd 3", 100, read(3, buf, 100));
	ferry_fill(data, SZ, 150);
	FERRY_CHECK_MEM("fd 3 data at offset 100", data + 100, buf, 100);
	struct stat st;
	fstat(4, &st);
	FERRY_CHECK_EQ("size of the O_TRUNC file", 5000, st.st_size);
	FERRY_CHECK_EQ("write via fd 4", 3, write(4, "END", 3));
	int t = open(p[1], O_RDONLY);
	FERRY_CHECK_EQ("size of trunc.bin", 5003, pread(t, buf, SZ, 0));
	close(t);
	ferry_fill(data, 5000, 161);
	FERRY_CHECK_MEM("trunc.bin contents", data, buf, 5000);
	FERRY_CHECK_MEM("trunc.bin tail", "END", buf + 5000, 3);
	char c3[4] = "";
	FERRY_CHECK_EQ("read via fd 5", 3, read(5, c3, 3));
	FERRY_CHECK_MEM("excl.bin at offset 7", "789", c3, 3);
	FERRY_CHECK_EQ("read via fd 200", 10, read(200, buf, 10));
	ferry_fill(data, SZ, 154);
	FERRY_CHECK_MEM("renamed file at offset 3", data + 3, buf, 10);
	FERRY_CHECK_EQ("write via fd 6", 2, write(6, "ok", 2));
	FERRY_CHECK_EQ("fd 6 offset after write", 4098, lseek(6, 0, SEEK_CUR));
	ferry_finish();
}
