package tenants

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/internal/policy"
	"github.com/mgpu-dev/mgpu/test/harness"
)

// detectBound is how soon a bypass must be caught and acted on (the
// issue's acceptance: 2 s).
const detectBound = 2 * time.Second

// bypassers are the two ways a process of an instance skips the shim: an
// unset LD_PRELOAD, and the driver loaded into a link-map namespace of its
// own (dlmopen), where the preloaded shim is not.
func bypassers(workload string, args ...string) map[string][]string {
	return map[string][]string{
		"LD_PRELOAD unset": append([]string{"/usr/bin/env", "-u", "LD_PRELOAD", workload}, args...),
		"dlmopen":          append([]string{workload, "--resolve", "dlmopen"}, args...),
	}
}

// TestBypassMemory: a process that bypasses the shim and allocates 4 GiB
// in a 1 GiB instance is caught by the driver backstop and killed (the
// memory default) within 2 s; a neighbour within its quota is left alone.
func TestBypassMemory(t *testing.T) {
	var logs harness.SyncBuffer
	n := newNode(t, harness.NodeConfig{Log: &logs})
	honest := honestNeighbour(t, n)
	for name, argv := range bypassers(n.Paths.Workload, "alloc", "--api", "cuMemAlloc_v2", "--mib", "4096", "--hold-ms", "-1") {
		t.Run(name, func(t *testing.T) {
			sh, err := n.Shell(0, 20, 1024)
			if err != nil {
				t.Fatal(err)
			}
			defer sh.Close()
			p, err := sh.SpawnCommand(argv...)
			if err != nil {
				t.Fatal(err)
			}
			if err := p.WaitOutput("-> CUDA_SUCCESS", 15*time.Second); err != nil {
				t.Fatalf("the bypass did not get its memory (the shim was not bypassed?): %v", err)
			}
			t0 := time.Now()
			if err := p.WaitExit(10 * time.Second); err != nil {
				t.Fatalf("not acted on: %v\nenforcer log:\n%s", err, logs.String())
			}
			took := time.Since(t0)
			t.Logf("%s: 4096 MiB in a 1024 MiB instance, detected and killed %v after the allocation", name, took.Round(time.Millisecond))
			if took > detectBound {
				t.Errorf("caught after %v, want within %v", took, detectBound)
			}
			if !strings.Contains(logs.String(), "instance="+sh.Instance.Name) {
				t.Errorf("no log line names %s:\n%s", sh.Instance.Name, logs.String())
			}
		})
	}
	if !honest.Alive() {
		t.Errorf("the neighbour within its quota was killed:\n%s", honest.Output())
	}
}

// TestBypassCompute: beside a guaranteed-burst instance of core 70, a
// process of a 30 instance bypasses the shim and computes flat out. With
// compute_on_violation = "kill" the backstop catches it within 2 s, kills
// it, and within 2 s of that the 70 has at least 68 % of the device again.
func TestBypassCompute(t *testing.T) {
	for name := range bypassers("") {
		t.Run(name, func(t *testing.T) {
			var logs harness.SyncBuffer
			n := newNode(t, harness.NodeConfig{Policies: map[int]policy.Policy{0: policy.GuaranteedBurstShare}, Log: &logs,
				ExtraConfig: "[backstop]\ncompute_on_violation = \"kill\"\n"})
			a, err := n.Shell(0, 70, 1024)
			if err != nil {
				t.Fatal(err)
			}
			b, err := n.Shell(0, 30, 1024)
			if err != nil {
				t.Fatal(err)
			}
			pa, err := a.Spawn(saturating(30)...)
			if err != nil {
				t.Fatal(err)
			}
			if err := pa.WaitOutput("start", 15*time.Second); err != nil {
				t.Fatal(err)
			}
			pb, err := b.SpawnCommand(bypassers(n.Paths.Workload, saturating(30)...)[name]...)
			if err != nil {
				t.Fatal(err)
			}
			if err := pb.WaitOutput("start", 15*time.Second); err != nil {
				t.Fatal(err)
			}
			start, ok := harness.StartedAt(pb.Output())
			if !ok {
				t.Fatalf("no start stamp:\n%s", pb.Output())
			}
			s0, err := n.Sample()
			if err != nil {
				t.Fatal(err)
			}
			if err := pb.WaitExit(10 * time.Second); err != nil {
				t.Fatalf("not acted on: %v\nenforcer log:\n%s", err, logs.String())
			}
			killed := time.Now()
			s1, err := n.Sample()
			if err != nil {
				t.Fatal(err)
			}
			took := killed.Sub(start)
			during := harness.Share(s0, s1, 0, map[int]bool{pa.PID: true})
			t.Logf("%s: flat out beside a guaranteed 70 (which got %.2f%% meanwhile), killed %v after it started", name, during, took.Round(time.Millisecond))
			if took > detectBound {
				t.Errorf("caught after %v, want within %v", took, detectBound)
			}
			// The 70's share over the second after detection + 1 s.
			time.Sleep(time.Until(killed.Add(time.Second))) // the window starts 1 s after the kill, by design
			a1, err := n.Sample()
			if err != nil {
				t.Fatal(err)
			}
			time.Sleep(time.Until(killed.Add(detectBound))) // and ends 2 s after it
			a2, err := n.Sample()
			if err != nil {
				t.Fatal(err)
			}
			after := harness.Share(a1, a2, 0, map[int]bool{pa.PID: true})
			t.Logf("the 70 from 1 s to 2 s after the kill: %.2f%%", after)
			if after < 68 {
				t.Errorf("the 70 has %.2f%% of the device 1-2 s after the kill, want >= 68", after)
			}
			if !strings.Contains(logs.String(), "instance="+b.Instance.Name) {
				t.Errorf("no log line names %s:\n%s", b.Instance.Name, logs.String())
			}
		})
	}
}

// TestBypassManyProcesses (issue 30, point 5): the driver backstop's slack
// over an instance's quota is an allowance per process, counted for at
// most memory_allowance_processes processes. Eight processes of a 1024 MiB
// instance skip the shim and hold 170 MiB each (1360 MiB): within quota +
// 8 allowances of 64 MiB (1536) but over quota + 4 (1280), so the backstop
// kills processes of the instance, within 2 s, until the rest fit; a
// neighbour within its quota is left alone.
func TestBypassManyProcesses(t *testing.T) {
	const (
		procs     = 8
		eachMiB   = 170
		quotaMiB  = 1024
		allowance = 64
		allowCap  = 4
	)
	var logs harness.SyncBuffer
	n := newNode(t, harness.NodeConfig{Log: &logs,
		ExtraConfig: fmt.Sprintf("[backstop]\nmemory_allowance_mib = %d\nmemory_allowance_processes = %d\n", allowance, allowCap)})
	honest := honestNeighbour(t, n)
	sh, err := n.Shell(0, 20, quotaMiB)
	if err != nil {
		t.Fatal(err)
	}
	var ps []harness.Proc
	for range procs {
		p, err := sh.SpawnCommand(n.Paths.Workload, "--resolve", "dlmopen", "alloc", "--api", "cuMemAlloc_v2", "--mib", strconv.Itoa(eachMiB), "--hold-ms", "-1")
		if err != nil {
			t.Fatal(err)
		}
		ps = append(ps, p)
	}
	// The last allocation brings the instance over quota + 4 allowances;
	// the backstop acts within an interval of seeing it.
	for _, p := range ps {
		if err := p.WaitOutput("-> CUDA_SUCCESS", 15*time.Second); err != nil && p.Alive() {
			t.Fatalf("a bypassing process did not get its memory: %v\n%s", err, p.Output())
		}
	}
	t0 := time.Now()
	limit := quotaMiB + allowance*allowCap
	fits := func() error {
		alive := 0
		for _, p := range ps {
			if p.Alive() {
				alive++
			}
		}
		if alive*eachMiB > limit {
			return fmt.Errorf("%d processes of %d MiB alive (%d MiB), over the %d MiB limit", alive, eachMiB, alive*eachMiB, limit)
		}
		return nil
	}
	if err := poll(10*time.Second, fits); err != nil {
		t.Fatalf("%v\nenforcer log:\n%s", err, logs.String())
	}
	took := time.Since(t0)
	alive := 0
	for _, p := range ps {
		if p.Alive() {
			alive++
		}
	}
	t.Logf("%d processes of %d MiB skipping the shim in a %d MiB instance: %d left (%d MiB) %v after the last allocation; limit %d MiB (4 allowances, not 8: %d)",
		procs, eachMiB, quotaMiB, alive, alive*eachMiB, took.Round(time.Millisecond), limit, quotaMiB+allowance*procs)
	if took > detectBound {
		t.Errorf("brought within the limit after %v, want within %v", took, detectBound)
	}
	if alive == 0 {
		t.Errorf("every process was killed; the backstop kills the largest until the rest fit")
	}
	if !strings.Contains(logs.String(), "instance="+sh.Instance.Name) {
		t.Errorf("no log line names %s:\n%s", sh.Instance.Name, logs.String())
	}
	if !honest.Alive() {
		t.Errorf("the neighbour within its quota was killed:\n%s", honest.Output())
	}
}

// poll checks cond every 10 ms until it holds or within has passed, and
// returns its last error.
func poll(within time.Duration, cond func() error) error {
	deadline := time.Now().Add(within)
	for {
		err := cond()
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(10 * time.Millisecond) // polling the processes' state
	}
}

// honestNeighbour starts a 2048 MiB instance on device 0 whose process
// holds 1024 MiB, within its quota, and returns the process.
func honestNeighbour(t *testing.T, n *harness.Node) harness.Proc {
	t.Helper()
	nb, err := n.Shell(0, 50, 2048)
	if err != nil {
		t.Fatal(err)
	}
	honest, err := nb.Spawn("alloc", "--api", "cuMemAlloc_v2", "--mib", "1024", "--hold-ms", "-1")
	if err != nil {
		t.Fatal(err)
	}
	if err := honest.WaitOutput("-> CUDA_SUCCESS", 15*time.Second); err != nil {
		t.Fatal(err)
	}
	return honest
}
