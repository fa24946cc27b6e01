/* A process for the early read of mappings (crates/ferry-engine/tests/premaps.rs): 64 MiB of
 * private anonymous memory, written, whose address it writes to DIR/addr; a thread started
 * before that waits for DIR/go, then gives the whole mapping ADVICE (a number; -1: nothing)
 * and writes DIR/done. It makes no other call that changes a mapping, then sleeps (its
 * threads never end). */
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static const char *dir;
static char *mem;
static int advice;
#define SIZE (64 << 20)

static void say(const char *name, const char *text) {
    char tmp[4096], path[4096];
    snprintf(tmp, sizeof tmp, "%s/%s.tmp", dir, name);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || write(fd, text, strlen(text)) < 0) _exit(2);
    close(fd);
    rename(tmp, path);
}

static void *act(void *arg) {
    (void)arg;
    char go[4096];
    snprintf(go, sizeof go, "%s/go", dir);
    struct timespec ts = {0, 10 * 1000 * 1000};
    while (access(go, F_OK) != 0) nanosleep(&ts, NULL);
    if (advice >= 0 && madvise(mem, SIZE, advice) != 0) _exit(3);
    say("done", "done\n");
    /* Never returns: glibc frees an ending thread's stack with madvise, a watched call. */
    for (;;) pause();
}

int main(int argc, char **argv) {
    if (argc != 3) return 1;
    dir = argv[1];
    advice = atoi(argv[2]);
    mem = mmap(NULL, SIZE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) return 1;
    memset(mem, 'x', SIZE);
    pthread_t t;
    if (pthread_create(&t, NULL, act, NULL) != 0) return 1;
    char text[64];
    snprintf(text, sizeof text, "%lx\n", (unsigned long)mem);
    say("addr", text);
    pthread_join(t, NULL);
    for (;;) pause();
}
