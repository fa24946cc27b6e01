/*
 * proc_ptraced: a child held in a ptrace stop by its tracer (its parent),
 * as under a debugger.
 *
 * Sets up: child T asks to be traced (PTRACE_TRACEME) and stops itself
 * with SIGSTOP; the parent collects that signal-delivery stop and leaves T
 * in it.
 * Verifies: T is still in a tracing stop (state t) with this process as
 * its tracer; PTRACE_CONT lets it run on and it exits with 5.
 *
 * Refused (PENDING): a thread has one tracer, so Ferry cannot attach T,
 * and the tracing itself cannot be captured or made again.
 */
#include "ferry_test.h"
#include <sys/ptrace.h>
#include <sys/wait.h>

static char state_of(pid_t pid, int *tracer)
{
	char path[64], buf[4096];
	snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
	if (ferry_read_file(path, buf, sizeof buf) < 0)
		return '?';
	char *t = strstr(buf, "TracerPid:");
	*tracer = t ? atoi(t + 10) : -1;
	char *s = strstr(buf, "State:");
	return s ? s[7] : '?';
}

int main(void)
{
	pid_t t = FERRY_SYS(fork());
	if (t == 0) {
		if (ptrace(PTRACE_TRACEME, 0, 0, 0) < 0)
			_exit(2);
		raise(SIGSTOP);
		_exit(5);
	}
	int st;
	FERRY_CHECK_EQ("waitpid(T)", t, waitpid(t, &st, 0));
	FERRY_CHECK(WIFSTOPPED(st) && WSTOPSIG(st) == SIGSTOP, "T: status %#x", st);

	ferry_ready();
	ferry_wait_go();

	int tracer = 0;
	char s = state_of(t, &tracer);
	FERRY_CHECK(s == 't', "T: state '%c', expected a tracing stop", s);
	FERRY_CHECK_EQ("T's tracer", getpid(), tracer);
	FERRY_CHECK_EQ("PTRACE_CONT", 0, ptrace(PTRACE_CONT, t, 0, 0));
	ferry_reap_child(t, "T", 5, 5000);
	ferry_finish();
}
