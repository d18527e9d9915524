package cdi

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	oci "github.com/opencontainers/runtime-spec/specs-go"
	specs "tags.cncf.io/container-device-interface/specs-go"

	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/device"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/")

// fixture is a node whose spec has a golden file.
type fixture struct {
	name    string
	cfg     *config.Config
	devs    []device.Info
	control []string
	// injectable are the control nodes the injection test can use: the
	// engine stats the nodes whose numbers the spec leaves out, so only
	// those that exist on this host.
	injectable []string
	// major is the character major the GPU nodes must get.
	major int64
}

func simFixture(t *testing.T) fixture {
	t.Helper()
	cfg, err := config.Load("../packaging/config/sim-node.toml")
	if err != nil {
		t.Fatal(err)
	}
	s := device.NewSim(cfg)
	devs, err := s.Devices()
	if err != nil {
		t.Fatal(err)
	}
	return fixture{name: "sim-node", cfg: cfg, devs: devs, control: s.ControlNodes(), injectable: s.ControlNodes(), major: device.SimNodeMajor}
}

// dgxFixture is an 8-GPU DGX A100 (go-nvml's mock) with fixed UUIDs, and
// the control nodes a driver installation has.
func dgxFixture(t *testing.T) fixture {
	t.Helper()
	srv := dgxa100.New()
	for i, d := range srv.Devices {
		d.(*server.Device).UUID = fmt.Sprintf("GPU-a100a100-0000-4000-8000-%012d", i)
	}
	n, err := device.NewNVML(srv)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = n.Close() }()
	devs, err := n.Devices()
	if err != nil {
		t.Fatal(err)
	}
	control := []string{"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}
	return fixture{
		name: "dgxa100", cfg: config.Default(), devs: devs,
		control: control, injectable: existing(control), major: 195,
	}
}

func TestGoldenSpecs(t *testing.T) {
	t.Parallel()
	for _, f := range []fixture{simFixture(t), dgxFixture(t)} {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			spec, err := Generate(f.cfg, f.devs, f.control)
			if err != nil {
				t.Fatal(err)
			}
			if spec.Version != "0.5.0" {
				t.Errorf("cdiVersion = %q, want 0.5.0 (the minimum; podman 4.3 reads at most 0.5.0)", spec.Version)
			}
			if want := 2*len(f.devs) + 1; len(spec.Devices) != want {
				t.Errorf("%d devices, want %d (index, uuid, all)", len(spec.Devices), want)
			}
			for _, format := range []string{FormatYAML, FormatJSON} {
				data, err := Marshal(spec, format)
				if err != nil {
					t.Fatal(err)
				}
				golden := filepath.Join("testdata", f.name+"."+format)
				if *update {
					if err := os.WriteFile(golden, data, 0o644); err != nil {
						t.Fatal(err)
					}
				}
				want, err := os.ReadFile(golden)
				if err != nil {
					t.Fatalf("%v (run go test ./cdi -update)", err)
				}
				if !bytes.Equal(data, want) {
					t.Errorf("%s differs from the generated spec (go test ./cdi -update to accept):\n%s", golden, data)
				}
				if err := Validate(want, format); err != nil {
					t.Errorf("%s: %v", golden, err)
				}
			}
		})
	}
}

// existing keeps the nodes that exist on this host, and nvidiactl, whose
// numbers the spec gives.
func existing(nodes []string) []string {
	var out []string
	for _, n := range nodes {
		if _, err := os.Stat(n); err == nil || n == "/dev/nvidiactl" {
			out = append(out, n)
		}
	}
	return out
}

func TestInject(t *testing.T) {
	t.Parallel()
	for _, f := range []fixture{simFixture(t), dgxFixture(t)} {
		for _, file := range []string{"mgpu.io-gpu.yaml", "mgpu.io-gpu.json"} {
			t.Run(f.name+"/"+file, func(t *testing.T) {
				t.Parallel()
				testInject(t, f, file)
			})
		}
	}
}

func testInject(t *testing.T, f fixture, file string) {
	cfg := f.cfg
	spec, err := Generate(cfg, f.devs, f.injectable, WithConfigPath("/srv/mgpu.toml"))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	path := filepath.Join(dir, file)
	if err := WriteFile(path, spec); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(path); err != nil || st.Mode().Perm() != 0o644 {
		t.Fatalf("spec file: %v, %v (want mode 0644)", st, err)
	}
	reg := Open(dir)
	if errs := reg.Errors(); len(errs) > 0 {
		t.Fatalf("CDI library errors: %v", errs)
	}
	kind := cfg.CDIKind
	uuid := func(i int) string { return f.devs[i].UUID }

	tests := []struct {
		name    string
		devices []string
		gpus    []int // the GPUs the container must get
	}{
		{name: "index", devices: []string{"0"}, gpus: []int{0}},
		{name: "second index", devices: []string{"1"}, gpus: []int{1}},
		{name: "uuid", devices: []string{uuid(1)}, gpus: []int{1}},
		{name: "qualified", devices: []string{kind + "=0"}, gpus: []int{0}},
		{name: "two", devices: []string{"0", "1"}, gpus: []int{0, 1}},
		{name: "all", devices: []string{"all"}, gpus: seq(len(f.devs))},
		{name: "all and one", devices: []string{"0", "all", uuid(0)}, gpus: seq(len(f.devs))},
	}
	for _, tc := range tests {
		s := &oci.Spec{Process: &oci.Process{Env: []string{"PATH=/bin"}}, Linux: &oci.Linux{}}
		if err := reg.Inject(s, kind, tc.devices...); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		checkInjected(t, tc.name, cfg, f, s, tc.gpus)
	}

	// Unknown names: a clear error that says what exists.
	for _, bad := range []string{"9", "GPU-nope", "mgpu.io/other=0"} {
		err := reg.Inject(&oci.Spec{}, kind, bad)
		if err == nil || !strings.Contains(err.Error(), "unknown CDI device") || strings.Contains(err.Error(), "\n") {
			t.Errorf("inject %q: err = %v, want one line about an unknown CDI device", bad, err)
		}
	}
}

func seq(n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = i
	}
	return out
}

func checkInjected(t *testing.T, name string, cfg *config.Config, f fixture, s *oci.Spec, gpus []int) {
	t.Helper()
	// Device nodes: exactly the requested GPUs' nodes, plus nvidiactl.
	var nodes []string
	for _, d := range s.Linux.Devices {
		nodes = append(nodes, d.Path)
		if strings.HasPrefix(d.Path, "/dev/nvidia") && d.Path != "/dev/nvidiactl" && !strings.HasPrefix(d.Path, "/dev/nvidia-") {
			if d.Type != "c" || d.Major != f.major {
				t.Errorf("%s: node %s is %s %d:%d, want c %d:_", name, d.Path, d.Type, d.Major, d.Minor, f.major)
			}
		}
	}
	var want []string
	for _, g := range gpus {
		want = append(want, fmt.Sprintf("/dev/nvidia%d", f.devs[g].Minor))
	}
	want = append(want, "/dev/nvidiactl")
	for _, w := range want {
		if !slices.Contains(nodes, w) {
			t.Errorf("%s: device node %s missing from %v", name, w, nodes)
		}
	}
	for _, n := range nodes {
		if strings.HasPrefix(n, "/dev/nvidia") && !strings.HasPrefix(n, "/dev/nvidia-") && !slices.Contains(want, n) {
			t.Errorf("%s: device node %s not requested", name, n)
		}
	}
	if len(s.Linux.Resources.Devices) == 0 {
		t.Errorf("%s: no device cgroup rules", name)
	}

	// Mounts: the requested GPUs' client directories, the shim and the
	// preload file, all read-only; nothing else of the run directory.
	mounts := map[string]oci.Mount{}
	for _, m := range s.Mounts {
		if _, dup := mounts[m.Destination]; dup {
			t.Errorf("%s: %s mounted twice", name, m.Destination)
		}
		mounts[m.Destination] = m
		if !slices.Contains(m.Options, "ro") || m.Type != "bind" {
			t.Errorf("%s: mount %s: type %q options %v, want a read-only bind", name, m.Destination, m.Type, m.Options)
		}
		if strings.HasPrefix(m.Source, cfg.RunDir+"/") && !strings.HasPrefix(m.Source, cfg.RunDir+"/sim/") {
			if filepath.Base(m.Source) != "client" {
				t.Errorf("%s: mounts %s from the run directory; only client/ directories may be", name, m.Source)
			}
		}
	}
	for _, g := range gpus {
		dir := ClientDir(cfg, f.devs[g].Index)
		if m, ok := mounts[dir]; !ok || m.Source != dir {
			t.Errorf("%s: client directory %s not mounted (%v)", name, dir, mounts[dir])
		}
	}
	if len(mounts) != len(gpus)+2 {
		t.Errorf("%s: %d mounts, want %d", name, len(mounts), len(gpus)+2)
	}
	if m := mounts[ShimPath(cfg)]; m.Source != ShimPath(cfg) {
		t.Errorf("%s: shim mount = %+v", name, m)
	}
	if m := mounts["/etc/ld.so.preload"]; m.Source != PreloadPath(cfg) {
		t.Errorf("%s: /etc/ld.so.preload mount = %+v", name, m)
	}

	// Hooks: one createRuntime and one poststop, whatever was requested.
	h := s.Hooks
	if h == nil || len(h.CreateRuntime) != 1 || len(h.Poststop) != 1 {
		t.Fatalf("%s: hooks = %+v, want one createRuntime and one poststop", name, h)
	}
	for _, c := range []struct {
		hook oci.Hook
		verb string
	}{{h.CreateRuntime[0], "create"}, {h.Poststop[0], "destroy"}} {
		if c.hook.Path != HookPath(cfg) || !slices.Equal(c.hook.Args, []string{"mgpu-hook", c.verb}) ||
			c.hook.Timeout == nil || *c.hook.Timeout != HookTimeout || !slices.Equal(c.hook.Env, []string{"MGPU_CONFIG=/srv/mgpu.toml"}) {
			t.Errorf("%s: %s hook = %+v", name, c.verb, c.hook)
		}
	}

	// Env: the run directory and one key per requested GPU.
	env := s.Process.Env
	wantEnv := []string{"PATH=/bin", EnvRunDir + "=" + cfg.RunDir}
	for _, g := range gpus {
		wantEnv = append(wantEnv, DeviceEnvKey(f.devs[g].Index)+"="+f.devs[g].UUID)
	}
	slices.Sort(env)
	slices.Sort(wantEnv)
	if !slices.Equal(env, wantEnv) {
		t.Errorf("%s: env = %v, want %v", name, env, wantEnv)
	}
}

func TestGenerateWithoutHooks(t *testing.T) {
	t.Parallel()
	f := simFixture(t)
	spec, err := Generate(f.cfg, f.devs, f.control, WithoutHooks())
	if err != nil {
		t.Fatal(err)
	}
	if len(spec.ContainerEdits.Hooks) != 0 {
		t.Errorf("hooks = %v, want none", spec.ContainerEdits.Hooks)
	}
	for _, d := range spec.Devices {
		if len(d.ContainerEdits.Hooks) != 0 {
			t.Errorf("device %s has hooks", d.Name)
		}
	}
}

func TestGenerateErrors(t *testing.T) {
	t.Parallel()
	f := simFixture(t)
	noNodes := append([]device.Info(nil), f.devs...)
	noNodes[1].Nodes = nil
	dupUUID := append([]device.Info(nil), f.devs...)
	dupUUID[1].UUID = dupUUID[0].UUID
	for _, tc := range []struct {
		name string
		devs []device.Info
		want string
	}{
		{name: "no GPUs", devs: nil, want: "no GPUs found (backend sim): nothing to put in a CDI spec"},
		{name: "no node", devs: noNodes, want: "GPU 1 (" + f.devs[1].UUID + ") has no device node"},
		{name: "duplicate uuid", devs: dupUUID, want: "GPU 1: duplicate index or uuid"},
	} {
		_, err := Generate(f.cfg, tc.devs, f.control)
		if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: err = %v, want one line containing %q", tc.name, err, tc.want)
		}
	}
	if _, err := Generate(f.cfg, nil, nil); !errors.Is(err, ErrNoGPUs) {
		t.Errorf("no GPUs: %v is not ErrNoGPUs", err)
	}
}

func TestWriteFileErrors(t *testing.T) {
	t.Parallel()
	f := simFixture(t)
	spec, err := Generate(f.cfg, f.devs, f.control)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	notDir := filepath.Join(dir, "file")
	if err := os.WriteFile(notDir, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{filepath.Join(notDir, "spec.yaml"), filepath.Join(dir, "missing", "spec.yaml")} {
		err := WriteFile(p, spec)
		if err == nil || !strings.HasPrefix(err.Error(), "write "+p+": ") || strings.Contains(err.Error(), "\n") {
			t.Errorf("WriteFile(%s) = %v, want one line naming the file", p, err)
		}
	}
	// The CDI library's own checks run before anything is written.
	bad := *spec
	bad.Kind = "no-class"
	p := filepath.Join(dir, "bad.yaml")
	if err := WriteFile(p, &bad); err == nil || !strings.Contains(err.Error(), "CDI library rejects the spec") {
		t.Errorf("invalid spec: err = %v", err)
	}
	if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("an invalid spec was written: %v", err)
	}
}

// The per-device env keys are distinct: the CDI library keeps only the last
// value of a key set by two devices.
func TestDeviceEnvKeysDistinct(t *testing.T) {
	t.Parallel()
	f := dgxFixture(t)
	spec, err := Generate(f.cfg, f.devs, nil)
	if err != nil {
		t.Fatal(err)
	}
	keys := map[string]string{}
	for _, d := range spec.Devices {
		if d.Name == AllDevices {
			continue
		}
		for _, e := range d.ContainerEdits.Env {
			k, _, _ := strings.Cut(e, "=")
			if other, ok := keys[k]; ok && !sameGPU(spec, other, d.Name) {
				t.Errorf("devices %s and %s both set %s", other, d.Name, k)
			}
			keys[k] = d.Name
		}
	}
}

func sameGPU(spec *specs.Spec, a, b string) bool {
	edits := func(n string) []string {
		for _, d := range spec.Devices {
			if d.Name == n {
				return d.ContainerEdits.Env
			}
		}
		return nil
	}
	return slices.Equal(edits(a), edits(b))
}
