package enforcer

import (
	"math"
	"math/rand/v2"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/enforcer/attach"
	"github.com/mgpu-dev/mgpu/enforcer/region"
)

// slotFor returns a counters slot backed by plain memory.
func slotFor() region.Proc { return region.Proc{Slot: &region.Slot{}, Counters: &region.Counters{}} }

func TestSaneCounters(t *testing.T) {
	t.Parallel()
	const ms = time.Millisecond
	const qcap = 8e6
	for _, tc := range []struct {
		name    string
		trusted bool
		steps   []func(p region.Proc) // one per read, 10 ms apart
		gpu     uint64                // accepted GPU ns after the last read
		why     string                // in the reason of some read ("" = none)
	}{
		{name: "honest growth", steps: []func(region.Proc){
			func(p region.Proc) { p.GPUNs.Store(1e6) },
			func(p region.Proc) { p.GPUNs.Store(9e6) },
			func(p region.Proc) { p.GPUNs.Store(19e6) },
		}, gpu: 19e6},
		{name: "backwards is re-baselined", steps: []func(region.Proc){
			func(p region.Proc) { p.GPUNs.Store(5e6) },
			func(p region.Proc) { p.GPUNs.Store(1e6) },
			func(p region.Proc) { p.GPUNs.Store(3e6) },
		}, gpu: 7e6, why: "gpu_ns went backwards"},
		{name: "a jump is capped at the wall-time bound", steps: []func(region.Proc){
			func(p region.Proc) { p.GPUNs.Store(1e6) },
			func(p region.Proc) { p.GPUNs.Store(1e15) },
		}, gpu: gpuRate*uint64(10*ms) + gpuSlack, why: "gpu_ns grew faster than wall time allows"},
		{name: "all ones neither overflows nor wraps", steps: []func(region.Proc){
			func(p region.Proc) { p.GPUNs.Store(math.MaxUint64); p.Launches.Store(math.MaxUint64) },
			func(p region.Proc) { p.GPUNs.Store(math.MaxUint64) },
			func(p region.Proc) { p.GPUNs.Store(0) },
			func(p region.Proc) { p.GPUNs.Store(math.MaxUint64) },
		}, gpu: gpuRate*uint64(30*ms) + gpuSlack, why: "went backwards"},
		{name: "queued out of range", steps: []func(region.Proc){
			func(p region.Proc) { p.QueuedNs.Store(1 << 62) },
		}, why: "queued_ns out of range"},
		{name: "waiting out of range", steps: []func(region.Proc){
			func(p region.Proc) { p.Waiting.Store(math.MaxUint32) },
		}, why: "waiting out of range"},
		{name: "a restored slot keeps what it had and grows as usual", trusted: true, steps: []func(region.Proc){
			func(p region.Proc) { p.GPUNs.Store(3600e9) },
			func(p region.Proc) { p.GPUNs.Store(3600e9 + 9e6) },
		}, gpu: 3600e9 + 9e6},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := slotFor()
			s := sane{trusted: tc.trusted}
			var whys []string
			var c counts
			for i, step := range tc.steps {
				step(p)
				var why oddity
				c, why = s.read(p, time.Second+time.Duration(i)*10*ms, qcap)
				if why != 0 {
					whys = append(whys, why.String())
				}
				if c.gpu > satCap || c.launches > satCap || c.queued > qcap {
					t.Fatalf("read %d: out of bounds %+v", i, c)
				}
			}
			if tc.why == "" && len(whys) > 0 || tc.why != "" && !strings.Contains(strings.Join(whys, "|"), tc.why) {
				t.Fatalf("reasons %q, want %q", whys, tc.why)
			}
			if (tc.name != "queued out of range" && tc.name != "waiting out of range") && c.gpu != tc.gpu {
				t.Fatalf("accepted gpu %d, want %d", c.gpu, tc.gpu)
			}
		})
	}
}

// FuzzSaneCounters: whatever a process writes, in any order, the accepted
// totals never decrease (launches by at most a take-back), never exceed the wall-time bound, and the sums
// the arbiter sees stay positive.
func FuzzSaneCounters(f *testing.F) {
	f.Add(uint64(0), uint64(0), uint64(0), uint64(0), uint64(1))
	f.Add(uint64(math.MaxUint64), uint64(1), uint64(math.MaxUint64), uint64(7), uint64(99))
	f.Fuzz(func(t *testing.T, a, b, c, d, seed uint64) {
		p := slotFor()
		s := sane{}
		r := rand.New(rand.NewPCG(seed, a))
		var last counts
		for i := range 64 {
			vals := []uint64{a, b, c, d, r.Uint64(), a + uint64(i)}
			p.GPUNs.Store(vals[r.IntN(len(vals))])
			p.Launches.Store(vals[r.IntN(len(vals))])
			p.ThrottledNs.Store(vals[r.IntN(len(vals))])
			p.QueuedNs.Store(vals[r.IntN(len(vals))])
			p.MemReserved.Store(vals[r.IntN(len(vals))])
			now := time.Duration(i) * time.Millisecond
			got, _ := s.read(p, now, 1e6)
			// Launches may fall by a take-back, nothing else ever falls.
			if got.gpu < last.gpu || got.launches+launchTakeBack < last.launches || got.throttled < last.throttled {
				t.Fatalf("read %d went backwards: %+v after %+v", i, got, last)
			}
			if got.gpu > gpuRate*uint64(now)+gpuSlack || got.queued > 1e6 || got.mem > satCap {
				t.Fatalf("read %d beyond its bounds: %+v", i, got)
			}
			if clampDuration(sat(got.gpu, satCap)) < 0 {
				t.Fatal("negative duration")
			}
			last = got
		}
	})
}

// TestNonsenseCounters: a process that writes garbage into its own slot
// leaves the enforcer serving, its neighbour's grant working and the
// instance totals bounded; the enforcer says so once, naming the instance.
// selfAndNeighbour gives this process an instance (mgpu0inst0, core 40) and
// attaches it, and attaches a helper process to an instance of its own
// (mgpu0inst1, core 30): it returns this process's slot and the neighbour's
// region.
func selfAndNeighbour(t *testing.T, env *testEnv) (region.Proc, *region.Region) {
	t.Helper()
	c := env.client()
	if _, err := c.Create(ctx, tree(os.Getpid(), 40, 2048)); err != nil {
		t.Fatal(err)
	}
	res, err := attach.Dial(api.ClientSocket(env.runDir()), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	_, p := mapAttach(t, res)
	h := startHelper(t, api.ClientSocket(env.runDir()), nil)
	if _, err := c.Create(ctx, tree(h.cmd.Process.Pid, 30, 10)); err != nil {
		t.Fatal(err)
	}
	if line := h.attach(t); line != "ok slot=0 instance=1" {
		t.Fatalf("helper: %s", line)
	}
	return p, openRegion(t, env.runDir()+"/regions/mgpu0inst1")
}

func TestNonsenseCounters(t *testing.T) {
	env := newEnv(t, nil)
	logs := env.startLogged(t)
	p, nb := selfAndNeighbour(t, env)
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		r := rand.New(rand.NewPCG(1, 2))
		for {
			select {
			case <-stop:
				return
			default:
			}
			p.GPUNs.Store(r.Uint64())
			p.Launches.Store(r.Uint64())
			p.QueuedNs.Store(r.Uint64())
			p.ThrottledNs.Store(r.Uint64())
			p.MemReserved.Store(r.Uint64())
			p.Waiting.Store(r.Uint32())
		}
	}()
	time.Sleep(300 * time.Millisecond) // garbage for a while (no condition to wait for: it must just not matter)
	close(stop)
	<-done
	stats, err := env.client().Stats(ctx)
	if err != nil {
		t.Fatalf("the enforcer stopped answering: %v", err)
	}
	for _, s := range stats {
		if s.GPUNs > satCap || s.QueuedNs > satCap || s.Launches > satCap || s.GPUNs > gpuRate*uint64(time.Minute) {
			t.Fatalf("%s: totals out of bounds %+v", s.Name, s)
		}
	}
	if n := strings.Count(logs.String(), "reports counters out of range"); n != 1 || !strings.Contains(logs.String(), "instance=mgpu0inst0") {
		t.Fatalf("%d warnings, want 1 naming mgpu0inst0:\n%s", n, logs.String())
	}
	for _, line := range strings.Split(logs.String(), "\n") {
		if strings.Contains(line, "out of range") && strings.Contains(line, "instance=mgpu0inst1") {
			t.Fatalf("the neighbour was blamed: %s", line)
		}
	}
	// The neighbour still gets the grant when it waits.
	nb.Proc(0).Waiting.Store(1)
	eventually(t, 5*time.Second, "the neighbour's grant", func() bool { return nb.L().Grant.Load() != 0 })
}

// TestUnheldQueuedIsNoWork: a process reporting queued work while its
// instance never held the grant has submitted nothing (the shim submits only
// under the grant), so another instance's batches are not marked as shared
// with it (Contended stays 0), or the neighbour would be timed by its clean
// estimate and run over its share.
func TestUnheldQueuedIsNoWork(t *testing.T) {
	env := newEnv(t, nil)
	env.start(t)
	p, nb := selfAndNeighbour(t, env)
	p.QueuedNs.Store(uint64(time.Millisecond)) // in range, never waited for a grant
	nb.Proc(0).Waiting.Store(1)
	eventually(t, 5*time.Second, "the neighbour's grant", func() bool { return nb.L().Grant.Load() != 0 })
	// Contended is written before the grant, in the same tick.
	if v := nb.L().Contended.Load(); v != 0 {
		t.Fatalf("the holder's contended word is %d beside an instance that never held the grant", v)
	}
}

// TestSaneLaunchesTakenBack: the shim takes back a launch's count when the
// grant went while it waited; that is not a counter going backwards.
func TestSaneLaunchesTakenBack(t *testing.T) {
	t.Parallel()
	p := slotFor()
	s := sane{}
	for i, v := range []uint64{2000, 1998, 2001, 2001 - launchTakeBack - 1} {
		p.Launches.Store(v)
		c, odd := s.read(p, time.Second+time.Duration(i)*time.Millisecond, 1e6)
		why := odd.String()
		switch {
		case i < 3 && (why != "" || c.launches != v):
			t.Fatalf("read %d: launches %d (%q), want %d", i, c.launches, why, v)
		case i == 3 && (!strings.Contains(why, "launches went backwards") || c.launches != 2001):
			t.Fatalf("a fall beyond the take-back bound: %d (%q)", c.launches, why)
		}
	}
}
