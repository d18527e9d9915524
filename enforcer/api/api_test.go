package api

import (
	"errors"
	"strings"
	"testing"
)

func TestDecodeCreateRequest(t *testing.T) {
	t.Parallel()
	r, err := DecodeCreateRequest(strings.NewReader(`{"container_id":"abc","pid":12,"core":30,"memory_mib":4096}`))
	if err != nil || r.Kind != KindContainer || r.PID != 12 || r.Core != 30 || r.MemoryMiB != 4096 {
		t.Fatalf("got %+v, %v", r, err)
	}
	for _, tc := range []struct{ name, body, want string }{
		{"unknown field", `{"container_id":"a","pid":1,"gpus":2}`, `unknown field "gpus"`},
		{"trailing", `{"container_id":"a","pid":1} {}`, "data after"},
		{"no container id", `{"pid":1}`, "container_id is required"},
		{"bad kind", `{"kind":"vm","pid":1}`, `unknown kind "vm"`},
		{"pid", `{"container_id":"a","pid":-1}`, "pid must be"},
		{"space in id", `{"container_id":"a b","pid":1}`, "not printable"},
		{"cgroup relative", `{"container_id":"a","pid":1,"cgroup":"x/y"}`, "clean absolute path"},
		{"cgroup root", `{"container_id":"a","pid":1,"cgroup":"/"}`, "clean absolute path"},
		{"policy", `{"container_id":"a","pid":1,"policy":"x"}`, `unknown compute policy "x"`},
		{"type", `{"container_id":"a","pid":"1"}`, "cannot unmarshal"},
		{"pod without name", `{"container_id":"a","pid":1,"pod":{"namespace":"n","container":"c"}}`, "pod name must be 1 to 253 bytes"},
		{"pod control char", `{"container_id":"a","pid":1,"pod":{"namespace":"n\u0007","name":"p","container":"c"}}`, "pod namespace"},
		{"pod of a process tree", `{"kind":"process-tree","pid":1,"pod":{"namespace":"n","name":"p","container":"c"}}`, "pod is for kind"},
		{"huge", `{"container_id":"` + strings.Repeat("a", MaxRequestBytes) + `"}`, "larger than"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := DecodeCreateRequest(strings.NewReader(tc.body))
			if !errors.Is(err, ErrBadRequest) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err %v, want %q", err, tc.want)
			}
			if strings.Contains(err.Error(), "\n") {
				t.Fatalf("multi-line error %q", err)
			}
		})
	}
}

// A Kubernetes container's pod is accepted and kept.
func TestDecodeCreateRequestPod(t *testing.T) {
	t.Parallel()
	r, err := DecodeCreateRequest(strings.NewReader(`{"container_id":"abc","pid":12,"core":30,"memory_mib":4096,"pod":{"namespace":"ml","name":"train-0","container":"main"}}`))
	if err != nil || r.Pod == nil || *r.Pod != (PodRef{Namespace: "ml", Name: "train-0", Container: "main"}) {
		t.Fatalf("got %+v, %v", r, err)
	}
}

func TestInstanceNames(t *testing.T) {
	t.Parallel()
	if n := InstanceName(1, 12); n != "mgpu1inst12" {
		t.Fatal(n)
	}
	if d, i, err := ParseInstanceName("mgpu1inst12"); err != nil || d != 1 || i != 12 {
		t.Fatalf("%d %d %v", d, i, err)
	}
	for _, bad := range []string{"", "mgpu1", "mgpuinst1", "mgpu01inst1", "mgpu1inst-1", "gpu1inst1", "mgpu1inst1x"} {
		if _, _, err := ParseInstanceName(bad); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
}

// FuzzDecodeCreateRequest: the decoder never panics, and what it accepts
// satisfies Validate's rules.
func FuzzDecodeCreateRequest(f *testing.F) {
	f.Add(`{"container_id":"abc","pid":12,"core":30,"memory_mib":4096}`)
	f.Add(`{"kind":"process-tree","pid":1,"policy":"fixed-share","cgroup":"/a"}`)
	f.Add(`{}`)
	f.Add(`null`)
	f.Fuzz(func(t *testing.T, body string) {
		r, err := DecodeCreateRequest(strings.NewReader(body))
		if err != nil {
			if !errors.Is(err, ErrBadRequest) {
				t.Fatalf("error not ErrBadRequest: %v", err)
			}
			return
		}
		if r.PID <= 0 || (r.Kind != KindContainer && r.Kind != KindProcessTree) || (r.Kind == KindContainer && r.ContainerID == "") {
			t.Fatalf("accepted %+v", r)
		}
	})
}
