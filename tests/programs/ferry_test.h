/*
 * ferry_test.h - the protocol shared by every program of the engine suite.
 *
 * A program includes this header FIRST (it defines _GNU_SOURCE), sets up the
 * kind of state it is about, remembers what it expects, then calls
 *
 *     ferry_ready();     writes getpid() to $FERRY_TEST_DIR/ready (tmp+rename)
 *     ferry_wait_go();   polls for $FERRY_TEST_DIR/go every 5 ms
 *
 * and verifies everything with the FERRY_CHECK* macros, finishing with
 * ferry_finish(), which writes the single line "PASS" or "FAIL: ..." to
 * $FERRY_TEST_DIR/result (tmp+rename) and exits 0 or 1.
 *
 * Between ready and go the process may be frozen at ANY instruction,
 * checkpointed, killed and restored (twice).  Nothing here allocates with
 * malloc between ferry_ready() and the first checks, so the memory layout
 * seen by the checks is the one that was checkpointed.
 *
 * Children of the main process use ferry_child_finish() instead: it leaves
 * their failures in $FERRY_TEST_DIR/fail.<pid> and _exit()s 0 or 1; the main
 * process collects them with ferry_reap_child().  Threads may call the
 * FERRY_CHECK macros directly (a mutex guards the failure buffer).
 * Never call them from a signal handler: record into volatile globals.
 */
#ifndef FERRY_TEST_H
#define FERRY_TEST_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <alloca.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------ */
/* Paths and small file helpers (no malloc).                           */

static inline const char *ferry_dir(void)
{
	const char *d = getenv("FERRY_TEST_DIR");
	return (d && *d) ? d : ".";
}

/* buf <- "$FERRY_TEST_DIR/name" */
static inline char *ferry_path(char *buf, size_t size, const char *name)
{
	snprintf(buf, size, "%s/%s", ferry_dir(), name);
	return buf;
}

/* Write a whole string to path: returns 0 or -1. */
static inline int ferry_write_file(const char *path, const char *text)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0)
		return -1;
	size_t len = strlen(text), done = 0;
	while (done < len) {
		ssize_t n = write(fd, text + done, len - done);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			close(fd);
			return -1;
		}
		done += (size_t)n;
	}
	return close(fd);
}

/* Write $FERRY_TEST_DIR/name atomically (name.tmp then rename). */
static inline int ferry_write_atomic(const char *name, const char *text)
{
	char tmp[PATH_MAX], dst[PATH_MAX], tname[256];
	snprintf(tname, sizeof tname, "%s.tmp", name);
	ferry_path(tmp, sizeof tmp, tname);
	ferry_path(dst, sizeof dst, name);
	if (ferry_write_file(tmp, text) < 0)
		return -1;
	return rename(tmp, dst);
}

/* Read a whole (small) file into buf, NUL-terminated. Returns length or -1. */
static inline ssize_t ferry_read_file(const char *path, char *buf, size_t size)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	size_t done = 0;
	while (done + 1 < size) {
		ssize_t n = read(fd, buf + done, size - 1 - done);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			close(fd);
			return -1;
		}
		if (n == 0)
			break;
		done += (size_t)n;
	}
	buf[done] = 0;
	close(fd);
	return (ssize_t)done;
}

static inline pid_t ferry_gettid(void)
{
	return (pid_t)syscall(SYS_gettid);
}

static inline uint64_t ferry_now_ns(clockid_t clk)
{
	struct timespec ts;
	clock_gettime(clk, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline void ferry_sleep_ms(long ms)
{
	struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };
	while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
		;
}

/* Logging to stderr (= $FERRY_TEST_DIR/log under the harness). */
static void ferry_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static inline void ferry_log(const char *fmt, ...)
{
	char buf[2048];
	int n = snprintf(buf, sizeof buf, "[%s %d/%d] ", program_invocation_short_name,
			 (int)getpid(), (int)ferry_gettid());
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(buf + n, sizeof buf - (size_t)n - 1, fmt, ap);
	va_end(ap);
	size_t len = strlen(buf);
	buf[len++] = '\n';
	ssize_t unused = write(2, buf, len);
	(void)unused;
}

/* ------------------------------------------------------------------ */
/* Failure recording.                                                  */

static pid_t ferry__main_pid;
static char ferry__fails[8192];
static int ferry__nfail;
static pthread_mutex_t ferry__lock = PTHREAD_MUTEX_INITIALIZER;

__attribute__((constructor)) static void ferry__init(void)
{
	ferry__main_pid = getpid();
}

static void ferry_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static inline void ferry_fail(const char *fmt, ...)
{
	char msg[1024];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	for (char *p = msg; *p; p++)
		if (*p == '\n' || *p == '\r')
			*p = ' ';
	ferry_log("FAIL: %s", msg);
	pthread_mutex_lock(&ferry__lock);
	size_t used = strlen(ferry__fails);
	if (used + 8 < sizeof ferry__fails)
		snprintf(ferry__fails + used, sizeof ferry__fails - used, "%s%s",
			 ferry__nfail ? "; " : "", msg);
	ferry__nfail++;
	pthread_mutex_unlock(&ferry__lock);
}

static inline int ferry_failed(void)
{
	return ferry__nfail;
}

#define FERRY_CHECK(cond, fmt, ...)                                              \
	do {                                                                     \
		if (!(cond))                                                     \
			ferry_fail("line %d: " fmt, __LINE__, ##__VA_ARGS__);    \
	} while (0)

#define FERRY_CHECK_EQ(what, expected, got)                                      \
	do {                                                                     \
		long long ferry__e = (long long)(expected), ferry__g = (long long)(got); \
		if (ferry__e != ferry__g)                                        \
			ferry_fail("line %d: %s: expected %lld, got %lld", __LINE__, \
				   (what), ferry__e, ferry__g);                  \
	} while (0)

#define FERRY_CHECK_EQ_HEX(what, expected, got)                                  \
	do {                                                                     \
		unsigned long long ferry__e = (unsigned long long)(expected),    \
				   ferry__g = (unsigned long long)(got);         \
		if (ferry__e != ferry__g)                                        \
			ferry_fail("line %d: %s: expected %#llx, got %#llx", __LINE__, \
				   (what), ferry__e, ferry__g);                  \
	} while (0)

#define FERRY_CHECK_EQ_STR(what, expected, got)                                  \
	do {                                                                     \
		const char *ferry__e = (expected), *ferry__g = (got);            \
		if (strcmp(ferry__e, ferry__g) != 0)                             \
			ferry_fail("line %d: %s: expected \"%s\", got \"%s\"", __LINE__, \
				   (what), ferry__e, ferry__g);                  \
	} while (0)

#define FERRY_CHECK_MEM(what, expected, got, len)                                \
	ferry__check_mem(__LINE__, (what), (const void *)(expected), (const void *)(got), (len))

static inline int ferry__check_mem(int line, const char *what, const void *e, const void *g, size_t len)
{
	const unsigned char *a = e, *b = g;
	for (size_t i = 0; i < len; i++) {
		if (a[i] != b[i]) {
			ferry_fail("line %d: %s: first difference at byte %zu of %zu: expected %#04x, got %#04x",
				   line, what, i, len, a[i], b[i]);
			return 0;
		}
	}
	return 1;
}

/* Setup failures: report and stop at once. */
static void ferry_finish(void) __attribute__((noreturn));
static void ferry_child_finish(void) __attribute__((noreturn));

static void ferry_die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static inline void ferry_die(const char *fmt, ...)
{
	char msg[1024];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	ferry_fail("setup: %s", msg);
	if (getpid() == ferry__main_pid)
		ferry_finish();
	ferry_child_finish();
}

/* Evaluate a setup call; a result of -1 (or negative) is fatal. */
#define FERRY_SYS(expr)                                                          \
	({                                                                       \
		__typeof__(expr) ferry__r = (expr);                              \
		if (ferry__r < 0)                                                \
			ferry_die("line %d: %s: %s", __LINE__, #expr, strerror(errno)); \
		ferry__r;                                                        \
	})

#define FERRY_PTR(expr)                                                          \
	({                                                                       \
		void *ferry__p = (void *)(expr);                                 \
		if (ferry__p == NULL || ferry__p == MAP_FAILED)                  \
			ferry_die("line %d: %s: %s", __LINE__, #expr, strerror(errno)); \
		ferry__p;                                                        \
	})

/* ------------------------------------------------------------------ */
/* The protocol.                                                       */

static inline void ferry_ready(void)
{
	char text[32];
	snprintf(text, sizeof text, "%d\n", (int)getpid());
	if (ferry_write_atomic("ready", text) < 0)
		ferry_die("cannot write ready file: %s", strerror(errno));
	ferry_log("ready");
}

/* Non-blocking: has the harness said go? */
static inline int ferry_go_seen(void)
{
	char p[PATH_MAX];
	return access(ferry_path(p, sizeof p, "go"), F_OK) == 0;
}

#define FERRY_GO_TIMEOUT_S 300

/*
 * Wait for $FERRY_TEST_DIR/go.  Harmless to interrupt anywhere: a signal
 * only cuts a 5 ms nap short and the loop checks again.
 */
static inline void ferry_wait_go(void)
{
	char p[PATH_MAX];
	ferry_path(p, sizeof p, "go");
	uint64_t start = ferry_now_ns(CLOCK_MONOTONIC);
	for (;;) {
		if (access(p, F_OK) == 0)
			return;
		struct timespec ts = { 0, 5000000 };
		nanosleep(&ts, NULL); /* EINTR: just look again */
		if (ferry_now_ns(CLOCK_MONOTONIC) - start > FERRY_GO_TIMEOUT_S * 1000000000ull) {
			ferry_fail("timed out waiting for go");
			return;
		}
	}
}

/* Main process: write the verdict and exit. */
static inline void ferry_finish(void)
{
	static char text[sizeof ferry__fails + 16];
	pthread_mutex_lock(&ferry__lock);
	if (ferry__nfail == 0)
		snprintf(text, sizeof text, "PASS\n");
	else
		snprintf(text, sizeof text, "FAIL: %s\n", ferry__fails);
	int nfail = ferry__nfail;
	pthread_mutex_unlock(&ferry__lock);
	if (ferry_write_atomic("result", text) < 0)
		ferry_log("cannot write result: %s", strerror(errno));
	ferry_log("%s", nfail ? "FAIL" : "PASS");
	exit(nfail ? 1 : 0);
}

/* Forked child: leave failures in fail.<pid> and _exit(0/1). */
static inline void ferry_child_finish(void)
{
	if (ferry__nfail) {
		char name[64];
		snprintf(name, sizeof name, "fail.%d", (int)getpid());
		ferry_write_atomic(name, ferry__fails);
	}
	_exit(ferry__nfail ? 1 : 0);
}

/*
 * Main process: wait (up to timeout_ms) for child `pid`, require that it
 * exited with `want_code`, and pull in its failure text.  Returns the wait
 * status, or -1 (child killed after the timeout).
 */
static inline int ferry_reap_child(pid_t pid, const char *name, int want_code, int timeout_ms)
{
	int status = 0;
	for (int waited = 0;; waited++) {
		pid_t r = waitpid(pid, &status, WNOHANG);
		if (r == pid)
			break;
		if (r < 0 && errno != EINTR) {
			ferry_fail("%s (pid %d): waitpid: %s", name, (int)pid, strerror(errno));
			return -1;
		}
		if (waited >= timeout_ms) {
			ferry_fail("%s (pid %d): did not exit within %d ms", name, (int)pid, timeout_ms);
			kill(pid, SIGKILL);
			waitpid(pid, &status, 0);
			return -1;
		}
		ferry_sleep_ms(1);
	}
	char p[PATH_MAX], fname[64], text[4096] = "";
	snprintf(fname, sizeof fname, "fail.%d", (int)pid);
	ferry_path(p, sizeof p, fname);
	if (ferry_read_file(p, text, sizeof text) > 0)
		ferry_fail("%s (pid %d): %s", name, (int)pid, text);
	if (!WIFEXITED(status) || WEXITSTATUS(status) != want_code) {
		if (WIFSIGNALED(status))
			ferry_fail("%s (pid %d): killed by signal %d", name, (int)pid, WTERMSIG(status));
		else if (!text[0])
			ferry_fail("%s (pid %d): exit status %d, expected %d", name, (int)pid,
				   WEXITSTATUS(status), want_code);
	}
	return status;
}

/* Poll `cond` every millisecond for up to timeout_ms; value: did it hold. */
#define FERRY_WAIT_UNTIL(cond, timeout_ms)                                       \
	({                                                                       \
		int ferry__ok = 0;                                               \
		for (long ferry__i = 0; ferry__i <= (long)(timeout_ms); ferry__i++) { \
			if (cond) {                                              \
				ferry__ok = 1;                                   \
				break;                                           \
			}                                                        \
			ferry_sleep_ms(1);                                       \
		}                                                                \
		ferry__ok;                                                       \
	})

/* ------------------------------------------------------------------ */
/* File locks.                                                         */

/* A record lock (fcntl F_SETLK, F_OFD_SETLK, F_GETLK ...) of `len` bytes
 * (0: to the end of the file) from `start`. */
static inline void ferry_lock_range(struct flock *f, short type, off_t start, off_t len)
{
	memset(f, 0, sizeof *f);
	f->l_type = type;
	f->l_whence = SEEK_SET;
	f->l_start = start;
	f->l_len = len;
}

/* ------------------------------------------------------------------ */
/* Deterministic patterns.                                             */

static inline uint64_t ferry__mix(uint64_t x)
{
	x ^= x >> 30;
	x *= 0xbf58476d1ce4e5b9ull;
	x ^= x >> 27;
	x *= 0x94d049bb133111ebull;
	x ^= x >> 31;
	return x;
}

static inline void ferry_fill(void *p, size_t len, uint64_t seed)
{
	unsigned char *b = p;
	for (size_t i = 0; i < len; i += 8) {
		uint64_t v = ferry__mix(seed * 0x9e3779b97f4a7c15ull + i);
		size_t n = len - i < 8 ? len - i : 8;
		memcpy(b + i, &v, n);
	}
}

/* Returns 1 if p[0..len) holds the pattern of `seed`, else fails. */
static inline int ferry_check_fill(const char *what, const void *p, size_t len, uint64_t seed)
{
	const unsigned char *b = p;
	for (size_t i = 0; i < len; i += 8) {
		uint64_t v = ferry__mix(seed * 0x9e3779b97f4a7c15ull + i);
		size_t n = len - i < 8 ? len - i : 8;
		if (memcmp(b + i, &v, n) != 0) {
			ferry_fail("%s: pattern differs at byte %zu of %zu (address %p)", what, i, len,
				   (void *)(b + i));
			return 0;
		}
	}
	return 1;
}

static inline int ferry_check_zero(const char *what, const void *p, size_t len)
{
	const unsigned char *b = p;
	for (size_t i = 0; i < len; i++)
		if (b[i]) {
			ferry_fail("%s: expected zero at byte %zu of %zu, got %#04x", what, i, len, b[i]);
			return 0;
		}
	return 1;
}

/* ------------------------------------------------------------------ */
/* /proc helpers.                                                      */

/* Value of "Field:" in /proc/self/status (tid==0) or /proc/self/task/tid/status. */
static inline int ferry_status_field(pid_t tid, const char *field, char *out, size_t size)
{
	char buf[8192];
	char path[128];
	if (tid)
		snprintf(path, sizeof path, "/proc/self/task/%d/status", (int)tid);
	else
		snprintf(path, sizeof path, "/proc/self/status");
	if (ferry_read_file(path, buf, sizeof buf) < 0)
		return -1;
	size_t flen = strlen(field);
	for (char *line = buf; line && *line;) {
		char *nl = strchr(line, '\n');
		if (nl)
			*nl = 0;
		if (strncmp(line, field, flen) == 0 && line[flen] == ':') {
			char *v = line + flen + 1;
			while (*v == ' ' || *v == '\t')
				v++;
			snprintf(out, size, "%s", v);
			return 0;
		}
		line = nl ? nl + 1 : NULL;
	}
	return -1;
}

/* Value of "field:" in /proc/self/fdinfo/fd. */
static inline int ferry_fdinfo_field(int fd, const char *field, char *out, size_t size)
{
	char buf[4096], path[64];
	snprintf(path, sizeof path, "/proc/self/fdinfo/%d", fd);
	if (ferry_read_file(path, buf, sizeof buf) < 0)
		return -1;
	size_t flen = strlen(field);
	for (char *line = buf; line && *line;) {
		char *nl = strchr(line, '\n');
		if (nl)
			*nl = 0;
		if (strncmp(line, field, flen) == 0 && line[flen] == ':') {
			char *v = line + flen + 1;
			while (*v == ' ' || *v == '\t')
				v++;
			snprintf(out, size, "%s", v);
			return 0;
		}
		line = nl ? nl + 1 : NULL;
	}
	return -1;
}

/* The full "flags:" of fdinfo, as a number (octal in /proc). */
static inline long ferry_fdinfo_flags(int fd)
{
	char v[64];
	if (ferry_fdinfo_field(fd, "flags", v, sizeof v) < 0)
		return -1;
	return strtol(v, NULL, 8);
}

/* readlink /proc/self/fd/fd, "" on error. */
static inline char *ferry_fd_link(int fd, char *buf, size_t size)
{
	char path[64];
	snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
	ssize_t n = readlink(path, buf, size - 1);
	buf[n < 0 ? 0 : n] = 0;
	return buf;
}

/* Syscall number task pid/tid sits in (from /proc/PID/task/TID/syscall), or -1. */
static inline long ferry_task_syscall_in(pid_t pid, pid_t tid)
{
	char path[128], buf[256];
	snprintf(path, sizeof path, "/proc/%d/task/%d/syscall", (int)pid, (int)tid);
	if (ferry_read_file(path, buf, sizeof buf) <= 0)
		return -1;
	if (buf[0] < '0' || buf[0] > '9')
		return -1; /* "running" */
	return strtol(buf, NULL, 10);
}

static inline long ferry_task_syscall(pid_t tid)
{
	return ferry_task_syscall_in(getpid(), tid);
}

/*
 * Wait until task pid/tid is asleep (state S or D) inside syscall nr_a or
 * nr_b.  Returns 1 if it is, 0 after timeout_ms.
 */
static inline int ferry_wait_blocked_in(pid_t pid, pid_t tid, long nr_a, long nr_b, int timeout_ms)
{
	for (int i = 0; i <= timeout_ms; i++) {
		long nr = ferry_task_syscall_in(pid, tid);
		if (nr >= 0 && (nr == nr_a || nr == nr_b)) {
			char path[128], buf[512];
			snprintf(path, sizeof path, "/proc/%d/task/%d/stat", (int)pid, (int)tid);
			if (ferry_read_file(path, buf, sizeof buf) > 0) {
				char *p = strrchr(buf, ')');
				if (p && (p[2] == 'S' || p[2] == 'D'))
					return 1;
			}
		}
		ferry_sleep_ms(1);
	}
	return 0;
}

/* Same, for a thread of this process. */
static inline int ferry_wait_blocked(pid_t tid, long nr_a, long nr_b, int timeout_ms)
{
	return ferry_wait_blocked_in(getpid(), tid, nr_a, nr_b, timeout_ms);
}

/* Numbers of all open fds (ascending), excluding the one used to list. */
static inline int ferry_list_fds(int *fds, int max)
{
	int dfd = open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (dfd < 0)
		return -1;
	char buf[4096];
	int n = 0;
	for (;;) {
		long r = syscall(SYS_getdents64, dfd, buf, sizeof buf);
		if (r <= 0)
			break;
		for (long off = 0; off < r;) {
			struct {
				uint64_t ino;
				int64_t off;
				unsigned short reclen;
				unsigned char type;
				char name[];
			} *d = (void *)(buf + off);
			if (d->name[0] != '.') {
				int fd = atoi(d->name);
				if (fd != dfd && n < max)
					fds[n++] = fd;
			}
			off += d->reclen;
		}
	}
	close(dfd);
	for (int i = 1; i < n; i++) /* insertion sort */
		for (int j = i; j > 0 && fds[j - 1] > fds[j]; j--) {
			int t = fds[j];
			fds[j] = fds[j - 1];
			fds[j - 1] = t;
		}
	return n;
}

/* Check that the set of open fds equals the one taken before. */
static inline void ferry_check_fds_same(const int *before, int nbefore)
{
	int now[1024];
	int n = ferry_list_fds(now, 1024);
	char a[1024] = "", b[1024] = "";
	for (int i = 0; i < nbefore; i++)
		snprintf(a + strlen(a), sizeof a - strlen(a), "%d ", before[i]);
	for (int i = 0; i < n; i++)
		snprintf(b + strlen(b), sizeof b - strlen(b), "%d ", now[i]);
	if (n != nbefore || memcmp(before, now, sizeof(int) * (size_t)n) != 0)
		ferry_fail("open fds differ: expected [%s], got [%s]", a, b);
}

/* /proc/self/maps, parsed without malloc. */
struct ferry_map {
	unsigned long start, end, offset;
	char perms[8];
	char path[256];
};

#define FERRY_MAX_MAPS 1024

static void ferry_prefault_stack(void);

static inline int ferry_read_maps(struct ferry_map *out, int max)
{
	static char buf[1 << 18];
	ferry_prefault_stack();
	if (ferry_read_file("/proc/self/maps", buf, sizeof buf) < 0)
		return -1;
	int n = 0;
	for (char *line = buf; line && *line && n < max;) {
		char *nl = strchr(line, '\n');
		if (nl)
			*nl = 0;
		struct ferry_map *m = &out[n];
		int pos = 0;
		unsigned long ino;
		unsigned int maj, min;
		if (sscanf(line, "%lx-%lx %7s %lx %x:%x %lu %n", &m->start, &m->end, m->perms,
			   &m->offset, &maj, &min, &ino, &pos) >= 7) {
			snprintf(m->path, sizeof m->path, "%s", pos ? line + pos : "");
			n++;
		}
		line = nl ? nl + 1 : NULL;
	}
	return n;
}

/* The mapping that contains addr; 0 if found. */
static inline int ferry_find_map(const void *addr, struct ferry_map *m)
{
	static struct ferry_map maps[FERRY_MAX_MAPS];
	int n = ferry_read_maps(maps, FERRY_MAX_MAPS);
	for (int i = 0; i < n; i++)
		if ((unsigned long)addr >= maps[i].start && (unsigned long)addr < maps[i].end) {
			*m = maps[i];
			return 0;
		}
	return -1;
}

/*
 * Require that [start, start+len) lies inside one mapping with perms (e.g.
 * "rw-p").  (Neighbouring VMAs may be merged by the kernel, so this checks
 * containment; ferry_check_maps_same() checks exact boundaries.)
 */
static inline void ferry_check_map(const char *what, const void *start, size_t len, const char *perms)
{
	struct ferry_map m;
	if (ferry_find_map(start, &m) < 0) {
		ferry_fail("%s: no mapping at %p", what, start);
		return;
	}
	if (m.start > (unsigned long)start || m.end < (unsigned long)start + len)
		ferry_fail("%s: expected one mapping covering %p-%#lx, got %#lx-%#lx", what, start,
			   (unsigned long)start + len, m.start, m.end);
	if (perms && strcmp(m.perms, perms) != 0)
		ferry_fail("%s: expected perms %s, got %s", what, perms, m.perms);
}

/*
 * Touch 256 KiB of stack below the caller, so that later calls do not grow it: once per
 * thread (a forked child inherits the stack grown so, and the flag). Only once: the lowest
 * page touched becomes the stack's bottom, and a later call from a deeper frame (the check
 * after go, made a frame or two below the snapshot before ready, or from a function) touched
 * 256 KiB below itself again, one page past that bottom whenever the first call's lowest
 * address lay within the difference in depth of its page's start: the process grew its own
 * stack between snapshot and check, natively as after a restore (for mem_cow_shared, 144
 * bytes deeper: in 9 of the 256 places the kernel's randomization can give the stack
 * pointer within its page, the parent and its children, forked with the same offset, all).
 */
static __thread int ferry__stack_prefaulted;

__attribute__((noinline)) static void ferry_prefault_stack(void)
{
	if (ferry__stack_prefaulted)
		return;
	ferry__stack_prefaulted = 1;
	volatile unsigned char *p = alloca(256 * 1024);
	for (size_t i = 0; i < 256 * 1024; i += 4096)
		p[i] = 0;
}

/*
 * Compare the whole address space with a snapshot taken by ferry_read_maps()
 * (the labels [stack] and [heap] are not compared: tests about them check
 * them).  Take the snapshot right before ferry_ready() and compare right
 * after ferry_wait_go(), before anything that may allocate.
 */
static inline void ferry_check_maps_same(const struct ferry_map *before, int nbefore)
{
	static struct ferry_map now[FERRY_MAX_MAPS];
	int n = ferry_read_maps(now, FERRY_MAX_MAPS);
	int i = 0, j = 0, bad = 0;
	while ((i < nbefore || j < n) && bad < 4) {
		const struct ferry_map *a = i < nbefore ? &before[i] : NULL;
		const struct ferry_map *b = j < n ? &now[j] : NULL;
		if (a && b && a->start < b->end && b->start < a->end) {
			const char *pa = a->path, *pb = b->path;
			if (!strcmp(pa, "[stack]") || !strcmp(pa, "[heap]"))
				pa = "";
			if (!strcmp(pb, "[stack]") || !strcmp(pb, "[heap]"))
				pb = "";
			if (a->start != b->start || a->end != b->end || strcmp(a->perms, b->perms) ||
			    a->offset != b->offset || strcmp(pa, pb)) {
				bad++;
				ferry_fail("address space: expected mapping %lx-%lx %s %lx %s, got %lx-%lx %s %lx %s",
					   a->start, a->end, a->perms, a->offset, a->path, b->start, b->end,
					   b->perms, b->offset, b->path);
			}
			i++, j++;
		} else if (a && (!b || a->start < b->start)) {
			bad++;
			ferry_fail("address space: mapping %lx-%lx %s %lx %s is missing", a->start, a->end,
				   a->perms, a->offset, a->path);
			i++;
		} else {
			bad++;
			ferry_fail("address space: unexpected mapping %lx-%lx %s %lx %s", b->start, b->end,
				   b->perms, b->offset, b->path);
			j++;
		}
	}
}

/* Does the VmFlags line of the smaps entry at start contain flag (e.g. "gd")? */
static inline int ferry_smaps_field(const void *start, const char *field, char *out, size_t size)
{
	static char buf[1 << 20];
	if (ferry_read_file("/proc/self/smaps", buf, sizeof buf) < 0)
		return -1;
	char head[32];
	snprintf(head, sizeof head, "%lx-", (unsigned long)start);
	int in = 0;
	size_t flen = strlen(field);
	for (char *line = buf; line && *line;) {
		char *nl = strchr(line, '\n');
		if (nl)
			*nl = 0;
		if ((line[0] >= '0' && line[0] <= '9') || (line[0] >= 'a' && line[0] <= 'f')) {
			if (strchr(line, '-') && strchr(line, ' ') && strchr(line, '-') < strchr(line, ' '))
				in = strncmp(line, head, strlen(head)) == 0;
		} else if (in && strncmp(line, field, flen) == 0 && line[flen] == ':') {
			char *v = line + flen + 1;
			while (*v == ' ' || *v == '\t')
				v++;
			snprintf(out, size, "%s", v);
			return 0;
		}
		line = nl ? nl + 1 : NULL;
	}
	return -1;
}

static inline int ferry_has_vmflag(const void *start, const char *flag)
{
	char v[256], pad[260];
	if (ferry_smaps_field(start, "VmFlags", v, sizeof v) < 0)
		return -1;
	snprintf(pad, sizeof pad, " %s ", v);
	char want[8];
	snprintf(want, sizeof want, " %s ", flag);
	return strstr(pad, want) != NULL;
}

#endif /* FERRY_TEST_H */
