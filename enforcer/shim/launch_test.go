package shim_test

import (
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/enforcer/region"
)

// slotFor waits until pid has attached and returns its slot.
func (s *testServer) slotFor(t *testing.T, pid int) *region.Proc {
	t.Helper()
	var p *region.Proc
	eventually(t, "pid "+strconv.Itoa(pid)+" to attach", func() bool { p = s.slotOf(pid); return p != nil })
	return p
}

// Launches block while the grant is 0 and proceed once it is set; the time
// spent waiting is accounted.
func TestGrantGatesLaunches(t *testing.T) {
	t.Parallel()
	for _, asan := range []bool{false, true} {
		t.Run(fmt.Sprintf("asan=%v", asan), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			e.asan = asan
			s := newServer(t, e.run, 0)
			s.setGrant(0)
			c, _, se := e.bg(workload, "compute", "--kernel-us", "200", "--depth", "2", "--seconds", "0.3")
			p := s.slotFor(t, c.Process.Pid)
			eventually(t, "a launch to wait for the grant", func() bool { return p.Waiting.Load() == 1 })
			t0 := time.Now()
			for time.Since(t0) < 100*time.Millisecond {
				if n := p.Launches.Load(); n != 0 {
					t.Fatalf("%d launches went through without a grant", n)
				}
				time.Sleep(5 * time.Millisecond)
			}
			blocked := time.Since(t0)
			s.setGrant(1)
			if err := c.Wait(); err != nil {
				t.Fatalf("workload: %v\n%s", err, se)
			}
			if p.Waiting.Load() != 0 || p.Launches.Load() == 0 {
				t.Fatalf("after the grant: waiting %d launches %d", p.Waiting.Load(), p.Launches.Load())
			}
			if th := time.Duration(p.ThrottledNs.Load()); th < blocked {
				t.Fatalf("throttled_ns %v < the %v the launch was blocked", th, blocked)
			}
		})
	}
}

// gpu_ns is the busy time fakecuda measured for the process, within 3 %,
// whatever the launch API, stream layout and kernel length.
func TestGPUTimeMatchesDevice(t *testing.T) {
	t.Parallel()
	// exact: GPU time within 3 % of fakecuda's busy time (streams of one
	// process too: fakecuda counts the device passing between them as the
	// process's).  Otherwise (20 µs kernels) fakecuda's dispatch gaps
	// between back-to-back kernels (µs each) count as GPU time: gpu_ns must
	// still lie between the busy time and the wall time (no double counting).
	cases := []struct {
		name  string
		args  []string
		asan  bool
		exact bool
	}{
		{"launch-500us", []string{"--api", "launch", "--kernel-us", "500", "--depth", "4"}, false, true},
		{"launchex-2streams-2threads-500us", []string{"--api", "launchex", "--kernel-us", "500", "--depth", "4",
			"--streams", "2", "--threads", "2"}, false, true},
		{"coop-null-stream", []string{"--api", "coop", "--kernel-us", "200", "--null-stream"}, false, true},
		{"graph-ptsz", []string{"--ptsz", "compute", "--api", "graph", "--kernel-us", "100", "--graph-nodes", "4",
			"--null-stream"}, false, true},
		{"asan-launch-500us", []string{"--api", "launch", "--kernel-us", "500", "--depth", "4"}, true, true},
		{"launch-20us", []string{"--api", "launch", "--kernel-us", "20", "--depth", "8"}, false, false},
		{"launch-100us-2streams-2threads", []string{"--api", "launch", "--kernel-us", "100", "--depth", "4",
			"--streams", "2", "--threads", "2"}, false, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			e.asan = tc.asan
			s := newServer(t, e.run, 0, withMaxQueued(50e6))
			args := append([]string{"compute", "--seconds", "0.4"}, tc.args...)
			if tc.args[0] == "--ptsz" {
				args = append([]string{"--ptsz"}, append([]string{"compute", "--seconds", "0.4"}, tc.args[2:]...)...)
			}
			c, lines, se := e.bg(workload, args...)
			pid := c.Process.Pid
			p := s.slotFor(t, pid)
			wall := u64(t, kv(waitLine(t, lines, "launches=")), "wall_ns")
			if err := c.Wait(); err != nil {
				t.Fatalf("workload: %v\n%s", err, se)
			}
			st := e.fcstat()
			busy, kern := st.busyOf(pid), st.kernelOf(pid)
			gpu := p.GPUNs.Load()
			t.Logf("%s: wall %v, fakecuda held %v, kernels %v, gpu_ns %v, launches %d, queued_ns %d", tc.name, time.Duration(wall),
				time.Duration(busy), time.Duration(kern), time.Duration(gpu), p.Launches.Load(), p.QueuedNs.Load())
			if kern < 100e6 {
				t.Fatalf("fakecuda kernels ran only %v", time.Duration(kern))
			}
			// Event timing sees the kernels and the gaps between them: it
			// lies between the kernels' own time and the time the process
			// held the device (exact cases), or the wall time.
			lo, hi := 0.97*float64(kern), 1.03*float64(busy)
			if !tc.exact {
				hi = 1.03 * float64(wall)
			}
			if float64(gpu) < lo || float64(gpu) > hi {
				t.Fatalf("gpu_ns %d outside [%.0f, %.0f] (kernels %d, held %d, wall %d)", gpu, lo, hi, kern, busy, wall)
			}
			if q := p.QueuedNs.Load(); q != 0 {
				t.Fatalf("queued_ns %d after the process synchronised and exited", q)
			}
			if n := len(s.claimedPids()); n != 1 {
				t.Fatalf("%d slots for one process", n)
			}
		})
	}
}

// queued_ns stays within max_queued_ns however deep the application queues,
// and when the grant is revoked what is queued finishes within about that
// bound.
func TestQueueBound(t *testing.T) {
	t.Parallel()
	const bound = 4e6 // ns
	e := newEnv(t)
	s := newServer(t, e.run, 0, withMaxQueued(bound))
	// 1 ms kernels, 64 in flight allowed by the application: 64 ms unbounded.
	c, _, se := e.bg(workload, "compute", "--kernel-us", "1000", "--depth", "64", "--seconds", "0.6")
	p := s.slotFor(t, c.Process.Pid)
	eventually(t, "launches", func() bool { return p.Launches.Load() > 50 })
	maxQ := maxQueuedOver(p, 150*time.Millisecond)
	// The estimate is what is bounded; a launch is always admitted when
	// nothing is outstanding, and kernel times jitter on a loaded machine.
	if maxQ > bound*5/4 {
		t.Fatalf("queued_ns reached %v, bound %v\n%s", time.Duration(maxQ), time.Duration(bound), se)
	}
	if maxQ == 0 {
		t.Fatalf("queued_ns never rose")
	}
	// Revoke: the queue drains; no new work is submitted.  Measured on the
	// device: b0 is read before the revocation, so b1-b0 over-states the
	// over-run by at most the GPU time of the read itself (<= its wall time).
	pid := c.Process.Pid
	l0 := p.Launches.Load()
	t1 := time.Now()
	b0 := e.fcstat().kernelOf(pid) // kernel time: the work that ran, without the device's gaps
	s.setGrant(0)
	read := time.Since(t1)
	eventually(t, "a launch to wait", func() bool { return p.Waiting.Load() > 0 })
	eventually(t, "the queue to drain", func() bool { return p.QueuedNs.Load() == 0 })
	var b1 uint64
	eventually(t, "the device to go idle", func() bool {
		b := e.fcstat().kernelOf(pid)
		idle := b == b1
		b1 = b
		return idle
	})
	over := time.Duration(b1-b0) - read
	t.Logf("max queued_ns %v; after revocation: %v of GPU work (bound %v), launches %d -> %d", time.Duration(maxQ),
		over, time.Duration(bound), l0, p.Launches.Load())
	// The bound plus the kernel running at the revocation (and jitter): a
	// launch that waits for room in the queue when the grant goes is taken
	// back and waits for the next grant.
	if over > bound+2e6 {
		t.Fatalf("%v of GPU work ran after the grant was revoked (bound %v)", over, time.Duration(bound))
	}
	s.setGrant(1)
	if err := c.Wait(); err != nil {
		t.Fatalf("workload: %v\n%s", err, se)
	}
}

// The region's wake word: a process that is asked to wakes the enforcer
// (a datagram on the instance's wake socket) when its queue rises from
// empty (MGPU_WAKE_BUSY) and when it empties (MGPU_WAKE_IDLE), and stamps
// idle_ns when it empties; asked nothing, it sends nothing. Each request
// of the server starts on an idle device and ends with its queue empty.
func TestWakeWord(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	s := newServer(t, e.run, 0)
	for _, tc := range []struct {
		name string
		word uint32
		per  int // wake-ups per request, at least
	}{
		{"nothing asked", 0, 0},
		{"busy", region.WakeBusy, 1},
		{"busy and idle", region.WakeBusy | region.WakeIdle, 2},
	} {
		s.reg.L().Wake.Store(tc.word)
		s.wakes()
		c, lines, se := e.bg(workload, "serve", "--kernel-us", "100", "--burst", "4", "--period-ms", "10", "--seconds", "0.3")
		p := s.slotFor(t, c.Process.Pid)
		m := kv(waitLine(t, lines, "requests="))
		if err := c.Wait(); err != nil {
			t.Fatalf("workload: %v\n%s", err, se)
		}
		requests, n := int(u64(t, m, "requests")), s.wakes() //nolint:gosec // a few dozen
		t.Logf("%s: %d wake-ups for %d requests", tc.name, n, requests)
		if n < tc.per*requests || (tc.per == 0 && n != 0) || n > 2*(tc.per+1)*requests {
			t.Errorf("%s: %d wake-ups for %d requests, want %d per request (and not many more)", tc.name, n, requests, tc.per)
		}
		if p.IdleNs.Load() == 0 {
			t.Errorf("%s: idle_ns not stamped", tc.name)
		}
	}
}

// Granted MGPU_GRANT_ONE, a process keeps one kernel in flight per stream
// however deep the application queues: an online instance that wakes finds
// one kernel ahead of its own.
func TestGrantOne(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	s := newServer(t, e.run, 0, withMaxQueued(4e6))
	s.setGrant(region.GrantOne)
	c, _, se := e.bg(workload, "compute", "--kernel-us", "500", "--depth", "16", "--seconds", "0.5")
	p := s.slotFor(t, c.Process.Pid)
	eventually(t, "launches", func() bool { return p.Launches.Load() > 20 })
	maxQ := maxQueuedOver(p, 150*time.Millisecond)
	if err := c.Wait(); err != nil {
		t.Fatalf("workload: %v\n%s", err, se)
	}
	t.Logf("max queued_ns %v with 500 µs kernels", time.Duration(maxQ))
	// One launch outstanding is one kernel's estimate; two would be 1 ms.
	if maxQ == 0 || maxQ > 800e3 {
		t.Fatalf("queued_ns reached %v, want one 500 µs kernel", time.Duration(maxQ))
	}
}

// maxQueuedOver samples a process's queued_ns every 100 µs for d and
// returns the largest value.
func maxQueuedOver(p *region.Proc, d time.Duration) uint64 {
	var maxQ uint64
	for t0 := time.Now(); time.Since(t0) < d; {
		maxQ = max(maxQ, p.QueuedNs.Load())
		time.Sleep(100 * time.Microsecond)
	}
	return maxQ
}
