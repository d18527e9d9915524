package deviceplugin

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"unicode"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/mgpu-dev/mgpu/hook"
	"github.com/mgpu-dev/mgpu/internal/policy"
	"github.com/mgpu-dev/mgpu/kube/agentapi"
)

// FuzzParseMemID checks that what ParseMemID accepts is exactly what
// MemID.String writes (and never a core ID too), that every MemID reads
// back, and that a refusal quotes the input.
func FuzzParseMemID(f *testing.F) {
	for _, s := range []string{"mgpu-0-gib-0", "mgpu-1-gib-7", "mgpu-12-gib-16383", "mgpu-0-gib-07", "mgpu-0-gib--1",
		"mgpu--1-gib-0", "mgpu-0-07", "mgpu-0-gib-", "gpu-0-gib-1", "mgpu-0-gib-1x", "mgpu-+1-gib-2", "mgpu-1-gib-9223372036854775808"} {
		f.Add(s, 0, 0)
	}
	f.Add("", 3, 80)
	f.Fuzz(func(t *testing.T, s string, gpu, k int) {
		id, err := ParseMemID(s)
		if err != nil {
			want := fmt.Sprintf("%q is not an %s device ID (want mgpu-<gpu>-gib-<k>)", s, ACKMemory.Core)
			if err.Error() != want || id != (MemID{}) {
				t.Fatalf("ParseMemID(%q) = %+v, %q; want the error %q", s, id, err, want)
			}
		} else {
			if id.String() != s || id.GPU < 0 || id.K < 0 {
				t.Fatalf("ParseMemID(%q) = %+v", s, id)
			}
			if cid, err := ParseID(s); err == nil {
				t.Fatalf("%q is both a memory ID %+v and a core ID %+v", s, id, cid)
			}
		}
		if gpu >= 0 && k >= 0 {
			want := MemID{GPU: gpu, K: k}
			if got, err := ParseMemID(want.String()); err != nil || got != want {
				t.Fatalf("ParseMemID(%q) = %+v, %v", want.String(), got, err)
			}
		}
	})
}

// fuzzContainer is a container "main" whose limits and requests of
// the scheme's resources are the quantities given ("" or not a
// quantity: not set).
func fuzzContainer(s Scheme, coreLim, coreReq, memLim, memReq string) corev1.Container {
	c := corev1.Container{Name: "main", Resources: corev1.ResourceRequirements{Limits: corev1.ResourceList{}, Requests: corev1.ResourceList{}}}
	set := func(l corev1.ResourceList, name corev1.ResourceName, v string) {
		if q, err := resource.ParseQuantity(v); name != "" && err == nil {
			l[name] = q
		}
	}
	set(c.Resources.Limits, s.Core, coreLim)
	set(c.Resources.Requests, s.Core, coreReq)
	set(c.Resources.Limits, s.Memory, memLim)
	set(c.Resources.Requests, s.Memory, memReq)
	return c
}

// used is the quantity of name that counts: the limit, else the request.
func used(c *corev1.Container, name corev1.ResourceName) (int64, bool, bool) {
	q, ok := c.Resources.Limits[name]
	if !ok {
		q, ok = c.Resources.Requests[name]
	}
	if !ok || name == "" {
		return 0, false, false
	}
	v, whole := q.AsInt64()
	return v, true, whole
}

// FuzzRequestOf checks every scheme's reading of any quantities against
// its documented rules: the limit wins over the request, a whole number in
// range is read as it is (memory in MiB), anything else is an error of one
// line that starts with the resource it is about, and a share of one GPU
// needs memory.
func FuzzRequestOf(f *testing.F) {
	for i := range Schemes {
		sc := uint8(i)
		f.Add(sc, "30", "", "4096", "")
		f.Add(sc, "100", "", "", "")
		f.Add(sc, "300", "300", "", "")
		f.Add(sc, "", "", "", "")
		f.Add(sc, "0", "", "1", "")
		f.Add(sc, "150", "", "1", "1")
		f.Add(sc, "500m", "", "1", "")
		f.Add(sc, "30", "", "", "")
		f.Add(sc, "", "", "6", "")
		f.Add(sc, "30", "", "1.5", "")
		f.Add(sc, "30", "", "16385", "")
		f.Add(sc, "", "20", "", "2Ki")
		f.Add(sc, "1025", "", "16777216", "")
		f.Add(sc, "1e3", "9", "1k", "")
		f.Add(sc, "-100", "", "-1", "")
	}
	f.Fuzz(func(t *testing.T, sc uint8, coreLim, coreReq, memLim, memReq string) {
		s := Schemes[int(sc)%len(Schemes)]
		c := fuzzContainer(s, coreLim, coreReq, memLim, memReq)
		core, coreSet, coreWhole := used(&c, s.Core)
		mem, memSet, memWhole := used(&c, s.Memory)
		unit := s.MemoryUnitMiB
		memOK := !memSet || memWhole && mem >= 1 && uint64(mem) <= hook.MaxMemoryMiB/unit
		var coreOK, wantOK bool
		var wantCore int64
		switch {
		case s.Core == "":
			wantOK = memOK
		case s.Whole:
			coreOK = !coreSet || coreWhole && core >= 1 && core <= maxWholeGPUs
			wantOK, wantCore = coreOK, core*IDsPerGPU
			memSet = false // a whole GPU has all its memory
		default:
			coreOK = !coreSet || coreWhole && core >= 1 && (core <= IDsPerGPU || core%IDsPerGPU == 0)
			wantCore = core
			// memory without a core share, or a share of one GPU without memory, is refused
			wantOK = coreOK && memOK && (!memSet || coreSet) && (!coreSet || core >= IDsPerGPU || memSet)
		}
		r, err := s.RequestOf(&c)
		if err != nil {
			msg := err.Error()
			if wantOK {
				t.Fatalf("%s: refused %+v: %v", s.Mode, c.Resources, err)
			}
			if strings.ContainsAny(msg, "\r\n") {
				t.Fatalf("%s: error of more than one line %q", s.Mode, msg)
			}
			aboutCore := s.Core != "" && strings.HasPrefix(msg, string(s.Core)+" ")
			aboutMem := s.Memory != "" && strings.HasPrefix(msg, string(s.Memory)+" ")
			if !aboutCore && !aboutMem {
				t.Fatalf("%s: error %q does not start with the resource", s.Mode, msg)
			}
			return
		}
		if !wantOK {
			t.Fatalf("%s: accepted %+v as %+v", s.Mode, c.Resources, r)
		}
		if coreSet && int64(r.Core) != wantCore || !coreSet && r.Core != 0 {
			t.Fatalf("%s: core read as %d from %+v", s.Mode, r.Core, c.Resources)
		}
		if memSet && r.MemoryMiB != uint64(mem)*unit || !memSet && r.MemoryMiB != 0 || r.MemoryMiB > hook.MaxMemoryMiB {
			t.Fatalf("%s: memory read as %d MiB from %+v", s.Mode, r.MemoryMiB, c.Resources)
		}
	})
}

// FuzzResolve resolves a query about a pod of one container, under any
// scheme, requests, annotations and allocated device IDs. An assignment
// answers the query, on GPUs of the node in order, each exactly the GPU of
// the IDs the kubelet allocated, with the pod's request split over them and
// its policy and class; a refusal is one line.
func FuzzResolve(f *testing.F) {
	join := func(l ...[]string) string { return strings.Join(slices.Concat(l...), ",") }
	add := func(sc uint8, core, mem, pol, class, ids string) {
		f.Add(sc, core, mem, pol, class, ids, "ns", "p", "uid-p", "main")
	}
	// Schemes: 0 mgpu, 1 core_mem, 2 default, 3 topology, 4 cgpu, 5 share, 6 mps.
	add(0, "30", "4096", "guaranteed-burst-share", "", join(ids(1, 0, 30)))
	add(0, "200", "", "", "", join(ids(0, 0, 100), ids(1, 0, 100)))
	add(0, "200", "10000", "native-burst-share", "offline", join(ids(0, 0, 100), ids(1, 0, 100)))
	add(0, "200", "1", "", "", join(ids(0, 0, 100), ids(1, 0, 100)))
	add(0, "30", "4096", "greedy", "", join(ids(0, 0, 30)))
	add(0, "30", "4096", "", "batch", join(ids(0, 0, 30)))
	add(0, "", "", "", "", "")
	add(0, "30", "4096", "", "", join(ids(0, 0, 29)))
	add(0, "30", "4096", "", "", join(ids(0, 0, 15), ids(1, 0, 15)))
	add(0, "30", "4096", "", "", join(ids(0, 0, 29), ids(0, 28, 1)))
	add(0, "100", "", "", "", join(ids(0, 0, 50), ids(1, 0, 50)))
	add(0, "30", "4096", "", "", join(ids(7, 0, 30)))
	add(1, "30", "6", "", "", join(ids(1, 0, 30)))
	add(2, "1", "", "", "", "mgpu-1-00")
	add(2, "2", "", "", "", "mgpu-0-00")
	add(3, "2", "", "", "", "mgpu-0-00,mgpu-1-00")
	add(2, "1", "", "", "", "mgpu-1-05")
	add(4, "", "6", "", "", join(gib(1, 10, 16)))
	add(4, "", "2", "fixed-share", "", join(gib(0, 0, 2)))
	add(4, "", "4", "", "", join(gib(0, 2, 4), gib(1, 0, 2)))
	add(4, "", "2", "", "", join(gib(3, 0, 2)))
	add(5, "", "6", "", "", join(gib(1, 10, 16)))
	f.Add(uint8(0), "30", "4096", "", "", join(ids(1, 0, 30)), "ns", "p", "uid-old", "main")
	f.Add(uint8(0), "30", "4096", "", "", join(ids(1, 0, 30)), "ns", "p", "uid-p", "sidecar")
	f.Add(uint8(0), "30", "4096", "", "", join(ids(1, 0, 30)), "ns", "", "uid-p", "main")
	pols := map[int]policy.Policy{0: policy.NativeBurstShare, 1: policy.GuaranteedBurstShare, 2: policy.FixedShare}
	f.Fuzz(func(t *testing.T, sc uint8, core, mem, pol, class, idList, qns, qpod, quid, qctr string) {
		s := Schemes[int(sc)%len(Schemes)]
		ctr := fuzzContainer(s, core, "", mem, "")
		p := pod("p", "", "", "")
		p.Spec.Containers[0] = ctr
		p.Annotations = map[string]string{}
		if pol != "" {
			p.Annotations[PolicyKey] = pol
		}
		if class != "" {
			p.Annotations[ClassKey] = class
		}
		res := s.Core
		if res == "" {
			res = s.Memory
		}
		var allocated []string
		if idList != "" {
			allocated = strings.Split(idList, ",")
		}
		allocs := &fakeAllocs{allocs: []Allocation{
			{Namespace: "ns", Pod: "p", Container: "main", Resource: res, IDs: allocated},
			{Namespace: "ns", Pod: "p", Container: "sidecar", Resource: res, IDs: ids(0, 50, 50)},
		}}
		gpus := []int{0, 1, 2, 3} // GPU 3's policy is not known
		r := NewResolver("n1", gpus, &fakePods{pods: []corev1.Pod{p}}, allocs)
		r.SetGPUPolicies(pols)
		r.SetScheme(s)
		q := agentapi.Container{Namespace: qns, Pod: qpod, UID: quid, Container: qctr}
		a, err := r.Resolve(context.Background(), q)
		if err != nil {
			// Known gap: the query's names are shown as they are
			// (agentapi.Container.String, %+v); the agent does not check
			// that they are Kubernetes names.
			printable := !strings.ContainsFunc(qns+qpod+quid+qctr, func(r rune) bool { return !unicode.IsPrint(r) })
			if msg := err.Error(); printable && strings.ContainsAny(msg, "\r\n") {
				t.Fatalf("error of more than one line %q", msg)
			}
			return
		}
		if a.Container != q || q != (agentapi.Container{Namespace: "ns", Pod: "p", UID: "uid-p", Container: "main"}) {
			t.Fatalf("answered %+v for the query %+v", a.Container, q)
		}
		if _, err := policy.Parse(a.Policy); err != nil {
			t.Fatalf("policy %q: %v", a.Policy, err)
		}
		if a.Class != class {
			t.Fatalf("class %q, the pod's is %q", a.Class, class)
		}
		req, err := s.RequestOf(&ctr)
		if err != nil {
			t.Fatalf("assigned %+v to a container whose request is refused: %v", a, err)
		}
		// The GPUs of the allocated IDs, each counted once.
		want := map[int]bool{}
		for _, v := range allocated {
			if s.Core == "" {
				id, err := ParseMemID(v)
				if err != nil {
					t.Fatalf("assigned %+v from the allocated %q: %v", a, v, err)
				}
				want[id.GPU] = true
			} else {
				id, err := ParseID(v)
				if err != nil || s.Whole && id.K != 0 {
					t.Fatalf("assigned %+v from the allocated %q: %v", a, v, err)
				}
				want[id.GPU] = true
			}
		}
		var got []int
		var cores int
		var memory uint64
		for _, g := range a.GPUs {
			got = append(got, g.Index)
			cores += g.Core
			memory += g.MemoryMiB
			if g.Core < 1 || g.Core > IDsPerGPU || !slices.Contains(gpus, g.Index) {
				t.Fatalf("GPU %+v out of range", g)
			}
		}
		if !slices.Equal(got, slices.Sorted(maps.Keys(want))) {
			t.Fatalf("GPUs %v, the allocated IDs %q are of %v", got, allocated, slices.Sorted(maps.Keys(want)))
		}
		if s.Core == "" { // cgpu: memory alone, core 1 under the GPU's policy
			g := a.GPUs[0]
			if s.Enforce != EnforceMemory || len(a.GPUs) != 1 || g.Core != cgpuCore || g.MemoryMiB != req.MemoryMiB ||
				uint64(len(allocated))*s.MemoryUnitMiB != req.MemoryMiB || a.Policy != pols[g.Index].String() {
				t.Fatalf("%s: %+v for %+v and IDs %q", s.Mode, a, req, allocated)
			}
			return
		}
		wantPol := DefaultPolicy.String()
		if pol != "" {
			wantPol = pol
		}
		wantIDs := req.Core // one ID per percent, or with Whole per GPU
		if s.Whole {
			wantIDs = req.Core / IDsPerGPU
		}
		if a.Policy != wantPol || cores != req.Core || len(allocated) != wantIDs {
			t.Fatalf("%s: %+v for %+v and IDs %q", s.Mode, a, req, allocated)
		}
		if req.Core < IDsPerGPU {
			if len(a.GPUs) != 1 || memory != req.MemoryMiB {
				t.Fatalf("%s: a share of one GPU as %+v for %+v", s.Mode, a, req)
			}
			return
		}
		for _, g := range a.GPUs {
			if g.Core != IDsPerGPU || g.MemoryMiB != req.MemoryMiB/uint64(len(a.GPUs)) || req.MemoryMiB > 0 && g.MemoryMiB == 0 {
				t.Fatalf("%s: whole GPUs as %+v for %+v", s.Mode, a, req)
			}
		}
	})
}
