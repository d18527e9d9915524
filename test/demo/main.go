// Command mgpu-demo is `make demo`: on a simulated node it starts an
// enforcer, runs workloads with different quotas under each compute policy
// in turn, shows the shares they achieve while they run, and ends with a
// table of target against achieved. Everything it starts lives under a
// temporary directory and is removed at the end (also on Ctrl-C).
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/internal/policy"
	"github.com/mgpu-dev/mgpu/test/fakecuda"
	"github.com/mgpu-dev/mgpu/test/harness"
)

// phase is a stretch of a scenario with fixed targets (percent of device
// time per workload; -1: the workload is not running).
type phase struct {
	name    string
	length  time.Duration
	targets []float64
}

type workload struct {
	label string
	core  int
	delay time.Duration // idle before the first launch
	run   time.Duration // how long it launches; 0: until the scenario ends
	class string        // priority class ("": online)
}

type scenario struct {
	title     string
	policy    policy.Policy
	workloads []workload
	phases    []phase
	// onlineOffline runs the device with online_offline_switch = 1; the
	// results are labelled online/offline instead of the policy.
	onlineOffline bool
	// kernelUS, when set, replaces --kernel-us for the scenario.
	kernelUS int
}

// label names the scenario in the results table.
func (sc scenario) label() string {
	if sc.onlineOffline {
		return "online/offline"
	}
	return sc.policy.String()
}

type result struct {
	scenario, phase, label string
	target, achieved       float64
}

func scenarios(unit time.Duration) []scenario {
	return []scenario{
		{
			title:  "fixed-share 20/30/50: each capped at its core",
			policy: policy.FixedShare,
			workloads: []workload{
				{"core 20", 20, 0, 0, ""}, {"core 30", 30, 0, 0, ""}, {"core 50", 50, 0, 0, ""},
			},
			phases: []phase{{"all busy", 4 * unit, []float64{20, 30, 50}}},
		},
		{
			title:  "guaranteed-burst-share 30/70: the 30 bursts when the 70 goes idle",
			policy: policy.GuaranteedBurstShare,
			workloads: []workload{
				// The 70 stops a little after the first phase ends; the
				// second phase's settling time covers the gap.
				{"core 30", 30, 0, 0, ""}, {"core 70", 70, 0, 3*unit + 300*time.Millisecond, ""},
			},
			phases: []phase{
				{"both busy", 3 * unit, []float64{30, 70}},
				{"70 idle", 3 * unit, []float64{100, -1}},
			},
		},
		{
			title:  "native-burst-share weights 1:3: time in proportion to weight",
			policy: policy.NativeBurstShare,
			workloads: []workload{
				{"weight 1", 1, 0, 0, ""}, {"weight 3", 3, 0, 0, ""},
			},
			phases: []phase{{"both busy", 4 * unit, []float64{25, 75}}},
		},
		{
			// Kernels of 200 µs: an offline instance's queue bound is
			// 500 µs, and with kernels as long as that it runs one at a
			// time and loses throughput (docs/arbiter.md).
			title:  "online/offline on fixed-share, kernels of 200 µs: online 30 and 40 as if alone, the offline one takes the rest",
			policy: policy.FixedShare, onlineOffline: true, kernelUS: 200,
			workloads: []workload{
				// The online 40 stops a little after the first phase
				// ends: its time goes to the offline one, not to the 30.
				{"online 30", 30, 0, 0, ""}, {"online 40", 40, 0, 3*unit + 300*time.Millisecond, ""}, {"offline", 50, 0, 0, "offline"},
			},
			phases: []phase{
				{"all busy", 3 * unit, []float64{30, 40, 30}},
				{"40 idle", 3 * unit, []float64{30, -1, 70}},
			},
		},
	}
}

func main() {
	unit := flag.Duration("unit", 2*time.Second, "length unit of the scenarios (each lasts 4-6 units)")
	kernel := flag.Int("kernel-us", 500, "kernel length of the workloads, microseconds")
	model := flag.String("device-model", "slice", "how the simulated GPU interleaves processes: slice, timer (2 ms), timer:1ms, kernel (test/fakecuda/README.md)")
	flag.Parse()
	if _, _, err := fakecuda.ParseModel(*model); err != nil {
		fmt.Fprintf(os.Stderr, "mgpu-demo: --device-model: %v\n", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Stdout, *unit, *kernel, *model); err != nil {
		fmt.Fprintf(os.Stderr, "mgpu-demo: %v\n", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, w io.Writer, unit time.Duration, kernelUS int, model string) error {
	tty := isTTY(w)
	fmt.Fprintf(w, "simulated GPU: device model %s, kernels of %d µs\n", model, kernelUS)
	var results []result
	for _, sc := range scenarios(unit) {
		fmt.Fprintf(w, "\n== %s\n", sc.title)
		r, err := runScenario(ctx, w, tty, sc, kernelUS, model)
		if err != nil {
			return fmt.Errorf("%s: %w", sc.policy, err)
		}
		results = append(results, r...)
	}
	fmt.Fprintf(w, "\n== target vs achieved (share of the simulated GPU's time, measured by the device)\n\n")
	fmt.Fprintf(w, "%-24s %-10s %-9s %7s %9s %6s\n", "policy", "phase", "workload", "target", "achieved", "error")
	worst := 0.0
	for _, r := range results {
		e := r.achieved - r.target
		worst = max(worst, abs(e))
		fmt.Fprintf(w, "%-24s %-10s %-9s %6.1f%% %8.2f%% %+6.2f\n", r.scenario, r.phase, r.label, r.target, r.achieved, e)
	}
	fmt.Fprintf(w, "\nlargest error: %.2f points (the normative tolerance is 2)\n", worst)
	return nil
}

func runScenario(ctx context.Context, w io.Writer, tty bool, sc scenario, kernelUS int, model string) ([]result, error) {
	if sc.kernelUS > 0 {
		kernelUS = sc.kernelUS
	}
	nc := harness.NodeConfig{Policies: map[int]policy.Policy{0: sc.policy}, DeviceModel: model}
	if sc.onlineOffline {
		nc.OnlineOffline = 1
	}
	n, err := harness.NewNode(nc)
	if err != nil {
		return nil, err
	}
	defer func() { _ = n.Close() }()
	if err := n.StartEnforcer(0); err != nil {
		return nil, err
	}
	total := 2 * time.Second
	for _, ph := range sc.phases {
		total += ph.length
	}
	jobs := make([]*harness.Job, len(sc.workloads))
	for i, wl := range sc.workloads {
		length := wl.run
		if length == 0 {
			length = total
		}
		args := []string{"compute", "--api", "launch", "--kernel-us", strconv.Itoa(kernelUS), "--depth", "8",
			"--seconds", fmt.Sprintf("%.2f", length.Seconds())}
		if wl.delay > 0 {
			args = append(args, "--idle-ms", strconv.Itoa(int(wl.delay/time.Millisecond)))
		}
		j, err := n.Start(harness.RunSpec{Name: wl.label, Device: 0, Core: wl.core, MemoryMiB: 4096, Class: wl.class, Args: args})
		if err != nil {
			return nil, err
		}
		jobs[i] = j
	}
	for _, j := range jobs {
		if err := harness.WaitFor(15*time.Second, func() error {
			if strings.Contains(j.Output(), "start") {
				return nil
			}
			select {
			case <-j.Done():
				return fmt.Errorf("%s exited: %s", j.Spec.Name, strings.TrimSpace(j.Output()))
			default:
				return fmt.Errorf("%s has not started", j.Spec.Name)
			}
		}); err != nil {
			return nil, err
		}
	}
	pids := make([]map[int]bool, len(jobs))
	for i, j := range jobs {
		pids[i] = j.Pids()
	}
	var results []result
	lines := 0
	for _, ph := range sc.phases {
		settle := min(ph.length/3, time.Second)
		start, err := n.Sample()
		if err != nil {
			return nil, err
		}
		prev := start
		var begin harness.Sample
		deadline := start.At.Add(ph.length)
		for {
			select {
			case <-ctx.Done():
				return nil, ctx.Err()
			case <-time.After(250 * time.Millisecond):
			}
			s, err := n.Sample()
			if err != nil {
				return nil, err
			}
			if begin.At.IsZero() && s.At.Sub(start.At) >= settle {
				begin = s
			}
			lines = draw(w, tty, lines, sc, ph, pids, prev, s)
			prev = s
			if !s.At.Before(deadline) {
				break
			}
		}
		for i, t := range ph.targets {
			if t < 0 {
				continue
			}
			results = append(results, result{sc.label(), ph.name, sc.workloads[i].label, t, harness.Share(begin, prev, 0, pids[i])})
		}
	}
	return results, nil
}

// draw shows each workload's share over the last interval as a bar,
// redrawing in place on a terminal and appending lines otherwise.
func draw(w io.Writer, tty bool, lines int, sc scenario, ph phase, pids []map[int]bool, a, b harness.Sample) int {
	var sb strings.Builder
	if tty && lines > 0 {
		fmt.Fprintf(&sb, "\x1b[%dA", lines)
	}
	n := 0
	fmt.Fprintf(&sb, "\x1b[2K  phase %-10s device busy %5.1f%%\n", ph.name, harness.Share(a, b, 0, nil))
	n++
	for i, wl := range sc.workloads {
		share := harness.Share(a, b, 0, pids[i])
		bar := int(share/2 + 0.5)
		bar = max(0, min(bar, 50))
		target := "   -"
		if ph.targets[i] >= 0 {
			target = fmt.Sprintf("%4.0f", ph.targets[i])
		}
		fmt.Fprintf(&sb, "\x1b[2K  %-9s target %s%%  now %5.1f%% |%-50s|\n", wl.label, target, share, strings.Repeat("#", bar))
		n++
	}
	if !tty {
		// Plain output: no cursor movement, no line clearing.
		out := strings.ReplaceAll(sb.String(), "\x1b[2K", "")
		_, _ = io.WriteString(w, out)
		return 0
	}
	_, _ = io.WriteString(w, sb.String())
	return n
}

func isTTY(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS) //nolint:gosec // a file descriptor fits an int
	return err == nil
}

func abs(x float64) float64 {
	if x < 0 {
		return -x
	}
	return x
}
