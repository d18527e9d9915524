package hook

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	oci "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/internal/config"
)

// fakeEnforcer is an in-memory device: it admits everything, and can be
// told to lose the answer of a create it performed (as a timeout would) or
// to report another start time than the hook read (a reused pid).
type fakeEnforcer struct {
	index     int
	uuid      string
	insts     map[string]api.Instance
	loseReply bool
	startTime uint64 // 0: the request's process's
	proc      Proc
	memoryMiB uint64 // the device's memory

	lastPolicy string      // of the last create
	lastClass  string      // of the last create
	lastPod    *api.PodRef // of the last create
}

func (f *fakeEnforcer) Device(context.Context) (api.DeviceResponse, error) {
	return api.DeviceResponse{Index: f.index, UUID: f.uuid, MemoryMiB: f.memoryMiB}, nil
}

func (f *fakeEnforcer) Create(ctx context.Context, req api.CreateRequest) (api.CreateResponse, error) {
	if req.UUID != f.uuid {
		return api.CreateResponse{}, &api.Error{Status: 409, Message: fmt.Sprintf("device %d is %s, not %s; regenerate the CDI spec (mgpu-cli cdi generate)", f.index, f.uuid, req.UUID)}
	}
	f.lastPolicy = req.Policy
	f.lastClass = req.Class
	f.lastPod = req.Pod
	st := f.startTime
	if st == 0 {
		id, err := f.proc.Identity(req.PID)
		if err != nil {
			return api.CreateResponse{}, &api.Error{Status: 400, Message: err.Error()}
		}
		st = id.StartTime
	}
	in := api.Instance{Name: api.InstanceName(f.index, len(f.insts)), Device: f.index, ContainerID: req.ContainerID,
		Kind: api.KindContainer, PID: req.PID, StartTime: st, Core: req.Core, MemoryMiB: req.MemoryMiB}
	f.insts[in.Name] = in
	if f.loseReply {
		return api.CreateResponse{}, context.DeadlineExceeded
	}
	return api.CreateResponse{Instance: in}, nil
}

func (f *fakeEnforcer) List(context.Context) ([]api.Instance, error) {
	var out []api.Instance
	for _, in := range f.insts {
		out = append(out, in)
	}
	return out, nil
}

func (f *fakeEnforcer) Destroy(_ context.Context, name string) (api.DestroyResponse, error) {
	_, ok := f.insts[name]
	delete(f.insts, name)
	return api.DestroyResponse{Released: ok, Name: name}, nil
}

func fakeNode(t *testing.T, n int) (*config.Config, []*fakeEnforcer, Proc, *oci.State) {
	t.Helper()
	cfg := config.Default()
	cfg.RunDir = "/run/mgpu-test"
	proc := fakeProc(t, 100, statLine(100, 'S', 777), "0::/c\n", "pid:[4026532001]", "pid:[4026531836]")
	var fakes []*fakeEnforcer
	spec := oci.Spec{Process: &oci.Process{Env: []string{"MGPU_CORE=25", "MGPU_MEMORY=512"}}}
	for i := 0; i < n; i++ {
		uuid := "GPU-" + string(rune('a'+i))
		fakes = append(fakes, &fakeEnforcer{index: i, uuid: uuid, insts: map[string]api.Instance{}, proc: proc})
		spec.Process.Env = append(spec.Process.Env, "MGPU_DEVICE_"+string(rune('0'+i))+"="+uuid)
		d := filepath.Join(cfg.DeviceRunDir(i), "client")
		spec.Mounts = append(spec.Mounts, oci.Mount{Source: d, Destination: d})
	}
	bundle := t.TempDir()
	b, _ := json.Marshal(spec)
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), b, 0o600); err != nil {
		t.Fatal(err)
	}
	return cfg, fakes, proc, &oci.State{ID: "c1", Pid: 100, Bundle: bundle}
}

func TestCreateRollsBackAnUncertainCreate(t *testing.T) {
	t.Parallel()
	cfg, fakes, proc, st := fakeNode(t, 3)
	fakes[1].loseReply = true
	h := New(cfg, WithProc(proc), WithEnforcers(func(i int) Enforcer { return fakes[i] }))
	_, err := h.Create(context.Background(), st)
	if err == nil || !strings.HasPrefix(err.Error(), "device 1: the enforcer did not answer in time") {
		t.Fatalf("got %v", err)
	}
	for i, f := range fakes {
		if len(f.insts) != 0 {
			t.Fatalf("device %d kept %v", i, f.insts)
		}
	}
}

func TestCreateDetectsAReusedPid(t *testing.T) {
	t.Parallel()
	cfg, fakes, proc, st := fakeNode(t, 2)
	fakes[1].startTime = 778 // the enforcer saw another process with pid 100
	h := New(cfg, WithProc(proc), WithEnforcers(func(i int) Enforcer { return fakes[i] }))
	_, err := h.Create(context.Background(), st)
	if err == nil || !strings.Contains(err.Error(), "init pid 100 changed while it was admitted") {
		t.Fatalf("got %v", err)
	}
	for i, f := range fakes {
		if len(f.insts) != 0 {
			t.Fatalf("device %d kept %v", i, f.insts)
		}
	}
}

func TestCreateChecksTheDeviceUUID(t *testing.T) {
	t.Parallel()
	cfg, fakes, proc, st := fakeNode(t, 2)
	fakes[1].uuid = "GPU-other"
	h := New(cfg, WithProc(proc), WithEnforcers(func(i int) Enforcer { return fakes[i] }))
	_, err := h.Create(context.Background(), st)
	want := "device 1 is GPU-other, not GPU-b; regenerate the CDI spec (mgpu-cli cdi generate)"
	if err == nil || err.Error() != want {
		t.Fatalf("got %v, want %q", err, want)
	}
	if len(fakes[0].insts)+len(fakes[1].insts) != 0 {
		t.Fatal("instances kept")
	}
}

func TestCreateSameQuotaOnEveryDevice(t *testing.T) {
	t.Parallel()
	cfg, fakes, proc, st := fakeNode(t, 3)
	h := New(cfg, WithProc(proc), WithEnforcers(func(i int) Enforcer { return fakes[i] }))
	got, err := h.Create(context.Background(), st)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 {
		t.Fatalf("admitted %v", got)
	}
	for i, a := range got {
		if a.Device != i || a.Instance.Core != 25 || a.Instance.MemoryMiB != 512 || a.Instance.ContainerID != "c1" {
			t.Fatalf("admitted %+v", a)
		}
	}
	// poststop: the init is gone from the process table.
	if err := os.RemoveAll(filepath.Join(proc.Root, "100")); err != nil {
		t.Fatal(err)
	}
	released, errs := h.Destroy(context.Background(), &oci.State{ID: "c1", Bundle: st.Bundle})
	if len(errs) != 0 || len(released) != 3 {
		t.Fatalf("released %v, errors %v", released, errs)
	}
}

// Destroy and a reused pid: container c1's init (pid 100) exited, and a
// container of another namespace with the same id started with its init at
// pid 100 (start time 888); the enforcer replaced c1's instance with the
// neighbour's. c1's poststop names pid 100: the live init there is not the
// one create recorded in c1's bundle, so the neighbour's instance is kept.
// Before the record, a live init matched by pid alone was released.
func TestDestroyKeepsAnInstanceOfAReusedPid(t *testing.T) {
	t.Parallel()
	cfg, fakes, proc, st := fakeNode(t, 1)
	h := New(cfg, WithProc(proc), WithEnforcers(func(i int) Enforcer { return fakes[i] }))
	if _, err := h.Create(context.Background(), st); err != nil {
		t.Fatal(err)
	}
	if rec, ok := readInitRecord(st.Bundle); !ok || rec.Pid != 100 || rec.StartTime != 777 {
		t.Fatalf("record %+v, %v; want pid 100, start time 777", rec, ok)
	}
	// Pid 100 is now the neighbour's init.
	if err := os.WriteFile(filepath.Join(proc.Root, "100", "stat"), []byte(statLine(100, 'S', 888)), 0o644); err != nil {
		t.Fatal(err)
	}
	fakes[0].insts = map[string]api.Instance{"mgpu0inst1": {Name: "mgpu0inst1", ContainerID: "c1", Kind: api.KindContainer, PID: 100, StartTime: 888}}
	released, errs := h.Destroy(context.Background(), st)
	if len(released) != 0 || len(errs) != 1 || !strings.Contains(errs[0].Error(), `instance mgpu0inst1 of container "c1" kept: its init (pid 100) still runs`) {
		t.Fatalf("released %v, errors %v; want the neighbour's instance kept", released, errs)
	}
	if len(fakes[0].insts) != 1 {
		t.Fatalf("the neighbour's instance was released: %v", fakes[0].insts)
	}
}

// Destroy releases an instance whose init still runs when it is the init
// create recorded (a destroy before the init exits), and, without a
// record, only instances whose init has exited.
func TestDestroyLiveInitNeedsTheRecord(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		noRecord bool
		exited   bool
		released int
	}{
		{name: "recorded init, alive", released: 1},
		{name: "no record, init alive", noRecord: true, released: 0},
		{name: "no record, init exited", noRecord: true, exited: true, released: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg, fakes, proc, st := fakeNode(t, 1)
			h := New(cfg, WithProc(proc), WithEnforcers(func(i int) Enforcer { return fakes[i] }))
			if _, err := h.Create(context.Background(), st); err != nil {
				t.Fatal(err)
			}
			if tc.noRecord {
				if err := os.Remove(filepath.Join(st.Bundle, initRecordName)); err != nil {
					t.Fatal(err)
				}
			}
			if tc.exited {
				if err := os.RemoveAll(filepath.Join(proc.Root, "100")); err != nil {
					t.Fatal(err)
				}
			}
			released, _ := h.Destroy(context.Background(), st)
			if len(released) != tc.released {
				t.Fatalf("released %v, want %d", released, tc.released)
			}
			if _, ok := readInitRecord(st.Bundle); ok && tc.released > 0 {
				t.Error("the record is left after a full release")
			}
		})
	}
}

func TestParseInitRecord(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   string
		want Identity
		ok   bool
	}{
		{"100 777\n", Identity{Pid: 100, StartTime: 777}, true},
		{"100 777", Identity{}, false},
		{"100\n", Identity{}, false},
		{"0 777\n", Identity{}, false},
		{"-1 777\n", Identity{}, false},
		{"100 -7\n", Identity{}, false},
		{"100 777 1\n", Identity{}, false},
		{"x 777\n", Identity{}, false},
		{"", Identity{}, false},
	} {
		if got, ok := parseInitRecord([]byte(tc.in)); got != tc.want || ok != tc.ok {
			t.Errorf("%q: %+v, %v; want %+v, %v", tc.in, got, ok, tc.want, tc.ok)
		}
	}
}

func TestMainTimesOutOnSilentStdin(t *testing.T) {
	t.Parallel()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close(); _ = w.Close() })
	var out, errb strings.Builder
	start := time.Now()
	rc := Main([]string{"mgpu-hook", "--timeout", "200ms", "create"}, r, &out, &errb)
	if rc != exitRefused || !strings.HasPrefix(errb.String(), "mgpu: no OCI state on stdin within the timeout") {
		t.Fatalf("rc %d, stderr %q", rc, errb.String())
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("took %v", took)
	}
	errb.Reset()
	if rc := Main([]string{"mgpu-hook", "--timeout", "200ms", "destroy"}, r, &out, &errb); rc != 0 || !strings.HasPrefix(errb.String(), "mgpu: destroy: no OCI state") {
		t.Fatalf("destroy: rc %d, stderr %q", rc, errb.String())
	}
}

// Not parallel: urfave/cli shares its help flag between apps.
func TestMainUsage(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{}, {"frob"}, {"--nope", "create"}, {"--timeout", "0s", "create"}, {"--timeout", "soon", "create"}, {"create", "extra"}, {"destroy", "--config", "x"}} {
		var out, errb strings.Builder
		rc := Main(append([]string{"mgpu-hook"}, args...), strings.NewReader(""), &out, &errb)
		if rc != exitUsage || !strings.HasPrefix(errb.String(), "mgpu: ") || strings.Count(errb.String(), "\n") != 1 || out.Len() > 0 {
			t.Errorf("%v: rc %d, stdout %q, stderr %q", args, rc, out.String(), errb.String())
		}
	}
	for _, args := range [][]string{{"--help"}, {"-h"}, {"create", "--help"}, {"--config", "/nonexistent", "destroy", "-h"}} {
		var out, errb strings.Builder
		rc := Main(append([]string{"mgpu-hook"}, args...), strings.NewReader(""), &out, &errb)
		if rc != 0 || !strings.Contains(out.String(), "createRuntime") || !strings.Contains(out.String(), "default 5s") || errb.Len() > 0 {
			t.Errorf("%v: rc %d, stdout %q, stderr %q", args, rc, out.String(), errb.String())
		}
	}
}
