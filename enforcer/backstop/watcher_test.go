package backstop

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestMemory(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		allowance uint64
		allowCap  int // 0: the default
		procs     []Process
		dead      []int // listed by the driver, exited
		want      bool
		used      uint64
		limit     uint64
	}{
		{name: "under quota", procs: []Process{{PID: 10, UsedMemory: 512 * mib}}},
		{name: "exactly at quota", procs: []Process{{PID: 10, UsedMemory: 1024 * mib}}},
		{name: "one byte over", procs: []Process{{PID: 10, UsedMemory: 1024*mib + 1}}, want: true, used: 1024*mib + 1, limit: 1024 * mib},
		{name: "sum over processes", procs: []Process{{PID: 10, UsedMemory: 600 * mib}, {PID: 11, UsedMemory: 600 * mib}}, want: true, used: 1200 * mib, limit: 1024 * mib},
		{name: "allowance per process covers it", allowance: 100 * mib, procs: []Process{{PID: 10, UsedMemory: 600 * mib}, {PID: 11, UsedMemory: 600 * mib}}},
		{name: "allowance exceeded", allowance: 50 * mib, procs: []Process{{PID: 10, UsedMemory: 600 * mib}, {PID: 11, UsedMemory: 600 * mib}}, want: true, used: 1200 * mib, limit: 1124 * mib},
		{name: "allowance counted for at most the cap", allowance: 100 * mib, allowCap: 1, procs: []Process{{PID: 10, UsedMemory: 600 * mib}, {PID: 11, UsedMemory: 600 * mib}}, want: true, used: 1200 * mib, limit: 1124 * mib},
		{name: "allowance within the cap", allowance: 100 * mib, allowCap: 2, procs: []Process{{PID: 10, UsedMemory: 600 * mib}, {PID: 11, UsedMemory: 600 * mib}}},
		{name: "other instance not counted", procs: []Process{{PID: 10, UsedMemory: 1000 * mib}, {PID: 20, UsedMemory: 1000 * mib}}},
		{name: "unknown memory not counted", procs: []Process{{PID: 10, UsedMemory: 1000 * mib}, {PID: 11, MemoryUnknown: true}}},
		{name: "dead pid not counted", procs: []Process{{PID: 10, UsedMemory: 1000 * mib}, {PID: 12, UsedMemory: 1000 * mib}}, dead: []int{12}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			opts := []Option{WithMemoryAllowance(tc.allowance), WithAction(KindMemory, ActionLog)}
			if tc.allowCap > 0 {
				opts = append(opts, WithAllowanceProcesses(tc.allowCap))
			}
			r := newRig(t, opts...)
			r.proc(10, "a")
			r.proc(11, "a")
			r.proc(12, "a")
			r.proc(20, "b")
			for _, pid := range tc.dead {
				r.procs.Start(pid, 0, false)
			}
			r.src.Set(tc.procs, nil)
			vs := r.check(tick, Instance{Name: "a", MemoryQuota: 1024 * mib}, Instance{Name: "b", MemoryQuota: 1024 * mib})
			if !tc.want {
				if len(vs) != 0 {
					t.Fatalf("got %v, want none", vs)
				}
				return
			}
			if len(vs) != 1 {
				t.Fatalf("got %d violations %v, want 1", len(vs), vs)
			}
			v := vs[0]
			if v.Kind != KindMemory || v.Instance != "a" || !v.First || v.Action != ActionLog {
				t.Errorf("got %+v", v)
			}
			if v.Evidence.UsedMemory != tc.used || v.Evidence.MemoryLimit != tc.limit || v.Evidence.MemoryQuota != 1024*mib {
				t.Errorf("evidence %+v, want used %d limit %d", v.Evidence, tc.used, tc.limit)
			}
			if len(v.Killed) != 0 || len(r.killer.Killed()) != 0 {
				t.Errorf("log action killed %v", r.killer.Killed())
			}
		})
	}
}

func TestMemoryKillLargestFirstOnce(t *testing.T) {
	t.Parallel()
	r := newRig(t) // memory: kill by default
	for pid := 10; pid <= 12; pid++ {
		r.proc(pid, "a")
	}
	a := Instance{Name: "a", MemoryQuota: 1024 * mib}
	procs := []Process{{PID: 10, UsedMemory: 300 * mib}, {PID: 11, UsedMemory: 4096 * mib}, {PID: 12, UsedMemory: 500 * mib}}
	r.src.Set(procs, nil)
	vs := r.check(tick, a)
	if len(vs) != 1 || !slices.Equal(vs[0].PIDs, []int{10, 11, 12}) || !slices.Equal(vs[0].Killed, []int{11}) || vs[0].Action != ActionKill {
		t.Fatalf("got %+v, want pid 11 killed", vs)
	}
	if k := r.killer.Killed(); len(k) != 1 || k[0] != (Target{PID: 11, StartTime: 1011}) {
		t.Fatalf("killer got %v", k)
	}
	// The killed process is still listed while the driver tears it down:
	// the violation persists, nothing more is killed, nothing more logged.
	for range 8 {
		vs = r.check(tick, a)
		if len(vs) != 1 || vs[0].First || len(vs[0].Killed) != 0 {
			t.Fatalf("while dying: %+v", vs)
		}
	}
	if len(r.killer.Killed()) != 1 || r.logs.count("backstop: violation") != 1 || r.logs.count("backstop: killed") != 1 {
		t.Fatalf("killed %v, logs %v", r.killer.Killed(), r.logs.msgs)
	}
	// Gone: the episode ends.
	r.src.Set(procs[:1], nil)
	if vs := r.check(tick, a); len(vs) != 0 {
		t.Fatalf("after: %v", vs)
	}
	if r.logs.count("backstop: violation ended") != 1 {
		t.Errorf("logs %v", r.logs.msgs)
	}
	// Over again, by two processes: a new episode; both needed.
	r.proc(13, "a")
	r.proc(14, "a")
	r.src.Set(append(procs[:1], Process{PID: 13, UsedMemory: 600 * mib}, Process{PID: 14, UsedMemory: 600 * mib}), nil)
	vs = r.check(tick, a)
	if len(vs) != 1 || !vs[0].First || !slices.Equal(vs[0].Killed, []int{13}) {
		t.Fatalf("second episode: %+v", vs)
	}
	want := []Count{{Kind: KindMemory, Instance: "a", Episodes: 2, Kills: 2}}
	if got := r.w.Counts(); !slices.Equal(got, want) {
		t.Errorf("counts %+v, want %+v", got, want)
	}
}

// TestMemorySlackBoundedPerInstance: processes that skip the shim each hold
// a context's allowance over their share of the quota. The allowance
// counts for at most DefaultAllowanceProcesses of them, so 8 such
// processes are over the limit and the largest are killed until the rest
// fit; with one allowance per process (the rule before), 8 × the allowance
// over the quota went unpunished.
func TestMemorySlackBoundedPerInstance(t *testing.T) {
	t.Parallel()
	const allowance, quota, n = 1024 * mib, 1024 * mib, 8
	r := newRig(t, WithMemoryAllowance(allowance))
	a := Instance{Name: "a", MemoryQuota: quota}
	var procs []Process
	for pid := 10; pid < 10+n; pid++ {
		r.proc(pid, "a")
		procs = append(procs, Process{PID: pid, UsedMemory: quota/n + allowance})
	}
	r.src.Set(procs, nil)
	vs := r.check(tick, a)
	if len(vs) != 1 || vs[0].Kind != KindMemory {
		t.Fatalf("got %v, want a memory violation: %d processes hold %d MiB over a %d MiB quota",
			vs, n, n*(quota/n+allowance)/mib, quota/mib)
	}
	e := vs[0].Evidence
	if want := quota + DefaultAllowanceProcesses*allowance; e.MemoryLimit != want || e.UsedMemory != quota+n*allowance ||
		e.Processes != n || e.AllowanceCap != DefaultAllowanceProcesses || e.Allowance != allowance {
		t.Errorf("evidence %+v, want limit %d", e, want)
	}
	// All equal: the lowest pids first, until the 4 left (4 × 1152 MiB)
	// are within quota + 4 allowances (5120 MiB).
	if want := []int{10, 11, 12, 13}; !slices.Equal(vs[0].Killed, want) {
		t.Errorf("killed %v, want %v", vs[0].Killed, want)
	}
	r.src.Set(procs[4:], nil)
	if vs := r.check(tick, a); len(vs) != 0 {
		t.Errorf("after the kills: %v", vs)
	}
}

// TestMemoryHonestProcessesWithinTheCap: an instance whose processes keep
// to the quota through the shim, each with a context the driver charges
// (610 MiB, PyTorch on an H200), is not a violation with as many processes
// as the capped allowance covers: 6 at 1024 MiB × 4.
func TestMemoryHonestProcessesWithinTheCap(t *testing.T) {
	t.Parallel()
	const allowance, quota, context = 1024 * mib, 4096 * mib, 610 * mib
	for _, tc := range []struct {
		name string
		n    int
		want bool
	}{
		{name: "one process", n: 1},
		{name: "four processes", n: 4},
		{name: "six processes", n: 6},
		{name: "seven processes", n: 7, want: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := newRig(t, WithMemoryAllowance(allowance))
			var procs []Process
			for i := range tc.n {
				pid := 10 + i
				r.proc(pid, "a")
				procs = append(procs, Process{PID: pid, UsedMemory: context + quota/uint64(tc.n)}) //nolint:gosec // small
			}
			r.src.Set(procs, nil)
			vs := r.check(tick, Instance{Name: "a", MemoryQuota: quota})
			if got := len(vs) > 0; got != tc.want {
				t.Fatalf("%d processes holding %d MiB (quota %d MiB): violations %v, want %v", tc.n, (quota+uint64(tc.n)*context)/mib, quota/mib, vs, tc.want) //nolint:gosec // small
			}
		})
	}
}

// busyAll runs every pid flat out (reported in driver time) for d.
func busyAll(d time.Duration, pids ...int) map[int]time.Duration {
	m := map[int]time.Duration{}
	for _, p := range pids {
		m[p] = d
	}
	return m
}

func TestCompute(t *testing.T) {
	t.Parallel()
	// Each case runs 12 checks, 250 ms apart, of an instance whose process
	// the driver reports busy for driver per check while the enforcer
	// accounts acc per check. Window 1 s, tolerance 10 % (100 ms).
	for _, tc := range []struct {
		name        string
		driver, acc time.Duration
		firstAt     int // index of the first check reporting; -1: none
	}{
		{name: "shim bypass: nothing accounted", driver: tick, acc: 0, firstAt: 4},
		{name: "lying counters: half accounted", driver: 200 * time.Millisecond, acc: 100 * time.Millisecond, firstAt: 4},
		{name: "exactly its accounted time", driver: tick, acc: tick, firstAt: -1},
		{name: "under its accounted time", driver: 100 * time.Millisecond, acc: 200 * time.Millisecond, firstAt: -1},
		{name: "exactly at the tolerance", driver: 125 * time.Millisecond, acc: 100 * time.Millisecond, firstAt: -1},
		{name: "a nanosecond per check past the tolerance", driver: 125*time.Millisecond + 1, acc: 100 * time.Millisecond, firstAt: 4},
		{name: "idle", firstAt: -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := newRig(t)
			r.proc(10, "a")
			r.src.Set([]Process{{PID: 10, UsedMemory: mib}}, nil)
			a := Instance{Name: "a", MemoryQuota: 1024 * mib}
			first := -1
			for i := range 12 {
				if i > 0 { // the first check is the baseline
					a.Accounted += tc.acc
				}
				r.src.Busy = busyAll(tc.driver, 10)
				vs := r.check(tick, a)
				if len(vs) > 1 || len(vs) == 1 && vs[0].Kind != KindCompute {
					t.Fatalf("check %d: %v", i, vs)
				}
				if len(vs) == 1 {
					v := vs[0]
					if first < 0 {
						first = i
						if !v.First {
							t.Errorf("check %d: first not marked", i)
						}
						e := v.Evidence
						if e.Window != time.Second || e.Tolerance != 100*time.Millisecond || e.DriverTime != 4*tc.driver || e.AccountedTime != 4*tc.acc {
							t.Errorf("evidence %+v", e)
						}
						if !slices.Equal(v.PIDs, []int{10}) || v.Action != ActionLog {
							t.Errorf("got %+v", v)
						}
					} else if v.First {
						t.Errorf("check %d: first again", i)
					}
				} else if first >= 0 {
					t.Errorf("check %d: episode stopped", i)
				}
			}
			if first != tc.firstAt {
				t.Errorf("first reported at check %d, want %d", first, tc.firstAt)
			}
		})
	}
}

func TestComputeWindowMustFill(t *testing.T) {
	t.Parallel()
	r := newRig(t, WithWindow(2*time.Second))
	r.proc(10, "a")
	r.src.Set([]Process{{PID: 10}}, nil)
	// Irregular checks: judged only once a point is 2 s old.
	for i, d := range []time.Duration{100, 700, 900, 200, 50} {
		d *= time.Millisecond
		r.src.Busy = busyAll(d, 10)
		vs := r.check(d, Instance{Name: "a"})
		full := r.now-100*time.Millisecond >= 2*time.Second
		if (len(vs) == 1) != full {
			t.Fatalf("check %d at %v: %v (window full: %v)", i, r.now, vs, full)
		}
	}
	// A new instance fills its own window.
	r.proc(20, "b")
	r.src.Set([]Process{{PID: 10}, {PID: 20}}, nil)
	for i := range 9 {
		r.src.Busy = busyAll(tick, 10, 20)
		vs := r.check(tick, Instance{Name: "a"}, Instance{Name: "b"})
		var got []string
		for _, v := range vs {
			got = append(got, v.Instance)
		}
		want := []string{"a"}
		if i == 8 {
			want = []string{"a", "b"}
		}
		if !slices.Equal(got, want) {
			t.Fatalf("check %d: %v, want %v", i, got, want)
		}
	}
}

func TestComputeKill(t *testing.T) {
	t.Parallel()
	r := newRig(t, WithAction(KindCompute, ActionKill))
	r.proc(10, "a")
	r.proc(11, "a")
	r.proc(12, "a") // holds a context, never busy
	r.src.Set([]Process{{PID: 10}, {PID: 11}, {PID: 12}}, nil)
	a := Instance{Name: "a"}
	for i := range 5 {
		r.src.Busy = busyAll(tick/2, 10, 11)
		vs := r.check(tick, a)
		if i < 4 && len(vs) != 0 {
			t.Fatalf("check %d: %+v", i, vs)
		}
		if i == 4 && (len(vs) != 1 || !slices.Equal(vs[0].Killed, []int{10, 11})) {
			t.Fatalf("check %d: %+v", i, vs)
		}
	}
	killedAt := r.now
	// The killed processes linger; a new one runs flat out. It is judged
	// on a window that starts at the kill, so the killed ones' time is
	// not held against it, and it alone is killed, a full window later.
	r.proc(13, "a")
	r.src.Set([]Process{{PID: 10}, {PID: 11}, {PID: 12}, {PID: 13}}, nil)
	for {
		r.src.Busy = busyAll(tick, 13)
		vs := r.check(tick, a)
		if len(vs) == 0 {
			if r.now > killedAt+time.Second {
				t.Fatalf("not caught by %v", r.now)
			}
			continue
		}
		if r.now != killedAt+time.Second || !vs[0].First || !slices.Equal(vs[0].PIDs, []int{13}) || !slices.Equal(vs[0].Killed, []int{13}) {
			t.Fatalf("at %v (kill at %v): %+v", r.now, killedAt, vs)
		}
		break
	}
	if k := r.killer.Killed(); len(k) != 3 {
		t.Errorf("killed %v", k)
	}
	if c := r.w.Counts(); len(c) != 1 || c[0] != (Count{Kind: KindCompute, Instance: "a", Episodes: 2, Kills: 3}) {
		t.Errorf("counts %+v", c)
	}
}

func TestAccountedIsTakenMonotonic(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	r.proc(10, "a")
	r.src.Set([]Process{{PID: 10}}, nil)
	// A decrease counts as no growth (it does not reset the window) and a
	// jump counts as at most the time elapsed.
	accs := []time.Duration{5 * time.Second, 0, tick, time.Hour, time.Hour + tick, time.Hour + 2*tick, time.Hour + 3*tick}
	var got []bool
	for _, acc := range accs {
		r.src.Busy = busyAll(tick, 10)
		vs := r.check(tick, Instance{Name: "a", Accounted: acc})
		got = append(got, len(vs) == 1)
	}
	// Accounted over the window ending at check 4: 0 + 250 + 250 (the hour,
	// clamped) + 250 = 750 ms vs 1 s driver time: over by 250 ms.
	want := []bool{false, false, false, false, true, false, false}
	if !slices.Equal(got, want) {
		t.Errorf("violations %v, want %v", got, want)
	}
}

func TestUnattributed(t *testing.T) {
	t.Parallel()
	r := newRig(t, WithAction(KindUnattributed, ActionKill))
	r.proc(10, "a")
	r.proc(20, "")              // belongs to no instance
	r.proc(30, "gone")          // attributed to an instance the enforcer no longer has
	r.proc(40, "")              // busy, holds no memory listed
	r.procs.Start(50, 0, false) // listed, exited
	r.src.Set([]Process{{PID: 10}, {PID: 20, UsedMemory: 7 * mib}, {PID: 30}, {PID: 50}}, busyAll(tick, 40, 50))
	vs := r.check(tick, Instance{Name: "a", MemoryQuota: mib})
	if got := kinds(vs); !slices.Equal(got, []Kind{KindUnattributed, KindUnattributed, KindUnattributed}) {
		t.Fatalf("got %v", vs)
	}
	for i, pid := range []int{20, 30, 40} {
		v := vs[i]
		if v.Instance != "" || !slices.Equal(v.PIDs, []int{pid}) || !v.First || !slices.Equal(v.Killed, []int{pid}) {
			t.Errorf("got %+v, want pid %d killed", v, pid)
		}
	}
	if vs[0].Evidence.UsedMemory != 7*mib || vs[2].Evidence.DriverTime != tick {
		t.Errorf("evidence %+v %+v", vs[0].Evidence, vs[2].Evidence)
	}
	// Still listed next time: the same episodes, no second kill.
	r.src.Busy = busyAll(tick, 40, 50)
	vs = r.check(tick, Instance{Name: "a", MemoryQuota: mib})
	if len(vs) != 3 || vs[0].First || len(vs[0].Killed) != 0 || len(r.killer.Killed()) != 3 {
		t.Fatalf("second check %+v, killed %v", vs, r.killer.Killed())
	}
	if c := r.w.Counts(); len(c) != 1 || c[0] != (Count{Kind: KindUnattributed, Episodes: 3, Kills: 3}) {
		t.Errorf("counts %+v", c)
	}
}

func TestExitedProcessTimeCountsForItsInstance(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	r.proc(10, "a")
	r.src.Set([]Process{{PID: 10}}, nil)
	r.check(tick, Instance{Name: "a"})
	// The process exits; the driver reports its last samples after that.
	r.procs.Start(10, 0, false)
	r.src.Set(nil, busyAll(2*time.Second, 10))
	for range 3 {
		if vs := r.check(tick, Instance{Name: "a"}); len(vs) != 0 {
			t.Fatalf("before the window is full: %v", vs)
		}
	}
	vs := r.check(tick, Instance{Name: "a"})
	if len(vs) != 1 || vs[0].Kind != KindCompute || vs[0].Evidence.DriverTime != 2*time.Second {
		t.Fatalf("got %+v", vs)
	}
}

// churnProcs reports a new start time on every other read of pid.
type churnProcs struct {
	mu  sync.Mutex
	pid int
	n   uint64
}

func (c *churnProcs) StartTime(pid int) (uint64, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if pid != c.pid {
		return 0, os.ErrProcessDone
	}
	c.n++
	return c.n, nil
}

func TestPidReusedDuringAttributionIsNotJudged(t *testing.T) {
	t.Parallel()
	k := &FakeKiller{}
	src := &FakeSource{Procs: []Process{{PID: 10, UsedMemory: 8 * mib}}}
	w, err := New(src, WithProcs(&churnProcs{pid: 10}), WithKiller(k), WithAction(KindUnattributed, ActionKill))
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		vs, err := w.Check(time.Duration(i)*tick, []Instance{{Name: "a", MemoryQuota: mib}}, func(int, uint64) (string, bool) { return "a", true })
		if err != nil || len(vs) != 0 {
			t.Fatalf("got %v, %v", vs, err)
		}
	}
	if len(k.Killed()) != 0 {
		t.Errorf("killed %v", k.Killed())
	}
}

func TestKillErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		err     error
		wantErr bool
	}{
		{"exited meanwhile", fmt.Errorf("pid 10: %w", os.ErrProcessDone), false},
		{"pid reused", fmt.Errorf("pid 10: %w", ErrPidReused), true},
		{"permission", errors.New("operation not permitted"), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := newRig(t)
			r.killer.Err = tc.err
			r.proc(10, "a")
			r.src.Set([]Process{{PID: 10, UsedMemory: 2 * mib}}, nil)
			vs := r.check(tick, Instance{Name: "a", MemoryQuota: mib})
			if len(vs) != 1 || len(vs[0].Killed) != 0 || (vs[0].KillErr != nil) != tc.wantErr {
				t.Fatalf("got %+v", vs)
			}
			if tc.wantErr && !errors.Is(vs[0].KillErr, tc.err) {
				t.Errorf("kill error %v, want %v", vs[0].KillErr, tc.err)
			}
			// Not tried again every interval.
			r.killer.Err = nil
			vs = r.check(tick, Instance{Name: "a", MemoryQuota: mib})
			if len(vs) != 1 || len(vs[0].Killed) != 0 || len(r.killer.Killed()) != 0 {
				t.Fatalf("retried: %+v", vs)
			}
		})
	}
}

func TestSourceErrors(t *testing.T) {
	t.Parallel()
	errProcs, errBusy := errors.New("GPU is lost"), errors.New("not supported")
	r := newRig(t)
	r.proc(10, "a")
	a := Instance{Name: "a", MemoryQuota: mib}
	r.src.Set([]Process{{PID: 10, UsedMemory: 2 * mib}}, nil)
	step := func() ([]Violation, error) {
		r.now += tick
		r.src.mu.Lock()
		r.src.Busy = busyAll(tick, 10)
		r.src.mu.Unlock()
		return r.w.Check(r.now, []Instance{a}, r.attribute)
	}
	for range 4 {
		if _, err := step(); err != nil {
			t.Fatal(err)
		}
	}
	vs, err := step()
	if err != nil || !slices.Equal(kinds(vs), []Kind{KindCompute, KindMemory}) {
		t.Fatalf("got %v, %v", vs, err)
	}
	// Processes fail: the error is returned, compute is still judged, the
	// memory episode is not ended by a check that could not judge it.
	r.src.Fail(errProcs, nil)
	for range 3 {
		vs, err = step()
		if !errors.Is(err, errProcs) || !slices.Equal(kinds(vs), []Kind{KindCompute}) {
			t.Fatalf("processes failing: %v, %v", vs, err)
		}
	}
	// Utilization fails too: nothing judged, nothing panics.
	r.src.Fail(errProcs, errBusy)
	vs, err = step()
	if !errors.Is(err, errProcs) || !errors.Is(err, errBusy) || len(vs) != 0 {
		t.Fatalf("both failing: %v, %v", vs, err)
	}
	// Back: the episodes were never interrupted.
	r.src.Fail(nil, nil)
	vs, err = step()
	if err != nil || len(vs) != 2 || vs[0].First || vs[1].First {
		t.Fatalf("recovered: %+v, %v", vs, err)
	}
	if n := r.logs.count("backstop: driver query failing"); n != 1 {
		t.Errorf("failure logged %d times, want once: %v", n, r.logs.msgs)
	}
	if n := r.logs.count("backstop: violation"); n != 2 {
		t.Errorf("violations logged %d times, want 2: %v", n, r.logs.msgs)
	}
	if r.logs.count("backstop: violation ended") != 0 || r.logs.count("backstop: driver query works again") != 1 {
		t.Errorf("logs %v", r.logs.msgs)
	}
}

func TestInstanceRemovedForgotten(t *testing.T) {
	t.Parallel()
	r := newRig(t, WithAction(KindMemory, ActionLog))
	r.proc(10, "a")
	r.src.Set([]Process{{PID: 10, UsedMemory: 2 * mib}}, nil)
	if vs := r.check(tick, Instance{Name: "a", MemoryQuota: mib}); len(vs) != 1 {
		t.Fatalf("got %v", vs)
	}
	// Instance gone, its process exited: nothing, and the episode ended.
	r.procs.Start(10, 0, false)
	r.src.Set(nil, nil)
	for range 20 {
		if vs := r.check(tick); len(vs) != 0 {
			t.Fatalf("got %v", vs)
		}
	}
	r.w.mu.Lock()
	defer r.w.mu.Unlock()
	if len(r.w.insts) != 0 || len(r.w.pids) != 0 || len(r.w.episodes) != 0 {
		t.Errorf("state kept: %v %v %v", r.w.insts, r.w.pids, r.w.episodes)
	}
}

func TestCountsWhileChecking(t *testing.T) {
	t.Parallel()
	r := newRig(t, WithAction(KindMemory, ActionLog))
	r.proc(10, "a")
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range 200 {
			_ = r.w.Counts()
		}
	}()
	for i := range 200 {
		used := mib
		if i%2 == 0 {
			used = 2 * mib
		}
		r.src.Set([]Process{{PID: 10, UsedMemory: used}}, nil)
		r.check(tick, Instance{Name: "a", MemoryQuota: mib})
	}
	<-done
	if c := r.w.Counts(); len(c) != 1 || c[0].Episodes != 100 {
		t.Errorf("counts %+v", c)
	}
}

func TestNew(t *testing.T) {
	t.Parallel()
	src := &FakeSource{}
	for _, tc := range []struct {
		name string
		src  Source
		opts []Option
		msg  string
	}{
		{"no source", nil, nil, "no source"},
		{"zero window", src, []Option{WithWindow(0)}, "window"},
		{"negative tolerance", src, []Option{WithComputeTolerance(-1)}, "tolerance"},
		{"tolerance over 100", src, []Option{WithComputeTolerance(101)}, "tolerance"},
		{"allowance for no process", src, []Option{WithAllowanceProcesses(0)}, "allowance processes 0: must be at least 1"},
		{"bad action", src, []Option{WithAction(KindCompute, "ignore")}, `unknown action "ignore"`},
		{"bad kind", src, []Option{WithAction("cpu", ActionLog)}, `unknown kind "cpu"`},
		{"defaults", src, nil, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			w, err := New(tc.src, tc.opts...)
			if tc.msg == "" {
				if err != nil || w.o.actions[KindMemory] != ActionKill || w.o.actions[KindCompute] != ActionLog || w.o.actions[KindUnattributed] != ActionLog {
					t.Fatalf("got %v, %v", w, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.msg) {
				t.Fatalf("got %v, want error containing %q", err, tc.msg)
			}
		})
	}
}

func TestParseAction(t *testing.T) {
	t.Parallel()
	for _, s := range []string{"log", "kill"} {
		if a, err := ParseAction(s); err != nil || string(a) != s {
			t.Errorf("%q: %v, %v", s, a, err)
		}
	}
	for _, s := range []string{"", "Kill", "warn"} {
		if _, err := ParseAction(s); err == nil {
			t.Errorf("%q accepted", s)
		}
	}
}

func TestViolationString(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		v    Violation
		want string
	}{
		{Violation{Kind: KindMemory, Instance: "a", PIDs: []int{1}, Evidence: Evidence{UsedMemory: 3, MemoryLimit: 2, MemoryQuota: 2, AllowanceCap: 4, Processes: 1}},
			`instance "a": processes [1] hold 3 bytes of device memory, over its limit of 2 (quota 2 + allowance 0 × 1 processes)`},
		{Violation{Kind: KindMemory, Instance: "a", PIDs: []int{1, 2, 3}, Evidence: Evidence{UsedMemory: 9, MemoryLimit: 8, MemoryQuota: 2, Allowance: 3, AllowanceCap: 2, Processes: 3}},
			`instance "a": processes [1 2 3] hold 9 bytes of device memory, over its limit of 8 (quota 2 + allowance 3 × 2: it counts for at most 2 of the instance's 3 processes)`},
		{Violation{Kind: KindCompute, Instance: "a", PIDs: []int{1}, Evidence: Evidence{Window: time.Second, DriverTime: time.Second, Tolerance: 100 * time.Millisecond}},
			`instance "a": processes [1] were busy 1s on the device over 1s, 0s accounted (tolerance 100ms)`},
		{Violation{Kind: KindUnattributed, PIDs: []int{7}, Evidence: Evidence{UsedMemory: 5, DriverTime: tick}},
			`process [7] uses the device (5 bytes, busy 250ms in the last interval) and belongs to no instance`},
	} {
		if got := tc.v.String(); got != tc.want {
			t.Errorf("got  %s\nwant %s", got, tc.want)
		}
	}
}
