/*
 * cpu_regs_fpu_sse_avx: general, x87, SSE/AVX/AVX-512 and PKRU registers.
 *
 * Sets up a thread that loads known values into rbx, rdx, r8-r10, r12-r15,
 * the eight x87 stack registers (with a non-default x87 control word), the
 * MXCSR (non-default rounding, FTZ, DAZ), all vector registers at their
 * widest size (zmm0-31 + k0-k7 with AVX-512, ymm0-15 with AVX, else
 * xmm0-15) and, if the CPU has protection keys, PKRU; then, without calling
 * any function, loops on "go_flag != 0 ? done : nanosleep(1 ms) via a raw
 * syscall" so it can be frozen either in user code or in the syscall.
 * Verifies: after the main thread sets go_flag, every register still holds
 * its value (stored by the same asm block).
 */
#include "ferry_test.h"
#include <stddef.h>

struct regs {
	uint8_t vec[32][64]; /* offset 0 */
	uint64_t k[8];       /* 2048 */
	uint64_t gpr[9];     /* 2112 */
	double x87[8];       /* 2184 */
	uint16_t fcw;        /* 2248 */
	uint16_t pad;
	uint32_t mxcsr;      /* 2252 */
} __attribute__((aligned(64)));
_Static_assert(offsetof(struct regs, k) == 2048, "layout");
_Static_assert(offsetof(struct regs, gpr) == 2112, "layout");
_Static_assert(offsetof(struct regs, x87) == 2184, "layout");
_Static_assert(offsetof(struct regs, fcw) == 2248, "layout");
_Static_assert(offsetof(struct regs, mxcsr) == 2252, "layout");

static struct regs rin, rout;
static volatile int go_flag, spinning;
static const struct timespec nap = { 0, 1000000 };
static const uint16_t fcw_default = 0x037f;
static const uint32_t mxcsr_default = 0x1f80;
static int has_pku;
static uint32_t pkru_in = 0x55555550, pkru_out;

#define LOAD_GPR                                                                 \
	"mov 2112+%[rin], %%rbx\n mov 2120+%[rin], %%rdx\n mov 2128+%[rin], %%r8\n" \
	"mov 2136+%[rin], %%r9\n mov 2144+%[rin], %%r10\n mov 2152+%[rin], %%r12\n" \
	"mov 2160+%[rin], %%r13\n mov 2168+%[rin], %%r14\n mov 2176+%[rin], %%r15\n"
#define STORE_GPR                                                                \
	"mov %%rbx, 2112+%[rout]\n mov %%rdx, 2120+%[rout]\n mov %%r8, 2128+%[rout]\n" \
	"mov %%r9, 2136+%[rout]\n mov %%r10, 2144+%[rout]\n mov %%r12, 2152+%[rout]\n" \
	"mov %%r13, 2160+%[rout]\n mov %%r14, 2168+%[rout]\n mov %%r15, 2176+%[rout]\n"
#define LOAD_X87                                                                 \
	"fldcw 2248+%[rin]\n ldmxcsr 2252+%[rin]\n"                              \
	"fldl 2240+%[rin]\n fldl 2232+%[rin]\n fldl 2224+%[rin]\n fldl 2216+%[rin]\n" \
	"fldl 2208+%[rin]\n fldl 2200+%[rin]\n fldl 2192+%[rin]\n fldl 2184+%[rin]\n"
#define STORE_X87                                                                \
	"fnstcw 2248+%[rout]\n stmxcsr 2252+%[rout]\n"                           \
	"fstpl 2184+%[rout]\n fstpl 2192+%[rout]\n fstpl 2200+%[rout]\n fstpl 2208+%[rout]\n" \
	"fstpl 2216+%[rout]\n fstpl 2224+%[rout]\n fstpl 2232+%[rout]\n fstpl 2240+%[rout]\n" \
	"fldcw %[fcwd]\n ldmxcsr %[mxd]\n"
#define LOOP                                                                     \
	"movl $1, %[spin]\n"                                                     \
	"1: cmpl $0, %[go]\n jne 2f\n"                                           \
	"mov $35, %%eax\n lea %[nap], %%rdi\n xor %%esi, %%esi\n syscall\n jmp 1b\n2:\n"
#define OPERANDS                                                                 \
	: [rout] "=m"(rout), [spin] "=m"(spinning)                               \
	: [rin] "m"(rin), [go] "m"(go_flag), [nap] "m"(nap), [fcwd] "m"(fcw_default), \
	  [mxd] "m"(mxcsr_default)                                               \
	: "rax", "rbx", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11", "r12", "r13", \
	  "r14", "r15", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", \
	  "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "memory", "cc"

#define Z_IN(n) "vmovdqu64 " #n "*64+%[rin], %%zmm" #n "\n"
#define Z_OUT(n) "vmovdqu64 %%zmm" #n ", " #n "*64+%[rout]\n"
#define Y_IN(n) "vmovdqu " #n "*64+%[rin], %%ymm" #n "\n"
#define Y_OUT(n) "vmovdqu %%ymm" #n ", " #n "*64+%[rout]\n"
#define X_IN(n) "movdqu " #n "*64+%[rin], %%xmm" #n "\n"
#define X_OUT(n) "movdqu %%xmm" #n ", " #n "*64+%[rout]\n"
#define K_IN(n) "kmovw 2048+" #n "*8+%[rin], %%k" #n "\n"
#define K_OUT(n) "kmovw %%k" #n ", 2048+" #n "*8+%[rout]\n"
#define ALL16(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11) M(12) M(13) M(14) M(15)
#define HI16(M) M(16) M(17) M(18) M(19) M(20) M(21) M(22) M(23) M(24) M(25) M(26) M(27) M(28) M(29) M(30) M(31)
#define ALL8(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7)

__attribute__((noinline)) static void hold_avx512(void)
{
	asm volatile(LOAD_X87 ALL16(Z_IN) HI16(Z_IN) ALL8(K_IN) LOAD_GPR LOOP STORE_GPR ALL8(K_OUT)
			     HI16(Z_OUT) ALL16(Z_OUT) STORE_X87 "vzeroupper\n" OPERANDS);
}

__attribute__((noinline)) static void hold_avx(void)
{
	asm volatile(LOAD_X87 ALL16(Y_IN) LOAD_GPR LOOP STORE_GPR ALL16(Y_OUT) STORE_X87
		     "vzeroupper\n" OPERANDS);
}

__attribute__((noinline)) static void hold_sse(void)
{
	asm volatile(LOAD_X87 ALL16(X_IN) LOAD_GPR LOOP STORE_GPR ALL16(X_OUT) STORE_X87 OPERANDS);
}

static int vec_regs, vec_bytes;

static void *holder(void *arg)
{
	(void)arg;
	if (has_pku)
		asm volatile("wrpkru" ::"a"(pkru_in), "c"(0), "d"(0));
	if (vec_bytes == 64)
		hold_avx512();
	else if (vec_bytes == 32)
		hold_avx();
	else
		hold_sse();
	if (has_pku) {
		uint32_t eax, edx;
		asm volatile("rdpkru" : "=a"(eax), "=d"(edx) : "c"(0));
		pkru_out = eax;
		asm volatile("wrpkru" ::"a"(0x55555554u), "c"(0), "d"(0));
	}
	return NULL;
}

int main(void)
{
	__builtin_cpu_init();
	if (__builtin_cpu_supports("avx512f"))
		vec_regs = 32, vec_bytes = 64;
	else if (__builtin_cpu_supports("avx"))
		vec_regs = 16, vec_bytes = 32;
	else
		vec_regs = 16, vec_bytes = 16;
	{
		char flags[4096] = "";
		ferry_read_file("/proc/cpuinfo", flags, sizeof flags);
		has_pku = strstr(flags, " ospke") != NULL;
	}
	ferry_fill(rin.vec, sizeof rin.vec, 120);
	ferry_fill(rin.k, sizeof rin.k, 121);
	ferry_fill(rin.gpr, sizeof rin.gpr, 122);
	for (int i = 0; i < 8; i++)
		rin.x87[i] = (i + 1) * 1.25 - 3.0 / (i + 7);
	rin.fcw = 0x0e7f;   /* round toward zero, extended precision kept */
	rin.mxcsr = 0xffc0; /* FTZ, DAZ, round toward zero, all masked */
	ferry_log("vector registers: %d x %d bytes, pku: %d", vec_regs, vec_bytes, has_pku);

	pthread_t t;
	if (pthread_create(&t, NULL, holder, NULL))
		ferry_die("pthread_create");
	if (!FERRY_WAIT_UNTIL(spinning, 5000))
		ferry_die("register holder did not start");

	ferry_ready();
	ferry_wait_go();
	go_flag = 1;
	pthread_join(t, NULL);

	for (int i = 0; i < vec_regs; i++) {
		char what[64];
		snprintf(what, sizeof what, "%s%d", vec_bytes == 64 ? "zmm" : vec_bytes == 32 ? "ymm" : "xmm", i);
		FERRY_CHECK_MEM(what, rin.vec[i], rout.vec[i], (size_t)vec_bytes);
	}
	if (vec_bytes == 64)
		for (int i = 0; i < 8; i++) {
			char what[16];
			snprintf(what, sizeof what, "k%d", i);
			FERRY_CHECK_EQ_HEX(what, rin.k[i] & 0xffff, rout.k[i] & 0xffff);
		}
	static const char *gpr_names[] = { "rbx", "rdx", "r8", "r9", "r10", "r12", "r13", "r14", "r15" };
	for (int i = 0; i < 9; i++)
		FERRY_CHECK_EQ_HEX(gpr_names[i], rin.gpr[i], rout.gpr[i]);
	for (int i = 0; i < 8; i++) {
		char what[16];
		snprintf(what, sizeof what, "st(%d)", i);
		FERRY_CHECK(rin.x87[i] == rout.x87[i], "%s: expected %.17g, got %.17g", what, rin.x87[i],
			    rout.x87[i]);
	}
	FERRY_CHECK_EQ_HEX("x87 control word", rin.fcw, rout.fcw);
	FERRY_CHECK_EQ_HEX("mxcsr", rin.mxcsr, rout.mxcsr);
	if (has_pku)
		FERRY_CHECK_EQ_HEX("pkru", pkru_in, pkru_out);
	ferry_finish();
}
