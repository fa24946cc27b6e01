/*
 * proc_sched_affinity_nice: per-thread scheduling attributes.
 *
 * Sets up main thread: nice 7, SCHED_OTHER, pinned to the first allowed
 * CPU, I/O priority best-effort level 6; thread T: nice 12, SCHED_BATCH,
 * pinned to the last allowed CPU; thread U: SCHED_IDLE, I/O class idle.
 * Verifies for each thread: nice value, scheduling policy, CPU affinity
 * mask and I/O priority are unchanged.
 */
#include "ferry_test.h"
#include <sched.h>
#include <sys/resource.h>

#define IOPRIO(cls, lvl) (((cls) << 13) | (lvl))

static volatile int go_flag;
static volatile pid_t tids[3];

struct want {
	int nice, policy, ioprio;
	cpu_set_t cpus;
} want[3];

static void apply(int i)
{
	pid_t tid = ferry_gettid();
	struct sched_param sp = { 0 };
	if (sched_setscheduler(tid, want[i].policy, &sp) < 0)
		ferry_die("sched_setscheduler: %s", strerror(errno));
	if (want[i].policy != SCHED_IDLE && setpriority(PRIO_PROCESS, (id_t)tid, want[i].nice) < 0)
		ferry_die("setpriority: %s", strerror(errno));
	if (sched_setaffinity(tid, sizeof want[i].cpus, &want[i].cpus) < 0)
		ferry_die("sched_setaffinity: %s", strerror(errno));
	if (syscall(SYS_ioprio_set, 1 /* IOPRIO_WHO_PROCESS */, tid, want[i].ioprio) < 0)
		ferry_die("ioprio_set: %s", strerror(errno));
	want[i].nice = getpriority(PRIO_PROCESS, (id_t)tid);
	tids[i] = tid;
}

static void *thread_fn(void *arg)
{
	int i = (int)(intptr_t)arg;
	apply(i);
	while (!go_flag)
		ferry_sleep_ms(5);
	return NULL;
}

int main(void)
{
	cpu_set_t all;
	sched_getaffinity(0, sizeof all, &all);
	int first = -1, last = -1;
	for (int c = 0; c < CPU_SETSIZE; c++)
		if (CPU_ISSET(c, &all)) {
			if (first < 0)
				first = c;
			last = c;
		}
	want[0] = (struct want){ 7, SCHED_OTHER, IOPRIO(2, 6) };
	want[1] = (struct want){ 12, SCHED_BATCH, IOPRIO(2, 4) };
	want[2] = (struct want){ 0, SCHED_IDLE, IOPRIO(3, 0) };
	CPU_ZERO(&want[0].cpus);
	CPU_SET(first, &want[0].cpus);
	CPU_ZERO(&want[1].cpus);
	CPU_SET(last, &want[1].cpus);
	want[2].cpus = all;
	pthread_t t[3];
	for (int i = 1; i < 3; i++)
		if (pthread_create(&t[i], NULL, thread_fn, (void *)(intptr_t)i))
			ferry_die("pthread_create");
	FERRY_WAIT_UNTIL(tids[1] && tids[2], 5000);
	apply(0);

	ferry_ready();
	ferry_wait_go();

	static const char *names[3] = { "main", "T", "U" };
	for (int i = 0; i < 3; i++) {
		char what[64];
		pid_t tid = tids[i];
		snprintf(what, sizeof what, "%s: policy", names[i]);
		FERRY_CHECK_EQ(what, want[i].policy, sched_getscheduler(tid));
		errno = 0;
		snprintf(what, sizeof what, "%s: nice", names[i]);
		FERRY_CHECK_EQ(what, want[i].nice, getpriority(PRIO_PROCESS, (id_t)tid));
		snprintf(what, sizeof what, "%s: ioprio", names[i]);
		FERRY_CHECK_EQ_HEX(what, want[i].ioprio, syscall(SYS_ioprio_get, 1, tid));
		cpu_set_t now;
		CPU_ZERO(&now);
		sched_getaffinity(tid, sizeof now, &now);
		FERRY_CHECK(CPU_EQUAL(&now, &want[i].cpus), "%s: CPU affinity changed (%d CPUs, expected %d)",
			    names[i], CPU_COUNT(&now), CPU_COUNT(&want[i].cpus));
	}
	go_flag = 1;
	for (int i = 1; i < 3; i++)
		pthread_join(t[i], NULL);
	ferry_finish();
}
