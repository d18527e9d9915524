package harness

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/mgpu-dev/mgpu/enforcer/api"
)

// Shell is a process-tree instance whose root is a shell the test controls:
// every process it spawns belongs to the instance, with the shim preloaded.
type Shell struct {
	Instance api.Instance
	node     *Node
	dev      int
	cmd      *exec.Cmd
	stdin    io.WriteCloser
	stdout   *bufio.Reader
	mu       sync.Mutex
	seq      int
	spawned  []Proc // under mu
}

// Proc is one process spawned in a Shell.
type Proc struct {
	PID   int
	Out   string // file holding its stdout and stderr
	start string // its /proc start time, so that Close never kills a reused pid
}

// startTime is field 22 of /proc/<pid>/stat ("" when it cannot be read).
func startTime(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return ""
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 20 {
		return ""
	}
	return f[19]
}

// Shell starts a shell and registers it with device dev's enforcer as the
// root of a new instance with the given quota.
func (n *Node) Shell(dev, core, memoryMiB int) (*Shell, error) {
	return n.ShellClass(dev, core, memoryMiB, "")
}

// ShellClass is Shell with the instance's priority class ("online",
// "offline"; "" the default, online).
func (n *Node) ShellClass(dev, core, memoryMiB int, class string) (*Shell, error) {
	cmd := exec.Command("/bin/sh", "-s")
	cmd.Env = n.ShimEnv(dev)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	go func() { _ = cmd.Wait() }()
	s := &Shell{node: n, dev: dev, cmd: cmd, stdin: stdin, stdout: bufio.NewReader(stdout)}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := n.Client(dev).Create(ctx, api.CreateRequest{
		Kind: api.KindProcessTree, ContainerID: fmt.Sprintf("shell-%d", cmd.Process.Pid),
		PID: cmd.Process.Pid, Core: core, MemoryMiB: uint64(memoryMiB), //nolint:gosec // test quotas
		Class: class,
	})
	if err != nil {
		_ = cmd.Process.Kill()
		return nil, err
	}
	s.Instance = resp.Instance
	n.mu.Lock()
	n.shells = append(n.shells, s)
	n.mu.Unlock()
	return s, nil
}

// ShimEnv is the environment of a process that runs with the shim
// preloaded on device dev (what `mgpu-cli run` sets up).
func (n *Node) ShimEnv(dev int, extra ...string) []string {
	d := strconv.Itoa(dev)
	preload := n.Shim
	if n.libasan != "" {
		preload = n.libasan + ":" + n.Shim
		extra = append(extra, "ASAN_OPTIONS=detect_leaks=0:abort_on_error=1", "UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1")
	}
	return n.Env(append([]string{
		"LD_PRELOAD=" + preload,
		"MGPU_RUN_DIR=" + n.RunDir,
		"MGPU_VISIBLE_DEVICES=" + d,
		"CUDA_VISIBLE_DEVICES=" + d,
	}, extra...)...)
}

// Spawn starts mgpu-workload with args in the shell's instance and returns
// its pid; its output goes to a file (Proc.Out).
func (s *Shell) Spawn(args ...string) (Proc, error) {
	return s.SpawnCommand(append([]string{s.node.Paths.Workload}, args...)...)
}

// SpawnCommand is Spawn of any command line (argv[0] a path), e.g. one that
// starts with /usr/bin/env to change the environment the shell gives it.
func (s *Shell) SpawnCommand(argv ...string) (Proc, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.seq++
	out := filepath.Join(s.node.Dir, fmt.Sprintf("shell%d-%d.out", s.cmd.Process.Pid, s.seq))
	quoted := make([]string, 0, len(argv))
	for _, a := range argv {
		quoted = append(quoted, "'"+strings.ReplaceAll(a, "'", `'\''`)+"'")
	}
	line := fmt.Sprintf("%s >%s 2>&1 & echo $!\n", strings.Join(quoted, " "), out)
	if _, err := io.WriteString(s.stdin, line); err != nil {
		return Proc{}, err
	}
	pidLine, err := s.stdout.ReadString('\n')
	if err != nil {
		return Proc{}, fmt.Errorf("harness: shell: %w", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(pidLine))
	if err != nil {
		return Proc{}, fmt.Errorf("harness: shell printed %q", pidLine)
	}
	p := Proc{PID: pid, Out: out, start: startTime(pid)}
	s.spawned = append(s.spawned, p)
	return p, nil
}

// Output returns what p printed so far.
func (p Proc) Output() string {
	b, _ := os.ReadFile(p.Out)
	return string(b)
}

// Alive reports whether p still runs (and is not a zombie).
func (p Proc) Alive() bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.PID))
	if err != nil {
		return false
	}
	i := strings.LastIndexByte(string(b), ')')
	return i >= 0 && i+2 < len(b) && b[i+2] != 'Z'
}

// WaitExit waits until p has exited.
func (p Proc) WaitExit(timeout time.Duration) error {
	return WaitFor(timeout, func() error {
		if p.Alive() {
			return fmt.Errorf("pid %d still runs", p.PID)
		}
		return nil
	})
}

// WaitOutput waits until p's output contains s.
func (p Proc) WaitOutput(s string, timeout time.Duration) error {
	return WaitFor(timeout, func() error {
		if out := p.Output(); !strings.Contains(out, s) {
			return fmt.Errorf("pid %d has not printed %q; output so far: %q", p.PID, s, out)
		}
		return nil
	})
}

// Close ends the shell (and so the instance's root) and kills what it
// spawned.
func (s *Shell) Close() {
	for _, pid := range Descendants(s.cmd.Process.Pid) {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	// What it spawned, also once the shell is gone (its children are then
	// the init process's): a process that holds until killed must not
	// outlive the test.
	s.mu.Lock()
	for _, p := range s.spawned {
		if p.start != "" && startTime(p.PID) == p.start {
			_ = syscall.Kill(p.PID, syscall.SIGKILL)
		}
	}
	s.mu.Unlock()
	_ = s.stdin.Close()
}
