package hook

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	oci "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/kube/agentapi"
)

// fakeAgent answers one assignment, or an error, and records the query.
type fakeAgent struct {
	a     agentapi.Assignment
	err   error
	asked []agentapi.Container
}

func (f *fakeAgent) Assignment(_ context.Context, c agentapi.Container) (agentapi.Assignment, error) {
	f.asked = append(f.asked, c)
	if f.err != nil {
		return agentapi.Assignment{}, f.err
	}
	a := f.a
	a.Container = c
	return a, nil
}

var podAnnotations = map[string]string{
	AnnotationSandboxNamespace: "team-a",
	AnnotationSandboxName:      "train-0",
	AnnotationSandboxUID:       "uid-1",
	AnnotationContainerName:    "main",
}

// withAnnotations rewrites the bundle of st with annotations (and, as a
// tenant might, its own mgpu annotations, which must not count).
func withAnnotations(t *testing.T, st *oci.State, ann map[string]string) {
	t.Helper()
	path := filepath.Join(st.Bundle, "config.json")
	data, err := os.ReadFile(path) //nolint:gosec // the test's bundle
	if err != nil {
		t.Fatal(err)
	}
	var spec oci.Spec
	if err := json.Unmarshal(data, &spec); err != nil {
		t.Fatal(err)
	}
	spec.Annotations = ann
	data, _ = json.Marshal(spec)
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
}

func TestPodContainer(t *testing.T) {
	t.Parallel()
	if _, ok, err := PodContainer(map[string]string{"x": "y"}); ok || err != nil {
		t.Fatalf("no CRI annotations: ok %v, err %v", ok, err)
	}
	c, ok, err := PodContainer(podAnnotations)
	if !ok || err != nil || c != (agentapi.Container{Namespace: "team-a", Pod: "train-0", UID: "uid-1", Container: "main"}) {
		t.Fatalf("got %+v %v %v", c, ok, err)
	}
	partial := map[string]string{AnnotationSandboxName: "train-0"}
	if _, _, err := PodContainer(partial); err == nil || !strings.Contains(err.Error(), AnnotationSandboxUID) {
		t.Fatalf("partial: %v", err)
	}
}

func TestCreatePodUsesItsAssignment(t *testing.T) {
	t.Parallel()
	cfg, fakes, proc, st := fakeNode(t, 2) // env says MGPU_CORE=25, MGPU_MEMORY=512
	ann := map[string]string{AnnotationCore: "100", AnnotationMemory: "9999"}
	for k, v := range podAnnotations {
		ann[k] = v
	}
	withAnnotations(t, st, ann)
	agent := &fakeAgent{a: agentapi.Assignment{Policy: "guaranteed-burst-share", Class: "offline", GPUs: []agentapi.GPU{
		{Index: 0, Core: 100, MemoryMiB: 0}, {Index: 1, Core: 100, MemoryMiB: 2048, Claim: "train-0-gpu-x7k2q"},
	}}}
	fakes[0].memoryMiB = 81920
	h := New(cfg, WithProc(proc), WithAgent(agent), WithEnforcers(func(i int) Enforcer { return fakes[i] }))
	got, err := h.Create(context.Background(), st)
	if err != nil {
		t.Fatal(err)
	}
	if len(agent.asked) != 1 || agent.asked[0].UID != "uid-1" || agent.asked[0].Container != "main" {
		t.Fatalf("asked %+v", agent.asked)
	}
	if len(got) != 2 || got[0].Instance.Core != 100 || got[0].Instance.MemoryMiB != 81920 ||
		got[1].Instance.Core != 100 || got[1].Instance.MemoryMiB != 2048 {
		t.Fatalf("admitted %+v", got)
	}
	if p, c := fakes[1].lastPolicy, fakes[1].lastClass; p != "guaranteed-burst-share" || c != "offline" {
		t.Fatalf("policy %q, class %q", p, c)
	}
	// The instance is labelled with its pod container (metrics), and a
	// DRA share with its claim.
	for i, want := range []api.PodRef{{Namespace: "team-a", Name: "train-0", Container: "main"},
		{Namespace: "team-a", Name: "train-0", Container: "main", Claim: "train-0-gpu-x7k2q"}} {
		if p := fakes[i].lastPod; p == nil || *p != want {
			t.Fatalf("device %d: pod %+v, want %+v", i, p, want)
		}
	}
}

func TestCreatePodRefused(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		agent *fakeAgent
		want  string
	}{
		{name: "agent refuses", agent: &fakeAgent{err: &agentapi.Error{Message: "the pod of that name is UID x"}},
			want: `container "main" of pod team-a/train-0: the pod of that name is UID x`},
		{name: "agent down", agent: &fakeAgent{err: agentapi.ErrNotRunning}, want: "mgpu-device-plugin) is not running"},
		{name: "other GPU", agent: &fakeAgent{a: agentapi.Assignment{Policy: "fixed-share", GPUs: []agentapi.GPU{{Index: 1, Core: 30, MemoryMiB: 1}}}},
			want: "has the mgpu devices of GPUs [0], and the kubelet allocated it GPUs [1]"},
		{name: "bad core", agent: &fakeAgent{a: agentapi.Assignment{Policy: "fixed-share", GPUs: []agentapi.GPU{{Index: 0, Core: 0, MemoryMiB: 1}}}},
			want: "the node agent answered core 0"},
		{name: "bad policy", agent: &fakeAgent{a: agentapi.Assignment{Policy: "x", GPUs: []agentapi.GPU{{Index: 0, Core: 5, MemoryMiB: 1}}}},
			want: `the node agent answered policy "x"`},
		{name: "bad class", agent: &fakeAgent{a: agentapi.Assignment{Policy: "fixed-share", Class: "batch", GPUs: []agentapi.GPU{{Index: 0, Core: 5, MemoryMiB: 1}}}},
			want: `the node agent answered class "batch"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg, fakes, proc, st := fakeNode(t, 1)
			withAnnotations(t, st, podAnnotations)
			h := New(cfg, WithProc(proc), WithAgent(tc.agent), WithEnforcers(func(i int) Enforcer { return fakes[i] }))
			_, err := h.Create(context.Background(), st)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want %q", err, tc.want)
			}
			if len(fakes[0].insts) != 0 {
				t.Fatalf("instances %v", fakes[0].insts)
			}
		})
	}
}

func TestCreateNotAPodIgnoresTheAgent(t *testing.T) {
	t.Parallel()
	cfg, fakes, proc, st := fakeNode(t, 1)
	agent := &fakeAgent{err: errors.New("must not be asked")}
	h := New(cfg, WithProc(proc), WithAgent(agent), WithEnforcers(func(i int) Enforcer { return fakes[i] }))
	got, err := h.Create(context.Background(), st)
	if err != nil || len(got) != 1 || got[0].Instance.Core != 25 || len(agent.asked) != 0 || fakes[0].lastPod != nil {
		t.Fatalf("got %+v, %v; asked %v; pod %+v", got, err, agent.asked, fakes[0].lastPod)
	}
}
