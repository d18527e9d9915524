package enforcer

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/enforcer/attach"
	"github.com/mgpu-dev/mgpu/enforcer/region"
	"github.com/mgpu-dev/mgpu/internal/config"
)

// Roles the test binary plays when re-executed (MGPU_TEST_ROLE).
const (
	roleEnforcer = "enforcer" // run Command with MGPU_TEST_ARGS
	roleAttach   = "attach"   // attach to MGPU_TEST_SOCKET, print the result, wait for stdin to close
)

func TestMain(m *testing.M) {
	switch os.Getenv("MGPU_TEST_ROLE") {
	case roleEnforcer:
		os.Exit(Command(strings.Fields(os.Getenv("MGPU_TEST_ARGS")), os.Stderr))
	case roleAttach:
		// Wait for "go", attach, print the outcome, wait for EOF.
		in := bufio.NewReader(os.Stdin)
		if _, err := in.ReadString('\n'); err != nil {
			os.Exit(3)
		}
		res, err := attach.Dial(os.Getenv("MGPU_TEST_SOCKET"), 5*time.Second)
		if err != nil {
			fmt.Printf("refused %s\n", err)
		} else {
			fmt.Printf("ok slot=%d instance=%d\n", res.Slot, res.InstanceID)
		}
		_, _ = io.Copy(io.Discard, in)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// testEnv is a node configuration with private run and state directories.
type testEnv struct {
	dir     string
	cfgPath string
	cfg     *config.Config
}

// newEnv writes a config based on packaging/config/sim-node.toml; edit
// changes its [defaults] text. Socket paths must stay short (108 bytes),
// hence a short temporary directory rather than t.TempDir.
func newEnv(t testing.TB, edit func(string) string) *testEnv {
	t.Helper()
	dir, err := os.MkdirTemp("", "mgpu")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	env := &testEnv{dir: dir, cfgPath: filepath.Join(dir, "config.toml")}
	env.writeConfig(t, edit)
	return env
}

func (env *testEnv) writeConfig(t testing.TB, edit func(string) string) {
	t.Helper()
	data, err := os.ReadFile("../packaging/config/sim-node.toml")
	if err != nil {
		t.Fatal(err)
	}
	s := strings.Replace(string(data), "backend = \"sim\"\n",
		fmt.Sprintf("backend = \"sim\"\nrun_dir = %q\nstate_dir = %q\n", env.dir+"/run", env.dir+"/state"), 1)
	if edit != nil {
		s = edit(s)
	}
	if err := os.WriteFile(env.cfgPath, []byte(s), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Parse(env.cfgPath, []byte(s))
	if err != nil {
		t.Fatal(err)
	}
	env.cfg = cfg
}

func withPolicy(p string) func(string) string {
	return func(s string) string {
		return strings.Replace(s, `compute_policy = "fixed-share"`, fmt.Sprintf("compute_policy = %q", p), 1)
	}
}

func withMaxInstances(n int) func(string) string {
	return func(s string) string {
		return strings.Replace(s, "max_instances = 16", fmt.Sprintf("max_instances = %d", n), 1)
	}
}

func (env *testEnv) runDir() string { return env.cfg.DeviceRunDir(0) }

func (env *testEnv) client() *api.Client { return api.NewClient(api.ControlSocket(env.runDir())) }

func (env *testEnv) statePath() string {
	return filepath.Join(env.cfg.DeviceStateDir(0), StateFileName)
}

// start runs an in-process enforcer of device 0 until the test ends (or
// the returned stop is called).
func (env *testEnv) start(t testing.TB, opts ...Option) (*Enforcer, func()) {
	t.Helper()
	log := slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	e, err := New(env.cfg, 0, append([]Option{WithLogger(log)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		t0 := time.Now()
		defer func() { t.Logf("enforcer stopped in %v", time.Since(t0)) }()
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Error("Run did not return within 10s of cancel")
		}
	}
	t.Cleanup(stop)
	return e, stop
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(b), "\n"))
	return len(b), nil
}

// eventually polls cond every millisecond until it holds or the deadline
// passes.
func eventually(t testing.TB, within time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !cond() {
		if time.Since(start) > within {
			t.Fatalf("%s: not within %v", what, within)
		}
		time.Sleep(time.Millisecond) // polling interval, not synchronisation
	}
	return time.Since(start)
}

// startSleeper starts a process that lives until killed (a process-tree
// root or container init of tests).
func startSleeper(t testing.TB, attr *syscall.SysProcAttr) *exec.Cmd {
	t.Helper()
	cmd := exec.Command("sleep", "300")
	cmd.SysProcAttr = attr
	if err := cmd.Start(); err != nil {
		t.Skipf("cannot start sleep: %v", err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	return cmd
}

// helper is a re-executed test binary that attaches to a client socket
// when told, prints one line and lives until exit.
type helper struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stdout *bufio.Reader
	line   string
}

func startHelper(t testing.TB, socket string, attr *syscall.SysProcAttr) *helper {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "MGPU_TEST_ROLE="+roleAttach, "MGPU_TEST_SOCKET="+socket)
	cmd.SysProcAttr = attr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Skipf("cannot start helper: %v", err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	return &helper{cmd: cmd, stdin: stdin, stdout: bufio.NewReader(stdout)}
}

// attach tells the helper to attach and returns its line.
func (h *helper) attach(t testing.TB) string {
	t.Helper()
	if _, err := io.WriteString(h.stdin, "go\n"); err != nil {
		t.Fatal(err)
	}
	line, err := h.stdout.ReadString('\n')
	if err != nil {
		t.Fatalf("attach helper: %v", err)
	}
	h.line = strings.TrimSpace(line)
	return h.line
}

func startAttachHelper(t testing.TB, socket string, attr *syscall.SysProcAttr) *helper {
	t.Helper()
	h := startHelper(t, socket, attr)
	h.attach(t)
	return h
}

// startAttachHelperInNS starts a helper as pid 1 of a new pid namespace,
// creates a container instance for it, and lets it attach.
func startAttachHelperInNS(t testing.TB, env *testEnv, c *api.Client) *helper {
	t.Helper()
	h := startHelper(t, api.ClientSocket(env.runDir()), &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID})
	if _, err := c.Create(context.Background(), api.CreateRequest{ContainerID: "ns", PID: h.cmd.Process.Pid, Core: 10, MemoryMiB: 1}); err != nil {
		t.Fatal(err)
	}
	h.attach(t)
	return h
}

// startAttachHelperInCgroup starts a helper, moves it into cgroup dir and
// lets it attach.
func startAttachHelperInCgroup(t testing.TB, env *testEnv, dir string) *helper {
	t.Helper()
	h := startHelper(t, api.ClientSocket(env.runDir()), nil)
	if err := os.WriteFile(dir+"/cgroup.procs", []byte(itoa(h.cmd.Process.Pid)), 0o600); err != nil {
		t.Fatal(err)
	}
	h.attach(t)
	return h
}

func (h *helper) exit() { _ = h.stdin.Close(); _ = h.cmd.Wait() }

func itoa(i int) string { return strconv.Itoa(i) }

func dirBase(p string) string { return filepath.Base(p) }

func layoutOf(mem []byte) *region.Layout { return (*region.Layout)(unsafe.Pointer(&mem[0])) }

// mapAttach maps what an attach returned, like the shim does: the control
// file read-only and the caller's own proc file read-write. It closes the
// result's files.
func mapAttach(t testing.TB, res *attach.Result) (*region.Layout, region.Proc) {
	t.Helper()
	defer res.Close()
	ctl := mapFile(t, res.Control, region.ControlFileSize, unix.PROT_READ)
	own := mapFile(t, res.Own, region.ProcFileSize, unix.PROT_READ|unix.PROT_WRITE)
	l := layoutOf(ctl)
	return l, region.Proc{Slot: &l.Slots[res.Slot], Counters: (*region.Counters)(unsafe.Pointer(&own[0]))}
}

// openRegion maps a region as root on the host (not as a process of the
// instance would): its control file from the run directory, and the slots'
// memfds from the processes that hold them (their owners), as a restarted
// enforcer finds them.
func openRegion(t testing.TB, dir string) *region.Region {
	t.Helper()
	r, err := region.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	var holders []region.Holder
	for i := range region.MaxProcs {
		if pid := int(r.Proc(i).PID.Load()); pid != 0 {
			fd, err := unix.PidfdOpen(pid, 0)
			if err != nil {
				continue
			}
			t.Cleanup(func() { _ = unix.Close(fd) })
			holders = append(holders, region.Holder{PID: pid, PidFD: fd})
		}
	}
	r.Recover(holders)
	return r
}

// claim takes slot i of in for pid as an attach does: the slot gets its
// memfd, then its owner.
func claim(t testing.TB, in *instance, i, pid int) region.Proc {
	t.Helper()
	if err := in.reg.Prepare(i); err != nil {
		t.Fatal(err)
	}
	p := in.reg.Proc(i)
	p.Claim(uint32(pid), 1) //nolint:gosec // a pid
	in.setUsed(i)
	return p
}

func mapFile(t testing.TB, f *os.File, size, prot int) []byte {
	t.Helper()
	mem, err := unix.Mmap(int(f.Fd()), 0, size, prot, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Munmap(mem) })
	return mem
}

// rawRequest sends an HTTP request over the control socket.
func rawRequest(t testing.TB, env *testEnv, method, path, body string) (int, string) {
	t.Helper()
	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true, DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", api.ControlSocket(env.runDir()))
	}}, Timeout: 10 * time.Second}
	req, err := http.NewRequest(method, "http://mgpu"+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// syncBuffer is a log destination several goroutines write to.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// startLogged is start with the enforcer's log (Info and above) captured.
func (env *testEnv) startLogged(t testing.TB, opts ...Option) *syncBuffer {
	t.Helper()
	logs := &syncBuffer{}
	env.start(t, append(opts, WithLogger(slog.New(slog.NewTextHandler(logs, nil))))...)
	return logs
}
