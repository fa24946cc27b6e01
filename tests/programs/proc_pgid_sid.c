/*
 * proc_pgid_sid: process groups and sessions.
 *
 * Sets up, under root R (a session leader, as the harness starts it):
 *   A: own process group (pgid A);   B: in A's group;
 *   E: in the group of D, a child that has exited (leaderless group D);
 *   C: setsid() -> session C, with C1 (own group C1, session C) and
 *      C2 (in group C, session C).
 * Verifies in every process: getpid, getpgid(0) and getsid(0) unchanged
 * and as designed; R additionally checks getpgid/getsid of A, B and E.
 */
#include "ferry_test.h"

struct ids {
	pid_t pid, pgid, sid;
};
enum { R, A, B, D, E, C, C1, C2, NN };
static const char *nm[NN] = { "R", "A", "B", "D", "E", "C", "C1", "C2" };
static struct ids *tab;

static void record(int me)
{
	struct ids v = { getpid(), getpgid(0), getsid(0) };
	tab[me] = v;
}

static void check(int me)
{
	char what[64];
	snprintf(what, sizeof what, "%s: getpid", nm[me]);
	FERRY_CHECK_EQ(what, tab[me].pid, getpid());
	snprintf(what, sizeof what, "%s: pgid", nm[me]);
	FERRY_CHECK_EQ(what, tab[me].pgid, getpgid(0));
	snprintf(what, sizeof what, "%s: sid", nm[me]);
	FERRY_CHECK_EQ(what, tab[me].sid, getsid(0));
}

static void wait_for(int who)
{
	if (!FERRY_WAIT_UNTIL(__atomic_load_n(&tab[who].pid, __ATOMIC_SEQ_CST) != 0, 5000))
		ferry_die("%s did not start", nm[who]);
}

static void leaf(int me)
{
	record(me);
	ferry_wait_go();
	check(me);
	ferry_child_finish();
}

int main(void)
{
	tab = FERRY_PTR(mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
	/* Children are put into groups by the parent before they record. */
	pid_t a = FERRY_SYS(fork());
	if (a == 0) {
		FERRY_WAIT_UNTIL(getpgid(0) == getpid(), 5000);
		leaf(A);
	}
	FERRY_SYS(setpgid(a, a));
	pid_t b = FERRY_SYS(fork());
	if (b == 0) {
		FERRY_WAIT_UNTIL(getpgid(0) == a, 5000);
		leaf(B);
	}
	FERRY_SYS(setpgid(b, a));
	pid_t d = FERRY_SYS(fork());
	if (d == 0) {
		FERRY_WAIT_UNTIL(getpgid(0) == getpid(), 5000);
		tab[D].pid = getpid();
		_exit(0);
	}
	FERRY_SYS(setpgid(d, d));
	pid_t e = FERRY_SYS(fork());
	if (e == 0) {
		FERRY_WAIT_UNTIL(getpgid(0) == d, 5000);
		leaf(E);
	}
	FERRY_SYS(setpgid(e, d));
	ferry_reap_child(d, "D", 0, 5000); /* group D now has no leader */
	pid_t c = FERRY_SYS(fork());
	if (c == 0) {
		FERRY_SYS(setsid());
		pid_t c1 = FERRY_SYS(fork());
		if (c1 == 0) {
			FERRY_WAIT_UNTIL(getpgid(0) == getpid(), 5000);
			leaf(C1);
		}
		FERRY_SYS(setpgid(c1, c1));
		pid_t c2 = FERRY_SYS(fork());
		if (c2 == 0)
			leaf(C2);
		wait_for(C1);
		wait_for(C2);
		record(C);
		ferry_wait_go();
		check(C);
		ferry_reap_child(c1, "C1", 0, 10000);
		ferry_reap_child(c2, "C2", 0, 10000);
		ferry_child_finish();
	}
	record(R);
	wait_for(A);
	wait_for(B);
	wait_for(E);
	wait_for(C);
	FERRY_CHECK(tab[B].pgid == a && tab[E].pgid == d && tab[C1].sid == c && tab[C2].pgid == c,
		    "setup: groups not as designed");

	ferry_ready();
	ferry_wait_go();

	check(R);
	FERRY_CHECK_EQ("R: R is a session leader", getpid(), getsid(0));
	FERRY_CHECK_EQ("R: getpgid(A)", tab[A].pgid, getpgid(a));
	FERRY_CHECK_EQ("R: getpgid(B)", tab[B].pgid, getpgid(b));
	FERRY_CHECK_EQ("R: getpgid(E) (leaderless group)", tab[E].pgid, getpgid(e));
	FERRY_CHECK_EQ("R: getsid(C)", tab[C].sid, getsid(c));
	ferry_reap_child(a, "A", 0, 10000);
	ferry_reap_child(b, "B", 0, 10000);
	ferry_reap_child(e, "E", 0, 10000);
	ferry_reap_child(c, "C", 0, 15000);
	ferry_finish();
}
