// Package harness runs a whole simulated mgpu node from the built binaries:
// enforcers (build/bin/mgpu-enforcer) on simulated GPUs, workloads
// (build/bin/mgpu-workload) started through `mgpu-cli run` with the shim
// preloaded in front of the simulated driver (test/fakecuda), and the
// simulated device's own busy-time records, from which achieved shares are
// measured. The process-level tests, `make demo` and `make bench` use it.
package harness

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/internal/policy"
	"github.com/mgpu-dev/mgpu/test/fakecuda"
	"golang.org/x/sys/unix"
)

// NodeConfig describes the simulated node.
type NodeConfig struct {
	Devices      int                   // simulated GPUs (default 1)
	MemoryMiB    int64                 // per GPU (default 81920)
	Policies     map[int]policy.Policy // per device (default fixed-share)
	TimesliceMS  int                   // compute_timeslice (0: the config default)
	MaxInstances int                   // max_instances (0: the config default)
	// OnlineOffline is every device's online_offline_switch (0: off).
	OnlineOffline int
	// Shim overrides the shim library.
	Shim string
	// ASan uses the ASan/UBSan build of the shim (build/lib/asan), with
	// libasan preloaded before it as the sanitizer requires.
	ASan bool
	// DeviceModel is the simulated GPU's device model, as
	// fakecuda.ParseDevice reads it: "slice" (the default), "timer",
	// "timer:1ms", "kernel", each optionally with "+gap:<N>us"
	// (test/fakecuda/README.md, "Device models").
	DeviceModel string
	// ExtraEnv is added to every workload's environment.
	ExtraEnv []string
	// ExtraConfig is appended to the node configuration (TOML tables,
	// e.g. "[backstop]\n...").
	ExtraConfig string
	// Log receives the enforcers' logs (default: discarded).
	Log io.Writer
}

// Node is a running simulated node. Close it.
type Node struct {
	Dir        string // temporary root of everything below
	ConfigPath string // the node configuration
	RunDir     string
	FakeState  string // FAKECUDA_STATE_DIR
	Build      string // the build directory
	Paths      fakecuda.Paths
	CLI        string // mgpu-cli
	Enforcer   string // mgpu-enforcer
	Shim       string // libmgpu-shim.so
	libasan    string // preloaded before an ASan build of the shim

	nc       NodeConfig
	modelEnv []string // the device model's environment
	mu       sync.Mutex
	enf      Enforcers
	jobs     []*Job
	shells   []*Shell
}

// NewNode writes the configuration of a simulated node under a new
// temporary directory. It starts nothing; see StartEnforcer.
func NewNode(nc NodeConfig) (*Node, error) {
	if nc.Devices == 0 {
		nc.Devices = 1
	}
	if nc.MemoryMiB == 0 {
		nc.MemoryMiB = 81920
	}
	env, err := fakecuda.ParseDevice(nc.DeviceModel)
	if err != nil {
		return nil, fmt.Errorf("harness: %w", err)
	}
	build, err := fakecuda.BuildDir()
	if err != nil {
		return nil, err
	}
	n := &Node{
		modelEnv: env,
		Build:    build,
		Paths:    fakecuda.PathsIn(build),
		CLI:      filepath.Join(build, "bin", "mgpu-cli"),
		Enforcer: filepath.Join(build, "bin", "mgpu-enforcer"),
		Shim:     filepath.Join(build, "lib", "libmgpu-shim.so"),
		nc:       nc,
	}
	if nc.ASan {
		n.Shim = filepath.Join(build, "lib", "asan", "libmgpu-shim.so")
		out, err := exec.Command("gcc", "-print-file-name=libasan.so").Output()
		if err != nil {
			return nil, fmt.Errorf("harness: find libasan.so: %w", err)
		}
		n.libasan = strings.TrimSpace(string(out))
	}
	if nc.Shim != "" {
		n.Shim = nc.Shim
	}
	for _, p := range []string{n.CLI, n.Enforcer, n.Shim, n.Paths.Workload, n.Paths.Ctl, filepath.Join(n.Paths.LibDir, "libcuda.so.1")} {
		if _, err := os.Stat(p); err != nil {
			return nil, fmt.Errorf("harness: %s is missing; run make build", p)
		}
	}
	if n.Dir, err = os.MkdirTemp("", "mgpu-node-"); err != nil {
		return nil, err
	}
	n.RunDir = filepath.Join(n.Dir, "run")
	n.FakeState = filepath.Join(n.Dir, "fakecuda")
	if err := os.MkdirAll(n.FakeState, 0o755); err != nil {
		return nil, err
	}
	var b strings.Builder
	fmt.Fprintf(&b, "version = 1\nbackend = \"sim\"\nrun_dir = %q\nstate_dir = %q\n\n[defaults]\n",
		n.RunDir, filepath.Join(n.Dir, "state"))
	if nc.TimesliceMS != 0 {
		fmt.Fprintf(&b, "compute_timeslice = %d\n", nc.TimesliceMS)
	}
	if nc.MaxInstances != 0 {
		fmt.Fprintf(&b, "max_instances = %d\n", nc.MaxInstances)
	}
	if nc.OnlineOffline != 0 {
		fmt.Fprintf(&b, "online_offline_switch = %d\n", nc.OnlineOffline)
	}
	for dev := 0; dev < nc.Devices; dev++ {
		if p, ok := nc.Policies[dev]; ok {
			fmt.Fprintf(&b, "\n[[device]]\nindex = %d\ncompute_policy = %q\n", dev, p.String())
		}
	}
	for dev := 0; dev < nc.Devices; dev++ {
		fmt.Fprintf(&b, "\n[[sim.gpu]]\nname = \"Simulated-GPU-80GB\"\nmemory_mib = %d\n", nc.MemoryMiB)
	}
	b.WriteString("\n" + nc.ExtraConfig)
	n.ConfigPath = filepath.Join(n.Dir, "config.toml")
	if err := os.WriteFile(n.ConfigPath, []byte(b.String()), 0o644); err != nil { //nolint:gosec // a test config
		return nil, err
	}
	n.enf = Enforcers{Bin: n.Enforcer, Config: n.ConfigPath, Env: func() []string { return n.Env() }, Log: n.logWriter(), Client: n.Client}
	return n, nil
}

// Env is the environment of every process of the node: the simulated
// driver, its state and the node configuration.
func (n *Node) Env(extra ...string) []string {
	base := fakecuda.Env(n.Paths, n.FakeState,
		"FAKECUDA_DEVICES="+strconv.Itoa(n.nc.Devices),
		fmt.Sprintf("FAKECUDA_MEMORY_MIB=%d", n.nc.MemoryMiB),
		"MGPU_CONFIG="+n.ConfigPath)
	base = append(base, n.modelEnv...)
	base = append(base, n.nc.ExtraEnv...)
	return append(base, extra...)
}

// StartEnforcer starts mgpu-enforcer for device dev and waits until its
// control socket answers.
func (n *Node) StartEnforcer(dev int) error { return n.enf.Start(dev) }

// StopEnforcer sends sig to device dev's enforcer and waits for it to exit.
func (n *Node) StopEnforcer(dev int, sig syscall.Signal) error { return n.enf.Stop(dev, sig) }

// EnforcerPID returns the pid of device dev's enforcer (0 if none runs).
func (n *Node) EnforcerPID(dev int) int { return n.enf.PID(dev) }

// ControlSocket is device dev's control socket.
func (n *Node) ControlSocket(dev int) string {
	return api.ControlSocket(filepath.Join(n.RunDir, fmt.Sprintf("gpu%d", dev)))
}

// Client is a control-API client of device dev.
func (n *Node) Client(dev int) *api.Client { return api.NewClient(n.ControlSocket(dev)) }

func (n *Node) logWriter() io.Writer {
	if n.nc.Log != nil {
		return n.nc.Log
	}
	return io.Discard
}

// RunSpec is one workload started through `mgpu-cli run`.
type RunSpec struct {
	Name      string // a label for reports
	Device    int
	Core      int
	MemoryMiB int
	Policy    string   // "" means the device's
	Class     string   // priority class, "online" or "offline"; "" the default (online)
	Args      []string // mgpu-workload's arguments
	Env       []string // extra environment
	// Program replaces mgpu-workload (Args are then its arguments).
	Program string
}

// Job is a running `mgpu-cli run -- mgpu-workload ...` (or RunSpec.Program).
type Job struct {
	Spec RunSpec
	Cmd  *exec.Cmd
	out  SyncBuffer
	done chan struct{}
	err  error

	mu   sync.Mutex
	pids map[int]bool // the workload processes seen so far
}

// Start starts a workload under a new instance.
func (n *Node) Start(spec RunSpec) (*Job, error) {
	args := []string{"--config", n.ConfigPath, "run",
		"--device", strconv.Itoa(spec.Device),
		"--core", strconv.Itoa(spec.Core),
		"--memory", strconv.Itoa(spec.MemoryMiB),
		"--shim", n.Shim}
	if spec.Class != "" {
		args = append(args, "--class", spec.Class)
	}
	if spec.Policy != "" {
		args = append(args, "--policy", spec.Policy)
	}
	prog := n.Paths.Workload
	if spec.Program != "" {
		prog = spec.Program
	}
	args = append(args, "--", prog)
	args = append(args, spec.Args...)
	j := &Job{Spec: spec, done: make(chan struct{}), pids: map[int]bool{}}
	j.Cmd = exec.Command(n.CLI, args...)
	j.Cmd.Env = n.Env(spec.Env...)
	j.Cmd.Stdout, j.Cmd.Stderr = &j.out, &j.out
	j.Cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := j.Cmd.Start(); err != nil {
		return nil, err
	}
	n.mu.Lock()
	n.jobs = append(n.jobs, j)
	n.mu.Unlock()
	go func() {
		j.err = j.Cmd.Wait()
		close(j.done)
	}()
	return j, nil
}

// Wait waits for the job to end and returns its error (nil: exit status 0).
func (j *Job) Wait() error {
	<-j.done
	return j.err
}

// WaitStarted waits up to timeout for the workload's "start" line; an
// error if it exits or times out first.
func (j *Job) WaitStarted(timeout time.Duration) error {
	return WaitFor(timeout, func() error {
		if strings.Contains(j.Output(), "start") {
			return nil
		}
		select {
		case <-j.Done():
			return fmt.Errorf("workload exited: %s", j.Output())
		default:
			return fmt.Errorf("workload not started")
		}
	})
}

// Done is closed when the job has ended.
func (j *Job) Done() <-chan struct{} { return j.done }

// Output is what the job printed so far (stdout and stderr).
func (j *Job) Output() string { return j.out.String() }

// Kill kills the job's whole process tree.
func (j *Job) Kill() {
	for pid := range j.Pids() {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	if j.Cmd.Process != nil {
		_ = j.Cmd.Process.Kill()
	}
}

// Pids returns the processes of the job (mgpu-cli and its descendants) seen
// so far, including ones that have exited since.
func (j *Job) Pids() map[int]bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.Cmd.Process != nil {
		for _, p := range Descendants(j.Cmd.Process.Pid) {
			j.pids[p] = true
		}
	}
	out := make(map[int]bool, len(j.pids))
	for p := range j.pids {
		out[p] = true
	}
	return out
}

// Close kills every job and enforcer and removes the node's directory.
func (n *Node) Close() error {
	n.mu.Lock()
	jobs := n.jobs
	shells := n.shells
	n.mu.Unlock()
	for _, j := range jobs {
		j.Kill()
		<-j.done
	}
	for _, s := range shells {
		s.Close()
	}
	n.enf.Close()
	return os.RemoveAll(n.Dir)
}

// Sample is the simulated device's state at one moment.
type Sample struct {
	At    time.Time
	State fakecuda.State
}

// Sample reads the simulated devices' busy-time records. At is when
// fakecuda-ctl read them (its CLOCK_MONOTONIC stamp, placed on Go's clock),
// not when the process that read them started or ended: starting a process
// takes milliseconds on a loaded machine, and a 50 ms window must not be
// off by that much.
func (n *Node) Sample() (Sample, error) {
	t0 := time.Now()
	s, err := fakecuda.StatWith(n.Paths.Ctl, n.FakeState)
	t1 := time.Now()
	at := t0.Add(t1.Sub(t0) / 2) // somewhere between t0 and t1, without a stamp
	if t, ok := MonoTime(s.AtNs); err == nil && ok {
		at = t
	}
	return Sample{At: at, State: s}, err
}

// Watch samples the simulated devices every interval from one process
// (fakecuda.Watcher) until Stop: for windows of tens of milliseconds, where
// starting a process per Sample would take the measured workloads' CPU.
type Watch struct{ w *fakecuda.Watcher }

// Watch starts sampling every interval (at least 100 µs).
func (n *Node) Watch(every time.Duration) (*Watch, error) {
	w, err := fakecuda.WatchWith(n.Paths.Ctl, n.FakeState, every)
	if err != nil {
		return nil, err
	}
	return &Watch{w}, nil
}

// Samples returns the samples taken so far, oldest first.
func (w *Watch) Samples() []Sample { return samples(w.w.States()) }

// Stop ends the watch and returns every sample, oldest first.
func (w *Watch) Stop() ([]Sample, error) {
	ss, err := w.w.Stop()
	return samples(ss), err
}

func samples(ss []fakecuda.State) []Sample {
	rs := make([]Sample, 0, len(ss))
	for _, s := range ss {
		if at, ok := MonoTime(s.AtNs); ok {
			rs = append(rs, Sample{At: at, State: s})
		}
	}
	return rs
}

// MonoTime places a CLOCK_MONOTONIC stamp (ns, as the simulated GPU and the
// workload print them) on Go's clock; false for 0 or a stamp from the future.
func MonoTime(ns uint64) (time.Time, bool) {
	var ts unix.Timespec
	if ns == 0 || unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts) != nil {
		return time.Time{}, false
	}
	now := time.Now()
	ago := time.Duration(ts.Nano() - int64(ns)) //nolint:gosec // a CLOCK_MONOTONIC stamp fits int64
	if ago < 0 {
		return time.Time{}, false
	}
	return now.Add(-ago), true
}

// StartedAt is when the workload whose output this is printed
// "start mono_ns=N", just before its first launch.
func StartedAt(output string) (time.Time, bool) { return StampAt(output, "start mono_ns=") }

// StampAt places the CLOCK_MONOTONIC stamp that follows key (e.g.
// "until_mono_ns=") in output on Go's clock; false until the line holding
// it is complete. The stamp may lie in the future.
func StampAt(output, key string) (time.Time, bool) {
	_, rest, ok := strings.Cut(output, key)
	if !ok {
		return time.Time{}, false
	}
	if i := strings.IndexAny(rest, " \n"); i >= 0 && strings.Contains(rest, "\n") {
		rest = rest[:i]
	} else {
		return time.Time{}, false // the line is not complete yet
	}
	ns, err := strconv.ParseUint(rest, 10, 64)
	if err != nil || ns == 0 || ns > math.MaxInt64 {
		return time.Time{}, false
	}
	var ts unix.Timespec
	if unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts) != nil {
		return time.Time{}, false
	}
	return time.Now().Add(time.Duration(int64(ns) - ts.Nano())), true
}

// grown returns how much field, summed over the processes pids (nil: all)
// of device dev, grew between samples a and b.
func grown(a, b Sample, dev int, pids map[int]bool, field func(fakecuda.Proc) uint64) uint64 {
	sum := func(s Sample) uint64 {
		d, _ := s.State.Device(dev)
		var t uint64
		for _, p := range d.Procs {
			if pids == nil || pids[p.PID] {
				t += field(p)
			}
		}
		return t
	}
	return sum(b) - sum(a)
}

// percentOfWall is ns as a percentage of the wall time between a and b.
func percentOfWall(a, b Sample, ns uint64) float64 {
	wall := b.At.Sub(a.At)
	if wall <= 0 {
		return 0
	}
	return 100 * float64(ns) / float64(wall)
}

// Busy returns the GPU time the processes pids used on device dev between
// samples a and b.
func Busy(a, b Sample, dev int, pids map[int]bool) time.Duration {
	//nolint:gosec // busy time only grows between samples
	return time.Duration(grown(a, b, dev, pids, func(p fakecuda.Proc) uint64 { return p.BusyNs }))
}

// KernelShare returns the time the kernels of the processes pids ran on
// device dev between samples a and b (kernel_ns: without the device's own
// gaps between kernels, FAKECUDA_KERNEL_GAP_US), as a percentage of the wall
// time: their throughput.
func KernelShare(a, b Sample, dev int, pids map[int]bool) float64 {
	return percentOfWall(a, b, grown(a, b, dev, pids, func(p fakecuda.Proc) uint64 { return p.KernelNs }))
}

// Share returns Busy as a percentage of the wall time between a and b.
func Share(a, b Sample, dev int, pids map[int]bool) float64 {
	return percentOfWall(a, b, grown(a, b, dev, pids, func(p fakecuda.Proc) uint64 { return p.BusyNs }))
}

// Descendants lists pid and all its descendant processes now alive.
func Descendants(pid int) []int {
	children := map[int][]int{}
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if pp, ok := ParentOf(p); ok {
			children[pp] = append(children[pp], p)
		}
	}
	out := []int{pid}
	for i := 0; i < len(out); i++ {
		out = append(out, children[out[i]]...)
	}
	return out
}

// ParentOf returns the parent pid of pid from /proc/<pid>/stat.
func ParentOf(pid int) (int, bool) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, false
	}
	// pid (comm) state ppid ...; comm may hold spaces and parentheses.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 2 {
		return 0, false
	}
	pp, err := strconv.Atoi(f[1])
	return pp, err == nil
}

// SyncBuffer is a bytes.Buffer safe for concurrent writers and readers
// (a process's stdout and stderr, a test reading them).
type SyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write implements io.Writer.
func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String returns what was written so far.
func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// StartMetrics runs `mgpu-cli metrics serve` on a free loopback port for
// the node's devices and returns its address (host:port, from the line it
// prints when it listens) and the process, which the caller stops (SIGTERM)
// and waits for.
func (n *Node) StartMetrics() (string, *exec.Cmd, error) {
	cmd := exec.Command(n.CLI, "--config", n.ConfigPath, "metrics", "serve", "--listen", "127.0.0.1:0") //nolint:gosec // the build's CLI
	cmd.Env = n.Env()
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return "", nil, err
	}
	if err := cmd.Start(); err != nil {
		return "", nil, err
	}
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			if _, rest, ok := strings.Cut(sc.Text(), "serving metrics on http://"); ok {
				addr <- strings.TrimSuffix(rest, "/metrics")
			}
		}
	}()
	select {
	case a := <-addr:
		return a, cmd, nil
	case <-time.After(15 * time.Second):
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return "", nil, fmt.Errorf("harness: mgpu-cli metrics serve did not say where it listens")
	}
}
