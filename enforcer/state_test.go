package enforcer

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/internal/fsutil"
	"github.com/mgpu-dev/mgpu/internal/policy"
)

func goodState() stateFile {
	return stateFile{
		Version: StateVersion, Device: 0, BootID: "b", Epoch: 3, Policy: policy.GuaranteedBurstShare,
		TimesliceMS: 100, NativeSliceUS: 4096,
		Instances: []stateInstance{{
			Name: "mgpu0inst2", ID: 2, Kind: api.KindContainer, ContainerID: "c", PID: 10, StartTime: 5,
			PidNS: 4026531999, Policy: policy.GuaranteedBurstShare, Core: 30, MemoryMiB: 4096,
			Created: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), ReapedGPUNs: 9,
			Pod: &api.PodRef{Namespace: "ml", Name: "train-0", Container: "main"},
		}},
	}
}

func TestDecodeState(t *testing.T) {
	t.Parallel()
	good := goodState()
	data, err := json.Marshal(&good)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(data), `"policy":"guaranteed-burst-share"`) {
		t.Fatalf("policy not written by name: %s", data)
	}
	s, err := decodeState(data, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Instances) != 1 || s.Instances[0].ReapedGPUNs != 9 || s.Epoch != 3 || s.Instances[0].Pod == nil || s.Instances[0].Pod.Name != "train-0" {
		t.Fatalf("decoded %+v", s)
	}
	for _, tc := range []struct {
		name string
		mod  func(*stateFile)
		want string
	}{
		{"version", func(s *stateFile) { s.Version = 2 }, "version 2"},
		{"device", func(s *stateFile) { s.Device = 1 }, "belongs to device 1"},
		{"name", func(s *stateFile) { s.Instances[0].Name = "mgpu0inst3" }, "does not match id 2"},
		{"duplicate id", func(s *stateFile) { s.Instances = append(s.Instances, s.Instances[0]) }, "duplicate id 2"},
		{"duplicate container", func(s *stateFile) {
			x := s.Instances[0]
			x.ID, x.Name = 3, "mgpu0inst3"
			s.Instances = append(s.Instances, x)
		}, `duplicate container_id "c"`},
		{"core", func(s *stateFile) { s.Instances[0].Core = 0 }, "core 0"},
		{"pod", func(s *stateFile) { s.Instances[0].Pod = &api.PodRef{Namespace: "n", Name: "", Container: "c"} }, "pod name must be"},
		{"memory", func(s *stateFile) { s.Instances[0].MemoryMiB = 0 }, "memory_mib 0"},
		{"kind", func(s *stateFile) { s.Instances[0].Kind = "vm" }, `unknown kind "vm"`},
		{"policy mix", func(s *stateFile) { s.Instances[0].Policy = policy.FixedShare }, "differs from the device's"},
		{"timeslice", func(s *stateFile) { s.TimesliceMS = 0 }, "compute_timeslice_ms 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := goodState()
			s.Instances = append([]stateInstance(nil), s.Instances...)
			tc.mod(&s)
			data, _ := json.Marshal(&s)
			if _, err := decodeState(data, 0); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err %v, want %q", err, tc.want)
			}
		})
	}
	for _, bad := range []string{"", "{", `{"version":1}{}`, `{"version":1,"extra":1}`, `[]`} {
		if _, err := decodeState([]byte(bad), 0); err == nil {
			t.Errorf("%q decoded", bad)
		}
	}
}

func TestWriteFileAtomic(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	for _, v := range []string{"one", "two"} {
		if err := fsutil.WriteFileAtomic(p, []byte(v), 0o600); err != nil {
			t.Fatal(err)
		}
		if b, _ := os.ReadFile(p); string(b) != v {
			t.Fatalf("content %q, want %q", b, v)
		}
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 {
		t.Fatalf("left temporary files: %v", ents)
	}
	if st, _ := os.Stat(p); st.Mode().Perm() != 0o600 {
		t.Fatalf("mode %v", st.Mode())
	}
}

// FuzzDecodeState: the loader never panics, and whatever it accepts is a
// table the enforcer can adopt: ids, names and container ids unique,
// quotas in range; it survives a write and a re-read unchanged.
func FuzzDecodeState(f *testing.F) {
	good := goodState()
	data, _ := json.Marshal(&good)
	f.Add(data)
	f.Add([]byte(`{"version":1,"device":0,"policy":"fixed-share","compute_timeslice_ms":1,"compute_timeslice_native_burst_us":100,"instances":[]}`))
	f.Add([]byte(`{"version":1,"instances":null}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := decodeState(b, 0)
		if err != nil {
			return
		}
		ids := map[int]bool{}
		for _, in := range s.Instances {
			if ids[in.ID] || in.Core < 1 || in.Core > 100 || in.MemoryMiB < 1 || in.Name != api.InstanceName(0, in.ID) {
				t.Fatalf("accepted bad instance %+v", in)
			}
			ids[in.ID] = true
		}
		again, err := json.Marshal(s)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := decodeState(again, 0); err != nil {
			t.Fatalf("re-encoded state rejected: %v", err)
		}
	})
}
