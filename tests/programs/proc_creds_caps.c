/*
 * proc_creds_caps: credentials of a process that dropped root.
 *
 * Sets up (starting as root): the test dir made world-writable; bounding
 * set without CAP_SYS_BOOT; securebits SECBIT_KEEP_CAPS|SECBIT_NOROOT;
 * groups {1001, 1002, 4242}; gids r/e/s = 1000/1001/1002; uids r/e/s =
 * 1000/1001/1002; capabilities permitted {CHOWN, NET_BIND_SERVICE,
 * SYS_NICE}, effective {NET_BIND_SERVICE, SYS_NICE}, inheritable
 * {NET_BIND_SERVICE}, ambient {NET_BIND_SERVICE}; dumpable 1.
 * Verifies: getresuid/getresgid, fsuid/fsgid, getgroups, capget sets,
 * CapAmb/CapBnd from /proc/self/status, securebits, dumpable.
 */
#include "ferry_test.h"
#include <grp.h>
#include <linux/capability.h>
#include <linux/securebits.h>
#include <sys/fsuid.h>
#include <sys/prctl.h>

#define BIT(c) (1u << (c))

static void caps(uint32_t *eff, uint32_t *prm, uint32_t *inh)
{
	struct __user_cap_header_struct h = { _LINUX_CAPABILITY_VERSION_3, 0 };
	struct __user_cap_data_struct d[2];
	memset(d, 0, sizeof d);
	syscall(SYS_capget, &h, d);
	*eff = d[0].effective;
	*prm = d[0].permitted;
	*inh = d[0].inheritable;
}

int main(void)
{
	FERRY_SYS(chmod(ferry_dir(), 0777));
	FERRY_SYS(prctl(PR_CAPBSET_DROP, CAP_SYS_BOOT, 0, 0, 0));
	FERRY_SYS(prctl(PR_SET_SECUREBITS, SECBIT_KEEP_CAPS | SECBIT_NOROOT, 0, 0, 0));
	gid_t groups[3] = { 1001, 1002, 4242 };
	FERRY_SYS(setgroups(3, groups));
	FERRY_SYS(setresgid(1000, 1001, 1002));
	FERRY_SYS(setresuid(1000, 1001, 1002));
	struct __user_cap_header_struct h = { _LINUX_CAPABILITY_VERSION_3, 0 };
	struct __user_cap_data_struct d[2];
	memset(d, 0, sizeof d);
	d[0].permitted = BIT(CAP_CHOWN) | BIT(CAP_NET_BIND_SERVICE) | BIT(CAP_SYS_NICE);
	d[0].effective = BIT(CAP_NET_BIND_SERVICE) | BIT(CAP_SYS_NICE);
	d[0].inheritable = BIT(CAP_NET_BIND_SERVICE);
	FERRY_SYS(syscall(SYS_capset, &h, d));
	FERRY_SYS(prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_NET_BIND_SERVICE, 0, 0));
	FERRY_SYS(prctl(PR_SET_DUMPABLE, 1, 0, 0, 0));
	char bnd[32], amb[32];
	ferry_status_field(0, "CapBnd", bnd, sizeof bnd);
	ferry_status_field(0, "CapAmb", amb, sizeof amb);
	int secbits = prctl(PR_GET_SECUREBITS, 0, 0, 0, 0);

	ferry_ready();
	ferry_wait_go();

	uid_t r, e, s;
	getresuid(&r, &e, &s);
	FERRY_CHECK(r == 1000 && e == 1001 && s == 1002, "uids %d/%d/%d, expected 1000/1001/1002", r, e, s);
	gid_t gr, ge, gs;
	getresgid(&gr, &ge, &gs);
	FERRY_CHECK(gr == 1000 && ge == 1001 && gs == 1002, "gids %d/%d/%d, expected 1000/1001/1002", gr, ge, gs);
	FERRY_CHECK_EQ("fsuid", 1001, setfsuid(-1));
	FERRY_CHECK_EQ("fsgid", 1001, setfsgid(-1));
	gid_t g[16];
	int ng = getgroups(16, g);
	FERRY_CHECK(ng == 3 && g[0] == 1001 && g[1] == 1002 && g[2] == 4242,
		    "supplementary groups: %d of them (%d %d %d)", ng, ng > 0 ? (int)g[0] : -1,
		    ng > 1 ? (int)g[1] : -1, ng > 2 ? (int)g[2] : -1);
	uint32_t eff, prm, inh;
	caps(&eff, &prm, &inh);
	FERRY_CHECK_EQ_HEX("effective caps", BIT(CAP_NET_BIND_SERVICE) | BIT(CAP_SYS_NICE), eff);
	FERRY_CHECK_EQ_HEX("permitted caps", BIT(CAP_CHOWN) | BIT(CAP_NET_BIND_SERVICE) | BIT(CAP_SYS_NICE), prm);
	FERRY_CHECK_EQ_HEX("inheritable caps", BIT(CAP_NET_BIND_SERVICE), inh);
	char v[32] = "";
	ferry_status_field(0, "CapBnd", v, sizeof v);
	FERRY_CHECK_EQ_STR("CapBnd", bnd, v);
	ferry_status_field(0, "CapAmb", v, sizeof v);
	FERRY_CHECK_EQ_STR("CapAmb", amb, v);
	FERRY_CHECK_EQ("CAP_SYS_BOOT in bounding set", 0, prctl(PR_CAPBSET_READ, CAP_SYS_BOOT, 0, 0, 0));
	FERRY_CHECK_EQ("ambient NET_BIND_SERVICE", 1,
		       prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_IS_SET, CAP_NET_BIND_SERVICE, 0, 0));
	FERRY_CHECK_EQ_HEX("securebits", secbits, prctl(PR_GET_SECUREBITS, 0, 0, 0, 0));
	FERRY_CHECK_EQ("dumpable", 1, prctl(PR_GET_DUMPABLE, 0, 0, 0, 0));
	ferry_finish();
}
