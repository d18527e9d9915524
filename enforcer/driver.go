package enforcer

import (
	"context"
	"fmt"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/mgpu-dev/mgpu/enforcer/backstop"
	"github.com/mgpu-dev/mgpu/internal/config"
)

// The driver backstop (docs/backstop.md): what the driver itself reports
// of the device's processes (NVML), judged against each instance's quota
// and the GPU time the enforcer accounted for it. It is what holds the
// quotas against a process that bypasses the shim or lies in its counters.

// openBackstop loads NVML and makes the watcher; with [backstop] enabled =
// false it does nothing. On the simulated backend a missing NVML library
// (no fakecuda on the library path) turns it off with a warning; on real
// GPUs it is an error, so that a node never runs without it by accident.
func (e *Enforcer) openBackstop() error {
	bc := e.cfg.Backstop
	if !bc.Enabled {
		e.o.log.Info("driver backstop off ([backstop] enabled = false)")
		return nil
	}
	lib := e.o.nvml
	if lib == nil {
		lib = nvml.New()
	}
	if ret := lib.Init(); ret != nvml.SUCCESS {
		err := fmt.Errorf("driver backstop: initialise NVML: %w", ret)
		if e.cfg.Backend == config.BackendSim {
			e.o.log.Warn("driver backstop off: no NVML on the simulated backend", "err", err)
			return nil
		}
		return fmt.Errorf("%w (set [backstop] enabled = false to run without it)", err)
	}
	src, err := backstop.NewNVMLSource(lib, e.index)
	if err != nil {
		_ = lib.Shutdown()
		return fmt.Errorf("driver backstop: %w", err)
	}
	opts := []backstop.Option{
		backstop.WithWindow(bc.Window),
		backstop.WithComputeTolerance(bc.ComputeTolerance),
		backstop.WithMemoryAllowance(bc.MemoryAllowance()),
		backstop.WithAllowanceProcesses(bc.MemoryAllowanceProcesses),
		backstop.WithKiller(backstop.NewPidfdKiller()),
		backstop.WithLogger(e.o.log),
	}
	for k, s := range map[backstop.Kind]string{
		backstop.KindMemory: bc.MemoryOnViolation, backstop.KindCompute: bc.ComputeOnViolation,
		backstop.KindUnattributed: bc.UnattributedOnViolation,
	} {
		a, err := backstop.ParseAction(s)
		if err != nil {
			_ = lib.Shutdown()
			return fmt.Errorf("driver backstop: %w", err)
		}
		opts = append(opts, backstop.WithAction(k, a))
	}
	w, err := backstop.New(src, opts...)
	if err != nil {
		_ = lib.Shutdown()
		return fmt.Errorf("driver backstop: %w", err)
	}
	e.nvml, e.backstop = lib, w
	e.o.log.Info("driver backstop on", "interval", bc.Interval, "window", bc.Window,
		"memory", bc.MemoryOnViolation, "compute", bc.ComputeOnViolation, "unattributed", bc.UnattributedOnViolation)
	return nil
}

// runBackstop checks the driver's view every interval until ctx ends.
func (e *Enforcer) runBackstop(ctx context.Context) {
	if e.backstop == nil {
		return
	}
	t := time.NewTicker(e.cfg.Backstop.Interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		// The watcher logs violations (once per episode) and kills.
		_, _ = e.backstop.Check(monotonic(), e.backstopInstances(), e.attribute)
	}
}

// backstopInstances is the device's instances as the backstop judges them.
func (e *Enforcer) backstopInstances() []backstop.Instance {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]backstop.Instance, 0, len(e.list))
	for _, in := range e.list {
		out = append(out, backstop.Instance{Name: in.name, MemoryQuota: in.memMiB << 20, Accounted: clampDuration(in.gpuTotal())})
	}
	return out
}

// attribution is a remembered answer of attribute.
type attribution struct {
	start, gen uint64 // the process's start time; e.gen when it was found
	name       string
	ok         bool
}

// maxAttributions bounds the remembered answers.
const maxAttributions = 4096

// attribute names the instance a host pid belongs to, as attach does; the
// backstop tells the start time of the process it asks about. The answer
// is remembered for the same process (pid and start time) while the set of
// instances stays the same: a check asks about every process on the device
// four times a second, and the walk up the process tree is the costly
// part.
func (e *Enforcer) attribute(pid int, start uint64) (string, bool) {
	e.mu.Lock()
	if a, ok := e.attrs[pid]; ok && a.start == start && a.gen == e.gen {
		e.mu.Unlock()
		return a.name, a.ok
	}
	e.mu.Unlock()
	info, err := e.inspect(pid)
	if err != nil || info.startTime != start {
		return "", false
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	a := attribution{start: start, gen: e.gen}
	if in := e.matchLocked(info); in != nil {
		a.name, a.ok = in.name, true
	}
	if len(e.attrs) >= maxAttributions {
		clear(e.attrs)
	}
	e.attrs[pid] = a
	return a.name, a.ok
}
