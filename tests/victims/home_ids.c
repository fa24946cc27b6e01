/* What a process sees of where it is: its parent, process group, session and host name.
 *
 *   home_ids DIR
 *
 * Installs a seccomp filter of its own first (no_new_privs, then getpriority fails with
 * EACCES), writes its PID to DIR/pid, and then, each time a file DIR/askN appears (N = 1, 2,
 * ...), appends to DIR/ids the line
 *   N ppid=.. pgrp=.. pgid=.. sid=.. sid_self=.. host=.. own=..
 * (own: the errno of getpriority, 13 while its own filter acts). On DIR/done it exits with 5.
 * Each SIGUSR1 it receives appends "si_code si_pid si_value" to DIR/sigs.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/utsname.h>
#include <unistd.h>

static volatile sig_atomic_t got;
static volatile int got_code, got_pid, got_value;

static void on_usr1(int sig, siginfo_t *si, void *uc) {
    (void)sig;
    (void)uc;
    got_code = si->si_code;
    got_pid = si->si_pid;
    got_value = si->si_value.sival_int;
    got = 1;
}

static int exists(const char *dir, const char *name) {
    char p[4096];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return access(p, F_OK) == 0;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: home_ids DIR\n");
        return 2;
    }
    const char *dir = argv[1];
    struct sigaction sa = {.sa_sigaction = on_usr1, .sa_flags = SA_SIGINFO | SA_RESTART};
    sigaction(SIGUSR1, &sa, NULL);
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_getpriority, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EACCES),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {.len = sizeof f / sizeof f[0], .filter = f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog)) {
        perror("own seccomp filter");
        return 3;
    }
    char p[4096], tmp[4096];
    snprintf(p, sizeof p, "%s/pid", dir);
    snprintf(tmp, sizeof tmp, "%s/pid.tmp", dir);
    FILE *pf = fopen(tmp, "w");
    fprintf(pf, "%d", getpid());
    fclose(pf);
    rename(tmp, p);
    for (int n = 1;; ) {
        char ask[32];
        snprintf(ask, sizeof ask, "ask%d", n);
        if (exists(dir, ask)) {
            struct utsname u;
            uname(&u);
            errno = 0;
            getpriority(PRIO_PROCESS, 0);
            int own = errno;
            snprintf(p, sizeof p, "%s/ids", dir);
            FILE *o = fopen(p, "a");
            fprintf(o, "%d ppid=%d pgrp=%d pgid=%d sid=%d sid_self=%d host=%s own=%d\n", n,
                    (int)syscall(SYS_getppid), (int)syscall(SYS_getpgrp),
                    (int)syscall(SYS_getpgid, 0), (int)syscall(SYS_getsid, 0),
                    (int)syscall(SYS_getsid, getpid()), u.nodename, own);
            fclose(o);
            n++;
        }
        if (got) {
            got = 0;
            snprintf(p, sizeof p, "%s/sigs", dir);
            FILE *o = fopen(p, "a");
            fprintf(o, "%d %d %d\n", got_code, got_pid, got_value);
            fclose(o);
        }
        if (exists(dir, "done"))
            return 5;
        usleep(10000);
    }
}
