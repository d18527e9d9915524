package harness

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/mgpu-dev/mgpu/enforcer/api"
)

// Enforcers runs one mgpu-enforcer process per device of a node's
// configuration, for Node here and for test/e2e's container node.
type Enforcers struct {
	Bin    string                    // mgpu-enforcer
	Config string                    // its --config
	Env    func() []string           // each process's environment (nil: inherited)
	Log    io.Writer                 // stdout and stderr (nil: discarded)
	Client func(dev int) *api.Client // device dev's control API

	mu    sync.Mutex
	procs map[int]*exec.Cmd
}

// Start starts device dev's enforcer and waits until its control API
// answers; an enforcer that exits meanwhile fails it at once.
func (e *Enforcers) Start(dev int) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if c, ok := e.procs[dev]; ok && c.ProcessState == nil {
		return fmt.Errorf("harness: enforcer %d already runs", dev)
	}
	cmd := exec.Command(e.Bin, "--device", strconv.Itoa(dev), "--config", e.Config) //nolint:gosec // the node's binary
	if e.Env != nil {
		cmd.Env = e.Env()
	}
	w := e.Log
	if w == nil {
		w = io.Discard
	}
	cmd.Stdout, cmd.Stderr = w, w
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return err
	}
	if e.procs == nil {
		e.procs = map[int]*exec.Cmd{}
	}
	e.procs[dev] = cmd
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	client := e.Client(dev)
	return WaitFor(10*time.Second, func() error {
		select {
		case <-exited:
			return Permanent(fmt.Errorf("harness: %s --device %d exited: %v", e.Bin, dev, cmd.ProcessState))
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, err := client.List(ctx)
		return err
	})
}

// Stop sends sig to device dev's enforcer and waits until it is gone.
func (e *Enforcers) Stop(dev int, sig syscall.Signal) error {
	e.mu.Lock()
	cmd := e.procs[dev]
	delete(e.procs, dev)
	e.mu.Unlock()
	if cmd == nil {
		return fmt.Errorf("harness: no enforcer for device %d", dev)
	}
	if err := cmd.Process.Signal(sig); err != nil {
		return err
	}
	return WaitFor(10*time.Second, func() error {
		if cmd.Process.Signal(syscall.Signal(0)) == nil {
			return errors.New("enforcer still runs")
		}
		return nil
	})
}

// PID is device dev's enforcer's pid (0 if none runs).
func (e *Enforcers) PID(dev int) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	if c := e.procs[dev]; c != nil && c.Process != nil {
		return c.Process.Pid
	}
	return 0
}

// Close stops every enforcer: SIGTERM, then SIGKILL after 5 s.
func (e *Enforcers) Close() {
	e.mu.Lock()
	procs := e.procs
	e.procs = nil
	e.mu.Unlock()
	for _, c := range procs {
		_ = c.Process.Signal(syscall.SIGTERM)
	}
	for _, c := range procs {
		_ = WaitFor(5*time.Second, func() error {
			if c.Process.Signal(syscall.Signal(0)) == nil {
				return errors.New("running")
			}
			return nil
		})
		_ = c.Process.Kill()
	}
}

// permanent ends WaitFor at once.
type permanent struct{ error }

func (p *permanent) Unwrap() error { return p.error }

// Permanent wraps err so that WaitFor returns it at once instead of
// polling on (the condition can no longer become true).
func Permanent(err error) error { return &permanent{err} }

// WaitFor polls cond every 10 ms until it returns nil, returns an error
// made by Permanent (returned unwrapped), or timeout passes.
func WaitFor(timeout time.Duration, cond func() error) error {
	deadline := time.Now().Add(timeout)
	for {
		err := cond()
		if err == nil {
			return nil
		}
		var p *permanent
		if errors.As(err, &p) {
			return p.error
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("gave up after %v: %w", timeout, err)
		}
		time.Sleep(10 * time.Millisecond) // poll interval, bounded by the deadline
	}
}
