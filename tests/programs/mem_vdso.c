/*
 * mem_vdso: the vDSO and vvar.
 *
 * Sets up: looks up __vdso_clock_gettime, __vdso_gettimeofday, __vdso_time
 * and __vdso_getcpu in the vDSO's ELF symbol table and keeps the pointers;
 * records the [vdso]/[vvar] mappings and AT_SYSINFO_EHDR.
 * Verifies: the address space is unchanged, [vdso] is still at
 * AT_SYSINFO_EHDR, and calling the saved vDSO function pointers (and glibc's
 * clock_gettime/gettimeofday/time) gives sane times that agree with the
 * real syscalls and did not go backwards for CLOCK_MONOTONIC.
 */
#include "ferry_test.h"
#include <elf.h>
#include <sys/auxv.h>
#include <sys/time.h>

static struct ferry_map maps_before[FERRY_MAX_MAPS];

static void *vdso_sym(const char *name)
{
	unsigned long base = getauxval(AT_SYSINFO_EHDR);
	if (!base)
		return NULL;
	Elf64_Ehdr *eh = (Elf64_Ehdr *)base;
	Elf64_Shdr *sh = (Elf64_Shdr *)(base + eh->e_shoff);
	for (int i = 0; i < eh->e_shnum; i++) {
		if (sh[i].sh_type != SHT_DYNSYM)
			continue;
		Elf64_Sym *sym = (Elf64_Sym *)(base + sh[i].sh_offset);
		const char *str = (const char *)(base + sh[sh[i].sh_link].sh_offset);
		for (size_t j = 0; j < sh[i].sh_size / sizeof(Elf64_Sym); j++)
			if (sym[j].st_name && strcmp(str + sym[j].st_name, name) == 0 && sym[j].st_value)
				return (void *)(base + sym[j].st_value);
	}
	return NULL;
}

static int64_t ts_ns(struct timespec t)
{
	return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int64_t diff_ms(int64_t a, int64_t b)
{
	return (a > b ? a - b : b - a) / 1000000;
}

int main(void)
{
	int (*v_clock_gettime)(clockid_t, struct timespec *) = vdso_sym("__vdso_clock_gettime");
	int (*v_gettimeofday)(struct timeval *, void *) = vdso_sym("__vdso_gettimeofday");
	time_t (*v_time)(time_t *) = vdso_sym("__vdso_time");
	long (*v_getcpu)(unsigned *, unsigned *, void *) = vdso_sym("__vdso_getcpu");
	if (!v_clock_gettime || !v_gettimeofday || !v_time || !v_getcpu)
		ferry_die("vDSO symbols not found");
	unsigned long ehdr = getauxval(AT_SYSINFO_EHDR);
	struct timespec mono_before;
	v_clock_gettime(CLOCK_MONOTONIC, &mono_before);
	struct ferry_map vdso_before;
	if (ferry_find_map((void *)ehdr, &vdso_before) < 0 || strcmp(vdso_before.path, "[vdso]"))
		ferry_die("AT_SYSINFO_EHDR is not in [vdso]");

	int nmaps = ferry_read_maps(maps_before, FERRY_MAX_MAPS);
	ferry_ready();
	ferry_wait_go();

	ferry_check_maps_same(maps_before, nmaps);
	struct ferry_map m;
	if (ferry_find_map((void *)ehdr, &m) == 0) {
		FERRY_CHECK_EQ_STR("mapping at AT_SYSINFO_EHDR", "[vdso]", m.path);
		FERRY_CHECK_EQ_HEX("[vdso] start", vdso_before.start, m.start);
		FERRY_CHECK_EQ_HEX("[vdso] end", vdso_before.end, m.end);
	} else {
		ferry_fail("nothing mapped at AT_SYSINFO_EHDR %#lx", ehdr);
		ferry_finish(); /* calling into the vDSO would crash */
	}

	static const clockid_t clocks[] = { CLOCK_REALTIME, CLOCK_MONOTONIC, CLOCK_BOOTTIME,
					    CLOCK_MONOTONIC_RAW, CLOCK_REALTIME_COARSE,
					    CLOCK_MONOTONIC_COARSE };
	for (size_t i = 0; i < sizeof clocks / sizeof clocks[0]; i++) {
		struct timespec v = { 0 }, g = { 0 }, s = { 0 };
		FERRY_CHECK_EQ("vDSO clock_gettime rc", 0, v_clock_gettime(clocks[i], &v));
		FERRY_CHECK_EQ("glibc clock_gettime rc", 0, clock_gettime(clocks[i], &g));
		FERRY_CHECK_EQ("syscall clock_gettime rc", 0, syscall(SYS_clock_gettime, clocks[i], &s));
		FERRY_CHECK(diff_ms(ts_ns(v), ts_ns(s)) < 100,
			    "clock %d: vDSO says %lld.%09ld, syscall says %lld.%09ld", (int)clocks[i],
			    (long long)v.tv_sec, v.tv_nsec, (long long)s.tv_sec, s.tv_nsec);
		FERRY_CHECK(diff_ms(ts_ns(g), ts_ns(s)) < 100,
			    "clock %d: glibc says %lld.%09ld, syscall says %lld.%09ld", (int)clocks[i],
			    (long long)g.tv_sec, g.tv_nsec, (long long)s.tv_sec, s.tv_nsec);
	}
	struct timespec mono;
	v_clock_gettime(CLOCK_MONOTONIC, &mono);
	FERRY_CHECK(ts_ns(mono) >= ts_ns(mono_before), "CLOCK_MONOTONIC went backwards");

	struct timeval tv = { 0 }, tvg = { 0 };
	struct timespec rt;
	FERRY_CHECK_EQ("vDSO gettimeofday rc", 0, v_gettimeofday(&tv, NULL));
	FERRY_CHECK_EQ("glibc gettimeofday rc", 0, gettimeofday(&tvg, NULL));
	syscall(SYS_clock_gettime, CLOCK_REALTIME, &rt);
	int64_t tv_ns = (int64_t)tv.tv_sec * 1000000000 + tv.tv_usec * 1000;
	int64_t tvg_ns = (int64_t)tvg.tv_sec * 1000000000 + tvg.tv_usec * 1000;
	FERRY_CHECK(diff_ms(tv_ns, ts_ns(rt)) < 100, "vDSO gettimeofday off by %lld ms",
		    (long long)diff_ms(tv_ns, ts_ns(rt)));
	FERRY_CHECK(diff_ms(tvg_ns, ts_ns(rt)) < 100, "glibc gettimeofday off by %lld ms",
		    (long long)diff_ms(tvg_ns, ts_ns(rt)));
	time_t t = v_time(NULL);
	FERRY_CHECK(t >= rt.tv_sec - 1 && t <= rt.tv_sec + 1, "vDSO time() says %lld, expected %lld",
		    (long long)t, (long long)rt.tv_sec);
	unsigned cpu = 9999, node = 9999;
	FERRY_CHECK_EQ("vDSO getcpu rc", 0, v_getcpu(&cpu, &node, NULL));
	FERRY_CHECK(cpu < (unsigned)sysconf(_SC_NPROCESSORS_CONF), "vDSO getcpu gave cpu %u", cpu);
	ferry_finish();
}
