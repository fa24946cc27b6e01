/*
 * thr_lazy_same_pages: many threads touch the same pages at once.
 *
 * A region is filled with a pattern before the checkpoint. After go (under
 * `ferry restore --lazy` with a delayed push, its pages are still owed then),
 * eight threads meet at a barrier before each page and then all read it at
 * once: its first touch faults in several threads together (each fault is a
 * message of its own to the page server, which must fill the page once and
 * wake them all), and every thread must see the right bytes. Half of them
 * then write their own slot of each page; the writes must all be there.
 */
#include "ferry_test.h"

#define PG 4096UL
#define PAGES 512
#define THREADS 8

static unsigned char *mem;
static pthread_barrier_t barrier;

static void *reader(void *arg)
{
	long id = (long)arg;
	unsigned char *want = malloc(PG);
	for (size_t p = 0; p < PAGES; p++) {
		ferry_fill(want, PG, 1000 + p);
		/* All at once onto page p. */
		pthread_barrier_wait(&barrier);
		if (memcmp(want, mem + p * PG, PG) != 0) {
			ferry_fail("thread %ld: page %zu differs", id, p);
		}
	}
	pthread_barrier_wait(&barrier);
	if (id % 2 == 0)
		for (size_t p = 0; p < PAGES; p++)
			mem[p * PG + id] = (unsigned char)(0xa0 + id);
	free(want);
	return NULL;
}

int main(void)
{
	mem = FERRY_PTR(mmap(NULL, PAGES * PG, PROT_READ | PROT_WRITE,
			     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
	for (size_t p = 0; p < PAGES; p++)
		ferry_fill(mem + p * PG, PG, 1000 + p);
	ferry_ready();
	ferry_wait_go();
	pthread_barrier_init(&barrier, NULL, THREADS);
	pthread_t t[THREADS];
	for (long i = 0; i < THREADS; i++)
		if (pthread_create(&t[i], NULL, reader, (void *)i))
			ferry_die("pthread_create");
	for (int i = 0; i < THREADS; i++)
		pthread_join(t[i], NULL);
	for (size_t p = 0; p < PAGES; p++)
		for (long i = 0; i < THREADS; i += 2)
			FERRY_CHECK(mem[p * PG + i] == (unsigned char)(0xa0 + i),
				    "page %zu: thread %ld's write is missing", p, i);
	ferry_finish();
}
