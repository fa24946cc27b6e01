"""Many Python threads working on shared state, checked for consistency.

Run by crates/ferry/tests/real_programs.rs with cwd = a fresh directory T.
Protocol: writes its pid to T/ready once all threads run, prints
"progress N" lines (flushed) while they work, and when T/go appears checks
that every thread still makes progress, stops them, joins them, checks the
shared state and writes "PASS" or "FAIL: <what>" to T/result.

Threads: workers that bump a lock-protected shared counter and hash their own
sequence; a producer and a consumer passing numbered items through a bounded
queue.Queue (condition variables: futex waits); a sleeper counting naps; a
chain of threading.Timer objects (each timer is a new thread).
"""

import hashlib
import os
import queue
import sys
import threading
import time

WORKERS = 8


def write_atomic(name, text):
    tmp = name + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, name)


lock = threading.Lock()
shared = {"count": 0}
per_worker = [0] * WORKERS
digests = [None] * WORKERS
stop = threading.Event()
q = queue.Queue(maxsize=64)
produced = [0]
consumed = [0]
consumer_errors = []
naps = [0]
timer_fires = [0]
timer_lock = threading.Lock()
errors = []


def worker(i):
    h = hashlib.sha256()
    local = 0
    while not stop.is_set():
        with lock:
            shared["count"] += 1
        local += 1
        per_worker[i] = local
        h.update(local.to_bytes(8, "little"))
        if local % 500 == 0:
            time.sleep(0.0005)
    digests[i] = (local, h.hexdigest())


def producer():
    seq = 0
    while not stop.is_set():
        try:
            q.put(seq, timeout=0.05)
        except queue.Full:
            continue
        seq += 1
        produced[0] = seq
    q.put(None)  # end marker


def consumer():
    expect = 0
    while True:
        item = q.get()
        if item is None:
            break
        if item != expect:
            consumer_errors.append(f"queue item {item}, expected {expect}")
            expect = item
        expect += 1
        consumed[0] = expect


def sleeper():
    while not stop.is_set():
        time.sleep(0.003)
        naps[0] += 1


def arm_timer():
    if stop.is_set():
        return
    t = threading.Timer(0.02, timer_fired)
    t.daemon = True
    t.start()


def timer_fired():
    with timer_lock:
        timer_fires[0] += 1
    arm_timer()


def snapshot():
    return {
        "shared": shared["count"],
        "produced": produced[0],
        "consumed": consumed[0],
        "naps": naps[0],
        "timers": timer_fires[0],
        **{f"worker{i}": per_worker[i] for i in range(WORKERS)},
    }


def main():
    threads = [threading.Thread(target=worker, args=(i,), name=f"worker{i}") for i in range(WORKERS)]
    threads += [
        threading.Thread(target=producer, name="producer"),
        threading.Thread(target=consumer, name="consumer"),
        threading.Thread(target=sleeper, name="sleeper"),
    ]
    for t in threads:
        t.start()
    arm_timer()
    while min(per_worker) == 0 or consumed[0] == 0 or naps[0] == 0 or timer_fires[0] == 0:
        time.sleep(0.001)
    write_atomic("ready", f"{os.getpid()}\n")
    last_print = 0.0
    while not os.path.exists("go"):
        time.sleep(0.005)
        now = time.monotonic()
        if now - last_print >= 0.25:
            print(f"progress {shared['count']}", flush=True)
            last_print = now

    # Every thread must still be making progress.
    before = snapshot()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = snapshot()
        if all(now[k] > before[k] for k in before):
            break
    stuck = [k for k in before if now[k] <= before[k]]
    if stuck:
        errors.append(f"no progress in 5 s after go: {stuck} (before {before}, after {now})")

    stop.set()
    for t in threads:
        t.join(timeout=10)
        if t.is_alive():
            errors.append(f"thread {t.name} did not stop within 10 s")
    if not errors:
        if sum(per_worker) != shared["count"]:
            errors.append(f"workers counted {sum(per_worker)} in all, shared counter says {shared['count']}")
        for i, d in enumerate(digests):
            local, hexd = d
            h = hashlib.sha256()
            for k in range(1, local + 1):
                h.update(k.to_bytes(8, "little"))
            if h.hexdigest() != hexd or local != per_worker[i]:
                errors.append(f"worker{i}: digest of {local} steps differs")
        if consumed[0] != produced[0]:
            errors.append(f"consumer got {consumed[0]} items, producer put {produced[0]}")
        errors.extend(consumer_errors[:5])
    print(f"verified {snapshot()}", flush=True)
    verdict = "PASS" if not errors else "FAIL: " + "; ".join(errors)
    write_atomic("result", verdict + "\n")
    sys.stdout.flush()
    os._exit(0 if not errors else 1)


if __name__ == "__main__":
    main()
