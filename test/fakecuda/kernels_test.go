package fakecuda

import (
	"os/exec"
	"sort"
	"testing"
	"time"
)

// The record of kernel runs (fakecuda-ctl kernels, FollowKernels): two
// processes saturating the device under each model; every run is there
// (their durations add up to the device's kernel_ns exactly), attributed
// to the process that ran it, and no two overlap (one kernel at a time).
func TestKernelRecord(t *testing.T) {
	for _, spec := range []string{"slice", "timer:1ms", "kernel"} {
		t.Run(spec, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, modelEnv(t, spec)...)
			e.workload(0, "info") // creates the state file
			log, err := FollowKernels(e.p.Ctl, e.state, 0, 100*time.Millisecond)
			if err != nil {
				t.Fatal(err)
			}
			before, _ := e.stat().Device(0)
			var cmds []*exec.Cmd
			pids := map[int]bool{}
			for _, us := range []string{"300", "700"} {
				c := e.cmd(e.p.Workload, "compute", "--api", "launch", "--kernel-us", us, "--depth", "4", "--seconds", "0.6")
				if err := c.Start(); err != nil {
					t.Fatal(err)
				}
				cmds = append(cmds, c)
				pids[c.Process.Pid] = true
			}
			for _, c := range cmds {
				if err := c.Wait(); err != nil {
					t.Fatal(err)
				}
			}
			after, _ := e.stat().Device(0)
			runs, err := log.Stop()
			if err != nil {
				t.Fatal(err)
			}
			var sum int64
			per := map[int]int64{}
			for _, r := range runs {
				if !pids[r.Pid] {
					t.Fatalf("a run of pid %d, not one of the workloads %v", r.Pid, pids)
				}
				if r.From < log.From || r.To <= r.From {
					t.Fatalf("run %+v: before the log's start %d or empty", r, log.From)
				}
				sum += r.To - r.From
				per[r.Pid] += r.To - r.From
			}
			want := int64(after.KernelNs - before.KernelNs)
			t.Logf("%d runs, %v of kernels (stat: %v); per process %v", len(runs), time.Duration(sum), time.Duration(want), per)
			if sum != want {
				t.Errorf("the runs add up to %d ns, the device's kernel_ns grew by %d", sum, want)
			}
			if len(per) != 2 {
				t.Errorf("runs of %d processes, want 2", len(per))
			}
			s := append([]KernelRun(nil), runs...)
			sort.Slice(s, func(i, j int) bool { return s[i].From < s[j].From })
			for i := 1; i < len(s); i++ {
				if s[i].From < s[i-1].To {
					t.Errorf("runs %+v and %+v overlap by %v", s[i-1], s[i], time.Duration(s[i-1].To-s[i].From))
				}
			}
			tl := NewTimeline(runs, func(int) bool { return true })
			if got := tl.Within(log.From, s[len(s)-1].To+1); got != sum {
				t.Errorf("Within the whole log: %d ns, want %d", got, sum)
			}
		})
	}
}

// Timeline arithmetic on runs whose lengths differ (a long run starts
// well before a window it overlaps).
func TestTimeline(t *testing.T) {
	runs := []KernelRun{{100, 200, 1}, {200, 1200, 2}, {1200, 1300, 1}, {1300, 1400, 3}}
	tl := NewTimeline(runs, func(p int) bool { return p != 3 })
	for _, c := range []struct{ from, to, want int64 }{
		{0, 2000, 1200}, {150, 250, 100}, {900, 1250, 350}, {1300, 1400, 0}, {1250, 1250, 0},
	} {
		if got := tl.Within(c.from, c.to); got != c.want {
			t.Errorf("Within(%d, %d) = %d, want %d", c.from, c.to, got, c.want)
		}
	}
	if got := tl.LastEnd(100, 1250); got != 1200 {
		t.Errorf("LastEnd(100, 1250) = %d, want 1200", got)
	}
	if got := tl.LastEnd(150, 1250); got != 1200 {
		t.Errorf("LastEnd(150, 1250) = %d, want 1200 (the run from 200)", got)
	}
	if got := tl.LastEnd(1250, 2000); got != 0 {
		t.Errorf("LastEnd(1250, 2000) = %d, want 0 (the run of process 3 is not in it)", got)
	}
}
