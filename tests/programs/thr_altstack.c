/*
 * thr_altstack: per-thread alternate signal stacks.
 *
 * Sets up a SIGUSR1 handler with SA_ONSTACK; the main thread has its
 * altstack explicitly disabled (the thread a restore rebuilds a process in
 * may have one of its own: it must not be left), thread 1 a 32 KiB altstack
 * with SS_AUTODISARM, thread 2 a 64 KiB altstack.
 * Verifies in each thread: sigaltstack() reads back the same ss_sp,
 * ss_size and ss_flags, and a SIGUSR1 sent to the thread runs the handler
 * on that thread's altstack (or on its normal stack for the main thread).
 */
#include "ferry_test.h"

#define SS_AUTODISARM_FLAG (1u << 31)
#define NT 3
#define NONE 0 /* the thread without an altstack */

static unsigned char stacks[NT][65536] __attribute__((aligned(16)));
static stack_t want[NT];
static volatile int go_flag, nready;
static volatile uintptr_t handler_sp[NT];
static __thread int my_index;

static void on_usr1(int sig)
{
	(void)sig;
	int local;
	handler_sp[my_index] = (uintptr_t)&local;
}

static void setup(int i)
{
	my_index = i;
	stack_t ss = { .ss_sp = stacks[i], .ss_size = i == 1 ? 32768 : 65536,
		       .ss_flags = i == 1 ? (int)SS_AUTODISARM_FLAG : 0 };
	if (i == NONE) {
		ss.ss_flags = SS_DISABLE;
		ss.ss_sp = NULL;
		ss.ss_size = 0;
	}
	if (sigaltstack(&ss, NULL) < 0)
		ferry_die("sigaltstack(%d): %s", i, strerror(errno));
	sigaltstack(NULL, &want[i]);
}

static void verify(int i)
{
	stack_t cur;
	char what[64];
	sigaltstack(NULL, &cur);
	snprintf(what, sizeof what, "thread %d: ss_sp", i);
	FERRY_CHECK_EQ_HEX(what, want[i].ss_sp, cur.ss_sp);
	snprintf(what, sizeof what, "thread %d: ss_size", i);
	FERRY_CHECK_EQ(what, want[i].ss_size, cur.ss_size);
	snprintf(what, sizeof what, "thread %d: ss_flags", i);
	FERRY_CHECK_EQ_HEX(what, (unsigned)want[i].ss_flags, (unsigned)cur.ss_flags);

	int local;
	handler_sp[i] = 0;
	pthread_kill(pthread_self(), SIGUSR1);
	uintptr_t sp = handler_sp[i];
	FERRY_CHECK(sp != 0, "thread %d: handler did not run", i);
	uintptr_t lo = (uintptr_t)stacks[i], hi = lo + (i == 1 ? 32768 : 65536);
	if (i == NONE) {
		FERRY_CHECK(sp < (uintptr_t)stacks[0] || sp >= (uintptr_t)stacks[NT - 1] + 65536,
			    "thread %d: handler ran on an altstack (sp %#lx)", i, (unsigned long)sp);
		FERRY_CHECK(sp < (uintptr_t)&local && (uintptr_t)&local - sp < 65536,
			    "thread %d: handler sp %#lx not just below the thread stack %p", i,
			    (unsigned long)sp, (void *)&local);
	} else {
		FERRY_CHECK(sp >= lo && sp < hi, "thread %d: handler sp %#lx not on altstack %#lx-%#lx", i,
			    (unsigned long)sp, (unsigned long)lo, (unsigned long)hi);
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
	struct sigaction sa = { .sa_handler = on_usr1, .sa_flags = SA_ONSTACK };
	sigemptyset(&sa.sa_mask);
	FERRY_SYS(sigaction(SIGUSR1, &sa, NULL));
	setup(0);
	pthread_t t[NT];
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
