/*
 * mem_sysv_shm: a System V shared memory segment attached twice.
 *
 * Sets up a 64 KiB IPC_PRIVATE segment (mode 0640) attached read-write at
 * two addresses and read-only at a third, filled with a pattern.
 * Verifies: same shmid and attach addresses, shm_segsz, mode and nattch from
 * IPC_STAT, contents, and that the attachments share pages.  The segment is
 * removed at exit.  The segment asks for shmid 0 (shm_next_id), the number the first
 * segment of a freshly booted machine gets, where a 0 taken for "no inode" once made the
 * capture treat the segment as private memory.
 */
#include "ferry_test.h"
#include <sys/ipc.h>
#include <sys/shm.h>

#define LEN (16 * 4096UL)

static int shmid = -1;

static void rm_segment(void)
{
	if (shmid >= 0)
		shmctl(shmid, IPC_RMID, NULL);
}

int main(void)
{
	/* Best effort: as root, and only while id 0 is free; otherwise any id will do. */
	FILE *next = fopen("/proc/sys/kernel/shm_next_id", "w");
	if (next) {
		fputs("0", next);
		fclose(next);
	}
	shmid = FERRY_SYS(shmget(IPC_PRIVATE, LEN, IPC_CREAT | 0640));
	atexit(rm_segment);
	unsigned char *a = FERRY_PTR(shmat(shmid, NULL, 0));
	unsigned char *b = FERRY_PTR(shmat(shmid, NULL, 0));
	unsigned char *r = FERRY_PTR(shmat(shmid, NULL, SHM_RDONLY));
	if (a == (void *)-1 || b == (void *)-1 || r == (void *)-1)
		ferry_die("shmat: %s", strerror(errno));
	ferry_fill(a, LEN, 30);
	int id_before = shmid;

	ferry_ready();
	ferry_wait_go();

	struct shmid_ds ds;
	if (shmctl(id_before, IPC_STAT, &ds) < 0) {
		ferry_fail("IPC_STAT on shmid %d: %s", id_before, strerror(errno));
		ferry_finish();
	}
	FERRY_CHECK_EQ("shm_segsz", LEN, ds.shm_segsz);
	FERRY_CHECK_EQ("shm_nattch", 3, ds.shm_nattch);
	FERRY_CHECK_EQ("mode", 0640, ds.shm_perm.mode & 0777);
	FERRY_CHECK_EQ("cpid", getpid(), ds.shm_cpid);
	ferry_check_map("attach A", a, LEN, "rw-s");
	ferry_check_map("attach B", b, LEN, "rw-s");
	ferry_check_map("read-only attach", r, LEN, "r--s");
	struct ferry_map m;
	if (ferry_find_map(a, &m) == 0) {
		char want[64];
		snprintf(want, sizeof want, "/SYSV00000000 (deleted)");
		FERRY_CHECK_EQ_STR("attach path", want, m.path);
	}
	ferry_check_fill("segment via A", a, LEN, 30);
	ferry_check_fill("segment via B", b, LEN, 30);
	ferry_check_fill("segment via read-only attach", r, LEN, 30);
	a[1234] ^= 0xff;
	FERRY_CHECK_EQ("write via A seen via B", a[1234], b[1234]);
	FERRY_CHECK_EQ("write via A seen via read-only", a[1234], r[1234]);
	ferry_finish();
}
