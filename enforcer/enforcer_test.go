package enforcer

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/enforcer/attach"
	"github.com/mgpu-dev/mgpu/enforcer/procfs"
	"github.com/mgpu-dev/mgpu/enforcer/region"
	"golang.org/x/sys/unix"
)

var ctx = context.Background()

func tree(pid, core int, mem uint64) api.CreateRequest {
	return api.CreateRequest{Kind: api.KindProcessTree, PID: pid, Core: core, MemoryMiB: mem}
}

func TestRunDirectoryLayout(t *testing.T) {
	env := newEnv(t, nil)
	env.start(t)
	for _, c := range []struct {
		path string
		mode os.FileMode
	}{
		{env.runDir() + "/control.sock", os.ModeSocket | 0o600},
		{env.runDir() + "/regions", os.ModeDir | 0o700},
		{env.runDir() + "/client", os.ModeDir | 0o755},
		{env.runDir() + "/client/client.sock", os.ModeSocket | 0o666},
	} {
		st, err := os.Stat(c.path)
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode() != c.mode {
			t.Errorf("%s: mode %v, want %v", c.path, st.Mode(), c.mode)
		}
	}
	// A second enforcer for the same device refuses to start.
	_, err := New(env.cfg, 0)
	if !errors.Is(err, ErrRunning) || !strings.Contains(err.Error(), "device 0 is served by pid") {
		t.Fatalf("second enforcer: %v", err)
	}
}

func TestCreateListDestroy(t *testing.T) {
	env := newEnv(t, nil)
	env.start(t)
	c := env.client()
	out, err := c.Create(ctx, tree(os.Getpid(), 30, 4096))
	if err != nil {
		t.Fatal(err)
	}
	in := out.Instance
	if in.Name != "mgpu0inst0" || in.Kind != api.KindProcessTree || in.Core != 30 || in.MemoryMiB != 4096 || in.Policy != "fixed-share" || out.Existing {
		t.Fatalf("created %+v", out)
	}
	st, _ := procfs.Host.Stat(os.Getpid())
	if in.StartTime != st.StartTime {
		t.Fatalf("start time %d, want %d", in.StartTime, st.StartTime)
	}
	r, err := region.Open(in.Region)
	if err != nil {
		t.Fatal(err)
	}
	p := r.Params()
	r.Close()
	if p.DeviceIndex != 0 || p.InstanceID != 0 || p.Core != 30 || p.MemoryLimit != 4096<<20 || p.PeriodNs != 100e6 || p.Policy != region.PolicyFixedShare || p.MaxQueuedNs == 0 {
		t.Fatalf("region header %+v", p)
	}
	out2, err := c.Create(ctx, tree(os.Getpid(), 20, 1024))
	if err != nil || out2.Instance.Name != "mgpu0inst1" {
		t.Fatalf("second: %+v %v", out2, err)
	}
	list, err := c.List(ctx)
	if err != nil || len(list) != 2 || list[0].Name != "mgpu0inst0" || list[1].Name != "mgpu0inst1" {
		t.Fatalf("list %+v %v", list, err)
	}
	dev, err := c.Device(ctx)
	if err != nil || dev.Instances != 2 || dev.CoreSum != 50 || dev.CoreFree != 50 || dev.MemoryAllocatedMiB != 5120 || dev.MemoryFreeMiB != 81920-5120 {
		t.Fatalf("device %+v %v", dev, err)
	}
	got, err := c.Get(ctx, "mgpu0inst1")
	if err != nil || got.Core != 20 {
		t.Fatalf("get %+v %v", got, err)
	}
	var ae *api.Error
	if _, err := c.Get(ctx, "mgpu0inst9"); !errors.As(err, &ae) || ae.Status != 404 {
		t.Fatalf("get missing: %v", err)
	}
	d, err := c.Destroy(ctx, "mgpu0inst0")
	if err != nil || !d.Released {
		t.Fatalf("destroy %+v %v", d, err)
	}
	if _, err := os.Stat(in.Region); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("region still there: %v", err)
	}
	d, err = c.Destroy(ctx, "mgpu0inst0")
	if err != nil || d.Released {
		t.Fatalf("second destroy %+v %v", d, err)
	}
	// Y is reused after release: the lowest free id.
	out3, err := c.Create(ctx, tree(os.Getpid(), 10, 10))
	if err != nil || out3.Instance.Name != "mgpu0inst0" {
		t.Fatalf("reuse: %+v %v", out3, err)
	}
	stats, err := c.Stats(ctx)
	if err != nil || len(stats) != 2 || stats[0].MemoryLimitBytes != 10<<20 {
		t.Fatalf("stats %+v %v", stats, err)
	}
}

func TestAdmissionRefusals(t *testing.T) {
	env := newEnv(t, func(s string) string {
		return withMaxInstances(3)(withPolicy("guaranteed-burst-share")(s))
	})
	env.start(t)
	c := env.client()
	if _, err := c.Create(ctx, tree(os.Getpid(), 60, 80000)); err != nil {
		t.Fatal(err)
	}
	pid := os.Getpid()
	dev, err := c.Device(ctx)
	if err != nil {
		t.Fatal(err)
	}
	withUUID := func(r api.CreateRequest, uuid string) api.CreateRequest { r.UUID = uuid; return r }
	for _, tc := range []struct {
		name   string
		req    api.CreateRequest
		status int
		want   string
	}{
		{"other gpu", withUUID(tree(pid, 10, 1), "GPU-other"), 409, "device 0 is " + dev.UUID + ", not GPU-other; regenerate the CDI spec (mgpu-cli cdi generate)"},
		{"bad uuid", withUUID(tree(pid, 10, 1), "GPU 1"), 400, `bad request: uuid "GPU 1" has a character that is not printable`},
		{"policy", api.CreateRequest{Kind: api.KindContainer, ContainerID: "c1", PID: pid, Policy: "fixed-share", Core: 10, MemoryMiB: 1},
			409, "device 0 runs guaranteed-burst-share, container asks fixed-share"},
		{"policy process tree", api.CreateRequest{Kind: api.KindProcessTree, PID: pid, Policy: "native-burst-share", Core: 10, MemoryMiB: 1},
			409, "device 0 runs guaranteed-burst-share, process tree asks native-burst-share"},
		{"core sum", tree(pid, 50, 1), 409, "device 0 has 40% compute free under guaranteed-burst-share (60% allocated), process tree asks 50%"},
		{"memory sum", tree(pid, 10, 2000), 409, "device 0 has 1920 MiB memory free (80000 of 81920 MiB allocated), process tree asks 2000 MiB"},
		{"core zero", tree(pid, 0, 1), 409, "core 0 is outside 1..100 (percent of device 0's time)"},
		{"core high", tree(pid, 101, 1), 409, "core 101 is outside 1..100 (percent of device 0's time)"},
		{"memory zero", tree(pid, 10, 0), 409, "memory must be at least 1 MiB, process tree asks 0"},
		{"unknown policy", api.CreateRequest{Kind: api.KindProcessTree, PID: pid, Policy: "greedy", Core: 10, MemoryMiB: 1},
			400, `bad request: unknown compute policy "greedy" (want fixed-share, guaranteed-burst-share or native-burst-share)`},
		{"no pid", tree(0, 10, 1), 400, "bad request: pid must be a host pid (1..4194304), got 0"},
		{"dead pid", tree(1<<22, 10, 1), 400, "pid 4194304 does not exist or has exited"},
		{"container in host namespaces", api.CreateRequest{ContainerID: "c2", PID: pid, Core: 10, MemoryMiB: 1},
			409, "container c2 (pid " + itoa(pid) + ") shares the enforcer's pid namespace and cgroup, so its processes cannot be told from the host's; run it in its own pid namespace or cgroup"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := c.Create(ctx, tc.req)
			var ae *api.Error
			if !errors.As(err, &ae) {
				t.Fatalf("err %v, want *api.Error", err)
			}
			if ae.Status != tc.status || err.Error() != tc.want {
				t.Fatalf("got %d %q\nwant %d %q", ae.Status, err.Error(), tc.status, tc.want)
			}
		})
	}
	if _, err := c.Create(ctx, withUUID(tree(pid, 10, 1), dev.UUID)); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Create(ctx, tree(pid, 10, 1)); err != nil {
		t.Fatal(err)
	}
	_, err = c.Create(ctx, tree(pid, 10, 1))
	if want := "device 0 already has 3 instances, the most it admits (max_instances = 3)"; err == nil || err.Error() != want {
		t.Fatalf("max instances: %v, want %q", err, want)
	}
	// Refusals left nothing behind.
	if dev, _ := c.Device(ctx); dev.Instances != 3 || dev.CoreSum != 80 {
		t.Fatalf("device after refusals %+v", dev)
	}
}

func TestNativeBurstAdmitsOverHundred(t *testing.T) {
	env := newEnv(t, withPolicy("native-burst-share"))
	env.start(t)
	c := env.client()
	for range 3 {
		if _, err := c.Create(ctx, tree(os.Getpid(), 60, 1)); err != nil {
			t.Fatal(err)
		}
	}
	if dev, _ := c.Device(ctx); dev.CoreSum != 180 || dev.CoreFree != 0 || dev.PolicyCode != 2 {
		t.Fatalf("device %+v", dev)
	}
}

func TestBadControlRequests(t *testing.T) {
	env := newEnv(t, nil)
	env.start(t)
	hc := env.client()
	_ = hc
	for _, tc := range []struct {
		name, method, path, body string
		status                   int
	}{
		{"unknown field", "POST", "/v1/instances", `{"pid":1,"core":1,"memory_mib":1,"gpu":3}`, 400},
		{"two objects", "POST", "/v1/instances", `{"kind":"process-tree","pid":1,"core":1,"memory_mib":1}{}`, 400},
		{"not json", "POST", "/v1/instances", `pid=1`, 400},
		{"too large", "POST", "/v1/instances", `{"container_id":"` + strings.Repeat("a", api.MaxRequestBytes) + `"}`, 400},
		{"unknown path", "GET", "/v2/instances", ``, 404},
		{"destroy without id", "DELETE", "/v1/instances", ``, 400},
		{"bad name", "DELETE", "/v1/instances/gpu0", ``, 400},
	} {
		t.Run(tc.name, func(t *testing.T) {
			status, body := rawRequest(t, env, tc.method, tc.path, tc.body)
			if status != tc.status || !strings.HasPrefix(body, `{`) || !strings.Contains(body, `"error"`) {
				t.Fatalf("got %d %s, want %d with a JSON error", status, body, tc.status)
			}
		})
	}
}

func TestAttach(t *testing.T) {
	env := newEnv(t, nil)
	env.start(t)
	c := env.client()
	out, err := c.Create(ctx, tree(os.Getpid(), 40, 2048))
	if err != nil {
		t.Fatal(err)
	}
	res, err := attach.Dial(api.ClientSocket(env.runDir()), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if res.ControlSize != region.ControlFileSize || res.ProcSize != region.ProcFileSize || res.DeviceIndex != 0 || res.InstanceID != uint32(out.Instance.ID) {
		t.Fatalf("response %+v", res.Response)
	}
	l, p := mapAttach(t, res)
	if l.Magic != region.Magic || l.Core != 40 || l.MemoryLimit != 2048<<20 || l.InstanceID != 0 {
		t.Fatalf("header %+v", l)
	}
	st, _ := procfs.Host.Stat(os.Getpid())
	if p.PID.Load() != uint32(os.Getpid()) || p.StartTime.Load() != st.StartTime {
		t.Fatalf("slot %d: pid %d start %d", res.Slot, p.PID.Load(), p.StartTime.Load())
	}
	stats, _ := c.Stats(ctx)
	if len(stats[0].Processes) != 1 || stats[0].Processes[0].PID != os.Getpid() {
		t.Fatalf("stats %+v", stats)
	}
	if in, _ := c.Get(ctx, "mgpu0inst0"); in.Processes != 1 {
		t.Fatalf("processes %d", in.Processes)
	}
	// Attaching again (a new process image after exec) starts the slot
	// over: same slot, counters folded into the instance.
	p.GPUNs.Store(5000)
	p.MemReserved.Store(1 << 20)
	res2, err := attach.Dial(api.ClientSocket(env.runDir()), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	res2.Close()
	if res2.Slot != res.Slot || p.MemReserved.Load() != 0 || p.PID.Load() != uint32(os.Getpid()) {
		t.Fatalf("re-attach: slot %d (was %d), mem %d", res2.Slot, res.Slot, p.MemReserved.Load())
	}
	if stats, _ := c.Stats(ctx); stats[0].GPUNs != 5000 {
		t.Fatalf("gpu ns after re-attach %d, want 5000", stats[0].GPUNs)
	}
}

func TestAttachRefusesStrangers(t *testing.T) {
	env := newEnv(t, nil)
	env.start(t)
	c := env.client()
	// An instance rooted at another process: the test process is not in
	// its tree.
	sl := startSleeper(t, nil)
	if _, err := c.Create(ctx, tree(sl.Process.Pid, 40, 2048)); err != nil {
		t.Fatal(err)
	}
	_, err := attach.Dial(api.ClientSocket(env.runDir()), 5*time.Second)
	var re *attach.RefusedError
	if !errors.As(err, &re) || re.Status != attach.NoInstance {
		t.Fatalf("err %v, want NO_INSTANCE", err)
	}
	want := "mgpu: pid " + itoa(os.Getpid()) + " belongs to no mgpu instance on device 0; start it with mgpu-cli run or in a container with --device mgpu.io/gpu=0"
	if err.Error() != want {
		t.Fatalf("message %q\nwant %q", err.Error(), want)
	}
}

func TestAttachMalformed(t *testing.T) {
	env := newEnv(t, nil)
	env.start(t)
	if _, err := env.client().Create(ctx, tree(os.Getpid(), 40, 2048)); err != nil {
		t.Fatal(err)
	}
	sock := api.ClientSocket(env.runDir())
	// A shim of protocol 1 (one writable region file) is refused in its
	// own response layout, with a message that says what to do.
	old := attach.Request{Magic: attach.Magic, Version: 1}.Marshal()
	_, err := attach.DialRequest(sock, old[:], 5*time.Second)
	var re *attach.RefusedError
	want := "mgpu: bad attach request: the shim speaks attach protocol 1, this enforcer speaks 2: install the libmgpu-shim.so of the enforcer's release"
	if !errors.As(err, &re) || re.Status != attach.BadRequest || err.Error() != want {
		t.Fatalf("version 1: %v\nwant %s", err, want)
	}
	conn, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Write(old[:]); err != nil {
		t.Fatal(err)
	}
	raw, err := io.ReadAll(conn)
	conn.Close()
	if err != nil || len(raw) != attach.ResponseSize || raw[4] != 1 {
		t.Fatalf("reply to a version 1 request: %d bytes, version byte %v, %v", len(raw), raw[4:5], err)
	}
	bad := attach.Request{Magic: attach.Magic, Version: 7}.Marshal()
	if _, err = attach.DialRequest(sock, bad[:], 5*time.Second); !errors.As(err, &re) || re.Status != attach.BadRequest || !strings.Contains(err.Error(), "protocol 7") {
		t.Fatalf("bad version: %v", err)
	}
	// A short request, then silence: the server closes the connection at
	// its deadline and keeps serving others meanwhile.
	_, err = attach.DialRequest(sock, []byte{1, 2, 3}, 300*time.Millisecond)
	if err == nil {
		t.Fatal("short request answered")
	}
	res, err := attach.Dial(sock, 5*time.Second)
	if err != nil {
		t.Fatalf("after malformed requests: %v", err)
	}
	res.Close()
}

func TestReapDeadProcessAndInstance(t *testing.T) {
	env := newEnv(t, nil)
	env.start(t)
	c := env.client()
	// The instance's root is a sleeper; the attaching helper runs as a
	// child of it? No: the helper is a child of the test process, so the
	// instance is rooted at the test process here and at the sleeper below.
	if _, err := c.Create(ctx, tree(os.Getpid(), 40, 2048)); err != nil {
		t.Fatal(err)
	}
	h := startAttachHelper(t, api.ClientSocket(env.runDir()), nil)
	if !strings.HasPrefix(h.line, "ok slot=") {
		t.Fatalf("helper: %s", h.line)
	}
	stats, _ := c.Stats(ctx)
	if len(stats[0].Processes) != 1 || stats[0].Processes[0].PID != h.cmd.Process.Pid {
		t.Fatalf("stats %+v", stats)
	}
	_ = h.cmd.Process.Signal(syscall.SIGKILL)
	_ = h.cmd.Wait()
	took := eventually(t, 2*time.Second, "dead process's slot reaped", func() bool {
		s, _ := c.Stats(ctx)
		return len(s) == 1 && len(s[0].Processes) == 0
	})
	t.Logf("slot reaped %v after the process died", took)

	// A process-tree instance whose root exits is released.
	sl := startSleeper(t, nil)
	if _, err := c.Create(ctx, tree(sl.Process.Pid, 10, 1)); err != nil {
		t.Fatal(err)
	}
	_ = sl.Process.Kill()
	_ = sl.Wait()
	took = eventually(t, 2*time.Second, "instance of a dead root released", func() bool {
		l, _ := c.List(ctx)
		return len(l) == 1
	})
	t.Logf("instance released %v after its root died", took)
}

// corruptStateEnv is an environment whose device 0 has a state file cut
// short, and that file's bytes.
func corruptStateEnv(t *testing.T) (*testEnv, []byte) {
	t.Helper()
	env := newEnv(t, nil)
	if err := os.MkdirAll(env.cfg.DeviceStateDir(0), 0o700); err != nil {
		t.Fatal(err)
	}
	bad := []byte(`{"version":1,"device":0,"instances":[`)
	if err := os.WriteFile(env.statePath(), bad, 0o600); err != nil {
		t.Fatal(err)
	}
	return env, bad
}

// A state file cut short by a machine crash (it is written without fsync)
// is from before the boot: it is moved aside and the device starts empty.
func TestCorruptStateFromBeforeBootIsSetAside(t *testing.T) {
	env, bad := corruptStateEnv(t)
	boot := readBootTime()
	if boot.IsZero() {
		t.Skip("no btime in /proc/stat")
	}
	old := boot.Add(-time.Hour)
	if err := os.Chtimes(env.statePath(), old, old); err != nil {
		t.Fatal(err)
	}
	e, err := New(env.cfg, 0)
	if err != nil {
		t.Fatalf("a corrupt state file from before the boot refused the start: %v", err)
	}
	defer e.Close()
	if got, _ := os.ReadFile(env.statePath() + ".before-boot"); string(got) != string(bad) {
		t.Fatalf("set aside: %q", got)
	}
	if len(e.List()) != 0 {
		t.Fatalf("instances %v", e.List())
	}
	st, err := loadState(env.statePath(), 0)
	if err != nil || st == nil {
		t.Fatalf("the new state file: %+v %v", st, err)
	}
}

func TestCorruptStateRefusesStart(t *testing.T) {
	env, bad := corruptStateEnv(t)
	_, err := New(env.cfg, 0)
	var ce *CorruptStateError
	if !errors.As(err, &ce) {
		t.Fatalf("err %v, want CorruptStateError", err)
	}
	msg := err.Error()
	if strings.Contains(msg, "\n") || !strings.Contains(msg, env.statePath()) || !strings.Contains(msg, "move it aside") {
		t.Fatalf("message %q", msg)
	}
	if got, _ := os.ReadFile(env.statePath()); string(got) != string(bad) {
		t.Fatal("the corrupt state file was changed")
	}
	// The lock was released: once the file is moved aside, it starts.
	if err := os.Rename(env.statePath(), env.statePath()+".bad"); err != nil {
		t.Fatal(err)
	}
	e, err := New(env.cfg, 0)
	if err != nil {
		t.Fatal(err)
	}
	e.Close()
}

func TestSameContainerTwice(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root for a new pid namespace")
	}
	env := newEnv(t, nil)
	env.start(t)
	c := env.client()
	init := startSleeper(t, &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID})
	req := api.CreateRequest{ContainerID: "abc", PID: init.Process.Pid, Core: 30, MemoryMiB: 1024}
	first, err := c.Create(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if first.Instance.PidNS == 0 || first.Existing {
		t.Fatalf("first %+v", first)
	}
	again, err := c.Create(ctx, req)
	if err != nil || !again.Existing || again.Instance.Name != first.Instance.Name {
		t.Fatalf("again %+v %v", again, err)
	}
	req.Core = 50
	if _, err := c.Create(ctx, req); err == nil || err.Error() != "container abc already has instance mgpu0inst0 with core 30, memory 1024 MiB" {
		t.Fatalf("different quota: %v", err)
	}
	if l, _ := c.List(ctx); len(l) != 1 {
		t.Fatalf("list %+v", l)
	}
	d, err := c.DestroyContainer(ctx, "abc")
	if err != nil || !d.Released || d.Name != "mgpu0inst0" {
		t.Fatalf("destroy %+v %v", d, err)
	}
	if d, err := c.DestroyContainer(ctx, "abc"); err != nil || d.Released {
		t.Fatalf("destroy again %+v %v", d, err)
	}
}

// TestContainerByPidNamespace: a process in the container's pid namespace
// gets the container's region; the host process does not.
func TestContainerByPidNamespace(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root for a new pid namespace")
	}
	env := newEnv(t, nil)
	env.start(t)
	c := env.client()
	if _, err := c.Create(ctx, tree(os.Getpid(), 10, 1)); err != nil { // mgpu0inst0: the test's own tree
		t.Fatal(err)
	}
	// The helper is pid 1 of a new pid namespace: the container's init.
	// It waits for the instance before attaching: start it, create the
	// instance for its host pid, then let it attach.
	h := startAttachHelperInNS(t, env, c)
	if h.line != "ok slot=0 instance=1" {
		t.Fatalf("container process: %q, want its container's instance 1", h.line)
	}
	h.exit()
	eventually(t, 2*time.Second, "container instance released after its init exited", func() bool {
		l, _ := c.List(ctx)
		return len(l) == 1 && l[0].Name == "mgpu0inst0"
	})
}

func TestContainerByCgroup(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root for cgroups")
	}
	base := "/sys/fs/cgroup/unified"
	if _, err := os.Stat(base + "/cgroup.procs"); err != nil {
		base = "/sys/fs/cgroup"
	}
	dir, err := os.MkdirTemp(base, "mgpu-test")
	if err != nil {
		t.Skipf("cannot create a cgroup: %v", err)
	}
	defer os.Remove(dir)
	env := newEnv(t, nil)
	env.start(t)
	c := env.client()
	// A "container" in the host pid namespace, in its own cgroup.
	init := startSleeper(t, nil)
	if err := os.WriteFile(dir+"/cgroup.procs", []byte(itoa(init.Process.Pid)), 0o600); err != nil {
		t.Skipf("cannot move a process into %s: %v", dir, err)
	}
	out, err := c.Create(ctx, api.CreateRequest{ContainerID: "cg", PID: init.Process.Pid, Core: 10, MemoryMiB: 1})
	if err != nil {
		t.Fatal(err)
	}
	if out.Instance.PidNS != 0 || !strings.HasSuffix(out.Instance.Cgroup, "/"+dirBase(dir)) {
		t.Fatalf("instance %+v", out.Instance)
	}
	// The helper joins the cgroup before it attaches (its parent writes its
	// pid), so it is started stopped by a pipe: use a sleeper-like wait.
	h := startAttachHelperInCgroup(t, env, dir)
	if h.line != "ok slot=0 instance=0" {
		t.Fatalf("process in the container's cgroup: %q", h.line)
	}
	h.exit()
	_ = init.Process.Kill()
	_ = init.Wait()
	eventually(t, 2*time.Second, "cgroup container released", func() bool {
		l, _ := c.List(ctx)
		return len(l) == 0
	})
}

// TestSlotCannotBeResized: a process that tries to shrink or grow its own
// slot (its descriptor is writable) is refused (EPERM: the slot is a
// sealed memfd): the enforcer's mapping keeps its size, so it never
// faults, and nothing reaches the host's file systems. The enforcer keeps
// serving every instance, this one included.
func TestSlotCannotBeResized(t *testing.T) {
	env := newEnv(t, nil)
	env.start(t)
	c := env.client()
	if _, err := c.Create(ctx, tree(os.Getpid(), 40, 2048)); err != nil {
		t.Fatal(err)
	}
	sl := startSleeper(t, nil)
	if _, err := c.Create(ctx, tree(sl.Process.Pid, 10, 10)); err != nil {
		t.Fatal(err)
	}
	res, err := attach.Dial(api.ClientSocket(env.runDir()), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Close()
	fd := int(res.Own.Fd()) //nolint:gosec // fds fit in int
	for what, err := range map[string]error{
		"ftruncate to 64 MiB": unix.Ftruncate(fd, 64<<20),
		"ftruncate to 100":    unix.Ftruncate(fd, 100),
		"ftruncate to 0":      unix.Ftruncate(fd, 0),
		"fallocate 64 MiB":    unix.Fallocate(fd, 0, 0, 64<<20),
	} {
		if !errors.Is(err, unix.EPERM) {
			t.Errorf("%s: %v, want EPERM", what, err)
		}
	}
	if st, err := res.Own.Stat(); err != nil || st.Size() != region.ProcFileSize {
		t.Fatalf("the slot's size after the attempts: %v, %v", st, err)
	}
	if _, err := c.Stats(ctx); err != nil { // touches every slot
		t.Fatal(err)
	}
	if l, err := c.List(ctx); err != nil || len(l) != 2 || l[0].Processes != 1 {
		t.Fatalf("instances after the attempts: %+v, %v", l, err)
	}
}

// TestSlotFaultReleasesInstance: the one fault left (a process punched a
// hole in its slot and the kernel cannot back the page again: strict
// overcommit at its limit) is made here by mapping an empty file over the
// enforcer's mapping of the slot. The enforcer's next access faults; the
// guard releases that instance only, and the enforcer keeps serving.
func TestSlotFaultReleasesInstance(t *testing.T) {
	env := newEnv(t, nil)
	e, _ := env.start(t)
	c := env.client()
	if _, err := c.Create(ctx, tree(os.Getpid(), 40, 2048)); err != nil {
		t.Fatal(err)
	}
	sl := startSleeper(t, nil)
	if _, err := c.Create(ctx, tree(sl.Process.Pid, 10, 10)); err != nil {
		t.Fatal(err)
	}
	res, err := attach.Dial(api.ClientSocket(env.runDir()), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Close()
	empty, err := os.Create(filepath.Join(t.TempDir(), "empty"))
	if err != nil {
		t.Fatal(err)
	}
	defer empty.Close()
	e.mu.Lock()
	addr := uintptr(unsafe.Pointer(e.byID[0].reg.Proc(int(res.Slot)).Counters))
	_, _, errno := unix.Syscall6(unix.SYS_MMAP, addr, region.ProcFileSize, unix.PROT_READ|unix.PROT_WRITE,
		unix.MAP_SHARED|unix.MAP_FIXED, empty.Fd(), 0)
	e.mu.Unlock()
	if errno != 0 {
		t.Fatal(errno)
	}
	e.kickLoop()
	eventually(t, 5*time.Second, "the instance released", func() bool {
		l, err := c.List(ctx)
		return err == nil && len(l) == 1 && l[0].Name == "mgpu0inst1"
	})
	if _, err := c.Stats(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestAttachedFilesAreReadOnly: of what an attach hands out, only the
// caller's own proc file can be written; the control file (grant, quotas)
// and the other slots' files cannot be made writable by a root process,
// by any route it has.
func TestAttachedFilesAreReadOnly(t *testing.T) {
	env := newEnv(t, nil)
	env.start(t)
	if _, err := env.client().Create(ctx, tree(os.Getpid(), 40, 2048)); err != nil {
		t.Fatal(err)
	}
	res, err := attach.Dial(api.ClientSocket(env.runDir()), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Close()
	sock := api.ClientSocket(env.runDir())
	// A second process of the instance (a child of this one) attaches; the
	// first asks for its peers' files.
	h := startHelper(t, sock, nil)
	if line := h.attach(t); !strings.HasPrefix(line, "ok slot=1 ") {
		t.Fatalf("helper: %s", line)
	}
	peers, err := attach.Peers(sock, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if len(peers) != 1 || peers[1] == nil {
		t.Fatalf("peers %v, want slot 1 only", peers)
	}
	defer peers[1].Close()
	h.exit()
	for name, f := range map[string]*os.File{"control": res.Control, "another slot": peers[1]} {
		if _, err := unix.Mmap(int(f.Fd()), 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); !errors.Is(err, unix.EACCES) {
			t.Errorf("%s: mmap writable: %v, want EACCES", name, err)
		}
	}
	if fd, err := unix.Open("/proc/self/fd/"+itoa(int(res.Control.Fd())), unix.O_RDWR, 0); !errors.Is(err, unix.EROFS) {
		if err == nil {
			unix.Close(fd)
		}
		t.Errorf("control: reopen for writing: %v, want EROFS", err)
	}
	// Another slot is a memfd, in no read-only mount: root reopens it for
	// writing (docs/tenants.md), but cannot resize it.
	fd, err := unix.Open("/proc/self/fd/"+itoa(int(peers[1].Fd())), unix.O_RDWR, 0)
	if err != nil {
		t.Fatalf("another slot: reopen for writing as root: %v", err)
	}
	if err := unix.Ftruncate(fd, 0); !errors.Is(err, unix.EPERM) {
		t.Errorf("another slot, reopened: ftruncate: %v, want EPERM", err)
	}
	unix.Close(fd)
	own := mapFile(t, res.Own, region.ProcFileSize, unix.PROT_READ|unix.PROT_WRITE)
	own[8] = 1 // mem_reserved: the own slot is writable
	// A process that is not attached gets no peers.
	cmd := exec.Command(os.Args[0], "-test.run=^TestPeersOfAStranger$", "-test.v")
	cmd.Env = append(os.Environ(), "MGPU_TEST_PEERS_SOCKET="+sock)
	out, err := cmd.CombinedOutput()
	if err == nil && !strings.Contains(string(out), "--- PASS: TestPeersOfAStranger") {
		err = errors.New("did not run")
	}
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
}

// TestPeersOfAStranger runs (as a child of TestAttachedFilesAreReadOnly,
// so inside an instance, but not attached) when MGPU_TEST_SOCKET is set: a
// process that is not attached is refused the peers' files.
func TestPeersOfAStranger(t *testing.T) {
	sock := os.Getenv("MGPU_TEST_PEERS_SOCKET")
	if sock == "" {
		t.Skip("run by TestAttachedFilesAreReadOnly")
	}
	_, err := attach.Peers(sock, 5*time.Second)
	var re *attach.RefusedError
	if !errors.As(err, &re) || re.Status != attach.NoInstance || !strings.Contains(err.Error(), "is not attached") {
		t.Fatalf("peers of a process that is not attached: %v", err)
	}
}
