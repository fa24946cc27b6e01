/*
 * proc_clock_monotonic: CLOCK_MONOTONIC and CLOCK_BOOTTIME never run backwards.
 *
 * A thread reads both clocks every millisecond and remembers the last values; any reading
 * below the one before it (a restore on a machine, or into a time namespace, whose clocks are
 * behind the ones the process saw) is recorded.  The checkpoints may stop it at any
 * instruction.
 * Verifies: no backwards step was seen by the thread, and the clocks read after go are not
 * below those read before ready.
 */
#include "ferry_test.h"

static const clockid_t clocks[2] = { CLOCK_MONOTONIC, CLOCK_BOOTTIME };
static const char *names[2] = { "CLOCK_MONOTONIC", "CLOCK_BOOTTIME" };
static volatile int stop;
static volatile int backwards[2];
static volatile uint64_t back_from[2], back_to[2], readings;

static void *watch(void *arg)
{
	(void)arg;
	uint64_t prev[2] = { ferry_now_ns(clocks[0]), ferry_now_ns(clocks[1]) };
	while (!stop) {
		for (int i = 0; i < 2; i++) {
			uint64_t now = ferry_now_ns(clocks[i]);
			if (now < prev[i] && !backwards[i]) {
				back_from[i] = prev[i];
				back_to[i] = now;
				backwards[i] = 1;
			}
			prev[i] = now;
		}
		readings++;
		struct timespec ts = { 0, 1000000 };
		nanosleep(&ts, NULL);
	}
	return NULL;
}

int main(void)
{
	uint64_t before[2] = { ferry_now_ns(clocks[0]), ferry_now_ns(clocks[1]) };
	pthread_t t;
	if (pthread_create(&t, NULL, watch, NULL))
		ferry_die("pthread_create");
	FERRY_WAIT_UNTIL(readings > 2, 5000);

	ferry_ready();
	ferry_wait_go();

	uint64_t seen = readings;
	FERRY_WAIT_UNTIL(readings > seen + 2, 5000);
	stop = 1;
	pthread_join(t, NULL);
	for (int i = 0; i < 2; i++) {
		uint64_t after = ferry_now_ns(clocks[i]);
		FERRY_CHECK(after >= before[i], "%s went from %llu before ready to %llu after go",
			    names[i], (unsigned long long)before[i], (unsigned long long)after);
		FERRY_CHECK(!backwards[i], "%s stepped back from %llu to %llu", names[i],
			    (unsigned long long)back_from[i], (unsigned long long)back_to[i]);
	}
	ferry_finish();
}
