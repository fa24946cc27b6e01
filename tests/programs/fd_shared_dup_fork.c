/*
 * fd_shared_dup_fork: open files shared by dup() and by fork().
 *
 * Sets up file "s": fd A opened O_RDWR, fd B = dup(A), then a fork (the
 * child inherits A and B: four fds, one open file), then fd C opened
 * separately (its own offset, 3).  10 bytes were written via A (offset 10).
 * Verifies: kcmp(KCMP_FILE) says A, B and the child's A are one file and C
 * is another; offsets are shared: parent writes 5 bytes via B -> A is at
 * 15 and the child's fds too; the child writes 2 via its A -> parent's A is
 * at 17; C stays at 3; O_NONBLOCK set via the child's B shows on parent's A.
 */
#include "ferry_test.h"
#include <linux/kcmp.h>

struct sh {
	volatile int step;
};

static long kcmp_file(pid_t p1, pid_t p2, int f1, int f2)
{
	return syscall(SYS_kcmp, p1, p2, KCMP_FILE, f1, f2);
}

static int wait_step(struct sh *s, int v)
{
	return FERRY_WAIT_UNTIL(__atomic_load_n(&s->step, __ATOMIC_SEQ_CST) == v, 5000);
}

int main(void)
{
	struct sh *s = FERRY_PTR(mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
	char path[PATH_MAX];
	ferry_path(path, sizeof path, "s");
	int a = FERRY_SYS(open(path, O_RDWR | O_CREAT | O_TRUNC, 0644));
	int b = FERRY_SYS(dup(a));
	FERRY_SYS(write(a, "0123456789", 10));
	pid_t child = FERRY_SYS(fork());
	if (child == 0) {
		ferry_wait_go();
		if (!wait_step(s, 1))
			ferry_fail("child: parent never reached step 1");
		FERRY_CHECK_EQ("child: offset of A after parent's write", 15, lseek(a, 0, SEEK_CUR));
		FERRY_CHECK_EQ("child: offset of B after parent's write", 15, lseek(b, 0, SEEK_CUR));
		FERRY_CHECK_EQ("child: write via A", 2, write(a, "cc", 2));
		fcntl(b, F_SETFL, O_NONBLOCK);
		__atomic_store_n(&s->step, 2, __ATOMIC_SEQ_CST);
		ferry_child_finish();
	}
	int c = FERRY_SYS(open(path, O_RDWR));
	lseek(c, 3, SEEK_SET);

	ferry_ready();
	ferry_wait_go();

	FERRY_CHECK_EQ("kcmp(A, B) (0 = same file)", 0, kcmp_file(getpid(), getpid(), a, b));
	FERRY_CHECK(kcmp_file(getpid(), getpid(), a, c) != 0, "A and C are the same open file");
	FERRY_CHECK_EQ("kcmp(A, child's A)", 0, kcmp_file(getpid(), child, a, a));
	FERRY_CHECK_EQ("kcmp(A, child's B)", 0, kcmp_file(getpid(), child, a, b));
	FERRY_CHECK_EQ("offset of A", 10, lseek(a, 0, SEEK_CUR));
	FERRY_CHECK_EQ("offset of C", 3, lseek(c, 0, SEEK_CUR));
	FERRY_CHECK_EQ("write via B", 5, write(b, "BBBBB", 5));
	FERRY_CHECK_EQ("offset of A after writing via B", 15, lseek(a, 0, SEEK_CUR));
	FERRY_CHECK_EQ("offset of C after writing via B", 3, lseek(c, 0, SEEK_CUR));
	__atomic_store_n(&s->step, 1, __ATOMIC_SEQ_CST);
	if (!wait_step(s, 2))
		ferry_fail("child never reached step 2");
	FERRY_CHECK_EQ("offset of A after the child's write", 17, lseek(a, 0, SEEK_CUR));
	FERRY_CHECK(fcntl(a, F_GETFL) & O_NONBLOCK, "O_NONBLOCK set via the child's B not seen on A");
	ferry_reap_child(child, "child", 0, 5000);
	char buf[32] = "";
	FERRY_CHECK_EQ("file size", 17, pread(c, buf, sizeof buf, 0));
	FERRY_CHECK_EQ_STR("file contents", "0123456789BBBBBcc", buf);
	ferry_finish();
}
