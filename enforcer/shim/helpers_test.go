// Package shim_test tests libmgpu-shim.so as programs see it: preloaded into
// mgpu-workload running on fakecuda, attached to a test-only attach server.
package shim_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/test/fakecuda"
)

var (
	root     string // repository root
	shimLib  string
	asanLib  string
	libasan  string
	fakeDir  string
	workload string
	fcCtl    string
	fixture  string // why fakecuda / the workload are unusable; "" when usable
)

func TestMain(m *testing.M) {
	wd, err := os.Getwd()
	if err != nil {
		panic(err)
	}
	root = filepath.Clean(filepath.Join(wd, "..", ".."))
	build := filepath.Join(root, "build")
	shimLib = filepath.Join(build, "lib", "libmgpu-shim.so")
	if p := os.Getenv("MGPU_TEST_SHIM"); p != "" { // a debugging build of the shim
		shimLib = p
	}
	asanLib = filepath.Join(build, "lib", "asan", "libmgpu-shim.so")
	fakeDir = filepath.Join(build, "fakecuda")
	workload = filepath.Join(build, "bin", "mgpu-workload")
	fcCtl = filepath.Join(build, "bin", "fakecuda-ctl")
	if out, err := exec.Command("make", "-s", "-C", wd).CombinedOutput(); err != nil { //nolint:gosec // fixed args
		fmt.Fprintf(os.Stderr, "building the shim: %v\n%s", err, out)
		os.Exit(1)
	}
	if out, err := exec.Command("gcc", "-print-file-name=libasan.so").Output(); err == nil {
		libasan = strings.TrimSpace(string(out))
	}
	// fakecuda and the workload belong to test/; build them when missing.
	for _, dir := range []string{"test/fakecuda", "test/workload"} {
		if _, err := os.Stat(filepath.Join(root, dir, "Makefile")); err != nil {
			continue
		}
		if !exists(filepath.Join(fakeDir, "libcuda.so.1")) || !exists(workload) || !exists(fcCtl) {
			_ = exec.Command("make", "-s", "-C", filepath.Join(root, dir)).Run() //nolint:gosec // fixed args
		}
	}
	for _, p := range []string{filepath.Join(fakeDir, "libcuda.so.1"), filepath.Join(fakeDir, "libnvidia-ml.so.1"),
		workload, fcCtl} {
		if !exists(p) {
			fixture = p + " is missing (make -C test/fakecuda and make -C test/workload)"
		}
	}
	os.Exit(m.Run())
}

func exists(p string) bool { _, err := os.Stat(p); return err == nil }

func needFixture(t *testing.T) {
	t.Helper()
	if fixture != "" {
		t.Skip(fixture)
	}
}

// env is one test's world: a run directory and a fakecuda state directory.
type env struct {
	t     *testing.T
	run   string // MGPU_RUN_DIR
	fc    string // FAKECUDA_STATE_DIR
	asan  bool
	extra []string
	nopre bool // run without the shim
}

func newEnv(t *testing.T) *env {
	t.Helper()
	needFixture(t)
	d := t.TempDir()
	e := &env{t: t, run: filepath.Join(d, "run"), fc: filepath.Join(d, "fc")}
	for _, p := range []string{e.run, e.fc} {
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return e
}

func (e *env) environ() []string {
	var out []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, "MGPU_") || strings.HasPrefix(k, "FAKECUDA_") || k == "LD_PRELOAD" ||
			k == "LD_LIBRARY_PATH" || k == "ASAN_OPTIONS" || k == "CUDA_VISIBLE_DEVICES" {
			continue
		}
		out = append(out, kv)
	}
	out = append(out, "LD_LIBRARY_PATH="+fakeDir, "MGPU_RUN_DIR="+e.run, "FAKECUDA_STATE_DIR="+e.fc)
	switch {
	case e.nopre:
	case e.asan:
		out = append(out, "LD_PRELOAD="+libasan+":"+asanLib,
			"ASAN_OPTIONS=detect_leaks=0:abort_on_error=0:halt_on_error=1:exitcode=99",
			"UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:exitcode=99")
	default:
		out = append(out, "LD_PRELOAD="+shimLib)
	}
	return append(out, e.extra...)
}

func (e *env) cmd(ctx context.Context, name string, args ...string) *exec.Cmd {
	c := exec.CommandContext(ctx, name, args...) //nolint:gosec // test programs
	c.Env = e.environ()
	return c
}

type result struct {
	out, err string
	code     int
}

// run runs a program to completion (30 s at most).
func (e *env) run1(name string, args ...string) result {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := e.cmd(ctx, name, args...)
	var so, se bytes.Buffer
	c.Stdout, c.Stderr = &so, &se
	err := c.Run()
	r := result{out: so.String(), err: se.String()}
	if err != nil {
		if ee, ok := err.(*exec.ExitError); ok { //nolint:errorlint // exec returns it unwrapped
			r.code = ee.ExitCode()
		} else {
			e.t.Fatalf("%s %v: %v", name, args, err)
		}
	}
	if r.code == 99 || strings.Contains(r.err, "AddressSanitizer") || strings.Contains(r.err, "runtime error:") {
		e.t.Fatalf("sanitizer report from %s %v:\n%s", name, args, r.err)
	}
	return r
}

func (e *env) wl(args ...string) result { e.t.Helper(); return e.run1(workload, args...) }

// bg starts a program; lines of its stdout arrive on the returned channel.
func (e *env) bg(name string, args ...string) (*exec.Cmd, <-chan string, *bytes.Buffer) {
	e.t.Helper()
	c := e.cmd(context.Background(), name, args...)
	stdout, err := c.StdoutPipe()
	if err != nil {
		e.t.Fatal(err)
	}
	var se bytes.Buffer
	c.Stderr = &se
	if err := c.Start(); err != nil {
		e.t.Fatal(err)
	}
	lines := make(chan string, 1024)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	e.t.Cleanup(func() {
		if c.ProcessState == nil {
			_ = c.Process.Kill()
			_ = c.Wait()
		}
	})
	return c, lines, &se
}

// waitLine waits for a line with the prefix.
func waitLine(t *testing.T, lines <-chan string, prefix string) string {
	t.Helper()
	deadline := time.After(20 * time.Second)
	for {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("output ended before a line starting %q", prefix)
			}
			if strings.HasPrefix(l, prefix) {
				return l
			}
		case <-deadline:
			t.Fatalf("no line starting %q", prefix)
		}
	}
}

// eventually polls cond until it holds (20 s at most).
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(200 * time.Microsecond)
	}
}

// kv parses the key=value words of a program's output.
var kv = fakecuda.Fields

func u64(t *testing.T, m map[string]string, k string) uint64 {
	t.Helper()
	v, err := strconv.ParseUint(m[k], 10, 64)
	if err != nil {
		t.Fatalf("%s=%q: %v", k, m[k], err)
	}
	return v
}

// fcStat is fakecuda-ctl stat's view of device 0.
type fcStat struct {
	Devices []struct {
		MemUsed uint64 `json:"mem_used"`
		BusyNs  uint64 `json:"busy_ns"`
		Procs   []struct {
			Pid      int    `json:"pid"`
			BusyNs   uint64 `json:"busy_ns"`   // time it held the device
			KernelNs uint64 `json:"kernel_ns"` // time its kernels ran
			Kernels  uint64 `json:"kernels"`
			MemUsed  uint64 `json:"mem_used"`
			Alive    bool   `json:"alive"`
		} `json:"procs"`
	} `json:"devices"`
}

func (e *env) fcstatAny() fcStat {
	e.t.Helper()
	c := exec.Command(fcCtl, "stat") //nolint:gosec // test fixture
	c.Env = append(os.Environ(), "FAKECUDA_STATE_DIR="+e.fc)
	out, err := c.Output()
	if err != nil {
		e.t.Fatalf("fakecuda-ctl stat: %v", err)
	}
	var s fcStat
	if err := json.Unmarshal(out, &s); err != nil {
		e.t.Fatalf("fakecuda-ctl stat: %v: %s", err, out)
	}
	return s
}

func (e *env) fcstat() fcStat {
	e.t.Helper()
	s := e.fcstatAny()
	if len(s.Devices) == 0 {
		e.t.Fatalf("fakecuda-ctl stat: no devices")
	}
	return s
}

func (s fcStat) busyOf(pid int) uint64 {
	for _, p := range s.Devices[0].Procs {
		if p.Pid == pid {
			return p.BusyNs
		}
	}
	return 0
}

// kernelOf is the time pid's kernels ran (busyOf adds the gaps between
// consecutive kernels while it held the device).
func (s fcStat) kernelOf(pid int) uint64 {
	for _, p := range s.Devices[0].Procs {
		if p.Pid == pid {
			return p.KernelNs
		}
	}
	return 0
}

// mgpuLines are the shim's lines on stderr.
func mgpuLines(stderr string) []string {
	var out []string
	for _, l := range strings.Split(stderr, "\n") {
		if strings.HasPrefix(l, "mgpu: ") {
			out = append(out, l)
		}
	}
	return out
}

const mib = 1 << 20
