package k8s

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"
)

// component is one process of the cluster (etcd, an apiserver, ...),
// logging to its own file, which restarts append to.
type component struct {
	name string
	path string
	args []string
	env  []string // nil: the test's environment
	log  string

	cmd    *exec.Cmd
	exited chan struct{} // closed once the process has been waited for
}

// start runs the component; its output goes to its log file.
func (p *component) start() error {
	logf, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	_, _ = fmt.Fprintf(logf, "=== %s start %s: %s %s\n", p.name, time.Now().Format(time.RFC3339Nano), p.path, strings.Join(p.args, " "))
	cmd := exec.Command(p.path, p.args...) //nolint:gosec // the cluster's own binaries
	cmd.Env = p.env
	cmd.Stdout, cmd.Stderr = logf, logf
	// Nothing of the cluster outlives a test binary that dies.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		_ = logf.Close()
		return fmt.Errorf("k8s: start %s: %w", p.name, err)
	}
	p.cmd, p.exited = cmd, make(chan struct{})
	go func() {
		_ = cmd.Wait() // its ProcessState says how it ended
		_ = logf.Close()
		close(p.exited)
	}()
	return nil
}

// running reports whether the component was started and has not exited.
func (p *component) running() bool {
	if p == nil || p.cmd == nil {
		return false
	}
	select {
	case <-p.exited:
		return false
	default:
		return true
	}
}

// checkRunning is an error, ready for harness.Permanent, once the
// component has exited.
func (p *component) checkRunning() error {
	if p.running() {
		return nil
	}
	return fmt.Errorf("%s exited (%s); log %s:\n%s", p.name, p.cmd.ProcessState, p.log, tail(p.log, 3000))
}

// stop sends SIGTERM and waits grace for the exit, then SIGKILLs.
func (p *component) stop(grace time.Duration) error {
	if !p.running() {
		return nil
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
		return nil
	case <-time.After(grace):
	}
	_ = p.cmd.Process.Kill()
	select {
	case <-p.exited:
		return fmt.Errorf("k8s: %s ignored SIGTERM for %v, killed", p.name, grace)
	case <-time.After(10 * time.Second):
		return fmt.Errorf("k8s: %s (pid %d) survived SIGKILL", p.name, p.cmd.Process.Pid)
	}
}

// tail is the end of a file, at most n bytes, from a line start.
func tail(path string, n int) string {
	data, err := os.ReadFile(path) //nolint:gosec // the cluster's own log
	if errors.Is(err, os.ErrNotExist) {
		return "(no log)"
	}
	if len(data) > n {
		data = data[len(data)-n:]
		if i := strings.IndexByte(string(data), '\n'); i >= 0 {
			data = data[i+1:]
		}
	}
	return string(data)
}
