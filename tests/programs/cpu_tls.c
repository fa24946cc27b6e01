/*
 * cpu_tls: thread-local storage and the FS/GS base registers.
 *
 * Sets up the main thread and 2 threads, each with its own values in an
 * initialised __thread variable and a zero-initialised __thread buffer; the
 * main thread and thread 1 also point their GS base (arch_prctl ARCH_SET_GS)
 * at a private 64-byte block.
 * Verifies in every thread: FS base and GS base (ARCH_GET_FS/GS) unchanged,
 * %fs:0 is the thread pointer, pthread_self() and &tls variables unchanged,
 * TLS contents intact, and %gs:0 reads the first word of the GS block.
 */
#include "ferry_test.h"
#include <asm/prctl.h>

#define NT 3 /* main + 2 threads */

static __thread uint64_t tls_val = 0x1111;
static __thread unsigned char tls_buf[256];
static uint64_t gs_block[NT][8];
static volatile int go_flag, nready;

struct snap {
	unsigned long fs, gs;
	pthread_t self;
	void *addr_val, *addr_buf;
};
static struct snap before[NT];

static unsigned long get_base(int code)
{
	unsigned long v = 0;
	syscall(SYS_arch_prctl, code, &v);
	return v;
}

static void take(struct snap *s)
{
	s->fs = get_base(ARCH_GET_FS);
	s->gs = get_base(ARCH_GET_GS);
	s->self = pthread_self();
	s->addr_val = (void *)&tls_val;
	s->addr_buf = (void *)tls_buf;
}

static void setup(int i)
{
	tls_val = 0xabcd0000 + (uint64_t)i;
	ferry_fill(tls_buf, sizeof tls_buf, 130 + (uint64_t)i);
	if (i != 2) {
		gs_block[i][0] = 0x6500000000000000ull + (uint64_t)i;
		if (syscall(SYS_arch_prctl, ARCH_SET_GS, (unsigned long)gs_block[i]) < 0)
			ferry_die("ARCH_SET_GS: %s", strerror(errno));
	}
	take(&before[i]);
}

static void verify(int i)
{
	struct snap now;
	take(&now);
	char what[64];
	snprintf(what, sizeof what, "thread %d: FS base", i);
	FERRY_CHECK_EQ_HEX(what, before[i].fs, now.fs);
	snprintf(what, sizeof what, "thread %d: GS base", i);
	FERRY_CHECK_EQ_HEX(what, before[i].gs, now.gs);
	snprintf(what, sizeof what, "thread %d: pthread_self", i);
	FERRY_CHECK_EQ_HEX(what, before[i].self, now.self);
	snprintf(what, sizeof what, "thread %d: &tls_val", i);
	FERRY_CHECK_EQ_HEX(what, before[i].addr_val, now.addr_val);
	snprintf(what, sizeof what, "thread %d: &tls_buf", i);
	FERRY_CHECK_EQ_HEX(what, before[i].addr_buf, now.addr_buf);
	unsigned long fs0;
	asm volatile("mov %%fs:0, %0" : "=r"(fs0));
	snprintf(what, sizeof what, "thread %d: %%fs:0", i);
	FERRY_CHECK_EQ_HEX(what, now.fs, fs0);
	snprintf(what, sizeof what, "thread %d: tls_val", i);
	FERRY_CHECK_EQ_HEX(what, 0xabcd0000 + (uint64_t)i, tls_val);
	snprintf(what, sizeof what, "thread %d: tls_buf", i);
	ferry_check_fill(what, tls_buf, sizeof tls_buf, 130 + (uint64_t)i);
	if (i != 2 && now.gs == (unsigned long)gs_block[i]) {
		uint64_t gs0;
		asm volatile("mov %%gs:0, %0" : "=r"(gs0));
		snprintf(what, sizeof what, "thread %d: %%gs:0", i);
		FERRY_CHECK_EQ_HEX(what, gs_block[i][0], gs0);
	}
}

static void *thread_fn(void *arg)
{
	int i = (int)(intptr_t)arg;
	setup(i);
	__atomic_add_fetch(&nready, 1, __ATOMIC_SEQ_CST);
	while (!go_flag)
		ferry_sleep_ms(5);
	verify(i);
	return NULL;
}

int main(void)
{
	pthread_t t[NT];
	setup(0);
	for (int i = 1; i < NT; i++)
		if (pthread_create(&t[i], NULL, thread_fn, (void *)(intptr_t)i))
			ferry_die("pthread_create");
	if (!FERRY_WAIT_UNTIL(nready == NT - 1, 5000))
		ferry_die("threads did not start");

	ferry_ready();
	ferry_wait_go();
	verify(0);
	go_flag = 1;
	for (int i = 1; i < NT; i++)
		pthread_join(t[i], NULL);
	ferry_finish();
}
