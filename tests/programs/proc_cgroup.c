/*
 * proc_cgroup: membership of cgroup v1 hierarchies (and the v2 one).
 *
 * Sets up, below the cgroups this process starts in: in the pids, cpu and
 * name=systemd hierarchies a cgroup "ferry-test-<pid>-a", and in pids and
 * devices (and the unified v2 hierarchy, when mounted) a cgroup
 * "ferry-test-<pid>-b"; this process joins the a's, a child C the b's.
 * Verifies: /proc/<pid>/cgroup of this process and of C names those
 * cgroups, each process in its own; and the cgroups' cgroup.procs list
 * them.  Then both move back and the cgroups are removed.
 */
#include "ferry_test.h"
#include <sys/wait.h>

#define ROOT "/sys/fs/cgroup"

struct cg {
	const char *mount; /* under ROOT */
	const char *key;   /* as /proc/PID/cgroup names the hierarchy */
	char orig[PATH_MAX];
	char made[PATH_MAX + 64];
};

/* The cgroup path of `pid` in the hierarchy named `key` ("" for v2). */
static int cgroup_of(pid_t pid, const char *key, char *out, size_t size)
{
	char path[64], buf[8192];
	snprintf(path, sizeof path, "/proc/%d/cgroup", (int)pid);
	if (ferry_read_file(path, buf, sizeof buf) < 0)
		return -1;
	for (char *line = strtok(buf, "\n"); line; line = strtok(NULL, "\n")) {
		char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
		if (!c2)
			continue;
		*c2 = 0;
		if (strcmp(c1 + 1, key) == 0) {
			snprintf(out, size, "%s", c2 + 1);
			return 0;
		}
	}
	return -1;
}

static void join(const char *mount, const char *cgroup, pid_t pid)
{
	char path[2 * PATH_MAX], text[32];
	snprintf(path, sizeof path, ROOT "/%s%s/cgroup.procs", mount, cgroup);
	snprintf(text, sizeof text, "%d\n", (int)pid);
	int fd = open(path, O_WRONLY);
	if (fd < 0 || write(fd, text, strlen(text)) < 0)
		ferry_die("join %s: %s", path, strerror(errno));
	close(fd);
}

static struct cg a[] = { { "pids", "pids" }, { "cpu", "cpu" }, { "systemd", "name=systemd" } };
static struct cg b[] = { { "pids", "pids" }, { "devices", "devices" }, { "unified", "" } };
#define NA (sizeof a / sizeof a[0])
#define NB (sizeof b / sizeof b[0])
static int nb = NB;

static void make(struct cg *g, char which)
{
	if (cgroup_of(getpid(), g->key, g->orig, sizeof g->orig) < 0)
		ferry_die("no %s hierarchy in /proc/self/cgroup", g->key);
	snprintf(g->made, sizeof g->made, "%s/ferry-test-%d-%c", strcmp(g->orig, "/") ? g->orig : "",
		 (int)getpid(), which);
	char path[2 * PATH_MAX];
	snprintf(path, sizeof path, ROOT "/%s%s", g->mount, g->made);
	if (mkdir(path, 0755) < 0)
		ferry_die("mkdir %s: %s", path, strerror(errno));
}

static void unmake(struct cg *g)
{
	char path[2 * PATH_MAX];
	snprintf(path, sizeof path, ROOT "/%s%s", g->mount, g->made);
	for (int i = 0; i < 200 && rmdir(path) < 0 && errno == EBUSY; i++)
		ferry_sleep_ms(5);
}

static void check(pid_t pid, const char *who, struct cg *g, int n)
{
	for (int i = 0; i < n; i++) {
		char got[PATH_MAX] = "";
		cgroup_of(pid, g[i].key, got, sizeof got);
		FERRY_CHECK(strcmp(got, g[i].made) == 0, "%s in %s: cgroup %s, expected %s", who,
			    g[i].key[0] ? g[i].key : "v2", got, g[i].made);
	}
}

int main(void)
{
	struct stat st;
	if (stat(ROOT "/unified/cgroup.procs", &st) < 0)
		nb = NB - 1;
	for (size_t i = 0; i < NA; i++)
		make(&a[i], 'a');
	for (int i = 0; i < nb; i++)
		make(&b[i], 'b');
	for (size_t i = 0; i < NA; i++)
		join(a[i].mount, a[i].made, getpid());
	int go_pipe[2];
	FERRY_SYS(pipe(go_pipe));
	pid_t c = FERRY_SYS(fork());
	if (c == 0) {
		close(go_pipe[1]);
		char x;
		while (read(go_pipe[0], &x, 1) < 0 && errno == EINTR)
			;
		_exit(0);
	}
	close(go_pipe[0]);
	for (int i = 0; i < nb; i++)
		join(b[i].mount, b[i].made, c);

	ferry_ready();
	ferry_wait_go();

	check(getpid(), "P", a, NA);
	check(c, "C", b, nb);
	/* C is in a's of P's only where it did not move (cpu, name=systemd). */
	char got[PATH_MAX] = "";
	cgroup_of(c, "cpu", got, sizeof got);
	FERRY_CHECK_EQ_STR("C's cpu cgroup", a[1].made, got);

	/* Move back and clean up. */
	for (int i = 0; i < nb; i++)
		join(b[i].mount, b[i].orig, c);
	for (size_t i = 0; i < NA; i++) {
		join(a[i].mount, a[i].orig, getpid());
		join(a[i].mount, a[i].orig, c);
	}
	close(go_pipe[1]);
	waitpid(c, NULL, 0);
	for (size_t i = 0; i < NA; i++)
		unmake(&a[i]);
	for (int i = 0; i < nb; i++)
		unmake(&b[i]);
	ferry_finish();
}
