// go-ticker: goroutines, tickers, timers and channels, checked for
// consistency after being checkpointed and restored.
//
// Run by crates/ferry/tests/real_programs.rs with cwd = a fresh directory T.
// Protocol: writes its pid to T/ready once every goroutine has run, prints
// "progress N" lines while it works, and when T/go appears checks that every
// kind of timer still fires, stops everything, checks the shared state and
// writes "PASS" or "FAIL: <what>" to T/result, then exits 0 or 1.
package main

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"os"
	"runtime"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

const workers = 16

type tick struct {
	worker int
	seq    uint64
	chain  [32]byte
}

// next is the hash chain each worker extends on every tick.
func next(prev [32]byte, worker int, seq uint64) [32]byte {
	var buf [48]byte
	copy(buf[:32], prev[:])
	binary.LittleEndian.PutUint64(buf[32:], uint64(worker))
	binary.LittleEndian.PutUint64(buf[40:], seq)
	return sha256.Sum256(buf[:])
}

func writeAtomic(name, text string) {
	tmp := name + ".tmp"
	if err := os.WriteFile(tmp, []byte(text), 0o644); err != nil {
		fmt.Fprintln(os.Stderr, "write", tmp, err)
		os.Exit(2)
	}
	if err := os.Rename(tmp, name); err != nil {
		fmt.Fprintln(os.Stderr, "rename", tmp, err)
		os.Exit(2)
	}
}

func exists(name string) bool {
	_, err := os.Stat(name)
	return err == nil
}

type counters struct {
	ticks     [workers]atomic.Uint64
	received  atomic.Uint64
	afterFunc atomic.Uint64
	sleeps    atomic.Uint64
	gcs       atomic.Uint64
}

func (c *counters) snapshot() map[string]uint64 {
	m := map[string]uint64{
		"received":  c.received.Load(),
		"afterfunc": c.afterFunc.Load(),
		"sleeps":    c.sleeps.Load(),
		"gc":        c.gcs.Load(),
	}
	for i := range c.ticks {
		m[fmt.Sprintf("worker%02d", i)] = c.ticks[i].Load()
	}
	return m
}

func main() {
	var c counters
	var errMu sync.Mutex
	var errs []string
	fail := func(format string, args ...any) {
		errMu.Lock()
		defer errMu.Unlock()
		if len(errs) < 20 {
			errs = append(errs, fmt.Sprintf(format, args...))
		}
	}

	stop := make(chan struct{})
	results := make(chan tick, 256)
	var wg sync.WaitGroup

	// Workers: each on its own ticker, extending a hash chain and reporting
	// every step on a shared channel.
	var lastMu sync.Mutex
	last := map[int]uint64{}
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			t := time.NewTicker(time.Duration(1+w%5) * time.Millisecond)
			defer t.Stop()
			var chain [32]byte
			var seq uint64
			for {
				select {
				case <-t.C:
					seq++
					chain = next(chain, w, seq)
					c.ticks[w].Add(1)
					lastMu.Lock()
					last[w] = seq
					lastMu.Unlock()
					select {
					case results <- tick{w, seq, chain}:
					case <-stop:
						return
					}
				case <-stop:
					return
				}
			}
		}(w)
	}

	// The aggregator checks every worker's steps arrive in order and
	// recomputes each chain.
	aggDone := make(chan map[int]uint64)
	go func() {
		seen := map[int]uint64{}
		chains := map[int][32]byte{}
		for r := range results {
			if r.seq != seen[r.worker]+1 {
				fail("worker %d: step %d arrived after step %d", r.worker, r.seq, seen[r.worker])
			}
			want := next(chains[r.worker], r.worker, r.seq)
			if want != r.chain {
				fail("worker %d: hash chain differs at step %d", r.worker, r.seq)
			}
			seen[r.worker] = r.seq
			chains[r.worker] = r.chain
			c.received.Add(1)
		}
		aggDone <- seen
	}()

	// A self-rearming time.AfterFunc.
	var rearm func()
	var afterMu sync.Mutex
	stopped := false
	rearm = func() {
		c.afterFunc.Add(1)
		afterMu.Lock()
		defer afterMu.Unlock()
		if !stopped {
			time.AfterFunc(7*time.Millisecond, rearm)
		}
	}
	time.AfterFunc(7*time.Millisecond, rearm)

	// A sleeper, and a garbage producer that keeps the collector busy.
	wg.Add(2)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			time.Sleep(3 * time.Millisecond)
			c.sleeps.Add(1)
		}
	}()
	keep := make(map[int]string)
	for i := 0; i < 100000; i++ {
		keep[i] = strings.Repeat(fmt.Sprint(i%10), 1+i%13)
	}
	go func() {
		defer wg.Done()
		var junk [][]byte
		for {
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
			}
			for i := 0; i < 200; i++ {
				junk = append(junk, make([]byte, 4096))
			}
			if len(junk) > 2000 {
				junk = nil
				runtime.GC()
				c.gcs.Add(1)
			}
		}
	}()

	start := time.Now()
	for {
		s := c.snapshot()
		ok := true
		for k, v := range s {
			if v == 0 && k != "gc" {
				ok = false
			}
		}
		if ok {
			break
		}
		time.Sleep(time.Millisecond)
	}
	writeAtomic("ready", fmt.Sprintf("%d\n", os.Getpid()))

	progress := time.NewTicker(250 * time.Millisecond)
	for !exists("go") {
		select {
		case <-progress.C:
			fmt.Printf("progress %d\n", c.received.Load())
		case <-time.After(5 * time.Millisecond):
		}
	}
	progress.Stop()

	// Every timer must still fire and every goroutine make progress.
	before := c.snapshot()
	deadline := time.Now().Add(5 * time.Second)
	var stuck []string
	for {
		time.Sleep(20 * time.Millisecond)
		now := c.snapshot()
		stuck = stuck[:0]
		for k, v := range before {
			if k != "gc" && now[k] <= v {
				stuck = append(stuck, k)
			}
		}
		if len(stuck) == 0 || time.Now().After(deadline) {
			break
		}
	}
	if len(stuck) > 0 {
		sort.Strings(stuck)
		fail("no progress in 5 s after go: %v", stuck)
	}
	if el := time.Since(start); el <= 0 || el > time.Hour {
		fail("monotonic clock: %v since start", el)
	}

	afterMu.Lock()
	stopped = true
	afterMu.Unlock()
	close(stop)
	waited := make(chan struct{})
	go func() { wg.Wait(); close(waited) }()
	select {
	case <-waited:
	case <-time.After(10 * time.Second):
		fail("goroutines did not stop within 10 s")
	}
	close(results)
	seen := <-aggDone
	lastMu.Lock()
	var total uint64
	for w := 0; w < workers; w++ {
		// A worker may have made a step it could not send after stop.
		if got, made := seen[w], last[w]; got != made && got+1 != made {
			fail("worker %d made %d steps, the aggregator saw %d", w, made, got)
		}
		total += seen[w]
	}
	lastMu.Unlock()
	if total != c.received.Load() {
		fail("aggregator counted %d, sum of steps is %d", c.received.Load(), total)
	}
	for i := 0; i < 100000; i++ {
		if keep[i] != strings.Repeat(fmt.Sprint(i%10), 1+i%13) {
			fail("map entry %d differs", i)
			break
		}
	}
	fmt.Printf("verified %v\n", c.snapshot())
	if len(errs) > 0 {
		writeAtomic("result", "FAIL: "+strings.Join(errs, "; ")+"\n")
		os.Exit(1)
	}
	writeAtomic("result", "PASS\n")
}
