package hook_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	oci "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/mgpu-dev/mgpu/cdi"
	"github.com/mgpu-dev/mgpu/enforcer"
	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/hook"
	"github.com/mgpu-dev/mgpu/internal/config"
)

// node is a simulated two-GPU node (packaging/config/sim-node.toml) with
// private run and state directories. Socket paths must stay under 108
// bytes, hence a short temporary directory rather than t.TempDir.
type node struct {
	dir     string
	cfgPath string
	cfg     *config.Config
}

func newNode(t *testing.T) *node {
	t.Helper()
	dir, err := os.MkdirTemp("", "mgpuh")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	data, err := os.ReadFile("../packaging/config/sim-node.toml")
	if err != nil {
		t.Fatal(err)
	}
	s := strings.Replace(string(data), "backend = \"sim\"\n",
		fmt.Sprintf("backend = \"sim\"\nrun_dir = %q\nstate_dir = %q\n", dir+"/run", dir+"/state"), 1)
	n := &node{dir: dir, cfgPath: filepath.Join(dir, "config.toml")}
	if err := os.WriteFile(n.cfgPath, []byte(s), 0o600); err != nil {
		t.Fatal(err)
	}
	if n.cfg, err = config.Parse(n.cfgPath, []byte(s)); err != nil {
		t.Fatal(err)
	}
	return n
}

// startEnforcer runs device index's enforcer in-process until the test ends.
func (n *node) startEnforcer(t *testing.T, index int) {
	t.Helper()
	e, err := enforcer.New(n.cfg, index)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("enforcer %d: %v", index, err)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("enforcer %d did not stop", index)
		}
	})
}

func (n *node) client(index int) *api.Client {
	return api.NewClient(api.ControlSocket(n.cfg.DeviceRunDir(index)))
}

func (n *node) list(t *testing.T, index int) []api.Instance {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	l, err := n.client(index).List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// containerInit starts a process in its own pid namespace, as a container
// runtime does: the container's init.
func containerInit(t *testing.T) *exec.Cmd {
	t.Helper()
	cmd := exec.Command("sleep", "300")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID}
	if err := cmd.Start(); err != nil {
		if errors.Is(err, syscall.EPERM) {
			t.Skipf("cannot create a pid namespace (needs root): %v", err)
		}
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	return cmd
}

// container is a synthetic OCI bundle and state, as the CDI spec and an
// engine would make them for devs with the given annotations and env.
type container struct {
	id    string
	pid   int
	state []byte
}

func (n *node) container(t *testing.T, id string, pid int, devs []int, ann map[string]string, env ...string) container {
	t.Helper()
	bundle := filepath.Join(n.dir, "bundles", id)
	if err := os.MkdirAll(bundle, 0o700); err != nil {
		t.Fatal(err)
	}
	spec := oci.Spec{Version: "1.2.0", Process: &oci.Process{Env: append([]string{"PATH=/bin"}, env...)}, Annotations: ann}
	if len(devs) > 0 {
		spec.Process.Env = append(spec.Process.Env, cdi.EnvRunDir+"="+n.cfg.RunDir)
	}
	for _, d := range devs {
		spec.Process.Env = append(spec.Process.Env, cdi.DeviceEnvKey(d)+"="+n.cfg.Sim.GPUs[d].UUID)
		dir := cdi.ClientDir(n.cfg, d)
		spec.Mounts = append(spec.Mounts, oci.Mount{Source: dir, Destination: dir, Type: "bind", Options: []string{"ro", "bind"}})
	}
	b, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), b, 0o600); err != nil {
		t.Fatal(err)
	}
	st, err := json.Marshal(oci.State{Version: "1.2.0", ID: id, Status: oci.StateCreating, Pid: pid, Bundle: bundle})
	if err != nil {
		t.Fatal(err)
	}
	return container{id: id, pid: pid, state: st}
}

// run runs mgpu-hook verb with the state on stdin and returns its exit
// status and stderr.
func (n *node) run(t *testing.T, c container, args ...string) (int, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	argv := append([]string{"mgpu-hook", "--config", n.cfgPath}, args...)
	rc := hook.Main(argv, bytes.NewReader(c.state), &stdout, &stderr)
	if stdout.Len() > 0 {
		t.Errorf("mgpu-hook %s wrote to stdout: %q", strings.Join(args, " "), stdout.String())
	}
	return rc, stderr.String()
}

func quota(core, mem string) map[string]string {
	return map[string]string{hook.AnnotationCore: core, hook.AnnotationMemory: mem}
}

// instancesOf returns the instances of container id on device index.
func (n *node) instancesOf(t *testing.T, index int, id string) []api.Instance {
	t.Helper()
	var out []api.Instance
	for _, in := range n.list(t, index) {
		if in.ContainerID == id {
			out = append(out, in)
		}
	}
	return out
}

func TestCreateDestroyWithEnforcers(t *testing.T) {
	n := newNode(t)
	n.startEnforcer(t, 0)
	n.startEnforcer(t, 1)

	// A: 30% and 4096 MiB on both GPUs.
	initA := containerInit(t)
	a := n.container(t, "ctr-a", initA.Process.Pid, []int{0, 1}, quota("30", "4096"))
	start := time.Now()
	if rc, stderr := n.run(t, a, "create"); rc != 0 || stderr != "" {
		t.Fatalf("create A: rc %d, stderr %q", rc, stderr)
	}
	t.Logf("create on 2 devices took %v", time.Since(start))
	for d := 0; d < 2; d++ {
		insts := n.instancesOf(t, d, "ctr-a")
		if len(insts) != 1 {
			t.Fatalf("device %d: %d instances of ctr-a, want 1", d, len(insts))
		}
		in := insts[0]
		if in.PID != a.pid || in.Core != 30 || in.MemoryMiB != 4096 || in.Policy != "fixed-share" || in.PidNS == 0 || in.Device != d {
			t.Fatalf("device %d: instance %+v", d, in)
		}
	}

	t.Run("create again is idempotent", func(t *testing.T) {
		if rc, stderr := n.run(t, a, "create"); rc != 0 || stderr != "" {
			t.Fatalf("rc %d, stderr %q", rc, stderr)
		}
		for d := 0; d < 2; d++ {
			if got := len(n.instancesOf(t, d, "ctr-a")); got != 1 {
				t.Fatalf("device %d: %d instances of ctr-a", d, got)
			}
		}
	})

	// Fill device 1 so that it has 20% left while device 0 has 70%.
	other := containerInit(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := n.client(1).Create(ctx, api.CreateRequest{ContainerID: "other", PID: other.Process.Pid, Core: 50, MemoryMiB: 1024}); err != nil {
		t.Fatal(err)
	}

	refusals := []struct {
		name    string
		devs    []int
		ann     map[string]string
		env     []string
		wantErr string
	}{
		{name: "second device refuses, first is rolled back", devs: []int{0, 1}, ann: quota("40", "1024"),
			wantErr: "mgpu: device 1 has 20% compute free under fixed-share (80% allocated), container asks 40%\n"},
		{name: "policy mismatch", devs: []int{0}, env: []string{"MGPU_COMPUTE_POLICY=guaranteed-burst-share", "MGPU_CORE=10", "MGPU_MEMORY=10"},
			wantErr: "mgpu: device 0 runs fixed-share, container asks guaranteed-burst-share\n"},
		{name: "more memory than free", devs: []int{0, 1}, ann: quota("10", "77000"),
			wantErr: "mgpu: device 1 has 76800 MiB memory free (5120 of 81920 MiB allocated), container asks 77000 MiB\n"},
		{name: "core out of range", devs: []int{0, 1}, ann: quota("101", "10"),
			wantErr: "mgpu: vke.volcengine.com/mgpu-core is \"101\"; set it to a percent from 1 to 100\n"},
		{name: "memory with a unit", devs: []int{0}, env: []string{"MGPU_CORE=10", "MGPU_MEMORY=4096MiB"},
			wantErr: "mgpu: MGPU_MEMORY is \"4096MiB\"; set it to a whole number of MiB from 1 to 16777216, without a unit (e.g. 4096)\n"},
		{name: "no quota", devs: []int{1},
			wantErr: "mgpu: the container asks for an mgpu device but sets no compute quota: set vke.volcengine.com/mgpu-core (or MGPU_CORE) to a percent from 1 to 100 and no memory quota: set vke.volcengine.com/mgpu-memory (or MGPU_MEMORY) to a whole number of MiB from 1 to 16777216, without a unit (e.g. 4096)\n"},
	}
	for i, tt := range refusals {
		t.Run(tt.name, func(t *testing.T) {
			init := containerInit(t)
			id := fmt.Sprintf("ctr-refused-%d", i)
			c := n.container(t, id, init.Process.Pid, tt.devs, tt.ann, tt.env...)
			rc, stderr := n.run(t, c, "create")
			if rc == 0 || stderr != tt.wantErr {
				t.Fatalf("rc %d, stderr %q; want non-zero and %q", rc, stderr, tt.wantErr)
			}
			for d := 0; d < 2; d++ {
				if got := n.instancesOf(t, d, id); len(got) != 0 {
					t.Fatalf("device %d kept %+v after a refusal", d, got)
				}
			}
		})
	}

	t.Run("no mgpu device: nothing to do", func(t *testing.T) {
		init := containerInit(t)
		c := n.container(t, "ctr-plain", init.Process.Pid, nil, quota("999", "x"))
		if rc, stderr := n.run(t, c, "create"); rc != 0 || stderr != "" {
			t.Fatalf("rc %d, stderr %q", rc, stderr)
		}
		if rc, stderr := n.run(t, c, "destroy"); rc != 0 || stderr != "" {
			t.Fatalf("destroy: rc %d, stderr %q", rc, stderr)
		}
	})

	t.Run("a live container with the same id is kept", func(t *testing.T) {
		// A poststop for another "ctr-a" whose init is not A's.
		stale := n.container(t, "ctr-a", 0, []int{0, 1}, quota("30", "4096"))
		rc, stderr := n.run(t, stale, "destroy")
		if rc != 0 || !strings.Contains(stderr, "mgpu: destroy ctr-a: device 0: instance mgpu0inst0 of container \"ctr-a\" kept: its init") {
			t.Fatalf("rc %d, stderr %q", rc, stderr)
		}
		for d := 0; d < 2; d++ {
			if got := len(n.instancesOf(t, d, "ctr-a")); got != 1 {
				t.Fatalf("device %d: %d instances of ctr-a", d, got)
			}
		}
	})

	t.Run("destroy releases and is idempotent", func(t *testing.T) {
		for i := 0; i < 2; i++ {
			if rc, stderr := n.run(t, a, "destroy"); rc != 0 || stderr != "" {
				t.Fatalf("destroy #%d: rc %d, stderr %q", i+1, rc, stderr)
			}
			for d := 0; d < 2; d++ {
				if got := n.instancesOf(t, d, "ctr-a"); len(got) != 0 {
					t.Fatalf("destroy #%d: device %d kept %+v", i+1, d, got)
				}
			}
		}
		if got := n.instancesOf(t, 1, "other"); len(got) != 1 {
			t.Fatalf("destroying ctr-a touched another container: %+v", got)
		}
	})

	t.Run("destroy after the init exited, without a bundle", func(t *testing.T) {
		init := containerInit(t)
		c := n.container(t, "ctr-b", init.Process.Pid, []int{0}, quota("10", "10"))
		if rc, stderr := n.run(t, c, "create"); rc != 0 {
			t.Fatalf("create: rc %d, stderr %q", rc, stderr)
		}
		_ = init.Process.Kill()
		_ = init.Wait()
		if err := os.RemoveAll(filepath.Join(n.dir, "bundles", "ctr-b")); err != nil {
			t.Fatal(err)
		}
		if rc, stderr := n.run(t, c, "destroy"); rc != 0 || stderr != "" {
			t.Fatalf("destroy: rc %d, stderr %q", rc, stderr)
		}
		if got := n.instancesOf(t, 0, "ctr-b"); len(got) != 0 {
			t.Fatalf("kept %+v", got)
		}
	})
}

// TestCreateBounded: a device whose enforcer is not running, or never
// answers, fails the create in bounded time with one line, and the instance
// already made on another device is rolled back.
func TestCreateBounded(t *testing.T) {
	n := newNode(t)
	n.startEnforcer(t, 0)
	init := containerInit(t)
	c := n.container(t, "ctr-t", init.Process.Pid, []int{0, 1}, quota("10", "10"))

	rc, stderr := n.run(t, c, "create")
	want := fmt.Sprintf("mgpu: device 1: enforcer is not running (no one listens on %s); start it (systemctl start mgpu-enforcer@1)\n", api.ControlSocket(n.cfg.DeviceRunDir(1)))
	if rc == 0 || stderr != want {
		t.Fatalf("rc %d, stderr %q; want %q", rc, stderr, want)
	}
	if got := n.instancesOf(t, 0, "ctr-t"); len(got) != 0 {
		t.Fatalf("device 0 kept %+v", got)
	}

	// A control socket that accepts and never answers.
	if err := os.MkdirAll(n.cfg.DeviceRunDir(1), 0o755); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("unix", api.ControlSocket(n.cfg.DeviceRunDir(1)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	var held []net.Conn
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			held = append(held, conn) //nolint:staticcheck // kept open, never answered
		}
	}()
	start := time.Now()
	rc, stderr = n.run(t, c, "--timeout", "700ms", "create")
	took := time.Since(start)
	t.Logf("create against a silent enforcer gave up after %v: %s", took, stderr)
	// The create was sent, so the hook also tries to release what the
	// enforcer may have made, and says that it could not.
	lines := strings.Split(strings.TrimSuffix(stderr, "\n"), "\n")
	if rc == 0 || len(lines) != 2 || !strings.HasPrefix(lines[0], "mgpu: rollback: device 1: the enforcer did not answer in time either") ||
		!strings.HasPrefix(lines[1], "mgpu: device 1: the enforcer did not answer in time") {
		t.Fatalf("rc %d, stderr %q", rc, stderr)
	}
	if took > 700*time.Millisecond+hook.RollbackTimeout+500*time.Millisecond {
		t.Fatalf("took %v", took)
	}
	if got := n.instancesOf(t, 0, "ctr-t"); len(got) != 0 {
		t.Fatalf("device 0 kept %+v", got)
	}

	// destroy never fails, even when a device does not answer.
	start = time.Now()
	rc, stderr = n.run(t, c, "--timeout", "700ms", "destroy")
	if rc != 0 || !strings.Contains(stderr, "device 1") {
		t.Fatalf("destroy: rc %d, stderr %q", rc, stderr)
	}
	t.Logf("destroy with a silent enforcer took %v", time.Since(start))
}
