// Command mgpu-bench is `make bench`: it measures mgpu on a simulated node,
// always side by side in one run (with and without the shim, interleaved),
// and prints one `BENCH <name> <value> <unit>` line per measurement followed
// by a readable table. It reports what it measured; targets are printed
// beside the values, never substituted for them.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"math"
	"os"
	"os/exec"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/internal/policy"
	"github.com/mgpu-dev/mgpu/test/arbiterbench"
	"github.com/mgpu-dev/mgpu/test/e2e"
	"github.com/mgpu-dev/mgpu/test/fakecuda"
	"github.com/mgpu-dev/mgpu/test/harness"
)

type row struct {
	name  string
	value float64
	unit  string
	goal  goal
}

type bench struct {
	out    io.Writer
	rows   []row
	rounds int
	// launchRounds, allocRounds and startRounds are the interleaved rounds
	// of the launch, allocation and process start (attach) figures
	// (medians of paired differences).
	launchRounds, allocRounds, startRounds int
	window                                 time.Duration
	hookN                                  int
	models                                 []string // device models of the share section
	// serveSecs is how long the priority section serves requests on each
	// side (alone, beside the offline instance, beside an online
	// neighbour), in turns of priorityTurn.
	serveSecs float64
}

// benchModels are the simulated device models the share section runs under
// by default: every model of DESIGN.md "The simulated GPU".
var benchModels = []string{"slice", "timer:1ms", "timer:2ms", "kernel"}

func (b *bench) report(name string, value float64, unit string, g goal) {
	b.rows = append(b.rows, row{name, value, unit, g})
	fmt.Fprintf(b.out, "BENCH %s %.6g %s\n", name, value, unit)
}

func main() {
	only := flag.String("only", "", "comma-separated sections to run (arbiter,launch,alloc,start,share,reclaim,cpu,scale,metrics,hook,priority); default all")
	hookN := flag.Int("hook-containers", 20, "containers per variant (with and without the hooks) and engine in the hook section")
	rounds := flag.Int("rounds", 5, "interleaved rounds per side-by-side measurement")
	launchRounds := flag.Int("launch-rounds", 21, "interleaved rounds of the launch overhead")
	allocRounds := flag.Int("alloc-rounds", 9, "interleaved rounds of each allocation overhead")
	startRounds := flag.Int("start-rounds", 15, "interleaved rounds of each process start (attach) overhead")
	win := flag.Duration("window", 4*time.Second, "measurement window of each share case")
	serve := flag.Duration("serve", 20*time.Second, "time the priority section serves requests on each side (alone, beside the offline instance, beside an online neighbour), in turns of 1s")
	models := flag.String("models", strings.Join(benchModels, ","), "comma-separated simulated device models of the share and priority sections (slice, timer:1ms, timer:2ms, kernel)")
	reportOnly := flag.Bool("report-only", false, "report every figure and the verdict, but exit 0 when figures are over their budget")
	flag.Parse()
	if *rounds < 1 || *launchRounds < 1 || *allocRounds < 1 || *startRounds < 1 {
		fmt.Fprintln(os.Stderr, "mgpu-bench: -rounds, -launch-rounds, -alloc-rounds and -start-rounds must be at least 1")
		os.Exit(2)
	}
	if *serve < time.Second {
		fmt.Fprintf(os.Stderr, "mgpu-bench: -serve %v: want at least 1s\n", *serve)
		os.Exit(2)
	}
	b := &bench{out: os.Stdout, rounds: *rounds, launchRounds: *launchRounds, allocRounds: *allocRounds, startRounds: *startRounds, window: *win, hookN: *hookN, serveSecs: serve.Seconds()}
	for _, m := range strings.Split(*models, ",") {
		if m = strings.TrimSpace(m); m != "" {
			if _, _, err := fakecuda.ParseModel(m); err != nil {
				fmt.Fprintf(os.Stderr, "mgpu-bench: -models: %v\n", err)
				os.Exit(2)
			}
			b.models = append(b.models, m)
		}
	}
	sections := []struct {
		name string
		fn   func() error
	}{
		{"arbiter", b.arbiterCost},
		{"launch", b.launchOverhead},
		{"alloc", b.allocOverhead},
		{"start", b.processStart},
		{"share", b.shareError},
		{"reclaim", b.reclaim},
		{"cpu", b.enforcerCPU},
		{"scale", b.scale},
		{"metrics", b.metricsCost},
		{"hook", b.hookCost},
		{"priority", b.priority},
	}
	want := map[string]bool{}
	for _, s := range strings.Split(*only, ",") {
		if s != "" {
			want[s] = true
		}
	}
	failed := false
	for _, s := range sections {
		if len(want) > 0 && !want[s.name] {
			continue
		}
		if err := s.fn(); err != nil {
			fmt.Fprintf(os.Stderr, "mgpu-bench: %s: %v\n", s.name, err)
			failed = true
		}
	}
	b.table()
	over := verdict(b.out, b.rows)
	switch {
	case failed:
		os.Exit(1)
	case len(over) > 0 && !*reportOnly:
		os.Exit(3)
	}
}

func (b *bench) table() {
	w := 44
	for _, r := range b.rows {
		w = max(w, len(r.name))
	}
	fmt.Fprintf(b.out, "\n%-*s %14s  %-16s %-4s  %s\n", w, "measurement", "value", "unit", "", "budget")
	for _, r := range b.rows {
		mark := ""
		if r.goal.has {
			mark = "ok"
			if !r.goal.met(r.value) {
				mark = "OVER"
			}
		}
		fmt.Fprintf(b.out, "%-*s %14.2f  %-16s %-4s  %s\n", w, r.name, r.value, r.unit, mark, r.goal)
	}
}

// tickBudget is the arbiter's budget per tick (ns) by instances.
var tickBudget = map[int]float64{16: 1000, 64: 4000}

// arbiterCost times the arbiter's decision for 16 and 64 saturating
// fixed-share instances (one Tick per simulated millisecond) in the steady
// state of the arbiter package's BenchmarkTick (arbiterbench.Steady): the
// figure is the Tick's, not the bench's (an earlier harness rewrote every
// instance's usage each tick, 2 × n map writes, a third of the figure).
func (b *bench) arbiterCost() error {
	for _, n := range []int{16, 64} {
		s := arbiterbench.NewSteady(policy.FixedShare, n)
		const ticks = 200000
		start := time.Now()
		for range ticks {
			s.Step()
		}
		per := float64(time.Since(start).Nanoseconds()) / ticks
		b.report(fmt.Sprintf("arbiter_tick_%d_instances", n), per, "ns/tick", atMost(tickBudget[n], "(once per 1 ms tick)"))
	}
	return nil
}

// workloadRun runs mgpu-workload with env and returns its output.
func workloadRun(n *harness.Node, env []string, args ...string) (string, error) {
	cmd := exec.Command(n.Paths.Workload, args...)
	cmd.Env = env
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("mgpu-workload %v: %w: %s", args, err, out)
	}
	return string(out), nil
}

func field(out, key string) (float64, error) {
	m := regexp.MustCompile(`(?m)\b` + regexp.QuoteMeta(key) + `=([0-9.]+)`).FindStringSubmatch(out)
	if m == nil {
		return 0, fmt.Errorf("no %s in %q", key, out)
	}
	return strconv.ParseFloat(m[1], 64)
}

func median(v []float64) float64 {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	if len(s) == 0 {
		return 0
	}
	return s[len(s)/2]
}

// shimNode is a node with one enforcer and one instance that holds the
// whole device, rooted at this process (a process-tree instance, as
// `mgpu-cli run` makes): the shim side of a measurement is then a direct
// exec exactly like the side without the shim.
func shimNode() (*harness.Node, error) {
	n, err := harness.NewNode(harness.NodeConfig{})
	if err != nil {
		return nil, err
	}
	if err := n.StartEnforcer(0); err != nil {
		_ = n.Close()
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := n.Client(0).Create(ctx, api.CreateRequest{Kind: api.KindProcessTree, ContainerID: "mgpu-bench",
		PID: os.Getpid(), Core: 100, MemoryMiB: 65536}); err != nil {
		_ = n.Close()
		return nil, err
	}
	return n, nil
}

// runIn runs the workload with the shim preloaded (in the bench's instance)
// or without it, the same way, and returns its output.
func runIn(n *harness.Node, shim bool, args ...string) (string, error) {
	env := n.Env()
	if shim {
		env = n.ShimEnv(0)
	}
	return workloadRun(n, env, args...)
}

// interleaved measures f(withShim) in rounds interleaved rounds, the side
// that goes first alternating from round to round, and summarises the
// pairs.
func interleaved(rounds int, f func(shim bool) (float64, error)) (paired, error) {
	var off, on []float64
	for r := range rounds {
		order := []bool{false, true}
		if r%2 == 1 {
			order = []bool{true, false}
		}
		for _, shim := range order {
			v, err := f(shim)
			if err != nil {
				return paired{}, err
			}
			if shim {
				on = append(on, v)
			} else {
				off = append(off, v)
			}
		}
	}
	return summarise(off, on), nil
}

// launchOverhead: the shim's fast path per launch, from the CPU time of
// processes launching 0 ns kernels (mgpu-workload bench-launch: the median
// of its batches), without and with the shim in interleaved rounds; the
// figure is the median of the per-round differences, beside their spread.
func (b *bench) launchOverhead() error {
	n, err := shimNode()
	if err != nil {
		return err
	}
	defer func() { _ = n.Close() }()
	p, err := interleaved(b.launchRounds, func(shim bool) (float64, error) {
		out, err := runIn(n, shim, "bench-launch", "--n", "300000", "--batches", "300")
		if err != nil {
			return 0, err
		}
		return field(out, "cpu_ns_per_launch")
	})
	if err != nil {
		return err
	}
	b.report("launch_no_shim", p.off, "ns/launch", info("(CPU time of the launching thread)"))
	b.report("launch_shim", p.on, "ns/launch", info("(CPU time of the launching thread)"))
	b.report("launch_overhead", p.diff, "ns/launch", atMost(30, fmt.Sprintf("(median of %d paired rounds)", b.launchRounds)))
	b.report("launch_overhead_spread", p.spread, "ns/launch", info("(interquartile range of the paired differences)"))
	return nil
}

// medianOfParallel runs f procs times at once and returns the median of
// what they measured, or the first error.
func medianOfParallel(procs int, f func() (float64, error)) (float64, error) {
	vals := make([]float64, procs)
	errs := make([]error, procs)
	var wg sync.WaitGroup
	for i := range procs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			vals[i], errs[i] = f()
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return 0, err
	}
	return median(vals), nil
}

// allocOverhead: what the shim adds to an allocation+free pair, in CPU time
// per pair of each process (the median of its batches; with 8 processes at
// once, the median process), without and with the shim in interleaved
// rounds. CPU time, not wall time: 8 processes on fewer cores would
// otherwise multiply the figure by the time each waits for a core.
func (b *bench) allocOverhead() error {
	n, err := shimNode()
	if err != nil {
		return err
	}
	defer func() { _ = n.Close() }()
	for _, procs := range []int{1, 8} {
		p, err := interleaved(b.allocRounds, func(shim bool) (float64, error) {
			return medianOfParallel(procs, func() (float64, error) {
				out, err := runIn(n, shim, "bench-alloc", "--n", "200000", "--batches", "20", "--bytes", "1048576")
				if err != nil {
					return 0, err
				}
				return field(out, "cpu_ns_per_alloc")
			})
		})
		if err != nil {
			return err
		}
		b.report(fmt.Sprintf("alloc_no_shim_%dproc", procs), p.off, "ns/alloc", info("(CPU time of the allocating thread)"))
		b.report(fmt.Sprintf("alloc_shim_%dproc", procs), p.on, "ns/alloc", info("(CPU time of the allocating thread)"))
		b.report(fmt.Sprintf("alloc_overhead_%dproc", procs), p.diff, "ns/alloc", atMost(100, fmt.Sprintf("(median of %d paired rounds)", b.allocRounds)))
		b.report(fmt.Sprintf("alloc_overhead_%dproc_spread", procs), p.spread, "ns/alloc", info("(interquartile range)"))
	}
	return nil
}

// processStart measures what the shim adds to a process's start: a process
// that never calls CUDA (/bin/true), and a CUDA process (mgpu-workload info:
// initialisation, attach, a query), alone (per process) and 64 at once
// (the time until the last of them has exited: the total).
func (b *bench) processStart() error {
	n, err := shimNode()
	if err != nil {
		return err
	}
	defer func() { _ = n.Close() }()
	envOf := func(shim bool) []string {
		if shim {
			return n.ShimEnv(0)
		}
		return n.Env()
	}
	timeOne := func(env []string, path string, args ...string) (float64, error) {
		cmd := exec.Command(path, args...)
		cmd.Env = env
		t0 := time.Now()
		if out, err := cmd.CombinedOutput(); err != nil {
			return 0, fmt.Errorf("%s: %w: %s", path, err, out)
		}
		return float64(time.Since(t0).Nanoseconds()), nil
	}
	medianOfEnv := func(k int, env []string, path string, args ...string) (float64, error) {
		var v []float64
		for range k {
			d, err := timeOne(env, path, args...)
			if err != nil {
				return 0, err
			}
			v = append(v, d)
		}
		return median(v), nil
	}
	// /bin/true: preloading the shim must cost nothing measurable.
	medianOf := func(k int, shim bool, path string, args ...string) (float64, error) {
		return medianOfEnv(k, envOf(shim), path, args...)
	}
	p, err := interleaved(b.startRounds, func(shim bool) (float64, error) { return medianOf(20, shim, "/bin/true") })
	if err != nil {
		return err
	}
	b.report("start_true_no_shim", p.off/1e6, "ms/process", info(""))
	b.report("start_true_shim", p.on/1e6, "ms/process", info(""))
	b.report("start_true_overhead", p.diff/1e3, "us/process", info("~0 (no work at load)"))
	p, err = interleaved(b.startRounds, func(shim bool) (float64, error) {
		return medianOf(10, shim, n.Paths.Workload, "info")
	})
	if err != nil {
		return err
	}
	b.report("start_cuda_no_shim_1proc", p.off/1e6, "ms/process", info(""))
	b.report("start_cuda_shim_1proc", p.on/1e6, "ms/process", info(""))
	b.report("attach_1proc", p.diff/1e6, "ms/process", atMost(0.5, fmt.Sprintf("(median of %d paired rounds)", b.startRounds)))
	b.report("attach_1proc_spread", p.spread/1e6, "ms/process", info("(interquartile range)"))
	// The floor, the same way: a preloaded library that makes one request
	// of the protocol's size to a server answering at once (floor.go).
	fl, err := startFloor()
	if err != nil {
		return err
	}
	p, err = interleaved(b.startRounds, func(floor bool) (float64, error) {
		env := n.Env()
		if floor {
			env = fl.env(env)
		}
		return medianOfEnv(10, env, n.Paths.Workload, "info")
	})
	fl.close()
	if err != nil {
		return err
	}
	b.report("attach_floor_1proc", p.diff/1e6, "ms/process", info("(the machine's floor: a preloaded library making one request of the same size to a server answering at once)"))
	b.report("attach_floor_1proc_spread", p.spread/1e6, "ms/process", info("(interquartile range)"))
	const procs = 64
	p, err = interleaved(b.startRounds, func(shim bool) (float64, error) {
		t0 := time.Now()
		if _, err := medianOfParallel(procs, func() (float64, error) {
			return timeOne(envOf(shim), n.Paths.Workload, "info")
		}); err != nil {
			return 0, err
		}
		return float64(time.Since(t0).Nanoseconds()), nil
	})
	if err != nil {
		return err
	}
	b.report(fmt.Sprintf("start_cuda_no_shim_%dproc_total", procs), p.off/1e6, "ms total", info(""))
	b.report(fmt.Sprintf("start_cuda_shim_%dproc_total", procs), p.on/1e6, "ms total", info(""))
	b.report(fmt.Sprintf("attach_%dproc_total_extra", procs), p.diff/1e6, "ms total", atMost(50, fmt.Sprintf("(%d processes at once; median of %d paired rounds)", procs, b.startRounds)))
	b.report(fmt.Sprintf("attach_%dproc_total_extra_spread", procs), p.spread/1e6, "ms total", info("(interquartile range)"))
	return nil
}

// splits are the cores of the share cases: n instances saturating one GPU.
var splits = map[int][]int{2: {30, 70}, 3: {20, 30, 50}, 4: {10, 20, 30, 40}, 8: {5, 5, 10, 10, 15, 15, 20, 20}}

// mixedKernels are the kernel lengths (µs) of the mixed cases, instance i
// taking mixedKernels[i % len]: 50 µs to 8 ms side by side.
var mixedKernels = []int{100, 8000, 500, 2000, 50, 1000, 200, 5000}

// shareError reports, per policy and device model, the worst share error
// of n instances with equal kernels (200 µs; n = 2, 3, 4, 8) and with mixed
// kernel lengths (n = 2, 8: share_error_<policy>_<model>_<n>_mixed).
func (b *bench) shareError() error {
	for _, m := range b.models {
		name := strings.ReplaceAll(m, ":", "")
		for _, p := range []policy.Policy{policy.FixedShare, policy.GuaranteedBurstShare, policy.NativeBurstShare} {
			for _, k := range []int{2, 3, 4, 8} {
				worst, err := b.shareCase(p, m, splits[k], nil)
				if err != nil {
					return err
				}
				b.report(fmt.Sprintf("share_error_%s_%s_%d", p, name, k), worst, "points", atMost(2, ""))
			}
			for _, k := range []int{2, 8} {
				worst, err := b.shareCase(p, m, splits[k], mixedKernels)
				if err != nil {
					return err
				}
				b.report(fmt.Sprintf("share_error_%s_%s_%d_mixed", p, name, k), worst, "points", atMost(2, ""))
			}
		}
	}
	return nil
}

// shareCase runs saturating workloads with the given cores and returns the
// largest |achieved − target| in points. Targets: fixed and guaranteed, the
// core (Σ = 100); native, core/Σcore.
//
// kernels (µs, by instance modulo its length) nil means 200 µs for all.
func (b *bench) shareCase(p policy.Policy, model string, cores, kernels []int) (float64, error) {
	n, err := harness.NewNode(harness.NodeConfig{Policies: map[int]policy.Policy{0: p}, DeviceModel: model})
	if err != nil {
		return 0, err
	}
	defer func() { _ = n.Close() }()
	if err := n.StartEnforcer(0); err != nil {
		return 0, err
	}
	secs := (b.window + 4*time.Second).Seconds()
	jobs := make([]*harness.Job, len(cores))
	sum := 0
	for i, c := range cores {
		sum += c
		k, depth := 200, 16
		if kernels != nil {
			k = kernels[i%len(kernels)]
			depth = max(2, 4000/k) // about 4 ms of work in flight
		}
		j, err := n.Start(harness.RunSpec{Device: 0, Core: c, MemoryMiB: 1024,
			Args: []string{"compute", "--api", "launch", "--kernel-us", strconv.Itoa(k), "--depth", strconv.Itoa(depth), "--seconds", fmt.Sprintf("%.1f", secs)}})
		if err != nil {
			return 0, err
		}
		jobs[i] = j
	}
	if err := waitStarted(jobs); err != nil {
		return 0, err
	}
	time.Sleep(time.Second) // settle; the window below is the measurement
	pids := make([]map[int]bool, len(jobs))
	for i, j := range jobs {
		pids[i] = j.Pids()
	}
	a, err := n.Sample()
	if err != nil {
		return 0, err
	}
	time.Sleep(b.window)
	z, err := n.Sample()
	if err != nil {
		return 0, err
	}
	worst := 0.0
	for i, c := range cores {
		target := float64(c)
		if p == policy.NativeBurstShare {
			target = 100 * float64(c) / float64(sum)
		}
		e := harness.Share(a, z, 0, pids[i]) - target
		if e < 0 {
			e = -e
		}
		worst = max(worst, e)
	}
	return worst, nil
}

func waitStarted(jobs []*harness.Job) error {
	for _, j := range jobs {
		if err := j.WaitStarted(20 * time.Second); err != nil {
			return err
		}
	}
	return nil
}

// reclaim: guaranteed-burst 30/70 with the 70 idle; the time from the 70's
// first launch until its share over the last 20 ms reaches 68 %.
func (b *bench) reclaim() error {
	var starts, ends []float64
	for r := 0; r < 3; r++ {
		st, end, err := reclaimOnce()
		if err != nil {
			return err
		}
		starts, ends = append(starts, st), append(ends, end)
	}
	b.report("reclaim_idle_to_busy", median(starts), "ms", atMost(20, "(until a 20 ms window of >= 68 % begins)"))
	b.report("reclaim_idle_to_busy_window_end", median(ends), "ms", info("(until that window ends)"))
	return nil
}

// reclaimWindow is the window over which the resumed instance's share is
// judged.
const reclaimWindow = 20 * time.Millisecond

// reclaimOnce measures how long a guaranteed 70 that resumes after idling
// beside a busy 30 takes to run at its share again: from its first launch
// (stamped by the workload) until the first window of reclaimWindow in
// which it gets >= 68 % of the device begins (start), and until that
// window ends (end). The device is sampled throughout, from before the
// resumption, so that a window may begin at it.
func reclaimOnce() (start, end float64, err error) {
	n, err := harness.NewNode(harness.NodeConfig{Policies: map[int]policy.Policy{0: policy.GuaranteedBurstShare}})
	if err != nil {
		return 0, 0, err
	}
	defer func() { _ = n.Close() }()
	if err := n.StartEnforcer(0); err != nil {
		return 0, 0, err
	}
	a, err := n.Start(harness.RunSpec{Device: 0, Core: 30, MemoryMiB: 1024,
		Args: []string{"compute", "--api", "launch", "--kernel-us", "100", "--depth", "16", "--seconds", "8"}})
	if err != nil {
		return 0, 0, err
	}
	bj, err := n.Start(harness.RunSpec{Device: 0, Core: 70, MemoryMiB: 1024,
		Args: []string{"compute", "--api", "launch", "--kernel-us", "100", "--depth", "16", "--seconds", "4", "--idle-ms", "2000"}})
	if err != nil {
		return 0, 0, err
	}
	if err := waitStarted([]*harness.Job{a}); err != nil {
		return 0, 0, err
	}
	var (
		resumed time.Time // its first launch, stamped by the workload
		known   bool
		hist    []harness.Sample
	)
	for t0 := time.Now(); !known || time.Since(resumed) < 2*time.Second; {
		if time.Since(t0) > 20*time.Second {
			return 0, 0, fmt.Errorf("the 70 has not resumed")
		}
		s, err := n.Sample()
		if err != nil {
			return 0, 0, err
		}
		hist = append(hist, s)
		if !known {
			resumed, known = harness.StartedAt(bj.Output())
		}
	}
	pids := bj.Pids()
	for i, j := 0, 0; i < len(hist); i++ {
		if hist[i].At.Before(resumed) {
			continue
		}
		for j = max(j, i); j < len(hist) && hist[j].At.Sub(hist[i].At) < reclaimWindow; j++ {
		}
		if j == len(hist) {
			break
		}
		if harness.Share(hist[i], hist[j], 0, pids) >= 68 {
			ms := func(t time.Time) float64 { return float64(t.Sub(resumed).Microseconds()) / 1000 }
			return ms(hist[i].At), ms(hist[j].At), nil
		}
	}
	return 0, 0, fmt.Errorf("the 70 never reached 68%% within 2 s of resuming")
}

// enforcerCPU: the enforcer's CPU use idle (no instance) and with 16 busy
// instances, from /proc/<pid>/stat over a window.
func (b *bench) enforcerCPU() error {
	n, err := harness.NewNode(harness.NodeConfig{MaxInstances: 16})
	if err != nil {
		return err
	}
	defer func() { _ = n.Close() }()
	if err := n.StartEnforcer(0); err != nil {
		return err
	}
	idle, err := cpuOver(n.EnforcerPID(0), 3*time.Second)
	if err != nil {
		return err
	}
	b.report("enforcer_cpu_idle", idle, "% of a core", info(""))
	if _, err := startBusy16(n, 17); err != nil {
		return err
	}
	// 10 s: the process's CPU time is counted in clock ticks (10 ms).
	busy, err := cpuOver(n.EnforcerPID(0), 10*time.Second)
	if err != nil {
		return err
	}
	b.report("enforcer_cpu_16_busy", busy, "% of a core", atMost(1.5, ""))
	return nil
}

// scaleInstances is the size of the scale section's device.
const scaleInstances = 64

// scaleCore is the core of scale instance i: 36 of 2 and 28 of 1, the
// whole device (100) in 64 instances.
func scaleCore(i int) int {
	if i < 36 {
		return 2
	}
	return 1
}

// scale: 64 fixed-share instances (scaleCore: the whole device), one
// process each, saturating with short kernels (100 µs): the enforcer's CPU
// (beside enforcer_cpu_16_busy, so that its growth with instances shows;
// the arbiter's own tick at 64 instances is arbiter_tick_64_instances) and
// the worst share error over the window.
func (b *bench) scale() error {
	n, err := harness.NewNode(harness.NodeConfig{MaxInstances: scaleInstances})
	if err != nil {
		return err
	}
	defer func() { _ = n.Close() }()
	if err := n.StartEnforcer(0); err != nil {
		return err
	}
	// 10 s at least: the process's CPU time is counted in clock ticks
	// (10 ms); starting 64 processes takes a while on a small machine.
	win := max(b.window, 10*time.Second)
	secs := win + 30*time.Second
	var jobs []*harness.Job
	defer func() {
		for _, j := range jobs {
			j.Kill()
		}
	}()
	for i := range scaleInstances {
		j, err := n.Start(harness.RunSpec{Device: 0, Core: scaleCore(i), MemoryMiB: 256,
			Args: []string{"compute", "--api", "launch", "--kernel-us", "100", "--depth", "4", "--seconds", fmt.Sprintf("%.0f", secs.Seconds())}})
		if err != nil {
			return err
		}
		jobs = append(jobs, j)
	}
	if err := waitStarted(jobs); err != nil {
		return err
	}
	time.Sleep(time.Second) // settle; the window below is the measurement
	pids := make([]map[int]bool, len(jobs))
	for i, j := range jobs {
		pids[i] = j.Pids()
	}
	pid := n.EnforcerPID(0)
	c0, err := cpuSeconds(pid)
	if err != nil {
		return err
	}
	a, err := n.Sample()
	if err != nil {
		return err
	}
	time.Sleep(win)
	z, err := n.Sample()
	if err != nil {
		return err
	}
	c1, err := cpuSeconds(pid)
	if err != nil {
		return err
	}
	wall := z.At.Sub(a.At).Seconds()
	worst := 0.0
	for i := range jobs {
		worst = max(worst, math.Abs(harness.Share(a, z, 0, pids[i])-float64(scaleCore(i))))
	}
	b.report(fmt.Sprintf("scale_%d_enforcer_cpu", scaleInstances), 100*(c1-c0)/wall, "% of a core", info(fmt.Sprintf("(%d busy instances)", scaleInstances)))
	b.report(fmt.Sprintf("scale_%d_device_busy", scaleInstances), harness.Share(a, z, 0, nil), "%", info(""))
	b.report(fmt.Sprintf("scale_%d_share_error", scaleInstances), worst, "points", atMost(2, "(worst instance)"))
	return nil
}

// startBusy16 starts 16 saturating instances of 6 % on device 0 for the
// given seconds and waits until each launches; the jobs started so far are
// returned also with an error.
func startBusy16(n *harness.Node, seconds int) ([]*harness.Job, error) {
	var jobs []*harness.Job
	for range 16 {
		j, err := n.Start(harness.RunSpec{Device: 0, Core: 6, MemoryMiB: 1024,
			Args: []string{"compute", "--api", "launch", "--kernel-us", "500", "--depth", "4", "--seconds", strconv.Itoa(seconds)}})
		if err != nil {
			return jobs, err
		}
		jobs = append(jobs, j)
	}
	return jobs, waitStarted(jobs)
}

func cpuOver(pid int, d time.Duration) (float64, error) {
	t0, err := cpuSeconds(pid)
	if err != nil {
		return 0, err
	}
	start := time.Now()
	time.Sleep(d)
	t1, err := cpuSeconds(pid)
	if err != nil {
		return 0, err
	}
	return 100 * (t1 - t0) / time.Since(start).Seconds(), nil
}

// cpuSeconds is the CPU time (user + system) process pid has used, from
// /proc/<pid>/stat (clock ticks of 10 ms).
func cpuSeconds(pid int) (float64, error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	s := string(raw)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	u, _ := strconv.ParseFloat(f[11], 64)
	k, _ := strconv.ParseFloat(f[12], 64)
	const hz = 100 // USER_HZ on Linux
	return (u + k) / hz, nil
}

// hookCost measures what the OCI hooks add to a container's creation and
// removal (test/e2e.HookBench: containers with and without the hooks,
// interleaved, in one run), with containerd 2.x (ctr), podman and a Docker
// engine. It needs
// root and the engines (test/e2e/deps.sh); without them the section says so
// on stderr and reports nothing.
func (b *bench) hookCost() error {
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "mgpu-bench: hook: skipped: containers need root")
		return nil
	}
	for _, engine := range []string{"ctr", "podman", "docker"} {
		switch engine {
		case "ctr", "docker":
			if _, err := e2e.ContainerdBinaries(); err != nil {
				fmt.Fprintf(os.Stderr, "mgpu-bench: hook: %s skipped: %v\n", engine, err)
				continue
			}
			if _, _, err := e2e.DockerBinaries(); engine == "docker" && err != nil {
				fmt.Fprintf(os.Stderr, "mgpu-bench: hook: docker skipped: %v\n", err)
				continue
			}
		case "podman":
			if _, err := exec.LookPath("podman"); err != nil {
				fmt.Fprintln(os.Stderr, "mgpu-bench: hook: podman skipped: podman is not installed (test/e2e/deps.sh)")
				continue
			}
		}
		res, err := e2e.HookBench(context.Background(), e2e.HookBenchOptions{N: b.hookN, Engine: engine})
		if err != nil {
			return err
		}
		ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
		b.report("hook_create_"+engine+"_without", ms(e2e.Median(res.CreateWithout)), "ms/container", info(""))
		b.report("hook_create_"+engine+"_with", ms(e2e.Median(res.CreateWith)), "ms/container", info(""))
		b.report("hook_create_overhead_"+engine, ms(res.CreateOverhead()), "ms/container", atMost(20, ""))
		b.report("hook_remove_overhead_"+engine, ms(res.RemoveOverhead()), "ms/container", info(""))
	}
	return nil
}

// priority is online/offline co-location (issues 18 and 35): an online
// instance serving requests (a burst of 10 kernels of 200 µs every 5 ms:
// 40 % of the device) alone, beside a saturating offline instance (kernels
// of 200 µs), and beside a saturating online neighbour of fixed-share 40
// (the same kernels), on a device of fixed-share with
// online_offline_switch 1 and 2, under each device model. One server runs
// throughout and the other instance is started and killed every second
// beside it, b.serveSecs a side (about 3,800 requests each at the default
// 20 s); each request counts on the side its arrival falls in, so that the
// machine's slow spells, which last seconds, weigh on every side alike.
//
// What mgpu controls is measured on the device's own timeline (fakecuda's
// record of kernel runs): for each request, the device time the other
// instance's kernels ran between the request's first launch and the end of
// its last kernel (priority_..._delay_...: p50, p99, max), with the bound
// docs/arbiter.md states for the offline side at p99; the offline
// instance's part of the device time the server leaves idle and the
// device's busy time (budgets under switch 1; switch 2's trade-off is
// reported). Beside them, the request latency by the server's own clock
// (p50, p90, p99 and the ratios to alone), which includes how the host
// schedules the simulated device's and the workloads' threads on its two
// CPUs: reported, not judged.
func (b *bench) priority() error {
	// online_offline_switch 1 (offline instances keep their queue bound)
	// and 2 (latency first: one offline kernel in flight beside an online
	// instance), reported as priority_... and priority_latency_first_...
	for _, sw := range []int{1, 2} {
		pre := "priority_"
		if sw == 2 {
			pre = "priority_latency_first_"
		}
		for _, m := range b.models {
			name := strings.ReplaceAll(m, ":", "")
			n, err := harness.NewNode(harness.NodeConfig{Policies: map[int]policy.Policy{0: policy.FixedShare}, DeviceModel: m, OnlineOffline: sw})
			if err != nil {
				return err
			}
			res, err := b.priorityCase(n)
			_ = n.Close()
			if err != nil {
				return fmt.Errorf("online_offline_switch %d, model %s: %w", sw, m, err)
			}
			ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
			bound := harness.OfflineDelayBound(sw, priorityKernel)
			for i, p := range []string{"p50", "p99", "max"} {
				g := info("(device timeline)")
				if p == "p99" {
					g = atMost(ms(bound), "(device timeline; docs/arbiter.md)")
				}
				b.report(pre+"offline_delay_"+p+"_"+name, ms(res.delay[0][i]), "ms", g)
			}
			for i, p := range []string{"p50", "p99", "max"} {
				b.report(pre+"neighbour_delay_"+p+"_"+name, ms(res.delay[1][i]), "ms", info("(device timeline; an online fixed-share 40 in place of the offline instance)"))
			}
			b.report(pre+"requests_beside_offline_"+name, float64(res.n[1]), "requests", info(""))
			b.report(pre+"requests_beside_neighbour_"+name, float64(res.n[2]), "requests", info(""))
			fill, busy := atLeast(80, ""), atLeast(95, "")
			if sw == 2 {
				fill, busy = info("(switch 2's trade-off)"), info("(switch 2's trade-off)")
			}
			b.report(pre+"offline_of_idle_"+name, res.offlineOfIdle, "%", fill)
			b.report(pre+"device_busy_"+name, res.busy, "%", busy)
			for i, p := range []string{"p50", "p90", "p99"} {
				b.report(pre+"online_"+p+"_alone_"+name, res.alone[i], "ms", info("(host clock)"))
				b.report(pre+"online_"+p+"_beside_offline_"+name, res.beside[i], "ms", info("(host clock)"))
			}
			b.report(pre+"online_requests_alone_"+name, float64(res.n[0]), "requests", info(""))
			b.report(pre+"online_p50_ratio_"+name, res.beside[0]/res.alone[0], "x", info("(host clock: includes the host's scheduling)"))
			b.report(pre+"online_p99_ratio_"+name, res.beside[2]/res.alone[2], "x", info("(host clock: includes the host's scheduling)"))
		}
	}
	return nil
}

type priorityResult struct {
	alone, beside [3]float64          // host clock: p50, p90, p99 (ms)
	delay         [2][3]time.Duration // device timeline, beside offline and beside the neighbour: p50, p99, max
	n             [3]int              // requests alone, beside offline, beside the neighbour
	offlineOfIdle float64             // percent of the time the online instance leaves
	busy          float64             // percent
}

// serveLatency matches one request's latency in mgpu-workload serve --raw.
var serveLatency = regexp.MustCompile(`(?m)^lat_us=([0-9]+)$`)

// percentile is the p-th percentile (nearest rank) of v, sorted.
func percentile(v []float64, p float64) float64 {
	if len(v) == 0 {
		return 0
	}
	k := int(math.Ceil(p / 100 * float64(len(v))))
	return v[min(max(k, 1), len(v))-1]
}

func (b *bench) priorityCase(n *harness.Node) (priorityResult, error) {
	var r priorityResult
	if err := n.StartEnforcer(0); err != nil {
		return r, err
	}
	// One server runs throughout; the other instance comes and goes every
	// priorityTurn, and each request counts on the side its arrival falls
	// in. Turns this short let the machine's slow spells (seconds long)
	// fall on every side alike.
	turns := max(1, int(math.Ceil(b.serveSecs/priorityTurn.Seconds())))
	limit := float64(turns)*3*(priorityTurn.Seconds()+3) + 10 // a bound only: SIGTERM ends it
	srv, err := n.Start(harness.RunSpec{Device: 0, Core: 60, MemoryMiB: 1024, Class: "online",
		Args: []string{"serve", "--kernel-us", strconv.Itoa(int(priorityKernel.Microseconds())), "--burst", "10", "--period-ms", strconv.Itoa(priorityPeriodMs),
			"--seconds", strconv.FormatFloat(limit, 'f', 0, 64), "--raw"}})
	if err != nil {
		return r, err
	}
	defer func() {
		select {
		case <-srv.Done():
		default:
			srv.Kill()
		}
	}()
	if err := srv.WaitStarted(20 * time.Second); err != nil {
		return r, err
	}
	srvPids := srv.Pids()
	t0, err := startMono(srv.Output())
	if err != nil {
		return r, err
	}
	log, err := n.FollowKernels(0)
	if err != nil {
		return r, err
	}
	defer func() { _, _ = log.Stop() }()
	var alone, beside, nextTo []window
	offPids, nbPids := map[int]bool{}, map[int]bool{}
	var on, off, busy float64
	// side runs the other instance for one turn and returns its processes
	// and the window.
	side := func(spec harness.RunSpec, measure bool) (map[int]bool, window, error) {
		job, err := n.Start(spec)
		if err != nil {
			return nil, window{}, err
		}
		defer func() {
			job.Kill()
			_ = job.Wait()
		}()
		if err := job.WaitStarted(20 * time.Second); err != nil {
			return nil, window{}, err
		}
		a, err := n.Sample()
		if err != nil {
			return nil, window{}, err
		}
		s := monoNow()
		time.Sleep(priorityTurn)
		e := monoNow()
		z, err := n.Sample()
		if err != nil {
			return nil, window{}, err
		}
		pids := job.Pids()
		if measure {
			all := harness.Share(a, z, 0, nil)
			o := harness.Share(a, z, 0, pids)
			on += all - o
			off += o
			busy += all
		}
		return pids, window{s, e}, nil
	}
	saturating := []string{"compute", "--api", "launch", "--kernel-us", strconv.Itoa(int(priorityKernel.Microseconds())), "--depth", "16", "--seconds", "60"}
	for range turns {
		s := monoNow() + int64(priorityTurnSettle)
		time.Sleep(priorityTurn)
		alone = append(alone, window{s, monoNow()})
		pids, w, err := side(harness.RunSpec{Device: 0, Core: 100, MemoryMiB: 1024, Class: "offline", Args: saturating}, true)
		if err != nil {
			return r, err
		}
		maps.Copy(offPids, pids)
		beside = append(beside, w)
		pids, w, err = side(harness.RunSpec{Device: 0, Core: 40, MemoryMiB: 1024, Class: "online", Args: saturating}, false)
		if err != nil {
			return r, err
		}
		maps.Copy(nbPids, pids)
		nextTo = append(nextTo, w)
	}
	if err := srv.Cmd.Process.Signal(unix.SIGTERM); err != nil {
		return r, err
	}
	select {
	case <-srv.Done():
	case <-time.After(30 * time.Second):
		return r, errors.New("serve did not end on SIGTERM")
	}
	runs, err := log.Stop()
	if err != nil {
		return r, err
	}
	out := srv.Output()
	lat := serveLatency.FindAllStringSubmatch(out, -1)
	reqs, err := harness.ParseRequests(out)
	if err != nil {
		return r, err
	}
	if len(lat) == 0 || len(reqs) != len(lat) {
		return r, fmt.Errorf("serve printed %d latencies and %d request lines: %s", len(lat), len(reqs), out)
	}
	var la, lb []float64
	var rb, rn []harness.Request
	for i, m := range lat {
		us, _ := strconv.ParseFloat(m[1], 64)
		at := t0 + int64(i)*int64(priorityPeriodMs)*int64(time.Millisecond)
		switch {
		case within(alone, at):
			la = append(la, us/1000)
		case within(beside, at):
			lb = append(lb, us/1000)
			rb = append(rb, reqs[i])
		case within(nextTo, at):
			rn = append(rn, reqs[i])
		}
	}
	if len(la) == 0 || len(lb) == 0 || len(rn) == 0 {
		return r, fmt.Errorf("%d requests alone, %d beside the offline instance, %d beside the neighbour", len(la), len(lb), len(rn))
	}
	sort.Float64s(la)
	sort.Float64s(lb)
	for i, p := range []float64{50, 90, 99} {
		r.alone[i], r.beside[i] = percentile(la, p), percentile(lb, p)
	}
	isSrv := func(p int) bool { return srvPids[p] }
	for k, c := range []struct {
		reqs  []harness.Request
		other map[int]bool
	}{{rb, offPids}, {rn, nbPids}} {
		d, err := harness.DeviceDelays(runs, isSrv, func(p int) bool { return c.other[p] }, c.reqs, log.From)
		if err != nil {
			return r, err
		}
		copy(r.delay[k][:], harness.Percentiles(d, 50, 99, 100))
	}
	r.n = [3]int{len(la), len(lb), len(rn)}
	k := float64(turns)
	on, off, r.busy = on/k, off/k, busy/k
	if on < 100 {
		r.offlineOfIdle = 100 * off / (100 - on)
	}
	return r, nil
}

const (
	priorityPeriodMs = 5 // the server's request period
	// priorityKernel is the length of every kernel of the priority cases.
	priorityKernel = 200 * time.Microsecond
	// priorityTurn is how long each side lasts before the next one's turn.
	priorityTurn = time.Second
	// priorityTurnSettle is left out at the start of a turn alone: the
	// other process just killed may still have kernels on the device.
	priorityTurnSettle = 20 * time.Millisecond
	// priorityTail is left out at the end of every turn: a request that
	// arrives later may run into the next turn.
	priorityTail = 30 * time.Millisecond
)

// window is a span of CLOCK_MONOTONIC, in ns.
type window struct{ from, to int64 }

// within reports whether a request arriving at t counts in one of ws: it
// arrived in it, priorityTail or more before its end.
func within(ws []window, t int64) bool {
	for _, w := range ws {
		if t >= w.from && t < w.to-int64(priorityTail) {
			return true
		}
	}
	return false
}

// monoNow is CLOCK_MONOTONIC in ns, the clock of the workload's mono_ns.
func monoNow() int64 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return ts.Nano()
}

var startLine = regexp.MustCompile(`(?m)^start mono_ns=([0-9]+)$`)

// startMono is the mono_ns of a workload's start line.
func startMono(out string) (int64, error) {
	m := startLine.FindStringSubmatch(out)
	if m == nil {
		return 0, fmt.Errorf("no start line in %q", out)
	}
	return strconv.ParseInt(m[1], 10, 64)
}
