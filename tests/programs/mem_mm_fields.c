/*
 * mem_mm_fields: per-mm bookkeeping the kernel shows in /proc.
 *
 * Sets up: rewrites argv[0] in place (as setproctitle does), adds an
 * environment variable (which lives in the heap, not in the env area).
 * Verifies: /proc/self/exe, /proc/self/cmdline, /proc/self/environ and
 * /proc/self/auxv are byte-for-byte unchanged; /proc/self/stat startcode,
 * endcode, startstack, start_data, end_data, start_brk, arg_start, arg_end,
 * env_start and env_end are unchanged; getauxval(AT_RANDOM/AT_PHDR/...) still
 * point to the same places.
 */
#include "ferry_test.h"
#include <sys/auxv.h>

static const int stat_fields[] = { 26, 27, 28, 45, 46, 47, 48, 49, 50, 51 };
static const char *stat_names[] = { "startcode", "endcode", "startstack", "start_data",
				    "end_data", "start_brk", "arg_start", "arg_end",
				    "env_start", "env_end" };
#define NF (sizeof stat_fields / sizeof stat_fields[0])

static void read_stat(unsigned long *out)
{
	char buf[2048];
	memset(out, 0, NF * sizeof *out);
	if (ferry_read_file("/proc/self/stat", buf, sizeof buf) < 0)
		return;
	char *p = strrchr(buf, ')') + 2;
	for (int f = 3, k = 0; p && k < (int)NF; f++) {
		if (f == stat_fields[k])
			out[k++] = strtoul(p, NULL, 10);
		p = strchr(p, ' ');
		if (p)
			p++;
	}
}

static char exe_b[PATH_MAX], cmd_b[4096], env_b[65536], aux_b[4096];
static ssize_t cmd_n, env_n, aux_n;
static unsigned long stat_b[NF];

int main(int argc, char **argv)
{
	(void)argc;
	size_t l = strlen(argv[0]);
	if (l >= 4)
		memcpy(argv[0] + l - 4, "-xyz", 4);
	setenv("FERRY_MM_TEST", "value-in-heap", 1);
	unsigned long at_random = getauxval(AT_RANDOM), at_phdr = getauxval(AT_PHDR),
		      at_entry = getauxval(AT_ENTRY), at_execfn = getauxval(AT_EXECFN);
	unsigned char random_bytes[16];
	memcpy(random_bytes, (void *)at_random, 16);

	FERRY_SYS(readlink("/proc/self/exe", exe_b, sizeof exe_b - 1));
	cmd_n = FERRY_SYS(ferry_read_file("/proc/self/cmdline", cmd_b, sizeof cmd_b));
	env_n = FERRY_SYS(ferry_read_file("/proc/self/environ", env_b, sizeof env_b));
	aux_n = FERRY_SYS(ferry_read_file("/proc/self/auxv", aux_b, sizeof aux_b));
	read_stat(stat_b);

	ferry_ready();
	ferry_wait_go();

	static char exe[PATH_MAX], cmd[4096], env[65536], aux[4096];
	FERRY_CHECK(readlink("/proc/self/exe", exe, sizeof exe - 1) > 0, "readlink exe: %s", strerror(errno));
	FERRY_CHECK_EQ_STR("/proc/self/exe", exe_b, exe);
	FERRY_CHECK_EQ("cmdline length", cmd_n, ferry_read_file("/proc/self/cmdline", cmd, sizeof cmd));
	FERRY_CHECK_MEM("cmdline", cmd_b, cmd, (size_t)cmd_n);
	FERRY_CHECK_EQ("environ length", env_n, ferry_read_file("/proc/self/environ", env, sizeof env));
	FERRY_CHECK_MEM("environ", env_b, env, (size_t)env_n);
	FERRY_CHECK_EQ("auxv length", aux_n, ferry_read_file("/proc/self/auxv", aux, sizeof aux));
	FERRY_CHECK_MEM("auxv", aux_b, aux, (size_t)aux_n);
	unsigned long st[NF];
	read_stat(st);
	for (size_t i = 0; i < NF; i++)
		FERRY_CHECK_EQ_HEX(stat_names[i], stat_b[i], st[i]);
	FERRY_CHECK_EQ_HEX("getauxval(AT_RANDOM)", at_random, getauxval(AT_RANDOM));
	FERRY_CHECK_EQ_HEX("getauxval(AT_PHDR)", at_phdr, getauxval(AT_PHDR));
	FERRY_CHECK_EQ_HEX("getauxval(AT_ENTRY)", at_entry, getauxval(AT_ENTRY));
	FERRY_CHECK_EQ_HEX("getauxval(AT_EXECFN)", at_execfn, getauxval(AT_EXECFN));
	FERRY_CHECK_MEM("AT_RANDOM bytes", random_bytes, (void *)at_random, 16);
	FERRY_CHECK_EQ_STR("getenv", "value-in-heap", getenv("FERRY_MM_TEST") ?: "(null)");
	ferry_finish();
}
