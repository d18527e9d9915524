package hook

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	oci "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/mgpu-dev/mgpu/cdi/cdienv"
	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/kube/agentapi"
)

// bundleParts is what LoadBundle promises to read of a config.json, with
// nil and empty lists alike.
type bundleParts struct {
	HasProcess  bool
	Env         []string
	Mounts      [][2]string // destination, source
	Annotations map[string]string
}

func partsOf(spec *oci.Spec) bundleParts {
	p := bundleParts{HasProcess: spec.Process != nil, Annotations: spec.Annotations}
	if spec.Process != nil && len(spec.Process.Env) > 0 {
		p.Env = spec.Process.Env
	}
	for _, m := range spec.Mounts {
		p.Mounts = append(p.Mounts, [2]string{m.Destination, m.Source})
	}
	if len(p.Annotations) == 0 {
		p.Annotations = nil
	}
	return p
}

// FuzzLoadBundle writes any content as a bundle's config.json. LoadBundle
// either refuses it with one line that names the file, or reads exactly
// what the full OCI spec decoder reads of the parts it uses (whenever that
// decoder accepts the file too), and reads its own re-encoding back the
// same.
func FuzzLoadBundle(f *testing.F) {
	full, _ := json.Marshal(oci.Spec{Version: "1.2.0", Process: &oci.Process{Env: []string{"MGPU_CORE=30", "MGPU_DEVICE_0=GPU-a"}},
		Mounts:      []oci.Mount{{Source: "/run/mgpu/gpu0/client", Destination: "/run/mgpu/gpu0/client", Type: "bind"}},
		Annotations: map[string]string{AnnotationCore: "30", AnnotationSandboxName: "train-0"}})
	for _, s := range []string{
		string(full),
		`{"ociVersion":"1.2.0","process":{"env":["MGPU_CORE=30"]},"annotations":{"a":"b"}}`,
		`{"process":`,
		`{"process":null,"mounts":[],"annotations":{}}` + "\n",
		`{"process":{"env":null,"args":["sh"]},"mounts":[{"destination":"/x"}],"hooks":{"createRuntime":[]}}`,
		`{"Process":{"Env":["A=1"]},"MOUNTS":[{"Source":"/a","destination":"/b","type":7}]}`,
		`{"process":{"env":[1]}}`,
		`{"annotations":{"k":"v"}}{}`,
		`null`, `[]`, `""`, " ", "",
		"{\"annotations\":{\"\xff\":\"\\ud800\"}}",
	} {
		f.Add([]byte(s))
	}
	dir := f.TempDir() // one per worker: the fuzz function runs one input at a time
	f.Fuzz(func(t *testing.T, data []byte) {
		path := filepath.Join(dir, "config.json")
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
		spec, err := LoadBundle(dir)
		if err != nil {
			if spec != nil {
				t.Fatal("a spec returned with an error")
			}
			msg := err.Error()
			if !strings.HasPrefix(msg, path+": ") && !strings.HasPrefix(msg, "read "+path+": ") || strings.ContainsAny(msg, "\r\n") {
				t.Fatalf("error %q is not one line naming %s", msg, path)
			}
			var whole oci.Spec
			if json.Unmarshal(data, &whole) == nil {
				t.Fatalf("refused %q, which the OCI spec decoder reads: %v", data, err)
			}
			return
		}
		if !json.Valid(data) {
			t.Fatalf("accepted invalid JSON %q", data)
		}
		got := partsOf(spec)
		var whole oci.Spec
		if json.Unmarshal(data, &whole) == nil {
			if want := partsOf(&whole); !reflect.DeepEqual(got, want) {
				t.Fatalf("read %q as\n%+v\nthe OCI spec decoder reads\n%+v", data, got, want)
			}
		}
		again, err := json.Marshal(spec)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, again, 0o600); err != nil {
			t.Fatal(err)
		}
		spec2, err := LoadBundle(dir)
		if err != nil {
			t.Fatalf("own encoding %s: %v", again, err)
		}
		if got2 := partsOf(spec2); !reflect.DeepEqual(got, got2) {
			t.Fatalf("round trip changed\n%+v to\n%+v", got, got2)
		}
	})
}

// FuzzRequestedDevices checks, for any environment and mounts, that the
// devices found are exactly the MGPU_DEVICE_X keys, in index order, each
// with its client directory mounted, and that a refusal is a typed error
// of one line that starts with the key it is about.
func FuzzRequestedDevices(f *testing.F) {
	cfg := config.Default()
	cfg.RunDir = "/run/mgpu"
	m := func(x string) string { d := "/run/mgpu/gpu" + x + "/client"; return d + "\t" + d }
	f.Add("PATH=/bin\nMGPU_CORE=30", "")
	f.Add("MGPU_RUN_DIR=/run/mgpu\nMGPU_DEVICE_0=GPU-a", m("0"))
	f.Add("MGPU_DEVICE_10=GPU-c\nMGPU_DEVICE_2=GPU-b\nMGPU_DEVICE_10=GPU-c", m("2")+"\n"+m("10"))
	f.Add("MGPU_RUN_DIR=/run/mgpu/\nMGPU_DEVICE_1=GPU-a", m("1"))
	f.Add("MGPU_DEVICE_1=GPU-b", m("0")+"\n"+m("1"))
	f.Add("MGPU_DEVICE_1=GPU-b", m("0"))
	f.Add("MGPU_DEVICE_0=GPU-b", "/run/mgpu/gpu0/client\t/x")
	f.Add("MGPU_RUN_DIR=/var/run/other\nMGPU_DEVICE_0=GPU-a", m("0"))
	f.Add("MGPU_RUN_DIR=/run/mgpu\nMGPU_RUN_DIR=/run//mgpu\nMGPU_DEVICE_0=GPU-a", m("0"))
	f.Add("MGPU_DEVICE_x=GPU-a", "")
	f.Add("MGPU_DEVICE_01=GPU-a", m("1"))
	f.Add("MGPU_DEVICE_=GPU-a", "")
	f.Add("MGPU_DEVICE_\r\n=GPU-a", "")
	f.Add("MGPU_DEVICE_0=", m("0"))
	f.Add("MGPU_DEVICE_0=GPU-a\nMGPU_DEVICE_0=GPU-b", m("0"))
	f.Add("MGPU_DEVICE_65536=GPU-a", m("65536"))
	f.Add("MGPU_DEVICE_65537=GPU-a", m("65537"))
	f.Add("MGPU_DEVICE_0", m("0"))
	f.Add("MGPU_DEVICE_3=a=b", "/run/mgpu/./gpu3/client/\t//run/mgpu/gpu3/client")
	f.Fuzz(func(t *testing.T, envs, mounts string) {
		spec := &oci.Spec{}
		if envs != "" {
			spec.Process = &oci.Process{Env: strings.Split(envs, "\n")}
		}
		for _, l := range strings.Split(mounts, "\n") {
			src, dst, _ := strings.Cut(l, "\t")
			spec.Mounts = append(spec.Mounts, oci.Mount{Source: src, Destination: dst})
		}
		var env []string
		if spec.Process != nil {
			env = spec.Process.Env
		}
		keys := map[string]bool{} // the MGPU_DEVICE_ keys set
		for _, kv := range env {
			k, _, _ := strings.Cut(kv, "=")
			if strings.HasPrefix(k, cdienv.DevicePrefix) {
				keys[k] = true
			}
		}
		devs, err := RequestedDevices(cfg, spec)
		if err != nil {
			var de *DeviceError
			var ee *EnvError
			if !errors.As(err, &de) && !errors.As(err, &ee) {
				t.Fatalf("error of type %T: %v", err, err)
			}
			msg := err.Error()
			if strings.ContainsAny(msg, "\r\n") {
				t.Fatalf("error of more than one line: %q", msg)
			}
			if !strings.HasPrefix(strings.TrimPrefix(msg, `"`), cdienv.DevicePrefix) && !strings.HasPrefix(msg, cdienv.RunDir+" ") &&
				!strings.HasPrefix(msg, "the container's "+cdienv.RunDir+" ") {
				t.Fatalf("error %q does not start with the key", msg)
			}
			if devs != nil {
				t.Fatal("devices returned with an error")
			}
			return
		}
		if len(keys) == 0 {
			if devs != nil {
				t.Fatalf("devices %+v without a key", devs)
			}
			return
		}
		if len(devs) != len(keys) {
			t.Fatalf("%d devices of %d keys: %+v", len(devs), len(keys), devs)
		}
		mounted := map[[2]string]bool{}
		for _, mt := range spec.Mounts {
			mounted[[2]string{filepath.Clean(mt.Source), filepath.Clean(mt.Destination)}] = true
		}
		for i, d := range devs {
			if i > 0 && devs[i-1].Index >= d.Index {
				t.Fatalf("devices not in index order: %+v", devs)
			}
			if d.Index < 0 || d.Index > maxDeviceIndex || d.UUID == "" {
				t.Fatalf("device %+v out of range", d)
			}
			if !keys[cdienv.DeviceKey(d.Index)] || !slices.Contains(env, cdienv.DeviceKey(d.Index)+"="+d.UUID) {
				t.Fatalf("device %+v is not a key of %q", d, env)
			}
			dir := cdienv.ClientDir(cfg, d.Index)
			if !mounted[[2]string{dir, dir}] {
				t.Fatalf("device %+v accepted without %s mounted", d, dir)
			}
		}
		if v, found, _ := LookupEnv(env, cdienv.RunDir); found && filepath.Clean(v) != cfg.RunDir {
			t.Fatalf("accepted %s=%q", cdienv.RunDir, v)
		}
	})
}

// FuzzPodContainer checks that the four CRI annotations name a container
// only all together, that none of them is no pod container, and that some
// without the others is an error naming exactly the ones missing.
func FuzzPodContainer(f *testing.F) {
	f.Add("team-a", "train-0", "uid-1", "main", uint8(0xf), "x", "y")
	f.Add("", "train-0", "", "", uint8(0xf), "", "")
	f.Add("", "", "", "", uint8(0), "x", "y")
	f.Add("ns", "p", "u", "c", uint8(0x7), AnnotationContainerName, "")
	f.Add("ns\n", "p,q", "u", "c", uint8(0xb), AnnotationSandboxName, "other")
	f.Fuzz(func(t *testing.T, ns, name, uid, ctr string, present uint8, extraKey, extraVal string) {
		keys := []string{AnnotationSandboxNamespace, AnnotationSandboxName, AnnotationSandboxUID, AnnotationContainerName}
		vals := []string{ns, name, uid, ctr}
		ann := map[string]string{}
		if !slices.Contains(keys, extraKey) {
			ann[extraKey] = extraVal
		}
		var missing []string
		for i, k := range keys {
			if present&(1<<i) != 0 {
				ann[k] = vals[i]
			}
			if ann[k] == "" {
				missing = append(missing, k)
			}
		}
		c, ok, err := PodContainer(ann)
		switch {
		case len(missing) == 0:
			want := agentapi.Container{Namespace: ns, Pod: name, UID: uid, Container: ctr}
			if !ok || err != nil || c != want {
				t.Fatalf("all four set: %+v %v %v, want %+v", c, ok, err, want)
			}
		case len(missing) == len(keys):
			if ok || err != nil || c != (agentapi.Container{}) {
				t.Fatalf("none set: %+v %v %v", c, ok, err)
			}
		default:
			if ok || err == nil || c != (agentapi.Container{}) {
				t.Fatalf("some set: %+v %v %v", c, ok, err)
			}
			msg := err.Error()
			list, found := strings.CutPrefix(msg, "the container has CRI annotations but not ")
			list, _, ok2 := strings.Cut(list, "; mgpu cannot tell which pod it is")
			if !found || !ok2 || strings.ContainsAny(msg, "\r\n") || !slices.Equal(strings.Split(list, ", "), missing) {
				t.Fatalf("message %q for missing %v", msg, missing)
			}
		}
	})
}
