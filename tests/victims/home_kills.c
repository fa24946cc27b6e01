/* Signals sent from a process, by command: to its parent, a sibling, its process group, a
 * process it may not signal, one that does not exist, itself.
 *
 *   home_kills DIR
 *
 * Writes its PID to DIR/pid, then, each time a file DIR/askN appears (N = 1, 2, ...), runs the
 * command that file holds and appends "N RC ERRNO" to DIR/out (RC the call's return value).
 * Commands (PID: a number, or "ppid" for getppid(), or "self"):
 *   kill PID SIG          kill(PID, SIG)
 *   killpg SIG            kill(-getpgrp(), SIG)
 *   kill0 SIG             kill(0, SIG)
 *   tgkill PID SIG        tgkill(PID, PID, SIG)
 *   sigqueue PID SIG V    sigqueue(PID, SIG, V)
 *   loop PID COUNT        COUNT times kill(PID, 0); appends "N RC ERRNO NS" with NS the
 *                         nanoseconds per call
 *   setpgid PID PGID      setpgid(PID, PGID)
 *   setsid                setsid()
 *   fork                  forks a child that pauses until killed (RC is its PID)
 *   setuid UID            setresuid(UID, UID, UID)
 *   getppid, getpgrp, getsid  getppid(), getpgrp(), getsid(0) (RC is the parent, group or
 *                         session)
 * Each SIGUSR1 it receives appends a line "usr1" to DIR/sigs. On DIR/done it exits with 3.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t usr1;

static void on_usr1(int sig) {
    (void)sig;
    usr1++;
}

static const char *dir;

static int exists(const char *name) {
    char p[4096];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return access(p, F_OK) == 0;
}

static void append(const char *name, const char *line) {
    char p[4096];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "a");
    if (f) {
        fputs(line, f);
        fclose(f);
    }
}

static pid_t pid_of(const char *s) {
    if (strcmp(s, "ppid") == 0)
        return getppid();
    if (strcmp(s, "self") == 0)
        return getpid();
    return (pid_t)atoi(s);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: home_kills DIR\n");
        return 2;
    }
    dir = argv[1];
    struct sigaction sa = {.sa_handler = on_usr1, .sa_flags = SA_RESTART};
    sigaction(SIGUSR1, &sa, NULL);
    char p[4096], tmp[4096];
    snprintf(tmp, sizeof tmp, "%s/pid.tmp", dir);
    snprintf(p, sizeof p, "%s/pid", dir);
    FILE *f = fopen(tmp, "w");
    if (!f)
        return 1;
    fprintf(f, "%d", getpid());
    fclose(f);
    rename(tmp, p);
    int n = 1;
    int seen = 0;
    for (;;) {
        while (seen < usr1) {
            append("sigs", "usr1\n");
            seen++;
        }
        if (exists("done"))
            return 3;
        char ask[64];
        snprintf(ask, sizeof ask, "ask%d", n);
        if (!exists(ask)) {
            usleep(10000);
            continue;
        }
        snprintf(p, sizeof p, "%s/%s", dir, ask);
        char cmd[64] = "", a[64] = "", b[64] = "", c[64] = "";
        f = fopen(p, "r");
        if (!f || fscanf(f, "%63s %63s %63s %63s", cmd, a, b, c) < 1) {
            if (f)
                fclose(f);
            usleep(10000);
            continue;
        }
        fclose(f);
        long rc = 0;
        int err = 0;
        char line[256];
        errno = 0;
        if (strcmp(cmd, "kill") == 0) {
            rc = kill(pid_of(a), atoi(b));
        } else if (strcmp(cmd, "killpg") == 0) {
            rc = kill(-getpgrp(), atoi(a));
        } else if (strcmp(cmd, "kill0") == 0) {
            rc = kill(0, atoi(a));
        } else if (strcmp(cmd, "tgkill") == 0) {
            pid_t t = pid_of(a);
            rc = syscall(SYS_tgkill, t, t, atoi(b));
        } else if (strcmp(cmd, "sigqueue") == 0) {
            union sigval v = {.sival_int = atoi(c)};
            rc = sigqueue(pid_of(a), atoi(b), v);
        } else if (strcmp(cmd, "setpgid") == 0) {
            rc = setpgid(pid_of(a), atoi(b));
        } else if (strcmp(cmd, "setsid") == 0) {
            rc = setsid();
        } else if (strcmp(cmd, "getpgrp") == 0) {
            rc = getpgrp();
        } else if (strcmp(cmd, "setuid") == 0) {
            rc = setresuid(atoi(a), atoi(a), atoi(a));
        } else if (strcmp(cmd, "fork") == 0) {
            rc = fork();
            if (rc == 0) {
                for (;;)
                    pause();
            }
        } else if (strcmp(cmd, "getppid") == 0) {
            rc = getppid();
        } else if (strcmp(cmd, "getsid") == 0) {
            rc = getsid(0);
        } else if (strcmp(cmd, "loop") == 0) {
            pid_t t = pid_of(a);
            long count = atol(b);
            struct timespec t0, t1;
            clock_gettime(CLOCK_MONOTONIC, &t0);
            for (long i = 0; i < count && rc == 0; i++)
                rc = kill(t, 0);
            err = rc ? errno : 0;
            clock_gettime(CLOCK_MONOTONIC, &t1);
            long long ns = (t1.tv_sec - t0.tv_sec) * 1000000000LL + (t1.tv_nsec - t0.tv_nsec);
            snprintf(line, sizeof line, "%d %ld %d %lld\n", n, rc, err, ns / (count ? count : 1));
            append("out", line);
            n++;
            continue;
        } else {
            rc = -2;
        }
        err = rc < 0 ? errno : 0;
        snprintf(line, sizeof line, "%d %ld %d\n", n, rc, err);
        append("out", line);
        n++;
    }
}
