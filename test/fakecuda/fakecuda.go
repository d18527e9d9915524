// Package fakecuda reads and resets the shared state of the simulated GPU
// (test/fakecuda, a libcuda.so.1 for tests), so that Go tests can measure the
// GPU time and memory each process achieved.
package fakecuda

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Proc is one process that used a device; exited processes stay listed
// (Alive false, memory returned) until Reset. PID is the process's pid in its
// own pid namespace, PIDNS that namespace's inode (of /proc/<pid>/ns/pid; 0
// when the process could not read it): processes of different containers may
// have the same PID, never the same PIDNS and PID.
type Proc struct {
	PID      int    `json:"pid"`
	PIDNS    uint64 `json:"pidns"`
	BusyNs   uint64 `json:"busy_ns"`   // time it held the device (kernels and the gaps of its slice)
	KernelNs uint64 `json:"kernel_ns"` // time its kernels ran
	Kernels  uint64 `json:"kernels"`
	MemUsed  uint64 `json:"mem_used"`
	Alive    bool   `json:"alive"`
}

// Device is one simulated GPU (host index).
type Device struct {
	Index    int    `json:"index"`
	Name     string `json:"name"`
	UUID     string `json:"uuid"`
	MemTotal uint64 `json:"mem_total"`
	MemUsed  uint64 `json:"mem_used"`
	BusyNs   uint64 `json:"busy_ns"`   // time some process held the device
	KernelNs uint64 `json:"kernel_ns"` // time kernels ran
	Kernels  uint64 `json:"kernels"`
	Procs    []Proc `json:"procs"`
	// Handoffs counts the times the device passed from one process to
	// another, Idles the times it was left with no holder: between two
	// states, the hand-offs and idle spells of the window.
	Handoffs uint64 `json:"handoffs"`
	Idles    uint64 `json:"idles"`

	// Model is the device model ("slice", "timer" or "kernel"), TimesliceNs
	// its time slice (kernel model: only the turn of a process's streams
	// among themselves); both fixed by the process that created the state.
	Model       string `json:"model"`
	TimesliceNs uint64 `json:"timeslice_ns"`
}

// State is the output of `fakecuda-ctl stat`.
type State struct {
	Devices []Device `json:"devices"`
	// AtNs is CLOCK_MONOTONIC (ns) when the state was read: a window
	// between two states is exact, whatever starting fakecuda-ctl took.
	AtNs uint64 `json:"at_ns"`
}

// Device returns the device of host index i.
func (s State) Device(i int) (Device, bool) {
	for _, d := range s.Devices {
		if d.Index == i {
			return d, true
		}
	}
	return Device{}, false
}

// Proc returns the entry of pid (the newest one if the pid was reused).
func (d Device) Proc(pid int) (Proc, bool) {
	found, ok := Proc{}, false
	for _, p := range d.Procs {
		if p.PID == pid {
			found, ok = p, true
		}
	}
	return found, ok
}

// BusyNsIn is the GPU time used on the device by every process, alive or
// exited, of pid namespace pidns (one container).
func (d Device) BusyNsIn(pidns uint64) uint64 {
	var t uint64
	for _, p := range d.Procs {
		if p.PIDNS == pidns {
			t += p.BusyNs
		}
	}
	return t
}

// UUID is the UUID of simulated device index; internal/config.SimUUID
// derives the same value.
func UUID(index int) string {
	return fmt.Sprintf("GPU-5a1e0000-0000-4000-8000-%012x", index)
}

// RepoRoot finds the repository root (the directory holding go.mod) above the
// working directory.
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("fakecuda: no go.mod above the working directory")
		}
		dir = parent
	}
}

// BuildDir is $MGPU_BUILD, or build/ at the repository root.
func BuildDir() (string, error) {
	if b := os.Getenv("MGPU_BUILD"); b != "" {
		return b, nil
	}
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	return filepath.Join(root, "build"), nil
}

// Paths of the built artefacts under a build directory.
type Paths struct {
	LibDir   string // holds libcuda.so.1 and libnvidia-ml.so.1
	Ctl      string // fakecuda-ctl
	Workload string // mgpu-workload
}

// PathsIn returns the artefact paths under build directory b.
func PathsIn(b string) Paths {
	return Paths{
		LibDir:   filepath.Join(b, "fakecuda"),
		Ctl:      filepath.Join(b, "bin", "fakecuda-ctl"),
		Workload: filepath.Join(b, "bin", "mgpu-workload"),
	}
}

// Build runs make for test/fakecuda and test/workload into build directory b.
func Build(b string) error {
	root, err := RepoRoot()
	if err != nil {
		return err
	}
	for _, dir := range []string{"test/fakecuda", "test/workload"} {
		cmd := exec.Command("make", "-s", "-C", filepath.Join(root, dir), "BUILD="+b) //nolint:gosec // fixed arguments
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("make %s: %w\n%s", dir, err, out)
		}
	}
	return nil
}

// Env returns os.Environ() plus what a process needs to use the simulated GPU
// with state in stateDir (LD_LIBRARY_PATH, FAKECUDA_STATE_DIR), then extra.
func Env(p Paths, stateDir string, extra ...string) []string {
	env := make([]string, 0, len(os.Environ())+2+len(extra))
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "LD_LIBRARY_PATH=") && !strings.HasPrefix(kv, "FAKECUDA_STATE_DIR=") {
			env = append(env, kv)
		}
	}
	env = append(env, "LD_LIBRARY_PATH="+p.LibDir, "FAKECUDA_STATE_DIR="+stateDir)
	return append(env, extra...)
}

// The device models (README.md, "Device models").
const (
	ModelSlice  = "slice"
	ModelTimer  = "timer"
	ModelKernel = "kernel"
)

// ParseModel reads a device model spec: "slice" (or "", the default),
// "timer" (2 ms slices), "timer:1ms", "timer:<N>ms", "timer:<N>us",
// "slice:<N>ms"/"slice:<N>us", or "kernel". timesliceUS is 0 where the
// model's default applies (slice: 4000 us).
func ParseModel(s string) (model string, timesliceUS int, err error) {
	name, dur, hasDur := strings.Cut(strings.TrimSpace(s), ":")
	bad := func(why string) (string, int, error) {
		return "", 0, fmt.Errorf("fakecuda: device model %q: %s (want slice, timer, timer:<N>ms, timer:<N>us or kernel)", s, why)
	}
	switch name {
	case "", ModelSlice, ModelTimer:
	case ModelKernel:
		if hasDur {
			return bad("the kernel model has no time slice")
		}
		return ModelKernel, 0, nil
	default:
		return bad("unknown model")
	}
	if name == "" {
		if hasDur {
			return bad("no model name")
		}
		name = ModelSlice
	}
	if !hasDur {
		if name == ModelTimer {
			return ModelTimer, 2000, nil
		}
		return ModelSlice, 0, nil
	}
	unit := 0
	switch {
	case strings.HasSuffix(dur, "ms"):
		dur, unit = strings.TrimSuffix(dur, "ms"), 1000
	case strings.HasSuffix(dur, "us"):
		dur, unit = strings.TrimSuffix(dur, "us"), 1
	default:
		return bad("the time slice needs a unit, ms or us")
	}
	n, err := strconv.Atoi(dur)
	if err != nil || n <= 0 {
		return bad("bad time slice")
	}
	us := n * unit
	if us < 100 || us > 1000000 {
		return bad("time slice out of range 100us..1000ms")
	}
	return name, us, nil
}

// ParseDevice reads a device spec: a model spec (ParseModel), optionally
// followed by "+gap:<N>us", the device's own time before each kernel
// (FAKECUDA_KERNEL_GAP_US, 0..100000 us), so that a workload alone does
// not keep the device 100 % busy. It returns the environment entries that
// select it (ModelEnv's, and the gap's).
func ParseDevice(s string) ([]string, error) {
	spec, gap, hasGap := strings.Cut(strings.TrimSpace(s), "+")
	model, us, err := ParseModel(spec)
	if err != nil {
		return nil, err
	}
	env := ModelEnv(model, us)
	if !hasGap {
		return env, nil
	}
	v, ok := strings.CutPrefix(gap, "gap:")
	n, err := strconv.Atoi(strings.TrimSuffix(v, "us"))
	if !ok || !strings.HasSuffix(v, "us") || err != nil || n < 0 || n > 100000 {
		return nil, fmt.Errorf("fakecuda: device %q: want <model>+gap:<N>us with N in 0..100000", s)
	}
	return append(env, "FAKECUDA_KERNEL_GAP_US="+strconv.Itoa(n)), nil
}

// ModelEnv returns the environment entries that select a device model
// (FAKECUDA_DEVICE_MODEL; FAKECUDA_TIMESLICE_US when timesliceUS > 0). They
// take effect in the process that creates the state (the first cuInit or
// nvmlInit on a fresh state dir): give them to every process.
func ModelEnv(model string, timesliceUS int) []string {
	if model == "" {
		model = ModelSlice
	}
	env := []string{"FAKECUDA_DEVICE_MODEL=" + model}
	if timesliceUS > 0 {
		env = append(env, "FAKECUDA_TIMESLICE_US="+strconv.Itoa(timesliceUS))
	}
	return env
}

// Stat reads the state in stateDir with the fakecuda-ctl of BuildDir().
func Stat(stateDir string) (State, error) {
	b, err := BuildDir()
	if err != nil {
		return State{}, err
	}
	return StatWith(PathsIn(b).Ctl, stateDir)
}

// StatWith reads the state in stateDir with the given fakecuda-ctl binary.
// It also returns the memory of exited processes to their devices.
func StatWith(ctl, stateDir string) (State, error) {
	out, err := ctlRun(ctl, stateDir, "stat")
	if err != nil {
		return State{}, err
	}
	var s State
	if err := json.Unmarshal(out, &s); err != nil {
		return State{}, fmt.Errorf("fakecuda: parse %q stat output: %w", ctl, err)
	}
	return s, nil
}

// Reset clears busy counters and forgets exited processes (BuildDir's ctl).
func Reset(stateDir string) error {
	b, err := BuildDir()
	if err != nil {
		return err
	}
	return ResetWith(PathsIn(b).Ctl, stateDir)
}

// ResetWith is Reset with the given fakecuda-ctl binary.
func ResetWith(ctl, stateDir string) error {
	_, err := ctlRun(ctl, stateDir, "reset")
	return err
}

func ctlRun(ctl, stateDir, verb string) ([]byte, error) {
	cmd := exec.Command(ctl, verb) //nolint:gosec // the caller names its own build
	cmd.Env = append(os.Environ(), "FAKECUDA_STATE_DIR="+stateDir)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("fakecuda: %s %s: %w: %s", ctl, verb, err, strings.TrimSpace(stderr.String()))
	}
	return out, nil
}

// Fields parses the key=value words of a fixture program's output
// (fctest, mgpu-workload); other words are ignored, a later key wins.
func Fields(out string) map[string]string {
	m := map[string]string{}
	for _, f := range strings.Fields(out) {
		if k, v, ok := strings.Cut(f, "="); ok {
			m[k] = v
		}
	}
	return m
}

// Watcher samples the state at a fixed interval from one `fakecuda-ctl
// watch` process: a sample costs microseconds there, where starting
// `fakecuda-ctl stat` for each costs milliseconds of CPU that the measured
// workloads would miss on a small machine.
type Watcher struct {
	cmd  *exec.Cmd
	done chan struct{} // closed when the reader has seen the end of the output

	mu     sync.Mutex
	states []State
	err    error // a line that did not parse, or the read error
	stderr bytes.Buffer
}

// WatchWith starts sampling stateDir's devices every interval (at least
// 100 µs) with the given fakecuda-ctl binary, until Stop.
func WatchWith(ctl, stateDir string, every time.Duration) (*Watcher, error) {
	us := every.Microseconds()
	if us < 100 {
		return nil, fmt.Errorf("fakecuda: watch interval %v: want at least 100µs", every)
	}
	w := &Watcher{done: make(chan struct{})}
	w.cmd = exec.Command(ctl, "watch", strconv.FormatInt(us, 10)) //nolint:gosec // the caller names its own build
	w.cmd.Env = append(os.Environ(), "FAKECUDA_STATE_DIR="+stateDir)
	w.cmd.Stderr = &lockedWriter{mu: &w.mu, b: &w.stderr}
	out, err := w.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := w.cmd.Start(); err != nil {
		return nil, fmt.Errorf("fakecuda: %s watch: %w", ctl, err)
	}
	go w.read(out)
	return w, nil
}

func (w *Watcher) read(out io.Reader) {
	defer close(w.done)
	sc := bufio.NewScanner(out)
	sc.Buffer(make([]byte, 0, 1<<16), 16<<20) // a device lists up to 1024 processes
	for sc.Scan() {
		var s State
		err := json.Unmarshal(sc.Bytes(), &s)
		w.mu.Lock()
		if err != nil && w.err == nil {
			w.err = fmt.Errorf("fakecuda: parse watch output: %w", err)
		}
		if err == nil {
			w.states = append(w.states, s)
		}
		w.mu.Unlock()
	}
	if err := sc.Err(); err != nil {
		w.mu.Lock()
		if w.err == nil {
			w.err = fmt.Errorf("fakecuda: read watch output: %w", err)
		}
		w.mu.Unlock()
	}
}

// States returns the samples read so far, oldest first.
func (w *Watcher) States() []State {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]State(nil), w.states...)
}

// Stop ends the watch and returns every sample, oldest first, with the
// first error: a line that did not parse, or the watch exiting on its own
// (its stderr included).
func (w *Watcher) Stop() ([]State, error) {
	var early error
	select {
	case <-w.done:
		early = errors.New("fakecuda: watch ended before it was stopped")
	default:
	}
	_ = w.cmd.Process.Kill()
	<-w.done
	_ = w.cmd.Wait()
	w.mu.Lock()
	defer w.mu.Unlock()
	err := w.err
	if err == nil && early != nil {
		err = fmt.Errorf("%w: %s", early, strings.TrimSpace(w.stderr.String()))
	}
	return w.states, err
}

type lockedWriter struct {
	mu *sync.Mutex
	b  *bytes.Buffer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}
