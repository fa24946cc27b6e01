"""A long computation with all its state in memory, checked against itself.

Run by crates/ferry/tests/real_programs.rs with cwd = a fresh directory T.
Protocol: writes its pid to T/ready once set up, prints "progress N" lines
(flushed) about four times a second while it works, and when T/go appears it
stops, recomputes everything from scratch and writes "PASS" or
"FAIL: <what>" to T/result (tmp + rename), then exits 0 or 1.

The state that must survive checkpoint/restore: Python objects of many kinds
(ints and big ints, a dict, a list, a bytearray), an OpenSSL SHA-256 context,
a Mersenne Twister generator, a zlib compressor, a generator frame.
"""

import hashlib
import os
import random
import sys
import time
import zlib

MOD = (1 << 61) - 1


def write_atomic(name, text):
    tmp = name + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, name)


def collatz_lengths():
    """A generator whose frame lives across checkpoints."""
    k = 1
    while True:
        x, steps = k, 0
        while x != 1:
            x = x // 2 if x % 2 == 0 else 3 * x + 1
            steps += 1
        yield k, steps
        k += 1


def collatz_len(k):
    steps = 0
    while k != 1:
        k = k // 2 if k % 2 == 0 else 3 * k + 1
        steps += 1
    return steps


def main():
    seed = 20240531
    rng = random.Random(seed)
    sha = hashlib.sha256()
    comp = zlib.compressobj(6)
    compressed = bytearray()
    n = 0
    sum_sq = 0
    fib_a, fib_b = 0, 1  # Fibonacci modulo MOD
    big = 1  # 3**n, a big int that keeps growing (bounded below)
    rand_xor = 0
    squares = {}
    collatz = collatz_lengths()
    collatz_seen = []
    write_atomic("ready", f"{os.getpid()}\n")
    last_print = 0.0
    while True:
        for _ in range(2000):
            n += 1
            sum_sq += n * n
            sha.update(n.to_bytes(8, "little"))
            fib_a, fib_b = fib_b, (fib_a + fib_b) % MOD
            rand_xor ^= rng.getrandbits(64)
            if n % 97 == 0:
                squares[n] = n * n
            if n % 1000 == 0:
                compressed += comp.compress(str(n).encode() * 10)
                collatz_seen.append(next(collatz))
            if n <= 20000:
                big *= 3
        now = time.monotonic()
        if now - last_print >= 0.25:
            print(f"progress {n}", flush=True)
            last_print = now
        if os.path.exists("go"):
            break

    errors = []
    if sum_sq != n * (n + 1) * (2 * n + 1) // 6:
        errors.append(f"sum of squares {sum_sq} != closed form for n={n}")
    sha2 = hashlib.sha256()
    for i in range(1, n + 1):
        sha2.update(i.to_bytes(8, "little"))
    if sha.hexdigest() != sha2.hexdigest():
        errors.append(f"sha256 {sha.hexdigest()} != recomputed {sha2.hexdigest()}")
    a, b = 0, 1
    for _ in range(n):
        a, b = b, (a + b) % MOD
    if (fib_a, fib_b) != (a, b):
        errors.append(f"fibonacci ({fib_a}, {fib_b}) != recomputed ({a}, {b})")
    rng2 = random.Random(seed)
    x = 0
    for _ in range(n):
        x ^= rng2.getrandbits(64)
    if x != rand_xor:
        errors.append(f"random stream xor {rand_xor:#x} != recomputed {x:#x}")
    # The generator must carry on from where it was.
    k, _ = next(collatz)
    if k != len(collatz_seen) + 1:
        errors.append(f"generator yielded k={k}, expected {len(collatz_seen) + 1}")
    for k, steps in collatz_seen:
        if collatz_len(k) != steps:
            errors.append(f"collatz({k}) = {steps}, expected {collatz_len(k)}")
            break
    if big != 3 ** min(n, 20000):
        errors.append("3**n big integer differs")
    expected_squares = {i: i * i for i in range(97, n + 1, 97)}
    if squares != expected_squares:
        errors.append(f"dict of {len(squares)} squares differs (expected {len(expected_squares)})")
    compressed += comp.flush()
    plain = b"".join(str(i).encode() * 10 for i in range(1000, n + 1, 1000))
    try:
        if zlib.decompress(bytes(compressed)) != plain:
            errors.append("zlib stream decompresses to something else")
    except zlib.error as e:
        errors.append(f"zlib stream is corrupt: {e}")
    print(f"verified n={n}", flush=True)
    verdict = "PASS" if not errors else "FAIL: " + "; ".join(errors)
    write_atomic("result", verdict + "\n")
    sys.exit(0 if not errors else 1)


if __name__ == "__main__":
    main()
