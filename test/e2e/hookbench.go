package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"time"
)

// HookBenchOptions configure HookBench.
type HookBenchOptions struct {
	// N is the number of containers per variant (default 20).
	N int
	// Engine is "ctr" (default: a private containerd), "podman" or
	// "docker" (a private Docker engine).
	Engine string
	// Log receives the enforcer's output (default: discarded).
	Log io.Writer
	// Installed: measure an installed mgpu (NodeOptions.Installed).
	Installed string
}

// HookBenchResult holds the measured times, one per container, in the
// order they ran. Create is the engine's command that creates and starts a
// detached container (ctr run -d, podman run -d, docker run -d: the
// createRuntime hook runs inside it); Remove is the one that kills and
// removes it (ctr task rm -f + ctr containers rm, podman rm -f, docker rm
// -f: the poststop hook runs inside it).
type HookBenchResult struct {
	Engine                    string
	N                         int
	CreateWith, CreateWithout []time.Duration
	RemoveWith, RemoveWithout []time.Duration
}

// Median of d (0 if empty).
func Median(d []time.Duration) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// CreateOverhead is the median of the paired differences: each container
// with the hooks minus the one without that ran right after it. Pairing
// cancels the drift of a shared machine that a difference of two medians
// keeps (runs of 20 pairs differed by 10 ms that way).
func (r HookBenchResult) CreateOverhead() time.Duration {
	return pairedOverhead(r.CreateWith, r.CreateWithout)
}

// RemoveOverhead is the median of the paired remove-time differences.
func (r HookBenchResult) RemoveOverhead() time.Duration {
	return pairedOverhead(r.RemoveWith, r.RemoveWithout)
}

func pairedOverhead(with, without []time.Duration) time.Duration {
	n := min(len(with), len(without))
	d := make([]time.Duration, n)
	for i := range n {
		d[i] = with[i] - without[i]
	}
	return Median(d)
}

// String is one line of medians.
func (r HookBenchResult) String() string {
	ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
	return fmt.Sprintf("%s, %d containers each: create %.1f ms with the hook, %.1f ms without (paired +%.1f ms); remove %.1f ms with, %.1f ms without (paired +%.1f ms)",
		r.Engine, r.N, ms(Median(r.CreateWith)), ms(Median(r.CreateWithout)), ms(r.CreateOverhead()),
		ms(Median(r.RemoveWith)), ms(Median(r.RemoveWithout)), ms(r.RemoveOverhead()))
}

// HookBench measures what mgpu's OCI hooks cost a container start and
// removal: on one simulated node with its enforcer, two CDI specs of the
// same devices, one with the hooks and one generated with --no-hooks, and N
// containers of each, run one at a time and interleaved (with, without,
// with, ...), so that both variants see the same machine. Each container
// asks for device 0 with core 1 and 1 MiB and runs /bin/sleep; with the
// hooks it must get an instance, without them it must not (checked outside
// the timed commands). Needs root, the build (make build), runc, busybox and,
// for "ctr" and "docker", containerd 2.x, for "docker" dockerd and the
// docker CLI (test/e2e/deps.sh); it cleans up after itself.
func HookBench(ctx context.Context, opts HookBenchOptions) (res HookBenchResult, err error) {
	if opts.N <= 0 {
		opts.N = 20
	}
	if opts.Engine == "" {
		opts.Engine = "ctr"
	}
	res = HookBenchResult{Engine: opts.Engine, N: opts.N}
	if os.Geteuid() != 0 {
		return res, errors.New("e2e: HookBench needs root")
	}
	n, err := NewNode(NodeOptions{Log: opts.Log, Installed: opts.Installed})
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, n.Close()) }()
	if err := n.StartEnforcer(0); err != nil {
		return res, err
	}
	with, err := n.GenerateSpec(true)
	if err != nil {
		return res, err
	}
	without, err := n.GenerateSpec(false)
	if err != nil {
		return res, err
	}
	var eng Engine
	switch opts.Engine {
	case "ctr":
		bin, err := ContainerdBinaries()
		if err != nil {
			return res, err
		}
		cd, err := StartContainerd(bin, filepath.Join(n.Dir, "containerd"), CDISpecDir)
		if err != nil {
			return res, err
		}
		defer func() { err = errors.Join(err, cd.Close()) }()
		c := NewCtr(n, cd)
		defer func() { err = errors.Join(err, c.Cleanup()) }()
		eng = c
	case "podman":
		p, err := NewPodman(n)
		if err != nil {
			return res, err
		}
		defer func() { err = errors.Join(err, p.Cleanup()) }()
		eng = p
	case "docker":
		bin, err := ContainerdBinaries()
		if err != nil {
			return res, err
		}
		dockerd, cli, err := DockerBinaries()
		if err != nil {
			return res, err
		}
		de, err := StartDocker(n, dockerd, cli, bin, filepath.Join(n.Dir, "docker"))
		if err != nil {
			return res, err
		}
		defer func() { err = errors.Join(err, de.Close()) }()
		d := &Docker{N: n, E: de}
		defer func() { err = errors.Join(err, d.Cleanup()) }()
		eng = d
	default:
		return res, fmt.Errorf("e2e: HookBench: unknown engine %q (ctr, podman or docker)", opts.Engine)
	}
	for i := 0; i < 2*opts.N; i++ {
		hooks := i%2 == 0
		kind := without
		if hooks {
			kind = with
		}
		c := Container{ID: fmt.Sprintf("hookbench-%d-%d", os.Getpid(), i), Kind: kind, Devices: []string{"0"},
			Core: "1", Memory: "1", Args: []string{"/bin/sleep", "3600"}}
		t0 := time.Now()
		out, err := eng.Start(ctx, c)
		created := time.Since(t0)
		if err != nil {
			return res, fmt.Errorf("e2e: HookBench: start %s: %w\n%s", c.ID, err, out)
		}
		list, err := n.Instances()
		if err != nil {
			return res, err
		}
		if want := map[bool]int{true: 1, false: 0}[hooks]; len(list) != want {
			return res, fmt.Errorf("e2e: HookBench: %d instances with hooks=%v, want %d", len(list), hooks, want)
		}
		t0 = time.Now()
		if err := eng.Remove(ctx, c.ID); err != nil {
			return res, err
		}
		removed := time.Since(t0)
		if err := Poll(5*time.Second, func() error {
			l, err := n.Instances()
			if err == nil && len(l) != 0 {
				err = fmt.Errorf("%d instances left after removing %s", len(l), c.ID)
			}
			return err
		}); err != nil {
			return res, err
		}
		if hooks {
			res.CreateWith, res.RemoveWith = append(res.CreateWith, created), append(res.RemoveWith, removed)
		} else {
			res.CreateWithout, res.RemoveWithout = append(res.CreateWithout, created), append(res.RemoveWithout, removed)
		}
	}
	return res, nil
}
